"""The one helper around a stage body: skip a done stage (its key and the intact check of its outputs), time the
body, record its output files and write its manifest atomically."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from eagle3_core.contract.manifest import file_intact, file_stamp, read_manifest, sha256_file, write_manifest


def changed_outputs(out: Path, manifest: dict, intact: Callable[[dict], list[str]] | None = None) -> list[str]:
    """Names of the stage's output files that are missing or changed since the manifest in `out` was written: the
    files of its `files` record (manifest.file_intact: size and mtime as recorded, no read; the sha256 where they
    differ), then whatever `intact(manifest)` names (e.g. the feature store's shards: store.bad_shards)."""
    bad = [name for name, rec in (manifest.get("files") or {}).items() if not file_intact(Path(out) / name, rec)]
    return bad + (list(intact(manifest)) if intact is not None else [])


def done_manifest(out: Path, keys: Sequence[str], intact: Callable[[dict], list[str]] | None = None,
                  log=None) -> dict | None:
    """The manifest of the stage written in `out` if the stage is done: it holds one of `keys` (the current inputs
    key first, then the older formulas of it that the stage still accepts, contract.compat) and its outputs are
    intact (changed_outputs). None: the stage must run; `log` (if given) names the changed outputs."""
    manifest = read_manifest(Path(out) / "manifest.json")
    if manifest is None or manifest.get("inputs_key") not in keys:
        return None
    if (bad := changed_outputs(out, manifest, intact)):
        if log is not None:
            log(f"{Path(out).name}: {bad} missing or changed since written; running the stage again")
        return None
    return manifest


def record_outputs(out: Path, names: Sequence[str]) -> dict[str, dict]:
    """{name: {sha256, bytes, mtime_ns}} of the files `names` (relative to `out`) that exist: what a manifest's
    `files` holds, read back by changed_outputs."""
    return {n: {"sha256": sha256_file(Path(out) / n), **file_stamp(Path(out) / n)} for n in names
            if (Path(out) / n).is_file()}


def run_stage(out: Path, key: str, body: Callable[[], dict], accepted: Sequence[str] = (),
              intact: Callable[[dict], list[str]] | None = None, outputs: Sequence[str] = (),
              write: Callable[[Path, dict], dict] = write_manifest, log=None) -> dict:
    """The manifest of the stage written in `out` for inputs `key`.

    Done (done_manifest over `key` and the `accepted` older keys, outputs intact): the manifest on disk, `body` not
    called. Otherwise `body()`'s dict plus inputs_key, seconds (the body's wall time, unless the body says its own:
    the features stage sums its shard tasks) and, for the `outputs` (file
    names relative to `out`) the body wrote, their `files` record; written atomically to out/manifest.json by
    `write` (manifest.write_manifest; the feature store passes its own writer, store.write_record, so that its
    manifest has one writer)."""
    if (m := done_manifest(out, [key, *accepted], intact, log)):
        return m
    t0 = time.monotonic()
    manifest = body()
    files = {"files": record_outputs(out, outputs)} if outputs else {}
    return write(Path(out) / "manifest.json", {"seconds": time.monotonic() - t0, **manifest, "inputs_key": key,
                                               **files})
