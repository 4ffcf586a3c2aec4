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


# --- the held-out set frozen by content (the prompts stage's manifest keeps each row's content digest)

def _gsm8k_rows(n: int, start: int = 0) -> list[dict]:
    lines = (SHARED_DATA / "gsm8k" / "train.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines[start:start + n]]


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _prompts(cfg, lines=None) -> dict:
    run_prompts(cfg, log=(lines.append if lines is not None else lambda *_: None))
    return json.loads((cfg.run_dir / "prompts" / "manifest.json").read_text())


def _questions(run_dir, name) -> list[str]:
    return [r["messages"][0]["content"] for r in prompts_mod.read_rows(run_dir / "prompts" / f"{name}.parquet")]


def _id_less_run(tmp_path, rows, num_train=8, num_eval=3):
    cfg = preset("debug_tiny", run_dir=tmp_path / "run")
    cfg.prompts.sources = [_write(tmp_path / "src.jsonl", rows)]
    cfg.prompts.num_train, cfg.prompts.num_eval = num_train, num_eval
    return cfg


def test_rows_prepended_to_an_id_less_source_keep_its_held_out_prompts_held_out(tmp_path):
    """The leak of issue 42: ids were row positions, so rows added at the top of an id-less file renamed every row
    and both held-out prompts went to training. Ids now come from the content: the same rows keep their ids, the
    held-out set is kept, and no prompt trained on before is held out."""
    base = _gsm8k_rows(20, start=100)
    cfg = _id_less_run(tmp_path, base)
    first = _prompts(cfg)
    held, trained = _questions(cfg.run_dir, "eval"), _questions(cfg.run_dir, "train")
    assert first["eval_digests"] and len(first["train_digests"]) == 8
    _write(tmp_path / "src.jsonl", _gsm8k_rows(5, start=0) + base)       # 5 new rows at the top
    cfg.prompts.num_train = 13
    lines = []
    grown = _prompts(cfg, lines)
    assert grown["eval_ids"] == first["eval_ids"] and _questions(cfg.run_dir, "eval") == held
    assert grown["train_ids"][:8] == first["train_ids"] and _questions(cfg.run_dir, "train")[:8] == trained
    assert not set(_questions(cfg.run_dir, "eval")) & set(trained)
    assert grown["stats"]["eval_chosen"] == "kept from the earlier run" and grown["eval_set"] == first["eval_set"]
    assert any("held-out set kept from the earlier run" in x for x in lines)


def test_a_deleted_held_out_row_is_replaced_by_one_never_trained_on_and_the_log_says_so(tmp_path):
    """Deleting a held-out row used to move an earlier train prompt into the held-out set. Now the other held-out
    rows stay, the new one is a prompt the earlier run never trained on, and the log names the row that went."""
    base = _gsm8k_rows(20, start=100)
    cfg = _id_less_run(tmp_path, base)
    first = _prompts(cfg)
    held, trained = _questions(cfg.run_dir, "eval"), _questions(cfg.run_dir, "train")
    gone = held[1]
    _write(tmp_path / "src.jsonl", [r for r in base if r["question"] != gone])
    lines = []
    second = _prompts(cfg, lines)
    now = _questions(cfg.run_dir, "eval")
    assert len(now) == 3 and {held[0], held[2]} <= set(now) and gone not in now
    assert not set(now) & set(trained)                                   # no trained prompt held out
    assert _questions(cfg.run_dir, "train")[:8] == trained                # the train prompts keep their order
    how = second["stats"]["eval_chosen"]
    assert how.startswith("re-chosen: 2 of the earlier run's 3 held-out prompts kept, 1 added that it never "
                          "trained on; 1 gone") and "not comparable" in how
    assert second["stats"]["eval_lost"] == [{"id": first["eval_ids"][1], "why": "no longer a usable row of the "
                                             "sources (deleted, rejected, filtered or a duplicate)"}]
    assert any(x.startswith(f"prompts: WARNING earlier held-out prompt {first['eval_ids'][1]}") for x in lines)
    assert second["eval_set"] != first["eval_set"]


def test_an_id_whose_content_changed_is_another_prompt_and_the_held_out_set_is_re_chosen(tmp_path):
    rows = [{"id": f"q{i}", **r} for i, r in enumerate(_gsm8k_rows(20, start=100))]
    cfg = _id_less_run(tmp_path, rows)
    first = _prompts(cfg)
    victim = first["eval_ids"][0].split("/", 1)[1]
    trained = _questions(cfg.run_dir, "train")
    _write(tmp_path / "src.jsonl", [{**r, "question": r["question"] + " Show your work."} if r["id"] == victim
                                    else r for r in rows])
    second = _prompts(cfg)
    assert second["stats"]["eval_lost"] == [{"id": first["eval_ids"][0], "why": "its content changed"}]
    assert second["stats"]["eval_chosen"].startswith("re-chosen: 2 of the earlier run's 3")
    assert not set(_questions(cfg.run_dir, "eval")) & set(trained)


def test_more_held_out_prompts_are_taken_from_prompts_never_trained_on(tmp_path):
    """Raising num_eval used to take the front of the stable order, where the earlier train rows stand."""
    cfg = _id_less_run(tmp_path, _gsm8k_rows(20, start=100))
    first = _prompts(cfg)
    trained = _questions(cfg.run_dir, "train")
    cfg.prompts.num_eval = 5
    second = _prompts(cfg)
    assert second["eval_ids"][:3] == first["eval_ids"] and len(second["eval_ids"]) == 5
    assert not set(_questions(cfg.run_dir, "eval")) & set(trained)
    assert set(second["train_ids"]) >= set(first["train_ids"])
    cfg.prompts.eval_ids = [*second["eval_ids"][:4], first["train_ids"][0]]        # a trained prompt pinned
    with pytest.raises(ValueError, match=r"prompts.eval_ids: 1 id\(s\) are prompts this run's earlier prompts "
                                         r"stage put in training"):
        run_prompts(cfg, log=lambda *_: None)


def test_a_run_from_before_content_ids_keeps_its_held_out_prompts_by_content(tmp_path):
    """A prompts manifest written before digests were kept, with row-position ids (what main wrote for id-less
    sources): its held-out and train rows are found again by content in its prompts files, keep their names, and
    rows added at the top of the file do not move a trained prompt into the held-out set."""
    base = _gsm8k_rows(20, start=100)
    cfg = _id_less_run(tmp_path, base)
    _prompts(cfg)
    out = cfg.run_dir / "prompts"
    position = {r["question"]: f"src/{i}" for i, r in enumerate(base)}         # the old scheme's ids
    manifest = json.loads((out / "manifest.json").read_text())
    for name in ("train", "eval"):
        rows = prompts_mod.read_rows(out / f"{name}.parquet")
        rows = [{**r, "id": position[r["messages"][0]["content"]]} for r in rows]
        prompts_mod.write_rows(out / f"{name}.parquet", rows)
        manifest[f"{name}_ids"] = [r["id"] for r in rows]
        del manifest[f"{name}_digests"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    held, trained = _questions(cfg.run_dir, "eval"), _questions(cfg.run_dir, "train")
    _write(tmp_path / "src.jsonl", _gsm8k_rows(5, start=0) + base)
    cfg.prompts.num_train = 13
    grown = _prompts(cfg)
    assert grown["eval_ids"] == manifest["eval_ids"] and _questions(cfg.run_dir, "eval") == held
    assert grown["train_ids"][:8] == manifest["train_ids"] and _questions(cfg.run_dir, "train")[:8] == trained
    assert grown["stats"]["ids_taken_back"] == 11 and grown["stats"]["eval_chosen"] == "kept from the earlier run"
    new = [i for i in grown["train_ids"][8:]]
    assert all(len(i.split("/")[1]) == 16 for i in new)                         # new rows: content ids
