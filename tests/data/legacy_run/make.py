"""Write the legacy-run fixture: the data stages (prompts, generation, tokenize, features, vocab) of a tiny run on
the embedded target, 2 prompts in 2 generation and 2 feature shards, as a given checkout of this repository writes
them. tests/test_verify.py checks that today's code recognises such a run as done (no stage recomputed, no shard
redone). The target's head.safetensors (113 MB of embedding rows, read by training only) is left out.

    cd <checkout of the commit to freeze> && .venv/bin/python /path/to/tests/data/legacy_run/make.py OUT_DIR

OUT_DIR gets config.json (the run's PipelineConfig, run_dir relative) and run/ (the stage directories).

    cd <checkout of a later commit> && .venv/bin/python /path/to/tests/data/legacy_run/make.py --train OUT_DIR

adds the train stage to OUT_DIR as that checkout writes it (the fixture's draft/ came from the commit in
TRAIN_COMMIT, before the keys hashed results only): head.safetensors written again from the target for training,
then deleted with everything in draft/ but its manifest (the export and checkpoints: ~150 MB, read by no done
check).
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

from eagle3_core.config import preset  # noqa: E402
from eagle3_core.pipeline.features_stage import run_features  # noqa: E402
from eagle3_core.pipeline.generation_stage import (  # noqa: E402
    finish_generation,
    generation_servers,
    generation_shards,
    run_generation_shard,
)
from eagle3_core.pipeline.prompts_stage import run_prompts  # noqa: E402
from eagle3_core.pipeline.tokenize_stage import run_tokenize  # noqa: E402
from eagle3_core.pipeline.vocab_stage import run_vocab  # noqa: E402


def main(out: Path) -> None:
    cfg = preset("debug_tiny", out / "run")
    cfg.prompts.num_train, cfg.prompts.num_eval = 2, 1
    cfg.generation.max_new_tokens, cfg.generation.shard_size = 16, 1
    cfg.features.shard_samples = 1
    run_prompts(cfg)
    with generation_servers(cfg) as urls:
        records = [run_generation_shard(cfg, k, urls=urls) for k in generation_shards(cfg)]
    finish_generation(cfg, records)
    run_tokenize(cfg)
    run_features(cfg)
    run_vocab(cfg)
    (cfg.run_dir / "features" / "head.safetensors").unlink()
    for junk in [*cfg.run_dir.rglob("*.log"), cfg.run_dir / ".eagle3-run.lock"]:
        junk.unlink(missing_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    data = json.loads(cfg.model_dump_json())
    data["run_dir"] = "run"
    (out / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / "COMMIT").write_text(commit + "\n")
    shutil.rmtree(cfg.run_dir / ".prefect", ignore_errors=True)


def add_train(out: Path) -> None:
    from eagle3_core.config import load_config
    from eagle3_core.features.extract import HFExtractor
    from eagle3_core.features.store import write_head
    from eagle3_core.pipeline.train_stage import run_train
    from eagle3_core.target.loading import load_target
    cfg = load_config(out / "config.json")
    cfg.run_dir = out / "run"
    write_head(HFExtractor(load_target(cfg.target)), cfg.run_dir / "features", None)
    run_train(cfg)
    (cfg.run_dir / "features" / "head.safetensors").unlink()
    for p in (cfg.run_dir / "draft").iterdir():
        if p.name != "manifest.json":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (out / "TRAIN_COMMIT").write_text(commit + "\n")


if __name__ == "__main__":
    if sys.argv[1] == "--train":
        add_train(Path(sys.argv[2]).resolve())
    else:
        main(Path(sys.argv[1]).resolve())
