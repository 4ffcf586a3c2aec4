"""Regeneration: answer prompt rows with the target on inference servers, into resumable Parquet shards.

Shard k holds the prompts at rows [start_k, stop_k) of the prompt file: gen.shard_size rows each, except that a
shard finished for exactly its rows keeps them when the prompt file grows (pipeline.generation_stage.generation_plan,
shard_plan). In the output folder:
  shard_{k:05d}.parquet   the answered rows of shard k in prompt order (written atomically, once the shard is done)
  shard_{k:05d}.json      its record: inputs key (sampling, target), digest of its rows (ids and prompt digests),
                          sha256 of the Parquet file, counts, failures (id, reason), retries, quality counts
  partial/shard_{k:05d}/part_*.parquet   answers flushed while the shard runs (every flush_rows answers or
                          flush_s seconds), merged into the shard file when its last prompt has an outcome
A shard is finished when its record names the current inputs key and rows, the Parquet file is intact and no prompt
failed. A rerun leaves finished shards untouched and sends, in the others, only the prompts not yet answered: a run
killed at any moment ends, once rerun, with every prompt answered exactly once. Every file carries the inputs key in
its Parquet metadata and every answer its prompt's digest; answers of other inputs, or to a prompt that has since
changed, are deleted or left out, never mixed in.

Memory: prompts stream from Parquet in batches through a queue of 2 x concurrency; only open shards keep state
(their answered ids and unflushed rows), so memory does not grow with the number of prompts.

What is sent: the conversation up to its final assistant turn (which the target regenerates), with the row's tool
schemas (`tools` column) and `generation.chat_template_kwargs`. With `generation.turns = 'all'` every turn is
answered in order after the target's own earlier answers (eagle3_core.generation.turns: its tool-call policy, resume per
row) and `messages` holds the regenerated conversation. Rows with `mode == "keep"` are passed through whole, no request:
`messages` holds the full conversation (every assistant turn is trained) and `response`/`reasoning` its final turn
(finish_reason 'kept').

Early gate: the first `generation.gate_after` answers of a call are checked against the quality gate's limits
(generation_quality.EarlyGate); past a limit the call stops sending and raises QualityGateError with examples,
after at most gate_after + concurrency requests.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_core.config import GenerationConfig, ServerConfig
from eagle3_core.data.markers import target_markers
from eagle3_core.data.prompt_set import prompt_digest
from eagle3_core.generation.answer_row import Regeneration, answer_row
from eagle3_core.generation.answer_shard import KEY_META, AnswerShardWriter
from eagle3_core.generation.progress import Progress
from eagle3_core.generation.quality import EarlyGate, gate_limits
from eagle3_core.serving.client import TOKEN_ID_APIS
from eagle3_core.serving.pool import ServerPool

# columns the regeneration adds to each prompt row (`messages` becomes what was sent, as JSON text)
ANSWER_FIELDS = [("index", pa.int64()), ("response", pa.string()), ("reasoning", pa.string()),
                 ("finish_reason", pa.string()), ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
                 ("prompt_ids", pa.list_(pa.int32())), ("output_ids", pa.list_(pa.int32())), ("model", pa.string()),
                 ("server", pa.string()), ("api", pa.string()), ("attempts", pa.int32()), ("latency_s", pa.float64()),
                 ("timings", pa.string()), ("tool_calls", pa.string()), ("turn_requests", pa.int32()),
                 ("turns", pa.string()), ("turn_prompt_ids", pa.list_(pa.list_(pa.int32()))),
                 ("turn_output_ids", pa.list_(pa.list_(pa.int32())))]


def num_shards(prompts_path: Path, shard_size: int) -> int:
    rows = pq.ParquetFile(prompts_path).metadata.num_rows
    return -(-rows // shard_size)


def output_schema(prompts_path: Path, key: str) -> pa.Schema:
    """The prompt file's columns (`messages` as JSON text, `prompt_sha256` added where the file lacks it) followed
    by ANSWER_FIELDS; the inputs key as metadata."""
    names = {n for n, _ in ANSWER_FIELDS}
    fields = [pa.field("messages", pa.string()) if f.name == "messages" else f
              for f in pq.read_schema(prompts_path) if f.name not in names]
    if "prompt_sha256" not in {f.name for f in fields}:
        fields.append(pa.field("prompt_sha256", pa.string()))
    return pa.schema(fields + [pa.field(n, t) for n, t in ANSWER_FIELDS], metadata={KEY_META: key.encode()})


def prompt_digests(prompts_path: Path) -> tuple[list[str], list[str], list[str]]:
    """(ids, prompts.prompt_digest of each row, modes) of a prompt file, in row order: digests from its
    `prompt_sha256` column, computed from messages, tools and mode for files written before it existed.
    Remove the computed digests when runs written before 1e5d694 are no longer supported: their prompt file is then
    unreadable (compat.LEGACY_READERS)."""
    cols = set(pq.read_schema(prompts_path).names)
    if "prompt_sha256" in cols:                          # written by the prompts stage since shards name rows
        t = pq.read_table(prompts_path, columns=["id", "prompt_sha256", "mode"])
        digests = t["prompt_sha256"].to_pylist()
    else:
        t = pq.read_table(prompts_path, columns=[c for c in ("id", "messages", "tools", "mode") if c in cols])
        digests = [prompt_digest(r) for r in t.to_pylist()]
    return t["id"].to_pylist(), digests, t["mode"].to_pylist()


def shard_rows(prompts_path: Path, ranges: dict[int, tuple[int, int]]) -> dict[int, dict[str, tuple[int, str]]]:
    """Per shard, id -> (row index, prompts.prompt_digest) of its rows [start, stop) of the prompt file
    (prompt_digests)."""
    ids, digests, _ = prompt_digests(prompts_path)
    return {k: {ids[i]: (i, digests[i]) for i in range(a, b)} for k, (a, b) in ranges.items()}


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


@dataclass(frozen=True)
class _ShardFeed:
    """The shards of one regenerate call as rows are queued and answered: ranges (shard k -> rows [start, stop)),
    rows_of (shard_rows), shard_at (row index -> shard), writers of the open shards, records of the finished ones;
    queue: (writer, row index, row) items, then one None per worker."""
    run: Regeneration
    out: Path
    key: str
    schema: pa.Schema
    ranges: dict[int, tuple[int, int]]
    rows_of: dict[int, dict[str, tuple[int, str]]]
    shard_at: dict[int, int]
    rows_sha256: dict[int, str]
    queue: asyncio.Queue
    writers: dict[int, AnswerShardWriter] = field(default_factory=dict)
    records: dict[int, dict] = field(default_factory=dict)


def _resolve_api(gen: GenerationConfig, server: ServerConfig, engine, tokenizer):
    """(gen with its api resolved ('auto' -> the server kind's), token_ids, markers: the target's marker tokens
    by which a token-id API's answers are read, else None). Raises ValueError when token ids need a tokenizer."""
    gen = gen.model_copy(update={"api": gen.api_for(server.kind)})
    token_ids = gen.api in TOKEN_ID_APIS or engine is not None
    if token_ids and tokenizer is None:
        raise ValueError(f"generation.api {gen.api!r} / an in-process engine takes token ids: pass the target's "
                         "tokenizer")
    return gen, token_ids, target_markers(tokenizer) if gen.api in TOKEN_ID_APIS else None


def _maybe_finalize(feed: _ShardFeed, w: AnswerShardWriter) -> None:
    if w.input_done and w.pending == 0 and not w.finalized:
        feed.records[w.k] = w.finalize()
        del feed.writers[w.k]


def _close_input(feed: _ShardFeed, w: AnswerShardWriter | None) -> None:
    if w is not None:
        w.input_done = True
        _maybe_finalize(feed, w)


async def _produce(feed: _ShardFeed) -> None:
    """Queue the not yet answered rows of every shard in row order, opening each shard's writer (resumed from its
    files) at its first row, then one None per worker."""
    current = None
    for index, row in iter_prompt_rows(feed.run.prompts_path, min(a for a, _ in feed.ranges.values()),
                                       max(b for _, b in feed.ranges.values())):
        k = feed.shard_at.get(index)
        if k is None:
            continue
        row.setdefault("prompt_sha256", feed.rows_of[k][row["id"]][1])
        if current is None or current.k != k:
            _close_input(feed, current)
            current = feed.writers[k] = AnswerShardWriter(feed.out, k, feed.key, feed.schema, feed.rows_of[k],
                                                          feed.run.gen, feed.rows_sha256.get(k))
            feed.run.progress.resumed += current.resumed
        if row["id"] in current.done_ids:
            continue
        current.pending += 1
        await feed.queue.put((current, index, row))
    _close_input(feed, current)
    for _ in range(feed.run.gen.concurrency):
        await feed.queue.put(None)


async def _work(feed: _ShardFeed, client: httpx.AsyncClient, pool: ServerPool | None) -> None:
    while (item := await feed.queue.get()) is not None:
        w, index, row = item
        await answer_row(feed.run, w, index, row, client, pool)
        w.pending -= 1
        _maybe_finalize(feed, w)


def _report(feed: _ShardFeed, pool: ServerPool | None, log, on_progress) -> None:
    snap = feed.run.progress.snapshot(pool)
    log(Progress.line(snap))
    if on_progress is not None:
        on_progress(snap)


async def _tick(feed: _ShardFeed, pool: ServerPool | None, log, on_progress) -> None:
    """Runs until cancelled: flushes answers waiting longer than flush_s, reports progress; raises
    launcher.ServerExited as soon as the server the stage started has exited (the pool's watch)."""
    gen = feed.run.gen
    last = time.monotonic()
    while True:
        await asyncio.sleep(min(0.2, gen.progress_interval_s))
        if pool is not None:
            pool.check_exited()
        for w in list(feed.writers.values()):
            w.flush(older_than_s=gen.flush_s)
        if time.monotonic() - last >= gen.progress_interval_s:
            last = time.monotonic()
            _report(feed, pool, log, on_progress)


async def _answer_all(feed: _ShardFeed, client: httpx.AsyncClient, pool: ServerPool | None, log, on_progress):
    """Run the producer, gen.concurrency workers and the ticker until every row has an outcome; on any error the
    others are cancelled and the answers so far flushed before it propagates."""
    tasks = [asyncio.create_task(_produce(feed))]
    tasks += [asyncio.create_task(_work(feed, client, pool)) for _ in range(feed.run.gen.concurrency)]
    ticker = asyncio.create_task(_tick(feed, pool, log, on_progress))
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
        for w in feed.writers.values():                    # stopped early: keep what was answered
            w.flush()
        feed.run.tokenize_thread.shutdown(wait=False, cancel_futures=True)


async def regenerate(prompts_path: Path, out: Path, shards: list[int] | dict[int, tuple[int, int]], key: str,
                     gen: GenerationConfig, server: ServerConfig, urls: list[str], tokenizer=None, log=print,
                     on_progress=None, engine=None, rows_sha256: dict[int, str] | None = None) -> list[dict]:
    """Answer every prompt of `shards` on the servers `urls` with `gen.concurrency` requests in flight; returns
    the shards' records, in order.

    shards: shard k -> its rows [start, stop) of the prompt file (pipeline.generation_stage.generation_plan), or a list
    of shard indices of gen.shard_size rows each. rows_sha256: shard k -> the digest of its rows, kept in its record.

    engine: an in-process generator instead of servers (`serving.hf_generate.BatchedGenerator`, server.kind
    'transformers'): prompts go to it as token ids (the tokenizer is then needed), `urls` is ignored.

    tokenizer: the target's (HF) tokenizer, needed for the token-id APIs ('sglang', 'llama.cpp'): prompts are
    rendered with its chat template (`data.chat.prompt_ids`). on_progress(snapshot: dict) is called every
    `gen.progress_interval_s` and at the end (e.g. to update a Prefect progress artifact), beside a log line.
    A prompt whose request exhausts its retries or is rejected (4xx) is recorded as failed with the reason.
    Raises ServerError when no server answers for `server.down_timeout_s`, launcher.ServerExited within a second
    when a server this process started exits (answers so far are flushed first, in both cases).
    """
    if not shards:
        return []
    gen, token_ids, markers = _resolve_api(gen, server, engine, tokenizer)
    n_rows, size = pq.ParquetFile(prompts_path).metadata.num_rows, gen.shard_size
    ranges = dict(sorted((shards if isinstance(shards, dict) else
                          {k: (k * size, min((k + 1) * size, n_rows)) for k in shards}).items()))
    rows_of = shard_rows(prompts_path, ranges)
    shard_at = {i: k for k, (a, b) in ranges.items() for i in range(a, b)}
    schema = output_schema(prompts_path, key)
    progress = Progress(sum(b - a for a, b in ranges.values()))
    queue: asyncio.Queue = asyncio.Queue(maxsize=2 * gen.concurrency)
    out.mkdir(parents=True, exist_ok=True)
    timeout = httpx.Timeout(gen.request_timeout_s, connect=min(10.0, gen.request_timeout_s))
    limits = httpx.Limits(max_connections=gen.concurrency, max_keepalive_connections=gen.concurrency)
    run = Regeneration(prompts_path, gen, token_ids, tokenizer, markers, engine,
                       ThreadPoolExecutor(1, thread_name_prefix="tokenize"),
                       EarlyGate(gen.gate_after, gate_limits(gen), str(out)), progress)
    feed = _ShardFeed(run, out, key, schema, ranges, rows_of, shard_at, rows_sha256 or {}, queue)
    # no URLs: every row of these shards is kept as it is (the caller checked), no server is needed
    pools = ServerPool(urls, server.probe_interval_s, server.down_timeout_s) if urls else nullcontext(None)
    async with pools as pool, \
            httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        await _answer_all(feed, client, pool, log, on_progress)
        assert not feed.writers, f"shards {sorted(feed.writers)} were not finalized"
        _report(feed, pool, log, on_progress)
    if (out / "partial").exists() and not any((out / "partial").iterdir()):
        (out / "partial").rmdir()
    return [feed.records[k] for k in sorted(feed.records)]
