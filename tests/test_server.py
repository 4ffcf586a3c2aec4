"""The real llama.cpp llama-server: start on 127.0.0.1, answer through the async client, stop; errors name the URL."""
import asyncio

import pytest

from eagle3_core.serving.client import check_reachable, generate_all
from eagle3_core.serving.launcher import ServerError, llama_server
from eagle3_core.target import embedded_gguf_path


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


def test_server_dies_with_a_killed_flow_process(tmp_path):
    """A cancelled flow run's process can be SIGKILLed (Prefect's runner does after a grace period); the server it
    started, in its own process group, must not outlive it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import httpx

    script = tmp_path / "hold.py"
    script.write_text(
        "import sys, time\nfrom pathlib import Path\n"
        "from eagle3_core.serving.launcher import llama_server\nfrom eagle3_core.target import embedded_gguf_path\n"
        "with llama_server(embedded_gguf_path(), Path(sys.argv[1]), parallel=1) as url:\n"
        "    print(url, flush=True)\n    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "s.log")], stdout=subprocess.PIPE, text=True)
    url = proc.stdout.readline().strip()
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=1)
        except httpx.HTTPError:
            return
        time.sleep(0.2)
    raise AssertionError(f"llama-server at {url} still answers after its parent was killed")
