"""Regeneration: answer prompt rows with the target on inference servers, into resumable Parquet shards.

Shard k holds the prompts at rows [k * shard_size, (k + 1) * shard_size) of the prompt file. In the output folder:
  shard_{k:05d}.parquet   the answered rows of shard k in prompt order (written atomically, once the shard is done)
  shard_{k:05d}.json      its record: inputs key, sha256 of the Parquet file, counts, failures (id, reason),
                          retries, quality counts with examples
  partial/shard_{k:05d}/part_*.parquet   answers flushed while the shard runs (every flush_rows answers or
                          flush_s seconds), merged into the shard file when its last prompt has an outcome
A shard is finished when its record names the current inputs key, the Parquet file's sha256 matches and no prompt
failed. A rerun leaves finished shards untouched and sends, in the others, only the prompts not yet answered: a run
killed at any moment ends, once rerun, with every prompt answered exactly once. Every file carries the inputs key in
its Parquet metadata; files of other inputs are deleted, never mixed in.

Memory: prompts stream from Parquet in batches through a queue of 2 x concurrency; only open shards keep state
(their answered ids and unflushed rows), so memory does not grow with the number of prompts.

What is sent: the conversation up to its final assistant turn (which the target regenerates). Rows with
`mode == "keep"` are passed through whole, no request: `messages` holds the full conversation (every assistant turn
is trained) and `response`/`reasoning` its final turn (finish_reason 'kept').
"""
from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .config import GenerationConfig, ServerConfig
from .generation_quality import shard_quality
from .manifest import sha256_file, write_atomic, write_manifest
from .serving.client import (
    TOKEN_ID_APIS,
    RequestRejected,
    RetryableError,
    request_body,
    request_with_retries,
)
from .serving.launcher import ServerError
from .serving.pool import ServerPool

KEY_META = b"eagle3_inputs_key"
MAX_FAILURES_KEPT = 20  # per shard record; the count is always complete
# columns the regeneration adds to each prompt row (`messages` becomes what was sent, as JSON text)
ANSWER_FIELDS = [("index", pa.int64()), ("response", pa.string()), ("reasoning", pa.string()),
                 ("finish_reason", pa.string()), ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
                 ("prompt_ids", pa.list_(pa.int32())), ("output_ids", pa.list_(pa.int32())), ("model", pa.string()),
                 ("server", pa.string()), ("api", pa.string()), ("attempts", pa.int32()), ("latency_s", pa.float64()),
                 ("timings", pa.string())]


def shard_name(k: int) -> str:
    return f"shard_{k:05d}.parquet"


def num_shards(prompts_path: Path, shard_size: int) -> int:
    rows = pq.ParquetFile(prompts_path).metadata.num_rows
    return -(-rows // shard_size)


def output_schema(prompts_path: Path, key: str) -> pa.Schema:
    """The prompt file's columns (`messages` as JSON text) followed by ANSWER_FIELDS; the inputs key as metadata."""
    names = {n for n, _ in ANSWER_FIELDS}
    fields = [pa.field("messages", pa.string()) if f.name == "messages" else f
              for f in pq.read_schema(prompts_path) if f.name not in names]
    return pa.schema(fields + [pa.field(n, t) for n, t in ANSWER_FIELDS], metadata={KEY_META: key.encode()})


def iter_prompt_rows(path: Path, start: int, stop: int, batch_rows: int = 256) -> Iterator[tuple[int, dict]]:
    """(row index, row) for rows [start, stop) of a Parquet prompt file, read in batches: whole row groups before
    `start` are skipped unread, and memory holds one batch, not the file (buffered stream, no pre-buffering)."""
    f = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)
    groups, first = [], 0
    for g in range(f.metadata.num_row_groups):
        n = f.metadata.row_group(g).num_rows
        if first + n > start and first < stop:
            groups.append(g)
        elif not groups:
            first += n
    index = first
    for batch in f.iter_batches(batch_size=batch_rows, row_groups=groups):
        for row in batch.to_pylist():
            if index >= stop:
                return
            if index >= start:
                yield index, row
            index += 1


