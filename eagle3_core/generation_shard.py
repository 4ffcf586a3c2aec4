"""One generation shard on disk: its answers buffered, flushed to part files and merged into the shard file, and
the record that says it is finished (the contract is described in eagle3_core.regenerate)."""
from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .config import GenerationConfig
from .generation_quality import shard_quality
from .manifest import file_intact, file_stamp, sha256_file, write_atomic, write_manifest
from .serving.client import RetryableError

KEY_META = b"eagle3_inputs_key"
MAX_FAILURES_KEPT = 20  # per shard record; the count is always complete


def shard_name(k: int) -> str:
    return f"shard_{k:05d}.parquet"


def _file_key(path: Path) -> str | None:
    meta = pq.read_schema(path).metadata or {}
    return meta.get(KEY_META, b"").decode() or None


def _write_parquet(path: Path, table: pa.Table) -> None:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    write_atomic(path, sink.getvalue().to_pybytes())


def finished_record(out: Path, k: int, key: str) -> dict | None:
    """Shard k's record if the shard is finished for inputs `key` (record and file agree, no failed prompt)."""
    path = out / f"shard_{k:05d}.json"
    if not path.exists():
        return None
    rec = json.loads(path.read_text())
    if rec.get("inputs_key") != key or not rec.get("complete"):
        return None
    return rec if file_intact(out / rec["file"], rec) else None


class ShardWriter:
    """Answers of one shard: buffered, flushed to part files, merged into the shard file by `finalize`."""

    def __init__(self, out: Path, k: int, key: str, schema: pa.Schema, prompts: int, gen: GenerationConfig):
        self.out, self.k, self.key, self.schema, self.prompts, self.gen = out, k, key, schema, prompts, gen
        self.path, self.record_path = out / shard_name(k), out / f"shard_{k:05d}.json"
        self.partial = out / "partial" / f"shard_{k:05d}"
        self.partial.mkdir(parents=True, exist_ok=True)
        self.done_ids: set[str] = set()
        for f in self._files():
            if _file_key(f) != key:                       # written for other inputs: never mixed in
                f.unlink()
            else:
                self.done_ids.update(pq.read_table(f, columns=["id"])["id"].to_pylist())
        parts = [int(p.stem.split("_")[1]) for p in self.partial.glob("part_*.parquet")]
        self.next_part = max(parts, default=-1) + 1
        self.buffer: list[dict] = []
        self.buffer_since = 0.0
        self.failures: list[dict] = []
        self.retry_kinds: Counter = Counter()
        self.resumed = len(self.done_ids)
        self.generated = self.pending = 0
        self.input_done = self.finalized = False
        self.t0, self.started_at = time.monotonic(), time.time()

    def _files(self) -> list[Path]:
        return ([self.path] if self.path.exists() else []) + sorted(self.partial.glob("part_*.parquet"))

    def add(self, row: dict) -> None:
        if not self.buffer:
            self.buffer_since = time.monotonic()
        self.buffer.append(row)
        self.generated += 1
        if len(self.buffer) >= self.gen.flush_rows:
            self.flush()

    def fail(self, row_id: str, reason: str) -> None:
        self.failures.append({"id": row_id, "reason": reason[:1000]})

    def retry(self, error: RetryableError) -> None:
        self.retry_kinds[error.kind] += 1

    def flush(self, older_than_s: float = 0.0) -> None:
        """Write buffered answers to a new part file (atomically), if any waited longer than `older_than_s`."""
        if not self.buffer or time.monotonic() - self.buffer_since < older_than_s:
            return
        _write_parquet(self.partial / f"part_{self.next_part:06d}.parquet",
                       pa.Table.from_pylist(self.buffer, schema=self.schema))
        self.next_part += 1
        self.buffer = []

    def finalize(self) -> dict:
        """Merge the shard file and parts (deduplicated by id, prompt order) into the shard file, write the record,
        delete the parts. Returns the record (small, JSON-able)."""
        self.flush()
        files = self._files()
        changed = any(f != self.path for f in files) or not self.path.exists()
        if changed:
            tables = [pq.read_table(f).cast(self.schema) for f in files]
            table = pa.concat_tables(tables) if tables else self.schema.empty_table()
            ids = table["id"].to_pylist()
            first = {i: n for n, i in reversed(list(enumerate(ids)))}        # first occurrence of each id
            table = table.take(pa.array(sorted(first.values()))).sort_by("index")
            assert len(set(table["id"].to_pylist())) == table.num_rows, f"shard {self.k}: duplicate ids"
            _write_parquet(self.path, table.replace_schema_metadata(self.schema.metadata))
        table = pq.read_table(self.path, columns=["id", "response", "reasoning", "finish_reason",
                                                  "completion_tokens", "turn_requests", "api"])
        finish = Counter(table["finish_reason"].to_pylist())
        # requests per row: turn-by-turn rows say how many, kept rows had none, the others one
        requests = Counter(str(n if n is not None else 0 if api == "kept" else 1) for n, api in
                           zip(table["turn_requests"].to_pylist(), table["api"].to_pylist()))
        record = {"shard": self.k, "inputs_key": self.key, "file": self.path.name, "sha256": sha256_file(self.path),
                  **file_stamp(self.path),
                  "prompts": self.prompts, "answered": table.num_rows, "failed": len(self.failures),
                  "failures": self.failures[:MAX_FAILURES_KEPT], "complete": not self.failures,
                  "generated": self.generated, "resumed": self.resumed, "retries": sum(self.retry_kinds.values()),
                  "retry_kinds": dict(self.retry_kinds), "finish_reasons": dict(finish),
                  "requests_per_row": dict(sorted(requests.items())),
                  "completion_tokens": int(pc.sum(table["completion_tokens"]).as_py() or 0),
                  "quality": shard_quality(table.to_pylist()), "seconds": time.monotonic() - self.t0,
                  "started_at": self.started_at, "ended_at": time.time()}
        assert record["answered"] + record["failed"] == self.prompts, (
            f"shard {self.k}: {record['answered']} answered + {record['failed']} failed != {self.prompts} prompts")
        write_manifest(self.record_path, record)
        shutil.rmtree(self.partial, ignore_errors=True)
        self.finalized = True
        return record
