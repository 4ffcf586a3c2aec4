"""Run `torchrun` as a child in its own process group, stream its output line by line, and never leave a process
behind: on success, failure, an exception in the caller (a cancelled Prefect flow run raises one in the thread
that waits here) or the caller's death.

Why more than killpg: torchrun's agent starts each worker in a new session (torch.distributed.elastic's
SubprocessHandler uses start_new_session), so the workers are not in torchrun's process group. Stopping therefore
takes a snapshot of the whole process tree first (/proc, Linux), sends SIGTERM to torchrun (its handler stops the
workers) and to every descendant, and SIGKILLs whatever is still alive after the grace period. Workers also call
`die_with_parent()` so that they get SIGTERM if torchrun itself is SIGKILLed, and torchrun gets SIGTERM if the
thread that started it dies (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


class TorchrunError(RuntimeError):
    """torchrun exited with a non-zero code; the message leads with the first failing rank's own error
    (root_cause), then the command and the last lines of its output."""


# what a rank raises when another rank died first: the cause is elsewhere (gloo's pair.cc, NCCL, c10d)
PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "DistBackendError", "NCCL communicator",
             "ProcessGroupNCCL", "Broken pipe", "Socket Timeout", "Timed out waiting", "Connection refused")
_RANK_ERROR = re.compile(r"^\[rank(\d+)\]:\s*((?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt|Exit)\b.*)$")
_SUMMARY_FIELD = re.compile(r"^\s*(rank|exitcode|traceback)\s*:\s*(.*)$")


def root_cause(lines: list[str]) -> str | None:
    """The first failing rank's own error in torchrun's output (`lines`: torchrun's and its workers' lines): the
    rank torchrun's summary names under 'Root Cause (first observed failure)' (torch/distributed/elastic/
    multiprocessing/errors: ChildFailedError.format_msg), with its exception line as the workers print it
    ('[rankN]: ValueError: ...', torch's excepthook prefix) or its signal; failing that, the first rank exception
    that is not a peer's loss (PEER_LOSS: gloo's 'Connection closed by peer' on the rank that waited). E.g.
    'rank 1: ValueError: shard 3 is bad'. None when the output names no failure."""
    errors = [(int(m[1]), m[2].strip()) for m in map(_RANK_ERROR.match, lines) if m]
    summary: dict[str, str] = {}
    if any(x.startswith("Root Cause") for x in lines):
        for x in lines[max(i for i, x in enumerate(lines) if x.startswith("Root Cause")):]:
            if (m := _SUMMARY_FIELD.match(x)) and m[1] not in summary:
                summary[m[1]] = m[2].strip()
    if "rank" in summary and (first := re.match(r"\d+", summary["rank"])):
        rank = int(first[0])
        own = [e for r, e in errors if r == rank]
        if own:
            return f"rank {rank}: {own[-1]}"
        code = summary.get("exitcode", "")
        if (sig := re.search(r"\((SIG\w+)\)", code)) is not None:
            return (f"rank {rank} was killed by {sig[1]}" + (" (the kernel's out-of-memory killer sends SIGKILL: "
                                                           "see dmesg)" if sig[1] == "SIGKILL" else ""))
        return f"rank {rank} exited with code {code.split()[0] if code else '?'} (its lines above say why)"
    own = [(r, e) for r, e in errors if not any(p in e for p in PEER_LOSS)]
    r, e = (own or errors or [(None, None)])[0]
    return None if e is None else f"rank {r}: {e}"


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux; a no-op elsewhere), with `sig`
    unblocked (a blocked signal mask is inherited through fork and exec, and a blocked SIGTERM would make the
    request, and stop_tree's SIGTERM, do nothing). Called by worker entry points at start, and (as a preexec hook)
    by `run_torchrun` for torchrun itself."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(sig))


def emit_line(text: str) -> None:
    """Write `text` and its newline to stdout in one write() call. Workers share torchrun's output pipe and run
    unbuffered (PYTHONUNBUFFERED, set by run_torchrun), where print() writes the text and the newline separately:
    two ranks' lines then interleave ('...readyrank 1 ...'). One write of a line under PIPE_BUF bytes is atomic."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def torchrun_command(args: list[str], nproc_per_node: int, nnodes: int = 1, node_rank: int = 0,
                     rdzv_endpoint: str | None = None, python: str | None = None) -> list[str]:
    """The torchrun command line for `args` (e.g. ['-m', 'eagle3_core.pipeline.train_ddp', '--config', f]), run by
    `python` (another environment's interpreter, e.g. sglang_python) or this process's.

    One node: `--standalone` (a local rendezvous on a free port, so parallel runs do not collide). Several nodes:
    the c10d rendezvous at `rdzv_endpoint` (host:port of node 0), run the same command on every node with its
    `node_rank`. Raises ValueError if nnodes > 1 without an endpoint."""
    cmd = [python or sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}"]
    if nnodes == 1:
        cmd.append("--standalone")
    else:
        if not rdzv_endpoint:
            raise ValueError("nnodes > 1 needs rdzv_endpoint (host:port of node 0, reachable from every node)")
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={rdzv_endpoint}"]
    return cmd + list(args)


