"""The torchrun Prefect task under a real Prefect server and runner: worker lines reach the run log as they come,
and cancelling the flow run (the runner's real path: Cancelling state, SIGTERM to the flow process) leaves no
torchrun or worker process alive."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

SERVE = Path(__file__).with_name("ddp_cancel_flow.py")


def _wait(what, fn, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := fn()):
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.mark.slow
def test_cancelled_flow_run_leaves_no_torchrun_process(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL
    from prefect.states import Cancelling

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_RUNNER_POLL_FREQUENCY": "1",
           "OMP_NUM_THREADS": "1"}
    runner_log = tmp_path / "runner.log"
    with open(runner_log, "w") as out:
        runner = subprocess.Popen([sys.executable, str(SERVE)], env=env, start_new_session=True,
                                  stdout=out, stderr=subprocess.STDOUT)

    def diagnosis(client, run_id) -> str:
        state = client.read_flow_run(run_id).state
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
        return (f"flow run state: {state!r}\nrun log:\n" + "\n".join(log.message for log in logs[-30:]) +
                "\nrunner output (last 4000 chars):\n" + runner_log.read_text()[-4000:])
    try:
        with get_client(sync_client=True) as client:
            def deployment():
                try:
                    return client.read_deployment_by_name("ddp-hold/ddp-hold-test")
                except Exception:                                    # noqa: BLE001 - not registered yet
                    return None
            _wait("the served deployment", deployment, 300)
            run = run_deployment("ddp-hold/ddp-hold-test", timeout=0)

            def ready_lines():
                logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
                lines = [log.message for log in logs if log.message.endswith("ready")]
                if len(lines) < 2 and (s := client.read_flow_run(run.id).state) and s.is_final():
                    raise AssertionError("the flow run ended before both workers were ready")
                return lines if len(lines) == 2 else None
            try:
                lines = _wait("both workers' 'ready' lines in the run log", ready_lines, 600)
            except AssertionError as e:
                raise AssertionError(f"{e}\n{diagnosis(client, run.id)}") from None
            worker_pids = sorted(int(x.split()[3]) for x in lines)
            tree = psutil.Process(runner.pid).children(recursive=True)
            torchrun = [p for p in tree if "torch.distributed.run" in " ".join(p.cmdline())]
            assert len(torchrun) == 1 and all(psutil.pid_exists(p) for p in worker_pids)
            watched = [torchrun[0].pid, *worker_pids, *(c.pid for c in torchrun[0].children(recursive=True))]

            client.set_flow_run_state(run.id, Cancelling(), force=True)
            state = _wait("the flow run to be cancelled",
                          lambda: (s := client.read_flow_run(run.id).state) and s.is_final() and s, 120)
            assert state.is_cancelled(), state

        def gone():
            return all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE
                       for p in watched)
        _wait(f"torchrun and its workers {watched} to exit", gone, 30)
    finally:
        os.killpg(runner.pid, signal.SIGTERM)
        runner.wait(timeout=30)
