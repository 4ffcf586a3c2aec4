"""Routed experts kept in the checkpoint's packed INT4 layout, and the sharded MoE / MLA pieces of the `ep_int4`
features backend (DeepSeek-V3 and Kimi-K2.5 text models; the loader is target.ep_loading).

Legend: N tokens, k experts per token (num_experts_per_tok), E_l experts this rank holds, H hidden, I expert width
(moe_intermediate_size), G = 32 inputs per quantization group, W ranks.

The layout is compressed-tensors' `pack-quantized` format as Kimi-K2.5's published checkpoint uses it (4-bit,
symmetric, `strategy: group`, group size 32; vllm-project/compressed-tensors `compressors/pack_quantized/`): per
expert matrix [out, in] the tensors `weight_packed` int32 [out, in/8] (input j in nibble j % 8 of word j // 8,
lowest nibble first, stored as q + 8), `weight_scale` [out, in/32] (bf16) and `weight_shape` [2]. The weight is
`q * scale` computed in the scale's dtype, one rounding: `dequantize_int4` does exactly that (bit for bit what
compressed-tensors' `unpack_from_int32` + `dequantize` give; tests/test_int4_experts.py), on GPU in one Triton
kernel (target.int4_kernel) that reads 0.5625 bytes per weight and writes 2.

`Int4Experts` holds E_l experts packed (gate and up stacked as transformers' `gate_up_proj` is: gate rows first)
and, at each forward, dequantizes the whole layer into one buffer shared by all layers of the same shape (so a
rank holds its experts at 0.5625 B/weight plus one layer in bf16), then runs the grouped SwiGLU expert matmul over
the tokens routed to its experts (F.grouped_mm on CUDA, one matmul per expert elsewhere); routing, weights and the
summation order are those of transformers' eager `DeepseekV3Experts.forward`
(transformers/models/deepseek_v3/modeling_deepseek_v3.py), the weight applied to the activation before down_proj.
"""
from __future__ import annotations

import sys
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from eagle3_core.target.int4_layout import GROUP, NIBBLES


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., K/8] -> int8 [..., K] in [-8, 7] (compressed-tensors' 4-bit packing, offset 8). Raises
    ValueError for another dtype or a big-endian host (the byte view below assumes little-endian words)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"weight_packed has dtype {packed.dtype}; pack-quantized INT4 stores int32 words")
    if sys.byteorder != "little":
        raise ValueError("unpack_int4 reads the words' bytes in little-endian order; this host is big-endian")
    b = packed.contiguous().view(torch.uint8)                  # byte j of a word: inputs 2j (low), 2j + 1 (high)
    q = torch.stack((b & 0xF, b >> 4), dim=-1).view(*packed.shape[:-1], packed.shape[-1] * NIBBLES)
    return q.view(torch.int8) - 8


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """W = q * scale for packed [..., R, K/8] int32 and scale [..., R, K/32] (its dtype is W's, as in
    compressed-tensors' `dequantize`): [..., R, K] in scale.dtype, written into `out` when given (any float dtype
    of that shape: the scale-dtype result is cast once). CUDA tensors with bf16/fp16 scales use the fused Triton
    kernel (target.int4_kernel), bit-identical to this reference. Raises ValueError on mismatched shapes."""
    K = packed.shape[-1] * NIBBLES
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * GROUP != K:
        raise ValueError(f"weight_scale {tuple(scale.shape)} does not match weight_packed {tuple(packed.shape)} "
                         f"at group size {GROUP}")
    if packed.is_cuda and scale.dtype in (torch.bfloat16, torch.float16):
        from eagle3_core.target.int4_kernel import dequantize_cuda  # optional: Triton, on CUDA hosts only
        if out is None or out.dtype == scale.dtype:
            return dequantize_cuda(packed, scale, out)
    q = unpack_int4(packed).view(*scale.shape, GROUP).to(scale.dtype)
    w = (q * scale.unsqueeze(-1)).view(*packed.shape[:-1], K)
    if out is None:
        return w
    return out.copy_(w)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


