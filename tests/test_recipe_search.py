"""The default recipe against the recipe search it comes from (docs/recipes.md): the rule's epochs at both measured
data sizes, and the committed H200 measurement (docs/recipe_tau_time_results.json, benchmarks/recipe_tau_time.py)
showing the default beating SpecForge's recipe within SpecForge's wall time and the rule's choice winning at the
second size; --replot redraws the docs plot from that file."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_core.config import TrainConfig, load_config
from eagle3_core.evaluation.acceptance import paired_bootstrap_diff_ci

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "recipe_tau_time_results.json"


def point(res: dict, recipe: str, epoch: int | None = None) -> dict:
    pts = [p for p in res["points"] if p["recipe"] == recipe]
    return max(pts, key=lambda p: p["epoch"]) if epoch is None else next(p for p in pts if p["epoch"] == epoch)


def test_epochs_rule():
    t = TrainConfig()
    assert t.epochs is None and t.lr == 1e-3
    assert t.epochs_for(1_105_695) == 6 and t.epochs_for(200_000_000) == 6
    assert t.epochs_for(700_000) == 10                    # ceil(6 x 1.1M / 0.7M) = ceil(9.43)
    assert t.epochs_for(279_913) == 12 and t.epochs_for(1) == 12   # capped
    assert TrainConfig(epochs=3).epochs_for(10) == 3
    with pytest.raises(ValueError):
        TrainConfig(epochs=0)


def test_train_without_epochs_runs_the_rules_epochs(tmp_path):
    """train() with train.epochs unset trains TrainConfig.epochs_for(the train samples' tokens) epochs and says so."""
    import torch

    from conftest import tiny_draft
    from eagle3_core.training.trainer import train
    from train_worker import CFG, samples
    data = samples(4)                                                    # 80 tokens an epoch: the cap, 12
    cfg = CFG.model_copy(update={"epochs": None, "checkpoint_every": 1000})
    lines = []
    out = train(tiny_draft(), data, [], torch.randn(100, 32, generator=torch.Generator().manual_seed(5)), cfg,
                tmp_path / "d", log=lines.append, tensorboard=False)
    assert len(out["history"]) == cfg.epochs_for(80) == 12
    assert any("12 epochs by the default recipe's rule (80 tokens an epoch)" in line for line in lines), lines
    assert any(line.startswith("train: epoch 12 of 12") for line in lines)


def test_default_recipe_is_the_measured_winner():
    res = json.loads(RESULTS.read_text())
    recipes = json.loads((ROOT / "configs" / "recipes_gsm8k.json").read_text())
    base = load_config(ROOT / "configs" / "e2e_gsm8k.json").train
    assert res["recipes"] == recipes and len(res["eval_ids"]) == 64
    # the winner: the config's train settings with the default recipe's lr and its rule's epochs at this size
    winner = point(res, "e6_lr1e-3")
    default = base.model_copy(update={"epochs": None, "lr": TrainConfig().lr})
    assert recipes["e6_lr1e-3"]["train"] == {"epochs": default.epochs_for(winner["epoch_tokens"]), "lr": default.lr}
    sf = point(res, "specforge")
    assert sf["epoch"] == 3 and winner["seconds"] <= sf["seconds"]
    lo, hi = paired_bootstrap_diff_ci(winner["per_prompt"], sf["per_prompt"])
    assert winner["tau"] >= 2.38 and 0 < lo < winner["tau"] - sf["tau"] < hi
    # the second size: the rule picks 12 epochs for 1,000 samples, which beats the 4,000-sample 6 epochs there
    small, small6 = point(res, "n1000_e12_lr1e-3"), point(res, "n1000_e6_lr1e-3")
    assert default.epochs_for(small["epoch_tokens"]) == small["epoch"] == 12
    assert paired_bootstrap_diff_ci(small["per_prompt"], small6["per_prompt"])[0] > 0


@pytest.mark.slow
def test_replot_redraws_the_docs_plot(tmp_path):
    res = tmp_path / "results.json"
    res.write_text(RESULTS.read_text())
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "recipe_tau_time.py"), "--replot", str(res),
                          "--plot", str(tmp_path / "docs.png")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "docs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "tau_time.png").exists()                      # --plot given: only there
    committed = json.loads(RESULTS.read_text())
    winner, sf = point(committed, "e6_lr1e-3"), point(committed, "specforge")
    row = next(line for line in out.stdout.splitlines() if line.startswith("| e6_lr1e-3 |"))
    assert f"{winner['tau']:.3f}" in row and f"{winner['tau'] - sf['tau']:+.3f}" in row
