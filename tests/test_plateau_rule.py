"""train.epochs unset: the plateau rule (eagle3_core.training.stopping) on scripted scores, and through train() on
the tiny draft: it stops at a plateau after its decay, respects the epoch and wall-time ceilings, exports the best
epoch, falls back to the fixed rule when too few tokens are held out, and a resumed run decides the same."""
import math

import pytest
import torch

from conftest import tiny_draft
from eagle3_core.config import TrainConfig
from eagle3_core.training import stopping, trainer
from eagle3_core.training.checkpoint import load_draft
from eagle3_core.training.stopping import MIN_EVAL_TOKENS, PlateauRule, eval_tokens, expected_epochs
from train_worker import CFG, samples

LM_HEAD = torch.randn(100, 32, generator=torch.Generator().manual_seed(5))
RISE_THEN_FLAT = [2.0, 2.4, 2.7, 2.9, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]
# smoothed: 2.0 2.3 2.65 2.875 2.9375 2.944 (+0.006: 1 epoch without a rise) 2.922 (2: plateau at 7, decay
# ceil(0.2 x 7) = 2 epochs) 2.911 2.906: stopped after epoch 9; the best raw score is epoch 4's 3.1
PEAK = [2.0, 2.6, 3.0, 3.1, 3.0, 2.95, 2.9, 2.9, 2.9]


def run_rule(rule: PlateauRule, scores, seconds=1.0) -> int:
    for e, s in enumerate(scores, 1):
        rule.update(e, s, seconds)
        if rule.stop(e):
            return e
    return len(scores)


def test_plateau_starts_the_decay_and_the_run_ends_with_it():
    rule = PlateauRule(max_epochs=24)
    end = run_rule(rule, RISE_THEN_FLAT)
    # smoothed (EMA 0.5): 2.0 2.2 2.45 2.675 2.8375 2.919 2.959 2.980 2.990 2.995: rises of >= 0.01 until epoch 8
    # (2.980 - 2.959 = 0.0203), then 2.990 (+0.0102 > 0.01 from 2.980: best) and 2.995 (+0.005): 1 epoch without,
    # then 2.9976 (+0.0076 from 2.990): 2 epochs without a rise at epoch 11 -> plateau, decay ceil(0.2 x 11) = 3
    assert (rule.reason, rule.decay_start, rule.decay_epochs) == ("plateau", 11, 3)
    assert end == rule.stopped_at == 14


def test_still_rising_runs_to_the_epoch_ceiling_with_a_full_decay():
    rule = PlateauRule(max_epochs=24)
    end = run_rule(rule, [1.0 + 0.1 * e for e in range(40)])
    # one more stable epoch after 20 would need 21 + ceil(0.2 x 21) = 26 > 24 epochs: the decay starts at 20
    assert (rule.reason, rule.decay_start, rule.decay_epochs, end) == ("max_epochs", 20, 4, 24)
    tiny = PlateauRule(max_epochs=1)
    assert run_rule(tiny, [1.0, 2.0]) == 1 and tiny.reason == "max_epochs"


def test_the_wall_time_ceiling_starts_the_decay_in_time_and_stops_past_it():
    rule = PlateauRule(max_epochs=100, max_train_s=100.0)
    end = run_rule(rule, [1.0 + 0.1 * e for e in range(40)], seconds=10.0)
    # at 7 epochs (70 s) one more epoch and its decay (ceil(0.2 x 8) = 2) need 30 s, 30 left: go on; at 8 (80 s)
    # 1 + 2 epochs need 30 s, 20 left: the decay starts, 2 epochs, ending at 100 s
    assert (rule.reason, rule.decay_start, rule.decay_epochs, end) == ("max_train_s", 8, 2, 10)
    assert rule.seconds() == 100.0
    late = PlateauRule(max_epochs=100, max_train_s=25.0)
    # the first epoch (it compiles) took 30 s: past the ceiling, stop at once
    assert run_rule(late, [1.0, 2.0, 3.0], seconds=30.0) == 1 and late.reason == "max_train_s"


