"""A served flow for test_distributed_prefect's cancellation test: one torchrun task whose 2 workers join a gloo
group, print 'rank R pid P ready' and sleep. `python tests/ddp_cancel_flow.py` serves it (a real Prefect runner)."""
import sys
from pathlib import Path

from prefect import flow

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.distributed import torchrun_task

WORKER = str(Path(__file__).with_name("ddp_worker.py"))


@flow(name="ddp-hold")
def ddp_hold_flow() -> None:
    torchrun_task([WORKER, "hold"], 2)


if __name__ == "__main__":
    ddp_hold_flow.serve(name="ddp-hold-test")
