"""Which features backend a target needs: its parameter bytes per GPU at a parallel size, from the config alone.

Legend: W ranks (= features.tp_size, one GPU each), P parameters.
The model is built on the meta device (no weights, no memory: ~4 s for a 1T-parameter Kimi-K2.5 config) and its
parameters are laid out with transformers' own resolved plans (`_resolve_parallel_plans`, the step
`from_pretrained(distributed_config=...)` runs before sharding, transformers/distributed/mixin.py): a parameter
under a sharding style holds ceil(numel / W) elements per rank, any other parameter (norms, routers, MLA's
projections, which DeepseekV3's plan leaves whole) is whole on every rank. Bytes are bf16 (load_target's GPU
dtype); activations and the CUDA context are not in them, hence the headroom FIT_FRACTION.
"""
from __future__ import annotations

import math
import re

import torch

# styles that split a parameter over the ranks (transformers/distributed/tensor_parallel.py and expert_parallel.py
# register them); any other style keeps the parameter whole: counting it whole can only over-estimate
SHARDING_STYLES = {"colwise", "colwise_rep", "colwise_gather_output", "rowwise", "rowwise_rep", "packed_colwise",
                   "packed_rowwise", "embedding_rowwise", "embedding_colwise", "grouped_gemm"}
ROW_STYLES = {"rowwise", "rowwise_rep", "packed_rowwise"}          # their 1-D parameters (biases) stay whole
FIT_FRACTION = 0.85          # of one GPU's memory for the weights; the rest: activations of batch_tokens, context
BYTES_PER_PARAM = 2          # bf16


def meta_model(tcfg, trust_remote_code: bool = False) -> torch.nn.Module:
    """The target's model class built from its config on the meta device (shapes only, no memory)."""
    from eagle3_core.target.loading import auto_model_class
    with torch.device("meta"):
        return auto_model_class(tcfg, type(tcfg).__name__).from_config(tcfg, dtype=torch.bfloat16,
                                                                  trust_remote_code=trust_remote_code)


def param_bytes_per_rank(model: torch.nn.Module, tp_size: int, expert_parallel: bool = False) -> int:
    """Parameter bytes (bf16) one rank holds with `model` (meta_model) sharded over `tp_size` ranks by
    transformers' plans (expert_parallel: the EP plan for the experts, ep_size = tp_size). tp_size 1: the whole
    model. Raises ValueError (from transformers) for a model with no plan for the sizes asked."""
    params = dict(model.named_parameters())
    if tp_size == 1:
        return BYTES_PER_PARAM * sum(p.numel() for p in params.values())
    from transformers.distributed import DistributedConfig
    tp_plan, ep_plan, _ = model._resolve_parallel_plans(
        DistributedConfig(tp_size=tp_size, ep_size=tp_size if expert_parallel else 1))
    total = 0
    for name, p in params.items():
        style = ep_plan.get(name) or tp_plan.get(name)
        split = style in SHARDING_STYLES and not (style in ROW_STYLES and p.dim() == 1)
        total += math.ceil(p.numel() / tp_size) if split else p.numel()
    return BYTES_PER_PARAM * total


INT4_BYTES_PER_PARAM = 0.5625   # pack-quantized INT4, group 32: 4 bits + a bf16 scale per 32 weights
# what target.ep_loading splits over the ranks (the rest is whole on every rank)
EP_INT4_SPLIT = (".self_attn.q_b_proj.", ".self_attn.q_proj.", ".self_attn.kv_b_proj.", ".self_attn.o_proj.",
                 ".mlp.gate_proj.", ".mlp.up_proj.", ".mlp.down_proj.", ".shared_experts.")


