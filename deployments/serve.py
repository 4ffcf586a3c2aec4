"""Register the pipeline's deployments with a running Prefect server (`make server` in one shell) and serve them
(`make deploy` in another), or hand them to work pools (`make deploy-pools`, then start workers).

Deployments: `eagle3-pipeline/demo` (nightly at 02:00, created switched off: switch it on in the UI),
`eagle3-pipeline/debug-tiny` (the smallest preset, minutes on a laptop), and one per stage
(`prompts/prompts`, `generation/generation`, ...) with the demo preset as parameter defaults, and
`scaling-study/scaling-study` (tau against training-set size). Run directories
default to runs/<preset> (EAGLE3_RUN_ROOT or --run-root to change).

Each deployment runs one flow run at a time (a deployment concurrency limit of 1; more runs wait, ENQUEUE), and
a flow run holds its run directory's lock (eagle3_core/contract/run_lock.py): two deployments writing the same run
directory (the demo run and the `train` stage deployment, say) are refused, naming the run that holds it.

Work pools (--pools): `eagle3-cpu` for prompts, generation and vocab; `eagle3-gpu` for features, train, evaluate,
llama.cpp deployment and the end-to-end flow. Start one worker per pool and host:
    prefect worker start --pool eagle3-cpu
    CUDA_VISIBLE_DEVICES=0 prefect worker start --pool eagle3-gpu --limit 1     # one per GPU
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from prefect import serve
from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.schedules import Cron

from deployments.limits import CPU_POOL, GPU_POOL, ensure_all
from eagle3_core.config import preset
from flows import stage_flows as stages
from flows.pipeline import eagle3_pipeline
from flows.scaling_study import DEFAULT_FRACTIONS, scaling_study_flow

ROOT = Path(__file__).resolve().parents[1]
NIGHTLY_CRON = "0 2 * * *"
STAGE_FLOWS = {stages.prompts_flow: CPU_POOL, stages.generation_flow: CPU_POOL, stages.features_flow: GPU_POOL,
               stages.vocab_flow: CPU_POOL, stages.train_flow: GPU_POOL, stages.evaluate_flow: GPU_POOL,
               stages.deploy_llama_cpp_flow: GPU_POOL, stages.deploy_sglang_flow: GPU_POOL}



def one_at_a_time() -> ConcurrencyLimitConfig:
    """Deployment concurrency: one run of a deployment at a time; a second one (a Quick run during a run, the
    nightly schedule firing during a manual run) waits for a slot instead of starting."""
    return ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE)


def nightly(timezone: str) -> Cron:
    """The nightly schedule: opt-in (created inactive; switch it on in the UI, deployment page). Its runs pass
    nightly=True: a night's work (eagle3_core.pipeline.nightly), not a rerun that finds every stage done."""
    return Cron(NIGHTLY_CRON, timezone=timezone, active=False, parameters={"nightly": True})


def deployment_specs(run_root: Path, timezone: str) -> list[dict]:
    """(flow, name, parameter defaults, schedule, work pool) of every deployment."""
    def params(name: str) -> dict:
        return {"config": preset(name, run_root / name).model_dump(mode="json"), "refresh": False}

    specs = [{"flow": eagle3_pipeline, "name": "demo", "parameters": params("demo"),
              "schedule": nightly(timezone), "pool": GPU_POOL,
              "description": "End to end on the embedded default (about 15 min on 2 CPU cores)."},
             {"flow": eagle3_pipeline, "name": "debug-tiny", "parameters": params("debug_tiny"),
              "schedule": None, "pool": GPU_POOL, "description": "End to end on 6 prompts: a smoke run."}]
    for fl, pool in STAGE_FLOWS.items():
        specs.append({"flow": fl, "name": fl.name, "parameters": params("demo"), "schedule": None, "pool": pool,
                      "description": fl.description})
    specs.append({"flow": scaling_study_flow, "name": "scaling-study", "pool": GPU_POOL, "schedule": None,
                  "parameters": {"config": preset("demo", run_root / "demo").model_dump(mode="json"),
                                 "fractions": DEFAULT_FRACTIONS},
                  "description": scaling_study_flow.description})
    return specs


def creation_tags(spec: dict) -> list[str]:
    """The tags a deployment's runs carry from their creation: eagle3, run:<its run directory's name> and
    stage:<its stage> (the flow relabels a run whose form changed run_dir when it starts: stage_flows.label)."""
    stage = "pipeline" if spec["flow"] is eagle3_pipeline else spec["flow"].name
    return ["eagle3", f"run:{stages.run_label(spec['parameters']['config'])}", f"stage:{stage}"]


def runner_deployments(run_root: Path, timezone: str = "UTC") -> list:
    """The deployments as RunnerDeployments for `serve` (flow runs execute in the serving process's host)."""
    return [sp["flow"].to_deployment(name=sp["name"], parameters=sp["parameters"], description=sp["description"],
                                     schedule=sp["schedule"], tags=creation_tags(sp),
                                     concurrency_limit=one_at_a_time())
            for sp in deployment_specs(run_root, timezone)]


def deploy_to_pools(run_root: Path, timezone: str = "UTC") -> list:
    """Register every deployment with its work pool (code pulled from this checkout); returns their ids."""
    ids = []
    for sp in deployment_specs(run_root, timezone):
        entry = f"{Path(sp['flow'].fn.__code__.co_filename).relative_to(ROOT)}:{sp['flow'].fn.__name__}"
        fl = sp["flow"].from_source(source=str(ROOT), entrypoint=entry)
        ids.append(fl.deploy(name=sp["name"], work_pool_name=sp["pool"], parameters=sp["parameters"],
                             description=sp["description"], schedule=sp["schedule"], tags=creation_tags(sp),
                             concurrency_limit=one_at_a_time(), build=False, push=False, print_next_steps=False))
    return ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-root", default=os.environ.get("EAGLE3_RUN_ROOT", "runs"),
                   help="run directories default to RUN_ROOT/<preset>")
    p.add_argument("--timezone", default=os.environ.get("EAGLE3_TIMEZONE", "UTC"),
                   help="IANA timezone of the nightly schedule, e.g. Europe/Berlin")
    p.add_argument("--pools", action="store_true", help="register with work pools instead of serving here")
    args = p.parse_args()
    run_root = Path(args.run_root).resolve()
    ensure_all()
    if args.pools:
        deploy_to_pools(run_root, args.timezone)
        print(f"registered; start workers: prefect worker start --pool {CPU_POOL}  and, per GPU, "
              f"prefect worker start --pool {GPU_POOL} --limit 1")
    else:
        serve(*runner_deployments(run_root, args.timezone))


if __name__ == "__main__":
    main()
