"""Pre-flight check of an exported EAGLE-3 draft directory against its target, before serving or benchmarking it.

Each check names the field, what was found, what the target needs and what to do. The facts checked are those
SGLang relies on without checking them itself (SGLang `models/llama_eagle3.py`, `speculative/eagle_worker.py`):
- `architectures` must be `LlamaForCausalLMEagle3` and the weights must hold `fc.weight [H, 3*H_t]`: an EAGLE(-2)
  draft has no fc, and serving an EAGLE-3 draft with `--speculative-algorithm EAGLE` skips fc and `d2t` silently;
- hidden sizes: the draft's `target_hidden_size` (default `hidden_size`) equals the target's hidden size;
- `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang's key) read by SGLang's layer-id rule for the target
  (`models/llama.py` / `models/deepseek_v2.py` `set_eagle3_layers_to_capture`, target.family.sglang_layers_to_capture):
  3 distinct layer *outputs* in [0, L-2] (L-1's output is the input of no layer), ascending (SGLang and vLLM
  concatenate in ascending layer order), and a top-level `eagle_aux_hidden_state_layer_ids` (vLLM's and llama.cpp's
  key, layer inputs) naming the same layers;
- `vocab_size` equals the target's V; `lm_head` has `draft_vocab_size` rows; `d2t` exists, is an int64 [N] of offsets
  with every `i + d2t[i]` in [0, V), no two draft ids on one target id and, where the file has `t2d`, exactly t2d's
  ids in ascending order (`vocab_map.check_vocab_map`: zeros, arange or absolute ids contradict it);
- the target config may be a composite (vision-language) config: its `text_config` is read (`Kimi_K25Config`);
- `max_position_embeddings` is not smaller than the target's (SGLang refuses to start otherwise).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3_core.data.vocab_map import check_vocab_map
from eagle3_core.target.family import (
    NESTED_KEY,
    RULE_FILES,
    TOP_KEY,
    sglang_layers_to_capture,
    sglang_rule,
    text_config,
    value,
)
from eagle3_core.training.checkpoint import ARCHITECTURE

EAGLE2_ARCHITECTURE = "LlamaForCausalLMEagle"


class PreflightError(ValueError):
    """The draft does not fit the target; `problems` lists (field, message) pairs, one per mismatch."""

    def __init__(self, draft_dir: Path, problems: list[tuple[str, str]]):
        self.problems = problems
        lines = "\n".join(f"- {field}: {msg}" for field, msg in problems)
        super().__init__(f"draft {draft_dir} failed the pre-flight check against the target:\n{lines}")


def _target_value(target_config, name: str):
    return value(text_config(target_config), name)


def _d2t_problem(d2t, t2d, N: int, V: int | None) -> str | None:
    """What is wrong with d2t (int64 [N] offsets) given its own t2d (bool [V] or None), or None if it is right.
    With t2d, d2t must name exactly t2d's target ids in ascending order (vocab_map.check_vocab_map): a d2t of
    zeros (N < V), of arange (absolute ids read as offsets) or of absolute target ids all contradict it; an
    all-zero d2t is the identity and legal when N == V."""
    target_ids = torch.arange(N) + d2t
    if V is not None:
        out = ((target_ids < 0) | (target_ids >= V)).nonzero().flatten().tolist()
        if out:
            return (f"maps {len(out)} draft ids outside the target vocab [0, {V}) (first: draft id {out[0]} -> "
                    f"{int(target_ids[out[0]])}); d2t holds offsets (target = draft + d2t), not target ids: "
                    f"rebuild the vocab map")
    if len(set(target_ids.tolist())) != N:
        return f"maps several draft ids to one target id ({N - len(set(target_ids.tolist()))} duplicates); " \
               f"rebuild the vocab map"
    if t2d is None:
        return None
    try:
        check_vocab_map(d2t, t2d, "d2t/t2d")
    except ValueError:
        chosen = t2d.nonzero().flatten()
        kind = ("all zeros (the identity, legal only when N == V)" if not d2t.any() else
                "absolute target ids, not offsets" if chosen.numel() == N and torch.equal(d2t, chosen) else
                "arange (draft ids read as offsets)" if torch.equal(d2t, torch.arange(N)) else
                "not the offsets of t2d's ids")
        return (f"contradicts the file's own t2d: d2t is {kind}; t2d marks {int(t2d.sum())} target ids and d2t "
                f"must be their offsets (d2t[i] = t2d_ids[i] - i, SGLang's convention); rebuild the vocab map "
                f"(eagle3_core.data.vocab_map.build_vocab_map) and re-export")
    return None


def aux_id_problems(cfg: dict, target_config, L: int | None) -> list[tuple[str, str]]:
    """[(field, message)] for a draft config's aux ids on a target of L layers: the nested ids (SGLang's key) must
    be present; the layer outputs SGLang captures for them by the target's rule (target.family.sglang_rule) must
    be 3 distinct, ascending ids in [0, L-2]; the top-level ids (vLLM's and llama.cpp's key, layer inputs) must
    name the same layers."""
    nested = (cfg.get("eagle_config") or {}).get(TOP_KEY)
    if nested is None:
        return [(NESTED_KEY, "missing: SGLang then captures its default layers, which may not be the layers the "
                             "draft was trained on; write the ids used for feature extraction into the nested "
                             "eagle_config")]
    if L is None:
        return []
    rule = sglang_rule(target_config)
    served = [i - 1 for i in sglang_layers_to_capture(nested, rule, L)]          # layer outputs SGLang captures
    how = f"SGLang ({RULE_FILES[rule]}) captures the outputs of {served} for nested ids {nested}"
    bad = [i for i in served if not (isinstance(i, int) and 0 <= i <= L - 2)]
    if len(served) != 3 or len(set(served)) != 3 or bad:
        return [(NESTED_KEY, f"{how}: they must be 3 distinct layer outputs in [0, {L - 2}] for a target with {L} "
                             f"layers{f'; out of range: {bad}' if bad else ''}; re-export the draft with this "
                             f"project for this target (it writes the ids by the target's rule)")]
    if served != sorted(served):
        return [(NESTED_KEY, f"{how}, not ascending: SGLang and vLLM concatenate the captured layers in ascending "
                             f"order, so fc sees them in another order than it was trained on; retrain with "
                             f"{sorted(served)}")]
    top = cfg.get(TOP_KEY)
    if top is not None and [i - 1 for i in top] != served:
        return [(TOP_KEY, f"top-level ids {top} (vLLM and llama.cpp read them as layer inputs: outputs "
                          f"{[i - 1 for i in top]}) and the nested ids disagree ({how}): the engines would capture "
                          f"different layers; re-export the draft with this project for this target")]
    return []


def check_draft(draft_dir: Path, target_config) -> list[tuple[str, str]]:
    """All mismatches between the draft directory (config.json + model.safetensors) and the target.

    target_config: the target's transformers config (or a dict with hidden_size, num_hidden_layers, vocab_size,
    max_position_embeddings). Returns [(field, message)]; empty when the draft fits. Never raises on a bad draft.
    """
    draft, unreadable = _read_draft(Path(draft_dir))
    if draft is None:
        return unreadable
    cfg, shapes, d2t, t2d = draft
    H_t, L = _target_value(target_config, "hidden_size"), _target_value(target_config, "num_hidden_layers")
    V, ctx = _target_value(target_config, "vocab_size"), _target_value(target_config, "max_position_embeddings")
    problems = _architecture_problems(cfg, shapes, H_t)
    problems += aux_id_problems(cfg, target_config, L)
    problems += _vocab_problems(cfg, shapes, d2t, t2d, V)
    draft_ctx = cfg.get("max_position_embeddings")
    if ctx is not None and (draft_ctx is None or draft_ctx < ctx):
        problems.append(("max_position_embeddings", f"is {draft_ctx}, smaller than the target's {ctx}: SGLang "
                         f"refuses to start; set it to the target's context length in config.json"))
    return problems


def _read_draft(draft_dir: Path) -> tuple[tuple | None, list[tuple[str, str]]]:
    """((config.json as a dict, {weight name: shape}, d2t or None, t2d or None), []) of a draft directory, or
    (None, [the problem]) where config.json or model.safetensors is missing or config.json is not JSON."""
    cfg_file, weights = draft_dir / "config.json", draft_dir / "model.safetensors"
    if not cfg_file.exists():
        return None, [("config.json", f"{cfg_file} not found; give the directory written by the export "
                                      f"(draft/export)")]
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        return None, [("config.json", f"{cfg_file} is not valid JSON ({e}); re-export the draft")]
    if not weights.exists():
        return None, [("model.safetensors", f"{weights} not found; re-export the draft")]
    with safe_open(str(weights), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        d2t = f.get_tensor("d2t") if "d2t" in shapes else None
        t2d = f.get_tensor("t2d") if "t2d" in shapes else None
    return (cfg, shapes, d2t, t2d), []


def _architecture_problems(cfg: dict, shapes: dict, H_t: int | None) -> list[tuple[str, str]]:
    """The draft's architecture (EAGLE-3, one decoder layer), its target hidden size against the target's H_t,
    and fc.weight's shape [H, 3*H_t]."""
    problems = []
    arch = cfg.get("architectures")
    if arch == [EAGLE2_ARCHITECTURE] or "fc.weight" not in shapes:
        problems.append(("architectures", f"this is an EAGLE(-2) draft (architectures {arch}, "
                         f"{'no' if 'fc.weight' not in shapes else 'an'} fc layer), not EAGLE-3: an EAGLE-3 draft has "
                         f"architectures [{ARCHITECTURE!r}] and fc.weight [H, 3*H_t]; export with this project or "
                         f"serve an EAGLE-2 draft with --speculative-algorithm EAGLE"))
    elif arch != [ARCHITECTURE]:
        problems.append(("architectures", f"architectures is {arch}, expected [{ARCHITECTURE!r}] (SGLang picks the "
                         f"draft model class by this name)"))
    if cfg.get("num_hidden_layers", 1) != 1:
        problems.append(("num_hidden_layers", f"is {cfg.get('num_hidden_layers')}; SGLang's "
                         f"LlamaForCausalLMEagle3 runs exactly one decoder layer"))
    H = cfg.get("hidden_size")
    draft_H_t = cfg.get("target_hidden_size", H)
    if draft_H_t != H_t:
        problems.append(("hidden_size", f"the draft expects target hidden size {draft_H_t} (target_hidden_size / "
                         f"hidden_size in config.json) but the target's hidden_size is {H_t}: this draft was trained "
                         f"for another target"))
    elif "fc.weight" in shapes and shapes["fc.weight"] != (H, 3 * H_t):
        problems.append(("fc.weight", f"shape {shapes['fc.weight']}, expected [{H}, {3 * H_t}] (= [H, 3*H_t]); "
                         f"re-export the draft"))
    return problems