class RowParallel(nn.Module):
    """A linear layer holding a slice of the input features (columns of W) on each rank: y = all_reduce(x W_r^T),
    the row-parallel half of Megatron-LM's MLP/attention split (Shoeybi et al. 2019, arXiv:1909.08053)."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(self.linear(x), self.group)


class Int4Experts(nn.Module):
    """Experts [first, first + E_l) of one MoE layer, packed INT4, with the call signature of transformers'
    `DeepseekV3Experts`: forward(hidden [N, H], top_k_index int64 [N, k], top_k_weights fp32 [N, k]) -> [N, H] in
    hidden's dtype, the sum over this rank's experts only (zero rows for tokens routed elsewhere).

    Buffers: gate_up_packed int32 [E_l, 2I, H/8], gate_up_scale [E_l, 2I, H/32], down_packed int32 [E_l, H, I/8],
    down_scale [E_l, H, I/32]. dtype: the compute dtype the layer's weights are dequantized to. fused: on CUDA with
    bf16, both matmuls read the packed words and dequantize in registers (target.int4_grouped_mm) instead of
    dequantizing the layer into the shared buffer; off by default: on one H100 (2026-12-07) the layer took 6.80 ms
    fused against 6.53 ms through the buffer (benchmarks/int4_ep_throughput.py, row experts_int4_fused)."""

    _buffers_by_shape: ClassVar[dict] = {}            # (device, dtype, shape) -> the one dequantized layer

    def __init__(self, first: int, num_local: int, hidden: int, width: int, act_fn, dtype: torch.dtype,
                 scale_dtype: torch.dtype = torch.bfloat16, device=None, fused: bool = False):
        super().__init__()
        self.fused = fused          # the matmuls read the packed words (target.int4_grouped_mm): `_fused_ok`
        if hidden % GROUP or width % GROUP:
            raise ValueError(f"hidden {hidden} and expert width {width} must be multiples of the INT4 group {GROUP}")
        self.first, self.num_local, self.hidden, self.width = first, num_local, hidden, width
        self.act_fn, self.dtype = act_fn, dtype
        kw = {"device": device}
        self.register_buffer("gate_up_packed", torch.empty(num_local, 2 * width, hidden // NIBBLES,
                                                           dtype=torch.int32, **kw))
        self.register_buffer("gate_up_scale", torch.empty(num_local, 2 * width, hidden // GROUP, dtype=scale_dtype,
                                                          **kw))
        self.register_buffer("down_packed", torch.empty(num_local, hidden, width // NIBBLES, dtype=torch.int32, **kw))
        self.register_buffer("down_scale", torch.empty(num_local, hidden, width // GROUP, dtype=scale_dtype, **kw))

    def _buffer(self, shape: tuple) -> torch.Tensor:
        key = (self.gate_up_packed.device, self.dtype, shape)
        if key not in Int4Experts._buffers_by_shape:
            Int4Experts._buffers_by_shape[key] = torch.empty(shape[1:], dtype=self.dtype, device=key[0])
        return Int4Experts._buffers_by_shape[key]

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E_l, 2I, H], down [E_l, H, I]) in self.dtype, in the shared per-shape buffers: valid until the
        next layer of the same shape dequantizes (layers run one after another)."""
        E, I, H = self.num_local, self.width, self.hidden
        gu = dequantize_int4(self.gate_up_packed, self.gate_up_scale, self._buffer(("gate_up", E, 2 * I, H)))
        dn = dequantize_int4(self.down_packed, self.down_scale, self._buffer(("down", E, H, I)))
        return gu, dn

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        local = top_k_index - self.first
        tok, slot = ((local >= 0) & (local < self.num_local)).nonzero(as_tuple=True)     # [P] token-expert pairs
        expert, order = local[tok, slot].sort(stable=True)                            # grouped by expert
        tok, slot = tok[order], slot[order]
        x = hidden.index_select(0, tok).to(self.dtype)                                # [P, H]
        w = top_k_weights[tok, slot, None]                                           # [P, 1] fp32
        counts = torch.bincount(expert, minlength=self.num_local)
        if self.fused and _fused_ok(x, self.gate_up_scale):
            return _combine(self._fused(x, w, counts).to(hidden.dtype), tok, hidden.shape)
        gate_up, down = self.dequantized()
        # the routing weight scales the activation [P, I] rather than the output [P, H] (the same product,
        # (h w) W_down^T = (h W_down^T) w, on 3.5x fewer elements)
        if _grouped_mm_ok(x, gate_up):
            offs = counts.cumsum(0).to(torch.int32)
            gate, up = F.grouped_mm(x, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
            h = self.act_fn(gate) * up
            y = F.grouped_mm(h.mul_(w.to(h.dtype)), down.transpose(-2, -1), offs=offs)
        else:                                   # one matmul per expert, as transformers' eager DeepseekV3Experts
            y, start = torch.empty_like(x), 0
            for e, n in enumerate(counts.tolist()):
                if n:
                    gate, up = F.linear(x[start:start + n], gate_up[e]).chunk(2, dim=-1)
                    y[start:start + n] = F.linear((self.act_fn(gate) * up * w[start:start + n]).to(x.dtype), down[e])
                start += n
        return _combine(y.to(hidden.dtype), tok, hidden.shape)

    def _fused(self, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """[P, H] bf16 pairs sorted by expert -> [P, H]: both matmuls read the packed words (no dequantized layer)."""
        from eagle3_core.target.int4_grouped_mm import grouped_mm_int4   # Triton: CUDA hosts, or its interpreter
        offs = counts.cumsum(0).to(torch.int32)
        gate, up = grouped_mm_int4(x, offs, self.gate_up_packed, self.gate_up_scale).chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        return grouped_mm_int4(h.mul_(w.to(h.dtype)), offs, self.down_packed, self.down_scale)


def _fused_ok(x: torch.Tensor, scale: torch.Tensor) -> bool:
    """The fused INT4 matmul takes bf16 activations and scales, on CUDA or under Triton's interpreter (elsewhere,
    and without Triton, the dequantizing path runs)."""
    if x.dtype != torch.bfloat16 or scale.dtype != torch.bfloat16:
        return False
    if x.is_cuda:
        return True
    try:
        from eagle3_core.target.int4_grouped_mm import interpreting    # Triton: optional off CUDA
    except ImportError:                          # no Triton on this host
        return False
    return interpreting()


def _combine(y: torch.Tensor, tok: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """out [N, H] with out[t] = the sum of the rows y[p] whose tok[p] = t, in p order (pairs sorted by expert:
    transformers' order). A token's first pair is copied, only its further ones (a token routed to several of this
    rank's experts: about a third of the pairs at EP 8) are added: index_add_ on bf16 CUDA tensors is an atomic
    read-modify-write per element, twice the time of the copy."""
    by_tok = torch.sort(tok, stable=True)
    first_sorted = torch.ones_like(tok, dtype=torch.bool)
    first_sorted[1:] = by_tok.values[1:] != by_tok.values[:-1]
    first = torch.empty_like(first_sorted)
    first[by_tok.indices] = first_sorted
    n_first = int(first.sum())                    # the one host sync of the combine (a mask index costs one each)
    firsts_then_rest = torch.argsort(~first, stable=True)
    head, tail = firsts_then_rest[:n_first], firsts_then_rest[n_first:]
    out = torch.zeros(shape, dtype=y.dtype, device=y.device)
    out.index_copy_(0, tok[head], y[head])
    return out.index_add_(0, tok[tail], y[tail])


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch's grouped GEMM (F.grouped_mm, torch >= 2.10) for bf16 on CUDA; the per-expert loop elsewhere."""
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm")


class ShardedMoE(nn.Module):
    """transformers' DeepseekV3MoE with this rank's routed experts (Int4Experts) and its slice of the shared expert
    (gate/up rows and down columns 1/W each): the router runs whole on every rank, both partial outputs are summed
    and one all-reduce over `group` gives every rank the layer's output (forward: [B, T, H] -> [B, T, H])."""

    def __init__(self, moe: nn.Module, experts: Int4Experts, group):
        super().__init__()
        self.gate, self.shared_experts, self.experts, self.group = moe.gate, moe.shared_experts, experts, group

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        _, weights, index = self.gate(hidden_states)
        routed = self.experts(hidden_states.view(-1, shape[-1]), index, weights).view(shape)
        return _all_reduce(routed + self.shared_experts(hidden_states), self.group)
