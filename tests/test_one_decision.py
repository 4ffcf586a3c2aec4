"""One done decision and one key computation per task (pipeline/run.py): the flow decides before the task, the
task's cache policy and the stage body take that decision over; a stage body called alone decides on its own."""
from __future__ import annotations

import dataclasses

import pytest

from conftest import SHARED_DATA
from eagle3_core.config import preset
from eagle3_core.pipeline import features_stage, generation_stage, prompts_stage, run, table


@pytest.fixture
def counted(monkeypatch):
    """The prompts stage's key function, counting its calls (the row in the table and the one its module's body
    reads, prompts_stage.ROW)."""
    calls = []
    original = prompts_stage.prompts_key

    def key(cfg, up=None):
        calls.append(cfg.run_dir)
        return original(cfg, up)
    row = dataclasses.replace(table.STAGES["prompts"], key=key)
    monkeypatch.setitem(table.STAGES, "prompts", row)
    monkeypatch.setattr(prompts_stage, "ROW", row)
    monkeypatch.setattr(prompts_stage, "prompts_key", key)
    return calls


def _cfg(tmp_path):
    cfg = preset("debug_tiny", run_dir=tmp_path / "run")
    cfg.prompts.sources = [str(SHARED_DATA / "gsm8k" / "train.jsonl")]
    return cfg


def test_a_task_decides_once_and_computes_its_key_once(prefect_server, tmp_path, counted):
    from flows.stage_flows import prompts_flow
    cfg = _cfg(tmp_path)
    for attempt in ("runs", "done"):
        before = run.CALLS["decide"]
        counted.clear()
        manifest = prompts_flow(cfg)
        assert run.CALLS["decide"] - before == 1 and len(counted) == 1, (attempt, run.CALLS, counted)
        assert len(manifest["train_ids"]) == 6
    assert not run._pending and not run._adopted                  # nothing kept past the task


def test_a_stage_body_called_alone_decides_on_its_own(tmp_path, counted):
    cfg = _cfg(tmp_path)
    first = prompts_stage.run_prompts(cfg, log=lambda *_: None)
    before = run.CALLS["decide"]
    assert prompts_stage.run_prompts(cfg, log=lambda *_: None) == first and run.CALLS["decide"] - before == 1
    assert len(counted) == 2
    (cfg.run_dir / "prompts" / "train.parquet").unlink()          # an output gone: not done, whoever asks
    assert not table.stage_done(cfg, "prompts")
    lines = []
    prompts_stage.run_prompts(cfg, log=lines.append)
    assert any("missing or changed" in line for line in lines) and table.stage_done(cfg, "prompts")


@pytest.fixture
def counted_shards(monkeypatch):
    """The generation and features stages' key functions, counting their calls by stage (the rows in the table and
    the ones their modules' bodies read)."""
    calls = {"generation": 0, "features": 0}
    for module in (generation_stage, features_stage):
        row = module.ROW

        def key(cfg, up=None, original=row.key, name=row.name):
            calls[name] += 1
            return original(cfg, up)
        counted = dataclasses.replace(row, key=key)
        monkeypatch.setitem(table.STAGES, row.name, counted)
        monkeypatch.setattr(module, "ROW", counted)
    return calls


@pytest.mark.slow                 # ~30 s: a llama-server start, two stages' shards run and answered from the cache
def test_a_shard_task_takes_the_plans_decision(prefect_server, tmp_path, counted_shards):
    """Two shards per sharded stage: the plan decides once for every shard (one key computation), each shard task's
    cache policy and body take their shard's decision over (none more), the finish task decides once; a rerun
    answers every shard from Prefect's cache with the same count."""
    from flows.stage_flows import features_flow, generation_flow
    from prefect_api import states_by_name, task_runs
    cfg = _cfg(tmp_path)
    cfg.generation.max_new_tokens, cfg.generation.shard_size = 8, 3
    cfg.features.shard_samples = 3
    prompts_stage.run_prompts(cfg, log=lambda *_: None)
    for attempt, state in (("runs", "Completed"), ("done", "Cached")):
        for stage, stage_flow, decisions in (("generation", generation_flow, 2), ("features", features_flow, 3)):
            before, counted_shards[stage] = run.CALLS["decide"], 0
            flow_state = stage_flow(cfg, return_state=True)
            assert flow_state.is_completed(), (attempt, stage, flow_state)
            assert run.CALLS["decide"] - before == decisions and counted_shards[stage] == 2, \
                (attempt, stage, run.CALLS["decide"] - before, counted_shards)
            states = states_by_name(task_runs(flow_state.state_details.flow_run_id))
            assert [states[f"{stage}-shard-{k}"] for k in (0, 1)] == [state, state], (attempt, states)
    assert not run._pending and not run._adopted                  # nothing kept past the tasks
