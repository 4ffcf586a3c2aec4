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
        path = cache / f"llama.cpp-{LLAMA_CPP_VERSION}" / "bin" / "llama-server"
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


@contextmanager
def llama_server(model: Path, log_path: Path, host: str = "127.0.0.1", port: int = 0, parallel: int = 4,
                 ctx_per_slot: int = 2048, startup_timeout_s: float = 120.0, extra_args: list[str] | None = None):
    """Run llama.cpp's llama-server on `model` (GGUF) for the duration of the block; yields its base URL.

    `-np parallel` slots share `-c parallel*ctx_per_slot` context; `--jinja` applies the GGUF's own chat template
    (the one the tokenizer of the HF target carries). Raises ServerError naming the binary/URL on failure.
    """
    binary = llama_server_binary()
    port = port or free_port(host)
    url = f"http://{host}:{port}"
    args = [str(binary), "-m", str(model), "--host", host, "--port", str(port), "-np", str(parallel),
            "-c", str(parallel * ctx_per_slot), "--jinja", "-t", str(os.cpu_count() or 2), *(extra_args or [])]
    with server_process(args, url, log_path, startup_timeout_s):
        yield url


@contextmanager
def server_process(args: list[str], url: str, log_path: Path, startup_timeout_s: float):
    """Run the server command `args` (which must serve `url`) for the duration of the block, logging to
    `log_path`; waits for `url`/health first. Raises ServerError naming the URL and log on failure."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(args)}\n".encode())
        log.flush()
        # own process group: stop() kills the server and anything it spawned
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_die_with_parent)
    try:
        wait_healthy(url, proc, startup_timeout_s, log_path)
        yield proc
    finally:
        stop(proc)
