"""Each features backend's memory model: what one rank of it holds on a GPU and the problems of that fit, from the
config alone (target.memory counts the bytes). A row of the backend table names its model (features.backends,
Backend.memory); backend_facts adds what every backend shares: the checkpoint as stored, bf16 bytes per rank at
each size, and the smallest backend and size that fit one GPU.

Legend: W ranks (= features.tp_size, one GPU each). Bytes are of weights only; activations and the CUDA context
take the rest of a GPU (memory.FIT_FRACTION).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from eagle3_core.target.family import text_config
from eagle3_core.target.memory import (
    FIT_FRACTION,
    SGLANG_DEFAULT_MEM_FRACTION,
    ep_int4_bytes_per_rank,
    ep_int4_scheme_problems,
    head_divisibility,
    kv_bytes_per_token,
    meta_model,
    param_bytes_per_rank,
    quantization,
    routed_experts,
    sglang_bytes_per_rank,
    stored_bytes,
    uneven_experts,
)


@dataclass(frozen=True)
class TargetMemory:
    """What a memory model reads of a run's target (target_memory). f: cfg.features; t: the text config; model:
    memory.meta_model; q: the quantization_config (None: bf16); stored: memory.stored_bytes; sizes: the W counted;
    per_rank: {W: bf16 parameter bytes per rank under transformers' plans}; int4: {W: bytes per rank with the routed
    experts kept INT4 as stored (ep_int4_bytes_per_rank)}, empty unless the experts are stored in the one scheme
    'ep_int4' reads, W only where it divides them; gpus: (count, bytes per GPU) or None (no GPU); budget:
    FIT_FRACTION of one GPU in bytes, None without GPUs."""
    f: object
    t: object
    model: torch.nn.Module
    q: dict | None
    stored: dict
    sizes: list[int]
    per_rank: dict[int, int]
    int4: dict[int, int]
    gpus: tuple[int, int] | None
    budget: float | None


@dataclass(frozen=True)
class Fit:
    """A memory model's answer. bytes_per_gpu: the weights one rank holds (None: not known at this size);
    problems: (field, message) pairs; facts: the model's own, reported after the shared ones; budget_field: the
    field a weights overrun of FIT_FRACTION of one GPU names (None: no such check, because the model weighs its own
    budget, or because the backend loads the whole target in one process, which checkers.backends_check weighs)."""
    bytes_per_gpu: int | None
    problems: list[tuple[str, str]] = field(default_factory=list)
    facts: dict = field(default_factory=dict)
    budget_field: str | None = None


MemoryModel = Callable[[TargetMemory], Fit]


def target_memory(cfg, tcfg, gpus: tuple[int, int] | None, expert_parallel: bool) -> TargetMemory:
    """TargetMemory of `cfg`'s target (its config `tcfg`) at W = 1, 2, 4, ..., 64 and features.tp_size, bf16 bytes
    per rank counted with the experts split by expert where `expert_parallel` (and W > 1)."""
    f, t = cfg.features, text_config(tcfg)
    model = meta_model(tcfg, cfg.target.trust_remote_code)
    q = quantization(tcfg)
    stored = stored_bytes(model, q)
    sizes = sorted({1, 2, 4, 8, 16, 32, 64, f.tp_size})
    per_rank = {w: param_bytes_per_rank(model, w, expert_parallel and w > 1) for w in sizes}
    int4 = ({w: ep_int4_bytes_per_rank(model, q, w, f.shard_attention) for w in sizes
             if w > 1 and not uneven_experts(t, w)}
            if stored["experts_quantized"] and not ep_int4_scheme_problems(model, q) else {})
    return TargetMemory(f, t, model, q, stored, sizes, per_rank, int4, gpus,
                        FIT_FRACTION * gpus[1] if gpus else None)


def whole_target_fit(m: TargetMemory) -> Fit:
    """'hf' (and any backend that loads the whole target in the calling process): the bf16 parameters at
    features.tp_size (1). Whether they fit is checkers.backends_check's in-process verdict, not a problem here."""
    return Fit(m.per_rank[m.f.tp_size])


