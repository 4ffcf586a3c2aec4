"""Pre-flight check of a draft directory against a target: a fitting draft passes, each kind of mismatch is
rejected with its own message. Drafts are real exports (save_draft) of tiny drafts, edited the way a wrong
checkpoint would look."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from conftest import tiny_draft
from eagle3_core.evaluation.preflight import PreflightError, check_draft, preflight
from eagle3_core.training.checkpoint import save_draft

# the target the tiny draft was built for: hidden 32, 8 layers, vocab 100
TARGET = LlamaConfig(hidden_size=32, num_hidden_layers=8, vocab_size=100, max_position_embeddings=256,
                     num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)


@pytest.fixture
def draft_dir(tmp_path):
    return save_draft(tiny_draft(), tmp_path / "draft")


def _edit(path, config=None, drop=(), tensors=None):
    if config:
        cfg = json.loads((path / "config.json").read_text())
        config(cfg)
        (path / "config.json").write_text(json.dumps(cfg))
    if drop or tensors:
        t = load_file(str(path / "model.safetensors"))
        for k in drop:
            del t[k]
        t.update(tensors or {})
        save_file(t, str(path / "model.safetensors"))


def _only(problems, field):
    assert [f for f, _ in problems] == [field], problems
    return problems[0][1]


def test_fitting_draft_passes(draft_dir):
    assert check_draft(draft_dir, TARGET) == []
    preflight(draft_dir, TARGET)


def test_eagle2_draft_without_fc_is_rejected(draft_dir):
    _edit(draft_dir, config=lambda c: c.update(architectures=["LlamaForCausalLMEagle"]), drop=["fc.weight"])
    msg = _only(check_draft(draft_dir, TARGET), "architectures")
    assert "EAGLE(-2) draft" in msg and "no fc layer" in msg and "--speculative-algorithm EAGLE" in msg


def test_wrong_layer_ids_are_rejected(draft_dir):
    _edit(draft_dir, config=lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 3, 7]))
    msg = _only(check_draft(draft_dir, TARGET), "eagle_config.eagle_aux_hidden_state_layer_ids")
    assert "[0, 6] for a target with 8 layers" in msg and "out of range: [7]" in msg


def test_wrong_hidden_size_is_rejected(draft_dir):
    other = LlamaConfig(**{**TARGET.to_dict(), "hidden_size": 64})
    msg = _only(check_draft(draft_dir, other), "hidden_size")
    assert "target hidden size 32" in msg and "hidden_size is 64" in msg


def test_missing_d2t_is_rejected(draft_dir):
    _edit(draft_dir, drop=["d2t"])
    msg = _only(check_draft(draft_dir, TARGET), "d2t")
    assert msg.startswith("missing from model.safetensors")


def test_d2t_out_of_range_is_rejected(draft_dir):
    d2t = load_file(str(draft_dir / "model.safetensors"))["d2t"].clone()
    d2t[7] = 200                                                        # draft id 7 -> target id 207 >= V = 100
    _edit(draft_dir, tensors={"d2t": d2t})
    msg = _only(check_draft(draft_dir, TARGET), "d2t")
    assert "outside the target vocab [0, 100)" in msg and "draft id 7 -> 207" in msg


def test_d2t_holding_target_ids_instead_of_offsets_is_rejected(draft_dir):
    _edit(draft_dir, tensors={"d2t": torch.arange(0, 100, 2)})         # target ids, the classic mistake
    msg = _only(check_draft(draft_dir, TARGET), "d2t")
    assert "offsets" in msg


def test_vocab_and_context_mismatches_and_all_reported_together(draft_dir):
    other = LlamaConfig(**{**TARGET.to_dict(), "vocab_size": 120, "max_position_embeddings": 4096})
    problems = check_draft(draft_dir, other)
    assert [f for f, _ in problems] == ["vocab_size", "max_position_embeddings"]
    with pytest.raises(PreflightError, match=r"(?s)vocab_size: is 100.*max_position_embeddings: is 256"):
        preflight(draft_dir, other)


def test_missing_directory_is_named(tmp_path):
    msg = _only(check_draft(tmp_path / "nothing", TARGET), "config.json")
    assert str(tmp_path / "nothing") in msg
