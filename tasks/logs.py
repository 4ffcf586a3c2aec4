"""Run logs: the stage functions' progress lines go to the run logger; transformers' and httpx's own loggers are
forwarded to the run log (the Prefect UI) at WARNING and above, which keeps httpx's one-line-per-request INFO
messages and transformers' loading chatter out while warnings and errors show."""
from __future__ import annotations

import logging
from contextlib import contextmanager

from prefect import get_run_logger
from prefect.context import get_run_context
from prefect.exceptions import MissingContextError
from prefect.logging.handlers import APILogHandler

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
