"""The extraction cost of features.format 'fp8_topk' over 'fp8' at Kimi-K2.5's shape: store_formats.encode of one
forward's tokens on the GPU (aux [T, 3 x 7168], final [T, 7168] bf16, lm_head [163,840, 7168] bf16, random), fp8
against fp8_topk (which adds two fp32 lm_head products a token, the top-32 and the tail shift).

  python benchmarks/fp8_topk_encode.py [--tokens 16384] [--repeats 3]

Prints each format's seconds per forward (median, min, max of --repeats after a warm-up) and tok/s, and their ratio.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch

# store_formats alone (torch only): the device machine has no project environment
_spec = importlib.util.spec_from_file_location(
    "store_formats", Path(__file__).resolve().parents[1] / "eagle3_core" / "features" / "store_formats.py")
ff = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ff)


def timed(fn, repeats: int, device: str) -> list[float]:
    def sync():
        if device == "cuda":
            torch.cuda.synchronize()
    fn()
    sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run at small shapes")
    a = ap.parse_args()
    dev = a.device
    g = torch.Generator(device=dev).manual_seed(0)
    H, V, T = a.hidden, a.vocab, a.tokens
    aux = torch.randn(T, 3 * H, device=dev, generator=g, dtype=torch.bfloat16)
    final = torch.randn(T, H, device=dev, generator=g, dtype=torch.bfloat16)
    head = (torch.randn(V, H, device=dev, generator=g) / H ** 0.5 * 8).to(torch.bfloat16)
    top1 = torch.zeros(T, dtype=torch.long, device=dev)
    res = {}
    for fmt in ("fp8", "fp8_topk"):
        s = timed(lambda: ff.encode(fmt, aux, final, top1, head if fmt == "fp8_topk" else None), a.repeats, dev)
        res[fmt] = statistics.median(s)
        print(f"{fmt}: {res[fmt]:.4f} s per {T} tokens (min {min(s):.4f}, max {max(s):.4f}), "
              f"{T / res[fmt]:,.0f} tok/s")
    print(f"fp8_topk / fp8 encode time: {res['fp8_topk'] / res['fp8']:.1f}x; fp8_topk adds "
          f"{(res['fp8_topk'] - res['fp8']) / T * 1e6:.1f} us a token on "
          f"{torch.cuda.get_device_name() if dev == 'cuda' else 'the CPU'}")


if __name__ == "__main__":
    main()
