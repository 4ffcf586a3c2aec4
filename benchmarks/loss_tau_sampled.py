"""Acceptance at T = 0 and T = 1 of two drafts trained on the same data with the default TTT loss (train.loss 'kl')
and the acceptance-aware one ('tv', total variation: arXiv 2602.23881), with paired intervals (issue 66).

  python benchmarks/loss_tau_sampled.py --config configs/e2e_gsm8k.json --recipes configs/recipes_loss_gsm8k.json \
      --part 1 --out bench/loss_tau_1.json      # regeneration, tokenize, features, vocab, the 'kl' draft
  python benchmarks/loss_tau_sampled.py ... --part 2 --out bench/loss_tau_2.json   # the 'tv' draft
  python benchmarks/loss_tau_sampled.py ... --part 3 --out bench/loss_tau.json     # measure both
  (--part all: everything in one call; [--target DIR] [--seeds 2] [--temperature 1.0] [--device cuda])

Data and training: benchmarks/recipe_tau_time.py's path (the config's prompts, regeneration on the target,
tokenize, one features store, each recipe in RUN_DIR/recipes/NAME with its own vocab and train stages; cached by
their manifests and trained.json, so part 2 on the same machine reuses part 1's run folder). The recipes file holds
the two drafts (first: the default loss; second: the LK option), the same epochs and lr so that only the loss differs.
Measured on the config's pinned held-out prompts, chain of eval.num_draft_steps, eval.max_new_tokens, target fp32:
T = 0 by replay_eval on recipe_tau_time.recording (the target's greedy output); T = --temperature by
replay_sampled (--seeds trajectories per prompt sampled by the target, both drafts on the same trajectories and
coin flips), under both accept rules (min(1, p/q): sampled-draft engines; argmax draft: llama.cpp). Each tau with its
95% bootstrap interval over prompts, and tv - kl with the paired interval (the same prompts resampled for both).
Prints the result JSON and writes it to --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from eagle3_core.config import TargetConfig, load_config  # noqa: E402
from eagle3_core.config.sampling_config import SamplingConfig  # noqa: E402


def train_part(cfg, recipes: dict, names: list[str], out: Path) -> dict:
    """Data stages, the features store and the named recipes trained (recipe_tau_time; all cached)."""
    from eagle3_core.pipeline.vocab_stage import run_vocab
    from recipe_tau_time import features_once, train_ours
    from train_end_to_end import data_stages
    stages = data_stages(cfg)
    features_s = features_once(cfg, out)
    run_vocab(cfg, log=lambda s: None)
    trained = {}
    for name in names:
        t0 = time.monotonic()
        trained[name] = train_ours(cfg, name, recipes[name], features_s)
        print(f"== {name}: trained in {time.monotonic() - t0:.0f} s", flush=True)
    return {"stages_s": {**stages, "features": features_s}, "trained": trained}


def _pair(a: dict, b: dict) -> dict:
    """b - a in tau with the paired 95% interval over the same prompts."""
    from eagle3_core.evaluation.acceptance import paired_bootstrap_diff_ci
    return {"tau": b["tau"] - a["tau"], "ci95_paired": paired_bootstrap_diff_ci(b["per_prompt"], a["per_prompt"])}


def measure_part(cfg, drafts: dict[str, Path], out: Path, device: str, temperature: float, n_seeds: int) -> dict:
    """tau of each draft at T = 0 (replay) and at `temperature` (sampled replay, both rules), paired differences."""
    from eagle3_core.evaluation.replay_eval import replay_measure
    from eagle3_core.evaluation.replay_sampled import record_sampled, replay_measure_sampled
    from eagle3_core.evaluation.speculate import TargetRunner
    from eagle3_core.pipeline.keys import aux_ids
    from eagle3_core.studies.scaling_study import held_out_prompts
    from eagle3_core.target.family import num_layers
    from eagle3_core.target.loading import load_target
    from eagle3_core.training.checkpoint import load_draft
    from recipe_tau_time import recording
    S, keep = cfg.eval.num_draft_steps, ("tau", "tau_ci95", "accept_per_position", "per_prompt")
    models = {n: load_draft(d).to(device).eval() for n, d in drafts.items()}
    t0 = time.monotonic()
    greedy = torch.load(recording(cfg, device, out.parent / "recording.pt", 64), weights_only=True)["recordings"]
    res = {"T0": {n: {k: v for k, v in replay_measure(m, greedy, S).items() if k in keep} for n, m in models.items()}}
    res["T0_seconds"] = time.monotonic() - t0
    t0 = time.monotonic()
    _, prompts, eos = held_out_prompts(cfg)
    target = load_target(cfg.target, device, torch.float32)
    s = SamplingConfig(temperature=temperature, seed=0)
    recs = record_sampled(TargetRunner(target, aux_ids(cfg, num_layers(target.config))), prompts,
                          cfg.eval.max_new_tokens, eos, s, list(range(n_seeds)))
    del target
    res["sampled_recording"] = {"trajectories": len(recs), "tokens": sum(len(r["tokens"]) for r in recs),
                                "seconds": time.monotonic() - t0}
    t0 = time.monotonic()
    res[f"T{temperature:g}"] = {n: {rule: {k: v for k, v in r.items() if k in keep}
                                    for rule, r in replay_measure_sampled(m, recs, S, s).items()}
                                for n, m in models.items()}
    res["sampled_replay_seconds"] = time.monotonic() - t0
    a, b = list(drafts)
    res["tv_minus_kl"] = {"T0": _pair(res["T0"][a], res["T0"][b]),
                          **{f"T{temperature:g}_{rule}": _pair(res[f"T{temperature:g}"][a][rule],
                                                                res[f"T{temperature:g}"][b][rule])
                             for rule in res[f"T{temperature:g}"][a]}}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--recipes", type=Path, required=True, help="two recipes: the default loss, then the LK one")
    ap.add_argument("--part", choices=("1", "2", "3", "all"), default="all",
                    help="1: data, features and the first draft; 2: the second draft; 3: the measurement")
    ap.add_argument("--target", default=None, help="target directory instead of the config's target.model")
    ap.add_argument("--out", type=Path, required=True, help="result JSON")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seeds", type=int, default=2, help="sampled trajectories per held-out prompt")
    a = ap.parse_args()
    cfg = load_config(a.config)
    if a.target:
        cfg = cfg.model_copy(update={"target": TargetConfig(model=a.target)})
    recipes = json.loads(a.recipes.read_text())
    if len(recipes) != 2:
        raise SystemExit(f"{a.recipes}: two recipes (the default loss, then the LK option), found {list(recipes)}")
    names = list(recipes)
    work = Path(cfg.run_dir) / "recipes"
    work.mkdir(parents=True, exist_ok=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    part = train_part(cfg, recipes, {"1": names[:1], "2": names[1:], "3": []}.get(a.part, names), work)
    result = {"config": str(a.config), "recipes": recipes, "part": a.part,
              "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, **part}
    if a.part in ("3", "all"):
        trained = {n: json.loads((work / n / "trained.json").read_text()) for n in names}
        drafts = {n: Path(t["epochs"][-1]["dir"]) for n, t in trained.items()}
        result.update(measure_part(cfg, drafts, work / "loss_tau", a.device, a.temperature, a.seeds))
        result["train_seconds"] = {n: t["epochs"][-1]["seconds"] for n, t in trained.items()}
    result["seconds"] = time.monotonic() - t0
    text = json.dumps(result, indent=1, default=str)
    a.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
