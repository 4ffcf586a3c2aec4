"""Served flows for test_cancel_flow_runs.py: each starts child processes, logs that they are up and waits to be
cancelled. `python tests/cancel_flows.py` serves both (a real Prefect runner).

- ddp-hold: one torchrun task whose 2 workers join a gloo group, print 'rank R pid P ready' and sleep.
- server-hold: the generation stage's server (llama-server on the embedded target, started by the start-servers
  task through tasks.control.inference_servers, as generation_flow does), then 'server pid P ready' and a sleep.
"""
import logging
import sys
import time
from pathlib import Path

import psutil
from prefect import flow, get_run_logger, serve

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_core.config import preset
from tasks.cancel import end_cancelled, say_cancelled
from tasks.control import inference_servers, log_in_parent_runs
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


@flow(name="server-hold-stage", on_crashed=[end_cancelled], on_cancellation=[say_cancelled])
def server_hold_stage(run_dir: str) -> None:
    """server-hold as a stage subflow (the stage flows carry the same on_crashed hook); its 'ready' line reaches
    the parent run's log, as a stage's lines do."""
    cfg = preset("debug_tiny", run_dir)
    cfg.server.parallel = 1
    with inference_servers(cfg, True):
        (server,) = [p.pid for p in psutil.Process().children() if "llama-server" in p.name()]
        log_in_parent_runs(logging.INFO, f"server pid {server} ready")
        time.sleep(600)


@flow(name="nested-server-hold", on_cancellation=[say_cancelled])
def nested_server_hold_flow(run_dir: str) -> None:
    """A pipeline-like parent: one stage subflow holding the generation server."""
    server_hold_stage(run_dir)


if __name__ == "__main__":
    serve(ddp_hold_flow.to_deployment(name="ddp-hold-test"), server_hold_flow.to_deployment(name="server-hold-test"),
          nested_server_hold_flow.to_deployment(name="nested-server-hold-test"))
