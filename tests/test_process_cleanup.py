"""No llama-server outlives the test that started it: a pytest holding a real server is interrupted (Ctrl-C, the
SIGINT a user sends) or SIGKILLed, and the server is gone afterwards (checked with psutil by pid and port)."""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import ROOT

CASES = ROOT / "tests" / "cases" / "hold_server.py"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _as_from_a_shell() -> None:
    """preexec hook: the inner pytest starts as a shell starts one, SIGINT and SIGTERM at their defaults and
    unblocked. Ignored and blocked signals are inherited through fork and exec, and the outer pytest's state after
    hundreds of tests (libraries that block or ignore SIGINT around their own work) is not a user's shell's."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _signal_state(pid: int) -> str:
    """The blocked and ignored signal masks of `pid` (/proc/PID/status), for failure messages."""
    try:
        lines = open(f"/proc/{pid}/status").read().splitlines()
    except OSError:
        return "gone"
    return " ".join(line for line in lines if line.startswith(("SigBlk", "SigIgn")))


def _pytest(args: list[str], env: dict, spawned) -> subprocess.Popen:
    return spawned(subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT,
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    preexec_fn=_as_from_a_shell))  # noqa: PLW1509 (two signal calls, no imports)


def _start_holding(case: str, tmp_path, spawned) -> tuple[subprocess.Popen, int, str]:
    hold = tmp_path / "hold.txt"
    env = {**os.environ, "HOLD_FILE": str(hold), "PYTHONPATH": str(ROOT)}
    inner = _pytest([f"{CASES}::{case}"], env, spawned)
    deadline = time.monotonic() + 180
    while not hold.exists() or not hold.read_text():
        assert inner.poll() is None, f"inner pytest ended early:\n{inner.stdout.read()}"
        assert time.monotonic() < deadline, "the inner test did not start its server in time"
        time.sleep(0.2)
    pid, url = hold.read_text().split()
    assert _alive(int(pid))
    return inner, int(pid), url


def _assert_gone(pid: int, url: str, inner_output: str = "") -> None:
    deadline = time.monotonic() + 20
    while _alive(pid):
        assert time.monotonic() < deadline, f"llama-server {pid} ({url}) outlived its test\n{inner_output}"
        time.sleep(0.2)
    port = url.rsplit(":", 1)[1]
    assert not [p for p in psutil.process_iter(["name", "cmdline"])
                if p.info["name"] and "llama-server" in p.info["name"] and port in " ".join(p.info["cmdline"] or [])]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["test_hold_in_a_launcher_fixture", "test_hold_spawned", "test_hold_untracked"])
def test_ctrl_c_of_a_test_holding_a_server_leaves_no_server(case, tmp_path, spawned):
    inner, pid, url = _start_holding(case, tmp_path, spawned)
    state = _signal_state(inner.pid)
    inner.send_signal(signal.SIGINT)
    try:
        out, _ = inner.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the inner pytest did not end within 60 s of SIGINT (its signal masks before: {state}; now "
                    f"{_signal_state(inner.pid)})")
    assert inner.returncode == 2 and "KeyboardInterrupt" in out, out     # pytest's "interrupted" exit code
    _assert_gone(pid, url, out)


@pytest.mark.slow
def test_sigkilled_pytest_leaves_no_server(tmp_path, spawned):
    """No finalizer runs after SIGKILL: the kernel stops the server (PR_SET_PDEATHSIG, set by spawn_server)."""
    inner, pid, url = _start_holding("test_hold_spawned", tmp_path, spawned)
    inner.kill()
    inner.wait()
    _assert_gone(pid, url)


TORCHRUN_CASE = ROOT / "tests" / "cases" / "hold_torchrun.py"


@pytest.mark.parametrize("signals,ignore_term", [([signal.SIGINT], False), ([signal.SIGTERM], False),
                                                ([signal.SIGINT, signal.SIGINT], True)],
                         ids=["SIGINT", "SIGTERM", "SIGINT-twice-stuck-workers"])
@pytest.mark.slow
def test_signalled_pytest_during_torchrun_ends_and_leaves_no_worker(signals, ignore_term, tmp_path, spawned):
    """Ctrl-C or the SIGTERM a CI runner or `kill` sends, while a test waits on torchrun: pytest ends (exit 2,
    interrupted, finalizers run), it does not carry on with the next test, and no torchrun worker is left. The
    third case: workers that ignore SIGTERM (stuck in a collective) and a second Ctrl-C while the launcher waits
    for them; the launcher holds the second signal until it has SIGKILLed them (launch.deferred_signals)."""
    hold = tmp_path / "hold.txt"
    env = {**os.environ, "HOLD_FILE": str(hold), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if ignore_term:
        env["HOLD_IGNORE_SIGTERM"] = "1"
    inner = _pytest(["-s", f"{TORCHRUN_CASE}::test_hold_torchrun", f"{TORCHRUN_CASE}::test_hold_torchrun"], env,
                    spawned)
    deadline = time.monotonic() + 120
    while not hold.exists() or len(hold.read_text().split()) < 2:
        assert inner.poll() is None, f"inner pytest ended early:\n{inner.stdout.read()}"
        assert time.monotonic() < deadline, "torchrun's workers did not start in time"
        time.sleep(0.2)
    workers = [int(p) for p in hold.read_text().split()]
    assert all(_alive(p) for p in workers)
    state = _signal_state(inner.pid)
    for sig in signals:
        inner.send_signal(sig)
        time.sleep(1.0)
    try:
        out, _ = inner.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the inner pytest did not end within 120 s of {signals} (its signal masks before: {state})")
    assert inner.returncode == 2 and "KeyboardInterrupt" in out, out
    assert len(hold.read_text().split()) == 2, f"pytest went on to the next test after {signals}:\n{out}"
    assert "stopping leftover process" not in out, f"the launcher left workers to conftest's backstop:\n{out}"
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in workers):
        assert time.monotonic() < deadline, f"torchrun workers {workers} outlived pytest\n{out}"
        time.sleep(0.2)


def test_a_server_started_with_sigterm_blocked_has_it_unblocked(tmp_path, spawned):
    """The fault seen once in a full run: llama-server inherited a blocked SIGTERM from the pytest thread that
    started it (a signal mask passes through fork and exec), so neither the stop's SIGTERM nor the parent-death
    signal reached it and it outlived its pytest. spawn_server's preexec hook unblocks SIGTERM and SIGINT."""
    from eagle3_core.serving.launcher import free_port, llama_server_argv, spawn_server, stop, wait_healthy
    from eagle3_core.target.loading import embedded_gguf_path
    port = free_port()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        proc = spawned(spawn_server(llama_server_argv(embedded_gguf_path(), "127.0.0.1", port, parallel=1),
                                    tmp_path / "server.log"))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    wait_healthy(f"http://127.0.0.1:{port}", proc, 120)
    blocked = int(_signal_state(proc.pid).split("SigBlk:")[1].split()[0], 16)
    assert not blocked & ((1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGINT - 1))), hex(blocked)
    t0 = time.monotonic()
    stop(proc, grace_s=30)
    assert time.monotonic() - t0 < 25 and proc.returncode is not None   # SIGTERM did it, not the SIGKILL after