def test_lr_schedule_is_warmup_stable_then_cosine_to_the_floor():
    rule = PlateauRule(max_epochs=24)
    assert rule.lr_factor(0, 10, 4) == 0.25 and rule.lr_factor(3, 10, 4) == 1.0
    assert rule.lr_factor(500, 10, 4) == 1.0                       # no decay decided: stable
    rule.decay_start, rule.decay_epochs = 10, 2                      # decay over steps 100..120
    assert rule.lr_factor(100, 10, 4) == 1.0
    assert math.isclose(rule.lr_factor(110, 10, 4), 0.1 + 0.9 * 0.5)
    assert math.isclose(rule.lr_factor(120, 10, 4), 0.1) and math.isclose(rule.lr_factor(999, 10, 4), 0.1)


def test_state_round_trips_and_decides_the_same():
    a, b = PlateauRule(max_epochs=24), PlateauRule(max_epochs=24)
    run_rule(a, RISE_THEN_FLAT[:6])
    b.load_state_dict(torch.load(_saved(a.state_dict()), weights_only=True))
    for e, s in enumerate(RISE_THEN_FLAT[6:], 7):
        a.update(e, s, 1.0)
        b.update(e, s, 1.0)
    assert a.state_dict() == b.state_dict() and a.stopped_at == 14


def _saved(state: dict):
    import io
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf


def test_expected_epochs_for_plan():
    assert expected_epochs(1_112_398, 24) == (24, stopping.MEASURED[0]["source"])   # measured: no plateau by 24
    assert expected_epochs(1_112_398, 10)[0] == 10


def _eval_samples():
    """21 samples of 200 tokens, 100 of them in the loss mask: 2,100 held-out tokens, enough for the rule."""
    s = samples(21, T=200, seed=1)
    assert eval_tokens(s) == 2100 >= MIN_EVAL_TOKENS
    return s


def _scripted(monkeypatch, scores):
    """trainer.evaluate_ttt returning `scores` as the held-out tau_sim epoch after epoch (the training itself is
    real; the eval's other metrics are placeholders of the right shape)."""
    it = iter(scores)

    def fake(draft, samples, head_draft, cfg, dp=None):
        k = cfg.ttt_length
        return {"acc": [0.5] * k, "cond_acc": [0.5] * k, "loss": [1.0] * k, "tau_sim": next(it)}
    monkeypatch.setattr(trainer, "evaluate_ttt", fake)


def test_train_stops_at_the_plateau_and_exports_the_best_epoch(tmp_path, monkeypatch):
    _scripted(monkeypatch, PEAK)
    cfg = CFG.model_copy(update={"epochs": None, "checkpoint_every": 1000})
    lines = []
    out = trainer.train(tiny_draft(), samples(), _eval_samples(), LM_HEAD, cfg, tmp_path / "d", log=lines.append,
                        tensorboard=False)
    assert len(out["history"]) == 9 and out["stopping"]["reason"] == "plateau"
    assert out["stopping"]["decay_start"] == 7 and out["stopping"]["stopped_at"] == 9
    assert any("plateau after epoch 7" in line for line in lines), lines
    # the lr after each epoch: constant through the stable epochs (3 steps an epoch, warmup 0.1 x 72 = 7 steps),
    # then the cosine over steps 21..27 (epochs 8, 9): half way 0.55 of the peak, then the floor 0.1
    lrs = [h["lr"] for h in out["history"]]
    assert lrs[2] == lrs[6] == cfg.lr
    assert math.isclose(lrs[7], 0.55 * cfg.lr) and math.isclose(lrs[8], 0.1 * cfg.lr)
    # the best epoch (4: 3.1) is the one in best/, not the last
    assert out["best"] == {"tau_sim": 3.1, "epoch": 4}
    best, last = load_draft(tmp_path / "d" / "best"), load_draft(tmp_path / "d" / "last")
    assert not torch.equal(best.fc.weight, last.fc.weight)


