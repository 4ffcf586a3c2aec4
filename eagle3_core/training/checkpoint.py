"""Draft checkpoints: the SGLang-loadable directory (SGLang `models/llama_eagle3.py` `load_weights`) and the resumable training state.

The export key map is data: `expected_tensors(shape)` lists every tensor name with its shape and dtype, and both
export and load check it strictly (SGLang silently keeps random weights for names it does not know: handed case C7).
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import pickle
import random
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3_core.data.vocab_map import check_vocab_map
from eagle3_core.target.family import PLUS_ONE, TOP_KEY, sglang_ids
from eagle3_core.training.capacity import ENGINES, unservable
from eagle3_core.training.draft_model import DraftShape, Eagle3Draft

ARCHITECTURE = "LlamaForCausalLMEagle3"


class CheckpointError(ValueError):
    """A draft checkpoint whose tensors or config do not match the EAGLE-3 schema; names the key and the fix."""


def expected_tensors(s: DraftShape) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """name -> (shape, dtype or None for 'the float dtype of the checkpoint'), SGLang's names."""
    H, qd, kvd = s.hidden_size, s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    return {
        "embed_tokens.weight": ((s.vocab_size, H), None),
        "fc.weight": ((H, 3 * s.target_hidden_size), None),
        "midlayer.self_attn.q_proj.weight": ((qd, 2 * H), None),
        "midlayer.self_attn.k_proj.weight": ((kvd, 2 * H), None),
        "midlayer.self_attn.v_proj.weight": ((kvd, 2 * H), None),
        "midlayer.self_attn.o_proj.weight": ((H, qd), None),
        "midlayer.mlp.gate_proj.weight": ((s.intermediate_size, H), None),
        "midlayer.mlp.up_proj.weight": ((s.intermediate_size, H), None),
        "midlayer.mlp.down_proj.weight": ((H, s.intermediate_size), None),
        "midlayer.input_layernorm.weight": ((H,), None),
        "midlayer.hidden_norm.weight": ((H,), None),
        "midlayer.post_attention_layernorm.weight": ((H,), None),
        "norm.weight": ((H,), None),
        "lm_head.weight": ((s.draft_vocab_size, H), None),
        "d2t": ((s.draft_vocab_size,), torch.int64),
        "t2d": ((s.vocab_size,), torch.bool),
        **capacity_tensors(s),
    }


def capacity_tensors(s: DraftShape) -> dict[str, tuple[tuple[int, ...], None]]:
    """The tensors of the capacity options (training.capacity), SGLang's names (0.5.14 `models/llama_eagle3.py`):
    `fc_norm.{j}.weight` [H_t] per aux chunk; per later layer i `layers.{i}.*` with q/k/v taking H inputs, plus
    `layers.{i}.input_layernorm.weight`, a copy of its hidden_norm (vLLM `models/llama_eagle3.py` norms a later
    layer's input with input_layernorm, SGLang with hidden_norm: both names make both engines run the same draft)."""
    H, qd, kvd, I = s.hidden_size, s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim, \
        s.intermediate_size
    out = {f"fc_norm.{j}.weight": ((s.target_hidden_size,), None) for j in range(3 if s.fc_norm else 0)}
    for i in range(1, s.num_hidden_layers):
        p = f"layers.{i}."
        out.update({p + "self_attn.q_proj.weight": ((qd, H), None), p + "self_attn.k_proj.weight": ((kvd, H), None),
                    p + "self_attn.v_proj.weight": ((kvd, H), None), p + "self_attn.o_proj.weight": ((H, qd), None),
                    p + "mlp.gate_proj.weight": ((I, H), None), p + "mlp.up_proj.weight": ((I, H), None),
                    p + "mlp.down_proj.weight": ((H, I), None), p + "hidden_norm.weight": ((H,), None),
                    p + ENGINE_COPY: ((H,), None), p + "post_attention_layernorm.weight": ((H,), None)})
    return out


ENGINE_COPY = "input_layernorm.weight"    # of a later layer: vLLM's name of its hidden_norm (capacity_tensors)


