"""Deployments served by a real Prefect runner against the session's Prefect server: registration (nightly cron,
parameter schema, defaults), runs triggered through the API with parameters, and a failed shard re-run alone when
the failed flow run is retried the way the UI's Retry button does it."""
import asyncio
import json
import os
import shutil

import pytest
from conftest import written_bytes
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.runner import Runner
from prefect.states import State

from deployments.limits import GPU_TAG, ensure_gpu_limit
from deployments.serve import NIGHTLY_CRON, runner_deployments
from prefect_api import states_by_name, task_runs
from fault_site.fault_injection import FAULT_ENV, pythonpath_with_injector


def _serve_once(deployments) -> None:
    """Register the deployments and run every flow run that is due, in subprocesses, until all have finished."""
    async def go():
        runner = Runner(pause_on_shutdown=False)
        for d in deployments:
            await runner.aadd_deployment(d)
        await runner.start(run_once=True)
    asyncio.run(go())


async def _read_deployment(name: str):
    async with get_client() as client:
        return await client.read_deployment_by_name(name)


async def _trigger(deployment_id, parameters: dict):
    async with get_client() as client:
        return (await client.create_flow_run_from_deployment(deployment_id, parameters=parameters)).id


async def _flow_run(flow_run_id):
    async with get_client() as client:
        return await client.read_flow_run(flow_run_id)


async def _retry_like_the_ui(flow_run_id):
    """What the UI's Retry button sends (prefect's UI, `retryFlowRun`): a Scheduled state named AwaitingRetry."""
    async with get_client() as client:
        return await client.set_flow_run_state(flow_run_id, State(type=StateType.SCHEDULED, name="AwaitingRetry",
                                                                  message="Retry from the UI"), force=False)


@pytest.fixture(scope="module")
def deployments(prefect_server, tmp_path_factory):
    asyncio.run(ensure_gpu_limit(1))
    deps = runner_deployments(tmp_path_factory.mktemp("runs"), timezone="Europe/Berlin")
    _serve_once(deps)                                # registers them; nothing is due yet
    return deps


@pytest.mark.slow
def test_deployments_register_with_schedule_schema_and_defaults(deployments):
    demo = asyncio.run(_read_deployment("eagle3-pipeline/demo"))
    (sched,) = demo.schedules
    assert (sched.schedule.cron, sched.schedule.timezone, sched.active) == (NIGHTLY_CRON, "Europe/Berlin", False)
    assert sched.parameters == {"nightly": True}                  # scheduled runs do a night's work
    schema = demo.parameter_openapi_schema
    assert set(schema["properties"]) == {"config", "refresh", "nightly", "gpus"}
    defs = schema["definitions"]
    assert {"PipelineConfig", "TrainConfig", "GenerationConfig"} <= set(defs)
    assert defs["GenerationConfig"]["properties"]["shard_size"]["description"]
    assert demo.parameters["config"]["train"]["epochs"] == 6 and demo.parameters["refresh"] is False
    assert "nightly" not in demo.parameters                       # a manual run is a plain run
    tiny = asyncio.run(_read_deployment("eagle3-pipeline/debug-tiny"))
    assert tiny.schedules == [] and tiny.parameters["config"]["prompts"]["num_train"] == 6
    for stage in ("prompts", "generation", "features", "vocab", "train", "evaluate", "deploy-llama-cpp",
                  "deploy-sglang"):
        assert asyncio.run(_read_deployment(f"{stage}/{stage}")).parameters["config"]["run_dir"].endswith("demo")
    # one run of each deployment at a time; a second one waits in the queue
    for name in ("eagle3-pipeline/demo", "eagle3-pipeline/debug-tiny", "train/train", "scaling-study/scaling-study"):
        d = asyncio.run(_read_deployment(name))
        assert d.global_concurrency_limit.limit == 1 and d.concurrency_options.collision_strategy.value == "ENQUEUE"

    async def limit():
        async with get_client() as client:
            return await client.read_concurrency_limit_by_tag(GPU_TAG)
    assert asyncio.run(limit()).concurrency_limit == 1


def _features_cfg(e2e_run, run_dir):
    """The debug_tiny run's prompts, generations and tokens in a new run directory; 3 feature shards."""
    cfg, _ = e2e_run
    new = cfg.model_copy(deep=True)
    new.run_dir = run_dir
    new.features.shard_samples = 2
    for d in ("prompts", "generations", "tokenized"):
        shutil.copytree(cfg.run_dir / d, run_dir / d)
    return new


