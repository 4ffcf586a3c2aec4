"""A target's bytes per GPU at a parallel size, from the config alone: the counts each features backend's memory
model (target.memory_fit) is built of.

Legend: W ranks (= features.tp_size, one GPU each), P parameters.
The model is built on the meta device (no weights, no memory: ~4 s for a 1T-parameter Kimi-K2.5 config) and its
parameters are laid out with transformers' own resolved plans (`_resolve_parallel_plans`, the step
`from_pretrained(distributed_config=...)` runs before sharding, transformers/distributed/mixin.py): a parameter
under a sharding style holds ceil(numel / W) elements per rank, any other parameter (norms, routers, MLA's
projections, which DeepseekV3's plan leaves whole) is whole on every rank. Bytes are bf16 (load_target's GPU
dtype); activations and the CUDA context are not in them, hence the headroom FIT_FRACTION.

Bytes as stored: a checkpoint with a compressed-tensors `quantization_config` (Kimi-K2.5: routed experts as INT4,
group 32, symmetric, `pack-quantized`) stores each matched Linear as packed weights plus one bf16 scale per group:
num_bits / 8 + 2 / group_size bytes a parameter (0.5625 for INT4 / 32). Matching follows compressed-tensors
(`src/compressed_tensors/utils/match.py`): an `ignore` or `targets` entry 're:P' matches a module whose full name
re.match-es P, any other entry equals the module's name or its class name ('Linear'). transformers fuses a MoE
layer's experts into 3-D parameters (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]); the
checkpoint names them per expert (`mlp.experts.K.gate_proj` ...), which is how they are matched here.
"""
from __future__ import annotations

import math
import re

import torch

from eagle3_core.target.int4_layout import GROUP
from eagle3_core.target.loading import auto_model_class, distributed_config

# styles that split a parameter over the ranks (transformers/distributed/tensor_parallel.py and expert_parallel.py
# register them); any other style keeps the parameter whole: counting it whole can only over-estimate
SHARDING_STYLES = {"colwise", "colwise_rep", "colwise_gather_output", "rowwise", "rowwise_rep", "packed_colwise",
                   "packed_rowwise", "embedding_rowwise", "embedding_colwise", "grouped_gemm"}
ROW_STYLES = {"rowwise", "rowwise_rep", "packed_rowwise"}          # their 1-D parameters (biases) stay whole
FIT_FRACTION = 0.85          # of one GPU's memory for the weights; the rest: activations of batch_tokens, context
BYTES_PER_PARAM = 2          # bf16


_META: dict[tuple[str, bool], torch.nn.Module] = {}          # the last few meta models, by config JSON


def meta_model(tcfg, trust_remote_code: bool = False) -> torch.nn.Module:
    """The target's model class built from its config on the meta device (shapes only, no memory; ~5 s for
    Kimi-K2.5 on 2 cores, so the last 4 are kept, keyed by the config's JSON). Treat it as read-only."""
    key = (tcfg.to_json_string(use_diff=False), trust_remote_code)
    if key not in _META:
        with torch.device("meta"):
            model = auto_model_class(tcfg, type(tcfg).__name__).from_config(tcfg, dtype=torch.bfloat16,
                                                                       trust_remote_code=trust_remote_code)
        while len(_META) >= 4:
            _META.pop(next(iter(_META)))
        _META[key] = model
    return _META[key]


def param_bytes_per_rank(model: torch.nn.Module, tp_size: int, expert_parallel: bool = False) -> int:
    """Parameter bytes (bf16) one rank holds with `model` (meta_model) sharded over `tp_size` ranks by
    transformers' plans (expert_parallel: the EP plan for the experts, ep_size = tp_size). tp_size 1: the whole
    model. Raises ValueError (from transformers) for a model with no plan for the sizes asked."""
    params = dict(model.named_parameters())
    if tp_size == 1:
        return BYTES_PER_PARAM * sum(p.numel() for p in params.values())
    tp_plan, ep_plan, _ = model._resolve_parallel_plans(distributed_config(tp_size, tp_size if expert_parallel else 1))
    total = 0
    for name, p in params.items():
        style = ep_plan.get(name) or tp_plan.get(name)
        split = style in SHARDING_STYLES and not (style in ROW_STYLES and p.dim() == 1)
        total += math.ceil(p.numel() / tp_size) if split else p.numel()
    return BYTES_PER_PARAM * total


def quantization(tcfg) -> dict | None:
    """The checkpoint's `quantization_config` as a dict (the wrapper's or its text model's), None if it has none."""
    for c in (tcfg, getattr(tcfg, "text_config", None)):
        q = getattr(c, "quantization_config", None) if c is not None else None
        if q:
            return q if isinstance(q, dict) else q.to_dict()
    return None


def _matches(entry: str, name: str, cls: str) -> bool:
    return bool(re.match(entry[3:], name)) if entry.startswith("re:") else entry in (name, cls)


