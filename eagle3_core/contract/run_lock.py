"""One run per run directory at a time: an exclusive flock on `<run_dir>/.eagle3-run.lock`.

The flow run that takes the lock owns it: its own subflows re-enter it (`held` is a context variable, which Prefect
copies into subflows and into the threads of its shard tasks), and the processes it starts (torchrun ranks,
servers) never take it. Anyone else, in this process or another, is refused with RunDirBusy naming the holder
(pid, host, flow run id and name, start time: written into the lock file by the holder).

The kernel drops a flock when the last descriptor of its open file closes, so a holder that is SIGKILLed (or whose
host process crashes) leaves no lock behind: the next run takes it at once. The descriptor is not inherited by
child processes (Python opens files non-inheritable), so a server left running by a killed holder cannot keep it.
"""
from __future__ import annotations

import contextvars
import fcntl
import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

LOCK_NAME = ".eagle3-run.lock"

# run directories (resolved) whose lock the current context holds: nested `run_lock` calls pass
_held: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("eagle3_run_locks", default=frozenset())


class RunDirBusy(RuntimeError):
    """Another run holds the run directory's lock; the message names it and what to do."""


def holder(run_dir: Path) -> dict | None:
    """What the lock file of `run_dir` says about its last holder ({pid, host, flow_run_id, flow_run_name,
    started}), or None if there is no readable record. A record stays after its holder ended: only the flock says
    whether it is held."""
    try:
        return json.loads((Path(run_dir) / LOCK_NAME).read_text() or "null")
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _describe(h: dict | None) -> str:
    if not h:
        return "another process (it has not written its details yet)"
    run = f"flow run '{h.get('flow_run_name')}' (id {h.get('flow_run_id')})" if h.get("flow_run_id") else "a run"
    return f"{run}, pid {h.get('pid')} on {h.get('host')}, started {h.get('started')}"


@contextmanager
def run_lock(run_dir: Path, flow_run_id: str | None = None, flow_run_name: str | None = None):
    """Hold the lock of `run_dir` (created if missing) for the block; re-entrant within the holder's context.

    Raises RunDirBusy naming the holder if another run holds it. Never waits: a second Quick run or a nightly
    run firing during a manual one is refused at once, and can be retried when the first has finished."""
    run_dir = Path(run_dir).resolve()
    if str(run_dir) in _held.get():
        yield
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirBusy(f"run directory {run_dir} is in use by {_describe(holder(run_dir))}; wait for that run "
                             f"to finish (or cancel it), or give this run another run_dir") from None
        record = {"pid": os.getpid(), "host": socket.gethostname(), "flow_run_id": flow_run_id,
                  "flow_run_name": flow_run_name, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        token = _held.set(_held.get() | {str(run_dir)})
        try:
            yield
        finally:
            _held.reset(token)
    finally:
        os.close(fd)                                   # releases the flock
