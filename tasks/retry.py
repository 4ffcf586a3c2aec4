"""Which failures a task retries, and how: transient ones only (a dropped connection, a timeout, HTTP 408/429/5xx,
a server that is not up yet), with exponential backoff and jitter. Anything else (bad input, a bug, a corrupt
file) fails the task at once, so that a flow-run retry, not a task retry, re-runs it after a fix.
"""
from __future__ import annotations

import os

import httpx
from prefect.tasks import exponential_backoff

from eagle3_core.serving.launcher import ServerExited, ServerStopped

# attempts after the first; with BACKOFF_S = 10 the waits are about 10, 20, 40 s (+-50% jitter)
RETRIES = 3
# base delay; tests shorten it with EAGLE3_RETRY_DELAY_S (read at import: task options are set at decoration)
BACKOFF_S = float(os.environ.get("EAGLE3_RETRY_DELAY_S", "10"))
RETRY_OPTIONS = {"retries": RETRIES, "retry_delay_seconds": exponential_backoff(backoff_factor=BACKOFF_S),
                 "retry_jitter_factor": 0.5}
TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}


def is_transient(exc: BaseException | None) -> bool:
    """True if `exc` or an exception it was raised from is a transient network or server error. Never for a server
    this process stopped (launcher.ServerStopped: the stage ended or was cancelled) or one that exited
    (ServerExited): a retry would meet the same dead server, however the request failed before."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (ServerStopped, ServerExited)):
            return False
        if isinstance(exc, httpx.HTTPStatusError):
            return exc.response.status_code in TRANSIENT_STATUS
        if isinstance(exc, (httpx.TransportError, httpx.TimeoutException, ConnectionError, TimeoutError)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def retry_if_transient(task, task_run, state) -> bool:
    """Prefect `retry_condition_fn`: retry a failed task run only if it failed with a transient error."""
    try:
        state.result()
    except BaseException as exc:  # noqa: BLE001 - we only classify the task's exception here
        return is_transient(exc)
    return False
