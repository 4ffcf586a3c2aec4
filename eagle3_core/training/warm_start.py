"""Warm start: training continues from an existing EAGLE-3 draft in SGLang's format (ours, SpecForge's, a public
one: config.json + model.safetensors with fc, midlayer, norm, lm_head, d2t, t2d) instead of a fresh init.

The draft vocabulary is part of what the draft learned: lm_head row i scores target token i + d2t[i]. Kept as it
is (train.init_vocab 'keep'), every weight is reused unchanged. Rebuilt from the new data ('rebuild'), each lm_head
row is carried over by the target token it scores, never by its position: a row carried by position would score
another token, and acceptance collapses (SpecForge PR #534). Tokens new to the draft vocab keep their fresh init.
"""
from __future__ import annotations

from pathlib import Path

import torch

from eagle3_core.data.vocab_map import draft_to_target_ids, target_to_draft_ids
from eagle3_core.training.checkpoint import CheckpointError, load_draft
from eagle3_core.training.draft_model import DraftShape, Eagle3Draft

# DraftShape field -> the config field that sets it (what the user changes when they differ)
SHAPE_FIELDS = {
    "aux_layer_ids": "features.aux_layer_ids", "vocab_size": "target.model", "target_hidden_size": "target.model",
    "hidden_size": "target.model", "draft_vocab_size": "draft.draft_vocab_size",
    "num_attention_heads": "draft.num_attention_heads", "num_key_value_heads": "draft.num_key_value_heads",
    "head_dim": "draft.head_dim", "intermediate_size": "draft.intermediate_size", "rope_theta": "draft.rope_theta",
    "rope_scaling": "draft.rope_scaling", "max_position_embeddings": "draft.max_position_embeddings",
    "hidden_act": "target.model", "rms_norm_eps": "target.model",
}


def init_dir(init_from: str | Path) -> Path:
    """The draft directory `train.init_from` names: a draft directory itself (config.json + model.safetensors), or
    an earlier run directory (its draft/export). Raises FileNotFoundError naming what is missing."""
    path = Path(init_from)
    for d in (path, path / "draft" / "export"):
        if (d / "config.json").exists() and (d / "model.safetensors").exists():
            return d
    raise FileNotFoundError(f"train.init_from {path}: neither it nor {path / 'draft' / 'export'} holds a draft "
                            f"(config.json and model.safetensors); give an exported draft directory or a run "
                            f"directory whose train stage finished")


def shape_problems(init: DraftShape, want: DraftShape, where: str, keep_vocab: bool) -> list[tuple[str, str]]:
    """[(config field, message)] for every way the draft at `where` (shape `init`) differs from the draft this
    run builds (`want`, from the target, the config and the feature store); draft_vocab_size only matters when
    the vocab map is kept. Empty when the warm start can load it."""
    problems = []
    for name, field in SHAPE_FIELDS.items():
        if name == "draft_vocab_size" and not keep_vocab:
            continue
        a, b = getattr(init, name), getattr(want, name)
        if a != b:
            fix = ("set train.init_vocab to 'rebuild' to build a new map" if name == "draft_vocab_size" else
                   "extract features at the draft's layers" if name == "aux_layer_ids" else "match the draft")
            problems.append((field, f"the run builds {name} = {b}, the draft {where} has {a}: set {field} to {a} "
                                    f"or {fix}"))
    return problems


def load_init(init_from: str | Path, want: DraftShape, keep_vocab: bool) -> Eagle3Draft:
    """The draft named by `train.init_from` (init_dir), loaded strictly in fp32 and checked against `want`.
    Raises ValueError naming every mismatched field (shape_problems), CheckpointError for a broken directory."""
    path = init_dir(init_from)
    draft = load_draft(path, torch.float32)
    if (problems := shape_problems(draft.shape, want, str(path), keep_vocab)):
        raise ValueError(f"train.init_from {path} does not fit this run:\n"
                         + "\n".join(f"- {field}: {msg}" for field, msg in problems))
    return draft


def carry_lm_head(old_weight: torch.Tensor, old_t2d: torch.Tensor, new_d2t: torch.Tensor,
                  new_weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(lm_head weight [N_new, H], rows carried): row j of the new head is the old head's row of the same target
    token (new target id j + new_d2t[j]; old draft id from old_t2d [V], vocab_map.target_to_draft_ids) where the
    old vocab holds that token, else row j of `new_weight` (the fresh init)."""
    old_of_target = target_to_draft_ids(old_t2d)                          # [V] old draft id or -1
    old_ids = old_of_target[draft_to_target_ids(new_d2t)]                 # [N_new]
    have = old_ids >= 0
    out = new_weight.clone()
    out[have] = old_weight[old_ids[have]].to(out.dtype)
    return out, int(have.sum())


def warm_draft(init: Eagle3Draft, fresh: Eagle3Draft) -> tuple[Eagle3Draft, dict]:
    """`fresh` (built for this run: its vocab map and, when H == H_t, the target's frozen embedding) with the
    weights of `init`: fc, the decoder layer and the norm as they are, lm_head carried by target token id
    (carry_lm_head; every row when the maps are equal), a trainable embedding (H != H_t) from `init`. Returns
    (fresh, {'lm_head_rows_carried', 'lm_head_rows', 'vocab': 'kept' | 'rebuilt'}). Raises CheckpointError if
    the two drafts' dense weights differ in shape."""
    src, dst = init.state_dict(), fresh.state_dict()
    skip = {"lm_head.weight", "d2t", "t2d"} | ({"embed_tokens.weight"} if not
                                               fresh.embed_tokens.weight.requires_grad else set())
    same_map = torch.equal(init.d2t, fresh.d2t) and torch.equal(init.t2d, fresh.t2d)
    with torch.no_grad():
        for name, t in dst.items():
            if name in skip:
                continue
            if src[name].shape != t.shape:
                raise CheckpointError(f"warm start: {name} is {tuple(src[name].shape)} in the draft, "
                                      f"{tuple(t.shape)} in this run")
            t.copy_(src[name])
        head, carried = carry_lm_head(init.lm_head.weight, init.t2d, fresh.d2t, fresh.lm_head.weight)
        fresh.lm_head.weight.copy_(head)
    return fresh, {"lm_head_rows_carried": carried, "lm_head_rows": fresh.shape.draft_vocab_size,
                   "vocab": "kept" if same_map else "rebuilt"}


def init_vocab_map(init_from: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [N], t2d bool [V]) of the draft `train.init_from` names (the vocab stage keeps them)."""
    from safetensors import safe_open
    path = init_dir(init_from) / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        if "d2t" not in f.keys() or "t2d" not in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            raise CheckpointError(f"{path}: no d2t/t2d; the draft's vocab map cannot be kept: set "
                                  f"train.init_vocab to 'rebuild'")
        return f.get_tensor("d2t").long(), f.get_tensor("t2d").bool()
