"""Target families, read one way everywhere: the text config of a composite target, its aux layer ids, and the
draft geometry each family gets (its recipe).

Legend: L target decoder layers, H_t target hidden, V target vocab, N draft vocab, hd head dim.

Every stage reads the target's config through `target.load_target_config` (trust_remote_code and revision passed)
and then `text_config` here: a vision-language wrapper such as transformers' `Kimi_K25Config` keeps its DeepSeek-V3
text model under `text_config`, and every number the draft needs (L, H_t, V, heads, rope, context) is the text
model's. Families:
- 'llama': Llama, Qwen2/3, Qwen3-MoE, GPT-OSS, ... (grouped-query attention with a head_dim the draft can copy):
  the draft copies the target's attention geometry, MLP width, rope and context, as before.
- 'mla': DeepSeek-V2/V3, Kimi-K2/K2.5 (multi-head latent attention). An MLA head has no single Llama head size:
  transformers' `DeepseekV3Config.head_dim` is `qk_rope_head_dim` (64), the RoPE slice of a 192-wide q/k head,
  and the target's yarn rope belongs to that slice. The draft is a Llama-style layer, so it gets a Llama geometry
  instead (see `_mla_recipe`).
"""
from __future__ import annotations

from .config import default_aux_layer_ids

MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
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


def text_config(config):
    """The text model's config of a target config: `config.text_config` of a composite (vision-language) config
    such as `Kimi_K25Config`, the config itself otherwise. Also takes a dict (a config.json) the same way."""
    if isinstance(config, dict):
        return config.get("text_config") or config
    if getattr(config, "text_config", None) is not None and hasattr(config, "get_text_config"):
        return config.get_text_config()
    return config


def value(config, name: str, default=None):
    """Attribute `name` of a (text) config or config dict, `default` when absent."""
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def num_layers(config) -> int:
    """L, the decoder layers of the target's text model. Raises ValueError if the config names none."""
    L = value(text_config(config), "num_hidden_layers")
    if L is None:
        raise ValueError(f"target config {type(config).__name__} has no num_hidden_layers (nor a text_config "
                         f"with one): set target.model to a decoder-only or vision-language causal LM")
    return int(L)


def family(config) -> str:
    """'mla' for DeepSeek-V2/V3 and Kimi-K2 text models (multi-head latent attention), 'llama' otherwise."""
    t = text_config(config)
    if value(t, "model_type") in MLA_MODEL_TYPES or value(t, "kv_lora_rank") is not None:
        return "mla"
    return "llama"


def resolve_aux_ids(ids: list[int] | None, L: int, field: str = "features.aux_layer_ids") -> list[int]:
    """The aux layer ids (outputs of 0-based decoder layers, REFERENCE.md section 1) for a target with L layers:
    `ids`, or `default_aux_layer_ids(L)` when None, checked once here.

    Refused (ValueError naming `field` and the fix): not 3 ids, duplicates, unsorted (SGLang and vLLM concatenate
    the captured states in ascending layer order, so fc would see them in another order than it was trained on),
    ids outside [0, L-2]: SGLang captures the *input* of layer id+1 (`models/deepseek_v2.py` and `llama.py`
    `set_eagle3_layers_to_capture`), so the last layer's output L-1 is never captured.
    """
    if ids is None:
        return default_aux_layer_ids(L)
    ids = list(ids)
    if len(ids) != 3:
        raise ValueError(f"{field} = {ids}: EAGLE-3 fuses exactly 3 layers; give 3 distinct ids in [0, {L - 2}]")
    if len(set(ids)) != 3:
        raise ValueError(f"{field} = {ids} repeats a layer; give 3 distinct ids in [0, {L - 2}]")
    if ids != sorted(ids):
        raise ValueError(f"{field} = {ids} is not ascending: SGLang and vLLM concatenate the captured layers in "
                         f"ascending order, so fc would be trained on another order than it is served with; "
                         f"write {sorted(ids)}")
    bad = [i for i in ids if not 0 <= i <= L - 2]
    if bad:
        raise ValueError(f"{field} = {ids}: {bad} outside [0, {L - 2}] for a target with {L} decoder layers (ids "
                         f"are layer outputs; SGLang captures the input of layer id+1, so {L - 1}, the last "
                         f"layer's output, is never captured); use ids in [0, {L - 2}] or None for the default "
                         f"{default_aux_layer_ids(L) if L >= 7 else '(needs 7 layers)'}")
    return ids


def engine_readings(ids: list[int]) -> dict[str, dict]:
    """How each engine reads the export's ids (REFERENCE.md section 2b): the key it reads and the layers whose
    *input* it captures. Our ids are layer outputs; the export writes them nested for SGLang and, +1, top-level."""
    inputs = [i + 1 for i in ids]
    sglang = {"key": "eagle_config.eagle_aux_hidden_state_layer_ids", "value": list(ids), "captures_inputs_of": inputs}
    if ids and ids[0] != 1:
        # REFERENCE.md 2b: a newer SGLang change (PR #25454) adds the +1 only when the first id is 1
        sglang["note"] = (f"SGLang releases with PR #25454 read ids not starting at 1 as layer inputs and would "
                          f"capture {list(ids)}: check the served SGLang's set_eagle3_layers_to_capture")
    return {
        "sglang": sglang,
        "vllm": {"key": "eagle_aux_hidden_state_layer_ids (top level)", "value": inputs,
                 "captures_inputs_of": inputs},
        "llama.cpp": {"key": "eagle_aux_hidden_state_layer_ids (top level, convert_hf_to_gguf.py)",
                      "value": inputs, "captures_inputs_of": inputs},
    }


def target_rope(config) -> tuple[float, dict | None]:
    """(rope_theta, rope scaling dict without rope_theta, or None for plain RoPE) of a (text) config, from the
    transformers 5 `rope_parameters` or the older `rope_theta` / `rope_scaling` attributes."""
    t = text_config(config)
    params = value(t, "rope_parameters") or {}
    theta = value(t, "rope_theta") or params.get("rope_theta") or 10000.0
    scaling = value(t, "rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        if scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
    return float(theta), scaling


def rope_type(scaling: dict | None) -> str:
    return "default" if not scaling else str(scaling.get("rope_type", scaling.get("type", "default")))


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
                overrides: dict | None = None):
    """DraftShape for a target config (composite configs unwrapped): H_t, V, norms from the text model, geometry
    from `draft_geometry`, N capped at V. Raises ValueError listing every geometry problem (field and fix)."""
    from .draft_model import DraftShape
    t = text_config(config)
    geom = draft_geometry(t, overrides)
    problems = geometry_problems(geom, t)
    if problems:
        raise ValueError("the draft geometry does not work for this target:\n"
                         + "\n".join(f"- {f}: {m}" for f, m in problems))
    H_t, V = value(t, "hidden_size"), value(t, "vocab_size")
    return DraftShape(hidden_size=hidden_size or H_t, target_hidden_size=H_t, vocab_size=V,
                      draft_vocab_size=min(draft_vocab_size, V), rms_norm_eps=value(t, "rms_norm_eps", 1e-6),
                      hidden_act="silu", aux_layer_ids=list(aux_layer_ids), **geom)
