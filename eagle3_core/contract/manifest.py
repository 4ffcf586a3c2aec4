"""Stage manifests: small JSON files written atomically (temp name, fsync, rename), the data contract between stages (docs/architecture.md)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see either the old file or the complete new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    write_atomic(path, json.dumps(manifest, indent=2, sort_keys=True, default=str).encode())
    return manifest


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest at `path`, or None if the stage has not finished there."""
    path = Path(path)
    if not path.exists():
        return None
    return json.loads(path.read_text())


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_stamp(path: Path) -> dict[str, int]:
    """What a data file's record keeps besides its sha256, read when the file is written: {'bytes': size in bytes,
    'mtime_ns': st_mtime_ns}, so that later done checks cost a stat() (file_intact), not a read."""
    st = Path(path).stat()
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def file_intact(path: Path, record: dict[str, Any], checksum: bool = False) -> bool:
    """Whether the data file at `path` still holds what `record` (its manifest entry: 'sha256', and 'bytes' and
    'mtime_ns' from file_stamp) says was written.

    The rule every done check uses (data on disk is the source of truth, docs/architecture.md; 9 TB of features must not be
    re-read to learn that nothing changed): the file exists, has the recorded size and the recorded modification
    time -> intact, nothing read. Its sha256 is computed (the whole file read) only when `checksum` is True (the
    explicit `python -m eagle3_core.verify`), when the record has no mtime_ns (written before this rule), or when
    the mtime differs (a copy that kept the bytes passes, an edit does not). A change that keeps size and mtime
    (a flipped bit with the timestamp put back) is found by verify only.
    A record without mtime_ns is a run's written before bc5e252: nothing to remove, it takes the changed-mtime path
    (compat.LEGACY_READERS)."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    if record.get("bytes") is not None and st.st_size != record["bytes"]:
        return False
    if not checksum and record.get("mtime_ns") == st.st_mtime_ns:
        return True
    return sha256_file(path) == record.get("sha256")


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def cached_manifest(path: Path, key: str) -> dict[str, Any] | None:
    """The stage manifest at `path` if it was written for the same inputs `key`, else None (recompute)."""
    manifest = read_manifest(path)
    if manifest is not None and manifest.get("inputs_key") == key:
        return manifest
    return None


def shard_records(folder: Path) -> list[dict]:
    """Every shard record (shard_*.json) in `folder`, in shard order; [] where the folder does not exist."""
    return [json.loads(p.read_text()) for p in sorted(Path(folder).glob("shard_*.json"))]


def busy_seconds(records: list[dict]) -> float:
    """Wall seconds during which at least one of `records` ran: the length of the union of their
    [started_at, ended_at] intervals (Unix time, s), so that shards run side by side count once and the idle time
    between a failed attempt and its retry not at all. A record without both times adds its own `seconds` (s)."""
    spans = sorted((r["started_at"], r["ended_at"]) for r in records if "started_at" in r and "ended_at" in r)
    total = sum(r["seconds"] for r in records if not ("started_at" in r and "ended_at" in r))
    end = float("-inf")
    for a, b in spans:
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total
