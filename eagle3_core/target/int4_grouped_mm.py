"""The routed experts' grouped matmul reading packed INT4 weights, dequantized in registers (Triton; CUDA, or CPU
under Triton's interpreter, TRITON_INTERPRET=1). Legend as target.int4_experts: P token-expert pairs sorted by
expert, E experts, K inputs, N outputs, G = 32 inputs per scale.

y[p] = x[p] @ W_e^T for the rows p of expert e, W_e = q * scale in the layout of compressed-tensors' pack-quantized
format (int32 words, input j in nibble j % 8 of word j // 8, stored as q + 8). Where target.int4_experts dequantizes
a whole layer into a bf16 buffer (2 bytes written and read again per weight) and then runs F.grouped_mm, each
program here reads its [BN, BK] weight tile as BK / 8 words and BK / 32 scales per row (0.5625 bytes a weight) and
forms the bf16 tile in registers, the idea of Marlin's mixed-precision GEMM (Frantar et al. 2024, arXiv:2408.11743)
without its hand-tuned layout. The int to float conversion uses the bits: the word (q + 8) | 0x4B000000 read as fp32
is 2^23 + q + 8 exactly, so subtracting 2^23 + 8 gives q without a conversion instruction.

Numerics: each weight is the fp32 product q * scale (exact: 4 + 8 significant bits) rounded once to bf16
(round-to-nearest-even), as compressed-tensors' `dequantize` computes it in the scale's dtype; the dot accumulates in
fp32 and the output is rounded once to x's dtype, so the result is the dequantize-then-matmul reference up to the
fp32 summation order (tests/test_int4_grouped_mm.py). Under the interpreter the dot takes fp32 operands (its bf16 dot
is wrong there; the products of two bf16 values are exact in fp32 either way) and the rounding to bf16 is done on the
bits (its cast truncates).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

GROUP = 32
NIBBLES = 8
BM, BN = 64, 64       # pair rows and output columns per program


@triton.jit
def _to_bf16(v, INTERPRET: tl.constexpr):
    """fp32 -> bf16, round-to-nearest-even. The interpreter's cast truncates, so there the rounding is done on the
    bits (add 0x7FFF plus the kept lowest bit, clear the low half); compiled, the cast is cvt.rn."""
    if INTERPRET:
        b = v.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        v = b.to(tl.float32, bitcast=True)
    return v.to(tl.bfloat16)


@triton.jit
def _weight_tile(packed_ptr, scale_ptr, n, n_live, k0, K, BN: tl.constexpr, BK: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """[BN, BK] bf16 weights of rows n, inputs [k0, k0 + BK), from the words and scales of one expert."""
    words = tl.load(packed_ptr + n[:, None] * (K // 8) + (k0 // 8 + tl.arange(0, BK // 8))[None, :],
                    mask=n_live[:, None], other=0)                                        # [BN, BK/8] int32
    nib = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF             # [BN, BK/8, 8]: q + 8
    q = (nib | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0                     # 2^23 + q + 8 - (2^23 + 8)
    s = tl.load(scale_ptr + n[:, None] * (K // 32) + (k0 // 32 + tl.arange(0, BK // 32))[None, :],
                mask=n_live[:, None], other=0).to(tl.float32)                             # [BN, BK/32]
    w = tl.reshape(q, (BN, BK // 32, 32)) * s[:, :, None]
    return _to_bf16(tl.reshape(w, (BN, BK)), INTERPRET)


@triton.jit
def _grouped_mm_int4(x_ptr, packed_ptr, scale_ptr, y_ptr, offs_ptr, tile_offs_ptr, E, N, K,
                     E_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     INTERPRET: tl.constexpr):
    t = tl.program_id(0)                          # a tile of BM rows of one expert; the grid's last ones are spare
    e_all = tl.arange(0, E_PAD)
    tile_ends = tl.load(tile_offs_ptr + e_all, mask=e_all < E, other=2 ** 30)
    e = tl.sum((tile_ends <= t).to(tl.int32))     # the expert whose tiles cover t
    if e >= E:
        return
    tile0 = tl.load(tile_offs_ptr + e - 1, mask=e > 0, other=0)
    row0 = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    rows = row0 + (t - tile0) * BM + tl.arange(0, BM)
    row_live = rows < tl.load(offs_ptr + e)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_live = n < N
    expert_words = packed_ptr + e.to(tl.int64) * N * (K // 8)
    expert_scales = scale_ptr + e.to(tl.int64) * N * (K // 32)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + (k0 + tl.arange(0, BK))[None, :],
                    mask=row_live[:, None], other=0.0)                                    # [BM, BK]
        w = _weight_tile(expert_words, expert_scales, n, n_live, k0, K, BN, BK, INTERPRET)
        if INTERPRET:                             # its bf16 dot is wrong; bf16 products are exact in fp32
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + rows[:, None].to(tl.int64) * N + n[None, :], _to_bf16(acc, INTERPRET),
             mask=row_live[:, None] & n_live[None, :])


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter, as Triton reads TRITON_INTERPRET (its knobs from 3.4 on)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _block_k(K: int) -> int:
    return next(bk for bk in (128, 64, 32) if K % bk == 0)


def grouped_mm_int4(x: torch.Tensor, offs: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [P, K] bf16 (rows sorted by expert), offs int32 [E] (inclusive end row of each expert, as F.grouped_mm's
    `offs`; offs[-1] must be P: rows after it are left unwritten), packed int32 [E, N, K/8], scale bf16
    [E, N, K/32] -> y [P, N] bf16 with y[p] = x[p] @ W_e^T. No host sync: the tile schedule is computed on the
    device and the grid has E spare tiles. Raises ValueError on shapes that do not match or K not a multiple of 32."""
    (P, K), (E, N, words) = x.shape, packed.shape
    if K % GROUP or words * NIBBLES != K or tuple(scale.shape) != (E, N, K // GROUP) or offs.shape != (E,):
        raise ValueError(f"grouped_mm_int4: x {tuple(x.shape)}, packed {tuple(packed.shape)}, scale "
                         f"{tuple(scale.shape)} and offs {tuple(offs.shape)} do not describe [P, K] @ E x [N, K] "
                         f"with K a multiple of {GROUP}")
    if x.dtype != torch.bfloat16 or scale.dtype != torch.bfloat16 or packed.dtype != torch.int32:
        raise ValueError(f"grouped_mm_int4 takes bf16 x and scales and int32 words, not {x.dtype}, {scale.dtype}, "
                         f"{packed.dtype}")
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    tile_offs = torch.cumsum((counts + BM - 1) // BM, 0).to(torch.int32)
    y = torch.empty(P, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(P, BM) + E, triton.cdiv(N, BN))
    _grouped_mm_int4[grid](x.contiguous(), packed.contiguous(), scale.contiguous(), y, offs.to(torch.int32),
                           tile_offs, E, N, K, E_PAD=triton.next_power_of_2(E), BM=BM, BN=BN, BK=_block_k(K),
                           INTERPRET=interpreting())
    return y
