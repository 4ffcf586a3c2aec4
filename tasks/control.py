"""What the flows ask of a run besides its stage bodies, as tasks (state, log, retries visible in the UI) or
task-level contexts, so that flows/ call no eagle3_core function except config and presets (tests/test_architecture.py):
the config check, forgetting stages on refresh, planning shards (which are finished, whether a server is needed),
starting and stopping the inference servers, the run directory's lock, and cache use derived from the records on
disk (a task may answer from Prefect's cache only while its stage's or shard's output is intact: docs/architecture.md, data on
disk is the source of truth).
"""
from __future__ import annotations

import logging
import time
from contextlib import ExitStack, contextmanager

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext
from prefect.futures import as_completed

from eagle3_core.check import check_or_raise
from eagle3_core.config import PipelineConfig
from eagle3_core.contract.numbers import eta_text
from eagle3_core.contract.run_lock import run_lock
from eagle3_core.pipeline.generation_stage import generation_servers, generation_shards
from eagle3_core.pipeline.run import release
from eagle3_core.pipeline.table import STAGES, done, invalidate_stage, plan_shards
from eagle3_core.serving.launcher import running_server
from tasks.artifacts import ShardProgress, shard_table
from tasks.logs import failure_text, note_failure, run_log
from tasks.report import publish_check

ALL_STAGES = tuple(STAGES)          # the stage table's, in order


@contextmanager
def locked(cfg: PipelineConfig):
    """Hold cfg.run_dir's lock (contract.run_lock) for the current flow run: its subflows, shard threads and the
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


@task(name="check", task_run_name="check", cache_policy=NO_CACHE)
def check_task(config: PipelineConfig) -> str:
    """The config against the target's config (eagle3_core.check: config files only, no weights): fails in
    seconds, before any stage runs, with CheckError naming each problem's field, cause and fix (the run log's first
    error; tasks/logs.py keeps a refusal's traceback out). When it passes, the facts read, ~100 lines, go to the
    artifact `check-<run>`, and it returns their summary line (check_summary), which plan_stages_task logs in the
    run's first message."""
    with run_log():
        facts = check_or_raise(config, log=lambda text: None, facts_on_refusal=False)
        return publish_check(config, facts)


@task(name="forget", task_run_name="forget", cache_policy=NO_CACHE)
def forget_task(config: PipelineConfig, stage_names: list[str]) -> list[str]:
    """Forget that `stage_names` are done (invalidate_stage: manifests and shard records; data files stay
    until overwritten), so that they recompute."""
    for name in stage_names:
        invalidate_stage(config, name)
    get_run_logger().info("refresh: %s will recompute", ", ".join(stage_names))
    return stage_names


def forget(cfg: PipelineConfig, refresh: bool, *stage_names: str) -> None:
    """refresh=True: the stages recompute their outputs (forget_task). Only on a flow run's first attempt: a
    retry keeps what the failed attempt finished."""
    if refresh and first_attempt():
        forget_task(cfg, list(stage_names))


def run_stage(task_, cfg: PipelineConfig, stage: str, *args):
    """Run a stage task; Prefect's cache may answer only if the stage's manifest on disk matches its inputs. The
    stage's one done decision (table.done), which the task's cache policy and body take over."""
    try:
        return task_.with_options(refresh_cache=done(cfg, stage) is None)(cfg, *args)
    finally:
        release(cfg, stage)


@task(name="plan-generation", task_run_name="plan-generation", cache_policy=NO_CACHE)
def plan_generation_task(config: PipelineConfig) -> dict:
    """The generation stage's shards: {'shards': every id, 'done': finished ones (record and file intact for the
    current inputs), 'needs_server': whether any unfinished shard holds rows to regenerate}."""
    generation_shards(config, get_run_logger().info)     # keeps shards past the last one, saying so
    status = plan_shards(config, "generation")           # every shard's done decision, kept for its task
    ids, done, needs = status["shards"], status["done"], status["needs_server"]
    get_run_logger().info("generation: %s shards, %s finished, %s to run; %s", len(ids), len(done),
                          len(ids) - len(done), "a server is needed" if needs else "no server needed")
    return {"shards": ids, "done": done, "needs_server": needs}


@task(name="plan-features", task_run_name="plan-features", cache_policy=NO_CACHE)
def plan_features_task(config: PipelineConfig) -> dict:
    """The features stage's shards: {'shards': every id, 'done': those intact on disk for the current inputs (read
    without loading the target), 'per_shard': whether the backend runs one task per shard (else one torchrun task
    for all: features.backends)}."""
    status = plan_shards(config, "features")             # every shard's done decision, kept for its task
    ids, done = status["shards"], status["done"]
    get_run_logger().info("features: %s shards, %s finished, %s to extract%s", len(ids), len(done),
                          len(ids) - len(done), "" if status["per_shard"] else " in one torchrun")
    return status


_servers: dict[str, ExitStack] = {}


