"""A stage's output files in its manifest: their record when written (record_outputs) and which of them are missing
or changed since (changed_outputs); the done decision and the manifest's writing around a stage body that use them
are pipeline.run's."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from eagle3_core.contract.manifest import file_intact, file_stamp, sha256_file


def changed_outputs(out: Path, manifest: dict, intact: Callable[[dict], list[str]] | None = None) -> list[str]:
    """Names of the stage's output files that are missing or changed since the manifest in `out` was written: the
    files of its `files` record (manifest.file_intact: size and mtime as recorded, no read; the sha256 where they
    differ), then whatever `intact(manifest)` names (e.g. the feature store's shards: store.bad_shards)."""
    bad = [name for name, rec in (manifest.get("files") or {}).items() if not file_intact(Path(out) / name, rec)]
    return bad + (list(intact(manifest)) if intact is not None else [])


def record_outputs(out: Path, names: Sequence[str]) -> dict[str, dict]:
    """{name: {sha256, bytes, mtime_ns}} of the files `names` (relative to `out`) that exist: what a manifest's
    `files` holds, read back by changed_outputs."""
    return {n: {"sha256": sha256_file(Path(out) / n), **file_stamp(Path(out) / n)} for n in names
            if (Path(out) / n).is_file()}