def split_final_answer(messages: list[dict], mode: str | None, where: str) -> tuple[list[dict], dict | None]:
    """(messages to send, the kept final assistant turn or None). Raises ValueError naming `where` when there is
    nothing to answer or (mode 'keep') nothing to keep."""
    if not messages:
        raise ValueError(f"{where}: empty conversation")
    prompt, last = (messages[:-1], messages[-1]) if messages[-1].get("role") == "assistant" else (messages, None)
    if mode == "keep":
        if last is None:
            raise ValueError(f"{where}: mode 'keep' but the conversation does not end with an assistant turn")
        return prompt, last
    if not prompt or prompt[-1].get("role") not in ("user", "tool"):
        role = prompt[-1].get("role") if prompt else None
        raise ValueError(f"{where}: nothing to answer (the conversation before the final assistant turn ends with "
                         f"{role!r}, not a user or tool turn)")
    return prompt, None


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
    if rec.get("inputs_key") != key or not rec.get("complete") or not (out / rec["file"]).exists():
        return None
    return rec if sha256_file(out / rec["file"]) == rec["sha256"] else None


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
        self.t0 = time.monotonic()

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
                                                  "completion_tokens"])
        finish = Counter(table["finish_reason"].to_pylist())
        record = {"shard": self.k, "inputs_key": self.key, "file": self.path.name, "sha256": sha256_file(self.path),
                  "prompts": self.prompts, "answered": table.num_rows, "failed": len(self.failures),
                  "failures": self.failures[:MAX_FAILURES_KEPT], "complete": not self.failures,
                  "generated": self.generated, "resumed": self.resumed, "retries": sum(self.retry_kinds.values()),
                  "retry_kinds": dict(self.retry_kinds), "finish_reasons": dict(finish),
                  "completion_tokens": int(pc.sum(table["completion_tokens"]).as_py() or 0),
                  "quality": shard_quality(table.to_pylist()), "seconds": time.monotonic() - self.t0}
        assert record["answered"] + record["failed"] == self.prompts, (
            f"shard {self.k}: {record['answered']} answered + {record['failed']} failed != {self.prompts} prompts")
        write_manifest(self.record_path, record)
        shutil.rmtree(self.partial, ignore_errors=True)
        self.finalized = True
        return record


class Progress:
    """done/total, output tok/s (since the start and over the last interval), failures and retries of one
    regeneration call; `snapshot()` is JSON-able."""

    def __init__(self, total: int):
        self.total, self.t0 = total, time.monotonic()
        self.resumed = self.answered = self.failed = self.retries = self.tokens = 0
        self._last = (self.t0, 0)                                       # (time, tokens) at the last snapshot

    def snapshot(self, pool: ServerPool | None = None) -> dict:
        now = time.monotonic()
        elapsed, (t_last, tok_last) = now - self.t0, self._last
        self._last = (now, self.tokens)
        done = self.resumed + self.answered + self.failed
        rate = (self.answered + self.failed) / elapsed if elapsed > 0 else 0.0
        return {"done": done, "total": self.total, "fraction": done / max(self.total, 1), "answered": self.answered,
                "resumed": self.resumed, "failed": self.failed, "retries": self.retries,
                "output_tokens": self.tokens, "tokens_per_s": self.tokens / elapsed if elapsed > 0 else 0.0,
                "recent_tokens_per_s": (self.tokens - tok_last) / (now - t_last) if now > t_last else 0.0,
                "elapsed_s": elapsed, "eta_s": (self.total - done) / rate if rate > 0 else None,
                "servers": pool.stats() if pool else {}}

    @staticmethod
    def line(s: dict) -> str:
        eta = ""
        if s["eta_s"] is not None:
            eta = f", ETA {s['eta_s'] / 3600:.1f} h" if s["eta_s"] >= 7200 else f", ETA {s['eta_s'] / 60:.1f} min"
        return (f"generation: {s['done']}/{s['total']} prompts ({s['fraction']:.1%}), {s['recent_tokens_per_s']:.0f} "
                f"output tok/s (mean {s['tokens_per_s']:.0f}), {s['failed']} failed, {s['retries']} retries{eta}")


