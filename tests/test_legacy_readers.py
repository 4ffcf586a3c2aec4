"""Every reader of older runs is listed in contract.compat.LEGACY_READERS with its removal rule, its docstring says so,
and tests/data/legacy_run (a run an earlier main wrote: tests/data/legacy_run/COMMIT, TRAIN_COMMIT) still holds the
older form each reader it is named for reads, read as that reader reads it."""
from __future__ import annotations

import ast
import importlib
import json
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle3_core.config import load_config
from eagle3_core.config.mix import DataMix, SourceSpec
from eagle3_core.contract.compat import (
    LEGACY_READERS,
    LEGACY_RUN,
    content_key_before_loss_mask,
    shard_backend,
)
from eagle3_core.contract.manifest import file_intact, read_manifest
from eagle3_core.data.held_out import content_digest, digests_from_files
from eagle3_core.data.prompt_set import earlier_prompts, prompt_digest
from eagle3_core.features.on_policy import sources_of
from eagle3_core.features.store import content_key, entry_holds, refuse_mixed_backends
from eagle3_core.generation.regenerate import prompt_digests
from eagle3_core.pipeline.features_stage import feature_shard_done, feature_shards
from eagle3_core.pipeline.generation_stage import generation_key, generation_shard_done, generation_shards
from eagle3_core.pipeline.prompts_stage import routes_stale
from eagle3_core.pipeline.table import STAGES, inputs_key, stage_done

ROOT = Path(__file__).resolve().parent.parent
# names or docstrings that mark a function as reading what an earlier version wrote
NAME_MARK = re.compile(r"(^|_)older(_|$)|_v4$|_before_")
DOC_MARK = re.compile(r"written before|from before")
# marked functions that are no reader of older runs, with the reason
NOT_READERS = {
    "pipeline.stage.no_older_keys": "the empty rule of a stage whose key formula never changed",
    "pipeline.report_numbers.stage_times": "'written before' this flow run's start: skipped stages, not older runs",
    "pipeline.train_stage._plateau_ceilings": "a key rule (fields at their defaults out of the key), no older data",
    "config.train_config.DraftConfig.key_fields": "a key rule (fields at their defaults out of the key), no older data",
}


def _readers() -> dict[str, list]:
    """{reader name: the LEGACY_READERS entries naming it}."""
    out = {}
    for entry in LEGACY_READERS:
        for name in entry.readers:
            out.setdefault(name, []).append(entry)
    return out


def _functions():
    """(name under eagle3_core, e.g. 'pipeline.stage.no_older_keys' or 'config.train_config.Class.method', docstring)
    of every function of the package."""
    for path in sorted((ROOT / "eagle3_core").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT / "eagle3_core").with_suffix("").parts)
        for node in ast.parse(path.read_text()).body:
            members = node.body if isinstance(node, ast.ClassDef) else [node]
            prefix = f"{node.name}." if isinstance(node, ast.ClassDef) else ""
            for f in members:
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{module}.{prefix}{f.name}", ast.get_docstring(f) or ""


def test_every_reader_exists_and_its_docstring_states_its_removal_rule():
    for name, entries in _readers().items():
        module, func = name.rsplit(".", 1)
        doc = getattr(importlib.import_module(f"eagle3_core.{module}"), func).__doc__ or ""
        assert "LEGACY_READERS" in doc, f"{name}: its docstring names no removal rule (compat.LEGACY_READERS)"
        for entry in entries:
            assert entry.since in doc and entry.since in entry.remove_when, (name, entry.name, entry.since)
    assert len({e.name for e in LEGACY_READERS}) == len(LEGACY_READERS)


def test_every_function_marked_as_reading_older_runs_is_listed():
    """A function named (older, _v4, _before_) or documented ('written before', 'from before') as reading what an
    earlier version wrote is a listed reader, names the listed reader it applies, or is in NOT_READERS."""
    readers = _readers()
    short = {name.rsplit(".", 1)[1] for name in readers}
    pointing = {name for name, doc in _functions() if "LEGACY_READERS" in doc}
    assert pointing == set(readers), f"docstrings naming LEGACY_READERS without an entry: {pointing - set(readers)}"
    unlisted = [name for name, doc in _functions()
                if (NAME_MARK.search(name.rsplit(".", 1)[1]) or DOC_MARK.search(doc)) and name not in readers
                and name not in NOT_READERS and not any(re.search(rf"\b{s}\b", doc) for s in short)]
    assert not unlisted, f"readers of older runs missing from compat.LEGACY_READERS: {unlisted}"
    marked = {name for name, doc in _functions() if NAME_MARK.search(name.rsplit(".", 1)[1]) or DOC_MARK.search(doc)}
    assert set(NOT_READERS) <= marked, f"NOT_READERS names no marked function: {set(NOT_READERS) - marked}"


def test_every_test_named_to_exercise_a_reader_exists():
    for entry in LEGACY_READERS:
        for where in entry.exercised_by:
            if where == LEGACY_RUN:
                assert (ROOT / LEGACY_RUN / "COMMIT").exists()
                continue
            path, test = where.split("::")
            assert re.search(rf"^def {test}\(", (ROOT / path).read_text(), re.M), where


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    """(config, run dir) of a copy of tests/data/legacy_run."""
    copy = tmp_path_factory.mktemp("legacy") / "legacy"
    shutil.copytree(ROOT / LEGACY_RUN, copy)
    cfg = load_config(copy / "config.json")
    cfg.run_dir = copy / "run"
    return cfg, cfg.run_dir


def _store(run: Path) -> tuple[dict, list[dict]]:
    store = read_manifest(run / "features" / "manifest.json")
    return store, store["shards"]


