"""Run logs: the stage functions' progress lines go to the run logger; transformers' and httpx's own loggers are
forwarded to the run log (the Prefect UI) at WARNING and above, which keeps httpx's one-line-per-request INFO
messages and transformers' loading chatter out while warnings and errors show."""
from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

from prefect import get_run_logger
from prefect.context import FlowRunContext, get_run_context
from prefect.exceptions import MissingContextError
from prefect.logging.handlers import APILogHandler

from eagle3_core.contract.layout import RunLayout
from eagle3_core.contract.numbers import human_bytes, percent

FORWARDED = ("transformers", "httpx")
# Prefect's loggers that log a failure with its traceback: the task run that raised it, then every flow run above
PREFECT_RUN_LOGGERS = ("prefect.task_runs", "prefect.flow_runs")
FORWARD_LEVEL = logging.WARNING


class _RunLogHandler(APILogHandler):
    """Sends records to the current flow/task run's log; drops records from threads outside any run."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            get_run_context()
        except MissingContextError:
            return
        super().emit(record)


@contextmanager
def run_log(level: int = FORWARD_LEVEL):
    """Inside a task or flow: yields the run logger; meanwhile records of FORWARDED loggers at `level` and above
    are sent to the run log too."""
    handler = _RunLogHandler(level=level)
    loggers = [logging.getLogger(name) for name in FORWARDED]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield get_run_logger()
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


def readable(key: str, value):
    """A manifest value as a summary line shows it: bytes per token in kB, fractions as percentages, other floats
    to 3 significant digits, lists by their length; anything else as it is."""
    if isinstance(value, list):
        return len(value)
    if key == "bytes_per_token" and isinstance(value, (int, float)):
        return f"{human_bytes(value)}/token"
    if key == "coverage" and isinstance(value, float):
        return percent(value)
    return f"{value:.3g}" if isinstance(value, float) else value


def done_before_this_run(stage: str) -> bool:
    """True when stage `stage`'s manifest (of the current flow run's config.run_dir) was written before this flow
    run started: the stage was skipped here, and its manifest's seconds are another run's."""
    ctx = FlowRunContext.get()
    cfg = (ctx.parameters or {}).get("config") if ctx else None
    if cfg is None:
        return False
    run_dir = cfg.run_dir if hasattr(cfg, "run_dir") else Path(cfg["run_dir"])
    path = RunLayout(run_dir).manifest(stage)
    return path.exists() and path.stat().st_mtime < ctx.start_time.timestamp()


class TracebackOnce(logging.Filter):
    """Prefect logs a failure's traceback in the task run that raised it and again in each flow run above it (a
    stage's subflow, the pipeline): the same ~40 lines two or three times, burying the cause. This filter keeps the
    first traceback of an exception and leaves later records their one line (the exception's repr); an exception
    whose class sets `traceback_helps = False` (a refusal naming a config field and its fix: check.CheckError)
    is logged without one."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None:
            if record.exc_info:              # exc_info=True outside an exception: Prefect's 'NoneType: None' line
                record.exc_info = None
            return True
        if getattr(exc, "_eagle3_traceback_logged", False) or not getattr(exc, "traceback_helps", True):
            record.exc_info, record.exc_text = None, None
        else:
            try:
                exc._eagle3_traceback_logged = True
            except AttributeError:            # an exception type without a __dict__: log it each time
                pass
        return True


def install_traceback_once() -> None:
    """Put TracebackOnce on Prefect's run loggers of this process (idempotent)."""
    for name in PREFECT_RUN_LOGGERS:
        lg = logging.getLogger(name)
        if not any(isinstance(f, TracebackOnce) for f in lg.filters):
            lg.addFilter(TracebackOnce())


install_traceback_once()      # every process that runs flows imports the tasks, and with them this module
