"""Warm start: training continues from an existing EAGLE-3 draft instead of a fresh init. `train.init_from` names
- a draft in SGLang's format (config.json + model.safetensors with fc, midlayer, norm, lm_head, d2t, t2d): ours, a
  public one, or SpecForge 0.2's SGLang export, which leaves out embed_tokens by design (serving takes the embedding
  from the target: SpecForge `specforge/export/to_sglang.py` drops every key with 'embed'); here too the run's draft
  gets the target's embedding (setup.build_draft) whenever H == H_t;
- an earlier run directory (its draft/export);
- a SpecForge 0.2 training checkpoint: a `{run_id}-step{N}/` directory holding `training_state.pt`, that file, or
  SpecForge's output_dir (its `{run_id}-latest` link, else its highest step). The payload is read with
  torch.load(weights_only=True) (SpecForge `specforge/training/controller.py` save_checkpoint: `draft_state_dict`
  with SGLang's names, `strategy` 'eagle3'); the draft config, which SpecForge keeps apart from its checkpoints
  (the JSON given as model.draft_model_config), is `config.json` beside the file or in the output_dir.

The draft vocabulary is part of what the draft learned: lm_head row i scores target token i + d2t[i]. Kept as it
is (train.init_vocab 'keep'), every weight is reused unchanged. Rebuilt from the new data ('rebuild'), each lm_head
row is carried over by the target token it scores, never by its position: a row carried by position would score
another token, and acceptance collapses (SpecForge PR #534). Tokens new to the draft vocab keep their fresh init.
A draft whose max_position_embeddings differs from the run's is accepted under plain RoPE (or llama3's scaling,
which reads its own original_max_position_embeddings): no weight depends on the number of positions, and the
run's value is used.
"""
from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagle3_core.config import default_aux_layer_ids
from eagle3_core.data.vocab_map import check_vocab_map, draft_to_target_ids, target_to_draft_ids
from eagle3_core.target.family import PLUS_ONE, TOP_KEY, num_layers, rope_type, sglang_layers_to_capture, sglang_rule
from eagle3_core.training.checkpoint import CheckpointError, check_tensors, shape_from_config
from eagle3_core.training.draft_geometry import draft_shape
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
SPECFORGE_STATE = "training_state.pt"          # SpecForge `specforge/training/checkpoint.py` STATE_FILE
EAGLE2_ARCHITECTURE = "LlamaForCausalLMEagle"


@dataclass(frozen=True)
class InitSource:
    """Where a warm-start draft is: `dir` (named in logs and keys), its `config` (config.json) and `weights`
    (model.safetensors, or SpecForge's training_state.pt)."""
    dir: Path
    config: Path
    weights: Path

    @property
    def specforge_checkpoint(self) -> bool:
        return self.weights.name == SPECFORGE_STATE


def _specforge_step_dir(path: Path) -> Path | None:
    """The checkpoint directory a SpecForge output_dir points at: its one `*-latest` link, else its highest
    `*-stepN` directory holding training_state.pt (SpecForge `export/checkpoint_io.py` resolve_training_state)."""
    latest = [p.resolve() for p in sorted(path.glob("*-latest")) if (p.resolve() / SPECFORGE_STATE).is_file()]
    if len(latest) == 1:
        return latest[0]
    steps = [(int(p.name.rsplit("-step", 1)[1]), p) for p in path.glob("*-step*")
             if p.name.rsplit("-step", 1)[1].isdigit() and (p / SPECFORGE_STATE).is_file()]
    return max(steps)[1] if steps and not latest else None