def _vocab_problems(cfg: dict, shapes: dict, d2t, t2d, V: int | None) -> list[tuple[str, str]]:
    """The draft's vocab_size against the target's V, lm_head's rows against draft_vocab_size N, and its d2t
    (int64 [N] offsets) and t2d (bool [vocab_size]) as model.safetensors holds them (_d2t_problem)."""
    problems = []
    if cfg.get("vocab_size") != V:
        problems.append(("vocab_size", f"is {cfg.get('vocab_size')}, the target's vocab is {V}: the draft maps its "
                         f"tokens into another vocabulary (wrong tokenizer or target)"))
    N = cfg.get("draft_vocab_size", cfg.get("vocab_size"))
    if "lm_head.weight" in shapes and shapes["lm_head.weight"][0] != N:
        problems.append(("lm_head.weight", f"has {shapes['lm_head.weight'][0]} rows but draft_vocab_size is {N}"))
    if d2t is None:
        problems.append(("d2t", "missing from model.safetensors: without it SGLang reads draft ids as target ids "
                         "and accepts almost nothing; export the draft with its vocab map (d2t)"))
    elif tuple(d2t.shape) != (N,) or d2t.is_floating_point():
        problems.append(("d2t", f"has shape {tuple(d2t.shape)} and dtype {d2t.dtype}, expected int64 [{N}] "
                         f"(draft_vocab_size offsets)"))
    else:
        V_d = cfg.get("vocab_size")                       # a V mismatch with the target is reported above
        t2d_ok = t2d is not None and str(t2d.dtype) == "torch.bool" and tuple(t2d.shape) == (V_d,)
        if t2d is not None and not t2d_ok:
            problems.append(("t2d", f"has shape {tuple(t2d.shape)} and dtype {t2d.dtype}, expected bool [{V_d}] "
                             f"(vocab_size)"))
        if (msg := _d2t_problem(d2t, t2d if t2d_ok else None, N, V)):
            problems.append(("d2t", msg))
    return problems


def preflight(draft_dir: Path, target_config) -> None:
    """Raise PreflightError listing every mismatch (see check_draft); return None when the draft fits."""
    problems = check_draft(draft_dir, target_config)
    if problems:
        raise PreflightError(Path(draft_dir), problems)
