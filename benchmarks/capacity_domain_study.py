"""Is one decoder layer the bottleneck? The default draft against larger ones at equal data, in one command on a GPU.

  python benchmarks/capacity_domain_study.py --config configs/e2e_gsm8k.json --out capacity.json \
      [--samples 1000] [--epochs 3] [--arms default,wider_mlp,two_layers,eagle3.1] [--target DIR] [--plot PNG]
  python benchmarks/capacity_domain_study.py --replot capacity.json --plot docs/img/capacity_h100.png

Data: the config's prompts, regeneration, tokenization and features (benchmarks/train_end_to_end.data_stages and
recipe_tau_time.features_once, cached by their manifests). Each arm is a recipe of recipe_tau_time (its own run
folder RUN_DIR/recipes/capacity_ARM linking the shared store; its own vocab stage; cold compile cache) trained on
the same first `--samples` of scaling_study's nested subsets for `--epochs` epochs with the config's recipe (equal
data, equal steps); only the draft differs:
  default     the family recipe (one layer, the target's MLP width)
  wider_mlp   draft.intermediate_size = --wide-factor x the recipe's width
  two_layers  draft.num_hidden_layers = 2
  eagle3.1    draft.variant = 'eagle3.1' (fc_norm, norm_output; arXiv 2605.09992)
The last epoch of each arm is measured by the replay evaluator (recipe_tau_time.recording: the target's greedy
output on the config's pinned held-out prompts, recorded once on --measure-device; chain of eval.num_draft_steps).
Reported per arm: tau with its bootstrap 95% interval, tau minus the default's with the paired bootstrap 95%
interval (acceptance.paired_bootstrap_diff_ci: the same prompts resampled for both), GPU seconds (features share +
vocab + training up to the last epoch, one GPU, compile from a cold cache included), tau per GPU-second, and the tau
gained per extra GPU-second against the default. JSON on stdout and to --out, with the device and the date.

Budget: on one H200 the data stages took about 200 s (regeneration 180 s, docs/recipes.md); 1,000 samples x 3
epochs per arm keeps the whole command under 8 minutes on an H100 (the two-layer arm trains eagerly: the compiled
per-step graphs cover layer 0 only, training.packing.packed_ttt_loss). Raise --samples where there is time.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import recipe_tau_time as rt  # noqa: E402

from eagle3_core.config import PipelineConfig, TargetConfig, load_config  # noqa: E402

ARMS = ("default", "wider_mlp", "two_layers", "eagle3.1")


def arm_recipes(cfg: PipelineConfig, arms: list[str], samples: int, epochs: int, wide_factor: float) -> dict:
    """{arm: recipe_tau_time recipe}: the same samples and epochs for every arm, the draft options per arm."""
    from eagle3_core.pipeline.keys import target_config
    from eagle3_core.training.draft_geometry import draft_geometry
    width = draft_geometry(target_config(cfg), cfg.draft.geometry())["intermediate_size"]
    drafts = {"default": {}, "wider_mlp": {"intermediate_size": int(round(wide_factor * width))},
              "two_layers": {"num_hidden_layers": 2}, "eagle3.1": {"variant": "eagle3.1"}}
    if unknown := set(arms) - set(drafts):
        raise SystemExit(f"--arms {sorted(unknown)}: choose from {list(drafts)}")
    return {a: {"samples": samples, "measure": "last", "train": {"epochs": epochs},
                **({"draft": drafts[a]} if drafts[a] else {})} for a in arms}


def compare(measured: dict, trained: dict) -> dict:
    """Per arm: tau, its 95% CI, GPU seconds, tau per GPU-second; against 'default' (when measured) the paired
    difference in tau with its 95% CI and the tau gained per extra GPU-second."""
    from eagle3_core.evaluation.acceptance import paired_bootstrap_diff_ci
    rows, base = {}, measured.get("default")
    for arm, m in measured.items():
        secs = trained[arm]["epochs"][-1]["seconds"]
        row = {"tau": m["tau"], "tau_ci95": m["tau_ci95"], "gpu_seconds": secs, "tau_per_gpu_second": m["tau"] / secs,
               "accept_per_position": m["accept_per_position"], "epochs": len(trained[arm]["epochs"]),
               "epoch_tokens": trained[arm]["epoch_tokens"], "draft": trained[arm]["settings"]["draft"]}
        if base is not None and arm != "default":
            extra = secs - trained["default"]["epochs"][-1]["seconds"]
            row["minus_default"] = {"tau": m["tau"] - base["tau"],
                                    "ci95_paired": paired_bootstrap_diff_ci(m["per_prompt"], base["per_prompt"]),
                                    "extra_gpu_seconds": extra,
                                    "tau_per_extra_gpu_second": (m["tau"] - base["tau"]) / extra if extra > 0 else None}
        epochs = trained[arm]["epochs"]
        if len(epochs) > 1:                 # an epoch without the first one's compile (and warm-up) in it
            row["later_epoch_seconds"] = (epochs[-1]["seconds"] - epochs[0]["seconds"]) / (len(epochs) - 1)
        rows[arm] = row
    return rows


def plot(res: dict, path: Path) -> Path:
    """Two panels: each arm's tau with its 95% interval, and each arm's tau minus the default's with the paired
    95% interval (0 marked); the title names the device, date, samples and epochs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    arms = res["arms"]
    names = list(arms)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    tau = [arms[n]["tau"] for n in names]
    err = [[t - arms[n]["tau_ci95"][0] for n, t in zip(names, tau)],
           [arms[n]["tau_ci95"][1] - t for n, t in zip(names, tau)]]
    left.errorbar(names, tau, yerr=err, fmt="o", capsize=4)
    left.set_ylabel("acceptance length tau (replay, held-out)")
    others = [n for n in names if "minus_default" in arms[n]]
    diff = [arms[n]["minus_default"]["tau"] for n in others]
    derr = [[d - arms[n]["minus_default"]["ci95_paired"][0] for n, d in zip(others, diff)],
            [arms[n]["minus_default"]["ci95_paired"][1] - d for n, d in zip(others, diff)]]
    right.errorbar(others, diff, yerr=derr, fmt="o", capsize=4, color="tab:red")
    right.axhline(0.0, color="black", linewidth=0.8)
    right.set_ylabel("tau minus the default draft's (paired 95% CI)")
    fig.suptitle(f"draft capacity at equal data: {res['samples']} samples x {res['epochs']} epochs, "
                 f"{res['device']}, {res['date']}", fontsize=10)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "e2e_gsm8k.json")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON result here (needed unless --replot)")
    ap.add_argument("--plot", type=Path, default=None, help="also draw the result here (PNG)")
    ap.add_argument("--replot", type=Path, default=None, help="draw --plot from this result JSON; train nothing")
    ap.add_argument("--samples", type=int, default=1000, help="train samples of every arm (equal data)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs of every arm")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--wide-factor", type=float, default=2.0, help="wider_mlp: times the recipe's MLP width")
    ap.add_argument("--target", default=None, help="target directory instead of the config's target.model")
    ap.add_argument("--measure-device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--record-batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2, help="processes that replay the drafts")
    rt.study_main(ap, study, plot)


def study(a) -> dict:
    """The whole study for parsed arguments `a` (module docstring); returns the result dict."""
    from train_end_to_end import data_stages

    from eagle3_core.pipeline.vocab_stage import run_vocab
    t_start = time.monotonic()
    cfg = load_config(a.config)
    if a.target:
        cfg = cfg.model_copy(update={"target": TargetConfig(model=a.target)})
    recipes = arm_recipes(cfg, [x for x in a.arms.split(",") if x], a.samples, a.epochs, a.wide_factor)
    out_dir = Path(cfg.run_dir) / "recipes"
    out_dir.mkdir(parents=True, exist_ok=True)
    stages = data_stages(cfg)
    features_seconds = rt.features_once(cfg, out_dir)
    run_vocab(cfg, log=lambda s: None)
    trained = {arm: rt.train_ours(cfg, f"capacity_{arm}", r, features_seconds) for arm, r in recipes.items()}
    recorded = rt.recording(cfg, a.measure_device, out_dir / "recording.pt", a.record_batch)
    dirs = {arm: t["epochs"][-1]["dir"] for arm, t in trained.items()}
    rt.measure_all(cfg, list(dirs.values()), a.workers, a.measure_device, recorded)
    measured = {arm: json.loads((Path(d) / "measured.json").read_text()) for arm, d in dirs.items()}
    res = {"study": "capacity at equal data", "config": str(a.config), "samples": a.samples, "epochs": a.epochs,
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
           "data_stage_seconds": {**stages, "features": features_seconds}, **rt.eval_settings(cfg),
           "arms": compare(measured, trained), "wall_seconds": time.monotonic() - t_start}
    return res


if __name__ == "__main__":
    main()