async def regenerate(prompts_path: Path, out: Path, shards: list[int], key: str, gen: GenerationConfig,
                     server: ServerConfig, urls: list[str], tokenizer=None, log=print, on_progress=None,
                     engine=None) -> list[dict]:
    """Answer every prompt of `shards` (indices into the prompt file, shard_size rows each) on the servers `urls`
    with `gen.concurrency` requests in flight; returns the shards' records, in order.

    engine: an in-process generator instead of servers (`serving.hf_generate.BatchedGenerator`, server.kind
    'transformers'): prompts go to it as token ids (the tokenizer is then needed), `urls` is ignored.

    tokenizer: the target's (HF) tokenizer, needed for the token-id APIs ('sglang', 'llama.cpp'): prompts are
    rendered with its chat template (`data.prompt_ids`). on_progress(snapshot: dict) is called every
    `gen.progress_interval_s` and at the end (e.g. to update a Prefect progress artifact), beside a log line.
    A prompt whose request exhausts its retries or is rejected (4xx) is recorded as failed with the reason.
    Raises ServerError when no server answers for `server.down_timeout_s` (answers so far are flushed first).
    """
    from .data import prompt_ids
    if not shards:
        return []
    token_ids = gen.api in TOKEN_ID_APIS or engine is not None
    if token_ids and tokenizer is None:
        raise ValueError(f"generation.api {gen.api!r} / an in-process engine takes token ids: pass the target's "
                         "tokenizer")
    n_rows = pq.ParquetFile(prompts_path).metadata.num_rows
    size = gen.shard_size
    ranges = {k: (k * size, min((k + 1) * size, n_rows)) for k in sorted(shards)}
    schema = output_schema(prompts_path, key)
    progress = Progress(sum(b - a for a, b in ranges.values()))
    queue: asyncio.Queue = asyncio.Queue(maxsize=2 * gen.concurrency)
    writers: dict[int, ShardWriter] = {}
    records: dict[int, dict] = {}

    def maybe_finalize(w: ShardWriter) -> None:
        if w.input_done and w.pending == 0 and not w.finalized:
            records[w.k] = w.finalize()
            del writers[w.k]

    async def produce() -> None:
        current = None
        for index, row in iter_prompt_rows(prompts_path, ranges[min(ranges)][0], ranges[max(ranges)][1]):
            k = index // size
            if k not in ranges:
                continue
            if current is None or current.k != k:
                if current is not None:
                    current.input_done = True
                    maybe_finalize(current)
                current = writers[k] = ShardWriter(out, k, key, schema, ranges[k][1] - ranges[k][0], gen)
                progress.resumed += current.resumed
            if row["id"] in current.done_ids:
                continue
            current.pending += 1
            await queue.put((current, index, row))
        if current is not None:
            current.input_done = True
            maybe_finalize(current)
        for _ in range(gen.concurrency):
            await queue.put(None)

    async def answer(w: ShardWriter, index: int, row: dict, client: httpx.AsyncClient, pool: ServerPool) -> None:
        t0 = time.monotonic()
        where = f"{prompts_path} row {index} (id {row['id']})"
        try:
            messages = row["messages"] if isinstance(row["messages"], list) else json.loads(row["messages"])
            sent, kept = split_final_answer(messages, row.get("mode"), where)
            ids = []
            if token_ids:                               # one thread: HF tokenizers are not safe to share
                ids = await asyncio.get_running_loop().run_in_executor(tokenize_thread, prompt_ids, tokenizer, sent)
        except ValueError as e:                        # bad row (also data.MaskError): recorded, never retried
            w.fail(row["id"], f"bad prompt row: {e}")
            progress.failed += 1
            return
        base = {**row, "messages": json.dumps(sent), "index": index, "prompt_ids": ids}
        if kept is not None:
            # the whole conversation as it is (earlier turns, final turn with its tool calls): every turn is trained
            w.add({**base, "messages": json.dumps(messages), "response": kept.get("content") or "",
                   "finish_reason": "kept", "attempts": 0,
                   "reasoning": kept.get("reasoning_content") or kept.get("reasoning") or "", "api": "kept"})
            progress.answered += 1
            return

        def on_retry(error: RetryableError) -> None:
            w.retry(error)
            progress.retries += 1

        if engine is not None:
            data, url, attempts, api = await engine.complete(ids), engine.name, 1, engine.name
        else:
            if pool is None:
                raise ServerError(f"{where} needs an answer but no server URL was given")
            body = request_body(gen.api, sent, ids, gen.max_new_tokens, gen.temperature)
            try:
                data, url, attempts = await request_with_retries(pool, client, gen.api, body, gen.max_retries,
                                                                 gen.retry_backoff_s, on_retry)
            except RequestRejected as e:
                w.fail(row["id"], str(e))
                progress.failed += 1
                return
            except RetryableError as e:
                w.fail(row["id"], f"gave up after {gen.max_retries + 1} attempts: {e.reason}")
                progress.failed += 1
                return
            data.pop("logprobs", None)
            api = gen.api
        w.add({**base, **data, "server": url, "api": api, "attempts": attempts,
               "latency_s": time.monotonic() - t0})
        progress.answered += 1
        progress.tokens += data["completion_tokens"]

    async def work(client: httpx.AsyncClient, pool: ServerPool) -> None:
        while (item := await queue.get()) is not None:
            w, index, row = item
            await answer(w, index, row, client, pool)
            w.pending -= 1
            maybe_finalize(w)

    def report(pool: ServerPool) -> None:
        snap = progress.snapshot(pool)
        log(Progress.line(snap))
        if on_progress is not None:
            on_progress(snap)

    async def tick(pool: ServerPool) -> None:
        """Runs until cancelled: flushes answers waiting longer than flush_s, reports progress."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(min(0.2, gen.progress_interval_s))
            for w in list(writers.values()):
                w.flush(older_than_s=gen.flush_s)
            if time.monotonic() - last >= gen.progress_interval_s:
                last = time.monotonic()
                report(pool)

    out.mkdir(parents=True, exist_ok=True)
    timeout = httpx.Timeout(gen.request_timeout_s, connect=min(10.0, gen.request_timeout_s))
    limits = httpx.Limits(max_connections=gen.concurrency, max_keepalive_connections=gen.concurrency)
    tokenize_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
    # no URLs: every row of these shards is kept as it is (the caller checked), no server is needed
    pools = ServerPool(urls, server.probe_interval_s, server.down_timeout_s) if urls else nullcontext(None)
    async with pools as pool, \
            httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        tasks = [asyncio.create_task(produce())]
        tasks += [asyncio.create_task(work(client, pool)) for _ in range(gen.concurrency)]
        ticker = asyncio.create_task(tick(pool))
        all_work = asyncio.gather(*tasks)
        try:
            await asyncio.wait([all_work, ticker], return_when=asyncio.FIRST_COMPLETED)
            if ticker.done():                     # it only ends by raising (e.g. in on_progress)
                ticker.result()
            await all_work
        finally:
            for t in [*tasks, ticker, all_work]:
                t.cancel()
            await asyncio.gather(*tasks, ticker, all_work, return_exceptions=True)
            for w in writers.values():                    # stopped early: keep what was answered
                w.flush()
            tokenize_thread.shutdown(wait=False, cancel_futures=True)
        assert not writers, f"shards {sorted(writers)} were not finalized"
        report(pool)
    if (out / "partial").exists() and not any((out / "partial").iterdir()):
        (out / "partial").rmdir()
    return [records[k] for k in sorted(records)]


def remove_shards_from(out: Path, first: int) -> None:
    """Delete shard files, records and parts of shards >= `first` (left by a larger prompt set)."""
    for f in [*out.glob("shard_*.parquet"), *out.glob("shard_*.json"), *out.glob("partial/shard_*")]:
        if int(f.name.split("_")[1].split(".")[0]) >= first:
            shutil.rmtree(f) if f.is_dir() else f.unlink()

