"""Prefect orchestration on the session's end-to-end run (debug_tiny, real llama.cpp server, real Prefect server):
cache keys (an equal rerun recomputes nothing; a changed parameter recomputes exactly the stages downstream of it),
retries only for transient errors, logs and artifacts readable through the API, refresh."""
import base64
import json
import logging
import shutil

import pytest
from prefect import flow, task
from prefect.context import FlowRunContext

from eagle3_core.contract.layout import STAGE_DIRS
from eagle3_core.pipeline.report import embed_images
from eagle3_core.pipeline.table import stage_done
from fault_site.fault_injection import InjectedFault
from prefect_api import artifacts_of, logs_of, states_by_name, task_runs
from tasks.artifacts import readable_shard_row, run_key
from tasks.logs import run_log
from tasks.retry import RETRY_OPTIONS, is_transient, retry_if_transient

STAGE_TASKS = {"prompts", "generation-shard-0", "generation-shard-1", "finish-generation", "tokenize",
               "features-shard-0", "features-shard-1", "finish-features", "vocab", "train", "evaluate",
               "deploy-llama-cpp", "deploy-sglang"}
# tasks/control.py's tasks that read the run's state each time (never cached; metadata only): the config check and
# the shard plans
CONTROL_TASKS = {"check", "plan-stages", "plan-generation", "plan-features"}


def _manifests(run_dir):
    return {d: (run_dir / d / "manifest.json").read_text() for d in STAGE_DIRS.values()}


@pytest.mark.slow
def test_equal_rerun_recomputes_nothing_and_a_changed_parameter_exactly_the_stages_downstream(e2e_run):
    from flows.pipeline import eagle3_pipeline
    cfg, summary = e2e_run
    before = _manifests(cfg.run_dir)
    state = eagle3_pipeline(cfg, return_state=True)          # a new flow run id, equal parameters
    assert state.is_completed()
    got = states_by_name(task_runs(state.state_details.flow_run_id))
    assert set(got) == STAGE_TASKS | CONTROL_TASKS | {"report"}
    # the report task computes nothing (it re-reads the manifests) and is never cached: every flow run gets its
    # own report artifacts; no server was started (start-servers did not run: every generation shard was done)
    assert {n: s for n, s in got.items() if n in STAGE_TASKS} == {n: "Cached" for n in STAGE_TASKS}
    assert {n: s for n, s in got.items() if n in CONTROL_TASKS} == {n: "Completed" for n in CONTROL_TASKS}
    assert _manifests(cfg.run_dir) == before                  # nothing on disk was rewritten

    changed = cfg.model_copy(deep=True)
    changed.eval.max_new_tokens = 8                          # read by evaluate and deploy-llama-cpp only
    state = eagle3_pipeline(changed, return_state=True)
    assert state.is_completed()
    got = states_by_name(task_runs(state.state_details.flow_run_id))
    recomputed = {n for n, s in got.items() if s != "Cached"} - {"report"} - CONTROL_TASKS
    assert recomputed == {"evaluate", "deploy-llama-cpp"}, got
    after = _manifests(cfg.run_dir)
    assert {d for d in after if after[d] != before[d]} == {"eval", "deploy_llama_cpp"}
    assert json.loads(after["eval"])["summary"]["max_new_tokens"] == 8
    # what the rest of the session reads: put the original evaluation back (recomputed, then cached again)
    assert eagle3_pipeline(cfg, return_state=True).is_completed()


