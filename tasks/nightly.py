"""The nightly run's two steps as tasks (eagle3_core.pipeline.nightly): plan the night before the stages, record and
promote after evaluation. Not cached: each night reads the sources and the run directory afresh."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from eagle3_core.config import PipelineConfig
from eagle3_core.pipeline import nightly
from tasks.logs import run_log


@task(name="plan-night", task_run_name="plan-night", cache_policy=NO_CACHE)
def plan_night_task(config: PipelineConfig) -> tuple[PipelineConfig, dict, list[str]]:
    """Tonight's config (every prompt of the sources, warm start from last night's draft), the night's plan and
    the lines saying it, which plan_stages_task logs with the run's plan (its first message)."""
    said = []
    with run_log():
        return (*nightly.plan_night(config, log=said.append), said)


@task(name="finish-night", task_run_name="finish-night", cache_policy=NO_CACHE)
def finish_night_task(config: PipelineConfig, plan: dict) -> dict:
    """Record the night in nights.json and promote tonight's export if its tau is not worse."""
    with run_log() as log:
        return nightly.finish_night(config, plan, log=log.info)
