"""Each stage's summary line: what it produced (its row's summary fields, Stage.summary, as a person reads them) and
how long it took, logged in its flow run and every run above it, so that the pipeline run's log holds one line per
stage."""
from __future__ import annotations

import logging

from eagle3_core.pipeline.report_numbers import RUN_NAMES
from eagle3_core.pipeline.table import STAGES
from tasks.control import log_in_parent_runs
from tasks.logs import done_before_this_run, readable


def summary_line(stage: str, manifest: dict, skipped: bool = False) -> str:
    """One line saying what stage `stage` produced (its manifest's fields its row names, Stage.summary, as a person
    reads them: tasks.logs.readable; tau for evaluate) and how long it took (the manifest's seconds: 0 when every
    piece was already done), or 'skipped (done before this run)' when `skipped`, without another run's time."""
    parts = []
    inner = manifest.get("summary") if isinstance(manifest.get("summary"), dict) else {}
    row = STAGES.get(stage)
    for key in row.summary if row is not None else ():
        value = readable(key, manifest.get(key, inner.get(key)))   # deploy manifests keep theirs in 'summary'
        if value is not None and not isinstance(value, dict):
            parts.append(f"{key} {value}")
    best = manifest.get("best")
    if isinstance(best, dict) and "epoch" in best:
        parts.append(f"best epoch {best['epoch']}" + (f" (tau_sim {best['tau_sim']:.3f})" if "tau_sim" in best else ""))
    for name in RUN_NAMES:
        if isinstance(inner.get(name), dict) and "tau" in inner[name]:
            parts.append(f"tau {name} {inner[name]['tau']:.3f}")
    seconds = manifest.get("seconds")
    took = f" in {seconds:.1f} s" if isinstance(seconds, (int, float)) else ""
    head = f"{stage}: skipped (done before this run)" if skipped else f"{stage}: done{took}"
    return head + (f" ({', '.join(parts)})" if parts else "")


def summarize(stage: str, manifest: dict) -> dict:
    """Log stage `stage`'s summary line in its flow run and every run above it (the pipeline run's log then holds
    one line per stage); returns `manifest`."""
    log_in_parent_runs(logging.INFO, "%s", summary_line(stage, manifest, done_before_this_run(stage)))
    return manifest