def _split_heads(m: TargetMemory) -> list[tuple[str, str]]:
    return [("features.tp_size", msg + ": the tensor-parallel plan splits whole heads")
            for msg in head_divisibility(m.t, m.f.tp_size)]


def tensor_parallel_fit(m: TargetMemory) -> Fit:
    """'hf_tp': bf16 parameters per rank under transformers' plans (it dequantizes a compressed-tensors checkpoint
    to bf16 at load); heads must split evenly; an overrun names features.backend where 'ep_int4' could keep the
    experts INT4, else features.tp_size."""
    return Fit(m.per_rank[m.f.tp_size], _split_heads(m),
               budget_field="features.backend" if m.int4 else "features.tp_size")


def ep_int4_fit(m: TargetMemory) -> Fit:
    """'ep_int4': the routed experts kept INT4 as stored, 1/W of them per rank (memory.ep_int4_bytes_per_rank);
    problems: heads, experts not quantized, W not dividing the routed experts, a scheme it cannot read
    (memory.ep_int4_scheme_problems)."""
    f, problems = m.f, _split_heads(m)
    if not m.stored["experts_quantized"]:
        problems.append(("features.backend", "'ep_int4' keeps routed experts as the checkpoint stores them, "
                         "but this checkpoint's experts are not quantized (no quantization_config targets "
                         "them): use 'hf_tp' (or 'hf' where the target fits one GPU)"))
    elif uneven_experts(m.t, f.tp_size):
        problems.append(("features.tp_size", f"{f.tp_size} must divide the {routed_experts(m.t)} routed experts "
                         f"(each rank holds whole experts)"))
    return Fit(m.int4.get(f.tp_size), problems + ep_int4_scheme_problems(m.model, m.q),
               budget_field="features.tp_size")


def sglang_fit(m: TargetMemory) -> Fit:
    """'sglang': weights per rank in SGLang's layout (memory.sglang_bytes_per_rank) plus the KV cache of one
    prefill batch (features.batch_tokens tokens, memory.kv_bytes_per_token) against SGLang's static share of a GPU
    (features.mem_fraction_static, SGLANG_DEFAULT_MEM_FRACTION when None); activations take the rest."""
    f, t = m.f, m.t
    weights, kv = sglang_bytes_per_rank(m.model, m.q, f.tp_size), kv_bytes_per_token(t, f.tp_size) * f.batch_tokens
    frac = f.mem_fraction_static or SGLANG_DEFAULT_MEM_FRACTION
    facts = {"kv_gb_per_batch": round(kv / 1e9, 2),
             "mem_fraction_static": f.mem_fraction_static or f"None (SGLang's default; counted {frac})",
             "expert_parallel": f.expert_parallel}
    problems = [("features.tp_size", msg + ": SGLang's tensor parallelism splits whole heads")
                for msg in head_divisibility(t, f.tp_size)]
    if f.expert_parallel and uneven_experts(t, f.tp_size):
        problems.append(("features.expert_parallel", f"SGLang's ep_size = tp_size = {f.tp_size} must divide the "
                         f"{routed_experts(t)} routed experts; set it false (experts split by slice)"))
    if m.gpus and weights + kv > frac * m.gpus[1]:
        problems.append(("features.tp_size", f"{weights / 1e9:.1f} GB of weights and {kv / 1e9:.1f} GB of KV cache "
                         f"per GPU with backend 'sglang' at tp_size {f.tp_size} exceed mem_fraction_static {frac} "
                         f"of one GPU ({m.gpus[1] / 1e9:.0f} GB): raise features.tp_size or "
                         f"features.mem_fraction_static, or lower features.batch_tokens"))
    return Fit(weights, problems, facts)