def descendants(pid: int) -> list[int]:
    """Pids of every live descendant of `pid` (children first), read from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:                                                  # exited while we looked
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])                   # field 4; comm may hold spaces
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                                                                 # a zombie is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_tree(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Stop `proc` and every process below it: SIGTERM to all (torchrun forwards it to its workers), SIGKILL to
    whatever is alive after `grace_s` seconds, then reap `proc`."""
    family = descendants(proc.pid) if proc.poll() is None else []
    for pid in [proc.pid, *family]:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (proc.poll() is None or any(_alive(p) for p in family)):
        time.sleep(0.1)
    for pid in [proc.pid, *family]:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()


@contextmanager
def deferred_signals(signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Hold `signals` while the block runs and deliver them (to the handlers in place before) when it ends.

    For clean-up that must finish: a second Ctrl-C, or the runner's SIGTERM after a first Ctrl-C, arriving while
    stop_tree waits would otherwise raise inside it and skip the SIGKILL of workers that ignore SIGTERM. Python runs
    signal handlers in the main thread only (signal module docs), so elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: held.append(signum)) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(held):
            signal.raise_signal(sig)


def run_torchrun(args: list[str], nproc_per_node: int, on_line: Callable[[str], None] = print,
                 log_path: Path | None = None, env: dict[str, str] | None = None, grace_s: float = 30.0,
                 cwd: Path | None = None, python: str | None = None, **rdzv) -> None:
    """Run torchrun on `args` (torchrun_command; `rdzv`: nnodes, node_rank, rdzv_endpoint; `python`: the
    interpreter, default this one) and wait for it.

    Every output line of torchrun and its workers (stdout and stderr, unbuffered) goes to `on_line` as it comes
    (without the newline) and to `log_path` if given. Whatever ends the wait (the run finishing, an exception in
    `on_line`, KeyboardInterrupt, Prefect's TerminationSignal) the process tree is stopped (stop_tree) before this
    returns or raises; a signal arriving during that stop is held until it is done (deferred_signals). Raises
    TorchrunError (the first failing rank's own error: root_cause; command, exit code, last 50 lines) on a
    non-zero exit.

    OMP_NUM_THREADS, unless the caller's environment sets it: the host's cores divided among the local workers
    (torchrun's own default is 1, which made the workers' CPU side, shard encoding, hashing and writing, the
    bottleneck: hf_tp extraction at world size 1 ran at 0.68x the in-process backend on an H200,
    benchmarks/tp_extract_throughput.py).
    """
    cmd = torchrun_command(args, nproc_per_node, python=python, **rdzv)
    full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    full_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc_per_node)))
    tail: deque[str] = deque(maxlen=50)
    evidence: list[str] = []                # rank exceptions and torchrun's failure summary, for root_cause
    summary: deque[str] = deque(maxlen=400)
    log = open(log_path, "a") if log_path else None                     # noqa: SIM115 (closed in finally)
    # own session and process group: a signal meant for the caller's group (Ctrl-C, the runner's SIGTERM) does not
    # hit the workers mid-collective; the caller stops them through stop_tree instead
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env=full_env, cwd=cwd, start_new_session=True,
                            preexec_fn=die_with_parent)  # noqa: PLW1509 (one prctl call, resolved in the parent)
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            summary.append(line)
            if _RANK_ERROR.match(line) and len(evidence) < 1000:
                evidence.append(line)
            if log:
                log.write(line + "\n")
                log.flush()
            on_line(line)
        proc.wait()
    finally:
        with deferred_signals():
            stop_tree(proc, grace_s)
        proc.stdout.close()
        if log:
            log.close()
    if proc.returncode != 0:
        cause = root_cause(evidence + list(summary))
        raise TorchrunError((f"{cause}\n" if cause else "") + f"torchrun exited with code {proc.returncode}"
                            + (f" (every line in {log_path})" if log_path else "") + f": {' '.join(cmd)}\n"
                            + "\n".join(tail))
