"""Served flows for test_cancel_flow_runs.py: each starts child processes, logs that they are up and waits to be
cancelled. `python tests/cancel_flows.py` serves both (a real Prefect runner).

- ddp-hold: one torchrun task whose 2 workers join a gloo group, print 'rank R pid P ready' and sleep.
- server-hold: the generation stage's server (llama-server on the embedded target, as `generation_servers` starts
  it for server.kind 'llama.cpp'), then 'server pid P ready' and a sleep.
"""
import sys
import time
from pathlib import Path

import psutil
from prefect import flow, get_run_logger, serve, task

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_core.config import preset
from eagle3_core.stages import generation_servers
from tasks.distributed import torchrun_task

WORKER = str(Path(__file__).with_name("ddp_worker.py"))


@flow(name="ddp-hold")
def ddp_hold_flow() -> None:
    torchrun_task([WORKER, "hold"], 2)


@task(name="server-hold")
def server_hold_task(run_dir: str) -> None:
    cfg = preset("debug_tiny", run_dir)
    cfg.server.parallel = 1
    with generation_servers(cfg):
        (server,) = [p.pid for p in psutil.Process().children() if "llama-server" in p.name()]
        get_run_logger().info(f"server pid {server} ready")
        time.sleep(600)


@flow(name="server-hold")
def server_hold_flow(run_dir: str) -> None:
    server_hold_task(run_dir)


if __name__ == "__main__":
    serve(ddp_hold_flow.to_deployment(name="ddp-hold-test"), server_hold_flow.to_deployment(name="server-hold-test"))