def init_source(init_from: str | Path) -> InitSource:
    """The warm-start draft `train.init_from` names (see the module docstring for what it may name). Raises
    FileNotFoundError naming what is missing and what to give instead."""
    path = Path(init_from)
    if not path.exists():
        raise FileNotFoundError(f"train.init_from {path} does not exist: give an exported draft directory, a run "
                                f"directory whose train stage finished (its draft/export), or a SpecForge "
                                f"checkpoint")
    for d in (path, path / "draft" / "export"):
        if (d / "config.json").exists() and (d / "model.safetensors").exists():
            return InitSource(d, d / "config.json", d / "model.safetensors")
    state = path if path.name == SPECFORGE_STATE and path.is_file() else path / SPECFORGE_STATE
    if not state.is_file() and path.is_dir() and (step := _specforge_step_dir(path)) is not None:
        state = step / SPECFORGE_STATE
    if state.is_file():
        for cfg in (state.parent / "config.json", state.parent.parent / "config.json"):
            if cfg.is_file():
                return InitSource(state.parent, cfg, state)
        raise FileNotFoundError(f"train.init_from {path}: SpecForge checkpoint {state} has no draft config beside "
                                f"it; SpecForge keeps it apart (the JSON given as --draft-model-config / "
                                f"model.draft_model_config): copy that file to {state.parent / 'config.json'}")
    raise FileNotFoundError(f"train.init_from {path}: neither it nor {path / 'draft' / 'export'} holds a draft "
                            f"(config.json and model.safetensors), nor a SpecForge checkpoint ({SPECFORGE_STATE}); "
                            f"give an exported draft directory or a run directory whose train stage finished")


def init_dir(init_from: str | Path) -> Path:
    """The directory of the draft `train.init_from` names (init_source)."""
    return init_source(init_from).dir


def init_config(src: InitSource, default_aux_ids: list[int] | None = None, rule: str = PLUS_ONE) -> DraftShape:
    """The DraftShape of a warm-start draft from its config.json, read as SGLang and SpecForge write it: head_dim
    defaults to hidden_size / num_attention_heads, rope_theta may sit in transformers 5's rope_parameters, and a
    config without eagle_config's aux ids means the layers SGLang captures for a draft that names none
    (`default_aux_ids`, config.target_config.default_aux_layer_ids). Its aux ids are layer outputs read as the
    engines read them (target.family.draft_aux_ids): the top-level ids - 1, else the nested ids through SGLang's
    rule for the target (`rule`, target.family.sglang_rule): a SpecForge draft whose features SGLang captured on a
    DeepSeek/Kimi target with nested ids [2, 30, 58] was trained on outputs [1, 29, 57]. Raises CheckpointError for
    an EAGLE-2 draft or a config that is not an EAGLE-3 draft's."""
    cfg = json.loads(src.config.read_text())
    if cfg.get("architectures") == [EAGLE2_ARCHITECTURE]:
        raise CheckpointError(f"{src.config}: an EAGLE-2 draft (architectures {cfg['architectures']}; no fc over "
                              f"the target's aux hidden states): it cannot start an EAGLE-3 draft; unset "
                              f"train.init_from to train a fresh draft, or give an EAGLE-3 draft")
    rope = cfg.get("rope_parameters") or {}
    cfg = {"head_dim": cfg.get("hidden_size", 0) // max(cfg.get("num_attention_heads", 1), 1),
           "rope_theta": rope.get("rope_theta", 10000.0), **cfg}
    if rope_type(rope) != "default" and not cfg.get("rope_scaling"):
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    nested = (cfg.get("eagle_config") or {}).get(TOP_KEY)
    if not cfg.get(TOP_KEY) and (nested or default_aux_ids):
        outputs = [i - 1 for i in sglang_layers_to_capture(nested, rule, 0)] if nested else default_aux_ids
        cfg["eagle_config"] = {**(cfg.get("eagle_config") or {}), TOP_KEY: outputs}
    try:
        return shape_from_config(cfg, str(src.config))
    except KeyError as e:
        raise CheckpointError(f"{src.config}: no {e.args[0]!r}; not an EAGLE-3 draft config") from None


def init_tensors(src: InitSource) -> dict[str, torch.Tensor]:
    """The warm-start draft's tensors by SGLang's names (CPU). SpecForge's training_state.pt is read with
    torch.load(weights_only=True, mmap=True): its `draft_state_dict`. Raises CheckpointError for a payload the safe
    loader refuses, or one that is not an EAGLE-3 draft's."""
    if not src.specforge_checkpoint:
        return load_file(str(src.weights))
    try:
        state = torch.load(src.weights, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError) as e:
        raise CheckpointError(f"{src.weights}: not readable with torch.load(weights_only=True) "
                              f"({str(e).splitlines()[0]}); export it with SpecForge (python -m "
                              f"specforge.export.to_sglang --checkpoint ... --draft-config ... --output-dir DIR) "
                              f"and give DIR as train.init_from") from None
    if not isinstance(state, dict) or "draft_state_dict" not in state:
        raise CheckpointError(f"{src.weights}: no draft_state_dict; not a SpecForge training checkpoint")
    if state.get("strategy", "eagle3") != "eagle3":
        raise CheckpointError(f"{src.weights}: a SpecForge {state['strategy']!r} checkpoint, not an EAGLE-3 draft")
    return dict(state["draft_state_dict"])