def stored_bytes_per_param(name: str, cls: str, q: dict | None) -> float:
    """Bytes a parameter of Linear module `name` (class `cls`) takes in the checkpoint: 2 (bf16) unless a
    config group of compressed-tensors config `q` targets it and `ignore` does not. Raises ValueError for a
    weights scheme other than int/float with strategy 'group' or 'channel' (the field named)."""
    if not q or any(_matches(e, name, cls) for e in q.get("ignore") or []):
        return BYTES_PER_PARAM
    for group in (q.get("config_groups") or {}).values():
        if any(_matches(e, name, cls) for e in group.get("targets") or []):
            w = group.get("weights") or {}
            if w.get("strategy") == "group":
                return w["num_bits"] / 8 + BYTES_PER_PARAM / w["group_size"]
            if w.get("strategy") == "channel":
                return w["num_bits"] / 8
            raise ValueError(f"quantization_config: weights strategy {w.get('strategy')!r} of a group targeting "
                             f"{name} is not counted; known: 'group', 'channel'")
    return BYTES_PER_PARAM


def _fused_experts(module) -> bool:
    return all(isinstance(getattr(module, n, None), torch.nn.Parameter) and getattr(module, n).dim() == 3
               for n in ("gate_up_proj", "down_proj"))


def stored_bytes(model: torch.nn.Module, q: dict | None) -> dict:
    """{total, routed_experts (bytes), experts_quantized (bool)} of `model`'s parameters as the checkpoint stores
    them (module docstring), from a meta_model: fused experts counted as the per-expert Linears they are stored as,
    every other parameter in bf16 (the checkpoints' dtype; transformers keeps e.g. DeepseekV3's router in fp32 in
    memory) unless its Linear is quantized; a tied parameter once."""
    total = experts = 0
    quantized, seen = False, set()
    for name, module in model.named_modules():
        own = {n: p for n, p in module.named_parameters(recurse=False) if id(p) not in seen}   # tied: once
        seen.update(id(p) for p in own.values())
        if _fused_experts(module):
            for pname, stored_as in (("gate_up_proj", "gate_proj"), ("down_proj", "down_proj")):
                per = stored_bytes_per_param(f"{name}.0.{stored_as}", "Linear", q)
                quantized |= per < BYTES_PER_PARAM
                experts += own.pop(pname).numel() * per
        for pname, p in own.items():
            total += p.numel() * (stored_bytes_per_param(name, type(module).__name__, q) if pname == "weight" and
                                  isinstance(module, torch.nn.Linear) else BYTES_PER_PARAM)
    return {"total": int(total + experts), "routed_experts": int(experts), "experts_quantized": quantized}


def _expert_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for m in model.modules() if _fused_experts(m) for p in m.parameters(recurse=False))


# what target.ep_loading splits over the ranks in bf16 (MLA's head projections, the dense and shared MLPs); the
# rest (embeddings, lm_head, norms, routers, MLA's low-rank a-projections) is whole on every rank
EP_INT4_SPLIT = (".self_attn.q_b_proj.", ".self_attn.q_proj.", ".self_attn.kv_b_proj.", ".self_attn.o_proj.",
                 ".mlp.gate_proj.", ".mlp.up_proj.", ".mlp.down_proj.", ".shared_experts.")
EP_INT4_ATTENTION = (".self_attn.",)


def ep_int4_bytes_per_rank(model: torch.nn.Module, q: dict | None, world: int, shard_attention: bool = True) -> int:
    """Bytes one of `world` ranks holds with backend 'ep_int4' (target.ep_loading's plan): 1/world of the routed
    experts as stored (stored_bytes; each rank reads only its experts), the EP_INT4_SPLIT layers 1/world in bf16
    (attention whole when not shard_attention), every other parameter whole in bf16, and one MoE layer of the
    rank's experts dequantized to bf16 (the reused buffer)."""
    total, layer = stored_bytes(model, q)["routed_experts"] / world, 0
    for m in model.modules():
        if _fused_experts(m):
            layer = max(layer, sum(p.numel() for p in m.parameters(recurse=False)))
    experts = {id(p) for m in model.modules() if _fused_experts(m) for p in m.parameters(recurse=False)}
    for name, p in model.named_parameters():
        if id(p) in experts:
            continue
        split = any(k in name for k in EP_INT4_SPLIT) and (shard_attention or not any(
            k in name for k in EP_INT4_ATTENTION))
        total += BYTES_PER_PARAM * p.numel() / (world if split else 1)
    return int(total + BYTES_PER_PARAM * math.ceil(layer / world))


