"""Cancelling a flow run under a real Prefect server and runner (the runner's real path: Cancelling state, SIGTERM
to the flow process) leaves none of the processes its tasks started: torchrun and its workers (whose lines reach
the run log as they come), and the generation stage's inference server."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

SERVE = Path(__file__).with_name("cancel_flows.py")


def _wait(what, fn, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := fn()):
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture(scope="module")
def runner(prefect_server, tmp_path_factory):
    """tests/cancel_flows.py served by a real runner (its output in runner.log); yields the log path."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_RUNNER_POLL_FREQUENCY": "1",
           "OMP_NUM_THREADS": "1"}
    log = tmp_path_factory.mktemp("runner") / "runner.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(SERVE)], env=env, start_new_session=True, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        with get_client(sync_client=True) as client:
            def registered():
                try:
                    return client.read_deployment_by_name("server-hold/server-hold-test")
                except Exception:                                    # noqa: BLE001 - not registered yet
                    return None
            _wait("the served deployments", registered, 300)
        yield log
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def _cancel_after_ready(runner_log: Path, deployment: str, parameters: dict, n_ready: int, watch,
                        seen: dict | None = None) -> list[int]:
    """Start a run of `deployment`, wait for `n_ready` log lines ending in 'ready', call `watch(lines)` (returns the
    pids that must not survive, after checking they are alive), cancel the run through the API, see it Cancelled and
    return those pids. Fails fast (with the run's state, log and the runner's output) if the run ends first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling

    with get_client(sync_client=True) as client:
        run = run_deployment(deployment, parameters=parameters, timeout=0)

        def logs():
            return [x.message for x in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))]

        def ready_lines():
            lines = [m for m in logs() if m.endswith("ready")]
            if len(lines) < n_ready and (s := client.read_flow_run(run.id).state) and s.is_final():
                raise AssertionError("the flow run ended before its processes were ready")
            return lines if len(lines) == n_ready else None
        try:
            lines = _wait(f"{n_ready} 'ready' line(s) in the run log", ready_lines, 600)
        except AssertionError as e:
            raise AssertionError(f"{e}\nflow run state: {client.read_flow_run(run.id).state!r}\nrun log:\n"
                                 + "\n".join(logs()[-30:]) + "\nrunner output:\n"
                                 + runner_log.read_text()[-4000:]) from None
        pids = watch(lines)
        if seen is not None:
            seen["run_id"] = run.id
        client.set_flow_run_state(run.id, Cancelling(), force=True)
        state = _wait("the flow run to be cancelled",
                      lambda: (s := client.read_flow_run(run.id).state) and s.is_final() and s, 120)
        # Cancelled when the runner's control channel had connected before the cancel; a cancel in the first
        # seconds of a run takes Prefect's fallback path (plain SIGTERM, state Crashed): both must leave nothing
        assert state.is_cancelled() or (state.is_crashed() and "termination signal" in state.message), state
    return pids


def _gone(pids: list[int]) -> bool:
    return all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)


@pytest.mark.slow
def test_cancelled_flow_run_leaves_no_torchrun_process(runner):
    def watch(lines):
        workers = sorted(int(x.split()[3]) for x in lines)
        assert all(psutil.pid_exists(p) for p in workers)
        (torchrun,) = [p for p in psutil.Process(workers[0]).parents() if "torch.distributed.run" in
                       " ".join(p.cmdline())]
        return [torchrun.pid, *workers, *(c.pid for c in torchrun.children(recursive=True))]
    watched = _cancel_after_ready(runner, "ddp-hold/ddp-hold-test", {}, 2, watch)
    _wait(f"torchrun and its workers {watched} to exit", lambda: _gone(watched), 30)


@pytest.mark.slow
def test_cancelled_flow_run_leaves_no_inference_server(runner, tmp_path):
    def watch(lines):
        server = int(lines[0].split()[2])
        assert "llama-server" in psutil.Process(server).name()
        return [server]
    watched = _cancel_after_ready(runner, "server-hold/server-hold-test", {"run_dir": str(tmp_path / "run")}, 1,
                                  watch)
    _wait(f"llama-server {watched} to exit", lambda: _gone(watched), 30)


@pytest.mark.slow
def test_a_cancelled_run_ends_its_stage_subflow_cancelled_and_says_so(runner, tmp_path):
    """The parent of a stage subflow holding the generation server is cancelled: the server exits, the subflow
    ends Cancelled (not Crashed: tasks/cancel.end_cancelled where the engine's control channel does not mark it),
    and the parent run's own log says it was cancelled."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect_api import flow_run_tree

    def watch(lines):
        server = int(lines[0].split()[2])
        assert "llama-server" in psutil.Process(server).name()
        return [server]
    seen = {}
    watched = _cancel_after_ready(runner, "nested-server-hold/nested-server-hold-test",
                                  {"run_dir": str(tmp_path / "run")}, 1, watch, seen)
    _wait(f"llama-server {watched} to exit", lambda: _gone(watched), 30)
    parent = seen["run_id"]
    (sub,) = _wait("the subflow to end", lambda: [r for r in flow_run_tree(parent) if r.id != parent
                                                    and r.state is not None and r.state.is_final()] or None, 60)
    assert sub.state.is_cancelled(), sub.state
    with get_client(sync_client=True) as client:
        msgs = _wait("the parent's log to say it was cancelled", lambda: [
            x.message for x in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[parent])))
            if "cancelled" in x.message.lower() and x.task_run_id is None] or None, 30)
    assert msgs, msgs

