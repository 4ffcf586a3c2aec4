"""The draft's geometry for a target family (its recipe): attention heads, head size, MLP width, rope and
positions, copied from Llama-style targets and chosen for MLA targets, plus the problems a geometry would cause.

Legend: H_t target hidden, V target vocab, N draft vocab, hd head dim. The target side (text config, family, rope)
is read through eagle3_core.target.family.
"""
from __future__ import annotations

from eagle3_core.target.family import family, rope_type, target_rope, text_config, value
from eagle3_core.training.draft_model import DraftShape

# rope types `draft_model.rope_cos_sin` computes (and SGLang's Llama draft runs with the same formula)
SUPPORTED_ROPE_TYPES = ("default", "llama3")
# Kimi-K2.5 recipe (SpecForge configs/kimi-k25-eagle3.json, commit 3f9b5fca, 2026-02-28): rope_theta 1e6, no rope
# scaling, 131072 positions; heads 64 = the target's, head_dim 128 = the target's v_head_dim, 64 KV heads (no GQA),
# intermediate 18432 = the target's dense intermediate_size. AQ-MedAI/Kimi-K25-eagle3 uses the same heads with
# 262144 positions (the target's context), which SGLang needs when serving the full context.
MLA_ROPE_THETA = 1_000_000.0
MLA_MIN_POSITIONS = 131_072
GEOMETRY_FIELDS = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "rope_theta",
                   "rope_scaling", "max_position_embeddings")


def _llama_recipe(t) -> dict:
    nh, H_t = value(t, "num_attention_heads"), value(t, "hidden_size")
    hd = value(t, "head_dim")
    if hd is None:
        if H_t % nh:
            raise ValueError(f"target hidden {H_t} is not divisible by {nh} heads and the config gives no "
                             f"head_dim: set draft.head_dim")
        hd = H_t // nh
    theta, scaling = target_rope(t)
    return {"num_attention_heads": nh, "num_key_value_heads": value(t, "num_key_value_heads") or nh,
            "head_dim": hd, "intermediate_size": value(t, "intermediate_size"), "rope_theta": theta,
            "rope_scaling": scaling, "max_position_embeddings": value(t, "max_position_embeddings")}


def _mla_recipe(t) -> dict:
    """Llama-style geometry for an MLA target: the Kimi-K2.5 recipe above (MLA_* constants), expressed through the
    target's own numbers so that it reproduces SpecForge's Kimi-K2.5 draft on Kimi-K2.5: heads and KV heads =
    num_attention_heads, head_dim = v_head_dim, intermediate = intermediate_size, plain RoPE with theta 1e6,
    positions max(131072, target context) (SGLang refuses a draft with fewer positions than the target)."""
    nh = value(t, "num_attention_heads")
    return {"num_attention_heads": nh, "num_key_value_heads": nh,
            "head_dim": value(t, "v_head_dim") or value(t, "hidden_size") // nh,
            "intermediate_size": value(t, "intermediate_size"), "rope_theta": MLA_ROPE_THETA, "rope_scaling": None,
            "max_position_embeddings": max(MLA_MIN_POSITIONS, value(t, "max_position_embeddings") or 0)}


def draft_geometry(config, overrides: dict | None = None) -> dict:
    """The draft's attention/MLP/rope geometry for a target config: the family recipe, then every non-None entry
    of `overrides` (DraftConfig.geometry(); rope_scaling 'none' means plain RoPE). Keys: GEOMETRY_FIELDS."""
    t = text_config(config)
    geom = _mla_recipe(t) if family(t) == "mla" else _llama_recipe(t)
    for k, v in (overrides or {}).items():
        if k not in GEOMETRY_FIELDS:
            raise ValueError(f"draft.{k} is not a draft geometry field; choose from {list(GEOMETRY_FIELDS)}")
        if v is not None:
            geom[k] = None if (k == "rope_scaling" and v == "none") else v
    return geom


def geometry_problems(geom: dict, config) -> list[tuple[str, str]]:
    """[(field, message)] for a geometry the draft cannot run or SGLang would refuse, against the target config."""
    problems = []
    t = text_config(config)
    if rope_type(geom["rope_scaling"]) not in SUPPORTED_ROPE_TYPES:
        src = "copied from the target" if family(t) == "llama" else "set"
        problems.append(("draft.rope_scaling", f"rope type {rope_type(geom['rope_scaling'])!r} ({src}: "
                         f"{geom['rope_scaling']}) is not one the draft runs ({list(SUPPORTED_ROPE_TYPES)}); set "
                         f"draft.rope_scaling to 'none' (plain RoPE, theta {geom['rope_theta']:g}) or a llama3 "
                         f"scaling dict"))
    ctx = value(t, "max_position_embeddings")
    if ctx is not None and geom["max_position_embeddings"] < ctx:
        problems.append(("draft.max_position_embeddings", f"{geom['max_position_embeddings']} is below the "
                         f"target's context {ctx}: SGLang refuses to start such a draft; set it to {ctx} or more "
                         f"(or leave it None)"))
    for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
        if not isinstance(geom[k], int) or geom[k] < 1:
            problems.append((f"draft.{k}", f"is {geom[k]!r}; the target config does not give it: set draft.{k}"))
    if not problems and geom["num_attention_heads"] % geom["num_key_value_heads"]:
        problems.append(("draft.num_key_value_heads", f"{geom['num_key_value_heads']} does not divide "
                         f"{geom['num_attention_heads']} heads; choose a divisor"))
    return problems


def draft_shape(config, draft_vocab_size: int, aux_layer_ids: list[int], hidden_size: int | None = None,
                overrides: dict | None = None, capacity: dict | None = None):
    """DraftShape for a target config (composite configs unwrapped): H_t, V, norms from the text model, geometry
    from `draft_geometry`, N capped at V, the capacity options (DraftConfig.capacity(); None: EAGLE-3's one layer).
    Raises ValueError listing every geometry problem (field and fix)."""
    t = text_config(config)
    geom = draft_geometry(t, overrides)
    problems = geometry_problems(geom, t)
    if problems:
        raise ValueError("the draft geometry does not work for this target:\n"
                         + "\n".join(f"- {f}: {m}" for f, m in problems))
    H_t, V = value(t, "hidden_size"), value(t, "vocab_size")
    return DraftShape(hidden_size=hidden_size or H_t, target_hidden_size=H_t, vocab_size=V,
                      draft_vocab_size=min(draft_vocab_size, V), rms_norm_eps=value(t, "rms_norm_eps", 1e-6),
                      hidden_act="silu", aux_layer_ids=list(aux_layer_ids), **geom, **(capacity or {}))
