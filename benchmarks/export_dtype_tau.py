"""tau of one trained draft exported in fp32 and in bf16 (the default since the exports became bf16), measured by
the offline evaluator on a finished run's held-out prompts: the same draft, prompts, target and greedy decoding, so
the difference is the export dtype alone.

    python benchmarks/export_dtype_tau.py runs/demo            # after `make demo`

On a machine busy with other work run it with OMP_NUM_THREADS=1: two processes' OpenMP threads spinning on 2
cores made the target's step 10x slower (measured here). Prints tau (95% CI) per dtype as a chain of eval.num_draft_steps and the paired bootstrap interval of bf16 - fp32.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_core.config import PipelineConfig, load_config  # noqa: E402
from eagle3_core.contract.layout import RunLayout  # noqa: E402
from eagle3_core.data import prompt_set as prompts_mod  # noqa: E402
from eagle3_core.data.chat import prompt_ids  # noqa: E402
from eagle3_core.evaluation.acceptance import SpecRun, measure, paired_bootstrap_diff_ci  # noqa: E402
from eagle3_core.evaluation.speculate import TargetRunner  # noqa: E402
from eagle3_core.target.family import sglang_rule  # noqa: E402
from eagle3_core.target.loading import load_target, load_tokenizer  # noqa: E402
from eagle3_core.training.checkpoint import export_draft, load_draft  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--prompts", type=int, default=None, help="first N held-out prompts (default: all)")
    ap.add_argument("--config", default=None, help="the run's PipelineConfig JSON (default: the embedded target)")
    a = ap.parse_args()
    cfg = load_config(a.config) if a.config else PipelineConfig()
    draft_manifest = json.loads((a.run_dir / "draft" / "manifest.json").read_text())
    eval_manifest = json.loads((a.run_dir / "eval" / "manifest.json").read_text())
    S, n_new = eval_manifest["summary"]["num_draft_steps"], eval_manifest["summary"]["max_new_tokens"]
    tok, model = load_tokenizer(cfg.target), load_target(cfg.target)
    rows = prompts_mod.read_rows(a.run_dir / "prompts" / "eval.parquet")[:a.prompts]
    prompts = [prompt_ids(tok, r["messages"]) for r in rows]
    best = load_draft(RunLayout(a.run_dir).stored(draft_manifest["export_dir"]).parent / "best")
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            export = export_draft(best, Path(tmp) / name, dtype=dtype, sglang_rule=sglang_rule(model.config))
            runs[name] = SpecRun(load_draft(export), S)
        ids = runs["fp32"].draft.shape.aux_layer_ids
        eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        report = measure(TargetRunner(model, ids), runs, prompts, ["all"] * len(prompts), n_new, eos,
                         cfg.eval.tie_gap)
    for name in runs:
        r = report[name]
        print(f"{name}: tau {r['tau']:.3f} (95% CI {r['tau_ci95'][0]:.3f}-{r['tau_ci95'][1]:.3f}), "
              f"{r['tokens']} tokens, lossless {r['lossless']}")
    lo, hi = paired_bootstrap_diff_ci(report["bf16"]["per_prompt"], report["fp32"]["per_prompt"])
    print(f"bf16 - fp32: {report['bf16']['tau'] - report['fp32']['tau']:+.3f} (paired 95% CI {lo:+.3f}, {hi:+.3f}) "
          f"on {len(prompts)} held-out prompts, chain of {S}")


if __name__ == "__main__":
    main()
