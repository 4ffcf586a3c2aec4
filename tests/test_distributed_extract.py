"""Extraction with 2 worker processes under a real torchrun (gloo, CPU) writes the same shards, byte for byte, as
the one-process features stage; a worker's missing or corrupt shards are redone on resume."""
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from eagle3_core.config import FeatureConfig, PipelineConfig, TargetConfig
from eagle3_core.contract.manifest import read_manifest, sha256_file, write_manifest
from eagle3_core.features.extract import HFExtractor
from eagle3_core.features.extract_workers import extract_owned, merge_parts
from eagle3_core.pipeline.features_stage import feature_status, run_features, run_features_shard
from eagle3_core.target.loading import load_target
from conftest import assert_ranks_left_cleanly
from tiny_targets import build

SHARD_KEYS = ("file", "sha256", "bytes", "ids", "tokens", "samples", "content_key")


def _run_dir(root, target_dir, rows):
    cfg = PipelineConfig(run_dir=root, target=TargetConfig(model=str(target_dir)),
                         # random tokens are not what the random target writes: the on-policy gate (test_history) off
                         features=FeatureConfig(max_length=64, shard_samples=3, batch_tokens=96, format="bf16",
                                                min_on_policy=0.0))
    (root / "tokenized").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), root / "tokenized" / "train.parquet")
    write_manifest(root / "tokenized" / "manifest.json", {"inputs_key": "eleven-random-rows"})
    return cfg


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """(one-process store, two-worker store, worker output lines) over 11 rows of 5-40 tokens: 4 shards of 3."""
    root = tmp_path_factory.mktemp("extract")
    target = build("llama", root / "target")
    rng = random.Random(0)
    rows = []
    for i in range(11):
        n = rng.randint(5, 40)
        rows.append({"id": f"r{i}", "input_ids": [rng.randrange(128) for _ in range(n)],
                     "loss_mask": [int(t >= n // 2) for t in range(n)]})
    one, two = _run_dir(root / "one", target, rows), _run_dir(root / "two", target, rows)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                          # the workers run one thread each (torchrun's default)
    try:
        run_features(one, log=lambda s: None)
    finally:
        torch.set_num_threads(threads)
    lines = []
    run_features(two, workers=2, log=lines.append)
    return one, two, lines, rows


@pytest.mark.slow
def test_two_workers_write_the_same_shards_as_one_process(stores):
    one, two, lines, _ = stores
    m1, m2 = read_manifest(one.run_dir / "features" / "manifest.json"), read_manifest(two.run_dir / "features" /
                                                                                      "manifest.json")
    assert len(m1["shards"]) == 4 and m2["workers"] == 2 and m2["complete"]
    assert [{k: s[k] for k in SHARD_KEYS} for s in m1["shards"]] == [{k: s[k] for k in SHARD_KEYS}
                                                                     for s in m2["shards"]]
    for k in ("store_version", "format", "aux_layer_ids", "hidden_size", "target_id", "samples", "tokens", "bytes",
              "inputs_key"):
        assert m1[k] == m2[k], k
    head = "head.safetensors"
    assert sha256_file(one.run_dir / "features" / head) == sha256_file(two.run_dir / "features" / head)
    assert any("rank 0/2: 2 of my 2 shards extracted" in x for x in lines)
    assert any("rank 1/2: 2 of my 2 shards extracted" in x for x in lines)
    assert_ranks_left_cleanly(lines, 2)
    # rank 1 owned shards 1 and 3 (round robin)
    part = read_manifest(two.run_dir / "features" / "parts" / "rank_00001.json")
    assert [s["file"] for s in part["shards"]] == ["shard_00001.safetensors", "shard_00003.safetensors"]
    # the stage's cache: a rerun with the same inputs launches nothing
    again = []
    run_features(two, workers=2, log=again.append)
    assert again == []


def test_the_next_run_accepts_the_workers_store_without_loading_the_target(stores, monkeypatch):
    """The workers' store carries head.json (rank 0's merge goes through the store's one writer): the next run's
    plan finds every shard done, each shard task and the stage return at once, and no target is loaded."""
    from eagle3_core.pipeline.features_stage import store_key
    from eagle3_core.target import loading
    _, two, _, _ = stores
    out = two.run_dir / "features"
    merged = read_manifest(out / "manifest.json")
    assert read_manifest(out / "head.json") == {"inputs_key": store_key(two), "target_id": merged["target_id"]}
    assert {e["backend"] for e in merged["shards"]} == {"hf"}

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded")
    monkeypatch.setattr(loading, "load_target", no_target)
    assert feature_status(two) == {"shards": [0, 1, 2, 3], "done": [0, 1, 2, 3], "per_shard": True}
    assert [run_features_shard(two, k, log=lambda s: None)["extracted"] for k in range(4)] == [False] * 4
    assert run_features(two, log=lambda s: None) == merged


def test_a_workers_missing_and_corrupt_shards_are_redone(stores, tmp_path):
    """Rank 1's shard 1 deleted and shard 3 corrupted: rank 1 extracts exactly those again (in this process),
    and the merged manifest equals the first one."""
    _, two, _, rows = stores
    out = two.run_dir / "features"
    before = read_manifest(out / "manifest.json")
    (out / "shard_00001.safetensors").unlink()
    with open(out / "shard_00003.safetensors", "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)
    model = load_target(two.target)
    ex = HFExtractor(model)
    header = {k: before[k] for k in ("store_version", "format", "aux_layer_ids", "hidden_size", "target",
                                     "target_id", "samples", "store_key")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        logged = []
        part = extract_owned(ex, rows, out, 3, 96, "bf16", 1, 2, before["target_id"], header, log=logged.append)
    finally:
        torch.set_num_threads(threads)
    assert part["shards_extracted"] == 2 and "2 of my 2 shards extracted" in logged[0]
    after = merge_parts(out, 2)
    assert [s["sha256"] for s in after["shards"]] == [s["sha256"] for s in before["shards"]]
    untouched = extract_owned(ex, rows, out, 3, 96, "bf16", 0, 2, before["target_id"], header, log=logged.append)
    assert untouched["shards_extracted"] == 0
