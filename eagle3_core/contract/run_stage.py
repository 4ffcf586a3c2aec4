"""The one helper around a stage body: skip a done stage, time it, write its manifest atomically."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from eagle3_core.contract.manifest import cached_manifest, write_manifest


def run_stage(out: Path, key: str, body: Callable[[], dict]) -> dict:
    """The manifest of the stage written in `out` for inputs `key`: the one on disk if it was written for `key`
    (the stage is done, `body` is not called), else `body()`'s dict plus inputs_key and seconds (the body's wall
    time), written to out/manifest.json atomically."""
    if (m := cached_manifest(out / "manifest.json", key)):
        return m
    t0 = time.monotonic()
    manifest = body()
    return write_manifest(out / "manifest.json", {"inputs_key": key, **manifest, "seconds": time.monotonic() - t0})
