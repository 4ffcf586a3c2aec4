"""Growing a run: raising prompts.num_train in the same run directory regenerates and extracts only the new prompts
(real llama-server, the embedded target), and every finished shard, the held-out set and the earlier train order
stay as they were."""
import json

import pyarrow.parquet as pq
import pytest

from conftest import SHARED_DATA
from eagle3_core.config import preset
from eagle3_core.contract.shard_plan import append_only_ranges
from eagle3_core.data import prompt_set as prompts_mod
from eagle3_core.pipeline.features_stage import feature_status, run_features
from eagle3_core.pipeline.generation_stage import generation_status, run_generation
from eagle3_core.pipeline.prompts_stage import run_prompts
from eagle3_core.pipeline.tokenize_stage import run_tokenize

GSM8K = str(SHARED_DATA / "gsm8k" / "train.jsonl")


def test_append_only_ranges_keep_a_shard_only_where_its_rows_still_are():
    assert append_only_ranges(6, 4, lambda k, a: None) == [(0, 4), (4, 6)]
    earlier = {0: (0, 4), 1: (4, 6)}                         # a 6-row run's shards, grown to 12 rows

    def kept(k, start):
        return earlier[k][1] - earlier[k][0] if k in earlier and earlier[k][0] == start else None
    assert append_only_ranges(12, 4, kept) == [(0, 4), (4, 6), (6, 10), (10, 12)]
    assert append_only_ranges(5, 4, kept) == [(0, 4), (4, 5)]           # shard 1's rows are no longer all there
    assert append_only_ranges(0, 4, kept) == []


def _bytes(folder, pattern):
    return {p.name: p.read_bytes() for p in sorted(folder.glob(pattern))}


def _data_stages(cfg):
    for run in (run_prompts, run_generation, run_tokenize, run_features):
        run(cfg, log=lambda *_: None)


@pytest.mark.slow
def test_growing_debug_tiny_from_6_to_12_prompts_does_only_the_new_ones(tmp_path):
    cfg = preset("debug_tiny", run_dir=tmp_path / "run")
    cfg.prompts.sources = [GSM8K]
    _data_stages(cfg)
    run = cfg.run_dir
    gen_before, feat_before = _bytes(run / "generations", "shard_*"), _bytes(run / "features", "shard_*")
    first = json.loads((run / "prompts" / "manifest.json").read_text())
    held_out = prompts_mod.read_rows(run / "prompts" / "eval.parquet")
    assert len(first["train_ids"]) == 6 and sorted(gen_before) == [
        "shard_00000.json", "shard_00000.parquet", "shard_00001.json", "shard_00001.parquet"]

    cfg.prompts.num_train = 12
    _data_stages(cfg)
    grown = json.loads((run / "prompts" / "manifest.json").read_text())
    assert grown["train_ids"][:6] == first["train_ids"] and len(set(grown["train_ids"])) == 12
    assert grown["eval_ids"] == first["eval_ids"]                               # held-out set unchanged
    assert prompts_mod.read_rows(run / "prompts" / "eval.parquet") == held_out
    # generation: the two earlier shards (4 + 2 prompts) untouched, the 6 new prompts in two new shards
    gen_after = _bytes(run / "generations", "shard_*")
    assert {k: gen_after[k] for k in gen_before} == gen_before
    records = [json.loads(gen_after[f"shard_{k:05d}.json"]) for k in range(4)]
    assert [(r["start"], r["prompts"]) for r in records] == [(0, 4), (4, 2), (6, 4), (10, 2)]
    assert [r["generated"] for r in records[2:]] == [4, 2] and sum(r["resumed"] for r in records[2:]) == 0
    new_ids = {i for s in ("shard_00002.parquet", "shard_00003.parquet")
               for i in pq.read_table(run / "generations" / s, columns=["id"])["id"].to_pylist()}
    assert new_ids == set(grown["train_ids"][6:])
    assert json.loads((run / "generations" / "manifest.json").read_text())["samples"] == 12
    # features: the first 6 samples' shards byte-identical, only the new samples extracted
    feat_after = _bytes(run / "features", "shard_*")
    assert {k: feat_after[k] for k in feat_before} == feat_before
    store = json.loads((run / "features" / "manifest.json").read_text())
    assert [e["samples"] for e in store["shards"]] == [4, 2, 4, 2] and store["samples"] == 12
    assert store["shards_extracted"] == 2
    assert [i for e in store["shards"][2:] for i in e["ids"]] == grown["train_ids"][6:]
    assert feature_status(cfg) == {"shards": [0, 1, 2, 3], "done": [0, 1, 2, 3]}
    assert generation_status(cfg)["done"] == [0, 1, 2, 3]


def test_a_larger_sample_is_a_superset_with_the_same_held_out_set():
    """Without an earlier run: the stable order (sha256 of seed and id) makes the 12-prompt sample contain the
    6-prompt one and give it the same held-out rows; another seed gives another sample."""
    from eagle3_core.config import PromptConfig

    def ids(**kw):
        train, evals, _ = prompts_mod.build_prompts(PromptConfig(sources=[GSM8K], num_eval=2, **kw))
        return [r["id"] for r in train], [r["id"] for r in evals]
    (small, small_eval), (large, large_eval) = ids(num_train=6), ids(num_train=12)
    assert set(small) < set(large) and small_eval == large_eval
    assert set(ids(num_train=6, seed=1)[0]) != set(small)