# the one packing 'ep_int4' implements (target.int4_experts, Kimi-K2.5's layout): compressed-tensors
# `pack-quantized` weights, 4-bit int, symmetric (no weight_zero_point), groups of GROUP inputs
EP_INT4_SCHEME = {"format": "pack-quantized", "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                  "group_size": GROUP}


def ep_int4_scheme_problems(model: torch.nn.Module, q: dict | None) -> list[tuple[str, str]]:
    """[('features.backend', message)] naming each field of the `q` config group that quantizes the routed experts
    of `model` (a meta_model; matched as stored_bytes matches them) that differs from EP_INT4_SCHEME, and what
    works instead; empty when it matches or no group quantizes them."""
    name = next((f"{n}.0.gate_proj" for n, m in model.named_modules() if _fused_experts(m)), None)
    if not q or name is None or any(_matches(e, name, "Linear") for e in q.get("ignore") or []):
        return []
    groups = q.get("config_groups") or {}
    g = next((g for g, c in groups.items() if any(_matches(e, name, "Linear") for e in c.get("targets") or [])), None)
    if g is None:
        return []
    have = {**(groups[g].get("weights") or {}), "format": groups[g].get("format") or q.get("format")}
    bad = [f"quantization_config.{'' if k == 'format' else f'config_groups.{g}.weights.'}{k} = {have.get(k)!r} "
           f"(needs {v!r})" for k, v in EP_INT4_SCHEME.items() if have.get(k) != v]
    return [("features.backend", f"'ep_int4' implements only routed experts stored as compressed-tensors "
             f"'pack-quantized' 4-bit int, symmetric, group size {GROUP} (Kimi-K2.5's layout), and this "
             f"checkpoint's differ: {'; '.join(bad)}; it would misread them (an asymmetric checkpoint's "
             f"weight_zero_point would be ignored): use 'hf_tp' (transformers dequantizes compressed-tensors "
             f"checkpoints to bf16 at load) or 'sglang' (its own compressed-tensors MoE kernels)")] if bad else []


# what SGLang's model files split over the tensor-parallel ranks (models/deepseek_v2.py, llama.py: attention's
# column/row-parallel projections, the dense and shared MLPs, the vocab-parallel embedding and lm_head); routed
# experts split by expert or by slice, as stored (its compressed-tensors MoE keeps INT4); the rest (norms, routers,
# MLA's ReplicatedLinear q_a / kv_a projections, a vision tower) whole on every rank
SGLANG_SPLIT = EP_INT4_SPLIT + (".self_attn.k_proj.", ".self_attn.v_proj.", "embed_tokens.", "lm_head.")
SGLANG_DEFAULT_MEM_FRACTION = 0.8        # counted when features.mem_fraction_static is None (SGLang's own default
#                                          depends on the GPU, server_args.py _handle_gpu_memory_settings)


def sglang_bytes_per_rank(model: torch.nn.Module, q: dict | None, world: int) -> int:
    """Weight bytes one of `world` ranks holds with backend 'sglang' (SGLang's tensor-parallel layout): routed
    experts as stored (stored_bytes) / world, the SGLANG_SPLIT parameters / world in bf16, every other parameter
    whole in bf16. An estimate from the config: SGLang's padding of the vocab and of kv heads below the rank count
    is left out."""
    total = stored_bytes(model, q)["routed_experts"] / world
    experts = {id(p) for m in model.modules() if _fused_experts(m) for p in m.parameters(recurse=False)}
    for name, p in model.named_parameters():
        if id(p) not in experts:
            total += BYTES_PER_PARAM * p.numel() / (world if any(k in name for k in SGLANG_SPLIT) else 1)
    return int(total)


def kv_bytes_per_token(t, world: int) -> int:
    """KV-cache bytes (bf16) one rank holds per token of text config `t`: MLA's latent (kv_lora_rank +
    qk_rope_head_dim per layer, the same on every rank), else 2 x ceil(kv heads / world) x head_dim per layer."""
    L = t.num_hidden_layers
    if getattr(t, "kv_lora_rank", None):
        return BYTES_PER_PARAM * L * (t.kv_lora_rank + t.qk_rope_head_dim)
    heads = getattr(t, "num_key_value_heads", None) or t.num_attention_heads
    hd = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    return BYTES_PER_PARAM * L * 2 * math.ceil(heads / world) * hd


def gpu_memory() -> tuple[int, int] | None:
    """(GPU count, bytes of the smallest GPU) on this host, None without CUDA."""
    if not torch.cuda.is_available():
        return None
    n = torch.cuda.device_count()
    return n, min(torch.cuda.get_device_properties(i).total_memory for i in range(n))


def head_divisibility(t, tp_size: int) -> list[str]:
    """Why `tp_size` cannot split the attention of text config `t` evenly (transformers' column-wise q/k/v plan
    needs whole heads per rank), empty when it can or when the plan leaves attention whole (MLA)."""
    if getattr(t, "kv_lora_rank", None):                    # MLA: DeepseekV3's plan does not shard attention
        return []
    out = []
    for field in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(t, field, None)
        if n is not None and n % tp_size:
            out.append(f"{field} = {n} is not a multiple of features.tp_size = {tp_size}")
    return out


def routed_experts(t) -> int:
    """The routed experts of text config `t` (n_routed_experts, num_local_experts or num_experts), 0 for none."""
    return next((getattr(t, f) for f in ("n_routed_experts", "num_local_experts", "num_experts")
                 if getattr(t, f, None)), 0)


def uneven_experts(t, world: int) -> bool:
    """True when `world` ranks cannot each hold whole routed experts of `t` (none, or `world` not dividing them)."""
    return not routed_experts(t) or routed_experts(t) % world != 0