def backend_facts(cfg, tcfg, gpus: tuple[int, int] | None, model: MemoryModel | None = None,
                  expert_parallel: bool = False) -> tuple[dict, list[tuple[str, str]]]:
    """(facts, problems) of features.backend on `gpus` (count, bytes per GPU; None: no GPU, then the ranks share
    this host's RAM and only the layout is reported), `model` being its row's memory model (None: an unknown
    backend, the shared facts alone) and `expert_parallel` whether the row always splits experts by expert.

    Facts: the checkpoint's bytes as stored (total, routed experts, their quantization), bf16 parameter GB per rank
    at each size, GB per rank with the routed experts kept as stored where they are quantized, the chosen backend's
    GB per GPU (its model's), the smallest backend and size that fit one GPU (`needs`), then the model's own facts.
    Problems: the model's, then an overrun of FIT_FRACTION of one GPU naming its Fit.budget_field."""
    f = cfg.features
    m = target_memory(cfg, tcfg, gpus, f.expert_parallel or expert_parallel)
    fit = model(m) if model is not None else Fit(None)
    q, stored = m.q, m.stored
    facts = {"chosen": f.backend, "tp_size": f.tp_size, "expert_parallel": f.expert_parallel or expert_parallel,
             "checkpoint_gb": {"total": round(stored["total"] / 1e9, 2),
                               "routed_experts": round(stored["routed_experts"] / 1e9, 2),
                               "quantization": _scheme(q) if stored["experts_quantized"] else "none (bf16)"},
             "param_gb_per_rank_bf16": {w: round(b / 1e9, 2) for w, b in m.per_rank.items()},
             "gpus": f"{gpus[0]} x {gpus[1] / 1e9:.0f} GB" if gpus else "none (CPU: ranks share the RAM)"}
    if m.int4:
        facts["gb_per_rank_ep_int4"] = {w: round(b / 1e9, 2) for w, b in m.int4.items()}
    if fit.bytes_per_gpu is not None:
        facts["gb_per_gpu"] = round(fit.bytes_per_gpu / 1e9, 2)
    if m.budget is not None:
        facts["weights_budget_gb_per_gpu"] = f"{m.budget / 1e9:.1f} ({FIT_FRACTION:.0%} of {gpus[1] / 1e9:.0f} GB)"
        facts["needs"] = _needs(m)
    facts.update(fit.facts)
    problems = list(fit.problems)
    if m.budget is not None and fit.budget_field and fit.bytes_per_gpu is not None and fit.bytes_per_gpu > m.budget:
        problems.append((fit.budget_field, f"{fit.bytes_per_gpu / 1e9:.1f} GB of weights per GPU with backend "
                         f"{f.backend!r} at tp_size {f.tp_size} exceed {FIT_FRACTION:.0%} of one GPU "
                         f"({gpus[1] / 1e9:.0f} GB); needs {facts['needs']}"))
    if gpus and f.tp_size > gpus[0]:
        facts["hosts"] = f"tp_size {f.tp_size} > {gpus[0]} GPUs here: torchrun over several hosts (nnodes)"
    return facts, problems


def _scheme(q: dict) -> str:
    w = next(iter((q.get("config_groups") or {}).values()), {}).get("weights") or {}
    return (f"{w.get('type')}{w.get('num_bits')} {w.get('strategy')} {w.get('group_size') or ''} "
            f"({q.get('quant_method')} {q.get('format')})").replace("  ", " ")


def _needs(m: TargetMemory) -> str:
    """The smallest way to fit one GPU: the whole target ('hf'), else 'ep_int4' at the fewest ranks, else 'hf_tp'."""
    fitting = [w for w in m.sizes if m.per_rank[w] <= m.budget and not head_divisibility(m.t, w)]
    if fitting and fitting[0] == 1:
        return "hf (the whole target fits one GPU)"
    fits4 = [w for w, b in m.int4.items() if b <= m.budget and not head_divisibility(m.t, w)]
    if fits4:
        return (f"ep_int4 with tp_size >= {fits4[0]} ({m.int4[fits4[0]] / 1e9:.1f} GB per GPU with the routed "
                f"experts kept as stored, at most {FIT_FRACTION:.0%} of one)")
    if fitting:
        return (f"hf_tp with tp_size >= {fitting[0]} ({m.per_rank[fitting[0]] / 1e9:.1f} GB of bf16 weights per "
                f"GPU, at most {FIT_FRACTION:.0%} of one)")
    return f"more than {m.sizes[-1]} GPUs of {m.gpus[1] / 1e9:.0f} GB"
