"""Acceptance length against wall time: our trainer's recipes and SpecForge 0.2.0's online training on the same
regenerated data, every epoch's draft measured by one offline evaluator on the same held-out prompts.

  python benchmarks/recipe_tau_time.py --config configs/e2e_gsm8k.json --recipes configs/recipes_gsm8k.json \
      [--target DIR] [--out DIR] [--plot docs/recipe_tau_time.png] [--skip specforge]

Data: the config's prompts, regeneration and tokenization (train_end_to_end.data_stages, cached by their manifests).
Ours: the features stage once (timed, from scratch), then each recipe of the --recipes file ({name: partial
PipelineConfig, e.g. {"train": {"epochs": 5, "lr": 1e-3}, "draft": {"draft_vocab_size": 16384}}}, merged into the
config) in a run folder of its own, RUN_DIR/recipes/NAME, that links the shared prompts, generations, tokenized rows
and features: its vocab stage (a vocab size of its own) and train stage run there, every epoch's `last` draft kept.
A recipe's wall time at epoch e: features + its vocab + its train stage up to the end of epoch e (held-out TTT eval
and checkpoints included; copying the snapshots is left out). SpecForge: train_end_to_end.specforge_online with the
config's own recipe (its target forward in the loop, its BF16Optimizer), its weights at each epoch end loaded into
our draft class (same parameter names); wall time from the target's load to that epoch's end.
Measured: scaling_study.measure_offline (chain drafting with eval.num_draft_steps, greedy, eval.max_new_tokens, the
run's held-out prompts, whose ids the result lists). A recipe that has its RUN_DIR/recipes/NAME/point.json for the
same settings is not trained or measured again (a long search can go on over several calls).

Writes OUT/results.json (every point: trainer, recipe, epoch, seconds, tau, 95% CI, per-prompt counts), the plot
(tau against seconds, both trainers) and prints, for each recipe, its best tau within SpecForge's wall time with
the paired bootstrap interval of its difference from SpecForge's final draft (the same prompts resampled for both).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from eagle3_core.config import PipelineConfig, TargetConfig, load_config  # noqa: E402

SHARED = ("prompts", "generations", "tokenized", "features")        # RunLayout folders every recipe reads


def merged(base: dict, override: dict) -> dict:
    """base with override's keys replaced, nested dicts merged key by key."""
    out = dict(base)
    for k, v in override.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def recipe_config(base: PipelineConfig, name: str, recipe: dict) -> PipelineConfig:
    """The config of one recipe: `recipe` merged into `base`, run_dir RUN_DIR/recipes/NAME with the SHARED folders
    of base linked into it (created once). Raises pydantic's ValidationError naming a bad recipe field."""
    from eagle3_core.pipeline.layout import RunLayout
    cfg = PipelineConfig.model_validate(merged(base.model_dump(mode="json"), recipe) | {
        "run_dir": str(Path(base.run_dir) / "recipes" / name)})
    src, dst = RunLayout(base.run_dir), RunLayout(cfg.run_dir)
    dst.run_dir.mkdir(parents=True, exist_ok=True)
    for stage in SHARED:
        link = getattr(dst, stage)
        if not link.exists():
            link.symlink_to(getattr(src, stage).resolve(), target_is_directory=True)
    return cfg


def measured(cfg: PipelineConfig, draft_dir: Path) -> dict:
    """The offline evaluator's entry for the draft in draft_dir (tau, tau_ci95, per_prompt, ...)."""
    from eagle3_core.checkpoint import load_draft
    from eagle3_core.scaling_study import measure_offline
    m = measure_offline(cfg, load_draft(draft_dir))
    return {k: m[k] for k in ("tau", "tau_ci95", "accept_per_position", "per_prompt")}


