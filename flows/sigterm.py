"""SIGTERM for `python -m flows.pipeline` (what `make demo` runs): the process ends with exit code 143, its Prefect
run Crashed and its temporary Prefect server stopped, even when the signal arrives while native code runs.

Prefect's flow engine installs its own SIGTERM handler for the run, which raises `TerminationSignal` in the main
thread; once that exception has unwound the flow it restores the handler it found and sends the signal again
(prefect/utilities/engine/__init__.py, `capture_sigterm`). A Python signal handler runs at the next bytecode the
main thread executes, and when that is inside native code which clears the error indicator, the exception is lost:
a SIGTERM sent while the prompts stage imported transformers' tokenizers (the sentencepiece extension module) left
the run going to its end. The C-level handler still writes the signal number to the wakeup fd
(`signal.set_wakeup_fd`), so a watcher thread sees every SIGTERM and, while the main thread has not reached the
interpreter's shutdown, sends it again every `resend_s` seconds.

Limits: an asyncio loop in the main thread that adds signal handlers takes the wakeup fd and leaves none when it
removes them (no code of this project does); a resend that lands while a taken signal is still unwinding (Prefect's
crash handling, servers stopping: a few seconds in the runs seen) interrupts that unwinding, hence 30 s.
"""
from __future__ import annotations

import os
import signal
import sys
import threading


def _exit_143(signum: int, frame) -> None:
    """The handler Prefect hands the signal back to: SystemExit(128 + signum), which runs Prefect's atexit hook
    that stops the temporary server."""
    sys.exit(128 + signum)


def _resend_until_exit(read_fd: int, resend_s: float) -> None:
    main = threading.main_thread()
    while int(signal.SIGTERM) not in os.read(read_fd, 512):
        pass                                    # other signals with a Python handler (SIGINT) write here too
    while True:
        main.join(resend_s)                     # returns once the interpreter shuts down (threading._shutdown)
        if not main.is_alive():
            return
        print(f"SIGTERM has not ended the run within {resend_s:g} s (a signal's exception can be lost in native "
              f"code): sending it again", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)


def _no_wakeup_fd_in_child() -> None:
    """A forked child (a data loader worker) must not report its own signals to the parent's watcher."""
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:                          # not the child's main thread (3.11 makes the forking thread it)
        pass


def exit_on_sigterm(resend_s: float = 30.0) -> None:
    """Install `_exit_143` for SIGTERM and start the watcher that sends a SIGTERM again every `resend_s` seconds
    until the interpreter shuts down. Main thread only (ValueError otherwise: `signal.signal` and `set_wakeup_fd`
    are main-thread calls); call once, before the flow starts."""
    signal.signal(signal.SIGTERM, _exit_143)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)            # set_wakeup_fd requires a non-blocking fd
    signal.set_wakeup_fd(write_fd)
    os.register_at_fork(after_in_child=_no_wakeup_fd_in_child)
    threading.Thread(target=_resend_until_exit, args=(read_fd, resend_s), name="sigterm-resend", daemon=True).start()
