"""One Prefect task per pipeline stage. Each calls one eagle3_core stage function with the run config and returns
its manifest (paths, counts, hashes): no tensors, models or clients pass through Prefect.

Caching: each stage's manifest on disk, keyed by its inputs, decides whether work is redone (DESIGN.md: data on
disk is the source of truth), so Prefect's own cache is off here. `transformers` and `httpx` logs are forwarded to
the run log at WARNING.
"""
from __future__ import annotations

import logging

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from eagle3_core import stages
from eagle3_core.config import PipelineConfig


def _log():
    logger = get_run_logger()
    for name in ("transformers", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return logger.info


def _stage_task(name: str, fn, tags: tuple[str, ...] = ()):
    @task(name=name, cache_policy=NO_CACHE, tags=list(tags), log_prints=True)
    def run(config: PipelineConfig) -> dict:
        return fn(config, log=_log())
    run.__doc__ = fn.__doc__
    return run


prompts_task = _stage_task("prompts", stages.run_prompts)
generation_task = _stage_task("generation", stages.run_generation, ("server",))
tokenize_task = _stage_task("tokenize", stages.run_tokenize)
features_task = _stage_task("features", stages.run_features, ("gpu",))
vocab_task = _stage_task("vocab", stages.run_vocab)
train_task = _stage_task("train", stages.run_train, ("gpu",))
evaluate_task = _stage_task("evaluate", stages.run_evaluate, ("gpu",))
deploy_llama_cpp_task = _stage_task("deploy-llama-cpp", stages.run_deploy_llama_cpp, ("server",))