def with_engine_copies(tensors: dict, s: DraftShape) -> dict:
    """The draft's state dict plus the copy each later layer's hidden_norm gets under vLLM's name."""
    return {**tensors, **{f"layers.{i}.{ENGINE_COPY}": tensors[f"layers.{i}.hidden_norm.weight"].clone()
                          for i in range(1, s.num_hidden_layers)}}


def without_engine_copies(tensors: dict, s: DraftShape, where: str) -> dict:
    """`tensors` less the engine copies, each checked equal to its hidden_norm. Raises CheckpointError."""
    out = dict(tensors)
    for i in range(1, s.num_hidden_layers):
        copy, norm = out.pop(f"layers.{i}.{ENGINE_COPY}"), out[f"layers.{i}.hidden_norm.weight"]
        if not torch.equal(copy, norm):
            raise CheckpointError(f"{where}: layers.{i}.{ENGINE_COPY} differs from layers.{i}.hidden_norm.weight: "
                                  f"SGLang and vLLM would run different drafts; write both from the same norm")
    return out


def check_tensors(tensors: dict[str, torch.Tensor], s: DraftShape, where: str) -> None:
    """Raise CheckpointError naming the first missing, unexpected, mis-shaped or mis-typed tensor."""
    expected = expected_tensors(s)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{where}: missing tensors {missing}, unexpected tensors {unexpected}; the EAGLE-3 "
                              f"names are listed in eagle3_core.training.checkpoint.expected_tensors")
    for name, (shape, dtype) in expected.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{where}: tensor {name} has shape {tuple(t.shape)}, expected {shape}")
        if dtype is not None and t.dtype != dtype:
            raise CheckpointError(f"{where}: tensor {name} has dtype {t.dtype}, expected {dtype}")
        if dtype is None and not t.is_floating_point():
            raise CheckpointError(f"{where}: tensor {name} has dtype {t.dtype}, expected a float dtype")


def sglang_config(s: DraftShape, dtype: torch.dtype, rule: str = PLUS_ONE) -> dict:
    """config.json of the draft. The aux ids (s.aux_layer_ids, layer *outputs*) are written so that every engine
    captures those layers (target.family.engine_readings):
    - nested `eagle_config.eagle_aux_hidden_state_layer_ids`, what SGLang reads, by its layer-id rule for the
      target (`rule`, target.family.sglang_rule): the ids themselves under models/llama.py's rule, ids + 1 under
      models/deepseek_v2.py's unless they start at 1 (target.family.sglang_ids);
    - top-level `eagle_aux_hidden_state_layer_ids`: the same layers as layer *inputs* (id + 1), what vLLM
      (`vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py` get_eagle3_aux_layers_from_config) and llama.cpp's
      converter read, and what load_draft reads back (shape_from_config).
    The trainer's own checkpoints (save_draft) use PLUS_ONE: only the top-level ids are read back.
    Raises CheckpointError for ids that are not ascending (every engine concatenates in ascending layer order) or
    that SGLang's rule cannot express (ids starting at 0 on a DeepSeek/Kimi target)."""
    ids = list(s.aux_layer_ids)
    if ids != sorted(set(ids)):
        raise CheckpointError(f"aux_layer_ids {ids} are not strictly ascending: SGLang and vLLM concatenate the "
                              f"captured layers in ascending order; retrain with features.aux_layer_ids "
                              f"{sorted(set(ids))}")
    try:
        nested = sglang_ids(ids, rule)
    except ValueError as e:
        raise CheckpointError(f"{e}, and retrain (the draft cannot be served by SGLang on this target)") from None
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": s.num_hidden_layers,
        "hidden_size": s.hidden_size, "target_hidden_size": s.target_hidden_size,
        "intermediate_size": s.intermediate_size, "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads, "head_dim": s.head_dim, "rms_norm_eps": s.rms_norm_eps,
        "rope_theta": s.rope_theta, "rope_scaling": s.rope_scaling,
        "max_position_embeddings": s.max_position_embeddings, "hidden_act": s.hidden_act,
        "torch_dtype": str(dtype).removeprefix("torch."), "vocab_size": s.vocab_size,
        "draft_vocab_size": s.draft_vocab_size, "tie_word_embeddings": False,
        "pad_token_id": None, "attention_bias": False, "mlp_bias": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": nested, "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in ids],
        **{k: True for k in ("fc_norm", "norm_output") if getattr(s, k)},     # SGLang's and vLLM's EAGLE-3.1 flags
    }


