"""Stage `vocab`: the draft vocab map from loss-masked token counts of the tokenized data."""
from __future__ import annotations

import pyarrow.parquet as pq
import torch
from safetensors.torch import save_file

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.layout import RunLayout
from eagle3_core.data.vocab_map import build_vocab_map, check_vocab_map, count_tokens, coverage_by_source
from eagle3_core.pipeline import run as stage_run
from eagle3_core.pipeline.keys import init_key, stage_key, target_config, upstream_keys, upstream_manifest
from eagle3_core.pipeline.stage import Stage
from eagle3_core.target.family import text_config
from eagle3_core.training.warm_start import init_dir, init_vocab_map


def kept_init_vocab(cfg: PipelineConfig) -> bool:
    """True when the vocab stage keeps the warm-start draft's map (train.init_from with init_vocab 'keep')."""
    return cfg.train.init_from is not None and cfg.train.init_vocab == "keep"


def vocab_key(cfg: PipelineConfig, up: dict | None = None) -> str:
    """Inputs key of the vocab stage: the tokenized data (`up`: {'tokenize': its key}; default: read from its
    manifest) and the draft vocab size, and the warm-start draft when its map is kept. (The marker tokens kept in
    the map are not in it: end of turn, think and tool-call markers are among the most frequent supervised tokens of
    any run that has them, so a finished map keeps its key; the manifest names any marker a map lacks,
    `markers_missing`.)"""
    up = upstream_keys(cfg, ROW) if up is None else up
    return stage_key(up["tokenize"], cfg.draft.draft_vocab_size, *([init_key(cfg)] if kept_init_vocab(cfg) else []))


def run_vocab(cfg: PipelineConfig, log=print) -> dict:
    """Draft vocab map from loss-masked token counts (vocab/vocab_map.safetensors: d2t, t2d, counts)."""
    run = RunLayout(cfg.run_dir)
    out = run.vocab

    def body() -> dict:
        V = text_config(target_config(cfg)).vocab_size
        rows = pq.read_table(run.tokenized_train).to_pylist()
        ids, masks = [torch.tensor(r["input_ids"]) for r in rows], [torch.tensor(r["loss_mask"]) for r in rows]
        counts = count_tokens(ids, masks, V)
        markers = upstream_manifest(cfg.run_dir, "tokenize").get("marker_tokens") or {}
        always = sorted(t for t in markers.values() if t < V)
        N = min(cfg.draft.draft_vocab_size, V)
        if kept_init_vocab(cfg):
            d2t, t2d = init_vocab_map(cfg.train.init_from)
            where = str(init_dir(cfg.train.init_from))
            check_vocab_map(d2t, t2d, where)
            if t2d.numel() != V or d2t.numel() != N:
                raise ValueError(f"train.init_from {where}: its vocab map has N = {d2t.numel()} of V = "
                                 f"{t2d.numel()}, this run N = {N} of V = {V}: set draft.draft_vocab_size to "
                                 f"{d2t.numel()}, or train.init_vocab to 'rebuild'")
            log(f"vocab: kept the map of the warm-start draft {where} (train.init_vocab 'keep')")
        else:
            d2t, t2d = build_vocab_map(counts, N, always)
        out.mkdir(parents=True, exist_ok=True)
        save_file({"d2t": d2t, "t2d": t2d, "counts": counts}, str(run.vocab_map))
        seen = int((counts > 0).sum())
        coverage = float(counts[t2d].sum() / counts.sum().clamp(min=1))
        per_source = coverage_by_source(ids, masks, [r.get("source") or "?" for r in rows], t2d)
        missing = {k: t for k, t in markers.items() if t < V and not bool(t2d[t])}
        log(f"vocab: draft vocab {N} of {V}; {seen} distinct tokens seen; the map covers {coverage:.1%} of the "
            f"supervised tokens (" + ", ".join(f"{s} {c['coverage']:.1%}" for s, c in per_source.items()) + ")"
            + (f"; marker tokens not in the map: {missing}" if missing else ""))
        return {"draft_vocab_size": N, "vocab_size": V, "distinct_seen": seen, "coverage": coverage,
                "coverage_per_source": per_source, "always_in_vocab": markers, "markers_missing": missing,
                "from": str(init_dir(cfg.train.init_from)) if kept_init_vocab(cfg) else "counts"}

    return stage_run.run(stage_run.decision(cfg, ROW), body, log=log)


ROW = Stage("vocab", vocab_key, run_vocab, upstream=("tokenize",), outputs=("vocab_map.safetensors",),
            summary=("draft_vocab_size", "coverage"), timeout_h=6)