def our_recipe(base: PipelineConfig, name: str, recipe: dict, features_seconds: float) -> dict:
    """Train one recipe (module docstring) and measure each epoch's draft; cached in its point.json."""
    from eagle3_core import stages
    from eagle3_core.pipeline.layout import RunLayout
    cfg = recipe_config(base, name, recipe)
    run = RunLayout(cfg.run_dir)
    done = run.run_dir / "point.json"
    settings = {"recipe": recipe, "train": cfg.train.model_dump(mode="json"),
                "draft": cfg.draft.model_dump(mode="json")}
    if done.exists() and (old := json.loads(done.read_text()))["settings"] == settings:
        print(f"== recipe {name}: measured before ({done})", flush=True)
        return old
    for d in (run.vocab, run.draft, run.run_dir / "epochs"):
        shutil.rmtree(d, ignore_errors=True)
    t0 = time.monotonic()
    stages.run_vocab(cfg, log=lambda s: None)
    vocab_seconds = time.monotonic() - t0
    marks, left_out = [], [0.0]
    t0 = time.monotonic()

    def snapshot(epochs_done: int, epochs: int) -> None:
        paused = time.monotonic()
        marks.append(paused - t0 - left_out[0])
        shutil.copytree(run.draft / "last", run.run_dir / "epochs" / f"epoch_{epochs_done}")
        left_out[0] += time.monotonic() - paused

    stages.run_train(cfg, log=lambda s: print(f"   [{name}] {s}", flush=True), on_epoch=snapshot)
    points = []
    for e, train_seconds in enumerate(marks, 1):
        m = measured(cfg, run.run_dir / "epochs" / f"epoch_{e}")
        points.append({"trainer": "ours", "recipe": name, "epoch": e,
                       "seconds": features_seconds + vocab_seconds + train_seconds, **m})
        print(f"== recipe {name} epoch {e}: {points[-1]['seconds']:.1f} s, tau {m['tau']:.3f}", flush=True)
    out = {"settings": settings, "features_seconds": features_seconds, "vocab_seconds": vocab_seconds,
           "points": points}
    done.write_text(json.dumps(out, indent=2))
    return out


def specforge_recipe(base: PipelineConfig, device: torch.device) -> list[dict]:
    """SpecForge's online run with the config's recipe, each epoch's draft measured (module docstring)."""
    from train_end_to_end import specforge_online

    from eagle3_core.checkpoint import save_draft
    from eagle3_core.pipeline.train import fresh_draft
    keep = Path(base.run_dir) / "recipes" / "specforge" / "epochs"
    shutil.rmtree(keep, ignore_errors=True)
    marks = []

    def snapshot(epochs_done: int, seconds: float, model) -> None:
        ours, _ = fresh_draft(base, log=lambda s: None)
        missing, unexpected = ours.load_state_dict(model.state_dict(), strict=False)
        if missing or not all("rotary" in k or "inv_freq" in k for k in unexpected):
            raise RuntimeError(f"SpecForge's draft does not map onto ours: missing {missing}, extra {unexpected}")
        save_draft(ours.float(), keep / f"epoch_{epochs_done}")
        marks.append(seconds)

    specforge_online(base, device, on_epoch=snapshot)
    points = []
    for e, seconds in enumerate(marks, 1):
        m = measured(base, keep / f"epoch_{e}")
        points.append({"trainer": "specforge", "recipe": "specforge", "epoch": e, "seconds": seconds, **m})
        print(f"== specforge epoch {e}: {seconds:.1f} s, tau {m['tau']:.3f}", flush=True)
    return points


