"""Cancel that ends clean: a stage subflow stopped by the cancel of the run above it ends Cancelled, not Crashed,
and every run above it says so in its log.

Prefect delivers a cancel as SIGTERM to the flow process. With the runner's control channel the engine marks each
flow run Cancelled itself; without it (a work-pool worker, or a cancel in a run's first seconds) every subflow in
the process, and under `serve` the root too, is marked Crashed ('Execution was aborted by a termination signal').
This on_crashed hook turns such a Crashed into Cancelled when the root run was being cancelled, and the
on_cancellation hook `say_cancelled` puts one line in the run's log and every run above it (the runner cancels a
root run without a word in its log).
"""
from __future__ import annotations

from prefect.client.orchestration import get_client
from prefect.logging.loggers import flow_run_logger
from prefect.states import Cancelled


def _chain(client, flow_run) -> list:
    """The flow runs above `flow_run`, nearest first (empty for a root run)."""
    chain, run = [], flow_run
    while run.parent_task_run_id is not None:
        run = client.read_flow_run(client.read_task_run(run.parent_task_run_id).flow_run_id)
        chain.append(run)
    return chain


def _said_cancelled(client, flow_run, chain: list) -> None:
    root = chain[-1] if chain else flow_run
    msg = (f"cancelled: {flow_run.name}" + (f", a stage of {root.name}," if chain else "") + " stopped by the "
           "cancel; the stages and shards that finished are kept: run it again to continue")
    for r in [flow_run, *chain]:
        flow_run_logger(flow_run=r).info(msg)


def say_cancelled(flow, flow_run, state) -> None:
    """Prefect on_cancellation hook of the pipeline and stage flows: 'cancelled: ...' in the run's log and every
    run above it."""
    with get_client(sync_client=True) as client:
        _said_cancelled(client, flow_run, _chain(client, flow_run))


def end_cancelled(flow, flow_run, state) -> None:
    """Prefect on_crashed hook of the pipeline and stage flows: a run crashed by a termination signal whose root
    run was being cancelled (its state history holds Cancelling) is set Cancelled, and the line 'cancelled: ...'
    goes to it and every run above."""
    if "termination signal" not in (state.message or ""):
        return
    with get_client(sync_client=True) as client:
        chain = _chain(client, flow_run)
        root = chain[-1] if chain else flow_run
        # the root's history: a cancel passes Cancelling before the SIGTERM (the root itself may be Crashed by now)
        if not any(s.is_cancelling() or s.is_cancelled() for s in client.read_flow_run_states(root.id)):
            return                                      # a SIGTERM that is no cancel (a shutdown): a crash
        client.set_flow_run_state(flow_run.id, Cancelled(message=f"cancelled by the cancel of {root.name}"),
                                  force=True)
        _said_cancelled(client, flow_run, chain)
