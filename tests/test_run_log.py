"""One failure, one message (without a Prefect server): a server's exit names its log and a few clean lines of it,
the first log record of a failure shows its text with real line breaks, every later record of the same failure
(the flows above the task, 'Finished in state Failed(...)') is one short line."""
from __future__ import annotations

import logging
import sys

from eagle3_core.serving.launcher import ServerExited, log_tail
from tasks.logs import TracebackOnce, failure_text, note_failure

LLAMA_TAIL = """\
0.41.931.701 I slot      release: id  0 | task 4 | stop processing: n_tokens = 188, truncated = 0
0.40.000.001 W llama_model_loader: ignoring an unknown key
1.02.842.712 I slot print_timing: id  1 | task 69 | prompt eval time =    1813.07 ms /    94 tokens
1.02.842.765 I slot print_timing: id  1 | task 69 |        eval time =   20910.79 ms /    64 tokens
1.03.139.675 I slot      release: id  0 | task 135 | stop processing: n_tokens = 488, truncated = 0
1.04.000.000 E srv  main: {}
1.04.111.029 I srv    operator(): operator(): cleaning up before exit...
""".format("x" * 400)


def test_a_servers_log_tail_is_a_few_whole_lines_without_request_timings(tmp_path):
    log = tmp_path / "server.attempt-1.log"
    log.write_text(LLAMA_TAIL)
    tail = log_tail(log).splitlines()
    assert tail[0] == "  0.40.000.001 W llama_model_loader: ignoring an unknown key"
    assert tail[1].startswith("  1.04.000.000 E srv  main: xxx") and tail[1].endswith("...") and len(tail[1]) == 202
    assert tail[2] == "  1.04.111.029 I srv    operator(): operator(): cleaning up before exit..."
    assert "print_timing" not in log_tail(log, lines=10) and log_tail(tmp_path / "none.log") == ""


def _record(name: str, msg: str, exc: BaseException | None, *args, run: str = "stage") -> logging.LogRecord:
    info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    record = logging.LogRecord(name, logging.ERROR, __file__, 1, msg, args, info)
    record.flow_run_id = run                        # Prefect's run loggers set it (a task run's: its flow run's)
    return record


def test_a_failure_is_said_once_per_run_page_then_referred_to():
    f = TracebackOnce()
    try:
        raise ServerExited("the inference server this stage started (http://127.0.0.1:1, pid 7) was killed by "
                           "signal 9 (SIGKILL) while the stage was using it; its log /r/server.attempt-1.log, last "
                           "lines:\n  cleaning up\nFix the cause and retry the flow run")
    except ServerExited as e:
        exc = e
    task = _record("prefect.task_runs", "Task run failed with exception: %r", exc, exc)
    assert f.filter(task) and task.exc_info is None                 # traceback_helps = False: no traceback
    assert task.getMessage() == f"Task run failed with exception: {failure_text(exc)}"
    assert "\\n" not in task.getMessage() and "\n  cleaning up\nFix" in task.getMessage()
    # the stage flow (the same page as its task runs): the same failure, re-raised from the task's result as
    # another object, in one short line; so is every final-state line
    again = ServerExited(str(exc))
    flow = _record("prefect.flow_runs", "Encountered exception during execution: %r", again, again)
    assert f.filter(flow) and flow.exc_info is None
    assert flow.getMessage() == "Encountered exception during execution: ServerExited (cause and fix above)"
    final = _record("prefect.flow_runs", "Finished in state %s", None,
                    "Failed('Flow run encountered an exception: ServerExited: " + repr(str(exc))[1:-1] + "')")
    assert f.filter(final)
    assert final.getMessage() == "Finished in state Failed (ServerExited: cause and fix in the error line)"
    done = _record("prefect.task_runs", "Finished in state %s", None, "Completed()")
    assert f.filter(done) and done.getMessage() == "Finished in state Completed()"
    # a failure Prefect logs only in a task's final state (a task whose retry condition said no): shortened too;
    # run_shards registers it and its line, on every page it reaches, is that page's full message
    other = ServerExited(str(exc).replace("pid 7", "pid 8"))
    task_final = _record("prefect.task_runs", "Finished in state %s", None, "Failed(\"Task run encountered an "
                         "exception ServerExited: " + repr(str(other))[1:-1] + "\")", run="generation")
    assert f.filter(task_final) and task_final.getMessage().startswith("Finished in state Failed (ServerExited: ")
    note_failure(other)
    for page in ("generation", "pipeline"):
        line = _record("prefect.flow_runs", "generation: shards [1] of 4 failed (first error: %s)", None,
                       failure_text(other), run=page)
        assert f.filter(line) and "pid 8) was killed by signal 9" in line.getMessage()
        top = _record("prefect.flow_runs", "Encountered exception during execution: %r", other, other, run=page)
        assert f.filter(top) and top.getMessage().endswith("ServerExited (cause and fix above)")
    line = _record("prefect.flow_runs", "generation: shards [1] of 4 failed (first error: %s)", None,
                   failure_text(exc), run="pipeline")
    assert f.filter(line) and "was killed by signal 9" in line.getMessage()
    top = _record("prefect.flow_runs", "Encountered exception during execution: %r", again, again, run="pipeline")
    assert f.filter(top) and top.getMessage().endswith("ServerExited (cause and fix above)")


