"""Cache keys of the pipeline's tasks: what makes a result valid, never the run id.

A task's key is its source code plus the inputs key its stage writes into its manifest (eagle3_core.pipeline
.inputs_key: the config fields the stage reads, the upstream data's keys, the target's hash, the code version),
the run directory and the shard id. An equal rerun (any run id) hits the cache; a changed parameter changes the keys
of exactly the stages that read it and of those downstream. Data on disk stays the source of truth: flows pass
`refresh_cache=True` to a task whose output on disk is missing or stale (see flows/py), so a cache hit never
stands for data that is gone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect.cache_policies import TASK_SOURCE, CachePolicy
from prefect.context import TaskRunContext
from prefect.utilities.hashing import hash_objects

from eagle3_core.pipeline import run
from eagle3_core.pipeline.table import adopt


def _task_run_id() -> str | None:
    ctx = TaskRunContext.get()
    return str(ctx.task_run.id) if ctx is not None and ctx.task_run is not None else None


run.scope_id = _task_run_id           # a stage body finds the decision its task run's cache policy adopted


@dataclass
class StageInputs(CachePolicy):
    """Key: the stage's inputs key for the task's `config`, its run directory and its `shard` argument (if any).
    Other arguments (a server URL, shard manifests) are left out: they follow from these. A task takes the flow's
    done decision over (table.adopt: its key and whether it is done, kept for the task's body; a shard task its
    shard's, from the plan: run.decide_shards), so that the task computes its key once and decides once."""

    stage: str = ""

    def compute_key(self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> str | None:
        cfg = inputs["config"]
        shard = inputs.get("shard")
        return hash_objects(self.stage, str(cfg.run_dir), adopt(cfg, self.stage, str(task_ctx.task_run.id), shard),
                            shard)


def stage_cache(stage: str) -> CachePolicy:
    """The cache policy of a task of `stage` (a name of eagle3_core.pipeline.table.STAGES)."""
    return TASK_SOURCE + StageInputs(stage=stage)
