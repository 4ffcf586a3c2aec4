"""Start, health-check and stop an inference server as a child process in its own process group.

The server binds 127.0.0.1 unless configured otherwise. Stopping kills the whole process group (SIGTERM, then
SIGKILL after a grace period), so no server outlives the stage on success, failure or cancel.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

LLAMA_CPP_VERSION = "0.3.36"
LLAMA_CPP_BUILD = f"llama.cpp-{LLAMA_CPP_VERSION}-noamx"   # the cache folder scripts/build_llama_server.sh writes


class ServerError(RuntimeError):
    """A server could not be started or reached; the message names the URL/binary and what to do."""


def llama_server_binary() -> Path:
    """The llama-server built by `scripts/build_llama_server.sh` (or $EAGLE3_LLAMA_SERVER).
    Raises ServerError with the build command if it is missing."""
    env = os.environ.get("EAGLE3_LLAMA_SERVER")
    if env:
        path = Path(env)
    else:
        cache = Path(os.environ.get("EAGLE3_CACHE", Path.home() / ".cache" / "eagle3-pipeline"))
        path = cache / LLAMA_CPP_BUILD / "bin" / "llama-server"
    if not path.exists():
        raise ServerError(f"llama-server not found at {path}: run `make setup` (or scripts/build_llama_server.sh)")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout_s: float, log_path: Path | None = None) -> None:
    """Poll `url`/health until it answers 200. Raises ServerError if the process exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text()[-2000:] if log_path and log_path.exists() else ""
            raise ServerError(f"server for {url} exited with code {proc.returncode} while starting; log {log_path}:"
                              f"\n{tail}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise ServerError(f"server at {url} not healthy after {timeout_s:.0f} s (log: {log_path}); raise "
                      f"server.startup_timeout_s or check the log")


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop the server's whole process group: SIGTERM, then SIGKILL after `grace_s`."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


# resolved in the parent: the preexec hook below runs between fork and exec and must not import or load anything
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """preexec hook: the kernel sends SIGTERM to the server if the thread that started it dies (Linux), so a
    cancelled or killed flow run never leaves a server behind."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


_running: list[subprocess.Popen] = []   # servers started by `launch` and not yet stopped
_previous_handler: list = [signal.SIG_DFL]


def _stop_on_sigterm(signum, frame) -> None:
    """SIGTERM (Prefect's cancel, a scheduler's stop) while servers run: stop them, then do what the handler that
    was installed before would have done (Prefect's raises its TerminationSignal; the default ends the process)."""
    for proc in _running:
        stop(proc, grace_s=5.0)
    previous = _previous_handler[0]
    signal.signal(signal.SIGTERM, previous)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm_handler() -> None:
    """Main thread only (Python installs handlers nowhere else; PDEATHSIG still covers other threads)."""
    import threading
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is not _stop_on_sigterm:
        _previous_handler[0] = signal.signal(signal.SIGTERM, _stop_on_sigterm)


def _restore_sigterm_handler() -> None:
    if not _running and signal.getsignal(signal.SIGTERM) is _stop_on_sigterm:
        signal.signal(signal.SIGTERM, _previous_handler[0])


def spawn_server(argv: list[str], log_path: Path) -> subprocess.Popen:
    """Start the server command `argv` in its own process group, appending its output to `log_path`, with
    PR_SET_PDEATHSIG set (the kernel sends it SIGTERM when the starting thread dies, even by SIGKILL). The caller
    owns it: `stop(proc)` when done (`launch` does). Raises FileNotFoundError if the binary is missing."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(argv)}\n".encode())
        log.flush()
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_die_with_parent)


@contextmanager
def launch(argv: list[str], url: str, log_path: Path, startup_timeout_s: float):
    """Run the server command `argv` for the duration of the block, waiting until `url`/health answers 200;
    yields `url`.

    The server runs in its own process group (so stopping it stops everything it spawned), logs to `log_path`, and
    is stopped on success, exception, Ctrl-C and SIGTERM (handler above); if this process dies without running any
    of that (SIGKILL), the kernel sends the server SIGTERM (PR_SET_PDEATHSIG). Raises ServerError naming the URL
    and log if it exits or is not healthy in time.
    """
    proc = spawn_server(argv, log_path)
    _running.append(proc)
    _install_sigterm_handler()
    try:
        wait_healthy(url, proc, startup_timeout_s, log_path)
        yield url
    finally:
        stop(proc)
        _running.remove(proc)
        _restore_sigterm_handler()


def llama_server_argv(model: Path, host: str, port: int, parallel: int = 4, ctx_per_slot: int = 2048,
                      extra_args: list[str] | None = None) -> list[str]:
    """llama-server command: `-np parallel` slots sharing `-c parallel*ctx_per_slot` context; `--jinja` applies the
    GGUF's own chat template (the one the HF target's tokenizer carries)."""
    return [str(llama_server_binary()), "-m", str(model), "--host", host, "--port", str(port), "-np", str(parallel),
            "-c", str(parallel * ctx_per_slot), "--jinja", "-t", str(os.cpu_count() or 2), *(extra_args or [])]


@contextmanager
def llama_server(model: Path, log_path: Path, host: str = "127.0.0.1", port: int = 0, parallel: int = 4,
                 ctx_per_slot: int = 2048, startup_timeout_s: float = 120.0, extra_args: list[str] | None = None):
    """Run llama.cpp's llama-server on `model` (GGUF) for the duration of the block; yields its base URL.
    Raises ServerError naming the binary/URL on failure."""
    port = port or free_port(host)
    argv = llama_server_argv(model, host, port, parallel, ctx_per_slot, extra_args)
    with launch(argv, f"http://{host}:{port}", log_path, startup_timeout_s) as url:
        yield url


def sglang_server_argv(model: str, host: str, port: int, revision: str | None = None,
                       trust_remote_code: bool = False, extra_args: list[str] | None = None,
                       python: str | None = None) -> list[str]:
    """`python -m sglang.launch_server` command for `model` (HF name or directory) on host:port, with the same
    Python as this process unless `python` is given. Flags from SGLang 0.5.14 `srt/server_args.py`; parallelism,
    memory and speculative flags go in `extra_args` (e.g. ['--tp', '8'])."""
    argv = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", host,
            "--port", str(port)]
    if revision:
        argv += ["--revision", revision]
    if trust_remote_code:
        argv.append("--trust-remote-code")
    return argv + list(extra_args or [])


@contextmanager
def sglang_server(model: str, log_path: Path, host: str = "127.0.0.1", port: int = 0, revision: str | None = None,
                  trust_remote_code: bool = False, startup_timeout_s: float = 1800.0,
                  extra_args: list[str] | None = None):
    """Run an SGLang server on `model` for the duration of the block; yields its base URL. SGLang's /health answers
    503 until the model is loaded. Its scheduler and detokenizer processes die with it (SGLang sets their
    PDEATHSIG) and share its process group. Raises ServerError naming the URL and log on failure."""
    port = port or free_port(host)
    argv = sglang_server_argv(model, host, port, revision, trust_remote_code, extra_args)
    with launch(argv, f"http://{host}:{port}", log_path, startup_timeout_s) as url:
        yield url
