"""The stage table: one row per stage (name, directory under the run directory, inputs key, upstream stages).
`STAGE_DIRS`, `inputs_key`, `stage_done` and `invalidate_stage` read it, and so do the task layer (tasks/cache.py)
and docs/architecture.md (checked by tests/test_architecture.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..config import PipelineConfig
from ..manifest import cached_manifest
from .deploy import deploy_llama_cpp_key, deploy_sglang_key
from .evaluate import evaluate_key
from .features import features_key
from .generation import generation_stage_key
from .prompts import prompts_key
from .tokenize import tokenize_key
from .train import train_key
from .vocab import vocab_key


@dataclass(frozen=True)
class Stage:
    """A row of the stage table. key(cfg): the inputs key its manifest holds when it is done (needs the upstream
    manifests). upstream: the stages whose outputs it reads."""
    name: str
    directory: str
    key: Callable[[PipelineConfig], str]
    upstream: tuple[str, ...]


STAGES: dict[str, Stage] = {s.name: s for s in [
    Stage("prompts", "prompts", prompts_key, ()),
    Stage("generation", "generations", generation_stage_key, ("prompts",)),
    Stage("tokenize", "tokenized", tokenize_key, ("generation",)),
    Stage("features", "features", features_key, ("tokenize",)),
    Stage("vocab", "vocab", vocab_key, ("tokenize",)),
    Stage("train", "draft", train_key, ("features", "vocab")),
    Stage("evaluate", "eval", evaluate_key, ("train", "prompts")),
    Stage("deploy-llama-cpp", "deploy_llama_cpp", deploy_llama_cpp_key, ("train", "prompts")),
    Stage("deploy-sglang", "deploy_sglang", deploy_sglang_key, ("train",)),
]}

STAGE_DIRS = {name: s.directory for name, s in STAGES.items()}


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