def test_train_respects_both_ceilings(tmp_path, monkeypatch):
    _scripted(monkeypatch, [1.0 + 0.1 * e for e in range(40)])
    cfg = CFG.model_copy(update={"epochs": None, "max_epochs": 5, "checkpoint_every": 1000})
    out = trainer.train(tiny_draft(), samples(), _eval_samples(), LM_HEAD, cfg, tmp_path / "e", tensorboard=False)
    assert len(out["history"]) == 5 and out["stopping"]["reason"] == "max_epochs"
    assert out["best"]["epoch"] == 5
    _scripted(monkeypatch, [1.0 + 0.1 * e for e in range(40)])
    cfg = cfg.model_copy(update={"max_epochs": 24, "max_train_s": 1e-6})
    out = trainer.train(tiny_draft(), samples(), _eval_samples(), LM_HEAD, cfg, tmp_path / "t", tensorboard=False)
    assert len(out["history"]) == 1 and out["stopping"]["reason"] == "max_train_s"


def test_too_few_held_out_tokens_fall_back_to_the_fixed_rule(tmp_path):
    cfg = CFG.model_copy(update={"epochs": None, "checkpoint_every": 1000})
    few = samples(4, seed=1)                                           # 40 held-out loss tokens
    lines = []
    out = trainer.train(tiny_draft(), samples(4), few, LM_HEAD, cfg, tmp_path / "f", log=lines.append,
                        tensorboard=False)
    assert len(out["history"]) == cfg.epochs_for(80) == 12 and out["stopping"] is None
    assert any("40 held-out loss tokens are too few for the plateau rule (needs 2,048" in line for line in lines)


@pytest.mark.parametrize("split", [3, 8])             # resumed in the stable phase, and inside the decay
def test_a_resumed_run_decides_the_same(tmp_path, monkeypatch, split):
    cfg = CFG.model_copy(update={"epochs": None, "checkpoint_every": 1000})
    data, held_out = samples(8), _eval_samples()                    # 2 steps an epoch
    _scripted(monkeypatch, PEAK)
    whole = trainer.train(tiny_draft(), data, held_out, LM_HEAD, cfg, tmp_path / "w", tensorboard=False)
    _scripted(monkeypatch, PEAK)
    trainer.train(tiny_draft(), data, held_out, LM_HEAD, cfg, tmp_path / "r", tensorboard=False,
                  stop_after_epochs=split)
    _scripted(monkeypatch, PEAK[split:])
    resumed = trainer.train(tiny_draft(), data, held_out, LM_HEAD, cfg, tmp_path / "r", tensorboard=False)
    assert whole["stopping"]["stopped_at"] == 9 and len(resumed["history"]) == 9
    keep = ("reason", "decay_start", "decay_epochs", "stopped_at")
    assert {k: resumed["stopping"][k] for k in keep} == {k: whole["stopping"][k] for k in keep}
    assert [h["lr"] for h in resumed["history"]] == [h["lr"] for h in whole["history"]]
    # each epoch's own seconds, and which epoch began its train() call (its compile), kept across the resume
    assert [i for i, h in enumerate(resumed["history"]) if h["call_first"]] == [0, split]
    assert all(0 < h["epoch_seconds"] <= h["seconds"] for h in resumed["history"])
    assert resumed["best"] == whole["best"]
    a, b = load_draft(tmp_path / "w" / "last"), load_draft(tmp_path / "r" / "last")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_epochs_set_still_fixes_the_count(tmp_path):
    cfg = CFG.model_copy(update={"epochs": 2, "max_epochs": 1, "checkpoint_every": 1000})
    out = trainer.train(tiny_draft(), samples(4), samples(4, seed=1), LM_HEAD, cfg, tmp_path / "x",
                        tensorboard=False)
    assert len(out["history"]) == 2 and out["stopping"] is None
    assert TrainConfig().max_epochs == 24 and TrainConfig().max_train_s is None