def _parts(run: Path, entries: list[dict]) -> list[list[dict]]:
    rows = {r["id"]: r for r in pq.read_table(run / "tokenized" / "train.parquet").to_pylist()}
    return [[rows[i] for i in e["ids"]] for e in entries]


def _record_without_mtime(cfg, run):
    store, entries = _store(run)
    assert entries and not any("mtime_ns" in e for e in entries)
    assert all(file_intact(run / "features" / e["file"], e) for e in entries)


def _content_key_before_loss_masks(cfg, run):
    store, entries = _store(run)
    args = (store["aux_layer_ids"], store["format"], store["target_id"])
    for e, part in zip(entries, _parts(run, entries), strict=True):
        assert e["content_key"] != content_key(part, *args)
        assert e["content_key"] == content_key_before_loss_mask(part, *args)
        assert entry_holds(run / "features", e, part, *args)


def _head_naming_the_stage_key(cfg, run):
    head = json.loads((run / "features" / "head.json").read_text())
    assert head["inputs_key"] == inputs_key(cfg, "features")
    assert all(feature_shard_done(cfg, i) for i in feature_shards(cfg))


def _prompts_without_prompt_sha256(cfg, run):
    path = run / "prompts" / "train.parquet"
    assert "prompt_sha256" not in pq.read_schema(path).names
    ids, digests, _ = prompt_digests(path)
    assert digests == [prompt_digest(r) for r in pq.read_table(path).to_pylist()] and len(ids) == len(digests)


def _generation_records_keyed_by_the_stage(cfg, run):
    records = [json.loads(p.read_text()) for p in sorted((run / "generations").glob("shard_*.json"))]
    assert records and all(r["inputs_key"] == generation_key(cfg) and "rows_sha256" not in r for r in records)
    assert all(generation_shard_done(cfg, k) for k in generation_shards(cfg))


def _keys_before_result_only(cfg, run):
    for stage in ("prompts", "train"):
        held = read_manifest(run / STAGES[stage].directory / "manifest.json")["inputs_key"]
        up = {u: read_manifest(run / STAGES[u].directory / "manifest.json")["inputs_key"]
              for u in STAGES[stage].upstream}
        assert held != inputs_key(cfg, stage) and held in STAGES[stage].older(cfg, up), stage
        assert stage_done(cfg, stage), stage


def _entries_without_backend(cfg, run):
    store, entries = _store(run)
    assert "backend" not in store and not any("backend" in e for e in entries)
    assert {shard_backend(e, store) for e in entries} == {"hf"}
    refuse_mixed_backends(entries, store, "hf", False, run / "features")
    with pytest.raises(ValueError, match="hf"):
        refuse_mixed_backends(entries, store, "hf_tp", False, run / "features")


def _prompts_without_digests(cfg, run):
    manifest = read_manifest(run / "prompts" / "manifest.json")
    earlier = earlier_prompts(manifest, cfg.prompts)
    assert earlier is not None and earlier["eval_digests"] is None and earlier["train_digests"] is None
    filled = digests_from_files(earlier, run / "prompts" / "eval.parquet", run / "prompts" / "train.parquet")
    rows = {r["id"]: r for name in ("eval", "train")
            for r in pq.read_table(run / "prompts" / f"{name}.parquet").to_pylist()}
    for name in ("eval", "train"):
        assert filled[f"{name}_digests"] == [content_digest(json.loads(rows[i]["messages"]))
                                             for i in earlier[f"{name}_ids"]] != []


def _tokenized_without_source(cfg, run):
    path = run / "tokenized" / "train.parquet"
    assert "source" not in pq.read_schema(path).names
    ids = pq.read_table(path, columns=["id"]).column("id").to_pylist()
    assert sources_of([{"id": i} for i in ids]) == {i: "human-eval" for i in ids}


def _prompts_without_kept_routes(cfg, run):
    manifest = read_manifest(run / "prompts" / "manifest.json")
    assert "kept_routes" not in manifest and routes_stale(cfg, manifest) == []
    keep = SourceSpec(path=str(run / "prompts" / "train.parquet"), mode="keep")
    kept = cfg.model_copy(update={"prompts": cfg.prompts.model_copy(update={"mix": DataMix(sources=[keep])})})
    assert routes_stale(kept, manifest) == ["kept_routes"]


# each LEGACY_READERS entry the legacy run is named for: the older form the fixture holds, read by its reader
LEGACY_RUN_CHECKS = {
    "record without mtime_ns": _record_without_mtime,
    "content key before loss masks": _content_key_before_loss_masks,
    "head.json naming the stage key": _head_naming_the_stage_key,
    "prompts without prompt_sha256": _prompts_without_prompt_sha256,
    "generation records keyed by the whole stage": _generation_records_keyed_by_the_stage,
    "stage keys before result-only keys": _keys_before_result_only,
    "shard entries without their backend": _entries_without_backend,
    "prompts manifests without digests": _prompts_without_digests,
    "tokenized rows without source": _tokenized_without_source,
    "prompts manifests without kept_routes": _prompts_without_kept_routes,
}


def test_the_legacy_run_has_a_check_for_each_reader_it_is_named_for():
    assert set(LEGACY_RUN_CHECKS) == {e.name for e in LEGACY_READERS if LEGACY_RUN in e.exercised_by}


@pytest.mark.parametrize("name", sorted(LEGACY_RUN_CHECKS))
def test_the_legacy_run_holds_what_each_reader_reads(legacy, name):
    LEGACY_RUN_CHECKS[name](*legacy)