@task(name="start-servers", task_run_name="start-servers", cache_policy=NO_CACHE)
def start_servers_task(config: PipelineConfig) -> dict:
    """Start the generation stage's inference servers (generation_servers; kinds 'external' and
    'transformers' start nothing) and log each one's pid, URL and log file. Returns {'handle', 'urls'}; the
    servers run until stop_servers_task(handle) (inference_servers pairs them)."""
    stack = ExitStack()
    urls = stack.enter_context(generation_servers(config))
    handle = f"{config.run_dir}:{time.monotonic_ns()}"
    _servers[handle] = stack
    log = get_run_logger()
    for url in urls:
        if (info := running_server(url)) is not None:
            log.info("server %s started: pid %s, log %s", url, info[0], info[1])
        else:
            log.info("server %s: external, not started here", url)
    return {"handle": handle, "urls": urls}


def _stop(handle: str) -> bool:
    stack = _servers.pop(handle, None)
    if stack is not None:
        stack.close()
    return stack is not None


@task(name="stop-servers", task_run_name="stop-servers", cache_policy=NO_CACHE)
def stop_servers_task(handle: str) -> bool:
    """Stop the servers start_servers_task started under `handle` (SIGTERM to each process group, SIGKILL after
    the grace period). False if they were already stopped."""
    stopped = _stop(handle)
    get_run_logger().info("servers %s", "stopped" if stopped else "were already stopped")
    return stopped


@contextmanager
def inference_servers(config: PipelineConfig, needed: bool):
    """The servers for the block: start_servers_task, then stop_servers_task when the block ends, on failure and
    on cancellation; yields their URLs (None when not `needed`). Whatever happens to the stop task, the servers
    are stopped before this returns (and, through PDEATHSIG, if the process is killed)."""
    if not needed:
        yield None
        return
    started = start_servers_task(config)
    try:
        yield started["urls"]
    finally:
        try:
            stop_servers_task(started["handle"])
        finally:
            _stop(started["handle"])


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


def run_shards(task_, cfg: PipelineConfig, stage: str, plan: dict, *args, parallel: bool = False,
               in_flight: int = 2) -> list[dict]:
    """Run one task per shard of `plan` (plan_*_task: its done decisions, which the shard tasks take over;
    run_shard_tasks); the decisions left by shards Prefect's cache answered are dropped after (release)."""
    try:
        return run_shard_tasks(task_, cfg, stage, plan, *args, parallel=parallel, in_flight=in_flight)
    finally:
        release(cfg, stage)


def run_shard_tasks(task_, cfg: PipelineConfig, stage: str, plan: dict, *args, parallel: bool = False,
                    in_flight: int = 2) -> list[dict]:
    """Run one task per shard of `plan` (plan_*_task), let every shard finish, then fail if any failed (naming
    them). A shard not in plan['done'] ignores Prefect's cache. parallel=False runs them one after another in the
    flow's thread, where a task timeout can interrupt a hung shard; parallel=True submits them to the flow's task
    runner, `in_flight` at a time (the runner's threads): a shard is submitted only when one ends, so that once
    the flow run is cancelled (SIGTERM stops the servers and interrupts this loop) no queued shard starts."""
    shard_ids, done = plan["shards"], set(plan["done"])
    progress = ShardProgress(cfg.run_dir, stage, len(shard_ids))
    t0, ran = time.monotonic(), []

    def step(shard: int, state) -> None:
        progress.step()
        n, N = progress.done, progress.total
        ran.extend([shard] if state.name != "Cached" else [])    # a cached shard is no rate: eta_text
        eta = eta_text(time.monotonic() - t0, len(ran), N - n)
        # in the pipeline run's log too, but a failed shard there only in the failure line below (its cause and fix,
        # which should sit near the top of that page)
        say = log_in_parent_runs if state.is_completed() else get_run_logger().log
        say(logging.INFO, "%s: %s of %s shards done (shard %s: %s)%s", stage, n, N, shard, state.name, eta)

    states = []
    if parallel:
        queue, running, ended = list(shard_ids), {}, {}
        while queue or running:
            while queue and len(running) < in_flight:
                i = queue.pop(0)
                running[task_.with_options(refresh_cache=i not in done).submit(cfg, i, *args)] = i
            fut = next(as_completed(list(running)))
            fut.wait()                     # keeps the final state on the future (the API's copy may lag)
            i = running.pop(fut)
            ended[i] = fut.state
            step(i, fut.state)
        states = [ended[i] for i in shard_ids]
    else:
        for i in shard_ids:
            states.append(task_.with_options(refresh_cache=i not in done)(cfg, i, *args, return_state=True))
            step(i, states[-1])
    failed = [i for i, st in zip(shard_ids, states) if not st.is_completed()]
    if failed:                  # the cause once per run page: this line, here and in every run above
        exc = next(st for st in states if not st.is_completed()).result(raise_on_failure=False)
        text = failure_text(exc) if isinstance(exc, BaseException) else str(exc)
        fix = "" if "retry" in text else "; fix the cause and retry this flow run: only they will run again"
        if isinstance(exc, BaseException):
            note_failure(exc)              # this line is each page's full message: later records refer to it
        log_in_parent_runs(logging.ERROR, "%s: shards %s of %s failed (first error: %s)%s", stage, failed,
                           len(shard_ids), text, fix)
    results = [st.result() for st in states]                  # raises the first failure
    shard_table(cfg.run_dir, stage, results)
    return results
