"""Stage `vocab`: the draft vocab map from loss-masked token counts of the tokenized data."""
from __future__ import annotations

import pyarrow.parquet as pq
import torch
from safetensors.torch import save_file

from ..config import PipelineConfig
from .keys import stage_key, target_config, upstream_manifest
from .layout import RunLayout
from .run_stage import run_stage


def vocab_key(cfg: PipelineConfig) -> str:
    """Inputs key of the vocab stage: the tokenized data and the draft vocab size."""
    return stage_key(upstream_manifest(cfg.run_dir, "tokenized")["inputs_key"], cfg.draft.draft_vocab_size)


def run_vocab(cfg: PipelineConfig, log=print) -> dict:
    """Draft vocab map from loss-masked token counts (vocab/vocab_map.safetensors: d2t, t2d, counts)."""
    from ..target_family import text_config
    from ..vocab_map import build_vocab_map, count_tokens
    run = RunLayout(cfg.run_dir)
    out = run.vocab

    def body() -> dict:
        V = text_config(target_config(cfg)).vocab_size
        rows = pq.read_table(run.tokenized_train).to_pylist()
        counts = count_tokens([torch.tensor(r["input_ids"]) for r in rows],
                              [torch.tensor(r["loss_mask"]) for r in rows], V)
        N = min(cfg.draft.draft_vocab_size, V)
        d2t, t2d = build_vocab_map(counts, N)
        out.mkdir(parents=True, exist_ok=True)
        save_file({"d2t": d2t, "t2d": t2d, "counts": counts}, str(run.vocab_map))
        seen = int((counts > 0).sum())
        coverage = float(counts[t2d].sum() / counts.sum().clamp(min=1))
        log(f"vocab: draft vocab {N} of {V}; {seen} distinct tokens seen; the map covers {coverage:.1%} of them")
        return {"draft_vocab_size": N, "vocab_size": V, "distinct_seen": seen, "coverage": coverage}

    return run_stage(out, vocab_key(cfg), body)
