"""The INT4 dequantization of target.int4_experts as one Triton kernel (CUDA only): each program reads BLOCK int32
words of `weight_packed` and their group scales and writes the 8 * BLOCK weights, so the pass moves 0.5625 bytes
in and 2 bytes out per weight (bf16) and nothing else.

Bit-identical to the torch reference `int4_experts.dequantize_int4` (and so to compressed-tensors): q is an exact
small integer and the scale a bf16/fp16 value, their product is exact in fp32 (at most 4 + 11 significant bits),
and the one rounding to the scale's dtype is round-to-nearest-even in both.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024          # int32 words per program (8192 weights)


@triton.jit
def _dequant(packed_ptr, scale_ptr, out_ptr, n_words, words_per_row, groups_per_row, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    word = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)                 # [BLOCK] flat word index
    live = word < n_words
    w = tl.load(packed_ptr + word, mask=live, other=0)
    row, col = word // words_per_row, word % words_per_row
    s = tl.load(scale_ptr + row * groups_per_row + col // 4, mask=live, other=0).to(tl.float32)  # 4 words a group
    nib = tl.arange(0, 8)
    q = ((w[:, None] >> (nib[None, :] * 4)) & 0xF) - 8                       # [BLOCK, 8], lowest nibble first
    v = (q.to(tl.float32) * s[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + word[:, None] * 8 + nib[None, :], v, mask=live[:, None])


def dequantize_cuda(packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """packed int32 [..., R, K/8], scale [..., R, K/32] (bf16/fp16, CUDA) -> [..., R, K] in scale.dtype, into
    `out` (contiguous, that shape and dtype) when given."""
    packed, scale = packed.contiguous(), scale.contiguous()
    shape = (*packed.shape[:-1], packed.shape[-1] * 8)
    if out is None:
        out = torch.empty(shape, dtype=scale.dtype, device=packed.device)
    if tuple(out.shape) != shape or out.dtype != scale.dtype or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}: needs a contiguous {shape} {scale.dtype} tensor")
    n = packed.numel()
    _dequant[(triton.cdiv(n, BLOCK),)](packed, scale, out, n, packed.shape[-1], scale.shape[-1], BLOCK=BLOCK)
    return out