@pytest.mark.slow
def test_task_logs_and_artifacts_read_back_through_the_api(e2e_run):
    from flows.pipeline import eagle3_pipeline
    cfg, _ = e2e_run
    state = eagle3_pipeline(cfg, return_state=True)
    runs = {t.name: t for t in task_runs(state.state_details.flow_run_id)}
    # the report task's log line and its four artifacts
    report = runs["report"]
    assert any(f"report written to {cfg.run_dir / 'report.md'}" in m
               for m in logs_of(report.id, "report written to"))
    # keys name the run directory: another run's report never replaces this one's
    arts = {a.key: a for a in artifacts_of(report.id)}
    keys = {name: run_key(cfg.run_dir, name) for name in ("eagle3-report", "eagle3-acceptance", "eagle3-stage-times",
                                                          "eagle3-acceptance-plot", "eagle3-plots")}
    assert set(keys.values()) <= set(arts)
    assert keys["eagle3-report"].startswith("eagle3-report-debug-tiny-")
    # the report artifact is report.md with its three plots embedded (the UI cannot read the run directory)
    md = (cfg.run_dir / "report.md").read_text()
    shown = arts[keys["eagle3-report"]].data
    assert shown == embed_images(md, cfg.run_dir) and "](plots/" in md and "](plots/" not in shown
    assert shown.count("](data:image/png;base64,") == 3 == md.count("](plots/")
    # every run under its own name, rounded to 3 decimals
    table = json.loads(arts[keys["eagle3-acceptance"]].data)
    ev = json.loads((cfg.run_dir / "eval" / "manifest.json").read_text())["summary"]
    assert [r["draft"] for r in table] == ["trained, chain", "trained, tree", "untrained, chain",
                                           "trained, llama.cpp"]
    for row, key in zip(table, ("trained", "trained_tree", "untrained")):
        assert row["tau"] == round(ev[key]["tau"], 3)
        assert [row["tau_ci95_low"], row["tau_ci95_high"]] == [round(x, 3) for x in ev[key]["tau_ci95"]]
    png = base64.b64decode(arts[keys["eagle3-acceptance-plot"]].data.split(",", 1)[1])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png == (cfg.run_dir / "report_acceptance.png").read_bytes()


def test_shard_progress_and_shard_tables_are_artifacts(e2e_run):
    """The session's first (computing) run published a progress bar and a table for its feature shards."""
    import asyncio

    from prefect.client.orchestration import get_client
    cfg, _ = e2e_run

    async def query():
        async with get_client() as client:
            return await client.read_artifacts()
    arts = asyncio.run(query())
    progress = [a for a in arts if a.key == run_key(cfg.run_dir, "features-progress")]
    assert progress and all(a.type == "progress" for a in progress)
    assert any(a.data == 100.0 for a in progress)
    shards = [json.loads(a.data) for a in arts if a.key == run_key(cfg.run_dir, "features-shards")]
    assert any(sum(r["samples"] for r in t) == 6 for t in shards)
    # training and evaluation publish progress too, at 100% once done
    for stage, what in (("train", f"{cfg.train.epochs} of {cfg.train.epochs} epochs"),
                        ("evaluate", "prompt decodes")):
        bars = [a for a in arts if a.key == run_key(cfg.run_dir, f"{stage}-progress")]
        assert bars and any(a.data == 100.0 and what in a.description for a in bars), [
            (a.data, a.description) for a in bars]


def test_the_pipeline_run_shows_the_running_stages_progress(prefect_server, tmp_path):
    """A stage's progress bar, while it moves, is mirrored into the pipeline run's own progress artifact
    ('stage k of N: <the stage's line>'), which the pipeline's flow run owns (its page in the UI)."""
    from tasks.artifacts import Progress, pipeline_progress, stage_started
    seen = {}

    def latest():
        return next(a for a in _latest_artifacts() if a.key == run_key(tmp_path, "pipeline-progress"))

    @task
    def stage_task():
        Progress(tmp_path, "features", 4, "shards finished").update(2)
        seen["mid"] = latest()

    @flow
    def pipeline():
        with pipeline_progress(tmp_path, ["prompts", "generation", "features", "train"]):
            stage_started(tmp_path, "features")
            stage_task()
        return FlowRunContext.get().flow_run.id

    run_id = pipeline()
    mid = seen["mid"]
    assert mid.description.startswith("stage 3 of 4: features: 2 of 4 shards finished") and mid.data == 62.5
    assert mid.flow_run_id == run_id                                 # on the pipeline run's page, not the task's
    assert latest().data == 100.0


