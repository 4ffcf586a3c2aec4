"""Reading flow runs, task runs, logs and artifacts back through the Prefect API (the test session's server)."""
from __future__ import annotations

import asyncio
import time
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterTaskRunId,
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterParentFlowRunId,
    LogFilter,
    LogFilterFlowRunId,
    LogFilterTaskRunId,
)


def _run(coro):
    return asyncio.run(coro)


def flow_run_tree(flow_run_id: UUID) -> list:
    """The flow run and all its subflow runs (any depth)."""
    async def go():
        async with get_client() as client:
            runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            frontier = [flow_run_id]
            while frontier:
                children = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=frontier)))
                runs += children
                frontier = [c.id for c in children]
            return runs
    return _run(go())


def task_runs(flow_run_id: UUID) -> list:
    """Task runs of the flow run and its subflow runs (without the placeholder task runs that stand for the
    subflows in their parents), oldest first."""
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId
    tree = flow_run_tree(flow_run_id)
    placeholders = {r.parent_task_run_id for r in tree}

    async def go():
        async with get_client() as client:
            return await client.read_task_runs(task_run_filter=TaskRunFilter(
                flow_run_id=TaskRunFilterFlowRunId(any_=[r.id for r in tree])))
    # task run states reach the API as events, shortly after the flow call returns: wait until all are final
    deadline = time.monotonic() + 30
    while True:
        runs = sorted((t for t in _run(go()) if t.id not in placeholders), key=lambda t: t.created)
        if all(t.state.is_final() for t in runs) or time.monotonic() > deadline:
            return runs
        time.sleep(0.5)


def states_by_name(runs: list) -> dict[str, str]:
    """{task run name: state name} keeping each name's latest task run (a retried flow run makes new ones)."""
    return {t.name: t.state.name for t in runs}


def logs_of(task_run_id: UUID, expect: str, timeout_s: float = 20.0) -> list[str]:
    """Log messages of a task run; waits until one contains `expect` (logs reach the API in batches)."""
    async def go():
        async with get_client() as client:
            return await client.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id])))
    deadline = time.monotonic() + timeout_s
    while True:
        msgs = [entry.message for entry in _run(go())]
        if any(expect in m for m in msgs) or time.monotonic() > deadline:
            return msgs
        time.sleep(0.5)


def flow_run_log(flow_run_id: UUID, expect: str, timeout_s: float = 20.0, with_tasks: bool = False) -> list[str]:
    """Messages logged by the flow run itself (and by its task runs if `with_tasks`: the run page's log in the
    UI), oldest first; waits until one contains `expect`."""
    async def go():
        async with get_client() as client:
            return await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    deadline = time.monotonic() + timeout_s
    while True:
        msgs = [e.message for e in sorted(_run(go()), key=lambda e: e.timestamp)
                if with_tasks or e.task_run_id is None]
        if any(expect in m for m in msgs) or time.monotonic() > deadline:
            return msgs
        time.sleep(0.5)


def artifacts_of(task_run_id: UUID) -> list:
    async def go():
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(
                task_run_id=ArtifactFilterTaskRunId(any_=[task_run_id])))
    return _run(go())
