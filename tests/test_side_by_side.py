"""The SpecForge side by side feeds SpecForge's trainer what SpecForge's own pipeline feeds it: inputs and teacher
shifted left by one (its TargetHead.preprocess), so that its draft learns the pairs (f_t, x_{t+1}) our verify loop
feeds; and its model with our weights gives our step-0 logits. Real SpecForge 0.2.0 (PyPI, --no-deps)."""
import sys

import pytest
import torch
from conftest import ROOT, tiny_draft

sys.path.insert(0, str(ROOT / "benchmarks"))
from specforge_side_by_side import check_step0_alignment, specforge_draft, specforge_inputs  # noqa: E402


def _batch(T: int = 9):
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, 100, (1, T), generator=g), "valid": torch.ones(1, T, dtype=torch.bool),
            "loss_mask": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 0]], dtype=torch.bool),
            "aux": torch.randn(1, T, 96, generator=g), "final": torch.randn(1, T, 32, generator=g)}


@pytest.fixture(scope="module")
def specforge_loaded():
    """SpecForge's modeling imported and its draft run once: the first call pays ~7 s of imports and first-use op
    setup on 2 cores (9.3 s of the first test's 10 s budget, conftest.FAST_TEST_S), a fixture's cost, not the test's;
    later calls take milliseconds."""
    b, d = _batch(), tiny_draft()
    check_step0_alignment(specforge_draft(d).eval(), d, b, specforge_inputs(b))


def test_specforge_gets_shifted_inputs_and_matches_our_step0_logits(specforge_loaded):
    b, d = _batch(), tiny_draft()
    kw = specforge_inputs(b)
    assert torch.equal(kw["input_ids"][0, :-1], b["input_ids"][0, 1:]) and kw["input_ids"][0, -1] == 0
    assert torch.equal(kw["target_hidden_for_compact"][0, :-1], b["final"][0, 1:])
    assert torch.equal(kw["hidden_states"], b["aux"]) and torch.equal(kw["loss_mask"][..., 0], b["loss_mask"].long())
    model = specforge_draft(d).eval()
    assert check_step0_alignment(model, d, b, kw) < 1e-5


def test_unshifted_inputs_are_caught(specforge_loaded):
    """The harness's first GPU run fed SpecForge unshifted ids: (f_t, x_t) -> z_t. The check refuses that."""
    b, d = _batch(), tiny_draft()
    kw = {**specforge_inputs(b), "input_ids": b["input_ids"]}
    with pytest.raises(AssertionError, match="misaligned"):
        check_step0_alignment(specforge_draft(d).eval(), d, b, kw)
