"""Done checks cost metadata, full verification is a command: a shard's record keeps its size and mtime, a rerun
compares those (no read), and `python -m eagle3_core.verify` reads every shard in full, names a flipped bit that
kept size and mtime, and with --quarantine makes the next run redo exactly that shard."""
import json
import os
import shutil
from pathlib import Path

import pytest

from eagle3_core import verify
from eagle3_core.contract.manifest import file_intact, file_stamp, sha256_file
from eagle3_core.features.reader import load_samples
from eagle3_core.features.store import bad_shards, extract_features
from test_features import _rows


def _flip_keeping_stamp(path: Path, offset: int = -10) -> None:
    """A silent corruption: one bit flipped in place, size and mtime put back (what a bad disk or a copy tool
    that restores timestamps leaves)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_size == st.st_size


def test_file_intact_reads_only_when_the_stamp_disagrees(tmp_path):
    f = tmp_path / "a.bin"
    f.write_bytes(b"x" * 1000)
    rec = {"sha256": sha256_file(f), **file_stamp(f)}
    assert rec["bytes"] == 1000 and file_intact(f, rec)
    _flip_keeping_stamp(f)
    assert file_intact(f, rec)                                   # metadata only: the flip is not seen...
    assert not file_intact(f, rec, checksum=True)                # ...the full check sees it
    legacy = {"sha256": rec["sha256"], "bytes": 1000}            # a record written before mtime_ns was kept
    assert not file_intact(f, legacy)                            # is checked by sha256
    f.write_bytes(b"x" * 1000)                                   # same bytes, new mtime (a copy): still intact
    assert file_intact(f, rec) and file_intact(f, legacy)
    f.write_bytes(b"x" * 999)
    assert not file_intact(f, rec)                               # other size: no read needed to say so
    f.unlink()
    assert not file_intact(f, rec)


def test_verify_finds_a_silent_flip_and_quarantine_redoes_that_shard_only(target_model, tokenizer, tmp_path,
                                                                           capsys):
    run = tmp_path / "run"
    store = run / "features"
    rows = _rows(tokenizer, 6)
    first = extract_features(target_model, rows, store, [1, 14, 26], shard_samples=2, batch_tokens=512)
    for e in first["shards"]:
        assert (e["bytes"], e["mtime_ns"]) == tuple(file_stamp(store / e["file"]).values())
    assert verify.main([str(run)]) == 0
    assert "3 features shards" in capsys.readouterr().out
    victim = store / "shard_00001.safetensors"
    _flip_keeping_stamp(victim)
    assert bad_shards(store, first["shards"]) == []               # the done check does not read the data
    assert len(load_samples(store)) == 6
    assert verify.main([str(run)]) == 1
    assert str(victim) in capsys.readouterr().err
    assert verify.main([str(run), "--quarantine"]) == 1
    assert not victim.exists() and victim.with_name(victim.name + ".corrupt").exists()
    mtimes = {e["file"]: (store / e["file"]).stat().st_mtime_ns for e in first["shards"] if e["file"] != victim.name}
    again = extract_features(target_model, rows, store, [1, 14, 26], shard_samples=2, batch_tokens=512)
    assert again["shards_extracted"] == 1
    assert {f: (store / f).stat().st_mtime_ns for f in mtimes} == mtimes    # the others were not rewritten
    assert verify.main([str(run)]) == 0
    assert verify.main([str(tmp_path / "nowhere")]) == 2


@pytest.mark.slow
def test_a_no_op_rerun_of_the_end_to_end_run_reads_no_shard(e2e_run):
    """The whole pipeline again on finished inputs (the session's end-to-end run, real Prefect and llama.cpp):
    every done check is a stat, so the kernel reports no read() and no open() of any generation or feature shard
    (inotify, which sees every read system call on a watched directory's files). Control: hashing one shard
    afterwards is seen."""
    from inotify_simple import INotify, flags

    from flows.pipeline import eagle3_pipeline
    cfg, _ = e2e_run
    dirs = {cfg.run_dir / "features": "shard_*.safetensors", cfg.run_dir / "generations": "shard_*.parquet"}
    shards = {p.name for d, pattern in dirs.items() for p in d.glob(pattern)}
    assert len(shards) >= 4
    with INotify() as watch:
        for d in dirs:
            watch.add_watch(str(d), flags.ACCESS | flags.OPEN)
        state = eagle3_pipeline(cfg, return_state=True)
        assert state.is_completed()
        touched = {(e.name, str(flags.from_mask(e.mask))) for e in watch.read(timeout=500) if e.name in shards}
        assert touched == set(), f"a no-op rerun opened or read shard files: {sorted(touched)}"
        one = next((cfg.run_dir / "features").glob("shard_*.safetensors"))
        sha256_file(one)
        seen = {e.name for e in watch.read(timeout=500) if flags.ACCESS in flags.from_mask(e.mask)}
        assert one.name in seen                                   # the instrument sees a read when there is one


LEGACY = Path(__file__).resolve().parent / "data" / "legacy_run"


def test_a_run_written_by_an_earlier_main_is_recognised(tmp_path):
    """tests/data/legacy_run: the data stages of a tiny run as main wrote them before shard records kept their
    mtime (commit in its COMMIT file), and its train stage as main wrote it before the keys hashed results only
    (TRAIN_COMMIT; tests/data/legacy_run/make.py wrote both). Today's code finds every stage and shard done
    (records without mtime_ns are checked by sha256; the prompts and train manifests hold their older key formula,
    contract.compat), a rerun of the stages rewrites nothing, and the stages below train key on the key its
    manifest holds."""
    from eagle3_core.config import load_config
    from eagle3_core.pipeline.features_stage import feature_shard_done, feature_shards, run_features
    from eagle3_core.pipeline.generation_stage import generation_shard_done, generation_shards
    from eagle3_core.pipeline.prompts_stage import run_prompts
    from eagle3_core.pipeline.table import STAGES, inputs_key, stage_done
    from eagle3_core.pipeline.tokenize_stage import run_tokenize
    from eagle3_core.pipeline.train_stage import run_train
    from eagle3_core.pipeline.vocab_stage import run_vocab
    shutil.copytree(LEGACY, tmp_path / "legacy")
    cfg = load_config(tmp_path / "legacy" / "config.json")
    cfg.run_dir = tmp_path / "legacy" / "run"
    entries = json.loads((cfg.run_dir / "features" / "manifest.json").read_text())["shards"]
    assert len(entries) == 2 and not any("mtime_ns" in e for e in entries)          # the earlier record format
    trained = json.loads((cfg.run_dir / "draft" / "manifest.json").read_text())
    assert trained["inputs_key"] != inputs_key(cfg, "train")                      # the older formula's key
    for stage in ("prompts", "generation", "tokenize", "features", "vocab", "train"):
        assert stage_done(cfg, stage), stage
    assert all(generation_shard_done(cfg, k) for k in generation_shards(cfg))
    assert all(feature_shard_done(cfg, i) for i in feature_shards(cfg))
    before = {p: p.read_bytes() for p in cfg.run_dir.rglob("*") if p.is_file()}
    for run in (run_prompts, run_tokenize, run_features, run_vocab, run_train):
        run(cfg, log=lambda *_: None)
    assert {p: p.read_bytes() for p in cfg.run_dir.rglob("*") if p.is_file()} == before
    up = {"train": trained["inputs_key"], "prompts": json.loads((cfg.run_dir / "prompts" / "manifest.json")
                                                                  .read_text())["inputs_key"]}
    assert inputs_key(cfg, "evaluate") == STAGES["evaluate"].key(cfg, up)
    changed = cfg.model_copy(update={"train": cfg.train.model_copy(update={"lr": 1e-4})})
    assert not stage_done(changed, "train") and stage_done(changed, "vocab")       # a field in the key: redone
    corrupt = cfg.run_dir / "features" / entries[1]["file"]
    _flip_keeping_stamp(corrupt)
    assert not feature_shard_done(cfg, 1) and feature_shard_done(cfg, 0)   # no stamp: hashed


def test_a_shard_is_reused_only_for_the_same_loss_masks(target_model, tokenizer, tmp_path):
    """The shards store each sample's loss mask and training reads it from there: rows whose tokens are equal but
    whose mask changed (another generation.turns, a fixed template) must not be served from the old shard."""
    rows = _rows(tokenizer, 4)
    extract_features(target_model, rows, tmp_path, [1, 14, 26], shard_samples=2, batch_tokens=512)
    changed = [dict(r) for r in rows]
    changed[3]["loss_mask"] = [1] * len(rows[3]["input_ids"])
    assert changed[3]["loss_mask"] != list(rows[3]["loss_mask"])
    again = extract_features(target_model, changed, tmp_path, [1, 14, 26], shard_samples=2, batch_tokens=512)
    assert again["shards_extracted"] == 1
    assert load_samples(tmp_path)[3]["loss_mask"].tolist() == [True] * len(rows[3]["input_ids"])


def test_the_generation_stage_function_redoes_a_shard_quarantine_moved_aside(tmp_path, capsys):
    """verify --quarantine says the next run redoes the shard: run_generation (the stage function, not only the
    Prefect flow's shard tasks) did not, returning its manifest. Rows in mode 'keep' (no server) in 3 shards."""
    from conftest import SHARED_DATA
    from eagle3_core.config import PromptConfig, preset
    from eagle3_core.config.mix import DataMix, SourceSpec
    from eagle3_core.pipeline.generation_stage import run_generation
    from eagle3_core.pipeline.prompts_stage import run_prompts
    cfg = preset("debug_tiny", run_dir=tmp_path / "run")
    cfg.prompts = PromptConfig(mix=DataMix(sources=[SourceSpec(path=str(SHARED_DATA / "gsm8k" / "train.jsonl"),
                                                               mode="keep", max_rows=40)]), num_train=6, num_eval=2)
    cfg.generation.shard_size = 2
    run_prompts(cfg, log=lambda *_: None)
    first = run_generation(cfg, log=lambda *_: None)
    out = cfg.run_dir / "generations"
    victim = out / "shard_00001.parquet"
    before = {p.name: p.read_bytes() for p in out.glob("shard_*.parquet")}
    _flip_keeping_stamp(victim, offset=200)
    assert verify.main([str(cfg.run_dir), "--quarantine"]) == 1
    assert not victim.exists()
    capsys.readouterr()
    lines = []
    again = run_generation(cfg, log=lines.append)
    assert lines[0] == "generation: 2 of 3 shards already finished" and again["samples"] == first["samples"] == 6
    assert {p.name: p.read_bytes() for p in out.glob("shard_*.parquet")} == before
    assert verify.main([str(cfg.run_dir)]) == 0