def int4_bytes_per_rank(model: torch.nn.Module, world: int) -> int:
    """Bytes one of `world` ranks holds under the `ep_int4` backend (target.ep_loading's plan) for `model`
    (meta_model): routed experts 1/world at INT4_BYTES_PER_PARAM, the split layers 1/world in bf16, the rest whole
    in bf16, plus the one dequantized layer (its 1/world of one layer's experts in bf16)."""
    total, per_layer = 0.0, {}
    for name, p in model.named_parameters():
        if (m := re.search(r"layers\.(\d+)\.mlp\.experts\.", name)) is not None:
            total += INT4_BYTES_PER_PARAM * p.numel() / world
            per_layer[m.group(1)] = per_layer.get(m.group(1), 0) + p.numel()
        elif any(k in name for k in EP_INT4_SPLIT):
            total += BYTES_PER_PARAM * p.numel() / world
        else:
            total += BYTES_PER_PARAM * p.numel()
    return int(total + BYTES_PER_PARAM * max(per_layer.values(), default=0) / world)


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


def backend_facts(cfg, tcfg, gpus: tuple[int, int] | None) -> tuple[dict, list[tuple[str, str]]]:
    """(facts, problems) of the features backend `cfg.features` asks for, on `gpus` (count, bytes per GPU; None:
    no GPU, then the 'hf_tp' ranks share this host's RAM and only the layout is reported). Facts: parameter GB per
    rank at tp_size 1, 2, 4, 8 and the chosen one, the smallest size that fits one GPU (`needs`). Problems: the
    chosen size does not fit, heads not divisible by it, more ranks than GPUs (one host)."""
    from eagle3_core.target.family import text_config
    f, t = cfg.features, text_config(tcfg)
    model = meta_model(tcfg, cfg.target.trust_remote_code)
    sizes = sorted({1, 2, 4, 8, 16, 32, 64, f.tp_size})
    per_rank = {w: param_bytes_per_rank(model, w, f.expert_parallel and w > 1) for w in sizes}
    budget = FIT_FRACTION * gpus[1] if gpus else None
    facts = {"chosen": f.backend, "tp_size": f.tp_size, "expert_parallel": f.expert_parallel,
             "param_gb_per_rank_bf16": {w: round(b / 1e9, 2) for w, b in per_rank.items()},
             "gpus": f"{gpus[0]} x {gpus[1] / 1e9:.0f} GB" if gpus else "none (CPU: ranks share the RAM)"}
    if budget is not None:
        fitting = [w for w in sizes if per_rank[w] <= budget and not head_divisibility(t, w)]
        facts["needs"] = ("hf (the whole target fits one GPU)" if fitting and fitting[0] == 1 else
                          f"hf_tp with tp_size >= {fitting[0]} ({per_rank[fitting[0]] / 1e9:.1f} GB of bf16 weights "
                          f"per GPU, at most {FIT_FRACTION:.0%} of one)" if fitting else
                          f"more than {sizes[-1]} GPUs of {gpus[1] / 1e9:.0f} GB")
    problems = []
    if f.backend == "ep_int4":
        int4 = int4_bytes_per_rank(model, f.tp_size)
        facts["int4_gb_per_rank"] = round(int4 / 1e9, 2)
        if budget is not None and int4 > budget:
            problems.append(("features.tp_size", f"{int4 / 1e9:.1f} GB per GPU with INT4 experts at tp_size "
                             f"{f.tp_size} exceed {FIT_FRACTION:.0%} of one GPU ({gpus[1] / 1e9:.0f} GB)"))
    if f.backend == "hf_tp":
        problems += [("features.tp_size", m + ": transformers' tensor-parallel plan splits whole heads")
                     for m in head_divisibility(t, f.tp_size)]
        if budget is not None and per_rank[f.tp_size] > budget:
            problems.append(("features.tp_size", f"{per_rank[f.tp_size] / 1e9:.1f} GB of bf16 weights per GPU at "
                             f"tp_size {f.tp_size} exceed {FIT_FRACTION:.0%} of one GPU ({gpus[1] / 1e9:.0f} "
                             f"GB); needs {facts['needs']}"))
        if gpus and f.tp_size > gpus[0]:
            facts["hosts"] = f"tp_size {f.tp_size} > {gpus[0]} GPUs here: torchrun over several hosts (nnodes)"
    return facts, problems
