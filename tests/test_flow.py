"""The end-to-end Prefect flow on a handful of prompts under prefect_test_harness, with the real llama.cpp server;
and bad input failing the flow run with a message that names the file or URL, nothing earlier lost."""
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client

from eagle3_core.config import ServerConfig, preset
from eagle3_core.contract.layout import STAGE_DIRS
from eagle3_core.training.checkpoint import load_draft
from prefect_api import flow_run_log
from tasks.artifacts import run_key

ROOT = Path(__file__).resolve().parents[1]


def test_pipeline_runs_end_to_end(e2e_run):
    cfg, summary = e2e_run
    run = cfg.run_dir
    prompts = json.loads((run / "prompts" / "manifest.json").read_text())
    assert len(prompts["train_ids"]) == 6 and len(prompts["eval_ids"]) == 2
    assert not set(prompts["train_ids"]) & set(prompts["eval_ids"])
    gen = json.loads((run / "generations" / "manifest.json").read_text())
    assert gen["samples"] == 6 and gen["sampling"]["greedy"] and "llama.cpp" in gen["server"]
    assert summary["aux_layer_ids"] == [1, 14, 26]
    ev = summary["eval"]
    for name in ("trained", "trained_tree", "untrained"):
        d = ev[name]
        assert d["target_forward_calls"] == 2 + d["verify_steps"]
        assert 1.0 <= d["tau"] <= 1 + cfg.eval.num_draft_steps
        assert d["lossless"]["mismatch"] == 0
    assert ev["trained_tree"]["params"] == {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}
    assert ev["preflight"] == "passed" and ev["consistency"]["steps_compared"] == 3
    for rel in summary["plots"].values():
        assert (run / rel).read_bytes()[:4] == b"\x89PNG"
    draft = load_draft(summary["draft_dir"])
    assert draft.shape.draft_vocab_size == 1024
    md = (run / "report.md").read_text()
    assert "Acceptance length" in md and summary["draft_dir"] in md and "Deployed on llama.cpp" in md
    assert "![tau](plots/tau.png)" in md
    lc = summary["llama_cpp"]
    assert lc["tokens"] > 0 and lc["baseline_tokens_per_s"] > 0 and lc["tokens_per_s"] > 0


def test_flow_runs_and_report_artifact_are_in_prefect(e2e_run):
    """The end-to-end run and its seven stage subflows are recorded by the Prefect server, completed, with the
    report artifact."""
    cfg, _ = e2e_run

    async def query():
        async with get_client() as client:
            return (await client.read_flow_runs(), await client.read_artifacts(),
                    (await client.read_flow_by_name("eagle3-pipeline")).id)
    runs, arts, pipeline_id = asyncio.run(query())
    same_dir = [r for r in runs if str((r.parameters.get("config") or {}).get("run_dir")) == str(cfg.run_dir)]
    # the fixture's run came first (later tests may rerun this config): its pipeline run and the subflows after it
    first = min((r for r in same_dir if r.flow_id == pipeline_id), key=lambda r: r.created)
    subflows = sorted((r for r in same_dir if r.created > first.created), key=lambda r: r.created)[:7]
    ours = [first, *subflows]
    assert len(ours) == 8 and all(r.parent_task_run_id for r in subflows), [r.name for r in ours]
    assert all(r.state.is_completed() for r in ours), [(r.name, r.state.name) for r in ours]
    assert {run_key(cfg.run_dir, "eagle3-report"), run_key(cfg.run_dir, "eagle3-plots")} <= {a.key for a in arts}


def test_the_pipeline_run_names_its_subflows_tags_them_and_logs_every_stage_summary(e2e_run):
    """What a user sees on the Runs page and the pipeline run's log (read back through the API): '<run>-<stage>'
    names instead of random ones, run:/stage: tags on every subflow, and one summary line per stage in the parent
    run's own log (not only in the subflows')."""
    from prefect_api import flow_run_log, flow_run_tree
    cfg, _ = e2e_run
    label = cfg.run_dir.name

    async def query():
        async with get_client() as client:
            pipeline_id = (await client.read_flow_by_name("eagle3-pipeline")).id
            return [r for r in await client.read_flow_runs() if r.flow_id == pipeline_id]
    same_dir = [r for r in asyncio.run(query())
                if str((r.parameters.get("config") or {}).get("run_dir")) == str(cfg.run_dir)]
    first = min(same_dir, key=lambda r: r.created)
    assert first.name == f"{label}-pipeline" and {f"run:{label}", "stage:pipeline"} <= set(first.tags)
    subflows = [r for r in flow_run_tree(first.id) if r.id != first.id]
    stages = ["prompts", "generation", "features", "vocab", "train", "evaluate", "deploy-llama-cpp", "deploy-sglang"]
    assert sorted(r.name for r in subflows) == sorted(f"{label}-{s}" for s in stages)
    for r in subflows:
        stage = r.name.removeprefix(f"{label}-")
        assert {f"run:{label}", f"stage:{stage}"} <= set(r.tags), (r.name, r.tags)
    log = flow_run_log(first.id, "deploy-sglang: done")
    for stage in stages:
        assert any(m.startswith(f"{stage}: done") for m in log), (stage, log)
    features = next(m for m in log if m.startswith("features: done"))
    assert f"samples {json.loads((cfg.run_dir / 'features' / 'manifest.json').read_text())['samples']}" in features
    assert "tau trained" in next(m for m in log if m.startswith("evaluate: done"))
    train = json.loads((cfg.run_dir / "draft" / "manifest.json").read_text())
    assert f"best epoch {train['best']['epoch']}" in next(m for m in log if m.startswith("train: done"))
    assert f"train_samples {train['train_samples']}" in next(m for m in log if m.startswith("train: done"))
    assert "speedup" in next(m for m in log if m.startswith("deploy-llama-cpp: done"))
    # the running stages' shard lines reach the pipeline run's log too, each before its stage's summary
    for stage in ("generation", "features"):
        n = len(json.loads((cfg.run_dir / STAGE_DIRS[stage] / "manifest.json").read_text())["shards"])
        done = next(i for i, m in enumerate(log) if m.startswith(f"{stage}: {n} of {n} shards done"))
        assert done < next(i for i, m in enumerate(log) if m.startswith(f"{stage}: done")), log


