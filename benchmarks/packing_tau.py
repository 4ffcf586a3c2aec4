"""Does packing change the draft? The demo recipe trained twice on a finished run's features, padded batches and
packed rows (train.batching), on this machine's device, each measured by the offline evaluator (chain) on the
run's held-out prompts: tau with 95% intervals, the paired bootstrap interval of the difference, training time and
optimizer steps.

  make demo                                                    # once: runs/demo
  .venv/bin/python benchmarks/packing_tau.py --run-dir runs/demo

The run's data stages are copied to <run>-padded and <run>-packed (the run itself is not touched). Meant for a
GPU: on CPU the packed run is slow (eager TTT attention computes every [row, row] score and masks the other samples'
out; the demo's first epoch took 248 s packed against 42 s padded on 2 cores), which is why 'auto' packs on CUDA
only (flex attention skips the masked blocks).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_core.config import preset  # noqa: E402
from eagle3_core.contract.layout import STAGE_DIRS  # noqa: E402
from eagle3_core.evaluation.acceptance import paired_bootstrap_diff_ci  # noqa: E402
from eagle3_core.pipeline.evaluate_stage import run_evaluate  # noqa: E402
from eagle3_core.pipeline.train_stage import run_train  # noqa: E402
from eagle3_core.pipeline.vocab_stage import run_vocab  # noqa: E402

DATA = tuple(STAGE_DIRS[s] for s in ("prompts", "generation", "tokenize", "features"))   # the data stages' folders


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", default="runs/demo")
    args = p.parse_args()
    base = Path(args.run_dir).resolve()
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    out = {}
    for mode in ("padded", "packed"):
        run = base.with_name(f"{base.name}-{mode}")
        shutil.rmtree(run, ignore_errors=True)
        for s in DATA:
            shutil.copytree(base / s, run / s)
        cfg = preset("demo", run)
        cfg.train.batching, cfg.eval.tree_topk = mode, 1
        run_vocab(cfg, log=log)
        train = run_train(cfg, log=log)
        ev = run_evaluate(cfg, log=log)
        report = json.loads((run / "eval" / "report.json").read_text())["trained"]
        out[mode] = {"tau": ev["summary"]["trained"]["tau"], "tau_ci95": ev["summary"]["trained"]["tau_ci95"],
                     "train_s": train["seconds"], "steps": train.get("steps"), "per_prompt": report["per_prompt"]}
    diff = out["packed"]["tau"] - out["padded"]["tau"]
    lo, hi = paired_bootstrap_diff_ci(out["packed"]["per_prompt"], out["padded"]["per_prompt"])
    for mode, r in out.items():
        log(f"{mode}: tau {r['tau']:.3f} ({r['tau_ci95'][0]:.2f}-{r['tau_ci95'][1]:.2f}), train {r['train_s']:.0f} s, "
            f"{r['steps']} steps")
    log(f"packed - padded: {diff:+.3f}, paired 95% interval {lo:+.3f} .. {hi:+.3f}")


if __name__ == "__main__":
    main()
