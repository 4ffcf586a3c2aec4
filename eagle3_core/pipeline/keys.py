"""Inputs keys of the stages, and the target as every stage reads it. A stage whose manifest holds the key of its
current inputs is done (manifest.cached_manifest); keys chain: each names its upstream stages' keys."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.manifest import sha256_file, sha256_json

CODE_VERSION = "4"  # bump when a stage's output format or semantics change


def stage_key(*parts) -> str:
    """A stage's inputs key: sha256 of CODE_VERSION and `parts` (pydantic models as their JSON dump)."""
    return sha256_json([CODE_VERSION, *[p.model_dump(mode="json") if hasattr(p, "model_dump") else p
                                        for p in parts]])


def upstream_manifest(run_dir: Path, stage: str) -> dict:
    """The manifest of the stage written in directory `stage` of `run_dir` (e.g. 'tokenized', 'draft'). Raises
    FileNotFoundError naming it when that stage has not run."""
    path = run_dir / stage / "manifest.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: run the {stage} stage first")
    return json.loads(path.read_text())


def target_key(cfg: PipelineConfig) -> dict:
    """What identifies the target in a key: its config, and the sha256 of its GGUF file if it is one."""
    from eagle3_core.target.loading import gguf_path
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


def aux_ids(cfg: PipelineConfig, num_layers: int) -> list[int]:
    """features.aux_layer_ids resolved and checked for an L-layer target (target_family.resolve_aux_ids)."""
    from eagle3_core.target.family import resolve_aux_ids
    return resolve_aux_ids(cfg.features.aux_layer_ids, num_layers)


def target_config(cfg: PipelineConfig):
    """The target's config as every stage reads it (revision, trust_remote_code; no weights)."""
    from eagle3_core.target.loading import load_target_config
    return load_target_config(cfg.target)
