"""Run only by tests/test_process_cleanup.py, in a pytest of its own that is then interrupted or killed: each test
starts a real llama-server, writes its pid and URL to $HOLD_FILE and waits to be interrupted."""
import os
import subprocess
import time
from pathlib import Path

import pytest

from eagle3_core.serving.launcher import free_port, llama_server, llama_server_argv, spawn_server, wait_healthy
from eagle3_core.target.loading import embedded_gguf_path


def _hold(pid: int, url: str) -> None:
    Path(os.environ["HOLD_FILE"]).write_text(f"{pid} {url}")
    time.sleep(600)


def _server_pid(url: str) -> int:
    port = url.rsplit(":", 1)[1]
    import psutil
    return next(p.pid for p in psutil.Process().children(recursive=True) if port in " ".join(p.cmdline()))


@pytest.fixture
def launched(tmp_path):
    with llama_server(embedded_gguf_path(), tmp_path / "server.log", parallel=1) as url:
        yield url


def test_hold_in_a_launcher_fixture(launched):
    _hold(_server_pid(launched), launched)


def test_hold_spawned(tmp_path, spawned):
    port = free_port()
    proc = spawned(spawn_server(llama_server_argv(embedded_gguf_path(), "127.0.0.1", port, parallel=1),
                                tmp_path / "server.log"))
    wait_healthy(f"http://127.0.0.1:{port}", proc, 120)
    _hold(proc.pid, f"http://127.0.0.1:{port}")


def test_hold_untracked(tmp_path):
    """The bug this backstop exists for: a test that starts a server and forgets it (no fixture, no finally)."""
    port = free_port()
    argv = llama_server_argv(embedded_gguf_path(), "127.0.0.1", port, parallel=1)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    wait_healthy(f"http://127.0.0.1:{port}", proc, 120)
    _hold(proc.pid, f"http://127.0.0.1:{port}")
