"""Served flows for test_cancel_flow_runs.py: each starts child processes, logs that they are up and waits to be
cancelled. `python tests/cancel_flows.py` serves both (a real Prefect runner).

- ddp-hold: one torchrun task whose 2 workers join a gloo group, print 'rank R pid P ready' and sleep.
- server-hold: the generation stage's server (llama-server on the embedded target, started by the start-servers
  task through tasks.control.inference_servers, as generation_flow does), then 'server pid P ready' and a sleep.
"""
import sys
import time
from pathlib import Path

import psutil
from prefect import flow, get_run_logger, serve

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_core.config import preset
from tasks.control import inference_servers
from tasks.distributed import torchrun_task

WORKER = str(Path(__file__).with_name("ddp_worker.py"))


@flow(name="ddp-hold")
def ddp_hold_flow() -> None:
    torchrun_task([WORKER, "hold"], 2)


@flow(name="server-hold")
def server_hold_flow(run_dir: str) -> None:
    """The generation flow's server path: start-servers task, then wait inside inference_servers (the flow's
    thread), as generation_flow waits on its shard tasks."""
    cfg = preset("debug_tiny", run_dir)
    cfg.server.parallel = 1
    with inference_servers(cfg, True):
        (server,) = [p.pid for p in psutil.Process().children() if "llama-server" in p.name()]
        get_run_logger().info(f"server pid {server} ready")
        time.sleep(600)


if __name__ == "__main__":
    serve(ddp_hold_flow.to_deployment(name="ddp-hold-test"), server_hold_flow.to_deployment(name="server-hold-test"))
