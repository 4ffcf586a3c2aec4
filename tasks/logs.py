"""Run logs: the stage functions' progress lines go to the run logger; transformers' and httpx's own loggers are
forwarded to the run log (the Prefect UI) at WARNING and above, which keeps httpx's one-line-per-request INFO
messages and transformers' loading chatter out while warnings and errors show."""
from __future__ import annotations

import logging
import re
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
# the planning tasks, whose own line says what they found: their 'Finished in state Completed()' says nothing more
# and would push the run's plan (plan_stages_task's message) off the run log's first screen, so it is dropped
QUIET_TASKS = frozenset({"check", "plan-night", "plan-stages", "plan-generation", "plan-features"})


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


def failure_text(exc: BaseException) -> str:
    """'ServerExited: <its message>': an exception as the run log and Prefect's state message show it (its str
    with real line breaks, not the repr's literal '\\n')."""
    return f"{type(exc).__name__}: {exc}"


# failures already logged in full, oldest first: (type, message) -> the flow runs whose page shows it (a task run's
# records show on its flow run's page) and whether its traceback was logged
_said: dict[tuple[str, str], dict] = {}


def note_failure(exc: BaseException) -> None:
    """Register `exc` before a plain line quotes it (run_shards' line): that line then counts as the full message
    of each run page it reaches, and Prefect's later records of the failure there are shortened."""
    _entry(exc)


def _entry(exc: BaseException) -> dict:
    """The record of `exc` in _said, made on first sight. By type and message, not by object: a task's exception
    re-raised from its persisted result in the flow above is another object."""
    key = (type(exc).__name__, str(exc))
    if key not in _said:
        _said[key] = {"runs": set(), "traceback": False}
        while len(_said) > 200:
            _said.pop(next(iter(_said)))
    return _said[key]


class TracebackOnce(logging.Filter):
    """One failure, one message per run page. Prefect logs a failure in the task run that raised it and again in
    each flow run above it (a stage's subflow, the pipeline), each with its traceback and the exception's repr
    (line breaks as literal '\\n'), then 'Finished in state Failed(<the whole message>)'. This filter keeps, per
    flow run page, the first record of a failure in full (failure_text, real line breaks) and shortens later
    ones to the type with 'cause and fix above'; the traceback is logged once in all (never for a class that sets
    `traceback_helps = False`: a refusal naming a config field and its fix, check.CheckError, or a server that
    exited, launcher.ServerExited); a final-state line names the state alone. A plain record that quotes a
    failure (run_shards' line in the runs above a stage) counts as that page's full message. A QUIET_TASKS task's
    'Finished in state Completed()' is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        run = str(getattr(record, "flow_run_id", None))
        if getattr(record, "task_name", None) in QUIET_TASKS and record.getMessage() == "Finished in state " \
                "Completed()":
            return False
        if exc is None:
            if record.exc_info:              # exc_info=True outside an exception: Prefect's 'NoneType: None' line
                record.exc_info = None
            _plain(record, run)
            return True
        said, msg = _entry(exc), record.getMessage()
        if run in said["runs"]:
            record.msg, record.args = msg.replace(repr(exc), f"{type(exc).__name__} (cause and fix above)"), ()
            record.exc_info, record.exc_text = None, None
            return True
        said["runs"].add(run)
        record.msg, record.args = msg.replace(repr(exc), failure_text(exc)), ()
        if said["traceback"] or not getattr(exc, "traceback_helps", True):
            record.exc_info, record.exc_text = None, None
        said["traceback"] = True
        return True


_FINAL = re.compile(r"^Finished in state (\w+)\((.*)\)$", re.S)
_EXC_NAME = re.compile(r"exception:? (\w+):")


def _plain(record: logging.LogRecord, run: str) -> None:
    """A record without an exception: a final-state line with a long message ('Finished in state Failed('Task run
    encountered an exception ServerExited: <the message as a repr>')') becomes 'Finished in state Failed
    (ServerExited: cause and fix in the error line)' (the error line is the run page's record of the failure:
    TracebackOnce, or run_shards' line); a line quoting a registered failure marks it said on its run's page."""
    msg = record.getMessage()
    if (final := _FINAL.match(msg)):
        if "encountered an exception" in final[2] or len(final[2]) > 120 or "\\n" in final[2]:
            name = (_EXC_NAME.search(final[2]) or [None, "error"])[1]
            record.msg, record.args = f"Finished in state {final[1]} ({name}: cause and fix in the error line)", ()
        return
    for (name, text), said in _said.items():               # the whole message quoted: that page has it
        if text and f"{name}: {text}" in msg:
            said["runs"].add(run)


def install_traceback_once() -> None:
    """Put TracebackOnce on Prefect's run loggers of this process (idempotent)."""
    for name in PREFECT_RUN_LOGGERS:
        lg = logging.getLogger(name)
        if not any(isinstance(f, TracebackOnce) for f in lg.filters):
            lg.addFilter(TracebackOnce())


install_traceback_once()      # every process that runs flows imports the tasks, and with them this module
