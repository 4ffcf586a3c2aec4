"""flows.sigterm: a SIGTERM whose exception is lost (as in native code that clears the error), Prefect's or our
own, is sent again until the process exits with 143; a SIGTERM that is taken ends the process at once, without a
resend."""
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
if sys.argv[2] == "lose_exit":                  # no flow: our own SystemExit is the exception lost
    try:
        print("ready", flush=True)
        time.sleep(60)
    except SystemExit:
        print("lost", flush=True)
    time.sleep(60)
ours = signal.getsignal(signal.SIGTERM)
signal.signal(signal.SIGTERM, lambda signum, frame: (_ for _ in ()).throw(TerminationSignal()))
try:
    if sys.argv[2] == "lose":
        try:
            print("ready", flush=True)
            time.sleep(60)
        except TerminationSignal:
            print("lost", flush=True)           # what native code that clears the error indicator does
    else:
        print("ready", flush=True)
    time.sleep(60)
except TerminationSignal:
    signal.signal(signal.SIGTERM, ours)
    print("taken", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)
"""


def _terminate(mode: str, resend_s: float) -> tuple[int, str, str]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(resend_s), mode], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"          # printed inside the try that takes the signal
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    return proc.returncode, out, err


def test_a_lost_sigterm_is_sent_again_and_the_process_exits_143():
    rc, out, err = _terminate("lose", resend_s=2.0)
    assert rc == 128 + signal.SIGTERM, err
    assert out.split() == ["lost", "taken"]
    assert "sending it again" in err


def test_a_taken_sigterm_exits_143_without_a_resend():
    rc, out, err = _terminate("take", resend_s=30.0)
    assert rc == 128 + signal.SIGTERM and out.split() == ["taken"], err
    assert "sending it again" not in err


def test_a_lost_exit_is_sent_again_too():
    rc, out, err = _terminate("lose_exit", resend_s=2.0)
    assert rc == 128 + signal.SIGTERM and out.split() == ["lost"], err
    assert "sending it again" in err
