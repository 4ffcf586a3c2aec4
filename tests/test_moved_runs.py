"""Runs that move keep their work: a run trained on a GPU node (packed rows) is done on a CPU box, a run directory
copied elsewhere reads its own files, and a night with a lower prompts.num_train deletes no generation shard."""
from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from conftest import SHARED_DATA
from eagle3_core.config import preset
from eagle3_core.contract.layout import RunLayout
from eagle3_core.contract.manifest import write_manifest
from eagle3_core.contract.run_stage import record_outputs
from eagle3_core.contract.shard_plan import rows_digest
from eagle3_core.pipeline.generation_stage import (
    generation_plan,
    generation_shard_key,
    generation_shards,
    prompt_rows,
)
from eagle3_core.pipeline.prompts_stage import run_prompts
from eagle3_core.pipeline.table import inputs_key, stage_done
from eagle3_core.pipeline.train_stage import EXPORT_FILES, run_train

PINNED = json.loads((SHARED_DATA / "stage_keys.json").read_text())["configs"]


def _finished(run_dir, stage: str, key: str, outputs=(), **fields) -> None:
    out = RunLayout(run_dir).stage_dir(stage)
    for name in outputs:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(f"{stage} {name}".encode())
    write_manifest(out / "manifest.json", {"inputs_key": key, **fields, "files": record_outputs(out, outputs)})


def test_a_demo_run_trained_with_packed_rows_on_a_gpu_is_done_on_a_cpu_host(tmp_path, monkeypatch):
    """The demo's train stage as main keyed it on a CUDA host ('auto' batching resolved to packed rows: the pinned
    key) is done on a CPU host, where 'auto' would train padded batches: run_train returns its manifest without
    training, and the evaluate stage keyed on it stays done too."""
    cfg, pinned = preset("demo", tmp_path / "run"), PINNED["demo"]["cuda"]
    assert pinned["train"][0] != PINNED["demo"]["cpu"]["train"][0]          # the host did change the key
    for stage in ("prompts", "features", "vocab"):
        _finished(cfg.run_dir, stage, pinned[stage][0])
    _finished(cfg.run_dir, "train", pinned["train"][0], [n.removeprefix("draft/") for n in EXPORT_FILES],
              export_dir="draft/export")
    _finished(cfg.run_dir, "evaluate", pinned["evaluate"][0], summary={})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = (cfg.run_dir / "draft" / "manifest.json").read_bytes()
    assert stage_done(cfg, "train") and inputs_key(cfg, "train") != pinned["train"][0]
    assert run_train(cfg, log=lambda *_: None)["inputs_key"] == pinned["train"][0]
    assert (cfg.run_dir / "draft" / "manifest.json").read_bytes() == before
    assert not (cfg.run_dir / "draft" / "inputs_key").exists()                 # no training directory claimed
    assert stage_done(cfg, "evaluate") and inputs_key(cfg, "evaluate") == pinned["evaluate"][0]


def test_stored_paths_are_relative_to_the_run_directory_and_resolve_under_a_copy(tmp_path):
    """A manifest stores paths relative to the run directory; a copy of the run directory resolves them to its own
    files, and so does a path an older manifest stored absolute or relative to where the run started."""
    old = RunLayout(tmp_path / "gpu" / "runs" / "demo")
    (old.draft_export).mkdir(parents=True)
    stored = old.relative(old.draft_export)
    assert stored == "draft/export"
    shutil.copytree(old.run_dir, tmp_path / "cpu" / "demo")
    shutil.rmtree(tmp_path / "gpu")
    new = RunLayout(tmp_path / "cpu" / "demo")
    for value in (stored, str(old.draft_export), "runs/demo/draft/export"):
        assert new.stored(value) == new.draft_export, value
    assert str(new.stored("/elsewhere/model")) == "/elsewhere/model"          # not a path of a run: as stored


def test_the_prompts_rejects_path_is_stored_relative_and_read_under_a_copy(tmp_path, monkeypatch):
    """The prompts stage's manifest names its rejects file relative to the run directory (as the train stage its
    export, the evaluate stage its report): a run started from another working directory and copied elsewhere finds
    it under the copy."""
    monkeypatch.chdir(tmp_path)
    cfg = preset("debug_tiny", "runs/demo")
    cfg.prompts.sources = [str(SHARED_DATA / "gsm8k" / "train.jsonl")]
    manifest = run_prompts(cfg, log=lambda *_: None)
    assert manifest["rejects"] == "prompts/rejects.jsonl"
    shutil.copytree(tmp_path / "runs" / "demo", tmp_path / "elsewhere" / "demo")
    shutil.rmtree(tmp_path / "runs")
    copy = RunLayout(tmp_path / "elsewhere" / "demo")
    assert copy.stored(manifest["rejects"]) == copy.prompts / "rejects.jsonl"
    assert copy.stored(manifest["rejects"]).exists()
    assert copy.stored("runs/demo/prompts/rejects.jsonl") == copy.prompts / "rejects.jsonl"    # as stored before


