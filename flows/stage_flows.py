"""One flow per pipeline stage, so that a user can run (or schedule) any stage alone from the UI. Parameters: the
run config (a pydantic model: a form in the UI) and `refresh`. Flows call tasks only (and the task-level contexts
of tasks/control.py); each reads like its box in the pipeline diagram.

Generation and features run as shard tasks: a failed shard fails the flow run after its siblings finish, and a
retry of the flow run re-runs only what failed (finished shards come back Cached). A task may use Prefect's cache
only while its output on disk is intact for its inputs (tasks/control.py: run_stage, run_shards; docs/architecture.md: data
on disk is the source of truth).
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from prefect import flow
from prefect.context import FlowRunContext
from prefect.task_runners import ThreadPoolTaskRunner

from eagle3_core.config import PipelineConfig, preset
from tasks import stage_tasks as t
from tasks.artifacts import pipeline_progress, stage_started  # noqa: F401 (pipeline_progress: for flows.pipeline)
from tasks.cancel import end_cancelled, say_cancelled  # noqa: F401 (say_cancelled: for flows.pipeline)
from tasks.control import (  # noqa: F401 (locked, first_attempt: re-exported for callers of flows.stage_flows)
    first_attempt,
    forget,
    inference_servers,
    locked,
    plan_features_task,
    plan_generation_task,
    run_shards,
    run_stage,
)
from tasks.summary import summarize, summary_line  # noqa: F401 (summary_line: for callers of flows.stage_flows)

DEMO = preset("demo")


def run_label(config) -> str:
    """The run directory's name (runs/demo -> 'demo'; presets default to runs/<preset>), from a PipelineConfig or
    its JSON form (a deployment's stored parameters)."""
    run_dir = config.run_dir if hasattr(config, "run_dir") else (config or {}).get("run_dir", "")
    return Path(str(run_dir)).name or "run"


def run_name(stage: str):
    """flow_run_name for the flow of `stage`: '<run>-<stage>' (e.g. 'demo-features'), not Prefect's random name,
    so the Runs page says which run and which stage each flow run is. A run a deployment started keeps the name it
    was created with (the UI's Custom run form shows and lets the user pick it; the run's link carries it),
    unless a schedule created it."""
    def name() -> str:
        ctx = FlowRunContext.get()
        run = ctx.flow_run if ctx else None
        if run is not None and run.deployment_id is not None and run.parent_task_run_id is None \
                and not run.auto_scheduled:                # a schedule's run has a random name: named here
            return run.name
        return f"{run_label((ctx.parameters if ctx else {}).get('config'))}-{stage}"
    return name


STAGE_ARGS = """

    Args:
        config: the run's settings (a preset's values); run_dir is the run: the stage writes under it, and the
            run's name and run: tag come from its last folder.
        refresh: recompute this stage, ignoring what is done on disk (off: finished work is reused)."""
GPUS_ARG = """
        gpus: GPUs of this host the stage runs on (1: one process); see the first lines."""


def label(config: PipelineConfig, stage: str) -> None:
    """Tag the current flow run `run:<run>` and `stage:<stage>` (filterable on the Runs page; tags cannot be set
    on a @flow, so every stage flow adds its own, whether the pipeline, a deployment or a user started it)."""
    from prefect.client.orchestration import get_client
    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return
    kept = {t for t in ctx.flow_run.tags if not t.startswith(("run:", "stage:"))}   # a deployment's defaults
    tags = sorted({*kept, f"run:{run_label(config)}", f"stage:{stage}"})
    with get_client(sync_client=True) as client:
        client.update_flow_run(ctx.flow_run.id, tags=tags)


@contextmanager
def stage_run(config: PipelineConfig, stage: str, refresh: bool, *forgotten: str):
    """The frame of every stage flow: tags (label), the run directory's lock (locked), and refresh=True forgetting
    `forgotten` (default: `stage`) on the first attempt (forget)."""
    label(config, stage)
    with locked(config):
        forget(config, refresh, *(forgotten or (stage,)))
        stage_started(config.run_dir, stage)          # the pipeline run's progress names the running stage
        yield


def one_task_stage(config: PipelineConfig, stage: str, refresh: bool, task) -> dict:
    """The body of a stage flow that runs one task: the frame (stage_run), `task` through run_stage, the summary
    line (summarize); returns the stage's manifest."""
    with stage_run(config, stage, refresh):
        return summarize(stage, run_stage(task, config, stage))


@flow(name="prompts", flow_run_name=run_name("prompts"))
def prompts_flow(config: PipelineConfig = DEMO, refresh: bool = False) -> dict:
    """Load, dedupe and split prompts into train and held-out sets."""
    return one_task_stage(config, "prompts", refresh, t.prompts_task)


@flow(name="generation", flow_run_name=run_name("generation"), task_runner=ThreadPoolTaskRunner(max_workers=2))
def generation_flow(config: PipelineConfig = DEMO, refresh: bool = False) -> dict:
    """Regenerate responses with the target, one task per shard, against the inference servers (started by a task
    for server.kind 'llama.cpp' / 'sglang', stopped by another after). Two shards are in flight, each with
    generation.concurrency requests, so that no server slot idles at a shard's tail; shards whose rows are all
    kept, or that are finished, start no server."""
    with stage_run(config, "generation", refresh):
        plan = plan_generation_task(config)
        with inference_servers(config, plan["needs_server"]) as urls:
            shards = run_shards(t.generation_shard_task, config, "generation", plan, urls, parallel=True)
        return summarize("generation", run_stage(t.finish_generation_task, config, "generation", shards))


@flow(name="features", flow_run_name=run_name("features"))
def features_flow(config: PipelineConfig = DEMO, refresh: bool = False, gpus: int = 1) -> dict:
    """Tokenize with loss masks, then extract the target's aux hidden states with features.backend: a per-shard
    backend ('hf', an import) one task per shard, one after another (the target stays loaded between them), or with
    gpus > 1 one torchrun task of `gpus` workers on this host, each loading the whole target and extracting every
    gpus-th shard; a torchrun backend ('hf_tp', 'ep_int4', 'sglang') one torchrun task whose features.tp_size ranks
    share the sharded target and extract every shard."""
    with stage_run(config, "features", refresh, "tokenize", "features"):
        run_stage(t.tokenize_task, config, "tokenize")
        plan = plan_features_task(config)
        if not plan["per_shard"]:
            from tasks.distributed import features_tp_task  # a torchrun backend only: keeps the flow's import light
            return summarize("features", features_tp_task(config))
        if gpus > 1:
            from tasks.distributed import features_distributed_task  # as above
            return summarize("features", features_distributed_task(config, gpus))
        shards = run_shards(t.features_shard_task, config, "features", plan)
        return summarize("features", run_stage(t.finish_features_task, config, "features", shards))


@flow(name="vocab", flow_run_name=run_name("vocab"))
def vocab_flow(config: PipelineConfig = DEMO, refresh: bool = False) -> dict:
    """Build the draft vocab map (d2t, t2d)."""
    return one_task_stage(config, "vocab", refresh, t.vocab_task)


@flow(name="train", flow_run_name=run_name("train"))
def train_flow(config: PipelineConfig = DEMO, refresh: bool = False, gpus: int = 1) -> dict:
    """Train the EAGLE-3 draft with training-time test and export it for SGLang; with gpus > 1 under DDP, one
    torchrun task of `gpus` ranks on this host (train.batch_tokens per rank: the global batch grows with them)."""
    if gpus <= 1:
        return one_task_stage(config, "train", refresh, t.train_task)
    from tasks.distributed import train_ddp_task  # a multi-GPU run only: keeps the flow's import light
    with stage_run(config, "train", refresh):
        return summarize("train", train_ddp_task(config, gpus))


@flow(name="evaluate", flow_run_name=run_name("evaluate"))
def evaluate_flow(config: PipelineConfig = DEMO, refresh: bool = False) -> dict:
    """Measure tau of the trained and an untrained draft on held-out prompts."""
    return one_task_stage(config, "evaluate", refresh, t.evaluate_task)


@flow(name="deploy-llama-cpp", flow_run_name=run_name("deploy-llama-cpp"))
def deploy_llama_cpp_flow(config: PipelineConfig = DEMO, refresh: bool = False) -> dict:
    """Serve the draft on llama.cpp's EAGLE-3 mode and benchmark it against the same server without a draft."""
    return one_task_stage(config, "deploy-llama-cpp", refresh, t.deploy_llama_cpp_task)


@flow(name="deploy-sglang", flow_run_name=run_name("deploy-sglang"))
def deploy_sglang_flow(config: PipelineConfig = DEMO, refresh: bool = False) -> dict:
    """Serve the draft on SGLang (EAGLE3) against the same server without it: tau, tok/s, speed-up and break-even
    tau per concurrency; skipped, saying why, for GGUF targets and where SGLang is not installed."""
    return one_task_stage(config, "deploy-sglang", refresh, t.deploy_sglang_task)


for _stage_flow in (prompts_flow, generation_flow, features_flow, vocab_flow, train_flow, evaluate_flow,
                    deploy_llama_cpp_flow, deploy_sglang_flow):     # the form's field descriptions (Prefect reads Args)
    _stage_flow.fn.__doc__ = (_stage_flow.fn.__doc__ or "") + STAGE_ARGS + (GPUS_ARG if _stage_flow in (
        features_flow, train_flow) else "")
    _stage_flow.on_crashed_hooks.append(end_cancelled)     # a cancel above ends it Cancelled (tasks/cancel.py)
    _stage_flow.on_cancellation_hooks.append(say_cancelled)   # and its log, and the logs above it, say so
