"""The real llama.cpp llama-server: start on 127.0.0.1, answer through the async client, stop; errors name the URL."""
import asyncio
from pathlib import Path

import pytest

from eagle3_core.serving.client import check_reachable, generate_all
from eagle3_core.serving.launcher import ServerError, llama_server
from eagle3_core.target.loading import embedded_gguf_path


def test_llama_server_generates_greedily_and_stops(tmp_path):
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": q}]}
            for i, q in enumerate(["Say hello.", "Name a color.", "Count to three."])]
    with llama_server(embedded_gguf_path(), tmp_path / "server.log", parallel=2) as url:
        assert url.startswith("http://127.0.0.1:")
        out = asyncio.run(generate_all(url, rows, 16, 0.0, 2, 1, 60))
        again = asyncio.run(generate_all(url, rows[:1], 16, 0.0, 1, 1, 60))
    assert [r["id"] for r in out] == ["p0", "p1", "p2"]
    assert all(r["response"] and r["finish_reason"] in ("stop", "length") for r in out)
    assert all(0 < r["completion_tokens"] <= 16 for r in out)
    assert again[0]["response"] == out[0]["response"]                  # greedy is deterministic
    with pytest.raises(ServerError, match="cannot reach"):
        asyncio.run(check_reachable(url))                                # stopped with the block


def test_unreachable_server_error_names_url_and_fix():
    with pytest.raises(ServerError, match=r"127\.0\.0\.1:9.*server\.url"):
        asyncio.run(check_reachable("http://127.0.0.1:9"))


def test_server_dies_with_a_killed_flow_process(tmp_path, spawned):
    """A cancelled flow run's process can be SIGKILLed (Prefect's runner does after a grace period); the server it
    started, in its own process group, must not outlive it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import httpx
    import psutil

    script = tmp_path / "hold.py"
    script.write_text(
        "import sys, time\nfrom pathlib import Path\n"
        "from eagle3_core.serving.launcher import llama_server\n"
        "from eagle3_core.target.loading import embedded_gguf_path\n"
        "with llama_server(embedded_gguf_path(), Path(sys.argv[1]), parallel=1) as url:\n"
        "    print(url, flush=True)\n    time.sleep(600)\n")
    proc = spawned(subprocess.Popen([sys.executable, str(script), str(tmp_path / "s.log")], stdout=subprocess.PIPE,
                                    text=True))
    url = proc.stdout.readline().strip()
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    server = psutil.Process(int(open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()[0]))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # the process itself, not its port: a llama-server given SIGTERM here once stopped answering HTTP and then
    # hung in its own shutdown, an orphan of init that a health check calls gone
    try:
        server.wait(timeout=15)
    except psutil.TimeoutExpired:
        server.kill()
        raise AssertionError(f"llama-server {server.pid} ({url}) outlived its killed parent; status "
                             f"{server.status()}") from None
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=1)


def test_sglang_command_is_built_as_an_argv_list():
    """SGLang cannot run here: the launch command is checked as data (flags of SGLang 0.5.14 srt/server_args.py)."""
    import sys

    from eagle3_core.serving.launcher import sglang_server_argv
    argv = sglang_server_argv("moonshotai/Kimi-K2.5", "127.0.0.1", 30000, revision="abc123", trust_remote_code=True,
                              extra_args=["--tp", "8", "--mem-fraction-static", "0.85"])
    assert argv == [sys.executable, "-m", "sglang.launch_server", "--model-path", "moonshotai/Kimi-K2.5", "--host",
                    "127.0.0.1", "--port", "30000", "--revision", "abc123", "--trust-remote-code", "--tp", "8",
                    "--mem-fraction-static", "0.85"]
    assert "--trust-remote-code" not in sglang_server_argv("m", "127.0.0.1", 1)


def test_llama_server_leaves_one_cpu_to_its_client_and_extra_args_override_the_threads(monkeypatch):
    """ggml's threads spin at a barrier after every op: a server with as many threads as cores stalls when anything
    else runs (on 2 cores beside a second server: 1.3 tok/s with -t 2 against 37 with -t 1, 4 slots,
    benchmarks/llama_server_threads.py). The default leaves one CPU free; llama.cpp keeps the last -t given."""
    from eagle3_core.serving import launcher
    for cpus, threads in ((1, 1), (2, 1), (16, 15)):
        monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)))
        argv = launcher.llama_server_argv(Path("m.gguf"), "127.0.0.1", 1, parallel=2)
        assert argv[argv.index("-t") + 1] == str(threads), cpus
    argv = launcher.llama_server_argv(Path("m.gguf"), "127.0.0.1", 1, extra_args=["-t", "8"])
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "-t"][-1] == "8"


def test_cancel_sigterm_to_the_process_group_stops_the_server(tmp_path, spawned):
    """What Prefect's runner does on cancel: SIGTERM to the flow run's process group. The server (own process
    group, so it gets no signal itself) is stopped by the launcher's handler, which then calls the handler that
    was installed before it (Prefect installs one that raises; here one that exits with code 3)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "hold.py"
    script.write_text(
        "import signal, sys, time\nfrom pathlib import Path\n"
        "from eagle3_core.serving.launcher import llama_server\n"
        "from eagle3_core.target.loading import embedded_gguf_path\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))\n"
        "with llama_server(embedded_gguf_path(), Path(sys.argv[1]), parallel=1) as url:\n"
        "    print(url, flush=True)\n    time.sleep(600)\n")
    proc = spawned(subprocess.Popen([sys.executable, str(script), str(tmp_path / "s.log")], stdout=subprocess.PIPE,
                                    text=True, start_new_session=True))
    url = proc.stdout.readline().strip()
    server_pid = int(open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()[0])
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 3                                 # the earlier handler ran too
    def alive(pid: int) -> bool:                  # a zombie (state Z) waiting for its reaper counts as dead
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while alive(server_pid):
        assert time.monotonic() < deadline, f"llama-server {server_pid} ({url}) outlived the cancelled run"
        time.sleep(0.1)
