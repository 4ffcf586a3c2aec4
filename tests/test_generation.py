"""Regeneration against the real llama-server (embedded model, loopback, as many slots as requests in flight) on
GSM8K prompts: the token-id path, faults (server SIGKILLed and restarted, a fault-injecting proxy, the client
SIGKILLed and rerun), the shard contract and the quality gate. Answers are 8 tokens long to keep this fast."""
import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

from conftest import ROOT, SHARED_DATA
from eagle3_core.config import GenerationConfig, PipelineConfig, PromptConfig, ServerConfig
from eagle3_core.data.chat import prompt_ids
from eagle3_core.generation.quality import QualityGateError, is_degenerate
from eagle3_core.generation.turns import split_final_answer
from eagle3_core.pipeline.generation_stage import (
    finish_generation,
    generation_plan,
    generation_shard_done,
    generation_shards,
    run_generation,
    run_generation_shard,
)
from eagle3_core.pipeline.prompts_stage import run_prompts
from eagle3_core.serving.client import RequestRejected, parse_response, request_body, request_with_retries
from eagle3_core.serving.launcher import (
    ServerError,
    free_port,
    llama_server,
    llama_server_argv,
    spawn_server,
    stop,
    wait_healthy,
)
from eagle3_core.serving.pool import ServerPool
from eagle3_core.target.loading import embedded_gguf_path
from fault_proxy import FaultProxy

