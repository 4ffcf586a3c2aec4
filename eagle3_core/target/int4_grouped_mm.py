"""The routed experts' grouped matmul reading packed INT4 weights, dequantized in registers (Triton; CUDA, or CPU
under Triton's interpreter, TRITON_INTERPRET=1). Legend as target.int4_experts: P token-expert pairs sorted by
expert, E experts, K inputs, N outputs, G = 32 inputs per scale.

y[p] = x[p] @ W_e^T for the rows p of expert e, W_e = q * scale in the layout of compressed-tensors' pack-quantized
format (int32 words, input j in nibble j % 8 of word j // 8, stored as q + 8). Where target.int4_experts dequantizes
a whole layer into a bf16 buffer (2 bytes written and read again per weight) and then runs F.grouped_mm, each
program here reads its [BN, BK] weight tile as BK / 8 words and BK / 32 scales per row (0.5625 bytes a weight) and
forms the bf16 tile in registers, the idea of Marlin's mixed-precision GEMM (Frantar et al. 2024, arXiv:2408.11743)
without its hand-tuned layout. The int to float conversion uses the bits: the word (q + 8) | 0x4B000000 read as fp32
is 2^23 + q + 8 exactly, so subtracting 2^23 + 8 gives q without a conversion instruction (unpack 0 and 1); unpack 2
does the same in bf16 pairs (PAIRS_ASM). The launch shape is a Tiles (TILES per (N, K), measured by
benchmarks/int4_grouped_mm_tiles.py).

Numerics: each weight is the fp32 product q * scale (exact: 4 + 8 significant bits) rounded once to bf16
(round-to-nearest-even), as compressed-tensors' `dequantize` computes it in the scale's dtype; the dot accumulates in
fp32 and the output is rounded once to x's dtype, so the result is the dequantize-then-matmul reference up to the
fp32 summation order (tests/test_int4_grouped_mm.py). Under the interpreter the dot takes fp32 operands (its bf16 dot
is wrong there; the products of two bf16 values are exact in fp32 either way) and the rounding to bf16 is done on the
bits (its cast truncates).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from eagle3_core.target.int4_layout import GROUP, NIBBLES


class Tiles(NamedTuple):
    """One launch shape: bm pair rows x bn output columns per program, bk inputs per step (the largest of bk, 64,
    32 that divides K), unpack (0, 1 or 2, `_weight_tile`), w_first (the weight tile as the MMA's first operand),
    Triton's num_warps and num_stages."""
    bm: int
    bn: int
    bk: int
    unpack: int
    w_first: bool
    warps: int
    stages: int


DEFAULT_TILES = Tiles(64, 64, 128, 0, False, 4, 3)      # small: fits the shared memory of any tensor-core GPU
# the tiles for a (N, K), the fastest measured by benchmarks/int4_grouped_mm_tiles.py (docs/benchmarks.md): Kimi-K2.5's
# gate_up and down on one H100, 2026-12-07: 3.23 and 1.64 ms (6.30 and 3.46 at DEFAULT_TILES)
TILES: dict[tuple[int, int], Tiles] = {(4096, 7168): Tiles(128, 128, 64, 2, False, 8, 3),
                                       (7168, 2048): Tiles(128, 128, 64, 2, False, 8, 3)}


def usable(t: Tiles, capability: tuple[int, int] | None) -> Tiles:
    """t, with unpack 2 replaced by 0 on a GPU older than sm_90 (capability (major, minor); None: the interpreter),
    where the packed bf16 subtract and multiply of PAIRS_ASM do not exist (PTX ISA: sub/mul .bf16x2 need sm_90)."""
    return t._replace(unpack=0) if t.unpack == 2 and capability is not None and capability < (9, 0) else t


@triton.jit
def _to_bf16(v, INTERPRET: tl.constexpr):
    """fp32 -> bf16, round-to-nearest-even. The interpreter's cast truncates, so there the rounding is done on the
    bits (add 0x7FFF plus the kept lowest bit, clear the low half); compiled, the cast is cvt.rn."""
    if INTERPRET:
        b = v.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        v = b.to(tl.float32, bitcast=True)
    return v.to(tl.bfloat16)


# bf16 pairs from one word, Hopper's packed bf16 arithmetic (sm_90: sub/mul .rn.bf16x2): lop3 (w & 0x000F000F) |
# 0x43004300 makes the two bf16 values 128 + nibble (nibbles i and i + 4 of the word, as 0x4300 | nibble reads), minus
# 136 (0x4308) is q exactly, times the word's scale is q * scale rounded once. $0-$7: nibbles 0-7, $8 word, $9 scale
PAIRS_ASM = tl.constexpr("{ .reg .b32 t, m, s2, c; mov.b32 s2, {$9, $9}; mov.b32 c, 0x43084308;" + "".join(
    f" shr.b32 m, $8, {4 * i}; lop3.b32 t, m, 0x000F000F, 0x43004300, 0xea; sub.rn.bf16x2 t, t, c;"
    f" mul.rn.bf16x2 t, t, s2; mov.b32 {{${i}, ${i + 4}}}, t;" for i in range(4)) + " }")


@triton.jit
def _scaled(words, s, SHIFT: tl.constexpr):
    """Under the interpreter: the nibble at bit SHIFT of each word as q * s rounded once to bf16 (on the bits)."""
    return _to_bf16((((words >> SHIFT) & 0xF) - 8).to(tl.float32) * s.to(tl.float32), True)


@triton.jit
def _nibble_pairs(words, s, INTERPRET: tl.constexpr):
    """8 bf16 tensors shaped as `words` (int32): nibble i of each word as q * s rounded once to bf16 (s bf16, the
    word's scale). Compiled: PAIRS_ASM; under the interpreter the same values by plain operations."""
    if INTERPRET:
        o0, o1, o2, o3 = (_scaled(words, s, 0), _scaled(words, s, 4), _scaled(words, s, 8), _scaled(words, s, 12))
        o4, o5, o6, o7 = (_scaled(words, s, 16), _scaled(words, s, 20), _scaled(words, s, 24), _scaled(words, s, 28))
    else:
        o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
            PAIRS_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words, s], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    return o0, o1, o2, o3, o4, o5, o6, o7


