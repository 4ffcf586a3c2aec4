"""Pre-flight check of an exported EAGLE-3 draft directory against its target, before serving or benchmarking it.

Each check names the field, what was found, what the target needs and what to do. The facts checked are those
SGLang relies on without checking them itself (REFERENCE.md sections 1, 2, 4):
- `architectures` must be `LlamaForCausalLMEagle3` and the weights must hold `fc.weight [H, 3*H_t]`: an EAGLE(-2)
  draft has no fc, and serving an EAGLE-3 draft with `--speculative-algorithm EAGLE` skips fc and `d2t` silently;
- hidden sizes: the draft's `target_hidden_size` (default `hidden_size`) equals the target's hidden size;
- `eagle_config.eagle_aux_hidden_state_layer_ids`: 3 distinct layer *outputs* in [0, L-2] (SGLang captures the input
  of layer id+1, `llama.py::set_eagle3_layers_to_capture`, so L-1 would capture nothing);
- `vocab_size` equals the target's V; `lm_head` has `draft_vocab_size` rows; `d2t` exists, is an int64 [N] of offsets
  with every `i + d2t[i]` in [0, V) and no two draft ids on one target id;
- `max_position_embeddings` is not smaller than the target's (SGLang refuses to start otherwise).
"""
from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from .checkpoint import ARCHITECTURE

EAGLE2_ARCHITECTURE = "LlamaForCausalLMEagle"


class PreflightError(ValueError):
    """The draft does not fit the target; `problems` lists (field, message) pairs, one per mismatch."""

    def __init__(self, draft_dir: Path, problems: list[tuple[str, str]]):
        self.problems = problems
        lines = "\n".join(f"- {field}: {msg}" for field, msg in problems)
        super().__init__(f"draft {draft_dir} failed the pre-flight check against the target:\n{lines}")


def _target_value(target_config, name: str):
    cfg = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    return cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)