# rope types whose frequencies do not read max_position_embeddings: plain RoPE, and llama3's scaling, which reads
# its own original_max_position_embeddings (transformers modeling_rope_utils._compute_llama3_parameters; the draft's
# rope_cos_sin likewise); dynamic NTK and yarn without that key read max_position_embeddings
POSITION_FREE_ROPE = ("default", "llama3")


def positions_change_nothing(s: DraftShape) -> bool:
    """True when no weight and no rotary frequency of a draft of shape `s` depends on max_position_embeddings."""
    return rope_type(s.rope_scaling) in POSITION_FREE_ROPE


def shape_problems(init: DraftShape, want: DraftShape, where: str, keep_vocab: bool) -> list[tuple[str, str]]:
    """[(config field, message)] for every way the draft at `where` (shape `init`) differs from the draft this
    run builds (`want`, from the target, the config and the feature store); draft_vocab_size only matters when
    the vocab map is kept, max_position_embeddings only when a rope scaling reads it (plain RoPE or llama3 on both
    sides: no weight and no frequency depends on it). Empty when the warm start can load it. Each message says
    what to change."""
    problems = []
    for name, field in SHAPE_FIELDS.items():
        if name == "draft_vocab_size" and not keep_vocab:
            continue
        a, b = getattr(init, name), getattr(want, name)
        if a == b or (name == "max_position_embeddings" and positions_change_nothing(init)
                      and positions_change_nothing(want)):
            continue
        if field == "target.model":
            fix = ("the draft was trained for another target: warm-start from a draft of this target, or unset "
                   "train.init_from")
        elif name == "aux_layer_ids":
            fix = (f"set {field} to {a} (the layer outputs the draft was trained on: its top-level ids - 1, or its "
                   f"nested SGLang ids as the target's SGLang serves them; on DeepSeek/Kimi targets nested ids not "
                   f"starting at 1 are layer inputs, so SpecForge's [2, 30, 58] are outputs [1, 29, 57]) or unset "
                   f"train.init_from")
        elif name == "draft_vocab_size":
            fix = f"set {field} to {a}, or set train.init_vocab to 'rebuild' to build a new map"
        else:
            fix = f"set {field} to {a} to match the draft"
        problems.append((field, f"the run builds {name} = {b}, the draft {where} has {a}: {fix}"))
    return problems


def init_problems(init_from: str | Path, want: DraftShape, keep_vocab: bool,
                  default_aux_ids: list[int] | None = None, rule: str = PLUS_ONE) -> list[tuple[str, str]]:
    """[(field, message)] of everything that would stop a warm start from `init_from`: missing, not a draft, an
    EAGLE-2 draft, a config or tensors that are not EAGLE-3's, an embedding the run needs but the draft lacks, and
    every way it differs from the run (shape_problems). Reads config.json and the tensors' shapes only where it
    can (safetensors); a SpecForge training checkpoint is memory-mapped. Empty when load_init will load it."""
    try:
        src = init_source(init_from)
        init = init_config(src, default_aux_ids, rule)
        if src.specforge_checkpoint:
            shapes = {k: tuple(v.shape) for k, v in init_tensors(src).items()}
        else:
            with safe_open(str(src.weights), "pt") as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except (OSError, CheckpointError, json.JSONDecodeError) as e:
        return [("train.init_from", str(e))]
    if "fc.weight" not in shapes:
        return [("train.init_from", f"{src.weights} has no fc.weight: an EAGLE(-2) draft, not EAGLE-3; unset "
                                    f"train.init_from to train a fresh draft, or give an EAGLE-3 draft")]
    problems = shape_problems(init, want, str(src.dir), keep_vocab)
    if not problems and "embed_tokens.weight" not in shapes and want.hidden_size != want.target_hidden_size:
        problems.append(("train.init_from", f"{src.weights} has no embed_tokens.weight, and this draft (hidden "
                         f"size {want.hidden_size}, the target's {want.target_hidden_size}) trains its own: give "
                         f"a draft that holds it"))
    return problems