GSM8K = str(SHARED_DATA / "gsm8k" / "train.jsonl")
SLOTS = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One real llama-server with SLOTS slots, shared by the tests that do not kill it. One thread: on 2 shared
    cores, two spinning threads made it ~10x slower here."""
    with llama_server(embedded_gguf_path(), tmp_path_factory.mktemp("srv") / "server.log", parallel=SLOTS,
                      ctx_per_slot=1024, extra_args=["-t", "1"]) as url:
        yield url


def make_run(run_dir: Path, n: int, urls: list[str], **gen) -> PipelineConfig:
    """A run directory holding `n` GSM8K train prompts, generating on `urls`."""
    cfg = PipelineConfig(run_dir=run_dir, prompts=PromptConfig(sources=[GSM8K], num_train=n, num_eval=1),
                         server=ServerConfig(kind="external", urls=urls, probe_interval_s=0.5),
                         generation=GenerationConfig(**{"max_new_tokens": 8, "concurrency": SLOTS, "shard_size": 4,
                                                        "flush_rows": 1, "retry_backoff_s": 0.2,
                                                        "max_truncated_frac": 1.0, **gen}))
    run_prompts(cfg, log=lambda *_: None)
    return cfg


def all_rows(cfg: PipelineConfig) -> list[dict]:
    return [r for f in sorted((cfg.run_dir / "generations").glob("shard_*.parquet"))
            for r in pq.read_table(f).to_pylist()]


def train_ids(cfg: PipelineConfig) -> list[str]:
    return json.loads((cfg.run_dir / "prompts" / "manifest.json").read_text())["train_ids"]


def assert_each_prompt_answered_once(cfg: PipelineConfig) -> list[dict]:
    rows = all_rows(cfg)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == len(train_ids(cfg)), (len(ids), len(set(ids)))
    assert set(ids) == set(train_ids(cfg))
    assert all(r["response"] and r["finish_reason"] in ("stop", "length") for r in rows)
    return rows


@pytest.mark.slow
def test_token_ids_from_llama_cpp_completion_match_the_chat_api_and_the_gate(server, tmp_path, tokenizer):
    """api 'llama.cpp' (token ids in and out, like SGLang's /generate) gives the same greedy answer as
    /v1/chat/completions; the ids are the target's chat template and decode to the answer text. All answers are
    cut at 8 tokens: the quality gate stops the stage, keeps the shards, and passes once the limit allows it."""
    ids_cfg = make_run(tmp_path / "ids", 4, [server], api="llama.cpp", concurrency=1, max_truncated_frac=0.2)
    chat_cfg = make_run(tmp_path / "chat", 4, [server], api="openai", concurrency=1)
    records = {}
    for cfg in (ids_cfg, chat_cfg):
        records[cfg.generation.api] = [run_generation_shard(cfg, k, urls=[server])
                                       for k in generation_shards(cfg)]
    ids_rows, chat_rows = all_rows(ids_cfg), all_rows(chat_cfg)
    assert [r["id"] for r in ids_rows] == [r["id"] for r in chat_rows] == train_ids(ids_cfg)
    for a, b in zip(ids_rows, chat_rows):
        sent = json.loads(a["messages"])
        assert sent == json.loads(b["messages"]) and sent[-1]["role"] == "user"
        assert a["prompt_ids"] == prompt_ids(tokenizer, sent) and a["prompt_tokens"] == len(a["prompt_ids"])
        assert len(a["output_ids"]) == a["completion_tokens"] == 8 and a["finish_reason"] == "length"
        assert tokenizer.decode(a["output_ids"]) == a["response"] == b["response"]
        assert b["output_ids"] == [] and b["completion_tokens"] == 8
    with pytest.raises(QualityGateError, match=r"truncated: 4 of 4 answers \(100\.0%, limit 20\.0%, "
                                               r"generation\.max_truncated_frac\).*max_new_tokens"):
        finish_generation(ids_cfg, records["llama.cpp"])
    shard = ids_cfg.run_dir / "generations" / "shard_00000.parquet"
    before = shard.stat().st_mtime_ns
    ids_cfg.generation.max_truncated_frac = 1.0
    m = run_generation(ids_cfg)                       # shards finished: only the gate runs again
    assert m["samples"] == 4 and m["failed"] == 0 and m["quality"]["counts"]["truncated"] == 4
    assert m["token_ids"] and shard.stat().st_mtime_ns == before


def test_a_rejected_request_is_not_retried_and_keeps_the_server_message(server):
    async def go():
        async with ServerPool([server]) as pool, httpx.AsyncClient(timeout=60) as client:
            body = request_body("llama.cpp", None, [10**6], 4, 0.0)        # not a token id of this model
            await request_with_retries(pool, client, "llama.cpp", body, max_retries=5, backoff_s=0.1)
    with pytest.raises(RequestRejected, match=r"HTTP 400.*invalid tokens"):
        asyncio.run(go())


def test_sglang_generate_request_and_response_fields():
    """Fields of SGLang 0.5.14's /generate (managers/io_struct.py GenerateReqInput; managers/tokenizer_manager.py
    meta_info; managers/schedule_batch.py FINISH_LENGTH / FINISH_ABORT to_json), read from the wheel, not run."""
    body = request_body("sglang", None, [1, 2, 3], 2048, 0.0)
    assert body == {"input_ids": [1, 2, 3], "stream": False,
                    "sampling_params": {"max_new_tokens": 2048, "temperature": 0.0}}
    answer = {"text": " Paris.", "output_ids": [3681, 13, 2],
              "meta_info": {"id": "a1", "finish_reason": {"type": "length", "length": 3}, "prompt_tokens": 3,
                            "weight_version": "default", "reasoning_tokens": 0, "completion_tokens": 3,
                            "cached_tokens": 0, "e2e_latency": 0.05, "spec_verify_ct": 2}}
    out = parse_response("sglang", answer, "http://h:30000")
    assert (out["output_ids"], out["finish_reason"], out["completion_tokens"], out["prompt_tokens"]) == \
        ([3681, 13, 2], "length", 3, 3)
    assert out["response"] == " Paris." and json.loads(out["timings"])["spec_verify_ct"] == 2
    abort = {**answer, "meta_info": {**answer["meta_info"], "finish_reason": {
        "type": "abort", "message": "retracted", "status_code": None, "err_type": None}}}
    from eagle3_core.serving.client import RetryableError
    with pytest.raises(RetryableError, match="retracted"):
        parse_response("sglang", abort, "http://h:30000")
    with pytest.raises(RequestRejected, match=r"h:30000/generate.*generation\.api"):
        parse_response("sglang", {"choices": []}, "http://h:30000")


@pytest.mark.slow
def test_server_killed_mid_run_and_restarted_every_prompt_answered_once(tmp_path, spawned):
    """Two servers share the load; one is SIGKILLed with a request in flight and restarted on its port. The run
    completes, every prompt answered exactly once, the lost request retried, the restarted server used again.

    Synchronised on events, not time: each server sits behind a HoldingProxy. Server 0's proxy holds its second
    request, and the kill comes once it is held (in flight for sure); server 1's proxy then holds every new request
    until server 0's proxy has answered a health probe of the restarted server, so that prompts are left for it."""
    from recording_proxy import HoldingProxy
    ports = [free_port(), free_port()]
    direct = [f"http://127.0.0.1:{p}" for p in ports]
    procs: dict[int, subprocess.Popen] = {}

    def start(i: int) -> None:
        argv = llama_server_argv(embedded_gguf_path(), "127.0.0.1", ports[i], parallel=1, ctx_per_slot=1024,
                                 extra_args=["-t", "1"])
        procs[i] = spawned(spawn_server(argv, tmp_path / f"server{i}.log"))     # stopped by the fixture too
        wait_healthy(direct[i], procs[i], 120)

    start(0)
    start(1)
    after_kill = threading.Event()
    with HoldingProxy(direct[0], hold=lambda n, body: n == 2) as p0, \
            HoldingProxy(direct[1], hold=lambda n, body: after_kill.is_set()) as p1:
        urls = [p0.url, p1.url]
        cfg = make_run(tmp_path / "run", 16, urls, progress_interval_s=0.05, max_new_tokens=24)
        snaps, result, lines = [], [], []
        worker = threading.Thread(target=lambda: result.append(run_generation(
            cfg, log=lines.append, on_progress=snaps.append)))
        try:
            worker.start()
            assert p0.held.wait(300), "server 0 never got a second request"
            after_kill.set()
            os.killpg(procs[0].pid, signal.SIGKILL)
            procs[0].wait()
            answered_before = sum("answer" in e for e in p0.posts)
            p0.health_ok.clear()                          # from here on only the restarted server answers /health
            p0.release()                                  # its forward fails: the client's connection drops
            start(0)
            assert p0.health_ok.wait(300), "the pool never probed the restarted server"
            p1.release()
            worker.join(600)
        finally:
            for p in procs.values():
                stop(p)
    assert result, "the run did not finish"
    m = result[0]
    assert m["samples"] == 16 and m["failed"] == 0 and m["retry_kinds"].get("connection", 0) >= 1
    rows = assert_each_prompt_answered_once(cfg)
    assert {r["server"] for r in rows} == set(urls)
    assert snaps[-1]["servers"][urls[0]]["answered"] > answered_before      # back in use after the restart
    assert snaps[-1]["done"] == snaps[-1]["total"] == 16 and snaps[-1]["output_tokens"] == m["completion_tokens"]
    assert lines[-1].startswith("generation: 16 of 16 prompts (100.0%), ") and " retries" in lines[-1]