def check_draft(draft_dir: Path, target_config) -> list[tuple[str, str]]:
    """All mismatches between the draft directory (config.json + model.safetensors) and the target.

    target_config: the target's transformers config (or a dict with hidden_size, num_hidden_layers, vocab_size,
    max_position_embeddings). Returns [(field, message)]; empty when the draft fits. Never raises on a bad draft.
    """
    draft_dir = Path(draft_dir)
    cfg_file, weights = draft_dir / "config.json", draft_dir / "model.safetensors"
    if not cfg_file.exists():
        return [("config.json", f"{cfg_file} not found; give the directory written by the export (draft/export)")]
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        return [("config.json", f"{cfg_file} is not valid JSON ({e}); re-export the draft")]
    if not weights.exists():
        return [("model.safetensors", f"{weights} not found; re-export the draft")]
    with safe_open(str(weights), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        d2t = f.get_tensor("d2t") if "d2t" in shapes else None

    problems: list[tuple[str, str]] = []

    def add(field: str, message: str) -> None:
        problems.append((field, message))
    H_t, L = _target_value(target_config, "hidden_size"), _target_value(target_config, "num_hidden_layers")
    V, ctx = _target_value(target_config, "vocab_size"), _target_value(target_config, "max_position_embeddings")

    arch = cfg.get("architectures")
    if arch == [EAGLE2_ARCHITECTURE] or "fc.weight" not in shapes:
        add("architectures", f"this is an EAGLE(-2) draft (architectures {arch}, "
                         f"{'no' if 'fc.weight' not in shapes else 'an'} fc layer), not EAGLE-3: an EAGLE-3 draft has "
                         f"architectures [{ARCHITECTURE!r}] and fc.weight [H, 3*H_t]; export with this project or "
                         f"serve an EAGLE-2 draft with --speculative-algorithm EAGLE")
    elif arch != [ARCHITECTURE]:
        add("architectures", f"architectures is {arch}, expected [{ARCHITECTURE!r}] (SGLang picks the "
                         f"draft model class by this name)")
    if cfg.get("num_hidden_layers", 1) != 1:
        add("num_hidden_layers", f"is {cfg.get('num_hidden_layers')}; SGLang's "
                         f"LlamaForCausalLMEagle3 runs exactly one decoder layer")

    H = cfg.get("hidden_size")
    draft_H_t = cfg.get("target_hidden_size", H)
    if draft_H_t != H_t:
        add("hidden_size", f"the draft expects target hidden size {draft_H_t} (target_hidden_size / "
                         f"hidden_size in config.json) but the target's hidden_size is {H_t}: this draft was trained "
                         f"for another target")
    elif "fc.weight" in shapes and shapes["fc.weight"] != (H, 3 * H_t):
        add("fc.weight", f"shape {shapes['fc.weight']}, expected [{H}, {3 * H_t}] (= [H, 3*H_t]); "
                         f"re-export the draft")

    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        add("eagle_config.eagle_aux_hidden_state_layer_ids", "missing: SGLang then captures its "
                         "default layers, which may not be the layers the draft was trained on; write the ids "
                         "used for feature extraction into the nested eagle_config")
    elif L is not None:
        bad = [i for i in ids if not (isinstance(i, int) and 0 <= i <= L - 2)]
        if len(ids) != 3 or len(set(ids)) != 3 or bad:
            add("eagle_config.eagle_aux_hidden_state_layer_ids", f"{ids} must be 3 distinct layer "
                             f"outputs in [0, {L - 2}] for a target with {L} layers (SGLang captures the input of "
                             f"layer id+1){f'; out of range: {bad}' if bad else ''}; use the ids the features were "
                             f"extracted at")

    if cfg.get("vocab_size") != V:
        add("vocab_size", f"is {cfg.get('vocab_size')}, the target's vocab is {V}: the draft maps its "
                         f"tokens into another vocabulary (wrong tokenizer or target)")
    N = cfg.get("draft_vocab_size", cfg.get("vocab_size"))
    if "lm_head.weight" in shapes and shapes["lm_head.weight"][0] != N:
        add("lm_head.weight", f"has {shapes['lm_head.weight'][0]} rows but draft_vocab_size is {N}")
    if d2t is None:
        add("d2t", "missing from model.safetensors: without it SGLang reads draft ids as target ids "
                         "and accepts almost nothing; export the draft with its vocab map (d2t)")
    elif tuple(d2t.shape) != (N,) or d2t.is_floating_point():
        add("d2t", f"has shape {tuple(d2t.shape)} and dtype {d2t.dtype}, expected int64 [{N}] "
                         f"(draft_vocab_size offsets)")
    elif V is not None:
        import torch
        target_ids = torch.arange(N) + d2t
        out = ((target_ids < 0) | (target_ids >= V)).nonzero().flatten().tolist()
        if out:
            add("d2t", f"maps {len(out)} draft ids outside the target vocab [0, {V}) (first: draft id "
                             f"{out[0]} -> {int(target_ids[out[0]])}); d2t holds offsets (target = draft + d2t), "
                             f"not target ids: rebuild the vocab map")
        elif len(set(target_ids.tolist())) != N:
            add("d2t", f"maps several draft ids to one target id ({N - len(set(target_ids.tolist()))} "
                             f"duplicates); rebuild the vocab map")

    draft_ctx = cfg.get("max_position_embeddings")
    if ctx is not None and (draft_ctx is None or draft_ctx < ctx):
        add("max_position_embeddings", f"is {draft_ctx}, smaller than the target's {ctx}: SGLang "
                         f"refuses to start; set it to the target's context length in config.json")
    return problems


def preflight(draft_dir: Path, target_config) -> None:
    """Raise PreflightError listing every mismatch (see check_draft); return None when the draft fits."""
    problems = check_draft(draft_dir, target_config)
    if problems:
        raise PreflightError(Path(draft_dir), problems)
