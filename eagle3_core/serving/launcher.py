"""Start, health-check, watch and stop an inference server as a child process in its own process group.

The server binds 127.0.0.1 unless configured otherwise. Stopping kills the whole process group (SIGTERM, then
SIGKILL after a grace period), so no server outlives the stage on success, failure or cancel. While the block of
`launch` runs, the server is watched: `exit_error(url)` answers at once whether a server this process started at
`url` has exited, with the exit code or signal and the tail of its log (the client pool checks it, so a dead server
fails the stage in seconds instead of after `server.down_timeout_s`).
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from eagle3_core.serving.port_owner import held_by_group

LLAMA_CPP_VERSION = "0.3.36"
LLAMA_CPP_BUILD = f"llama.cpp-{LLAMA_CPP_VERSION}-noamx"   # the cache folder scripts/build_llama_server.sh writes


class ServerError(RuntimeError):
    """A server could not be started or reached; the message names the URL/binary and what to do."""


class ServerStopped(ServerError):
    """The server was stopped on purpose by this process (its stage ended, failed or was cancelled) while a request
    still wanted it: the request gives up at once instead of retrying against a server that will not return."""


class PortTaken(ServerError):
    """The port given to a server started here is held by another process (its health answer is not the server's):
    raised by wait_healthy; llama_server and sglang_server start again on another port when they chose it."""


class ServerExited(ServerError):
    """A server this process started exited while in use; the message names the exit code or signal and the tail
    of that attempt's log."""
    traceback_helps = False                 # the cause is outside this code: the run log shows the message alone


def next_attempt_log(folder: Path, stem: str = "server") -> Path:
    """Create and return `folder/<stem>.attempt-N.log`, N one past the highest existing attempt (1 for the first):
    each start of a stage's server gets its own log and earlier attempts' logs are kept. The file is created
    exclusively, so two servers started at once never share one."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    done = [int(n) for p in folder.glob(f"{stem}.attempt-*.log")
            if (n := p.name[len(stem) + len(".attempt-"):-len(".log")]).isdigit()]
    n = max(done, default=0) + 1
    while True:
        path = folder / f"{stem}.attempt-{n}.log"
        try:
            path.open("x").close()
            return path
        except FileExistsError:
            n += 1


# llama-server's routine per-request lines (slot timings, request log): nothing about why a server stopped
_ROUTINE = re.compile(r" I slot |log_server_r|update_slots|print_timing")


def log_tail(log_path: Path | None, lines: int = 3, width: int = 200) -> str:
    """The last `lines` lines of a server log that say something about it (llama-server's per-request timing
    and request lines left out: _ROUTINE), whole lines, each indented and cut at `width` characters with '...';
    '' if there is none. The rest is in the log, whose path the caller names."""
    if log_path is None or not Path(log_path).exists():
        return ""
    kept = [ln.rstrip() for ln in Path(log_path).read_text(errors="replace").splitlines()
            if ln.strip() and not _ROUTINE.search(ln)][-lines:]
    return "\n".join("  " + (ln if len(ln) <= width else ln[:width - 3] + "...") for ln in kept)


def describe_exit(returncode: int) -> str:
    """'exited with code 1' or 'was killed by signal 9 (SIGKILL)' (Popen's negative return codes are signals)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown"
        return f"was killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"


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
    """Poll `url`/health until it answers 200 from `proc`'s process group (port_owner.held_by_group: not another
    process that took the port). Raises PortTaken if another process listens on the port, ServerExited if the
    process exits, ServerError if the time runs out."""
    deadline, port = time.monotonic() + timeout_s, httpx.URL(url).port
    while time.monotonic() < deadline:
        exited = proc is not None and proc.poll() is not None
        try:
            healthy = not exited and httpx.get(f"{url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            healthy = False
        if (healthy or exited) and proc is not None and held_by_group(port, proc.pid) is False:
            raise PortTaken(f"{url}: another process listens on the port, not the server started for it (pid "
                            f"{proc.pid}); its log {log_path}, last lines:\n{log_tail(log_path)}")
        if exited:
            raise ServerExited(f"server for {url} {describe_exit(proc.returncode)} while starting; log {log_path}, "
                               f"last lines:\n{log_tail(log_path)}")
        if healthy:
            return
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
    """preexec hook: the kernel SIGKILLs the server if the thread that started it dies (Linux), so a cancelled or
    killed flow run never leaves a server behind. SIGKILL, not SIGTERM: a server whose client is gone has nothing
    to flush, and llama-server given SIGTERM this way was seen to stop answering HTTP yet hang in its own shutdown,
    an orphan of init for good (SGLang's scheduler processes carry their own PDEATHSIG, SIGKILL, and follow it).
    SIGTERM and SIGINT are unblocked and at their
    defaults first: a blocked or ignored signal is inherited through fork and exec, and a server that inherited
    a blocked SIGTERM (seen: a llama-server started from a pytest whose thread had it blocked) ignores both the
    stop and the parent-death signal and outlives everything."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


_running: list[subprocess.Popen] = []   # servers started by `launch` and not yet stopped
# url -> (process, log) of every server in a `launch` block of this process: the watch list of `exit_error`
_watched: dict[str, tuple[subprocess.Popen, Path]] = {}
# url -> (log, time.monotonic() when stopped) of every server whose `launch` block has ended (stopped on purpose):
# `exit_error` says so to users that began before the stop (a later server may reuse the port)
_stopped: dict[str, tuple[Path, float]] = {}


def started_here(url: str) -> Path | None:
    """The log of the server this process started at `url` (inside `launch`), or None for a server it did not
    start (an external one): errors give advice that fits the kind."""
    entry = _watched.get(url.rstrip("/"))
    return entry[1] if entry else None


def exit_error(url: str, since: float = float("-inf")) -> ServerError | None:
    """If the server this process started at `url` has exited (it is still inside its `launch` block, so nobody
    stopped it on purpose): a ServerExited naming its pid, exit code or signal and the tail of its log; if its
    `launch` block has ended (stopped on purpose) at or after `since` (time.monotonic() seconds: when the caller
    began using `url`): a ServerStopped. None while it runs, for a server this process did not start, or for one
    stopped before `since` (whatever answers at that URL now, e.g. on a reused port, is another server). Cheap (a
    waitpid with WNOHANG): call it often."""
    entry = _watched.get(url.rstrip("/"))
    stopped = _stopped.get(url.rstrip("/"))
    if entry is None and stopped is not None and stopped[1] >= since:
        log_path = stopped[0]
        return ServerStopped(f"the inference server at {url} was stopped by this process (its stage ended, failed "
                             f"or was cancelled; log {log_path}): this request gives up instead of retrying")
    if entry is None or entry[0].poll() is None:
        return None
    proc, log_path = entry
    return ServerExited(f"the inference server this stage started ({url}, pid {proc.pid}) "
                        f"{describe_exit(proc.returncode)} while the stage was using it; its log {log_path}, last "
                        f"lines:\n{log_tail(log_path)}\nFix the cause (out of memory? a killed process?) and retry "
                        f"the flow run: finished shards are kept and the stage starts a new server (a new attempt "
                        f"log)")
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
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is not _stop_on_sigterm:
        _previous_handler[0] = signal.signal(signal.SIGTERM, _stop_on_sigterm)


def _restore_sigterm_handler() -> None:
    if not _running and signal.getsignal(signal.SIGTERM) is _stop_on_sigterm:
        signal.signal(signal.SIGTERM, _previous_handler[0])


def spawn_server(argv: list[str], log_path: Path) -> subprocess.Popen:
    """Start the server command `argv` in its own process group, appending its output to `log_path`, with
    PR_SET_PDEATHSIG set (the kernel SIGKILLs it when the starting thread dies, even by SIGKILL). The caller
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
    of that (SIGKILL), the kernel SIGKILLs the server (PR_SET_PDEATHSIG). Inside the block the server is on
    the watch list of `exit_error`. Raises ServerError naming the URL and log if it is not healthy in time,
    ServerExited if it exits while starting.
    """
    proc = spawn_server(argv, log_path)
    _running.append(proc)
    _install_sigterm_handler()
    try:
        wait_healthy(url, proc, startup_timeout_s, log_path)
        _stopped.pop(url.rstrip("/"), None)
        _watched[url.rstrip("/")] = (proc, log_path)
        yield url
    finally:
        _watched.pop(url.rstrip("/"), None)                  # stopped on purpose from here on: not a crash
        _stopped[url.rstrip("/")] = (log_path, time.monotonic())   # requests in flight give up (ServerStopped)
        stop(proc)
        _running.remove(proc)
        _restore_sigterm_handler()


def running_server(url: str) -> tuple[int, Path] | None:
    """(pid, log path) of the server this process started at `url` and is running (inside `launch`'s block), else
    None (an external server, or one that has stopped)."""
    entry = _watched.get(url.rstrip("/"))
    return (entry[0].pid, entry[1]) if entry else None


def llama_server_argv(model: Path, host: str, port: int, parallel: int = 4, ctx_per_slot: int = 2048,
                      extra_args: list[str] | None = None) -> list[str]:
    """llama-server command: `-np parallel` slots sharing `-c parallel*ctx_per_slot` context; `--jinja` applies the
    GGUF's own chat template (the one the HF target's tokenizer carries); `-t llama_server_threads()`, which
    `extra_args` may override (llama.cpp keeps the last `-t` given)."""
    return [str(llama_server_binary()), "-m", str(model), "--host", host, "--port", str(port), "-np", str(parallel),
            "-c", str(parallel * ctx_per_slot), "--jinja", "-t", str(llama_server_threads()), *(extra_args or [])]


def llama_server_threads() -> int:
    """Decode threads for llama-server: the CPUs this process may run on, less one for the client (the stage's
    writer, the pipeline). ggml's threads meet at a spinning barrier after every op, so a server whose threads
    outnumber the free cores stalls whenever one of them is descheduled: on 2 cores shared with a second test run,
    `-t 2` fell to 0.35 tok/s per slot where `-t 1` keeps going (benchmarks/llama_server_threads.py)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, cpus - 1)


@contextmanager
def llama_server(model: Path, log_path: Path, host: str = "127.0.0.1", port: int = 0, parallel: int = 4,
                 ctx_per_slot: int = 2048, startup_timeout_s: float = 120.0, extra_args: list[str] | None = None):
    """Run llama.cpp's llama-server on `model` (GGUF) for the duration of the block; yields its base URL.
    Raises ServerError naming the binary/URL on failure."""
    with _launch_on_a_port(lambda p: llama_server_argv(model, host, p, parallel, ctx_per_slot, extra_args), host,
                           port, log_path, startup_timeout_s) as url:
        yield url


@contextmanager
def _launch_on_a_port(argv_for, host: str, port: int, log_path: Path, startup_timeout_s: float, tries: int = 3):
    """`launch(argv_for(port), ...)` on `port`, or, when `port` is 0, on a free port, chosen again (up to `tries`
    times) when another process took it before the server bound it (PortTaken); yields the URL."""
    with ExitStack() as stack:
        for attempt in range(1 if port else tries):
            p = port or free_port(host)
            try:
                url = stack.enter_context(launch(argv_for(p), f"http://{host}:{p}", log_path, startup_timeout_s))
                break
            except PortTaken:
                if port or attempt == tries - 1:
                    raise
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
                  extra_args: list[str] | None = None, python: str | None = None):
    """Run an SGLang server on `model` for the duration of the block (with `python`, e.g. the run's sglang_python,
    else this one); yields its base URL. SGLang's /health answers 503 until the model is loaded. Its scheduler and
    detokenizer processes die with it (SGLang sets their PDEATHSIG) and share its process group. Raises
    ServerError naming the URL and log on failure."""
    with _launch_on_a_port(lambda p: sglang_server_argv(model, host, p, revision, trust_remote_code, extra_args,
                                                         python), host, port, log_path, startup_timeout_s) as url:
        yield url
