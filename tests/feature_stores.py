"""Feature stores written by the torchrun backends (tests/test_tp_extract.py 'hf_tp', test_int4_experts.py
'ep_int4', test_sglang_backend.py 'sglang') and checked against the one-process 'hf' store: the run directory they
start from, the reference run, the comparison within one bf16 rounding, and a rank SIGKILLed mid-run
(tests/kill_worker.py) followed by the normal rerun.

Tolerance, and why: tests/test_tp_extract.py's docstring (|a - b| <= 1e-4 + 2^-7 |b| per element, one bf16 step)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3_core.config import FeatureConfig, PipelineConfig, TargetConfig
from eagle3_core.contract.manifest import read_manifest
from eagle3_core.distributed.launch import TorchrunError, run_torchrun
from eagle3_core.features.reader import load_samples
from eagle3_core.features.store import bad_shards
from eagle3_core.pipeline.features_stage import run_features
from tokenized_rows import write_tokenized

KILL_WORKER = Path(__file__).parent / "kill_worker.py"


def features_run(root: Path, target_dir, rows: list[dict], **features) -> PipelineConfig:
    """A run at `root` whose tokenize stage is done with `rows`, over the target at `target_dir`: max_length 64,
    shards of 2 samples, batches of 64 tokens, `features` (FeatureConfig fields) on top."""
    # random tokens are not what the random target writes: the on-policy gate (test_history) off
    cfg = PipelineConfig(run_dir=root, target=TargetConfig(model=str(target_dir)),
                         features=FeatureConfig(max_length=64, shard_samples=2, batch_tokens=64,
                                                **{"min_on_policy": 0.0, **features}))
    write_tokenized(root, rows, inputs_key="tp-rows", samples=len(rows))
    return cfg


def run_one_thread(cfg: PipelineConfig) -> dict:
    """run_features(cfg) on one CPU thread, as each torchrun rank (OMP_NUM_THREADS=1), so the kernels match the
    ranks'; the thread count is restored afterwards. Returns the features manifest."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_features(cfg, log=lambda s: None)
    finally:
        torch.set_num_threads(threads)


def assert_same_samples(ref: Path, got: Path, label: str, bit_identical: float | None = 0.95) -> None:
    """The stores at `ref` and `got` hold the same samples in the same order: ids, input_ids, loss masks and argmax
    tokens equal, aux and final within one bf16 rounding (`label` names the case in a failure), and at least the
    `bit_identical` share of their elements bit-identical (None: not asserted)."""
    same, total = 0, 0
    for a, b in zip(load_samples(ref), load_samples(got), strict=True):
        assert a["id"] == b["id"] and torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["loss_mask"], b["loss_mask"])
        assert torch.equal(a["target_top1"], b["target_top1"]), a["id"]
        for k in ("aux", "final"):
            torch.testing.assert_close(b[k], a[k], atol=1e-4, rtol=2 ** -7, msg=f"{label} {a['id']} {k}")
            same += int((a[k] == b[k]).sum())
            total += a[k].numel()
    if bit_identical is not None:
        assert same >= bit_identical * total, f"{same} of {total} elements bit-identical"


def kill_a_rank_then_rerun(cfg: PipelineConfig, extractor: str, **launch) -> dict:
    """Run cfg's features over 2 ranks under torchrun with rank 1 SIGKILLed at its 3rd forward (tests/kill_worker.py
    patching `extractor`'s forward; `launch`: more run_torchrun arguments) into a store of 4 shards: the run fails,
    leaving fewer than 4 shards listed, each passing its sha256; the normal rerun keeps them and extracts only the
    rest. Returns the rerun's manifest."""
    out = cfg.run_dir / "features"
    out.mkdir(parents=True)
    (out / "tp_config.json").write_text(cfg.model_dump_json())
    lines = []
    with pytest.raises(TorchrunError):
        run_torchrun([str(KILL_WORKER), "--extractor", extractor, "--kill-at", "3", "--config",
                      str(out / "tp_config.json")], 2, on_line=lines.append, grace_s=10, **launch)
    killed = read_manifest(out / "manifest.json")
    assert killed is not None and not killed["complete"] and 1 <= len(killed["shards"]) < 4, lines[-20:]
    assert bad_shards(out, killed["shards"]) == []
    manifest = run_features(cfg, log=lines.append)
    assert manifest["complete"] and len(manifest["shards"]) == 4 and not bad_shards(out, manifest["shards"])
    assert {s["file"] for s in killed["shards"]} <= {s["file"] for s in manifest["shards"]}
    assert manifest["shards_extracted"] == 4 - len(killed["shards"])
    return manifest
