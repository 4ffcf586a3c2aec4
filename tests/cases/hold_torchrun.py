"""Run only by tests/test_process_cleanup.py, in a pytest of its own that is then interrupted (SIGINT) or terminated
(SIGTERM): the test runs torchrun through the project's launcher with two workers that write their pids to
$HOLD_FILE and sleep; the outer test then signals this pytest and checks that it ends and no worker is left."""
from pathlib import Path

from eagle3_core.distributed.launch import run_torchrun

WORKER = Path(__file__).with_name("sleep_worker.py")


def test_hold_torchrun():
    run_torchrun([str(WORKER)], nproc_per_node=2, on_line=print, grace_s=10)