def _answered(cfg, shard: int, rows: tuple[int, int]) -> None:
    """A finished generation shard of rows [a, b) of the prompt file, as its record and file name them."""
    ids, digests, _ = prompt_rows(cfg)
    out = RunLayout(cfg.run_dir).generations
    out.mkdir(parents=True, exist_ok=True)
    a, b = rows
    pq.write_table(pa.table({"id": ids[a:b], "response": ["answer"] * (b - a)}), out / f"shard_{shard:05d}.parquet")
    (out / f"shard_{shard:05d}.json").write_text(json.dumps({
        "inputs_key": generation_shard_key(cfg), "prompts": b - a, "rows_sha256": rows_digest(ids[a:b], digests[a:b]),
        "file": f"shard_{shard:05d}.parquet"}))


def test_a_night_with_a_lower_num_train_deletes_no_generation_shard(tmp_path):
    """debug_tiny on GSM8K: 10 prompts answered in shards of 4 (4 + 4 + 2). A night asking for 7 trains on the
    finished shards that fit (8 rows would be 7: shard 1 is cut short, so the plan ends before it: 4 rows) and
    keeps every shard file byte for byte, saying so; asking for 10 again finds all three shards as they were."""
    cfg = preset("debug_tiny", run_dir=tmp_path / "run")
    cfg.prompts.sources, cfg.prompts.num_train = [str(SHARED_DATA / "gsm8k" / "train.jsonl")], 10
    run_prompts(cfg, log=lambda *_: None)
    for k, rows in enumerate([(0, 4), (4, 8), (8, 10)]):
        _answered(cfg, k, rows)
    assert [p[:2] for p in generation_plan(cfg)] == [(0, 4), (4, 8), (8, 10)]
    out = RunLayout(cfg.run_dir).generations
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    cfg.prompts.num_train = 7
    run_prompts(cfg, log=lambda *_: None)
    lines = []
    assert generation_shards(cfg, lines.append) == [0] and [p[:2] for p in generation_plan(cfg)] == [(0, 4)]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files
    assert len(lines) == 1 and "2 more on disk (shards 1..2" in lines[0] and "not deleted" in lines[0]
    cfg.prompts.num_train = 10
    run_prompts(cfg, log=lambda *_: None)
    assert generation_shards(cfg, lines.append) == [0, 1, 2] and len(lines) == 1
    assert [p[:2] for p in generation_plan(cfg)] == [(0, 4), (4, 8), (8, 10)]


def test_replay_recordings_extract_through_the_features_backend_and_a_rerun_extracts_nothing(tmp_path,
                                                                                           target_model):
    """The evaluate stage's replay recordings (features.store_run, no features stage called): the aux states of
    prompt + output are the target's own hidden states at the aux layers (id i = HF hidden_states[i + 1], stored
    in the store's format), and a rerun with the same sequences reads the same store, writing nothing."""
    from eagle3_core.pipeline.evaluate_stage import replay_recordings
    cfg = preset("debug_tiny", run_dir=tmp_path / "run")
    cfg.features.aux_layer_ids = [1, 14, 26]
    prompts, outputs = [[1, 2, 3, 4, 5], [9, 8, 7]], [[10, 11, 12], [6, 5]]
    recs = replay_recordings(cfg, prompts, outputs, log=lambda *_: None)
    for rec, p, g in zip(recs, prompts, outputs):
        with torch.no_grad():
            hs = target_model(torch.tensor([p + g]), output_hidden_states=True).hidden_states
        want = torch.cat([hs[i + 1][0] for i in (1, 14, 26)], dim=-1).float()
        assert rec["prompt"] == p and rec["tokens"] == g and rec["aux"].shape == want.shape
        assert torch.allclose(rec["aux"], want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    store = cfg.run_dir / "eval" / "replay" / "features"
    stamps = {f.name: f.stat().st_mtime_ns for f in store.iterdir()}
    lines = []
    again = replay_recordings(cfg, prompts, outputs, log=lines.append)
    assert {f.name: f.stat().st_mtime_ns for f in store.iterdir()} == stamps and not lines
    assert all(torch.equal(a["aux"], b["aux"]) for a, b in zip(recs, again))
