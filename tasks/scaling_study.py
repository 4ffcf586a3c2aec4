"""Tasks of the scaling-study flow (flows/scaling_study.py): the sizes to train, one draft per size, the fit."""
from __future__ import annotations

import base64
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_image_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from eagle3_core.config import PipelineConfig
from eagle3_core.studies import scaling_study as study
from tasks.artifacts import run_key
from tasks.logs import run_log
from tasks.retry import RETRY_OPTIONS, retry_if_transient


@task(name="scaling-sizes", cache_policy=NO_CACHE)
def sizes_task(config: PipelineConfig, fractions: list[float]) -> list[int]:
    """The training-set sizes of the study: `fractions` of the run's training samples (scaling_study.study_sizes)."""
    sizes = study.study_sizes(config, fractions)
    get_run_logger().info("scaling study: sizes %s", sizes)
    return sizes


# the size's manifest on disk (keyed by its inputs) is the cache: an equal rerun returns it at once
@task(name="scaling-size", task_run_name="scaling-size-{n}", cache_policy=NO_CACHE, tags=["gpu"],
      retry_condition_fn=retry_if_transient, **RETRY_OPTIONS)
def size_task(config: PipelineConfig, n: int, seed: int) -> dict:
    """Train on `n` samples and measure tau (scaling_study.train_and_measure)."""
    with run_log() as log:
        return study.train_and_measure(config, n, seed, log=log.info)


@task(name="scaling-finish", cache_policy=NO_CACHE)
def finish_task(config: PipelineConfig, sizes: list[dict], extrapolate_to: list[int]) -> dict:
    """Fit the trend, write the plot and publish table, image and Markdown artifacts."""
    res = study.finish_study(config, sizes, extrapolate_to)
    create_table_artifact([{"samples": z["samples"], "tokens": z["tokens"], "tau": round(z["tau"], 3),
                            "tau_ci95": f"{z['tau_ci95'][0]:.2f}-{z['tau_ci95'][1]:.2f}",
                            "tau_sim": round(z["tau_sim"], 3), "acc_0": round(z["acc_k"][0], 3)}
                           for z in res["sizes"]], key=run_key(config.run_dir, "scaling-study"),
                          description="tau per training-set size")
    url = "data:image/png;base64," + base64.b64encode(Path(res["plot"]).read_bytes()).decode()
    create_image_artifact(url, key=run_key(config.run_dir, "scaling-study-plot"),
                          description="tau and acc_k against training samples")
    create_markdown_artifact(res["markdown"], key=run_key(config.run_dir, "scaling-study-summary"),
                             description="scaling study")
    return {k: v for k, v in res.items() if k != "markdown"}
