"""Target families, read one way everywhere: the text config of a composite target, its family, aux layer ids and
rope (the draft geometry each family gets is eagle3_core.training.draft_geometry).

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
  instead (eagle3_core.training.draft_geometry `_mla_recipe`).
"""
from __future__ import annotations

from eagle3_core.config import default_aux_layer_ids

MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")


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
    """The aux layer ids (outputs of 0-based decoder layers, SGLang `models/llama.py`) for a target with L layers:
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
    """How each engine reads the export's ids (SGLang `models/llama.py`, vLLM `models/llama_eagle3.py`, llama.cpp `convert_hf_to_gguf.py`): the key it reads and the layers whose
    *input* it captures. Our ids are layer outputs; the export writes them nested for SGLang and, +1, top-level."""
    inputs = [i + 1 for i in ids]
    sglang = {"key": "eagle_config.eagle_aux_hidden_state_layer_ids", "value": list(ids), "captures_inputs_of": inputs}
    if ids and ids[0] != 1:
        # a newer SGLang change (sgl-project/sglang PR #25454) adds the +1 only when the first id is 1
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
