"""Background shard writing: safetensors shards serialized, checksummed and written by worker threads while the
extractor keeps the GPU busy.

A shard becomes visible only complete: bytes go to a hidden temporary file, fsync, then rename to its final name;
only after that is it reported (`on_written`) and listed in the store's manifest. A process killed at any moment
leaves at worst a temporary file or an unlisted shard, both of which the next run ignores and rewrites.
"""
from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save

# Fault injection for tests only (tests/test_features.py, SIGKILL during a write): called with the shard path after
# half of its bytes are written. None in normal use.
_mid_write_hook: Callable[[Path], None] | None = None


def write_shard(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[str, int]:
    """Write a safetensors shard atomically; returns (sha256 hex of its bytes, size in bytes)."""
    data = save(tensors, metadata=metadata)
    sha = hashlib.sha256(data).hexdigest()
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}.{threading.get_ident()}")
    with open(tmp, "wb") as f:
        view = memoryview(data)
        f.write(view[:len(data) // 2])
        if _mid_write_hook is not None:
            _mid_write_hook(path)
        f.write(view[len(data) // 2:])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return sha, len(data)


class ShardWriter:
    """A pool of `threads` writer threads. `submit(path, build, on_written)` runs `build() -> (tensors, metadata)`
    and writes the shard on a worker, then calls `on_written(path, sha256, nbytes)` there. At most threads + 1
    shards are in flight (bounding host memory): `submit` blocks beyond that. A worker's exception is raised in the
    caller at the next `submit` or at `close`."""

    def __init__(self, threads: int):
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="shard-writer")
        self.slots = threading.BoundedSemaphore(max(1, threads) + 1)
        self.futures: list[Future] = []

    def _run(self, path: Path, build, on_written) -> None:
        try:
            tensors, metadata = build()
            sha, n = write_shard(path, tensors, metadata)
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
