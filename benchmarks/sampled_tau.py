"""Chain tau at a sampling temperature for several trained drafts on one run's held-out prompts: the target's own
sampled trajectories recorded once (evaluation.replay_sampled.record_sampled), every draft replayed on the same
trajectories and coin flips under both engine rules (sampled draft: accept with min(1, q/p); greedy draft: accept
when the target's sample equals the draft's argmax), and each pair of drafts compared by the paired bootstrap.

  python benchmarks/sampled_tau.py --config configs/e2e_gsm8k.json --draft kl=DIR --draft tv=DIR \
      [--temperature 1.0] [--top-p 0.95] [--seeds 0,1] [--device cuda] [--out results.json]

DIR is a draft directory that training.checkpoint.load_draft reads (a recipe's draft/export). The run directory
(cfg.run_dir) must hold the prompts stage (its eval.parquet). Prints and writes JSON: settings, per draft and rule
tau with its 95% interval (prompts and seeds resampled together), and tau(a) - tau(b) with its paired interval.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3_core.config import load_config  # noqa: E402
from eagle3_core.config.sampling_config import SamplingConfig  # noqa: E402
from eagle3_core.evaluation.acceptance import paired_bootstrap_diff_ci  # noqa: E402
from eagle3_core.evaluation.replay_sampled import RULES, record_sampled, replay_measure_sampled  # noqa: E402
from eagle3_core.evaluation.speculate import TargetRunner  # noqa: E402
from eagle3_core.pipeline.keys import aux_ids  # noqa: E402
from eagle3_core.studies.scaling_study import held_out_prompts  # noqa: E402
from eagle3_core.target.family import num_layers  # noqa: E402
from eagle3_core.target.loading import load_target  # noqa: E402
from eagle3_core.training.checkpoint import load_draft  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--draft", action="append", required=True, help="NAME=DIR, repeated")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seeds", default="0", help="comma-separated trajectory seeds per prompt")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    cfg = load_config(a.config)
    s = SamplingConfig(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k)
    seeds = [int(x) for x in a.seeds.split(",")]
    _, prompts, eos = held_out_prompts(cfg)
    t0 = time.monotonic()
    target = load_target(cfg.target, a.device, torch.float32)
    runner = TargetRunner(target, aux_ids(cfg, num_layers(target.config)))
    recs = record_sampled(runner, prompts, cfg.eval.max_new_tokens, eos, s, seeds)
    rec_s = time.monotonic() - t0
    del target, runner
    res = {"settings": {**s.model_dump(mode="json"), "seeds": seeds, "prompts": len(prompts),
                        "num_draft_steps": cfg.eval.num_draft_steps, "max_new_tokens": cfg.eval.max_new_tokens,
                        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
                        "record_s": round(rec_s, 1)}, "drafts": {}, "paired": {}}
    for name, d in (x.split("=", 1) for x in a.draft):
        t1 = time.monotonic()
        m = replay_measure_sampled(load_draft(Path(d)).to(a.device).eval(), recs, cfg.eval.num_draft_steps, s)
        res["drafts"][name] = {r: {k: m[r][k] for k in ("tau", "tau_ci95", "accept_per_position", "per_prompt",
                                                        "trajectories")} for r in RULES}
        print(f"{name}: " + ", ".join(f"{r} tau {m[r]['tau']:.3f} {m[r]['tau_ci95']}" for r in RULES)
              + f" ({time.monotonic() - t1:.0f} s)", flush=True)
    for x, y in itertools.combinations(res["drafts"], 2):
        for r in RULES:
            px, py = res["drafts"][x][r]["per_prompt"], res["drafts"][y][r]["per_prompt"]
            res["paired"][f"{x}-{y}:{r}"] = paired_bootstrap_diff_ci(px, py)
            print(f"{x} - {y} ({r}): {res['drafts'][x][r]['tau'] - res['drafts'][y][r]['tau']:+.3f} "
                  f"95% CI {res['paired'][f'{x}-{y}:{r}']}", flush=True)
    text = json.dumps(res, indent=1)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