@pytest.mark.slow
def test_stage_server_killed_fails_the_run_through_the_watcher_and_a_rerun_runs_only_unfinished_shards(
        prefect_server, tmp_path, monkeypatch):
    """The generation flow (called by a parent flow, as the pipeline does) starts llama-server itself; it is
    SIGKILLed once shard 0 has finished. The run fails within seconds through the launcher's watch, not after
    server.down_timeout_s (1800 s): the error names the signal and that attempt's log, the parent run's log names
    the failed shards. A rerun starts a new server (its own log; the first attempt's is kept) and runs only the
    shards that had not finished (the finished one comes back Cached).

    Synchronised on events, not time: the shard tasks of shards 1-3 wait at a gate (the real shard function runs
    once it opens) while shard 0 runs; the server is killed when shard 0's record says it finished, then the gate
    opens. (Waiting for a record file to exist raced: a record is also written for a shard that failed, and on a
    loaded machine the kill came before any shard had finished.)"""
    import psutil
    from prefect import flow

    from eagle3_core.pipeline.table import STAGES
    from eagle3_core.serving import launcher
    from eagle3_core.serving.launcher import ServerExited
    from flows.stage_flows import generation_flow
    from prefect_api import flow_run_tree, logs_of, states_by_name, task_runs

    cfg = make_run(tmp_path / "run", 8, [], shard_size=2, concurrency=1, max_new_tokens=16)
    cfg.server = ServerConfig(kind="llama.cpp", parallel=1, ctx_per_slot=1024, extra_args=["-t", "1"],
                              probe_interval_s=0.5)
    assert cfg.server.down_timeout_s == 1800.0
    out = cfg.run_dir / "generations"
    gate, row = threading.Event(), STAGES["generation"]
    real = row.shards.run

    def gated(config, shard, *args, **kwargs):
        if shard != 0:
            assert gate.wait(600), "the gate never opened"
        return real(config, shard, *args, **kwargs)
    monkeypatch.setitem(STAGES, "generation", dataclasses.replace(row, shards=dataclasses.replace(row.shards,
                                                                                                  run=gated)))

    @flow(name="generation-parent")
    def parent() -> dict:
        return generation_flow(cfg)

    result = {}
    worker = threading.Thread(target=lambda: result.update(state=parent(return_state=True)))
    worker.start()
    try:
        deadline = time.monotonic() + 600
        while not generation_shard_done(cfg, 0):                         # the event: shard 0's complete record
            assert time.monotonic() < deadline and worker.is_alive(), "the run ended before shard 0 finished"
            time.sleep(0.1)
        # the stage's server (the module's shared `server` fixture may be running too): the one logging here
        (pid,) = [proc.pid for proc, log in launcher._watched.values() if log.parent == out]
        server = psutil.Process(pid)
        assert server.name() == "llama-server"
        server.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
    finally:
        gate.set()
        worker.join(600)
    monkeypatch.setitem(STAGES, "generation", row)
    failed_after = time.monotonic() - killed_at
    state = result["state"]
    assert state.is_failed() and failed_after < 120, (state, failed_after)
    log1 = out / "server.attempt-1.log"
    with pytest.raises(ServerExited, match=rf"pid {server.pid}\) was killed by signal 9 \(SIGKILL\) while the "
                                           rf"stage was using it; its log {log1}, last lines:\n"):
        state.result()
    finished = [k for k in range(4) if generation_shard_done(cfg, k)]
    unfinished = [k for k in range(4) if k not in finished]
    assert finished == [0] and unfinished == [1, 2, 3], finished
    # the line to act on is in the parent run's log, not only in the generation subflow's
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    parent_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        deadline = time.monotonic() + 30
        while not any(f"generation: shards {unfinished} of 4 failed (first error: " in (msgs := [
                m.message for m in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[parent_id])))])
                for _ in [0]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert any(f"generation: shards {unfinished} of 4 failed" in m and "SIGKILL" in m for m in msgs), msgs
    assert len(flow_run_tree(parent_id)) == 2
    first_log = log1.read_bytes()
    assert b"llama-server" in first_log.splitlines()[0]

    rerun = generation_flow(cfg, return_state=True)
    assert rerun.is_completed()
    got = states_by_name(task_runs(rerun.state_details.flow_run_id))
    assert got == {**{f"generation-shard-{k}": "Cached" for k in finished},
                   **{f"generation-shard-{k}": "Completed" for k in unfinished}, "finish-generation": "Completed",
                   "plan-generation": "Completed", "start-servers": "Completed", "stop-servers": "Completed"}
    # the server's start is a task of its own, whose log names the pid, URL and log file
    start = next(t for t in task_runs(rerun.state_details.flow_run_id) if t.name == "start-servers")
    started = [m for m in logs_of(start.id, "started: pid") if "started: pid" in m]
    assert len(started) == 1 and "http://127.0.0.1:" in started[0] and "server.attempt-2.log" in started[0]
    assert sorted(p.name for p in out.glob("server*.log")) == ["server.attempt-1.log", "server.attempt-2.log"]
    assert log1.read_bytes() == first_log and (out / "server.attempt-2.log").stat().st_size > 0
    assert_each_prompt_answered_once(cfg)


