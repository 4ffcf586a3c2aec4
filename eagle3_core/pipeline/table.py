"""The stage table: one row per stage (name, inputs key, the older key formulas it still accepts, upstream stages
from keys.UPSTREAM; its directory is contract.layout's STAGE_DIRS). `inputs_key`, `stage_done` and
`invalidate_stage` read it, and so do the task layer (tasks/cache.py) and docs/architecture.md (checked by
tests/test_architecture.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.layout import STAGE_DIRS
from eagle3_core.pipeline import run as stage_run
from eagle3_core.pipeline.deploy_stage import (
    deploy_llama_cpp_key,
    deploy_llama_cpp_older_keys,
    deploy_sglang_key,
    deploy_sglang_older_keys,
)
from eagle3_core.pipeline.evaluate_stage import evaluate_key, evaluate_older_keys
from eagle3_core.pipeline.features_stage import features_key, store_intact
from eagle3_core.pipeline.generation_stage import generation_intact, generation_stage_key
from eagle3_core.pipeline.keys import UPSTREAM, upstream_keys
from eagle3_core.pipeline.prompts_stage import prompts_intact, prompts_key, prompts_older_keys
from eagle3_core.pipeline.tokenize_stage import tokenize_key
from eagle3_core.pipeline.train_stage import train_key, train_older_keys
from eagle3_core.pipeline.vocab_stage import vocab_key


@dataclass(frozen=True)
class Stage:
    """A row of the stage table. key(cfg, up): the inputs key its manifest holds when it is done, from the config
    and `up`, {upstream stage: its manifest's inputs_key}. older(cfg, up): the keys of older formulas a finished
    run's manifest may hold for the same settings (contract.compat), also done. intact(cfg): the check of outputs
    its manifest's `files` record does not cover (the shards of generation and features), for run.decide."""
    name: str
    key: Callable[[PipelineConfig, dict], str]
    older: Callable[[PipelineConfig, dict], tuple[str, ...]] = lambda cfg, up: ()
    intact: Callable[[PipelineConfig], Callable[[dict], list[str]]] | None = None

    @property
    def upstream(self) -> tuple[str, ...]:
        """The stages whose outputs it reads and whose keys its own names (keys.UPSTREAM)."""
        return UPSTREAM[self.name]

    @property
    def directory(self) -> str:
        """The stage's directory under the run directory (contract.layout.STAGE_DIRS)."""
        return STAGE_DIRS[self.name]


STAGES: dict[str, Stage] = {s.name: s for s in [
    Stage("prompts", prompts_key, prompts_older_keys, prompts_intact),
    Stage("generation", generation_stage_key, intact=generation_intact),
    Stage("tokenize", tokenize_key),
    Stage("features", features_key, intact=store_intact),
    Stage("vocab", vocab_key),
    Stage("train", train_key, train_older_keys),
    Stage("evaluate", evaluate_key, evaluate_older_keys),
    Stage("deploy-llama-cpp", deploy_llama_cpp_key, deploy_llama_cpp_older_keys),
    Stage("deploy-sglang", deploy_sglang_key, deploy_sglang_older_keys),
]}

assert set(STAGES) == set(STAGE_DIRS) == set(UPSTREAM), "every stage has a directory, upstream stages and a row"


def inputs_key(cfg: PipelineConfig, stage: str) -> str:
    """The inputs key stage `stage` (a key of STAGE_DIRS) writes into its manifest: a stage whose manifest holds
    it is done. Reads the upstream stages' manifests by stage name; raises FileNotFoundError naming a missing one."""
    return STAGES[stage].key(cfg, upstream_keys(cfg, stage))


def stage_done(cfg: PipelineConfig, stage: str) -> bool:
    """True if stage `stage` has a manifest under cfg.run_dir for its current inputs (its key, or an older formula
    of it: Stage.older) whose outputs are intact (run.decide). Decides now; a flow asks `done` instead."""
    row = STAGES[stage]
    return stage_run.decide(cfg, stage, row.key, row.older, row.intact).manifest is not None


def done(cfg: PipelineConfig, stage: str) -> dict | None:
    """The flow's one done decision before a task of stage `stage` (run.done: kept for that task's cache policy
    and body): the done manifest, or None."""
    row = STAGES[stage]
    return stage_run.done(cfg, stage, row.key, row.older, row.intact)


def adopt(cfg: PipelineConfig, stage: str, scope: str) -> str:
    """The inputs key the cache policy of task run `scope` hashes: the flow's decision taken over (run.adopt)."""
    row = STAGES[stage]
    return stage_run.adopt(cfg, stage, scope, row.key, row.older, row.intact).key


def invalidate_stage(cfg: PipelineConfig, stage: str) -> None:
    """Forget that stage `stage` is done under cfg.run_dir (run.invalidate), so that its next run recomputes
    everything. Data files stay until they are overwritten."""
    stage_run.invalidate(cfg, stage)
