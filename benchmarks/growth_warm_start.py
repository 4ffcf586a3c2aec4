"""Grow a finished demo run and continue from its draft: what is redone, and does a warm start pay off?

  make demo                                                    # once: runs/demo, 120 train prompts
  .venv/bin/python benchmarks/growth_warm_start.py --run-dir runs/demo --grow-to 148

1. Growth: the run's data stages are copied to <run>-grown and rerun with prompts.num_train = --grow-to. Printed:
   requests sent and shards written per stage (from the shard records and the store manifest), whether the earlier
   shards are byte-identical and the held-out prompts unchanged.
2. From scratch: the demo recipe (train.epochs of the preset, 6) on the grown data, then tau on the held-out prompts.
3. Warm start: train.init_from = the earlier run's draft, --warm-epochs (2) epochs on the same grown data and tau on
   the same held-out prompts. Printed: both taus with their 95% intervals and the training-time ratio.
Both evaluations use the chain only (eval.tree_topk 1) to save time; everything else is the preset's.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_core.config import preset  # noqa: E402
from eagle3_core.contract.layout import STAGE_DIRS  # noqa: E402
from eagle3_core.pipeline.evaluate_stage import run_evaluate  # noqa: E402
from eagle3_core.pipeline.features_stage import run_features  # noqa: E402
from eagle3_core.pipeline.generation_stage import run_generation  # noqa: E402
from eagle3_core.pipeline.prompts_stage import run_prompts  # noqa: E402
from eagle3_core.pipeline.tokenize_stage import run_tokenize  # noqa: E402
from eagle3_core.pipeline.train_stage import run_train  # noqa: E402
from eagle3_core.pipeline.vocab_stage import run_vocab  # noqa: E402

DATA = tuple(STAGE_DIRS[s] for s in ("prompts", "generation", "tokenize", "features"))   # the data stages' folders


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("shard_*"))}


def _train_eval(cfg, log) -> dict:
    run_vocab(cfg, log=log)
    train = run_train(cfg, log=log)
    ev = run_evaluate(cfg, log=log)["summary"]["trained"]
    return {"train_s": train["seconds"], "tau": ev["tau"], "tau_ci95": ev["tau_ci95"], "epochs": cfg.train.epochs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", default="runs/demo")
    p.add_argument("--grow-to", type=int, default=148)
    p.add_argument("--warm-epochs", type=int, default=2)
    args = p.parse_args()
    base = Path(args.run_dir).resolve()
    grown = base.with_name(base.name + "-grown")
    warm = base.with_name(base.name + "-warm")
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    shutil.rmtree(grown, ignore_errors=True)
    for s in DATA:
        shutil.copytree(base / s, grown / s)
    cfg = preset("demo", grown)
    cfg.prompts.num_train, cfg.eval.tree_topk = args.grow_to, 1
    before = {s: _files(base / s) for s in ("generations", "features")}
    first = json.loads((base / "prompts" / "manifest.json").read_text())
    run_prompts(cfg, log=log)
    t0 = time.time()
    run_generation(cfg, log=log)
    run_tokenize(cfg, log=log)
    run_features(cfg, log=log)
    now = json.loads((grown / "prompts" / "manifest.json").read_text())
    records = [json.loads((grown / "generations" / f).read_text())
               for f in sorted(_files(grown / "generations")) if f.endswith(".json")]
    store = json.loads((grown / "features" / "manifest.json").read_text())
    after = {s: _files(grown / s) for s in ("generations", "features")}
    growth = {
        "train_prompts": [len(first["train_ids"]), len(now["train_ids"])],
        "held_out_unchanged": now["eval_ids"] == first["eval_ids"],
        "train_order_kept": now["train_ids"][:len(first["train_ids"])] == first["train_ids"],
        "requests_sent": sum(r["generated"] for r in records if r["started_at"] >= t0),
        "generation_shards_written": sum(r["started_at"] >= t0 for r in records),
        "generation_shards_new": sorted(set(after["generations"]) - set(before["generations"])),
        "generation_shards_identical": all(after["generations"][k] == v for k, v in before["generations"].items()),
        "feature_shards_extracted": store["shards_extracted"],
        "feature_samples_extracted": sum(e["samples"] for e in store["shards"]
                                         if e["file"] not in before["features"]),
        "feature_shards_identical": all(after["features"][k] == v for k, v in before["features"].items()),
    }
    log(json.dumps({"growth": growth}, indent=1))
    scratch = _train_eval(cfg, log)
    shutil.rmtree(warm, ignore_errors=True)
    for s in DATA:
        shutil.copytree(grown / s, warm / s)
    wcfg = cfg.model_copy(deep=True)
    wcfg.run_dir, wcfg.train.init_from, wcfg.train.epochs = warm, str(base), args.warm_epochs
    warm_r = _train_eval(wcfg, log)
    out = {"growth": growth, "from_scratch": scratch, "warm_start": warm_r,
           "train_time_ratio_warm_over_scratch": warm_r["train_s"] / scratch["train_s"],
           "warm_tau_within_scratch_interval": scratch["tau_ci95"][0] <= warm_r["tau"] <= scratch["tau_ci95"][1]}
    (grown / "growth_warm_start.json").write_text(json.dumps(out, indent=1))
    log(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
