"""Prefect tasks: each calls one eagle3_core stage (or shard) function with the run config and returns its small
manifest (paths, counts, hashes); no tensors, models or clients pass through Prefect. The tasks are built from the
stage table's rows (eagle3_core.pipeline.table.STAGES: name, body, timeout, tags, progress hook, shard hooks):
`body_task(row)` for a stage run whole, the shard and finish tasks of a sharded stage from its Shards.

Every task: persisted JSON result (the manifest), a cache key from its inputs and source (tasks/cache.py), retries
with exponential backoff and jitter for transient errors only (tasks/retry.py), a timeout, the run logger with
transformers' and httpx's warnings forwarded (tasks/logs.py). GPU work carries the `gpu` tag, whose concurrency
limit (deployments/limits.py) keeps it to one task per GPU.
"""
from __future__ import annotations

import inspect

from prefect import task

from eagle3_core.config import PipelineConfig
from eagle3_core.pipeline import report
from eagle3_core.pipeline.stage import Stage
from eagle3_core.pipeline.table import STAGES
from tasks.artifacts import RequestProgress, progress_callback
from tasks.cache import stage_cache
from tasks.logs import run_log
from tasks.retry import RETRY_OPTIONS, retry_if_transient

HOUR = 3600


def stage_task(name: str, stage: str, timeout_h: float | None, tags: tuple[str, ...] = (),
               run_name: str | None = None):
    """The @task options every pipeline task shares; `stage` picks the cache key (tasks/cache.py)."""
    return task(name=name, task_run_name=run_name or name, cache_policy=stage_cache(stage), tags=list(tags),
                timeout_seconds=timeout_h and timeout_h * HOUR, persist_result=True, result_serializer="json",
                retry_condition_fn=retry_if_transient, **RETRY_OPTIONS)


def _named(fn, name: str, doc: str):
    """`fn` named for the task `name` (its Prefect task key and the UI's description)."""
    fn.__name__ = fn.__qualname__ = name.replace("-", "_") + "_task"
    fn.__doc__ = doc
    return fn


def progress_hook(config: PipelineConfig, row: Stage) -> dict:
    """The keyword argument of `row.body` that moves the progress artifact `<stage>-progress-<run>` (Stage.progress:
    (keyword, unit)), a callback (done, total, detail='') naming the item being worked on; {} without one."""
    if row.progress is None:
        return {}
    keyword, unit = row.progress
    bar = progress_callback(config.run_dir, row.name, unit)
    return {keyword: lambda done, total, detail="": bar(done, total, f" (now: {detail})" if detail else "")}


def body_task(row: Stage, after=None):
    """The task of a stage run whole: its row's body with the run log (and its progress hook), named, timed out
    and tagged as the row says; after(manifest, log), where given, runs on the manifest before it is returned."""
    def run_body(config: PipelineConfig) -> dict:
        with run_log() as log:
            manifest = row.body(config, log=log.info, **progress_hook(config, row))
            if after is not None:
                after(manifest, log)
            return manifest
    doc = f"The {row.name} stage ({row.body.__module__}.{row.body.__name__}): " + \
        (row.body.__doc__ or "").strip().split("\n\n")[0]
    return stage_task(row.name, row.name, row.timeout_h, row.tags)(_named(run_body, row.name, doc))


def evaluate_warnings(manifest: dict, log) -> None:
    """The warnings the evaluate stage's numbers support (report.warnings), at WARNING in the run log."""
    for warning in report.warnings(manifest["summary"]):
        log.warning("evaluate: %s", warning)


prompts_task = body_task(STAGES["prompts"])
tokenize_task = body_task(STAGES["tokenize"])
vocab_task = body_task(STAGES["vocab"])
train_task = body_task(STAGES["train"])           # a retried run resumes from the training state
evaluate_task = body_task(STAGES["evaluate"], after=evaluate_warnings)
deploy_llama_cpp_task = body_task(STAGES["deploy-llama-cpp"])
deploy_sglang_task = body_task(STAGES["deploy-sglang"])     # {'skipped': reason} where SGLang cannot run here


def shard_task(row: Stage):
    """The @task options of `row`'s shard task (Stage.shards: name, timeout, tags; run name '<task>-<shard>')."""
    s = row.shards
    return stage_task(s.task, row.name, s.timeout_h, s.tags, s.task + "-{shard}")


def finish_task(row: Stage):
    """The task that writes a sharded stage's manifest from its shards' manifests (Stage.shards.finish)."""
    def finish(config: PipelineConfig, shard_manifests: list[dict]) -> dict:
        with run_log() as log:
            takes_log = "log" in inspect.signature(row.shards.finish).parameters
            return row.shards.finish(config, shard_manifests, **({"log": log.info} if takes_log else {}))
    doc = f"Write the {row.name} stage's manifest from its shards' manifests ({row.shards.finish.__name__})."
    return stage_task(row.shards.finish_task, row.name, row.timeout_h, row.tags)(
        _named(finish, row.shards.finish_task, doc))


# no task timeout: shards run in worker threads, where Prefect cannot interrupt them; every request is bounded by
# generation.request_timeout_s and generation.max_retries instead
@shard_task(STAGES["generation"])
def generation_shard_task(config: PipelineConfig, shard: int, urls: list[str] | None = None) -> dict:
    """Regenerate one shard of train prompts on the servers at `urls` (the generation row's Shards.run); a progress
    artifact `generation-shard-<k>-progress-<run>` moves every generation.progress_interval_s."""
    with run_log() as log:
        progress = RequestProgress(config.run_dir, f"generation-shard-{shard}")
        return STAGES["generation"].shards.run(config, shard, log=log.info, urls=urls, on_progress=progress.update)


finish_generation_task = finish_task(STAGES["generation"])


@shard_task(STAGES["features"])
def features_shard_task(config: PipelineConfig, shard: int) -> dict:
    """The target's aux hidden states for one shard of samples (run_features_shard)."""
    with run_log() as log:
        return STAGES["features"].shards.run(config, shard, log=log.info)


finish_features_task = finish_task(STAGES["features"])
