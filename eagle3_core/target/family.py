"""Target families, read one way everywhere: the text config of a composite target, its family, aux layer ids and
rope (the draft geometry each family gets is eagle3_core.training.draft_geometry).

Legend: L target decoder layers, H_t target hidden, V target vocab, N draft vocab, hd head dim.

Every stage reads the target's config through `target.loading.load_target_config` (trust_remote_code and revision
passed) and then `text_config` here: a vision-language wrapper such as transformers' `Kimi_K25Config` keeps its
DeepSeek-V3 text model under `text_config`, and every number the draft needs (L, H_t, V, heads, rope, context) is
the text model's. Families:
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


# ---- the aux ids as each engine reads a draft's config.json ------------------------------------------------------
# SGLang (0.5.14) reads the nested `eagle_config.eagle_aux_hidden_state_layer_ids` (`model_executor/model_runner.py`)
# and hands it to the target model's `set_eagle3_layers_to_capture`, which sets the layers whose *input* it captures
# (`layers_to_capture`). Two rules, by model file:
PLUS_ONE = "plus_one"                   # models/llama.py, qwen2.py, qwen3.py, qwen3_moe.py, gpt_oss.py, glm4_moe.py,
#                                         ...: layers_to_capture = [i + 1 for i in ids]
PLUS_ONE_IF_FIRST_IS_1 = "plus_one_if_first_is_1"   # models/deepseek_v2.py (DeepSeek-V2/V3, Kimi-K2/K2.5 through
#                                         kimi_k25.py's language_model) and glm4_moe_lite.py: +1 only when ids[0] == 1,
#                                         else the ids are taken as layer inputs as they are
RULE_FILES = {PLUS_ONE: "models/llama.py", PLUS_ONE_IF_FIRST_IS_1: "models/deepseek_v2.py"}
# Without ids both capture the inputs of [2, L // 2, L - 3]. vLLM (`vllm/v1/worker/gpu/spec_decode/eagle/
# eagle3_utils.py` get_eagle3_aux_layers_from_config; its models append the residual stream before layer idx) and
# llama.cpp (`convert_hf_to_gguf.py`) read only the top-level `eagle_aux_hidden_state_layer_ids`, as layer inputs.
NESTED_KEY = "eagle_config.eagle_aux_hidden_state_layer_ids"
TOP_KEY = "eagle_aux_hidden_state_layer_ids"


def sglang_rule(config) -> str:
    """SGLang's layer-id rule for a target: PLUS_ONE_IF_FIRST_IS_1 for the 'mla' family (DeepSeek-V2/V3, Kimi,
    GLM-4-MoE-Lite: served by models/deepseek_v2.py or its subclasses), PLUS_ONE otherwise."""
    return PLUS_ONE_IF_FIRST_IS_1 if family(config) == "mla" else PLUS_ONE


def sglang_layers_to_capture(value: list[int] | None, rule: str, L: int) -> list[int]:
    """The layers whose input SGLang 0.5.14 captures when the draft's nested ids are `value` (None: absent) on a
    target of L layers under `rule` (what `set_eagle3_layers_to_capture` sets as layers_to_capture)."""
    if value is None:
        return [2, L // 2, L - 3]
    if rule == PLUS_ONE or (value and value[0] == 1):
        return [i + 1 for i in value]
    assert rule == PLUS_ONE_IF_FIRST_IS_1, rule
    return list(value)


def sglang_ids(ids: list[int], rule: str, field: str = "features.aux_layer_ids") -> list[int]:
    """The nested ids to write (or pass to `set_eagle3_layers_to_capture`) so that SGLang captures the outputs of
    layers `ids` (layers_to_capture = [i + 1 for i in ids]) under `rule`. Raises ValueError naming `field` where
    the rule cannot express them: under PLUS_ONE_IF_FIRST_IS_1, ids starting at 0 (layer 1's input would need a
    first id of 1, which that rule adds one to)."""
    if rule == PLUS_ONE or ids[0] == 1:
        return list(ids)
    assert rule == PLUS_ONE_IF_FIRST_IS_1, rule
    if ids[0] == 0:
        raise ValueError(f"{field} = {list(ids)}: SGLang's DeepSeek-V2/V3 and Kimi model files "
                         f"(models/deepseek_v2.py set_eagle3_layers_to_capture) cannot capture layer 0's output "
                         f"(an id list starting at 1 gets one added to every id); start the ids at 1 or higher, "
                         f"e.g. {[1] + list(ids[1:]) if ids[1] > 1 else [1, 2, 3]}")
    return [i + 1 for i in ids]


def draft_aux_ids(cfg: dict, rule: str, L: int) -> list[int]:
    """The layer outputs a draft's config.json says it was trained on, for a target of L layers under SGLang
    rule `rule`: the top-level ids - 1 where present (vLLM's and llama.cpp's reading, the same on every target),
    else the layers SGLang captures for its nested ids (sglang_layers_to_capture) - 1: a SpecForge draft whose
    features SGLang captured on a DeepSeek/Kimi target with ids [2, 30, 58] was trained on outputs [1, 29, 57]."""
    top = cfg.get(TOP_KEY)
    if top:
        return [i - 1 for i in top]
    nested = (cfg.get("eagle_config") or {}).get(TOP_KEY) or None
    return [i - 1 for i in sglang_layers_to_capture(nested, rule, L)]


def engine_readings(ids: list[int], rule: str = PLUS_ONE) -> dict[str, dict]:
    """How each engine reads the export of a draft trained on layer outputs `ids` (the export writes the nested ids
    by `rule`, sglang_ids, and the top-level ids as layer inputs): for each, the key it reads, the value written
    there and the layers whose *input* it captures. Raises ValueError where SGLang's rule cannot express `ids`."""
    inputs = [i + 1 for i in ids]
    nested = sglang_ids(ids, rule)
    return {
        "sglang": {"key": NESTED_KEY, "value": nested, "captures_inputs_of": sglang_layers_to_capture(nested, rule, 0),
                   "rule": f"{RULE_FILES[rule]} set_eagle3_layers_to_capture ({rule})"},
        "vllm": {"key": f"{TOP_KEY} (top level)", "value": inputs, "captures_inputs_of": inputs},
        "llama.cpp": {"key": f"{TOP_KEY} (top level, convert_hf_to_gguf.py)", "value": inputs,
                      "captures_inputs_of": inputs},
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