def _latest_artifacts():
    import asyncio

    from prefect.client.orchestration import get_client

    async def go():
        async with get_client() as client:
            return await client.read_latest_artifacts()
    return asyncio.run(go())


def test_shard_tables_show_rounded_readable_columns_without_hashes():
    record = {"shard": 3, "file": "shard_00003.parquet", "prompts": 4, "completion_tokens": 256, "complete": True,
              "seconds": 12.09653735899974, "bytes": 19883, "started_at": 1796454555.5865245,
              "ended_at": 1796454890.8155148, "mtime_ns": 1796454890804715546, "sha256": "50" * 32,
              "rows_sha256": "3d" * 32, "inputs_key": "10" * 32, "bytes_per_token": 32777.123456,
              "finish_reasons": {"length": 4}, "failures": []}
    row = readable_shard_row(record)
    assert row == {"shard": 3, "file": "shard_00003.parquet", "prompts": 4, "completion_tokens": 256,
                   "seconds": 12.1, "MB": 0.02, "started (UTC)": "07:09:15", "bytes_per_token": 32780.0}
    assert next(iter(row)) == "shard"


def test_transformers_and_httpx_warnings_reach_the_run_log(prefect_server):
    @task
    def noisy() -> str:
        with run_log():
            # the libraries' own loggers, as their code logs to them
            logging.getLogger("transformers.modeling_utils").warning("transformers warning for the run log")
            logging.getLogger("httpx").info("HTTP Request: POST http://x 200 OK")   # INFO: stays out
            logging.getLogger("httpx").warning("httpx warning for the run log")
        return "ok"

    @flow
    def f():
        return noisy(return_state=True)

    state = f()
    msgs = logs_of(state.state_details.task_run_id, "httpx warning")
    assert "transformers warning for the run log" in msgs and "httpx warning for the run log" in msgs
    assert not any("HTTP Request" in m for m in msgs)


def test_a_stage_failure_logs_its_traceback_once_and_its_cause_once_per_run_page(prefect_server):
    from prefect_api import flow_run_log, flow_run_tree

    @task
    def broken_shard() -> None:
        raise ValueError("shard 3 of features: the cause")

    @flow
    def stage():
        broken_shard()

    @flow
    def pipeline():
        stage()

    state = pipeline(return_state=True)
    assert state.is_failed()
    runs = flow_run_tree(state.state_details.flow_run_id)
    pages = {r.id: flow_run_log(r.id, "the cause", with_tasks=True) for r in runs}   # each run's page in the UI
    log = [m for msgs in pages.values() for m in msgs]
    assert sum("Traceback" in m for m in log) == 1, log                         # the task run's, once
    for msgs in pages.values():                       # each page names the cause once
        assert sum("the cause" in m for m in msgs) == 1, msgs
    # the stage's page: the task's record in full, the stage flow's own record of it one line referring to it
    assert any("Encountered exception during execution: ValueError (cause and fix above)" in m for m in log), log


def test_only_transient_errors_are_retried(prefect_server):
    import httpx
    calls = {"transient": 0, "fatal": 0}
    req = httpx.Request("GET", "http://127.0.0.1:9")

    @task(retry_condition_fn=retry_if_transient, **RETRY_OPTIONS)
    def flaky(kind: str) -> int:
        calls[kind] += 1
        if kind == "transient" and calls[kind] < 3:
            raise httpx.ConnectError("connection refused", request=req)
        if kind == "fatal":
            raise InjectedFault("not transient")
        return calls[kind]

    @flow
    def f(kind: str):
        return flaky(kind, return_state=True)

    assert f("transient").result() == 3                       # two retries absorbed the dropped connections
    assert f("fatal", return_state=True).is_failed() and calls["fatal"] == 1      # no retry
    assert is_transient(RuntimeError("wrapped")) is False
    err = httpx.HTTPStatusError("x", request=req, response=httpx.Response(503, request=req))
    assert is_transient(err) and not is_transient(httpx.HTTPStatusError(
        "x", request=req, response=httpx.Response(400, request=req)))
    try:
        try:
            raise httpx.ReadTimeout("slow", request=req)
        except httpx.ReadTimeout as e:
            raise RuntimeError("request failed after 3 retries") from e
    except RuntimeError as wrapped:
        assert is_transient(wrapped)                          # the cause decides


