"""One flow per pipeline stage, so that a user can run (or schedule) any stage alone from the UI. Parameters: the
run config (a pydantic model: a form in the UI) and `refresh`.

Generation and features run as shard tasks: a failed shard fails the flow run after its siblings finish, and a
retry of the flow run re-runs only what failed (finished shards come back Cached). A task may use Prefect's cache
only while its output on disk is intact for its inputs; otherwise it runs with refresh_cache (DESIGN.md: data on
disk is the source of truth).
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager, nullcontext

from prefect import flow, get_run_logger
from prefect.context import FlowRunContext
from prefect.futures import as_completed
from prefect.task_runners import ThreadPoolTaskRunner

from eagle3_core import stages
from eagle3_core.config import PipelineConfig, preset
from eagle3_core.run_lock import run_lock
from tasks import stages as t
from tasks.artifacts import ShardProgress, shard_table

DEMO = preset("demo")


@contextmanager
def locked(cfg: PipelineConfig):
    """Hold cfg.run_dir's lock (eagle3_core.run_lock) for the current flow run: its subflows, shard threads and the
    processes its tasks start pass; another run of the same run directory is refused with RunDirBusy naming this
    one (flow run id and name, pid, start time)."""
    ctx = FlowRunContext.get()
    run = ctx.flow_run if ctx else None
    with run_lock(cfg.run_dir, str(run.id) if run else None, run.name if run else None):
        yield


def first_attempt() -> bool:
    """False when the current flow run is being retried (run_count > 1)."""
    ctx = FlowRunContext.get()
    return ctx is None or ctx.flow_run is None or ctx.flow_run.run_count <= 1


def forget(cfg: PipelineConfig, refresh: bool, *stage_names: str) -> None:
    """refresh=True: the stages recompute their outputs. Only on a flow run's first attempt: a retry keeps what
    the failed attempt finished."""
    if refresh and first_attempt():
        for name in stage_names:
            stages.invalidate_stage(cfg, name)


def log_in_parent_runs(level: int, msg: str, *args) -> None:
    """Log to the current flow run and to every flow run above it (a stage flow called by the pipeline flow), so
    that what a user must act on shows on the run page they opened."""
    from prefect.client.orchestration import get_client
    from prefect.logging.loggers import flow_run_logger
    get_run_logger().log(level, msg, *args)
    ctx = FlowRunContext.get()
    run = ctx.flow_run if ctx else None
    if run is None or run.parent_task_run_id is None:
        return
    with get_client(sync_client=True) as client:
        while run.parent_task_run_id is not None:
            run = client.read_flow_run(client.read_task_run(run.parent_task_run_id).flow_run_id)
            flow_run_logger(flow_run=run).log(level, msg, *args)


def run_stage(task, cfg: PipelineConfig, stage: str, *args):
    """Run a stage task; Prefect's cache may answer only if the stage's manifest on disk matches its inputs."""
    return task.with_options(refresh_cache=not stages.stage_done(cfg, stage))(cfg, *args)


def run_shards(task, cfg: PipelineConfig, stage: str, shard_ids: list[int], done, *args,
               parallel: bool = False) -> list[dict]:
    """Run one task per shard, let every shard finish, then fail if any failed (naming them). `done(cfg, i)`
    tells whether shard i is intact on disk (else the task ignores Prefect's cache). parallel=False runs them one
    after another in the flow's thread, where a task timeout can interrupt a hung shard; parallel=True submits
    them to the flow's task runner."""
    progress = ShardProgress(cfg.run_dir, stage, len(shard_ids))
    log, t0 = get_run_logger(), time.monotonic()

    def step(shard: int, state) -> None:
        progress.step()
        n, N = progress.done, progress.total
        eta = f", ETA {(time.monotonic() - t0) / n * (N - n) / 60:.1f} min" if n < N else ""
        log.info("%s: %s of %s shards done (shard %s: %s)%s", stage, n, N, shard, state.name, eta)

    states = []
    if parallel:
        futures = {task.with_options(refresh_cache=not done(cfg, i)).submit(cfg, i, *args): i for i in shard_ids}
        for fut in as_completed(list(futures)):
            fut.wait()                     # keeps the final state on the future (the API's copy may lag)
            step(futures[fut], fut.state)
        states = [f.state for f in futures]
    else:
        for i in shard_ids:
            states.append(task.with_options(refresh_cache=not done(cfg, i))(cfg, i, *args, return_state=True))
            step(i, states[-1])
    failed = [i for i, st in zip(shard_ids, states) if not st.is_completed()]
    if failed:
        first = next(st for st in states if not st.is_completed())
        log_in_parent_runs(logging.ERROR, "%s: shards %s of %s failed (first error: %s); fix the cause and retry "
                           "this flow run: only they will run again", stage, failed, len(shard_ids),
                           (first.message or "")[:1500])
    results = [st.result() for st in states]                  # raises the first failure
    shard_table(cfg.run_dir, stage, results)
    return results


@flow(name="prompts")
def prompts_flow(config: PipelineConfig = DEMO, refresh: bool = False) -> dict:
    """Load, dedupe and split prompts into train and held-out sets."""
    with locked(config):
        forget(config, refresh, "prompts")
        return run_stage(t.prompts_task, config, "prompts")


@flow(name="generation", task_runner=ThreadPoolTaskRunner(max_workers=2))
def generation_flow(config: PipelineConfig = DEMO, refresh: bool = False) -> dict:
    """Regenerate responses with the target, one task per shard, against the inference servers (started here for
    server.kind 'llama.cpp' / 'sglang', stopped after). Two shards are in flight, each with generation.concurrency
    requests, so that no server slot idles at a shard's tail; shards whose rows are all kept start no server."""
    with locked(config):
        forget(config, refresh, "generation")
        shard_ids = stages.generation_shards(config)
        pending = [i for i in shard_ids if not stages.generation_shard_done(config, i)
                   and stages.generation_shard_needs_server(config, i)]
        with (stages.generation_servers(config) if pending else nullcontext(None)) as urls:
            shards = run_shards(t.generation_shard_task, config, "generation", shard_ids,
                                stages.generation_shard_done, urls, parallel=True)
        return run_stage(t.finish_generation_task, config, "generation", shards)


@flow(name="features")
def features_flow(config: PipelineConfig = DEMO, refresh: bool = False) -> dict:
    """Tokenize with loss masks, then extract the target's aux hidden states, one task per shard, one after
    another (the target stays loaded between them; more GPUs = more workers of the GPU pool). Backend 'hf_tp':
    one torchrun task whose features.tp_size ranks share the sharded target and extract every shard."""
    with locked(config):
        forget(config, refresh, "tokenize", "features")
        run_stage(t.tokenize_task, config, "tokenize")
        if config.features.backend == "hf_tp":
            from tasks.distributed import features_tp_task
            return features_tp_task(config)
        shards = run_shards(t.features_shard_task, config, "features", stages.feature_shards(config),
                            stages.feature_shard_done)
        return run_stage(t.finish_features_task, config, "features", shards)


@flow(name="vocab")
def vocab_flow(config: PipelineConfig = DEMO, refresh: bool = False) -> dict:
    """Build the draft vocab map (d2t, t2d)."""
    with locked(config):
        forget(config, refresh, "vocab")
        return run_stage(t.vocab_task, config, "vocab")


@flow(name="train")
def train_flow(config: PipelineConfig = DEMO, refresh: bool = False) -> dict:
    """Train the EAGLE-3 draft with training-time test and export it for SGLang."""
    with locked(config):
        forget(config, refresh, "train")
        return run_stage(t.train_task, config, "train")


@flow(name="evaluate")
def evaluate_flow(config: PipelineConfig = DEMO, refresh: bool = False) -> dict:
    """Measure tau of the trained and an untrained draft on held-out prompts."""
    with locked(config):
        forget(config, refresh, "evaluate")
        return run_stage(t.evaluate_task, config, "evaluate")


@flow(name="deploy-llama-cpp")
def deploy_llama_cpp_flow(config: PipelineConfig = DEMO, refresh: bool = False) -> dict:
    """Serve the draft on llama.cpp's EAGLE-3 mode and benchmark it against the same server without a draft."""
    with locked(config):
        forget(config, refresh, "deploy-llama-cpp")
        return run_stage(t.deploy_llama_cpp_task, config, "deploy-llama-cpp")


@flow(name="deploy-sglang")
def deploy_sglang_flow(config: PipelineConfig = DEMO, refresh: bool = False) -> dict:
    """Serve the draft on SGLang (EAGLE3) against the same server without it: tau, tok/s, speed-up and break-even
    tau per concurrency; skipped, saying why, for GGUF targets and where SGLang is not installed."""
    with locked(config):
        forget(config, refresh, "deploy-sglang")
        return run_stage(t.deploy_sglang_task, config, "deploy-sglang")