def stop_and_wait(pid: int, timeout_s: float = 30.0) -> None:
    """SIGSTOP to process group `pid`, then wait until every thread of `pid` is stopped (state T in
    /proc/PID/task/*/stat): the stop is delivered asynchronously, and on a loaded machine llama-server answered one
    more /health after os.killpg had returned (7 times in 60)."""
    os.killpg(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = [Path(t).read_text().rsplit(")", 1)[1].split()[0] for t in Path(f"/proc/{pid}/task").glob("*/stat")]
        if states and all(st == "T" for st in states):
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped {timeout_s} s after SIGSTOP: {states}"
        time.sleep(0.01)


def test_advice_fits_the_server_kind(tmp_path):
    """A server the stage started that stops answering (SIGSTOP: alive, silent) is reported with its log, not with
    'start it or set server.url'; once it has exited, entering a pool fails at once naming the exit and the log.
    An external server that does not answer gets the advice to start it or set server.url / server.urls."""
    from eagle3_core.serving.launcher import ServerExited

    async def use(urls: list[str], down_timeout_s: float, after_enter=lambda: None) -> None:
        async with ServerPool(urls, probe_interval_s=0.2, down_timeout_s=down_timeout_s) as pool:
            after_enter()
            pool.failed(urls[0], "ConnectError: refused", server_down=True)
            async with pool.server():
                pass

    log = tmp_path / "server.attempt-1.log"
    with llama_server(embedded_gguf_path(), log, parallel=1, ctx_per_slot=512, extra_args=["-t", "1"]) as url:
        from eagle3_core.serving import launcher
        proc = launcher._watched[url][0]
        try:
            with pytest.raises(ServerError, match=rf"no inference server answered for 1 s .*the stage started this "
                                                  rf"server and it passed its health check: see its log {log}; then "
                                                  rf"rerun"):
                asyncio.run(use([url], 1.0, lambda: stop_and_wait(proc.pid)))
        finally:
            os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGTERM)                  # llama-server ends cleanly on SIGTERM: code 0
        proc.wait()
        with pytest.raises(ServerExited, match=rf"(?s)pid {proc.pid}\) exited with code 0 while the stage was using "
                                               rf"it; its log {log}, last lines:\n.*cleaning up before exit"):
            asyncio.run(use([url], 1800.0))
    with pytest.raises(ServerError, match=r"cannot reach any inference server \(http://127\.0\.0\.1:9: .*\); start "
                                          r"it or set server\.url / server\.urls"):
        asyncio.run(use(["http://127.0.0.1:9"], 1.0))


