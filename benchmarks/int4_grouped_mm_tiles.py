"""The launch shapes of target.int4_grouped_mm timed on one GPU, for the two grouped matmuls of one EP-8 rank's share
of Kimi-K2.5's routed experts, beside torch's bf16 grouped matmul on the same weights dequantized.

  python benchmarks/int4_grouped_mm_tiles.py --out tiles.json              # one GPU (H100: about 1 minute)
  TRITON_INTERPRET=1 python benchmarks/int4_grouped_mm_tiles.py --tiny     # CPU: every variant runs, small shapes
  python benchmarks/int4_grouped_mm_tiles.py --sass                          # CPU: each candidate's sm_90 SASS

Shapes (int4_ep_throughput.py's legend): 48 experts of 384, 16,384 tokens routed top-8 at random (about 16,384
token-expert pairs on the rank); gate_up N 4,096 x K 7,168, down N 7,168 x K 2,048. Every candidate Tiles (tile
sizes, unpack 0 and 2, the weight tile as first or second MMA operand, warps, stages) is checked against the
dequantized weights through F.grouped_mm (share of outputs bit-identical, largest relative difference) and timed as
int4_ep_throughput.timed does (median, min and max of 3 timings, each the mean of --iters calls). Beside them, the
ceiling of the schedule: the same Triton grouped matmul reading bf16 weights (`triton_bf16`, no unpacking), at the
tiles of the best candidate. The JSON's `best` maps each matmul to the fastest candidate whose outputs match;
int4_ep_throughput.py --tiles takes it.

--sass needs no GPU: every candidate compiled for sm_90 by Triton's own ptxas (pointers and K, N taken as multiples
of 16, as Triton specializes them at launch), disassembled by its nvdisasm: instructions in the kernel, shared
memory, local-memory spills (STL), shared-memory stores and loads, tensor-core MMAs (HGMMA), packed bf16 arithmetic.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from eagle3_core.target.int4_experts import dequantize_int4  # noqa: E402
from eagle3_core.target.int4_grouped_mm import (Tiles, block_k, compile_sm90, expert_tile,  # noqa: E402
                                               grouped_mm_int4, tile_schedule)
from int4_ep_throughput import KIMI, TINY, random_packed, timed  # noqa: E402

# (bm, bn, bk, warps, stages); unpack 1 is left out: 8.5-17x slower than unpack 0 on one H100 (2026-12-07)
SHAPES = [(64, 64, 128, 4, 3), (64, 128, 128, 4, 3), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3),
          (128, 128, 128, 8, 4), (128, 256, 64, 8, 3), (64, 256, 64, 8, 3), (128, 64, 128, 4, 4)]


def candidates(tiny: bool) -> list[Tiles]:
    """Every tile shape of SHAPES with unpack 0 and 2 and both operand orders (tiny: the first two shapes)."""
    shapes = SHAPES[:2] if tiny else SHAPES
    return [Tiles(bm, bn, bk, unpack, w_first, warps, stages)
            for (bm, bn, bk, warps, stages), unpack, w_first in itertools.product(shapes, (0, 2), (False, True))]


def routed_offs(d: dict, dev) -> torch.Tensor:
    """offs int32 [E_l]: the inclusive end row of each of the rank's experts for d['tokens'] tokens routed top-k at
    random over d['experts'] (the rank holds the first E_l = experts / ranks)."""
    E_l = d["experts"] // d["ranks"]
    g = torch.Generator(device=dev).manual_seed(0)
    idx = torch.rand(d["tokens"], d["experts"], device=dev, generator=g).topk(d["topk"], dim=-1).indices
    return torch.bincount(idx[idx < E_l], minlength=E_l).cumsum(0).to(torch.int32)


def sweep_matmul(offs: torch.Tensor, N: int, K: int, cands: list[Tiles], dev, iters: int) -> dict:
    """One grouped matmul [P, K] x E x [N, K]: the bf16 reference and every candidate, checked and timed."""
    E, P = offs.numel(), int(offs[-1])
    packed, scale = random_packed((E, N, K), dev)
    x = torch.randn(P, K, device=dev, generator=torch.Generator(device=dev).manual_seed(1)).to(torch.bfloat16)
    w = dequantize_int4(packed, scale).view(E, N, K) if dev.type == "cuda" else None
    if w is None:                                         # CPU: the torch reference of the dequantization
        from eagle3_core.target.int4_experts import unpack_int4  # only the CPU smoke run needs it
        w = (unpack_int4(packed).view(E, N, K // 32, 32).to(scale.dtype) * scale[..., None]).view(E, N, K)
    ref = F.grouped_mm(x, w.transpose(-2, -1), offs=offs) if dev.type == "cuda" else _loop(x, w, offs)
    out = {"N": N, "K": K, "pairs": P, "bf16_grouped_mm": timed(lambda: F.grouped_mm(
        x, w.transpose(-2, -1), offs=offs), dev, iters) if dev.type == "cuda" else None, "tiles": []}
    for t in cands:
        row = {"tiles": t._asdict()}
        try:
            t0 = time.perf_counter()
            y = grouped_mm_int4(x, offs, packed, scale, t)
            row["first_call_s"] = time.perf_counter() - t0
            row["identical"] = float((y == ref).float().mean())
            row["max_rel"] = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
            row["time"] = timed(lambda: grouped_mm_int4(x, offs, packed, scale, t), dev, iters)
        except Exception as exc:                          # out of resources for this shape is a result
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc(limit=1)
        print(json.dumps({k: row.get(k) for k in ("tiles", "identical", "time", "error")}), flush=True)
        out["tiles"].append(row)
    if best(out) and dev.type == "cuda":
        out["triton_bf16"] = bf16_ceiling(x, offs, w, ref, Tiles(**best(out)), dev, iters)
        print(json.dumps({"triton_bf16": out["triton_bf16"]}), flush=True)
    return out


def bf16_ceiling(x, offs, w, ref, top: Tiles, dev, iters: int) -> dict:
    """The Triton bf16 kernel of the same schedule at the best candidate's tiles, or with one stage fewer where the
    bf16 tiles (twice the bytes of the packed ones) do not fit the shared memory; an error is kept as the result."""
    for stages in (top.stages, top.stages - 1):
        t = top._replace(unpack=0, w_first=False, stages=stages)
        try:
            y = triton_bf16(x, offs, w, t)
            return {"tiles": t._asdict(), "max_rel": float((y.float() - ref.float()).abs().max()
                                                           / ref.float().abs().max()),
                    "time": timed(lambda: triton_bf16(x, offs, w, t), dev, iters)}
        except Exception as exc:                          # out of resources: try one stage fewer
            err = f"{type(exc).__name__}: {str(exc)[:300]}"
    return {"tiles": top._asdict(), "error": err}


@triton.jit
def _grouped_mm_bf16(x_ptr, w_ptr, y_ptr, offs_ptr, tile_offs_ptr, E, N, K, E_PAD: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr):
    """int4_grouped_mm's schedule and loop over bf16 weights [E, N, K]: what the unpacking costs."""
    e, row0, end, col0 = expert_tile(tl.program_id(0), tile_offs_ptr, offs_ptr, E, N, E_PAD, BM, BN)
    if e < 0:
        return
    rows = row0 + tl.arange(0, BM)
    n = col0 + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], mask=(rows < end)[:, None], other=0.0)
        w = tl.load(w_ptr + (e.to(tl.int64) * N + n[:, None]) * K + ks[None, :], mask=(n < N)[:, None], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + rows[:, None].to(tl.int64) * N + n[None, :], acc.to(tl.bfloat16),
             mask=(rows < end)[:, None] & (n < N)[None, :])


