"""Prefect tasks: each calls one eagle3_core stage (or shard) function with the run config and returns its small
manifest (paths, counts, hashes); no tensors, models or clients pass through Prefect.

Every task: persisted JSON result (the manifest), a cache key from its inputs and source (tasks/cache.py), retries
with exponential backoff and jitter for transient errors only (tasks/retry.py), a timeout, the run logger with
transformers' and httpx's warnings forwarded (tasks/logs.py). GPU work carries the `gpu` tag, whose concurrency
limit (deployments/limits.py) keeps it to one task per GPU.
"""
from __future__ import annotations

from prefect import task

from eagle3_core.config import PipelineConfig
from eagle3_core.pipeline import report
from eagle3_core.pipeline.deploy_stage import run_deploy_llama_cpp, run_deploy_sglang
from eagle3_core.pipeline.evaluate_stage import run_evaluate
from eagle3_core.pipeline.features_stage import finish_features, run_features_shard
from eagle3_core.pipeline.generation_stage import finish_generation, run_generation_shard
from eagle3_core.pipeline.prompts_stage import run_prompts
from eagle3_core.pipeline.tokenize_stage import run_tokenize
from eagle3_core.pipeline.train_stage import run_train
from eagle3_core.pipeline.vocab_stage import run_vocab
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


@stage_task("prompts", "prompts", 2)
def prompts_task(config: PipelineConfig) -> dict:
    """Load, dedupe and split prompts (eagle3_core.pipeline.prompts_stage.run_prompts)."""
    with run_log() as log:
        return run_prompts(config, log=log.info)


# no task timeout: shards run in worker threads, where Prefect cannot interrupt them; every request is bounded by
# generation.request_timeout_s and generation.max_retries instead
@stage_task("generation-shard", "generation", None, ("server",), "generation-shard-{shard}")
def generation_shard_task(config: PipelineConfig, shard: int, urls: list[str] | None = None) -> dict:
    """Regenerate one shard of train prompts on the servers at `urls` (run_generation_shard); a progress artifact
    `generation-shard-<k>-progress-<run>` moves every generation.progress_interval_s."""
    with run_log() as log:
        progress = RequestProgress(config.run_dir, f"generation-shard-{shard}")
        return run_generation_shard(config, shard, log=log.info, urls=urls, on_progress=progress.update)


@stage_task("finish-generation", "generation", 1)
def finish_generation_task(config: PipelineConfig, shard_manifests: list[dict]) -> dict:
    """Write the generation stage's manifest from its shards' manifests (finish_generation)."""
    return finish_generation(config, shard_manifests)


@stage_task("tokenize", "tokenize", 12)
def tokenize_task(config: PipelineConfig) -> dict:
    """Chat template + assistant-only loss masks (run_tokenize)."""
    with run_log() as log:
        return run_tokenize(config, log=log.info)


@stage_task("features-shard", "features", 12, ("gpu",), "features-shard-{shard}")
def features_shard_task(config: PipelineConfig, shard: int) -> dict:
    """The target's aux hidden states for one shard of samples (run_features_shard)."""
    with run_log() as log:
        return run_features_shard(config, shard, log=log.info)


@stage_task("finish-features", "features", 1)
def finish_features_task(config: PipelineConfig, shard_manifests: list[dict]) -> dict:
    """Write the features stage's manifest from its shards' entries (finish_features)."""
    with run_log() as log:
        return finish_features(config, shard_manifests, log=log.info)


@stage_task("vocab", "vocab", 6)
def vocab_task(config: PipelineConfig) -> dict:
    """Draft vocab map d2t/t2d (run_vocab)."""
    with run_log() as log:
        return run_vocab(config, log=log.info)


@stage_task("train", "train", 96, ("gpu",))
def train_task(config: PipelineConfig) -> dict:
    """Train the draft with TTT and export it (run_train); a retried run resumes from the training state. A
    progress artifact `train-progress-<run>` moves each epoch."""
    with run_log() as log:
        return run_train(config, log=log.info, on_epoch=progress_callback(config.run_dir, "train", "epochs"))


@stage_task("evaluate", "evaluate", 12, ("gpu",))
def evaluate_task(config: PipelineConfig) -> dict:
    """Offline tau of the trained and an untrained draft (run_evaluate); a progress artifact
    `evaluate-progress-<run>` moves each decoded prompt; warnings the numbers support at WARNING."""
    with run_log() as log:
        bar = progress_callback(config.run_dir, "evaluate", "prompt decodes")
        manifest = run_evaluate(config, log=log.info,
                                       on_progress=lambda done, total, name: bar(done, total, f" (now: {name})"))
        for warning in report.warnings(manifest["summary"]):
            log.warning("evaluate: %s", warning)
        return manifest


@stage_task("deploy-llama-cpp", "deploy-llama-cpp", 12, ("server",))
def deploy_llama_cpp_task(config: PipelineConfig) -> dict:
    """Serve the draft on llama.cpp's EAGLE-3 server and benchmark it (run_deploy_llama_cpp)."""
    with run_log() as log:
        return run_deploy_llama_cpp(config, log=log.info)


@stage_task("deploy-sglang", "deploy-sglang", 24, ("server",))
def deploy_sglang_task(config: PipelineConfig) -> dict:
    """Serve the draft on SGLang with EAGLE3 against the same server without it (run_deploy_sglang); returns
    {'skipped': reason} where SGLang cannot run here."""
    with run_log() as log:
        return run_deploy_sglang(config, log=log.info)