SILENT_SERVER = """
import sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):                                      # /health: up
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def do_POST(self):                                     # a generation that never finishes in time
        time.sleep(600)
    def log_message(self, *a): pass
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_request_in_flight_gives_up_at_once_when_its_stage_stops_the_server(tmp_path):
    """Cancelling the generation stage stops its server (launch's block ends); the shard requests still in flight
    raise ServerStopped at once instead of retrying with backoff against a server that will not return (the
    cancelled run kept retrying for 30 s until Prefect killed it)."""
    import sys
    import time

    from eagle3_core.serving.client import request_with_retries
    from eagle3_core.serving.launcher import ServerStopped, free_port, launch
    script = tmp_path / "silent.py"
    script.write_text(SILENT_SERVER)
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    async def scenario() -> float:
        block = launch([sys.executable, str(script), str(port)], url, tmp_path / "silent.log", 30)
        block.__enter__()
        async with ServerPool([url], probe_interval_s=0.2) as pool, httpx.AsyncClient(timeout=60) as client:
            body = request_body("openai", [{"role": "user", "content": "hi"}], None, 8, 0.0)
            req = asyncio.create_task(request_with_retries(pool, client, "openai", body, max_retries=5,
                                                           backoff_s=10.0))
            await asyncio.sleep(0.5)                                 # the request is in flight
            block.__exit__(None, None, None)                         # the stage stops its server
            t0 = time.monotonic()
            with pytest.raises(ServerStopped, match=rf"{url} was stopped by this process .*gives up"):
                await asyncio.wait_for(req, 20)
            return time.monotonic() - t0
    assert asyncio.run(scenario()) < 5                               # not a 10 s backoff, not 1800 s of probing

    async def port_reused() -> bool:
        """Another server (not started by `launch`: an external one) later answers on the same port: a pool that
        begins after the stop uses it (a test session reuses ports; the stop was not this pool's)."""
        proc = subprocess.Popen([sys.executable, str(script), str(port)])
        try:
            for _ in range(100):
                try:
                    httpx.get(f"{url}/health", timeout=1)
                    break
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
            async with ServerPool([url], probe_interval_s=0.2) as pool:
                return pool.servers[url].up
        finally:
            proc.kill()
            proc.wait()
    assert asyncio.run(port_reused())


@pytest.mark.slow
def test_fault_proxy_503_stalls_and_drops_every_prompt_completes(server, tmp_path):
    """20% of generation requests fail at a proxy in front of the real server (503, a stall past the request
    timeout, a dropped connection, a body cut in half); every prompt completes and each injected fault is one
    retry in the manifest, of its kind."""
    t0 = time.monotonic()                                   # warm-up: how slow is one answer on this machine now
    httpx.post(f"{server}/completion", json={"prompt": "Hi", "n_predict": 8}, timeout=300).raise_for_status()
    timeout = max(10.0, 4 * (time.monotonic() - t0))
    with FaultProxy(server, every=5) as proxy:
        cfg = make_run(tmp_path, 16, [proxy.url], request_timeout_s=timeout, max_retries=4)
        m = run_generation(cfg, log=lambda *_: None)
    assert proxy.posts >= 20 and sum(proxy.injected.values()) == proxy.posts // 5 + (proxy.posts % 5 > 0)
    assert set(proxy.injected) == {"503", "stall", "drop", "drop_mid"}
    assert m["failed"] == 0 and m["retries"] == sum(proxy.injected.values())
    assert m["retry_kinds"] == {"http_5xx": proxy.injected["503"], "timeout": proxy.injected["stall"],
                                "connection": proxy.injected["drop"] + proxy.injected["drop_mid"]}
    assert_each_prompt_answered_once(cfg)


@pytest.mark.slow
def test_client_killed_mid_run_then_rerun_no_duplicates_no_losses(server, tmp_path, spawned):
    """The generating process is SIGKILLed with one shard finished and another partly flushed; rerunning through
    the shard contract leaves the finished shard's files untouched, keeps the flushed answers and answers every
    prompt exactly once. Synchronised on events: a proxy holds the prompts of rows 6 on (shard 1's last two), so
    shard 1 cannot finish before the kill, which comes once shard 0's record and shard 1's two flushed answers
    are on disk (polling for files raced: shard 1 could finish, and its parts be merged, before the kill)."""
    from recording_proxy import HoldingProxy
    cfg = make_run(tmp_path, 12, [server])
    rows = json.loads((cfg.run_dir / "prompts" / "manifest.json").read_text())["train_ids"]
    from eagle3_core.data.prompt_set import read_rows
    late = {json.dumps(r["messages"][-1]["content"]) for r in read_rows(cfg.run_dir / "prompts" / "train.parquet")
            if r["id"] in rows[6:]}
    out = cfg.run_dir / "generations"
    with HoldingProxy(server, hold=lambda n, body: json.dumps((body.get("messages") or [{}])[-1].get("content"))
                      in late) as proxy:
        (tmp_path / "cfg.json").write_text(cfg.model_copy(update={"server": cfg.server.model_copy(
            update={"urls": [proxy.url]})}).model_dump_json())
        code = ("import sys; from pathlib import Path; from eagle3_core.pipeline.generation_stage import "
                "run_generation; from eagle3_core.config import PipelineConfig; "
                "run_generation(PipelineConfig.model_validate_json(Path(sys.argv[1]).read_text()))")
        child = spawned(subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "cfg.json")], cwd=ROOT,
                                         env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL))
        deadline = time.monotonic() + 300
        while not ((out / "shard_00000.json").exists()
                   and len(list(out.glob("partial/shard_00001/part_*.parquet"))) == 2):
            assert time.monotonic() < deadline and child.poll() is None, "child ended before the kill"
            time.sleep(0.05)
        child.kill()
        child.wait()
    finished = {f: (f.stat().st_mtime_ns, f.read_bytes()) for f in out.glob("shard_00000.*")}
    flushed = {r["id"] for p in out.glob("partial/shard_00001/part_*.parquet") for r in pq.read_table(p).to_pylist()}
    assert not (out / "manifest.json").exists() and flushed

    shards = generation_shards(cfg)
    assert shards == [0, 1, 2]
    records = [run_generation_shard(cfg, k, urls=[server], log=lambda *_: None) for k in shards]
    assert {f: (f.stat().st_mtime_ns, f.read_bytes()) for f in out.glob("shard_00000.*")} == finished
    assert records[1]["resumed"] >= len(flushed) and records[1]["resumed"] + records[1]["generated"] == 4
    assert not (out / "partial").exists()
    m = finish_generation(cfg, records)
    assert m["samples"] == 12 and m["shards"] == ["shard_00000.parquet", "shard_00001.parquet", "shard_00002.parquet"]
    rows = assert_each_prompt_answered_once(cfg)
    assert [r["id"] for r in rows] == train_ids(cfg)                    # prompt order, shard by shard
    assert run_generation_shard(cfg, 1, urls=["http://127.0.0.1:9"]) == json.loads(
        (out / "shard_00001.json").read_text())                          # finished: returned, nothing sent
    with pytest.raises(ValueError, match="shard 5 out of range"):
        run_generation_shard(cfg, 5, urls=[server])
    with pytest.raises(ValueError, match="not the one on disk"):
        finish_generation(cfg.model_copy(update={"generation": cfg.generation.model_copy(
            update={"max_failed_frac": 0.5})}), [{**records[0], "sha256": "0" * 64}])