def triton_bf16(x: torch.Tensor, offs: torch.Tensor, w: torch.Tensor, t: Tiles) -> torch.Tensor:
    """y [P, N] bf16 = x [P, K] @ w[e]^T by _grouped_mm_bf16 at the tiles t."""
    (P, K), (E, N, _) = x.shape, w.shape
    tile_offs, grid = tile_schedule(offs, P, N, t)
    y = torch.empty(P, N, dtype=x.dtype, device=x.device)
    _grouped_mm_bf16[grid](
        x, w, y, offs, tile_offs, E, N, K, E_PAD=triton.next_power_of_2(E), BM=t.bm, BN=t.bn,
        BK=block_k(K, t.bk), num_warps=t.warps, num_stages=t.stages)
    return y


def _loop(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The CPU reference: one fp32 matmul per expert, rounded once to bf16."""
    starts = [0, *offs[:-1].tolist()]
    return torch.cat([(x[a:b].float() @ w[e].float().T).to(x.dtype) for e, (a, b) in enumerate(zip(starts,
                                                                                                 offs.tolist()))])


def best(result: dict) -> dict | None:
    """The fastest candidate whose outputs match the reference within one bf16 rounding of the largest output, as a
    Tiles dict."""
    ok = [r for r in result["tiles"] if "time" in r and r["max_rel"] <= 2 ** -7]
    return min(ok, key=lambda r: r["time"]["median_ms"])["tiles"] if ok else None


def sass_mix(t: Tiles) -> dict:
    """Instruction counts of the kernel compiled for sm_90 at tiles t (no GPU: Triton's ptxas and nvdisasm)."""
    k = compile_sm90(t)
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
    ops = collections.Counter(m.group(1).split(".")[0] for m in re.finditer(
        r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass))
    return {"instructions": sum(ops.values()), "shared_bytes": k.metadata.shared, "spills_STL": ops["STL"],
            **{o: ops[o] for o in ("STS", "LDS", "LDSM", "STSM", "HGMMA", "HMUL2", "FMUL")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="small shapes, two tile shapes (CPU under TRITON_INTERPRET)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--sass", action="store_true", help="no GPU: each candidate's sm_90 instruction mix")
    a = ap.parse_args()
    if a.sass:
        for t in candidates(False):
            try:
                print(json.dumps({"tiles": t._asdict(), **sass_mix(t)}), flush=True)
            except Exception as exc:                      # out of resources for this shape is a result
                print(json.dumps({"tiles": t._asdict(), "error": f"{type(exc).__name__}: {str(exc)[:200]}"}))
        return
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = TINY if a.tiny else KIMI
    offs = routed_offs(d, dev)
    cands = candidates(a.tiny)
    result = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "dims": d, "matmuls": {}}
    for name, (N, K) in (("gate_up", (2 * d["width"], d["hidden"])), ("down", (d["hidden"], d["width"]))):
        result["matmuls"][name] = sweep_matmul(offs, N, K, cands, dev, 1 if a.tiny else a.iters)
        result.setdefault("best", {})[name] = best(result["matmuls"][name])
        if a.out:
            a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["best"], indent=1))


if __name__ == "__main__":
    main()