def test_missing_prompt_file_fails_the_run_at_the_check_naming_it_first_without_a_traceback(prefect_server,
                                                                                             tmp_path):
    from eagle3_core.check import CheckError
    from flows.pipeline import eagle3_pipeline
    cfg = preset("debug_tiny", tmp_path / "run")
    cfg.prompts.sources = [str(tmp_path / "missing.jsonl")]
    state = eagle3_pipeline(cfg, return_state=True)
    with pytest.raises(CheckError, match=r"prompts source 0 .*missing\.jsonl does not exist: give an existing"):
        state.result()
    assert not (cfg.run_dir / "prompts").exists()                   # refused before any stage ran
    log = flow_run_log(state.state_details.flow_run_id, "missing.jsonl", with_tasks=True)
    first = next(i for i, m in enumerate(log) if "missing.jsonl" in m)
    assert first <= 2 and "check refused the run:\n- prompts source 0" in log[first], log[:5]   # cause, then fix
    assert not any("Traceback" in m or "NoneType: None" in m for m in log), log


def test_malformed_prompt_file_fails_the_run_naming_file_and_line(prefect_server, tmp_path):
    from flows.pipeline import eagle3_pipeline
    bad = tmp_path / "prompts.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + '{"prompt": "unterminated\n')
    cfg = preset("debug_tiny", tmp_path / "run")
    cfg.prompts.sources = [str(bad)]
    with pytest.raises(ValueError, match=r"prompts.jsonl: line 2 is not valid JSON.*fix or remove it"):
        eagle3_pipeline(cfg)


@pytest.mark.slow
def test_unreachable_server_fails_the_run_keeping_earlier_stages(prefect_server, tmp_path):
    from eagle3_core.serving.launcher import ServerError
    from flows.pipeline import eagle3_pipeline
    cfg = preset("debug_tiny", tmp_path / "run")
    cfg.server = ServerConfig(kind="external", url="http://127.0.0.1:9")
    with pytest.raises(ServerError, match=r"http://127\.0\.0\.1:9.*server\.url"):
        eagle3_pipeline(cfg)
    assert (cfg.run_dir / "prompts" / "manifest.json").exists()          # the prompts stage is kept
    assert (cfg.run_dir / "prompts" / "train.parquet").exists()


@pytest.mark.slow
def test_a_run_directory_copied_elsewhere_evaluates_its_own_draft(e2e_run, tmp_path):
    """The finished run copied to another directory (as from a GPU node to a CPU box), the original moved out of
    reach: its train stage is done there (export_dir stored relative to the run directory) and its evaluate stage,
    run again, pre-flights and measures the copy's own export; a manifest that stored the old absolute path (as
    main did) resolves to the copy too."""
    from eagle3_core.contract.layout import RunLayout
    from eagle3_core.pipeline.evaluate_stage import run_evaluate
    from eagle3_core.pipeline.table import invalidate_stage, stage_done
    cfg, _ = e2e_run
    copy = cfg.model_copy(update={"run_dir": tmp_path / "moved" / "debug_tiny"})
    shutil.copytree(cfg.run_dir, copy.run_dir)
    train = json.loads((copy.run_dir / "draft" / "manifest.json").read_text())
    assert train["export_dir"] == "draft/export" and stage_done(copy, "train")
    train["export_dir"] = str(cfg.run_dir / "draft" / "export")          # as main stored it: absolute
    (copy.run_dir / "draft" / "manifest.json").write_text(json.dumps(train))
    away = cfg.run_dir.with_name("away")
    cfg.run_dir.rename(away)
    try:
        assert RunLayout(copy.run_dir).stored(train["export_dir"]) == copy.run_dir / "draft" / "export"
        invalidate_stage(copy, "evaluate")
        m = run_evaluate(copy, log=lambda *_: None)
    finally:
        away.rename(cfg.run_dir)
    assert m["summary"]["preflight"] == "passed" and 1.0 <= m["summary"]["trained"]["tau"] <= 4


@pytest.mark.slow
def test_a_terminated_pipeline_leaves_no_temporary_prefect_server_running(tmp_path):
    """`python -m flows.pipeline` (what `make demo` runs) stopped by SIGTERM mid-run: the run is Crashed and the
    temporary Prefect server it started (a uvicorn child in its process group) is gone too, not left holding a port
    (flows.sigterm.exit_on_sigterm)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | {
        "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300"}    # its own temporary server, not the harness
    (tmp_path / "prefect").mkdir()
    log = tmp_path / "log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "flows.pipeline", "--preset", "debug_tiny", "--run-dir",
                                 str(tmp_path / "run")], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while "Beginning subflow run" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(1)
        assert "Beginning subflow run" in log.read_text(), log.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM, log.read_text()[-3000:]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)            # anything left of its process group (the uvicorn server)?
            except ProcessLookupError:
                break
            time.sleep(1)
        else:
            raise AssertionError(f"processes of the terminated run are still running: {log.read_text()[-2000:]}")
        assert "Stopping temporary server" in log.read_text() and "Crashed" in log.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