def test_conversation_is_sent_up_to_its_final_assistant_turn():
    """Multi-turn ShareGPT rows (the real sample file): the target regenerates the final assistant turn; rows in
    mode 'keep' pass through with it; a row with nothing to answer is an error naming it."""
    conv = next(c for c in json.loads((SHARED_DATA / "sharegpt" / "dummy_conversation.json").read_text())
                if len(c["conversations"]) >= 4 and c["conversations"][-1]["from"] == "gpt")
    roles = {"human": "user", "gpt": "assistant"}
    msgs = [{"role": roles[m["from"]], "content": m["value"]} for m in conv["conversations"]]
    sent, kept = split_final_answer(msgs, None, "row 3")
    assert sent == msgs[:-1] and kept is None and sent[-1]["role"] == "user"
    assert split_final_answer(msgs, "keep", "row 3") == (msgs[:-1], msgs[-1])
    assert split_final_answer(msgs[:-1], None, "row 3") == (msgs[:-1], None)
    with pytest.raises(ValueError, match="row 3: mode 'keep' but the conversation does not end"):
        split_final_answer(msgs[:-1], "keep", "row 3")
    with pytest.raises(ValueError, match=r"row 3: nothing to answer .*'system'"):
        split_final_answer([{"role": "system", "content": "x"}], None, "row 3")