@triton.jit
def _words(packed_ptr, n, n_live, k0, K, BK: tl.constexpr):
    """[BN, BK/8] int32: the words holding inputs [k0, k0 + BK) of rows n."""
    return tl.load(packed_ptr + n[:, None] * (K // 8) + (k0 // 8 + tl.arange(0, BK // 8))[None, :],
                   mask=n_live[:, None], other=0)


@triton.jit
def _scales(scale_ptr, n, n_live, k0, K, BK: tl.constexpr):
    """[BN, BK/32] bf16: the scales of inputs [k0, k0 + BK) of rows n."""
    return tl.load(scale_ptr + n[:, None] * (K // 32) + (k0 // 32 + tl.arange(0, BK // 32))[None, :],
                   mask=n_live[:, None], other=0)


@triton.jit
def _pairs_tile(packed_ptr, scale_ptr, n, n_live, k0, K, BN: tl.constexpr, BK: tl.constexpr,
                INTERPRET: tl.constexpr):
    """unpack 2: each word loaded once, its nibbles made bf16 pairs by bit operations and scaled by packed bf16
    arithmetic (_nibble_pairs), the 8 results [BN, BK/8] interleaved by joins into [BN, BK]."""
    s = _scales(scale_ptr, n, n_live, k0, K, BK)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BN, BK // 32, 4)), (BN, BK // 8))      # each word's scale
    o0, o1, o2, o3, o4, o5, o6, o7 = _nibble_pairs(_words(packed_ptr, n, n_live, k0, K, BK), s, INTERPRET)
    even = tl.join(tl.join(o0, o4), tl.join(o2, o6))              # [BN, BK/8, 2, 2]: nibble 4 b2 + 2 b1
    odd = tl.join(tl.join(o1, o5), tl.join(o3, o7))
    return tl.reshape(tl.join(even, odd), (BN, BK))             # nibble 4 b2 + 2 b1 + b0 = input 8 j + i


@triton.jit
def _float_tile(packed_ptr, scale_ptr, n, n_live, k0, K, BN: tl.constexpr, BK: tl.constexpr,
                UNPACK: tl.constexpr, INTERPRET: tl.constexpr):
    """unpack 0: each word loaded once, its 8 nibbles spread by a reshape; 1: each input loads its own word (8 loads
    of a word, served by L1), no reshape. Then q * scale in fp32, rounded once to bf16."""
    if UNPACK == 0:
        words = _words(packed_ptr, n, n_live, k0, K, BK)                                  # [BN, BK/8] int32
        nib = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF         # [BN, BK/8, 8]: q + 8
        nib = tl.reshape(nib, (BN, BK))
    else:
        k = k0 + tl.arange(0, BK)
        words = tl.load(packed_ptr + n[:, None] * (K // 8) + (k // 8)[None, :], mask=n_live[:, None], other=0)
        nib = (words >> ((k % 8) * 4)[None, :]) & 0xF                                     # [BN, BK]: q + 8
    q = (nib | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0                     # 2^23 + q + 8 - (2^23 + 8)
    s = _scales(scale_ptr, n, n_live, k0, K, BK).to(tl.float32)                         # [BN, BK/32]
    w = tl.reshape(tl.reshape(q, (BN, BK // 32, 32)) * s[:, :, None], (BN, BK))
    return _to_bf16(w, INTERPRET)


@triton.jit
def _weight_tile(packed_ptr, scale_ptr, n, n_live, k0, K, BN: tl.constexpr, BK: tl.constexpr,
                 UNPACK: tl.constexpr, INTERPRET: tl.constexpr):
    """[BN, BK] bf16 weights of rows n, inputs [k0, k0 + BK), from the words and scales of one expert (UNPACK 0, 1:
    _float_tile; 2: _pairs_tile)."""
    if UNPACK == 2:
        w = _pairs_tile(packed_ptr, scale_ptr, n, n_live, k0, K, BN, BK, INTERPRET)
    else:
        w = _float_tile(packed_ptr, scale_ptr, n, n_live, k0, K, BN, BK, UNPACK, INTERPRET)
    return w


@triton.jit
def expert_tile(t, tile_offs_ptr, offs_ptr, E, N, E_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Program t's (expert, first row, row end, first column): the tiles run expert by expert, and within an expert
    its row tiles fastest, so the programs resident at once share one expert's weight tile and its rows stay in L2
    (the whole layer's rows are read about once, not once per column tile). Expert -1: a spare program."""
    n_tiles = tl.cdiv(N, BN)
    e_all = tl.arange(0, E_PAD)
    ends = tl.load(tile_offs_ptr + e_all, mask=e_all < E, other=0)
    ends = tl.where(e_all < E, ends * n_tiles, 2 ** 30)
    e = tl.sum((ends <= t).to(tl.int32))          # the expert whose tiles cover t
    m0 = tl.load(tile_offs_ptr + e - 1, mask=(e > 0) & (e < E), other=0)
    m_tiles = tl.load(tile_offs_ptr + e, mask=e < E, other=1) - m0
    local = t - m0 * n_tiles
    row0 = tl.load(offs_ptr + e - 1, mask=(e > 0) & (e < E), other=0) + (local % m_tiles) * BM
    end = tl.load(offs_ptr + e, mask=e < E, other=0)
    return tl.where(e < E, e, -1), row0, end, (local // m_tiles) * BN


@triton.jit
def grouped_mm_int4_kernel(x_ptr, packed_ptr, scale_ptr, y_ptr, offs_ptr, tile_offs_ptr, E, N, K,
                           E_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                           UNPACK: tl.constexpr, W_FIRST: tl.constexpr, INTERPRET: tl.constexpr):
    e, row0, end, col0 = expert_tile(tl.program_id(0), tile_offs_ptr, offs_ptr, E, N, E_PAD, BM, BN)
    if e < 0:
        return
    rows = row0 + tl.arange(0, BM)
    row_live = rows < end
    n = col0 + tl.arange(0, BN)
    n_live = n < N
    expert_words = packed_ptr + e.to(tl.int64) * N * (K // 8)
    expert_scales = scale_ptr + e.to(tl.int64) * N * (K // 32)
    if W_FIRST:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + (k0 + tl.arange(0, BK))[None, :],
                    mask=row_live[:, None], other=0.0)                                    # [BM, BK]
        w = _weight_tile(expert_words, expert_scales, n, n_live, k0, K, BN, BK, UNPACK, INTERPRET)
        acc = _mma(acc, x, w, W_FIRST, INTERPRET)
    if W_FIRST:
        tl.store(y_ptr + rows[None, :].to(tl.int64) * N + n[:, None], _to_bf16(acc, INTERPRET),
                 mask=row_live[None, :] & n_live[:, None])
    else:
        tl.store(y_ptr + rows[:, None].to(tl.int64) * N + n[None, :], _to_bf16(acc, INTERPRET),
                 mask=row_live[:, None] & n_live[None, :])


@triton.jit
def _mma(acc, x, w, W_FIRST: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + x @ w^T ([BM, BN]), or acc + w @ x^T ([BN, BM]) with the weight tile as the MMA's first operand. One
    return: Triton generates the code after a return inside a constexpr branch too."""
    if INTERPRET:                                 # its bf16 dot is wrong; bf16 products are exact in fp32
        x, w = x.to(tl.float32), w.to(tl.float32)
        if W_FIRST:
            out = acc + tl.dot(w, tl.trans(x), input_precision="ieee")
        else:
            out = acc + tl.dot(x, tl.trans(w), input_precision="ieee")
    else:
        if W_FIRST:
            out = acc + tl.dot(w, tl.trans(x))
        else:
            out = acc + tl.dot(x, tl.trans(w))
    return out


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter, as Triton reads TRITON_INTERPRET (its knobs from 3.4 on)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def block_k(K: int, bk: int) -> int:
    """The inputs per step: the first of bk, 64, 32 that divides K (K a multiple of 32)."""
    return next(b for b in (bk, 64, 32) if K % b == 0)


def tile_schedule(offs: torch.Tensor, P: int, N: int, t: Tiles) -> tuple[torch.Tensor, tuple[int]]:
    """expert_tile's inputs from offs int32 [E]: (tile_offs int32 [E], each expert's cumulative row tiles of t.bm,
    and the 1-D grid: every expert's row tiles, bounded by cdiv(P, bm) + E without a host sync, times the column
    tiles of t.bn)."""
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    tile_offs = torch.cumsum((counts + t.bm - 1) // t.bm, 0).to(torch.int32)
    return tile_offs, ((triton.cdiv(P, t.bm) + offs.numel()) * triton.cdiv(N, t.bn),)


def grouped_mm_int4(x: torch.Tensor, offs: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                    tiles: Tiles | None = None) -> torch.Tensor:
    """x [P, K] bf16 (rows sorted by expert), offs int32 [E] (inclusive end row of each expert, as F.grouped_mm's
    `offs`; offs[-1] must be P: rows after it are left unwritten), packed int32 [E, N, K/8], scale bf16
    [E, N, K/32] -> y [P, N] bf16 with y[p] = x[p] @ W_e^T. tiles: the launch shape (default: TILES[(N, K)], else
    DEFAULT_TILES). No host sync: the tile schedule is computed on the device and the grid has E spare row tiles
    per column tile. Raises ValueError on shapes that do not match or K not a multiple of 32."""
    (P, K), (E, N, words) = x.shape, packed.shape
    if K % GROUP or words * NIBBLES != K or tuple(scale.shape) != (E, N, K // GROUP) or offs.shape != (E,):
        raise ValueError(f"grouped_mm_int4: x {tuple(x.shape)}, packed {tuple(packed.shape)}, scale "
                         f"{tuple(scale.shape)} and offs {tuple(offs.shape)} do not describe [P, K] @ E x [N, K] "
                         f"with K a multiple of {GROUP}")
    if x.dtype != torch.bfloat16 or scale.dtype != torch.bfloat16 or packed.dtype != torch.int32:
        raise ValueError(f"grouped_mm_int4 takes bf16 x and scales and int32 words, not {x.dtype}, {scale.dtype}, "
                         f"{packed.dtype}")
    t = usable(tiles or TILES.get((N, K), DEFAULT_TILES),
               torch.cuda.get_device_capability(x.device) if x.is_cuda else None)
    tile_offs, grid = tile_schedule(offs, P, N, t)
    y = torch.empty(P, N, dtype=x.dtype, device=x.device)
    grouped_mm_int4_kernel[grid](x.contiguous(), packed.contiguous(), scale.contiguous(), y,
                                 offs.to(torch.int32), tile_offs, E, N, K, E_PAD=triton.next_power_of_2(E),
                                 BM=t.bm, BN=t.bn, BK=block_k(K, t.bk), UNPACK=t.unpack, W_FIRST=t.w_first,
                                 INTERPRET=interpreting(), num_warps=t.warps, num_stages=t.stages)
    return y


def compile_sm90(t: Tiles, e_pad: int = 64):
    """The kernel at tiles `t` compiled for sm_90 (H100, H200) without a GPU, by Triton's own LLVM and ptxas: the
    compiled kernel (.asm["ptx"], .asm["cubin"], .metadata.shared). Pointers are assumed 16-byte aligned and N, K
    multiples of 16, as every launch here has them (tt.divisibility, which Triton's launcher infers)."""
    from triton.backends.compiler import GPUTarget   # only an ahead-of-time compile needs these
    from triton.compiler import ASTSource            # (as above)
    args = ("x_ptr", "packed_ptr", "scale_ptr", "y_ptr", "offs_ptr", "tile_offs_ptr", "E", "N", "K")
    sig = {a: "*bf16" if a in ("x_ptr", "scale_ptr", "y_ptr") else "*i32" if a.endswith("_ptr") else "i32"
           for a in args} | {c: "constexpr" for c in ("E_PAD", "BM", "BN", "BK", "UNPACK", "W_FIRST", "INTERPRET")}
    src = ASTSource(fn=grouped_mm_int4_kernel, signature=sig,
                    attrs={(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 7, 8)},
                    constexprs={"E_PAD": e_pad, "BM": t.bm, "BN": t.bn, "BK": t.bk, "UNPACK": t.unpack,
                                "W_FIRST": t.w_first, "INTERPRET": False})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": t.warps,
                                                                           "num_stages": t.stages})
