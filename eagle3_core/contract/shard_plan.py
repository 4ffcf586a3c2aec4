"""Append-only shard plans: a shard that still holds the rows it was written for keeps its boundaries, and rows
after the last such shard are cut into new shards of the configured size. Growing a run (more prompts appended at
the end of the train file, see prompts.build_prompts) then leaves every finished shard, the last short one
included, as it is: only the new rows are regenerated and extracted."""
from __future__ import annotations

import hashlib
from typing import Callable


def append_only_ranges(n_rows: int, size: int, kept: Callable[[int, int], int | None]) -> list[tuple[int, int]]:
    """[(start, stop)] row ranges of shards 0, 1, ... covering rows [0, n_rows).

    kept(k, start): the number of rows shard k holds if its earlier record says it was written for exactly the
    current rows [start, start + count), else None; such a shard keeps its range, any other is `size` rows (fewer
    at the end). Raises ValueError for size < 1."""
    if size < 1:
        raise ValueError(f"shard size must be at least 1, got {size}")
    ranges, pos = [], 0
    while pos < n_rows:
        count = kept(len(ranges), pos)
        stop = pos + count if count and pos + count <= n_rows else min(pos + size, n_rows)
        ranges.append((pos, stop))
        pos = stop
    return ranges


def rows_digest(ids: list[str], digests: list[str]) -> str:
    """sha256 naming an ordered list of rows by id and content digest (prompts.prompt_digest)."""
    return hashlib.sha256("\n".join(f"{i}\t{d}" for i, d in zip(ids, digests, strict=True)).encode()).hexdigest()


def plan_ranges(ids: list[str], shard_samples: int, previous: list[dict]) -> list[tuple[int, int]]:
    """[(start, stop)] of every feature shard of samples with these `ids`: append-only (shard_plan), an earlier
    store entry (manifest 'shards') whose sample ids are the ones now at its place keeps its range, the rest are
    shard_samples each; growing a run keeps every finished shard, the last short one included."""
    by_file = {e["file"]: e for e in previous}

    def kept(k: int, start: int) -> int | None:
        e = by_file.get(f"shard_{k:05d}.safetensors")
        n = len(e.get("ids") or []) if e else 0
        return n if n and e["ids"] == ids[start:start + n] else None

    return append_only_ranges(len(ids), shard_samples, kept)
