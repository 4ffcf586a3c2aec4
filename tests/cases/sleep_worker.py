"""A torchrun worker for tests/cases/hold_torchrun.py: appends its pid to $HOLD_FILE and sleeps until stopped
(with $HOLD_IGNORE_SIGTERM set, until SIGKILLed)."""
import os
import signal
import time

from eagle3_core.distributed.launch import die_with_parent, emit_line

die_with_parent()
if os.environ.get("HOLD_IGNORE_SIGTERM"):                     # a worker stuck in a collective: only SIGKILL stops it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(os.environ["HOLD_FILE"], "a") as f:
    f.write(f"{os.getpid()}\n")
emit_line(f"rank {os.environ.get('RANK')} holding")
time.sleep(600)
