"""The stage table: one row per stage (name, inputs key, upstream stages; its directory is contract.layout's
STAGE_DIRS). `inputs_key`, `stage_done` and `invalidate_stage` read it, and so do the task layer (tasks/cache.py)
and docs/architecture.md (checked by tests/test_architecture.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.layout import STAGE_DIRS
from eagle3_core.contract.manifest import cached_manifest
from eagle3_core.pipeline.deploy_stage import deploy_llama_cpp_key, deploy_sglang_key
from eagle3_core.pipeline.evaluate_stage import evaluate_key
from eagle3_core.pipeline.features_stage import features_key
from eagle3_core.pipeline.generation_stage import generation_stage_key
from eagle3_core.pipeline.prompts_stage import prompts_key
from eagle3_core.pipeline.tokenize_stage import tokenize_key
from eagle3_core.pipeline.train_stage import train_key
from eagle3_core.pipeline.vocab_stage import vocab_key


@dataclass(frozen=True)
class Stage:
    """A row of the stage table. key(cfg): the inputs key its manifest holds when it is done (needs the upstream
    manifests). upstream: the stages whose outputs it reads."""
    name: str
    key: Callable[[PipelineConfig], str]
    upstream: tuple[str, ...]

    @property
    def directory(self) -> str:
        """The stage's directory under the run directory (contract.layout.STAGE_DIRS)."""
        return STAGE_DIRS[self.name]


STAGES: dict[str, Stage] = {s.name: s for s in [
    Stage("prompts", prompts_key, ()),
    Stage("generation", generation_stage_key, ("prompts",)),
    Stage("tokenize", tokenize_key, ("generation",)),
    Stage("features", features_key, ("tokenize",)),
    Stage("vocab", vocab_key, ("tokenize",)),
    Stage("train", train_key, ("features", "vocab")),
    Stage("evaluate", evaluate_key, ("train", "prompts")),
    Stage("deploy-llama-cpp", deploy_llama_cpp_key, ("train", "prompts")),
    Stage("deploy-sglang", deploy_sglang_key, ("train",)),
]}

assert set(STAGES) == set(STAGE_DIRS), "every stage has a directory in contract.layout.STAGE_DIRS and a row here"


def inputs_key(cfg: PipelineConfig, stage: str) -> str:
    """The inputs key stage `stage` (a key of STAGE_DIRS) writes into its manifest: a stage whose manifest holds
    it is done. Needs the upstream stages' manifests; raises FileNotFoundError naming a missing one."""
    return STAGES[stage].key(cfg)


def stage_done(cfg: PipelineConfig, stage: str) -> bool:
    """True if stage `stage` has a manifest for its current inputs under cfg.run_dir."""
    return cached_manifest(cfg.run_dir / STAGE_DIRS[stage] / "manifest.json", inputs_key(cfg, stage)) is not None


def invalidate_stage(cfg: PipelineConfig, stage: str) -> None:
    """Forget that stage `stage` is done under cfg.run_dir (its manifest and its shards' sidecars), so that its
    next run recomputes everything. Data files stay until they are overwritten."""
    out = cfg.run_dir / STAGE_DIRS[stage]
    for path in [out / "manifest.json", out / "head.json", *out.glob("shard_*.json")]:
        path.unlink(missing_ok=True)