def plot(points: list[dict], path: Path, title: str) -> Path:
    """tau (95% CI bars) against wall seconds, one line per recipe and one for SpecForge."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(p["recipe"] for p in points):
        pts = sorted((p for p in points if p["recipe"] == name), key=lambda p: p["seconds"])
        x, y = [p["seconds"] for p in pts], [p["tau"] for p in pts]
        err = [[p["tau"] - p["tau_ci95"][0] for p in pts], [p["tau_ci95"][1] - p["tau"] for p in pts]]
        style = dict(color="black", linestyle="--", marker="s") if name == "specforge" else dict(marker="o")
        ax.errorbar(x, y, yerr=err, capsize=3, label="SpecForge 0.2.0" if name == "specforge" else f"ours: {name}",
                    **style)
    ax.set_xlabel("wall time, seconds (ours: features + vocab + train; SpecForge: its online loop)")
    ax.set_ylabel("acceptance length tau (offline, held-out)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def summary(points: list[dict]) -> list[dict]:
    """Per recipe: its best point within SpecForge's final wall time and, against SpecForge's final draft, the
    difference in tau with its paired bootstrap 95% interval (evaluate.paired_bootstrap_diff_ci)."""
    from eagle3_core.evaluate import paired_bootstrap_diff_ci
    sf = [p for p in points if p["trainer"] == "specforge"]
    final = max(sf, key=lambda p: p["epoch"]) if sf else None
    rows = []
    for name in dict.fromkeys(p["recipe"] for p in points if p["trainer"] == "ours"):
        pts = [p for p in points if p["recipe"] == name and (final is None or p["seconds"] <= final["seconds"])]
        best = max(pts, key=lambda p: p["tau"]) if pts else None
        row = {"recipe": name, "best_within_specforge_time": best and {k: best[k] for k in ("epoch", "seconds",
                                                                                             "tau", "tau_ci95")}}
        if best and final:
            row["minus_specforge"] = {"tau": best["tau"] - final["tau"],
                                      "ci95_paired": paired_bootstrap_diff_ci(best["per_prompt"], final["per_prompt"])}
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, type=Path, help="PipelineConfig JSON (configs/e2e_gsm8k.json)")
    ap.add_argument("--recipes", required=True, type=Path, help="JSON {name: partial PipelineConfig}")
    ap.add_argument("--target", default=None, help="target directory instead of the config's target.model")
    ap.add_argument("--out", type=Path, default=None, help="result folder (default RUN_DIR/recipes)")
    ap.add_argument("--plot", type=Path, default=None, help="also write the plot here (e.g. docs/recipe_tau_time.png)")
    ap.add_argument("--skip", default="", help="comma-separated: specforge (reuse its points from OUT/results.json)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where SpecForge trains")
    a = ap.parse_args()
    from train_end_to_end import data_stages

    from eagle3_core import stages
    from eagle3_core.pipeline.layout import RunLayout
    cfg = load_config(a.config)
    if a.target:
        cfg = cfg.model_copy(update={"target": TargetConfig(model=a.target)})
    recipes = json.loads(a.recipes.read_text())
    out = a.out or Path(cfg.run_dir) / "recipes"
    out.mkdir(parents=True, exist_ok=True)
    earlier = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    data_stages(cfg)
    run = RunLayout(cfg.run_dir)
    shutil.rmtree(run.features, ignore_errors=True)
    t0 = time.monotonic()
    stages.run_features(cfg, log=lambda s: None)
    features_seconds = time.monotonic() - t0
    stages.run_vocab(cfg, log=lambda s: None)               # SpecForge's draft vocab: the config's own
    print(f"== features: {features_seconds:.1f} s", flush=True)
    points = []
    for name, recipe in recipes.items():
        points += our_recipe(cfg, name, recipe, features_seconds)["points"]
    if "specforge" in set(filter(None, a.skip.split(","))):
        points += [p for p in earlier.get("points", []) if p["trainer"] == "specforge"]
    else:
        points += specforge_recipe(cfg, torch.device(a.device))
    prompts_manifest = json.loads((run.prompts / "manifest.json").read_text())
    res = {"config": str(a.config), "recipes": recipes, "eval_ids": prompts_manifest.get("eval_ids"),
           "eval": cfg.eval.model_dump(mode="json"), "features_seconds": features_seconds, "points": points,
           "summary": summary(points)}
    (out / "results.json").write_text(json.dumps(res, indent=2))
    title = (f"{Path(a.config).stem}: {len(res['eval_ids'] or [])} held-out prompts, chain of "
             f"{cfg.eval.num_draft_steps}, {cfg.eval.max_new_tokens} new tokens")
    for path in filter(None, (out / "tau_time.png", a.plot)):
        plot(points, path, title)
    print("| recipe | best tau within SpecForge's time | at (s, epoch) | minus SpecForge (paired 95% CI) |\n"
          "|---|---|---|---|")
    for row in res["summary"]:
        b, d = row["best_within_specforge_time"], row.get("minus_specforge")
        print(f"| {row['recipe']} | " + (f"{b['tau']:.3f} ({b['tau_ci95'][0]:.2f}-{b['tau_ci95'][1]:.2f}) | "
                                         f"{b['seconds']:.0f} s, epoch {b['epoch']} | " if b else "none | - | ")
              + (f"{d['tau']:+.3f} ({d['ci95_paired'][0]:+.3f} to {d['ci95_paired'][1]:+.3f}) |" if d else "- |"))
    print(f"written to {out / 'results.json'}")


if __name__ == "__main__":
    main()
