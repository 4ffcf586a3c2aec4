"""A stage added by a test touches only its module (this file: its key, body and row, registered in the stage table)
and a flow: the table's done decision and key upstreams, the task built from its row (tasks.stage_tasks.body_task)
with its cache policy, the summary line, the plan of the run and the report's stage times all read the row."""
from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from prefect import flow

from conftest import SHARED_DATA
from eagle3_core.config import preset
from eagle3_core.contract.layout import RunLayout
from eagle3_core.contract.manifest import read_manifest
from eagle3_core.pipeline import report_numbers, run, table
from eagle3_core.pipeline.keys import UPSTREAM, stage_key, upstream_manifest
from eagle3_core.pipeline.prompts_stage import run_prompts
from eagle3_core.pipeline.stage import Stage


# the toy stage's module: its key, its body and its row
def toy_key(cfg, up: dict) -> str:
    """The toy stage's inputs key: the prompts stage's key and the one setting it reads."""
    return stage_key(up["prompts"], {"num_eval": cfg.prompts.num_eval})


def run_toy(cfg, log=print) -> dict:
    """Count the train prompts into toy/count.txt."""
    out = Path(cfg.run_dir) / TOY.directory

    def body() -> dict:
        out.mkdir(parents=True, exist_ok=True)
        n = pq.read_metadata(RunLayout(cfg.run_dir).prompts_train).num_rows
        (out / "count.txt").write_text(str(n))
        log(f"toy: counted {n} train prompts")
        return {"train_prompts": n, "seconds": 1.5}
    return run.run(run.decision(cfg, TOY), body, log=log)


TOY = Stage("toy", toy_key, run_toy, upstream=("prompts",), directory="toy", outputs=("count.txt",),
            summary=("train_prompts",), timeout_h=0.5, in_report=False)


@pytest.fixture
def toy():
    """The toy stage registered in the stage table for the test, then taken out; the task built from its row and
    its flow."""
    from flows.stage_flows import one_task_stage
    from tasks.stage_tasks import body_task
    table.register(TOY)
    toy_task = body_task(TOY)

    @flow(name="toy", flow_run_name="toy-run")
    def toy_flow(config, refresh: bool = False) -> dict:
        return one_task_stage(config, "toy", refresh, toy_task)
    yield toy_flow
    table.unregister("toy")
    assert "toy" not in table.STAGES and "toy" not in UPSTREAM


def test_a_toy_stage_runs_through_the_table_a_task_and_the_report(prefect_server, tmp_path, toy):
    from prefect_api import flow_run_log, states_by_name, task_runs
    cfg = preset("debug_tiny", run_dir=tmp_path / "run")
    cfg.prompts.sources = [str(SHARED_DATA / "gsm8k" / "train.jsonl")]
    run_prompts(cfg, log=lambda *_: None)
    assert list(table.STAGES)[-1] == "toy" and UPSTREAM["toy"] == ("prompts",)
    assert not table.stage_done(cfg, "toy")

    before = run.CALLS["decide"]
    state = toy(cfg, return_state=True)
    manifest = state.result()
    assert run.CALLS["decide"] - before == 1                     # one done decision for the flow, task and body
    assert manifest["train_prompts"] == 6 and (cfg.run_dir / "toy" / "count.txt").read_text() == "6"
    up = {"prompts": upstream_manifest(cfg.run_dir, "prompts")["inputs_key"]}
    assert manifest["inputs_key"] == toy_key(cfg, up) == table.inputs_key(cfg, "toy")
    assert list(manifest["files"]) == ["count.txt"] and table.stage_done(cfg, "toy")
    flow_id = state.state_details.flow_run_id
    assert states_by_name(task_runs(flow_id)) == {"toy": "Completed"}
    assert "toy: done in 1.5 s (train_prompts 6)" in flow_run_log(flow_id, "toy: done")

    again = toy(cfg, return_state=True)                          # done: Prefect's cache answers, the body never runs
    assert again.result() == read_manifest(cfg.run_dir / "toy" / "manifest.json") == manifest
    assert states_by_name(task_runs(again.state_details.flow_run_id)) == {"toy": "Cached"}

    (cfg.run_dir / "toy" / "count.txt").write_text("7")          # an output changed: the stage runs again
    third = toy(cfg, return_state=True)
    assert states_by_name(task_runs(third.state_details.flow_run_id)) == {"toy": "Completed"}
    assert (cfg.run_dir / "toy" / "count.txt").read_text() == "6"

    cfg.prompts.num_eval += 1                                    # its key names the prompts stage's and its setting
    assert table.inputs_key(cfg, "toy") != manifest["inputs_key"] and not table.stage_done(cfg, "toy")

    manifests = {d: read_manifest(cfg.run_dir / d / "manifest.json") for d in ("prompts", "toy")}
    assert report_numbers.stage_times(cfg.run_dir, manifests, None)["toy"] == 1.5


def test_a_row_names_its_directory_and_its_upstream_stages_first():
    with pytest.raises(ValueError, match="give its directory"):
        Stage("toy", toy_key)
    with pytest.raises(ValueError, match=r"upstream stages \['nowhere'\]"):
        table.register(Stage("toy", toy_key, upstream=("nowhere",), directory="toy"))
    with pytest.raises(ValueError, match="the train stage's"):
        table.register(Stage("toy", toy_key, directory="draft"))
    assert "toy" not in table.STAGES
