"""FAULT INJECTOR, for tests only: makes one shard task fail on demand, which no real component does.

EAGLE3_FAULT_INJECT="features:1" makes feature shard 1 raise InjectedFault, a non-transient error that task retries
do not absorb, so the flow run fails and a flow-run retry has to re-run that shard. "generation:0:transient" raises a
ConnectionError on the task's first attempt only (task retries absorb it). Several faults: comma-separated.
Users never set this variable.
"""
from __future__ import annotations

import os

from prefect.context import TaskRunContext

FAULT_ENV = "EAGLE3_FAULT_INJECT"


class InjectedFault(RuntimeError):
    """Raised by the test-only fault injector (EAGLE3_FAULT_INJECT)."""


def maybe_fail(stage: str, shard: int) -> None:
    """Raise the fault EAGLE3_FAULT_INJECT asks for at shard `shard` of stage `stage`, if any."""
    for spec in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
        name, idx, *kind = spec.strip().split(":")
        if name != stage or int(idx) != shard:
            continue
        if kind == ["transient"]:
            ctx = TaskRunContext.get()
            if ctx is None or ctx.task_run.run_count <= 1:
                raise ConnectionError(f"injected transient fault in {stage} shard {shard} ({FAULT_ENV})")
        else:
            raise InjectedFault(f"injected fault in {stage} shard {shard} ({FAULT_ENV}={spec})")