def test_a_planning_tasks_completed_line_is_dropped_and_a_stage_tasks_kept():
    """The run log's first screen: check, plan-night and plan-stages say what they found in the run's plan
    message; their 'Finished in state Completed()' lines are dropped, a stage task's and any failure are kept."""
    f = TracebackOnce()

    def final(task: str, state: str) -> logging.LogRecord:
        record = _record("prefect.task_runs", "Finished in state %s", None, state)
        record.task_name = task                     # Prefect's task run logger sets it
        return record
    assert [f.filter(final(t, "Completed()")) for t in ("check", "plan-night", "plan-stages", "plan-generation",
                                                        "plan-features")] == [False] * 5
    assert f.filter(final("train", "Completed()")) and f.filter(final("check", "Failed('check refused the run')"))
    assert f.filter(_record("prefect.flow_runs", "Finished in state %s", None, "Completed()"))


def test_a_failure_whose_traceback_helps_keeps_it_once_in_all():
    f = TracebackOnce()
    try:
        raise ValueError("shard 3: a bug\nsecond line")
    except ValueError as e:
        exc = e
    first = _record("prefect.task_runs", "Task run failed with exception: %r", exc, exc)
    assert f.filter(first) and first.exc_info is not None and first.getMessage().endswith("a bug\nsecond line")
    later = _record("prefect.flow_runs", "Encountered exception during execution: %r", exc, exc)
    assert f.filter(later) and later.exc_info is None and "ValueError (cause and fix above)" in later.getMessage()
    # the page above names it once, in full, without a second traceback
    above = _record("prefect.flow_runs", "Encountered exception during execution: %r", exc, exc, run="pipeline")
    assert f.filter(above) and above.exc_info is None and above.getMessage().endswith("a bug\nsecond line")
    assert sys.exc_info()[0] is None


def test_a_stopped_or_exited_server_is_never_retried():
    """ServerStopped raised while handling a dropped connection (what a shard meets when the stage's server is
    stopped by a cancel) is no transient error: the task gives up instead of 'Retry 1/3'."""
    import httpx

    from eagle3_core.serving.launcher import ServerStopped
    from tasks.retry import is_transient
    req = httpx.Request("POST", "http://127.0.0.1:9")
    try:
        try:
            raise httpx.ConnectError("connection refused", request=req)
        except httpx.ConnectError:
            raise ServerStopped("the inference server at http://127.0.0.1:9 was stopped by this process")
    except ServerStopped as e:
        stopped = e
    assert stopped.__context__ is not None and is_transient(stopped.__context__)
    assert not is_transient(stopped) and not is_transient(ServerExited("exited"))
