"""One generation shard on disk: its answers buffered, flushed to part files and merged into the shard file, and
the record that says it is finished (the contract is described in eagle3_core.generation.regenerate)."""
from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle3_core.config import GenerationConfig
from eagle3_core.contract.manifest import file_intact, file_stamp, sha256_file, write_atomic, write_manifest
from eagle3_core.generation.quality import shard_quality
from eagle3_core.serving.client import RetryableError

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


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` cast to `schema`, with null columns for the schema's columns it lacks (answers flushed by a version
    that wrote fewer answer fields, e.g. before `turn_prompt_ids`): nothing answered is lost to a new column."""
    for f in schema:
        if f.name not in table.column_names:
            table = table.append_column(f, pa.nulls(table.num_rows, f.type))
    return table.select(schema.names).cast(schema)


def finished_record(out: Path, k: int, key: str, rows_sha256: str | None = None) -> dict | None:
    """Shard k's record if the shard is finished for inputs `key` (record and file agree, no failed prompt) and,
    given `rows_sha256`, was written for exactly those rows (shard_plan.rows_digest)."""
    path = out / f"shard_{k:05d}.json"
    if not path.exists():
        return None
    rec = json.loads(path.read_text())
    if rec.get("inputs_key") != key or not rec.get("complete"):
        return None
    if rows_sha256 is not None and rec.get("rows_sha256") != rows_sha256:
        return None
    return rec if file_intact(out / rec["file"], rec) else None


def holds_more_rows(out: Path, k: int, ids: list[str], keys: tuple[str, ...]) -> bool:
    """Whether shard k, planned for the rows `ids`, is a shard written for one of `keys` for more rows than that,
    those rows among them (a prompt set cut short by a lower prompts.num_train): rewriting it for `ids` would drop
    answers already paid for, so the plan ends before it and its files stay (pipeline.generation_stage)."""
    path, record = out / shard_name(k), out / f"shard_{k:05d}.json"
    if not path.exists() or not record.exists():
        return False
    rec = json.loads(record.read_text())
    if rec.get("inputs_key") not in keys or (rec.get("prompts") or 0) <= len(ids):
        return False
    return set(ids) <= set(pq.read_table(path, columns=["id"])["id"].to_pylist())


def held_files(out: Path, key: str) -> list[Path]:
    """The held answer files of the generation stage at `out` written for inputs `key` (AnswerShardWriter)."""
    return [f for f in sorted((out / "held").glob("*.parquet")) if _file_key(f) == key]


def hold_other_rows(path: Path, key: str, rows: dict[str, tuple[int, str]]) -> Path | None:
    """Copy shard file `path` to `held/` (named by its content's digest) if it was written for inputs `key` and
    holds answers to rows other than `rows` (id -> (index, prompt digest)): rewriting it for `rows` would drop
    them. Returns the copy (None: nothing to hold). Held files are never deleted (shards run side by side read
    them; they hold only answer text)."""
    if not path.exists() or _file_key(path) != key or "prompt_sha256" not in pq.read_schema(path).names:
        return None
    t = pq.read_table(path, columns=["id", "prompt_sha256"])
    if all(i in rows and rows[i][1] == d for i, d in zip(t["id"].to_pylist(), t["prompt_sha256"].to_pylist())):
        return None
    copy = path.parent / "held" / f"{path.stem}.{sha256_file(path)[:16]}.parquet"
    if not copy.exists():
        copy.parent.mkdir(exist_ok=True)
        shutil.copyfile(path, copy.with_suffix(".tmp"))
        copy.with_suffix(".tmp").replace(copy)
    return copy


class AnswerShardWriter:
    """Answers of one shard: buffered, flushed to part files, merged into the shard file by `finalize`."""

    def __init__(self, out: Path, k: int, key: str, schema: pa.Schema, rows: dict[str, tuple[int, str]],
                 gen: GenerationConfig, rows_sha256: str | None = None):
        """rows: the shard's prompt rows, id -> (row index in the prompt file, prompts.prompt_digest): answers in
        the shard's files for other rows, or for an id whose prompt changed, are never counted or kept in it; a
        shard file for the same inputs holding answers to other rows (a lower prompts.num_train ending inside it)
        is copied to `held/` first, and every shard reads the held answers to its rows (nothing paid for is lost).
        rows_sha256: the rows' digest, written into the record (shard_plan.rows_digest)."""
        self.out, self.k, self.key, self.schema, self.gen = out, k, key, schema, gen
        self.rows, self.prompts, self.rows_sha256 = rows, len(rows), rows_sha256
        self.path, self.record_path = out / shard_name(k), out / f"shard_{k:05d}.json"
        self.partial = out / "partial" / f"shard_{k:05d}"
        self.partial.mkdir(parents=True, exist_ok=True)
        hold_other_rows(self.path, key, rows)
        self.done_ids: set[str] = set()
        for f in self._files() + held_files(out, key):
            if _file_key(f) != key or "prompt_sha256" not in pq.read_schema(f).names:
                f.unlink()                                # written for other inputs: never mixed in
            else:
                t = pq.read_table(f, columns=["id", "prompt_sha256"])
                self.done_ids.update(i for i, d in zip(t["id"].to_pylist(), t["prompt_sha256"].to_pylist())
                                     if i in rows and rows[i][1] == d)
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

    def _answer_files(self) -> list[Path]:
        """The files `finalize` merges: the shard's own, then the held answers (only those to its rows count)."""
        return self._files() + held_files(self.out, self.key)

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
        files = self._answer_files()
        changed = any(f != self.path for f in files) or not self.path.exists() or \
            pq.read_table(self.path, columns=["id"])["id"].to_pylist() != sorted(self.done_ids,
                                                                                 key=lambda i: self.rows[i][0])
        if changed:
            tables = [conform(pq.read_table(f), self.schema) for f in files]
            table = pa.concat_tables(tables) if tables else self.schema.empty_table()
            ids, digests = table["id"].to_pylist(), table["prompt_sha256"].to_pylist()
            first = {i: n for n, (i, d) in reversed(list(enumerate(zip(ids, digests))))
                     if i in self.rows and self.rows[i][1] == d}              # first answer of each current row
            table = table.take(pa.array(sorted(first.values(), key=lambda n: self.rows[ids[n]][0]), pa.int64()))
            table = table.set_column(table.schema.get_field_index("index"), "index",
                                     pa.array([self.rows[i][0] for i in table["id"].to_pylist()], pa.int64()))
            assert len(set(table["id"].to_pylist())) == table.num_rows, f"shard {self.k}: duplicate ids"
            _write_parquet(self.path, table.replace_schema_metadata(self.schema.metadata))
        table = pq.read_table(self.path, columns=["id", "response", "reasoning", "finish_reason",
                                                  "completion_tokens", "turn_requests", "api"])
        finish = Counter(table["finish_reason"].to_pylist())
        # requests per row: turn-by-turn rows say how many, kept rows had none, the others one
        requests = Counter(str(n if n is not None else 0 if api == "kept" else 1) for n, api in
                           zip(table["turn_requests"].to_pylist(), table["api"].to_pylist()))
        record = {"shard": self.k, "inputs_key": self.key, "rows_sha256": self.rows_sha256,
                  "start": min((i for i, _ in self.rows.values()), default=0),
                  "file": self.path.name, "sha256": sha256_file(self.path),
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