def test_degenerate_answers_are_runaway_repetitions():
    with open(GSM8K) as f:
        answer = json.loads(f.readline())["answer"]
    assert not is_degenerate(answer) and not is_degenerate(answer * 2)
    assert is_degenerate(answer + " 72 + 72 =" * 40) and is_degenerate("\n" * 100)
    assert is_degenerate("So the answer is 72. " * 30)          # a 21-character block, 30 times
    assert not is_degenerate("ha " * 10)                         # too short to tell


def test_stage_seconds_count_shards_run_side_by_side_once():
    """finish_generation's stage time is the union of the shards' run intervals (manifest.busy_seconds), not their
    sum: four shards on one server, two at a time, ran for 368 s and were reported as 726 s."""
    from eagle3_core.contract.manifest import busy_seconds
    side_by_side = [{"seconds": 10.0, "started_at": 100.0, "ended_at": 110.0},
                    {"seconds": 7.0, "started_at": 105.0, "ended_at": 112.0},
                    {"seconds": 1.0, "started_at": 106.0, "ended_at": 107.0},     # inside the others
                    {"seconds": 5.0, "started_at": 200.0, "ended_at": 205.0}]     # a retry after a gap
    assert busy_seconds(side_by_side) == 17.0
    assert busy_seconds(side_by_side + [{"seconds": 3.0}]) == 20.0                # an old record: its own time
    assert busy_seconds([]) == 0.0


def test_vllm_completions_request_and_response_fields():
    """Fields of vLLM's /v1/completions with token ids in and out (vllm/entrypoints/openai/protocol.py:
    CompletionRequest.return_token_ids, CompletionResponseChoice.token_ids / prompt_token_ids, UsageInfo; vLLM
    >= 0.10.2), read from the source, not run; a server without token_ids is refused naming the API."""
    body = request_body("vllm", None, [1, 2, 3], 512, 0.0, top_p=0.9)
    assert body == {"prompt": [1, 2, 3], "max_tokens": 512, "temperature": 0.0, "return_token_ids": True,
                    "stream": False, "top_p": 0.9}
    # top_k and seed are sampled settings: sent only when sampling (llama.cpp keeps top_k 1 to decode greedily)
    assert request_body("llama.cpp", None, [1], 8, 0.0, top_k=20, seed=3)["top_k"] == 1
    assert "seed" not in request_body("vllm", None, [1], 8, 0.0, top_k=20, seed=3)
    hot = {api: request_body(api, [{"role": "user", "content": "q"}], [1], 8, 0.7, top_k=20, seed=3)
           for api in ("openai", "llama.cpp", "vllm", "sglang")}
    assert all(hot[a]["top_k"] == 20 and hot[a]["seed"] == 3 for a in ("openai", "llama.cpp", "vllm"))
    assert hot["sglang"]["sampling_params"] == {"max_new_tokens": 8, "temperature": 0.7, "top_k": 20}
    answer = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "t",
              "choices": [{"index": 0, "text": " Paris.", "logprobs": None, "finish_reason": "stop",
                           "stop_reason": None, "token_ids": [3681, 13, 2], "prompt_logprobs": None,
                           "prompt_token_ids": [1, 2, 3]}],
              "usage": {"prompt_tokens": 3, "total_tokens": 6, "completion_tokens": 3}}
    out = parse_response("vllm", answer, "http://h:8000")
    assert (out["output_ids"], out["finish_reason"], out["prompt_tokens"], out["completion_tokens"]) == \
        ([3681, 13, 2], "stop", 3, 3)
    old = {**answer, "choices": [{**answer["choices"][0], "token_ids": None}]}
    with pytest.raises(RequestRejected, match=r"h:8000/v1/completions.*'vllm' API"):
        parse_response("vllm", old, "http://h:8000")