def save_draft(draft: Eagle3Draft, out: Path, dtype: torch.dtype | None = None, rule: str = PLUS_ONE) -> Path:
    """Write an SGLang-loadable directory (config.json, model.safetensors) atomically; returns `out`.

    dtype: float dtype of the weights (default: the draft's own, so a reload reproduces its logits exactly);
    rule: SGLang's layer-id rule for the target (sglang_config).
    """
    s = draft.shape
    dtype = dtype or draft.fc.weight.dtype
    tensors = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu()
               for k, v in with_engine_copies(draft.state_dict(), s).items()}
    check_tensors(tensors, s, f"export to {out}")
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(sglang_config(s, dtype, rule), indent=2))
    (tmp / "draft_shape.json").write_text(json.dumps(s.to_dict(), indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


EXPORT_DTYPE = torch.bfloat16          # public drafts ship bf16; SGLang's --dtype auto turns float32 into float16


def export_draft(draft: Eagle3Draft, out: Path, dtype: torch.dtype = EXPORT_DTYPE, *, sglang_rule: str,
                 engines: tuple[str, ...] = ENGINES) -> Path:
    """Write the serving export of a trained draft (save_draft in `dtype`, bf16 by default, its nested aux ids by
    `sglang_rule`: target.family.sglang_rule of the target it serves) and prove it: d2t and
    t2d name the same target ids (vocab_map.check_vocab_map), and the reloaded export gives step-0 logits bit for
    bit equal to the trained draft cast to `dtype`. Returns `out`. Raises ValueError (vocab map) or
    CheckpointError (the export does not reproduce the draft, or none of `engines`, the deploy targets, serves its
    capacity options: training.capacity.SERVES, the refusal naming option and engine)."""
    if (why := unservable(draft.shape, engines)) is not None:
        raise CheckpointError(f"export to {out}: {why}")

    check_vocab_map(draft.d2t.cpu(), draft.t2d.cpu(), f"export to {out}")
    save_draft(draft, out, dtype, sglang_rule)
    cast = copy.deepcopy(draft).to(device="cpu", dtype=dtype)
    if not logits_probe(cast, load_draft(out)):
        raise CheckpointError(f"export {out} does not reproduce the trained draft cast to {dtype}: re-export")
    return out


@torch.no_grad()
def logits_probe(a: Eagle3Draft, b: Eagle3Draft) -> bool:
    """True if drafts a and b give bit-identical step-0 logits [1, 8, N] on a fixed random input (CPU)."""
    g = torch.Generator().manual_seed(0)
    T = 8
    aux = torch.randn(1, T, 3 * a.shape.target_hidden_size, generator=g).to(a.fc.weight.dtype)
    ids = torch.randint(0, a.shape.vocab_size, (1, T), generator=g)
    pos = torch.arange(T)[None]
    la = a.decode(ids, a.fuse(aux), pos, {})[1]
    lb = b.decode(ids, b.fuse(aux.to(b.fc.weight.dtype)), pos, {})[1]
    return la.dtype == lb.dtype and torch.equal(la, lb)


def shape_from_config(cfg: dict, where: str) -> DraftShape:
    """DraftShape from an SGLang draft config.json; its aux_layer_ids (layer outputs) are the top-level ids - 1
    (layer inputs, as sglang_config writes them) where present, else the nested ids as they are (a draft with only
    those: read them through the target's SGLang rule first, target.family.draft_aux_ids, as warm_start does).
    Raises CheckpointError on a non-EAGLE-3 config."""
    if cfg.get("architectures") != [ARCHITECTURE]:
        raise CheckpointError(f"{where}: architectures is {cfg.get('architectures')}, expected [{ARCHITECTURE!r}]")
    ids = [i - 1 for i in cfg.get(TOP_KEY) or []] or (cfg.get("eagle_config") or {}).get(TOP_KEY)
    if not ids:
        raise CheckpointError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids missing")
    return DraftShape(
        hidden_size=cfg["hidden_size"], target_hidden_size=cfg.get("target_hidden_size", cfg["hidden_size"]),
        num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"], intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
        draft_vocab_size=cfg["draft_vocab_size"], rms_norm_eps=cfg["rms_norm_eps"], rope_theta=cfg["rope_theta"],
        rope_scaling=cfg.get("rope_scaling"), max_position_embeddings=cfg["max_position_embeddings"],
        hidden_act=cfg.get("hidden_act", "silu"), aux_layer_ids=list(ids),
        num_hidden_layers=cfg.get("num_hidden_layers", 1), fc_norm=bool(cfg.get("fc_norm", False)),
        norm_output=bool(cfg.get("norm_output", False)))


def load_draft(path: Path, dtype: torch.dtype | None = None) -> Eagle3Draft:
    """Load an exported draft directory strictly (every name and shape checked). Raises CheckpointError."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{path}: no config.json; give the directory written by the export")
    s = shape_from_config(json.loads(cfg_file.read_text()), str(cfg_file))
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    check_tensors(tensors, s, str(path / "model.safetensors"))
    tensors = without_engine_copies(tensors, s, str(path / "model.safetensors"))
    draft = Eagle3Draft(s).to(dtype or tensors["fc.weight"].dtype)
    draft.load_state_dict(tensors, strict=True)
    return draft


TRAINING_STATE_DIR = "checkpoints"      # under the training output directory: step_{step:09d}.pt files


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_states() -> dict:
    """Torch (CPU and every CUDA device) and Python RNG states, in a form torch.load(weights_only=True) reads."""
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": json.dumps(random.getstate())}


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    py = json.loads(states["python"])
    random.setstate((py[0], tuple(py[1]), py[2]))


def frozen_names(draft: Eagle3Draft) -> set[str]:
    """The names of the draft's parameters that training does not update (requires_grad False)."""
    return {n for n, p in draft.named_parameters() if not p.requires_grad}


def trained_state(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    """The draft's state_dict for a training checkpoint: every tensor but its frozen parameters (the target's
    embedding when H == H_t: fp32 [V, H], 4.7 GB of a Kimi-K2.5 draft's checkpoint), which the run rebuilds from
    the feature store's copy of it (startup.fresh_draft) before it resumes."""
    frozen = frozen_names(draft)
    return {k: v for k, v in draft.state_dict().items() if k not in frozen}


def load_trained_state(draft: Eagle3Draft, model: dict[str, torch.Tensor], path: Path) -> None:
    """Load a training checkpoint's `model` (trained_state's, or one written before 42aa5c7 that also holds the
    frozen embedding: compat.LEGACY_READERS) into `draft`. Raises CheckpointError naming `path` and the keys where
    a trained tensor is missing or a key is not the draft's."""
    missing, unexpected = draft.load_state_dict(model, strict=False)
    if (lost := sorted(set(missing) - frozen_names(draft))) or unexpected:
        raise CheckpointError(f"{path}: the checkpoint's draft lacks {lost} and has unknown {sorted(unexpected)}: "
                              f"it was written for another draft shape; train into a new output directory")


def save_training_state(out_dir: Path, state: dict, step: int, keep: int) -> Path:
    """Write `state` (tensors, dicts, lists, numbers, strings) as out_dir/checkpoints/step_{step}.pt atomically
    (temporary name, fsync, rename, fsync of the directory), then delete all but the newest `keep`.
    A crash at any moment leaves only complete checkpoints under their final names. Returns the path."""
    ckpt_dir = Path(out_dir) / TRAINING_STATE_DIR
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / f"step_{step:09d}.pt"
    tmp = ckpt_dir / f".{path.name}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(ckpt_dir)
    for old in sorted(ckpt_dir.glob("step_*.pt"))[:-keep]:
        old.unlink()
    return path


def load_latest_training_state(out_dir: Path, log=print) -> tuple[dict, Path] | tuple[None, None]:
    """The newest checkpoint under out_dir/checkpoints that loads (weights_only), and its path; (None, None) if
    there is none. A file that fails to load (damaged outside our atomic writes) is reported and skipped."""
    ckpt_dir = Path(out_dir) / TRAINING_STATE_DIR
    for path in sorted(ckpt_dir.glob("step_*.pt"), reverse=True):
        try:
            return torch.load(path, weights_only=True, map_location="cpu"), path
        except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:  # damaged: try an older one
            log(f"train: skipping unreadable checkpoint {path} ({type(e).__name__}: {e})")
    return None, None


# what each field of a checkpoint's resume key is, in the words a refusal names it
RESUME_FIELDS = {"batching": "train.batching (resolved: 'auto' is packed rows on CUDA, padded batches on CPU)",
                 "batch_tokens": "train.batch_tokens", "grad_accum_x_world": "train.grad_accum x the world size",
                 "seed": "train.seed", "window_context": "train.window_context (packed rows)",
                 "samples": "the train samples (ids and lengths of the feature store's samples)"}


def resume_key(samples: list[dict], batching: str, batch_tokens: int, global_accum: int, seed: int,
               window_context: int | None) -> dict:
    """What fixes the batches and optimizer steps a checkpoint's position (epoch, batch) refers to, stored in each
    checkpoint: the resolved batching ('packed' or 'padded'), the token budget, batches per optimizer step W*G
    (2 ranks x 1 equals 1 process x 2), the seed, the window context of packed rows (None for padded) and the
    sha256 of the samples' ids and lengths. Field names: RESUME_FIELDS."""
    digest = hashlib.sha256(json.dumps([[s["id"], len(s["input_ids"])] for s in samples]).encode()).hexdigest()
    return {"batching": batching, "batch_tokens": batch_tokens, "grad_accum_x_world": global_accum, "seed": seed,
            "window_context": window_context, "samples": digest}


def check_resume(state: dict, key: dict, path: Path, fingerprint_v4=None) -> None:
    """Refuse to resume from checkpoint `state` (at `path`) unless it was written for the batches `key`
    (resume_key) gives: ValueError naming the first field that differs (RESUME_FIELDS), its value then and now,
    and what to do. A checkpoint written before checkpoints held a resume key is compared by its `data`
    fingerprint against fingerprint_v4() (compat.checkpoint_fingerprint_v4).
    Remove `fingerprint_v4` when runs written before f66665b are no longer supported (compat.LEGACY_READERS)."""
    fix = f"set it back to resume, or delete {Path(path).parent} to train from scratch"
    if "resume" not in state:
        if fingerprint_v4 is None or state.get("data") != fingerprint_v4():
            raise ValueError(f"checkpoint {path} was written for other training data or batching (here: "
                             f"{RESUME_FIELDS['grad_accum_x_world']} = {key['grad_accum_x_world']}, "
                             f"{RESUME_FIELDS['batching']} = {key['batching']!r}); {fix}")
        return
    for field, now in key.items():
        then = state["resume"].get(field)
        if then != now:
            raise ValueError(f"checkpoint {path} was written with {RESUME_FIELDS[field]} = {then!r}, this run has "
                             f"{now!r}: resuming would train other batches from its position; {fix}")


def clear_training_state(out_dir: Path) -> None:
    """Delete the resumable checkpoints (e.g. when the training inputs changed and resuming would be wrong)."""
    shutil.rmtree(Path(out_dir) / TRAINING_STATE_DIR, ignore_errors=True)
    (Path(out_dir) / "training_state.pt").unlink(missing_ok=True)       # the walking skeleton's single file
