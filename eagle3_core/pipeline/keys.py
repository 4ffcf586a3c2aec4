"""Inputs keys of the stages, and the target as every stage reads it. A stage whose manifest holds the key of its
current inputs is done (pipeline.run.decide); keys chain: each names its upstream stages' keys.

A key hashes what changes the stage's result and nothing else (docs/architecture.md, "A stage field"): each stage's
key function takes `up`, {upstream stage: its manifest's inputs_key} (upstream_keys: the stages of UPSTREAM, read
by stage name), so that a key is a pure function of the config and those keys (tests/test_keys.py)."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import lru_cache
from pathlib import Path

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.layout import RunLayout
from eagle3_core.contract.manifest import read_manifest, sha256_file, sha256_json
from eagle3_core.pipeline.stage import STAGES, Stage, row_of
from eagle3_core.target.family import resolve_aux_ids
from eagle3_core.target.loading import gguf_path, load_target_config
from eagle3_core.training.warm_start import init_source

CODE_VERSION = "4"  # bump when a stage's output format or semantics change



class Upstream(Mapping):
    """{stage: the stages whose outputs it reads and whose inputs keys its own key names}, read from the stage
    table's rows (Stage.upstream; the rows registered: pipeline.table registers the built-in stages)."""

    def __getitem__(self, stage: str) -> tuple[str, ...]:
        return row_of(stage).upstream

    def __iter__(self) -> Iterator[str]:
        return iter(STAGES)

    def __len__(self) -> int:
        return len(STAGES)


UPSTREAM = Upstream()


def stage_key(*parts) -> str:
    """A stage's inputs key: sha256 of CODE_VERSION and `parts` (pydantic models as their JSON dump)."""
    return sha256_json([CODE_VERSION, *[p.model_dump(mode="json") if hasattr(p, "model_dump") else p
                                        for p in parts]])


def upstream_manifest(run_dir: Path, stage: str) -> dict:
    """The manifest of stage `stage` (a name of the stage table: 'tokenize', 'train', ...) under `run_dir`.
    Raises FileNotFoundError naming the stage and the file when that stage has not run."""
    path = RunLayout(run_dir).manifest(stage)
    if (manifest := read_manifest(path)) is None:
        raise FileNotFoundError(f"{path} missing: run the {stage} stage first")
    return manifest


def upstream_keys(cfg: PipelineConfig, stage: Stage | str) -> dict[str, str]:
    """{upstream stage: the inputs_key its manifest holds} for each upstream stage of `stage` (its row, or a
    registered stage's name; Stage.upstream): the `up` of its key function. Raises FileNotFoundError naming an
    upstream stage that has not run."""
    return {u: upstream_manifest(cfg.run_dir, u)["inputs_key"] for u in row_of(stage).upstream}


def target_key(cfg: PipelineConfig) -> dict:
    """What identifies the target in a key: its config, and the sha256 of its GGUF file if it is one."""
    gguf = gguf_path(cfg.target)
    return {"target": cfg.target.model_dump(), "gguf_sha256": sha256_unchanged_file(gguf) if gguf else None}


@lru_cache(maxsize=16)
def _sha256_cached(path: Path, size: int, mtime_ns: int) -> str:
    return sha256_file(path)


def sha256_unchanged_file(path: Path) -> str:
    """sha256 of a large file that rarely changes (the target, a warm-start draft), hashed again only when its
    size or mtime does."""
    st = path.stat()
    return _sha256_cached(path, st.st_size, st.st_mtime_ns)


def init_key(cfg: PipelineConfig) -> dict | None:
    """What identifies the warm-start draft in a key: its directory and the sha256 of its weights (model.safetensors,
    or a SpecForge checkpoint's training_state.pt; hashed again only when their size or mtime changes); None
    without train.init_from."""
    if cfg.train.init_from is None:
        return None
    src = init_source(cfg.train.init_from)
    return {"dir": str(src.dir), "sha256": sha256_unchanged_file(src.weights)}


def aux_ids(cfg: PipelineConfig, num_layers: int) -> list[int]:
    """features.aux_layer_ids resolved and checked for an L-layer target (target_family.resolve_aux_ids)."""
    return resolve_aux_ids(cfg.features.aux_layer_ids, num_layers)


def target_config(cfg: PipelineConfig):
    """The target's config as every stage reads it (revision, trust_remote_code; no weights)."""
    return load_target_config(cfg.target)