@pytest.mark.slow
def test_a_lower_num_train_inside_the_first_shard_sends_nothing_and_loses_no_answer(server, tmp_path):
    """10 GSM8K prompts answered in shards of 4 (4 + 4 + 2) by llama-server. A night asking for 3 ends inside
    shard 0: it is rewritten for its first 3 rows from its own answers (no request sent) and a copy of it kept in
    generations/held/, saying so; asking for 10 again plans shards (0, 3), (3, 7), (7, 10) and answers all of them
    from the shards' and the held files (no request sent), each prompt's answer the one generated first."""
    from recording_proxy import RecordingProxy
    with RecordingProxy(server) as proxy:
        cfg = make_run(tmp_path / "run", 10, [proxy.url])
        for k in generation_shards(cfg, log=lambda *_: None):
            run_generation_shard(cfg, k, log=lambda *_: None, urls=[proxy.url])
        first = {r["id"]: r["response"] for r in all_rows(cfg)}
        sent = len(proxy.posts)
        assert len(first) == 10 and sent >= 10
        cfg.prompts.num_train, lines = 3, []
        run_prompts(cfg, log=lambda *_: None)
        assert generation_shards(cfg, log=lines.append) == [0]
        assert any("ends inside shard 0" in line and "generations/held/" in line for line in lines), lines
        run_generation_shard(cfg, 0, log=lambda *_: None, urls=[proxy.url])
        out = cfg.run_dir / "generations"
        assert pq.read_table(out / "shard_00000.parquet")["id"].to_pylist() == train_ids(cfg)
        (held,) = (out / "held").glob("*.parquet")
        assert pq.read_table(held)["id"].to_pylist() == list(first)[:4]
        cfg.prompts.num_train = 10
        run_prompts(cfg, log=lambda *_: None)
        assert [p[:2] for p in generation_plan(cfg)] == [(0, 3), (3, 7), (7, 10)]
        for k in generation_shards(cfg, log=lambda *_: None):
            assert run_generation_shard(cfg, k, log=lambda *_: None, urls=[proxy.url])["complete"]
        assert len(proxy.posts) == sent                                      # nothing sent again
    rows = assert_each_prompt_answered_once(cfg)
    assert {r["id"]: r["response"] for r in rows} == first


def test_a_server_whose_port_another_process_took_starts_on_another_port(tmp_path, monkeypatch):
    """free_port hands out a port that another process binds before llama-server does (two runs starting servers
    at once): llama-server fails to bind and exits while the other process answers /health. The launcher sees
    that the listener is not in the server's process group and starts it again on another port; a port the user
    gave is refused with PortTaken naming the log instead."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from eagle3_core.serving import launcher
    from eagle3_core.serving.launcher import PortTaken, llama_server

    class Healthy(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    other = ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    taken = other.server_address[1]
    threading.Thread(target=other.serve_forever, daemon=True).start()
    ports, real = [], launcher.free_port
    monkeypatch.setattr(launcher, "free_port", lambda host="127.0.0.1": ports.append(
        taken if not ports else real(host)) or ports[-1])
    try:
        with llama_server(embedded_gguf_path(), tmp_path / "a.log", parallel=1, ctx_per_slot=256,
                          extra_args=["-t", "1"]) as url:
            assert ports[0] == taken and url == f"http://127.0.0.1:{ports[1]}" and len(ports) == 2
            assert httpx.get(f"{url}/props", timeout=10).status_code == 200         # llama-server itself
        with pytest.raises(PortTaken, match=rf"127\.0\.0\.1:{taken}: another process listens on the port, not the "
                                            rf"server started for it"):
            with llama_server(embedded_gguf_path(), tmp_path / "b.log", port=taken, parallel=1, ctx_per_slot=256,
                              extra_args=["-t", "1"]):
                pass
    finally:
        other.shutdown()
        other.server_close()
