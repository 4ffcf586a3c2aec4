"""FAULT INJECTOR, for tests only: makes one shard task fail on demand, which no real component does. Nothing in
eagle3_core/ or tasks/ knows about it: tests/fault_site/sitecustomize.py wraps the stage API's shard functions
(`eagle3_core.pipeline.generation_stage.run_generation_shard`, `run_features_shard`, which the shard tasks call) in a
Python process started with tests/fault_site on PYTHONPATH and EAGLE3_FAULT_INJECT set (e.g. a flow run a served
deployment starts, tests/test_deployments.py).

EAGLE3_FAULT_INJECT="features:1" makes feature shard 1 raise InjectedFault, a non-transient error that task retries
do not absorb, so the flow run fails and a flow-run retry has to re-run that shard. "generation:0:transient" raises a
ConnectionError on the task's first attempt only (task retries absorb it). Several faults: comma-separated.

`pause_mid_write` stops the shard writer half-way through one shard (SIGKILL tests: a real writer is too quick to
kill mid-write reliably); the script of the killed process calls it (tests/test_features.py, kill_worker.py).
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

FAULT_ENV = "EAGLE3_FAULT_INJECT"
SITE_DIR = Path(__file__).resolve().parent          # put on PYTHONPATH: its sitecustomize calls install()


class InjectedFault(RuntimeError):
    """Raised by the test-only fault injector (EAGLE3_FAULT_INJECT)."""


def maybe_fail(stage: str, shard: int) -> None:
    """Raise the fault EAGLE3_FAULT_INJECT asks for at shard `shard` of stage `stage`, if any."""
    for spec in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
        name, idx, *kind = spec.strip().split(":")
        if name != stage or int(idx) != shard:
            continue
        if kind == ["transient"]:
            from prefect.context import TaskRunContext
            ctx = TaskRunContext.get()
            if ctx is None or ctx.task_run.run_count <= 1:
                raise ConnectionError(f"injected transient fault in {stage} shard {shard} ({FAULT_ENV})")
        else:
            raise InjectedFault(f"injected fault in {stage} shard {shard} ({FAULT_ENV}={spec})")


def install() -> None:
    """Wrap the shard functions of the stage modules so that each first calls maybe_fail for its shard (inside
    the shard task). Runs at start-up (sitecustomize), before tasks/ imports the functions by name."""
    import eagle3_core.pipeline.features_stage as features_stage
    import eagle3_core.pipeline.generation_stage as generation_stage
    for stage, module, name in (("generation", generation_stage, "run_generation_shard"),
                                ("features", features_stage, "run_features_shard")):
        fn = getattr(module, name)

        @functools.wraps(fn)
        def failing(cfg, shard, *args, _fn=fn, _stage=stage, **kwargs):
            maybe_fail(_stage, shard)
            return _fn(cfg, shard, *args, **kwargs)

        setattr(module, name, failing)
        _patch_row(module, stage, fn, failing)


def _patch_row(module, stage: str, fn, failing) -> None:
    """The stage's row (`module.ROW`, eagle3_core.pipeline.stage) holds the shard function it was built with, and
    the shard task calls it there: give the row the wrapper too (in the table as well, if it is filled already)."""
    from dataclasses import replace

    from eagle3_core.pipeline import stage as stage_table
    row = getattr(module, "ROW", None)
    if row is None or row.shards is None or row.shards.run is not fn:
        return
    module.ROW = replace(row, shards=replace(row.shards, run=failing))
    if stage in stage_table.STAGES:
        stage_table.register(module.ROW)


def pythonpath_with_injector() -> str:
    """PYTHONPATH for a subprocess that should honour EAGLE3_FAULT_INJECT: this folder first."""
    return os.pathsep.join([str(SITE_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])


def pause_mid_write(shard_name: str, pause) -> None:
    """Make features.shard_writer stop writing shard `shard_name` (e.g. 'shard_00001.safetensors') once, after
    its header and half of its first tensor piece are in the hidden temporary file, and call pause(final path)
    there (sleep until SIGKILLed, or briefly). Wraps shard_writer.write_all, which write_shard_parts calls once
    per piece; the file behind a descriptor is read from /proc/self/fd (Linux)."""
    from eagle3_core.features import shard_writer
    write_all, calls, paused = shard_writer.write_all, {}, set()

    def pausing(fd: int, view: memoryview) -> None:
        tmp = Path(os.readlink(f"/proc/self/fd/{fd}"))                 # .<name>.tmp.<pid>.<thread>
        if not tmp.name.startswith(f".{shard_name}.tmp") or tmp in paused:
            return write_all(fd, view)
        calls[tmp] = calls.get(tmp, 0) + 1
        if calls[tmp] == 1:                                            # the header
            return write_all(fd, view)
        paused.add(tmp)
        write_all(fd, view[:len(view) // 2])
        pause(tmp.with_name(shard_name))
        write_all(fd, view[len(view) // 2:])

    shard_writer.write_all = pausing