def load_init(init_from: str | Path, want: DraftShape, keep_vocab: bool,
              default_aux_ids: list[int] | None = None, rule: str = PLUS_ONE) -> Eagle3Draft:
    """The draft named by `train.init_from` (init_source), loaded strictly in fp32 and checked against `want`.
    A draft without embed_tokens (SpecForge's SGLang export and checkpoints, when its embedding is the target's)
    gets a zero placeholder: warm_draft keeps the run's own (the target's) embedding whenever it is frozen.
    Raises FileNotFoundError (init_source), ValueError naming every mismatched field (init_problems),
    CheckpointError for a broken draft."""
    src = init_source(init_from)
    if (problems := init_problems(init_from, want, keep_vocab, default_aux_ids, rule)):
        raise ValueError(f"train.init_from {init_from} does not fit this run:\n"
                         + "\n".join(f"- {field}: {msg}" for field, msg in problems))
    shape = init_config(src, default_aux_ids, rule)
    tensors = init_tensors(src)
    if "embed_tokens.weight" not in tensors:
        tensors["embed_tokens.weight"] = torch.zeros(shape.vocab_size, shape.hidden_size,
                                                     dtype=tensors["fc.weight"].dtype)
    check_tensors(tensors, shape, str(src.weights))
    draft = Eagle3Draft(shape).to(torch.float32)
    draft.load_state_dict(tensors, strict=True)
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
            if name not in src:
                raise CheckpointError(f"warm start: the draft has no {name}, which this run's capacity options "
                                      f"(draft.num_hidden_layers {fresh.shape.num_hidden_layers}, fc_norm "
                                      f"{fresh.shape.fc_norm}) add; start from a draft with the same options")
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
    src = init_source(init_from)
    if not src.specforge_checkpoint:
        with safe_open(str(src.weights), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in ("d2t", "t2d") if k in f.keys()}  # noqa: SIM118
    else:
        tensors = init_tensors(src)
    if "d2t" not in tensors or "t2d" not in tensors:
        raise CheckpointError(f"{src.weights}: no d2t/t2d; the draft's vocab map cannot be kept: set "
                              f"train.init_vocab to 'rebuild'")
    return tensors["d2t"].long(), tensors["t2d"].bool()


def init_from_check(cfg, tcfg, ids: list[int] | None) -> tuple[dict, list[tuple[str, str]]]:
    """(facts, problems) of train.init_from (cfg: a PipelineConfig; tcfg: the target's transformers config; ids:
    the run's resolved aux layer ids, None where they are wrong) against the draft this run builds
    (init_problems: exists, a draft, not EAGLE-2, geometry, vocab, aux ids, positions) and, when its vocab map is
    kept, that map (vocab_map.check_vocab_map). No weights are loaded (a SpecForge checkpoint is memory-mapped)."""
    keep = cfg.train.init_vocab == "keep"
    facts: dict = {"given": cfg.train.init_from, "vocab": cfg.train.init_vocab}
    L = num_layers(tcfg)
    defaults = default_aux_layer_ids(L) if L >= 7 else None
    want = draft_shape(tcfg, cfg.draft.draft_vocab_size, ids if ids is not None else defaults or [],
                       overrides=cfg.draft.geometry(), capacity=cfg.draft.capacity())
    problems = init_problems(cfg.train.init_from, want, keep, defaults, sglang_rule(tcfg))
    if ids is None:                                         # reported under features.aux_layer_ids already
        problems = [p for p in problems if p[0] != "features.aux_layer_ids"]
    if any(f == "train.init_from" for f, _ in problems):
        return facts, problems
    src = init_source(cfg.train.init_from)
    facts.update({"dir": str(src.dir), "format": "SpecForge training checkpoint" if src.specforge_checkpoint
                  else "SGLang draft directory"})
    if keep and not problems:
        try:
            check_vocab_map(*init_vocab_map(cfg.train.init_from), str(src.weights))
        except ValueError as e:
            problems.append(("train.init_vocab", f"{e}; set train.init_vocab to 'rebuild' (a new map from this "
                                                 f"run's data; lm_head rows carried by target token)"))
    return facts, problems
