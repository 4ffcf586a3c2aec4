"""Rejected rows of a stage (prompts, tokenize): written atomically as JSONL, a failed attempt's apart from a finished
run's, and the per-source limit (prompts.max_reject_frac) that fails the stage naming the worst source."""
from __future__ import annotations

import json
from pathlib import Path

from eagle3_core.contract.manifest import write_atomic


class RejectError(ValueError):
    """A source rejected more rows than `prompts.max_reject_frac` allows."""


def failed_rejects_path(path: Path | None) -> Path | None:
    """Where a failed attempt writes its rejects: `rejects.failed.jsonl` beside `rejects.jsonl`."""
    return None if path is None else path.with_name(path.name.replace(".jsonl", ".failed.jsonl"))


def write_rejects(path: Path | None, rejects: list[dict], failed: bool) -> None:
    """Write `rejects` (JSONL, one object per rejected row) atomically: to `path` when the stage succeeded (and
    remove an earlier failed attempt's file), else to `failed_rejects_path(path)`, leaving `path` (a finished
    run's) byte-identical. `path=None` writes nothing."""
    if path is None:
        return
    data = "".join(json.dumps(r) + "\n" for r in rejects).encode()
    if failed:
        write_atomic(failed_rejects_path(path), data)
    else:
        write_atomic(path, data)
        failed_rejects_path(path).unlink(missing_ok=True)


def check_reject_limit(per: dict, rejects: list[dict], max_frac: float, rejects_path: Path | None) -> None:
    """Raise RejectError naming the source with the largest rejected fraction if it is above `max_frac`.

    per: {source: {"read": rows read, "rejected": rows rejected, ...}}; rejects: [{"source", "reason", ...}];
    rejects_path: named in the message (where the user finds every reject)."""
    if not per:
        return
    frac = {name: s["rejected"] / max(s["read"], 1) for name, s in per.items()}
    worst = max(frac, key=frac.get)
    if frac[worst] > max_frac:
        first = next(r["reason"] for r in rejects if r["source"] == worst)
        raise RejectError(f"source {worst!r} rejected {per[worst]['rejected']} of {per[worst]['read']} rows "
                          f"({frac[worst]:.0%}), above prompts.max_reject_frac {max_frac:.0%}; first: {first}. "
                          f"All rejects: {rejects_path or '(not written)'}")


def finish_rejects(path: Path, rejects: list[dict], per: dict, max_frac: float) -> None:
    """A later stage's rejects (e.g. tokenize's): within the limit, written to `path`; above it, written to
    `failed_rejects_path(path)` and RejectError raised naming the worst source (check_reject_limit)."""
    try:
        check_reject_limit(per, rejects, max_frac, failed_rejects_path(path))
    except RejectError:
        write_rejects(path, rejects, failed=True)
        raise
    write_rejects(path, rejects, failed=False)
