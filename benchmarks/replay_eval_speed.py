"""The replay evaluator against the decoding one on the same drafts and held-out prompts: seconds, ratio, and
whether tau and the per-prompt counts agree.

  python benchmarks/replay_eval_speed.py --config CONFIG.json --draft DIR [--draft DIR ...] [--target DIR]
      [--max-new-tokens N] [--device cpu|cuda]

Decode: scaling_study.measure_drafts (the target-only baseline, then speculative decoding with a target forward
per verify step, every draft). Replay: replay_eval.record_target once (greedy output + aux states of one forward),
then replay_eval.replay_measure per draft. Both chain drafting with eval.num_draft_steps, target fp32 on --device.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_core.config import TargetConfig, load_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, type=Path, help="PipelineConfig JSON of a run with prompts/eval")
    ap.add_argument("--draft", required=True, action="append", help="draft directory (repeatable)")
    ap.add_argument("--target", default=None, help="target directory instead of the config's target.model")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="instead of eval.max_new_tokens")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    from eagle3_core.evaluation.replay_eval import record_target, replay_measure
    from eagle3_core.evaluation.speculate import TargetRunner
    from eagle3_core.pipeline.keys import aux_ids
    from eagle3_core.studies.scaling_study import held_out_prompts, measure_drafts
    from eagle3_core.target.family import num_layers
    from eagle3_core.target.loading import load_target
    from eagle3_core.training.checkpoint import load_draft
    cfg = load_config(a.config)
    if a.target:
        cfg = cfg.model_copy(update={"target": TargetConfig(model=a.target)})
    if a.max_new_tokens:
        cfg.eval.max_new_tokens = a.max_new_tokens
    t0 = time.perf_counter()
    dec = measure_drafts(cfg, {d: load_draft(Path(d)) for d in a.draft}, a.device)
    t_dec = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, prompts, eos = held_out_prompts(cfg)
    target = load_target(cfg.target, a.device, torch.float32)
    recs = record_target(TargetRunner(target, aux_ids(cfg, num_layers(target.config))), prompts,
                         cfg.eval.max_new_tokens, eos)
    t_rec = time.perf_counter() - t0
    t0 = time.perf_counter()
    rep = {d: replay_measure(load_draft(Path(d)).to(a.device).eval(), recs, cfg.eval.num_draft_steps)
           for d in a.draft}
    t_rep = time.perf_counter() - t0
    print(f"{len(prompts)} prompts, {cfg.eval.max_new_tokens} new tokens, chain of {cfg.eval.num_draft_steps}, "
          f"{len(a.draft)} drafts, {a.device}")
    for d in a.draft:
        same = sum(x == y for x, y in zip(dec[d]["per_prompt"], rep[d]["per_prompt"], strict=True))
        print(f"  {d}: tau decode {dec[d]['tau']:.4f}, replay {rep[d]['tau']:.4f}; per-prompt counts equal on "
              f"{same} of {len(prompts)} prompts")
    print(f"decode {t_dec:.1f} s; replay {t_rec + t_rep:.1f} s (recording {t_rec:.1f} s once, drafts {t_rep:.1f} s)"
          f"; ratio {t_dec / (t_rec + t_rep):.2f}x for these drafts, {t_dec / t_rep:.1f}x per further draft once recorded (decode per draft includes its share of the baseline)")


if __name__ == "__main__":
    main()
