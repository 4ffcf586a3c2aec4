"""What training starts from, as the train stage and the evaluation of an untrained draft both build it: the draft's
shape (target config, family recipe, cfg.draft's geometry), and the fresh (or warm-started) draft with the target's
embedding and lm_head read from the feature store and the run's vocab map."""
from __future__ import annotations

from safetensors.torch import load_file

from eagle3_core.config import PipelineConfig, default_aux_layer_ids
from eagle3_core.contract.layout import RunLayout
from eagle3_core.contract.manifest import read_manifest
from eagle3_core.features.reader import load_head
from eagle3_core.target.family import num_layers, resolve_aux_ids, sglang_rule
from eagle3_core.target.loading import load_target_config
from eagle3_core.training.draft_geometry import draft_shape as family_draft_shape
from eagle3_core.training.setup import build_draft
from eagle3_core.training.warm_start import load_init, warm_draft


def draft_shape(cfg: PipelineConfig):
    """The draft's shape: target config (composite configs unwrapped), family recipe, cfg.draft's geometry."""
    tcfg = load_target_config(cfg.target)
    ids = resolve_aux_ids(cfg.features.aux_layer_ids, num_layers(tcfg))
    return family_draft_shape(tcfg, cfg.draft.draft_vocab_size, ids, overrides=cfg.draft.geometry(),
                              capacity=cfg.draft.capacity())


def init_default_aux_ids(cfg: PipelineConfig) -> list[int] | None:
    """The aux layer ids a warm-start draft whose config names none was trained on: those SGLang captures for such
    a draft on this target (config.default_aux_layer_ids); None for a target too shallow for them."""
    try:
        return default_aux_layer_ids(num_layers(load_target_config(cfg.target)))
    except ValueError:
        return None


def fresh_draft(cfg: PipelineConfig, log=print):
    """(the draft training starts from, the target's lm_head): the draft built from draft_shape with the target's
    embedding (features/head) and the vocab map (vocab/), seeded by draft.seed; with train.init_from, carrying the
    weights of that draft (warm_start.warm_draft: lm_head rows by target token id). Raises ValueError naming each
    field in which the warm-start draft differs from this run (shape, aux layer ids of the feature store)."""
    vocab = load_file(str(RunLayout(cfg.run_dir).vocab_map))
    emb, lm = load_head(RunLayout(cfg.run_dir).features)
    shape = draft_shape(cfg)
    store_ids = (read_manifest(RunLayout(cfg.run_dir).manifest("features")) or {}).get("aux_layer_ids")
    if store_ids is not None and store_ids != shape.aux_layer_ids:
        raise ValueError(f"features.aux_layer_ids resolves to {shape.aux_layer_ids} but the feature store "
                         f"{RunLayout(cfg.run_dir).features} holds layers {store_ids}: rerun the features stage")
    draft = build_draft(shape, emb, vocab["d2t"], vocab["t2d"], cfg.draft.seed)
    if cfg.train.init_from is not None:
        init = load_init(cfg.train.init_from, shape, keep_vocab=cfg.train.init_vocab == "keep",
                         default_aux_ids=init_default_aux_ids(cfg), rule=sglang_rule(load_target_config(cfg.target)))
        draft, info = warm_draft(init, draft)
        log(f"train: warm start from {cfg.train.init_from}: vocab map {info['vocab']}, "
            f"{info['lm_head_rows_carried']} of {info['lm_head_rows']} lm_head rows carried by target token id"
            + ("" if init.shape.max_position_embeddings == shape.max_position_embeddings else
               f"; its {init.shape.max_position_embeddings} positions become {shape.max_position_embeddings} "
               f"(plain RoPE: no weight depends on them)"))
    return draft, lm
