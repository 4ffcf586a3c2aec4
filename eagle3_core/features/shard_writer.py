"""Background shard writing: safetensors shards checksummed and written by worker threads while the extractor
keeps the GPU busy.

`write_shard_parts` writes the format safetensors reads (`safetensors.safe_open`) without serializing a copy: the
header is built by hand and each tensor's bytes go from the pinned host buffers they were copied into straight to
the file, piece by piece, hashed on the way. No copy of the shard is made in memory, and the thread holds the GIL
only for bookkeeping: the big operations (write, sha256 update, fsync) release it, so the thread launching GPU
kernels is never starved. (The former writer, `safetensors.torch.save` of concatenated tensors, is the reference
of tests/test_features.py and benchmarks/extract_throughput.py: tests/reference_paths.py.)

A shard becomes visible only complete: bytes go to a hidden temporary file, fsync, then rename to its final name;
only after that is it reported (`on_written`) and listed in the store's manifest. A process killed at any moment
leaves at worst a temporary file or an unlisted shard, both of which the next run ignores and rewrites.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

# safetensors dtype names (the format's spec, safetensors/src/tensor.rs `Dtype`)
_DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64",
                torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"shard pieces must be contiguous CPU tensors, got {t.device} contiguous={t.is_contiguous()}")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def safetensors_header(layout: list[tuple[str, torch.dtype, list[int], int]], metadata: dict[str, str]) -> bytes:
    """The safetensors prefix (8-byte little-endian length + JSON header, space-padded so that the data starts
    8-byte aligned, as safetensors itself writes it) for tensors stored back to back in `layout` order:
    (name, dtype, shape, nbytes). Raises ValueError for a dtype safetensors has no name for."""
    header, offset = {}, 0
    for name, dtype, shape, nbytes in layout:
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {dtype} cannot be stored in a safetensors shard")
        header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return len(text).to_bytes(8, "little") + text


def write_all(fd: int, view: memoryview) -> None:
    """Write all of `view` to file descriptor `fd` (os.write may write less, e.g. above 2 GiB)."""
    while len(view):
        view = view[os.write(fd, view):]


def write_shard_parts(path: Path, parts: dict[str, list[torch.Tensor]], metadata: dict[str, str]) -> tuple[str, int]:
    """Write a safetensors shard atomically from pieces; returns (sha256 hex of its bytes, size in bytes).

    parts: name -> contiguous CPU tensors of one dtype and the same trailing shape, stored concatenated along
    dim 0 (e.g. the row slices of each sample in pinned host buffers). Temporary file, fsync, rename (module
    docstring). Raises ValueError on pieces of mixed dtype or trailing shape."""
    layout, views = [], []
    for name, pieces in parts.items():
        first = pieces[0]
        if any(p.dtype != first.dtype or p.shape[1:] != first.shape[1:] for p in pieces):
            raise ValueError(f"tensor {name!r}: pieces differ in dtype or trailing shape")
        vs = [_bytes_view(p) for p in pieces]
        layout.append((name, first.dtype, [sum(p.shape[0] for p in pieces), *first.shape[1:]],
                       sum(len(v) for v in vs)))
        views += vs
    head = safetensors_header(layout, metadata)
    total = len(head) + sum(n for *_, n in layout)
    sha = hashlib.sha256()
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}.{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for v in [memoryview(head), *views]:
            sha.update(v)                                              # releases the GIL (large buffers)
            write_all(fd, v)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return sha.hexdigest(), total


class ShardWriter:
    """A pool of `threads` writer threads. `submit(path, build, on_written)` runs `build() -> (parts, metadata)`
    and writes the shard on a worker (`write_shard_parts`: parts maps each name to a list of pieces), then calls
    `on_written(path, sha256, nbytes)` there. At most threads + 1
    shards are in flight (bounding host memory): `submit` blocks beyond that. A worker's exception is raised in the
    caller at the next `submit` or at `close`."""

    def __init__(self, threads: int):
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="shard-writer")
        self.slots = threading.BoundedSemaphore(max(1, threads) + 1)
        self.futures: list[Future] = []

    def _run(self, path: Path, build, on_written) -> None:
        try:
            parts, metadata = build()
            sha, n = write_shard_parts(path, parts, metadata)
            if on_written is not None:
                on_written(path, sha, n)
        finally:
            self.slots.release()

    def _raise_errors(self) -> None:
        for f in self.futures:
            if f.done() and f.exception() is not None:
                raise f.exception()
        self.futures = [f for f in self.futures if not f.done()]

    def submit(self, path: Path, build, on_written: Callable[[Path, str, int], None] | None = None) -> None:
        self._raise_errors()
        self.slots.acquire()
        self.futures.append(self.pool.submit(self._run, path, build, on_written))

    def close(self) -> None:
        """Wait for every shard; raise the first writer error."""
        try:
            for f in self.futures:
                f.result()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:                                                              # keep the caller's error
            self.pool.shutdown(wait=True, cancel_futures=True)
