"""The stage table: the rows of the pipeline's stages in order (pipeline.stage.Stage, one per stage module: each
module's `ROW`), `STAGES`, the only table. The done decision (pipeline.run), the key upstreams (keys.UPSTREAM),
the task layer (tasks/stage_tasks.py, tasks/cache.py, tasks/control.py), the summary lines, the report and
docs/architecture.md's stage table (checked by tests/test_architecture.py) read it; `inputs_key`, `stage_done`,
`done`, `adopt` and `invalidate_stage` answer by stage name."""
from __future__ import annotations

from eagle3_core.config import PipelineConfig
from eagle3_core.pipeline import (
    deploy_stage,
    evaluate_stage,
    features_stage,
    generation_stage,
    prompts_stage,
    tokenize_stage,
    train_stage,
    vocab_stage,
)
from eagle3_core.pipeline import run as stage_run
from eagle3_core.pipeline.keys import upstream_keys
from eagle3_core.pipeline.stage import STAGES, Stage, register, row_of, unregister  # noqa: F401 (for callers)

for _row in (prompts_stage.ROW, generation_stage.ROW, tokenize_stage.ROW, features_stage.ROW, vocab_stage.ROW,
             train_stage.ROW, evaluate_stage.ROW, deploy_stage.LLAMA_CPP_ROW, deploy_stage.SGLANG_ROW):
    register(_row)


def inputs_key(cfg: PipelineConfig, stage: str) -> str:
    """The inputs key stage `stage` (a name of STAGES) writes into its manifest: a stage whose manifest holds it
    is done. Reads the upstream stages' manifests by stage name; raises FileNotFoundError naming a missing one."""
    row = row_of(stage)
    return row.key(cfg, upstream_keys(cfg, row))


def stage_done(cfg: PipelineConfig, stage: str) -> bool:
    """True if stage `stage` has a manifest under cfg.run_dir for its current inputs (its key, or an older formula
    of it: Stage.older) whose outputs are intact (run.decide). Decides now; a flow asks `done` instead."""
    return stage_run.decide(cfg, stage).manifest is not None


def done(cfg: PipelineConfig, stage: str) -> dict | None:
    """The flow's one done decision before a task of stage `stage` (run.done: kept for that task's cache policy
    and body): the done manifest, or None."""
    return stage_run.done(cfg, stage)


def adopt(cfg: PipelineConfig, stage: str, scope: str, shard: int | None = None) -> str:
    """The inputs key the cache policy of task run `scope` (of shard `shard`, for a shard task) hashes: the flow's
    decision taken over (run.adopt)."""
    return stage_run.adopt(cfg, stage, scope, shard).key


def plan_shards(cfg: PipelineConfig, stage: str) -> dict:
    """The plan of sharded stage `stage`: its done decision for every shard, kept for the shard tasks
    (run.decide_shards); {'shards', 'done', ...} as its Stage.shards.status says."""
    return stage_run.decide_shards(cfg, stage)


def invalidate_stage(cfg: PipelineConfig, stage: str) -> None:
    """Forget that stage `stage` is done under cfg.run_dir (run.invalidate), so that its next run recomputes
    everything. Data files stay until they are overwritten."""
    stage_run.invalidate(cfg, stage)
