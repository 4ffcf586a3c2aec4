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