@pytest.mark.slow
def test_failed_shard_reruns_alone_when_the_flow_run_is_retried(deployments, e2e_run, tmp_path, monkeypatch):
    features = asyncio.run(_read_deployment("features/features"))
    # an uninterrupted run, triggered through the API with parameters
    ref = _features_cfg(e2e_run, tmp_path / "uninterrupted")
    ref_id = asyncio.run(_trigger(features.id, {"config": ref.model_dump(mode="json")}))
    _serve_once(deployments)
    assert asyncio.run(_flow_run(ref_id)).state.is_completed()

    # the same with a non-retryable fault in shard 1 (test-only fault injector): the flow run fails
    cfg = _features_cfg(e2e_run, tmp_path / "retried")
    monkeypatch.setenv("PYTHONPATH", pythonpath_with_injector())   # the served flow run loads the injector
    monkeypatch.setenv(FAULT_ENV, "features:1")
    run_id = asyncio.run(_trigger(features.id, {"config": cfg.model_dump(mode="json")}))
    _serve_once(deployments)
    failed = asyncio.run(_flow_run(run_id))
    assert failed.state.is_failed(), failed.state
    runs = task_runs(run_id)
    assert states_by_name(runs) == {"tokenize": "Completed", "plan-features": "Completed",
                                    "features-shard-0": "Completed", "features-shard-1": "Failed",
                                    "features-shard-2": "Completed"}
    assert [t.run_count for t in runs if t.name == "features-shard-1"] == [1]   # task retries did not absorb it
    # the store's manifest lists the finished shards only; the stage is not done
    store = json.loads((cfg.run_dir / "features" / "manifest.json").read_text())
    assert [s["file"] for s in store["shards"]] == ["shard_00000.safetensors", "shard_00002.safetensors"]
    assert store["complete"] is False and "inputs_key" not in store
    assert not (cfg.run_dir / "features" / "shard_00001.safetensors").exists()

    # fixed; retried as the UI does: the served runner picks the rescheduled run up, same flow run id
    monkeypatch.delenv(FAULT_ENV)
    assert asyncio.run(_retry_like_the_ui(run_id)).status.value == "ACCEPT"
    _serve_once(deployments)
    retried = asyncio.run(_flow_run(run_id))
    assert retried.state.is_completed() and retried.run_count == 2
    attempt2 = [t for t in task_runs(run_id) if t.created > max(r.created for r in runs)]
    assert states_by_name(attempt2) == {"tokenize": "Cached", "plan-features": "Completed",
                                        "features-shard-0": "Cached", "features-shard-1": "Completed",
                                        "features-shard-2": "Cached", "finish-features": "Completed"}

    # final outputs equal the uninterrupted run's, byte for byte
    a = json.loads((cfg.run_dir / "features" / "manifest.json").read_text())
    b = json.loads((ref.run_dir / "features" / "manifest.json").read_text())
    assert len(a["shards"]) == 3 and written_bytes(a["shards"]) == written_bytes(b["shards"])
    assert a["inputs_key"] == b["inputs_key"]
    assert os.environ.get(FAULT_ENV) is None


@pytest.mark.slow
def test_work_pool_deployments_register_with_their_pools(deployments, tmp_path):
    """`make deploy-pools`: the same deployments on process work pools, CPU stages apart from GPU stages (runs
    last in this module: it re-registers the served deployments under the same names)."""
    from deployments.limits import CPU_POOL, GPU_POOL, ensure_work_pools
    from deployments.serve import deploy_to_pools
    asyncio.run(ensure_work_pools())
    asyncio.run(ensure_work_pools())                                  # idempotent
    assert len(deploy_to_pools(tmp_path, timezone="UTC")) == 11  # 2 pipelines, 8 stages, the study
    pools = {name: asyncio.run(_read_deployment(name)).work_pool_name
             for name in ("eagle3-pipeline/demo", "prompts/prompts", "generation/generation", "vocab/vocab",
                          "features/features", "train/train", "evaluate/evaluate")}
    assert pools == {"eagle3-pipeline/demo": GPU_POOL, "prompts/prompts": CPU_POOL,
                     "generation/generation": CPU_POOL, "vocab/vocab": CPU_POOL, "features/features": GPU_POOL,
                     "train/train": GPU_POOL, "evaluate/evaluate": GPU_POOL}
    demo = asyncio.run(_read_deployment("eagle3-pipeline/demo"))
    assert demo.entrypoint == "flows/pipeline.py:eagle3_pipeline" and demo.schedules[0].active is False

    async def pool_types():
        async with get_client() as client:
            return {p.name: p.type for p in await client.read_work_pools()}
    assert {CPU_POOL: "process", GPU_POOL: "process"}.items() <= asyncio.run(pool_types()).items()
