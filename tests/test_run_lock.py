"""One run per run directory (contract/run_lock.py, flows.stage_flows.locked) under the session's Prefect server:
a second flow run of a busy run directory is refused naming the first, the holder's own subflows pass, and a lock
left by a SIGKILLed holder (a real flow run in another process) does not block the next run."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from prefect import flow
from prefect.context import FlowRunContext

from conftest import ROOT
from eagle3_core.config import preset
from eagle3_core.contract.run_lock import LOCK_NAME, RunDirBusy, holder
from flows.stage_flows import locked, prompts_flow

# a flow run in another process that holds the run directory's lock (as every flow of the pipeline does), prints
# its flow run id and name and sleeps until it is killed
HOLDER = """
import sys, time
from prefect import flow
from prefect.context import FlowRunContext
from eagle3_core.config import preset
from flows.stage_flows import locked

@flow(name="lock-holder")
def hold(run_dir: str) -> None:
    with locked(preset("debug_tiny", run_dir)):
        run = FlowRunContext.get().flow_run
        print("holding", run.id, run.name, flush=True)
        time.sleep(600)

hold(sys.argv[1])
"""


def test_a_second_run_of_a_run_dir_is_refused_naming_the_first(prefect_server, tmp_path):
    cfg = preset("debug_tiny", tmp_path / "run")
    started, release, first = threading.Event(), threading.Event(), {}

    @flow(name="first-run")
    def first_run() -> None:
        with locked(cfg):
            run = FlowRunContext.get().flow_run
            first.update(id=str(run.id), name=run.name)
            prompts_flow(cfg)                     # its own subflow takes the same lock: passes
            started.set()
            release.wait(120)

    t = threading.Thread(target=lambda: first.update(state=first_run(return_state=True)))
    t.start()
    try:
        assert started.wait(300), "the first run did not get going"
        second = prompts_flow(cfg, return_state=True)          # a second run of the same run directory
        assert second.is_failed()
        with pytest.raises(RunDirBusy, match=(
                rf"run directory {cfg.run_dir.resolve()} is in use by flow run '{first['name']}' \(id {first['id']}\)"
                rf", pid {os.getpid()} on .*, started 20.*; wait for that run to finish")):
            second.result()
    finally:
        release.set()
        t.join(120)
    assert first["state"].is_completed()
    assert holder(cfg.run_dir)["flow_run_id"] == first["id"]
    assert prompts_flow(cfg, return_state=True).is_completed()   # free again once the first run ended


@pytest.mark.slow
def test_a_lock_left_by_a_sigkilled_holder_does_not_block_the_next_run(prefect_server, tmp_path, spawned):
    from prefect.settings import PREFECT_API_URL
    cfg = preset("debug_tiny", tmp_path / "run")
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(ROOT)}
    proc = spawned(subprocess.Popen([sys.executable, "-c", HOLDER, str(cfg.run_dir)], cwd=ROOT, env=env,
                                    stdout=subprocess.PIPE, text=True))
    line = proc.stdout.readline()                           # blocks until the holder holds the lock
    assert line.startswith("holding "), (line, proc.poll())
    _, run_id, run_name = line.split()
    with pytest.raises(RunDirBusy, match=rf"flow run '{run_name}' \(id {run_id}\), pid {proc.pid} on "):
        prompts_flow(cfg)
    proc.send_signal(signal.SIGKILL)                         # no finally, no atexit: only the kernel cleans up
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert holder(cfg.run_dir)["pid"] == proc.pid             # its record stays; the flock went with it
    t0 = time.monotonic()
    state = prompts_flow(cfg, return_state=True)
    assert state.is_completed() and time.monotonic() - t0 < 120
    assert holder(cfg.run_dir)["pid"] == os.getpid() and (cfg.run_dir / LOCK_NAME).exists()
