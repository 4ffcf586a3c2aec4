"""The `hf_tp` features backend (eagle3_core/features/tp_extract.py) on CPU: tiny random-weight targets sharded
over 2 gloo ranks under a real torchrun with transformers' tensor-parallel plan (and its expert-parallel plan for
the MoE families) store the same samples, tokens, layers and head as the one-process `hf` backend, with features
equal within one bf16 rounding; a SIGKILLed rank leaves only intact shards listed and a rerun finishes.

Tolerance, and why: the stores hold bf16. The sharded forward sums the row-wise projections' partial products in
another order than the unsharded one, so the fp32 hidden states differ by a few 1e-6 (measured at most 1.3e-5
absolute on values up to 11 with these weights, tiny Llama); bf16 rounding then turns a difference near a
rounding boundary into one bf16 step. Allowed: |a - b| <= 1e-4 + 2^-7 |b| (one bf16 ulp, relative) per element;
measured: most elements are bit-identical (asserted: at least 95%), the argmax token equal everywhere.
"""
import pytest

from eagle3_core.contract.manifest import read_manifest, sha256_file
from eagle3_core.features.store import bad_shards
from eagle3_core.pipeline.features_stage import feature_status, run_features
from eagle3_core.target.loading import load_target_config
from eagle3_core.target.memory import BYTES_PER_PARAM, meta_model, param_bytes_per_rank
from conftest import assert_ranks_left_cleanly
from feature_stores import assert_same_samples, features_run, kill_a_rank_then_rerun, run_one_thread
from tiny_targets import build
from tokenized_rows import random_rows

SHARD_KEYS = ("file", "ids", "tokens", "samples", "content_key")
# (family, expert_parallel): plain TP for the dense target and one MoE, EP (experts whole per rank) for the others
CASES = [("llama", False), ("qwen3_moe", False), ("qwen3_moe", True), ("deepseek_v3", True), ("kimi_k25", False)]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """stores(family, expert_parallel) -> (one-process cfg, tp cfg, tp log lines), each built once: 5 rows of 5-24
    tokens in 3 shards of 2."""
    root = tmp_path_factory.mktemp("tp")
    targets, made = {}, {}

    def get(fam: str, ep: bool):
        if fam not in targets:
            targets[fam] = build(fam, root / "targets" / fam)
            one = features_run(root / fam / "one", targets[fam], random_rows(5))
            run_one_thread(one)
            targets[fam, "one"] = one
        if (fam, ep) not in made:
            tp = features_run(root / fam / f"tp_ep{int(ep)}", targets[fam], random_rows(5), backend="hf_tp",
                              tp_size=2, expert_parallel=ep)
            lines = []
            run_features(tp, log=lines.append)
            made[fam, ep] = (targets[fam, "one"], tp, lines)
        return made[fam, ep]
    return get


@pytest.mark.slow
@pytest.mark.parametrize(("fam", "ep"), CASES, ids=[f"{f}-{'ep' if e else 'tp'}" for f, e in CASES])
def test_sharded_target_stores_the_one_process_features(stores, fam, ep):
    one, tp, lines = stores(fam, ep)
    d1, d2 = one.run_dir / "features", tp.run_dir / "features"
    m1, m2 = read_manifest(d1 / "manifest.json"), read_manifest(d2 / "manifest.json")
    assert m2["complete"] and m2["tp_size"] == 2 and m2["expert_parallel"] == ep and not bad_shards(d2, m2["shards"])
    assert [{k: s[k] for k in SHARD_KEYS} for s in m1["shards"]] == [{k: s[k] for k in SHARD_KEYS}
                                                                     for s in m2["shards"]]
    for k in ("store_version", "format", "aux_layer_ids", "hidden_size", "target_id", "samples", "tokens", "bytes"):
        assert m1[k] == m2[k], k
    assert sha256_file(d1 / "head.safetensors") == sha256_file(d2 / "head.safetensors")
    assert any("rank 1/2 ran 3 forwards" in x for x in lines), lines[-20:]
    assert_ranks_left_cleanly(lines, 2)
    # what check counts per rank (parallel_fit, from the config on the meta device) is what the rank holds
    held = [x for x in lines if "rank 1/2 holds" in x][0].split("holds ")[1].split()[0]
    counted = param_bytes_per_rank(meta_model(load_target_config(tp.target)), 2, ep) // BYTES_PER_PARAM
    assert int(held) == counted
    assert_same_samples(d1, d2, fam)
    # the stage's cache: a rerun with the same inputs launches nothing
    again = []
    run_features(tp, log=again.append)
    assert again == []
    # the store's own records (head.json, written by rank 0 through the store's writer) say every shard is done:
    # the next flow run plans no shard and loads no target
    assert feature_status(tp) == {"shards": [0, 1, 2], "done": [0, 1, 2], "per_shard": False}


@pytest.mark.slow
def test_a_killed_rank_leaves_only_intact_shards_and_a_rerun_finishes(stores, tmp_path):
    """Rank 1 SIGKILLed at its 3rd forward (shard 2 of 4) while rank 0 writes: the run fails, every shard the
    manifest lists passes its sha256, and the normal rerun extracts the rest, giving the uninterrupted store."""
    _, ref, _ = stores("llama", False)
    rows = random_rows(5) + random_rows(8)[5:]
    for i, r in enumerate(rows):
        r["id"] = f"k{i}"
    cfg = features_run(tmp_path / "run", ref.target.model, rows, backend="hf_tp", tp_size=2)
    manifest = kill_a_rank_then_rerun(cfg, "hf")
    assert [s["ids"] for s in manifest["shards"]] == [[f"k{i}", f"k{i + 1}"] for i in range(0, 8, 2)]


@pytest.mark.slow
def test_the_features_task_launches_torchrun_and_streams_every_rank_into_the_run_log(stores, prefect_server,
                                                                                      tmp_path):
    """tasks.distributed.features_tp_task in a flow: the store is written and both ranks' lines are in the task
    run's log (read back through the Prefect API)."""
    from prefect import flow

    from prefect_api import logs_of
    from tasks.distributed import features_tp_task
    _, ref, _ = stores("llama", False)
    cfg = features_run(tmp_path / "run", ref.target.model, random_rows(5), backend="hf_tp", tp_size=2)

    @flow
    def f():
        return features_tp_task(cfg, return_state=True)

    state = f()
    assert state.result()["complete"]
    msgs = logs_of(state.state_details.task_run_id, "rank 1/2 ran 3 forwards")
    assert any("rank 0/2 holds" in m for m in msgs) and any("rank 1/2 ran 3 forwards" in m for m in msgs)
    assert (cfg.run_dir / "features" / "torchrun.log").read_text().count("holds") == 2
