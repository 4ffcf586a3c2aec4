"""flows.sigterm: a SIGTERM whose exception is lost (as in native code that clears the error) is sent again until
the process exits with 143; a SIGTERM that is taken ends the process at once, without a resend."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Prefect's bridge stands over our handler during a flow: it raises, and once its exception has unwound it puts the
# handler it found back and sends the signal again (prefect/utilities/engine/__init__.py, capture_sigterm).
CHILD = """
import os, signal, sys, time
from flows.sigterm import exit_on_sigterm

class TerminationSignal(BaseException):
    pass

exit_on_sigterm(resend_s=float(sys.argv[1]))
ours = signal.getsignal(signal.SIGTERM)
signal.signal(signal.SIGTERM, lambda signum, frame: (_ for _ in ()).throw(TerminationSignal()))
print("ready", flush=True)
try:
    if sys.argv[2] == "lose":
        try:
            time.sleep(60)
        except TerminationSignal:
            print("lost", flush=True)           # what native code that clears the error indicator does
    time.sleep(60)
except TerminationSignal:
    print("taken", flush=True)
    signal.signal(signal.SIGTERM, ours)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)
"""


def _terminate(mode: str) -> tuple[int, str, str]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, "0.5", mode], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    return proc.returncode, out, err


def test_a_lost_sigterm_is_sent_again_and_the_process_exits_143():
    rc, out, err = _terminate("lose")
    assert rc == 128 + signal.SIGTERM, err
    assert out.split() == ["lost", "taken"]
    assert err.count("sending it again") == 1


def test_a_taken_sigterm_exits_143_without_a_resend():
    rc, out, err = _terminate("take")
    assert rc == 128 + signal.SIGTERM and out.split() == ["taken"], err
    assert "sending it again" not in err