@pytest.mark.slow
def test_refresh_recomputes_the_stage(e2e_run, tmp_path):
    from flows.stage_flows import prompts_flow
    cfg, _ = e2e_run
    copy = cfg.model_copy(deep=True)
    copy.run_dir = tmp_path / "run"
    shutil.copytree(cfg.run_dir / "prompts", copy.run_dir / "prompts")
    first = prompts_flow(copy, return_state=True)
    assert states_by_name(task_runs(first.state_details.flow_run_id)) == {"prompts": "Completed"}
    assert states_by_name(task_runs(prompts_flow(copy, return_state=True).state_details.flow_run_id)) == {
        "prompts": "Cached"}
    old = json.loads((copy.run_dir / "prompts" / "manifest.json").read_text())
    state = prompts_flow(copy, refresh=True, return_state=True)
    assert states_by_name(task_runs(state.state_details.flow_run_id)) == {"forget": "Completed",
                                                                          "prompts": "Completed"}
    new = json.loads((copy.run_dir / "prompts" / "manifest.json").read_text())
    assert new["seconds"] != old["seconds"] and new["train_ids"] == old["train_ids"]


@pytest.mark.parametrize("stage", sorted(STAGE_DIRS))
def test_every_stage_has_an_inputs_key_once_the_run_is_done(e2e_run, stage):
    cfg, _ = e2e_run
    assert stage_done(cfg, stage)


@pytest.mark.slow
def test_what_does_not_change_results_keeps_stages_done_and_aux_ids_redo_features_and_after(e2e_run, tmp_path):
    """On a copy of the session's run (mtimes kept, so no shard is hashed): changing how features are computed
    (writer threads, batch tokens) leaves every stage done and nothing is rewritten; a deleted feature shard is
    extracted again alone; other aux layer ids redo features and the stages after it, nothing before."""
    from flows.pipeline import eagle3_pipeline
    cfg, _ = e2e_run
    copy = cfg.model_copy(deep=True)
    copy.run_dir = tmp_path / "run"
    shutil.copytree(cfg.run_dir, copy.run_dir)
    before = _manifests(copy.run_dir)
    copy.features.writer_threads = cfg.features.writer_threads + 2
    copy.features.batch_tokens = cfg.features.batch_tokens * 2
    assert all(stage_done(copy, s) for s in STAGE_DIRS)
    assert eagle3_pipeline(copy, return_state=True).is_completed()
    assert _manifests(copy.run_dir) == before

    features = copy.run_dir / "features"
    victim = features / "shard_00001.safetensors"
    kept = {p.name: p.stat().st_mtime_ns for p in features.glob("shard_*.safetensors") if p != victim}
    victim.unlink()
    assert eagle3_pipeline(copy, return_state=True).is_completed()
    after = _manifests(copy.run_dir)
    assert {d for d in after if after[d] != before[d]} == {"features"}
    assert json.loads(after["features"])["shards_extracted"] == 1
    assert {n: (features / n).stat().st_mtime_ns for n in kept} == kept

    copy.features.aux_layer_ids = [2, 14, 26]
    assert eagle3_pipeline(copy, return_state=True).is_completed()
    final = _manifests(copy.run_dir)
    assert {d for d in final if final[d] != after[d]} == {"features", "draft", "eval", "deploy_llama_cpp",
                                                           "deploy_sglang"}
    assert json.loads(final["features"])["aux_layer_ids"] == [2, 14, 26]
