"""The training loop on a tiny draft: loss goes down, resume equals an uninterrupted run, NaN stops cleanly."""
import pytest
import torch
from conftest import tiny_draft

from eagle3_core.config import TrainConfig
from eagle3_core.trainer import train


def _samples(n=12, T=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, 100, (T,), generator=g)
        mask = torch.zeros(T, dtype=torch.bool)
        mask[T // 2:] = True
        out.append({"id": f"s{i}", "input_ids": ids, "loss_mask": mask, "aux": torch.randn(T, 96, generator=g),
                    "final": torch.randn(T, 32, generator=g), "target_top1": torch.roll(ids, -1) // 2 * 2})
    return out


CFG = TrainConfig(epochs=2, lr=3e-3, batch_tokens=80, ttt_length=3, warmup_frac=0.1)


def test_resume_equals_uninterrupted_run(tmp_path):
    lm_head = torch.randn(100, 32, generator=torch.Generator().manual_seed(5))
    data = _samples()
    a = tiny_draft()
    full = train(a, data, data[:4], lm_head, CFG, tmp_path / "a", log=lambda s: None)
    assert full["history"][-1]["train"]["loss"][0] < full["history"][0]["train"]["loss"][0] * 1.5
    b = tiny_draft()
    train(b, data, data[:4], lm_head, CFG, tmp_path / "b", log=lambda s: None, stop_after_epochs=1)
    c = tiny_draft()                                     # a fresh process: weights come from the training state
    said = []
    train(c, data, data[:4], lm_head, CFG, tmp_path / "b", log=said.append)
    assert any("resumed after epoch 0" in s for s in said)
    for (name, p), q in zip(a.state_dict().items(), c.state_dict().values()):
        assert torch.allclose(p, q, atol=1e-6), name


def test_non_finite_loss_names_the_step_and_saves_nothing(tmp_path):
    data = _samples()
    data[3]["aux"][0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"epoch 0, step \d+, batch \d+"):
        train(tiny_draft(), data, [], torch.randn(100, 32), CFG, tmp_path, log=lambda s: None)
    assert not (tmp_path / "training_state.pt").exists() and not (tmp_path / "last").exists()
