"""Hidden-state extraction throughput on one GPU: a Llama-3.1-8B-shaped random-weight target, sequences of 2048.

  python benchmarks/extract_throughput.py            # H200: the table of the issue (about 5 minutes)
  python benchmarks/extract_throughput.py --tiny     # CPU smoke run with small shapes

Measures, each in its own try/except (a failure prints a row with the error and the rest still run):
  disk      write bandwidth of --out-dir: 256 MiB blocks, fsync per file, files rotated (at most 2 on disk, total
            written capped at 25% of the free space)
  bare HF   model.model(input_ids) at B=4: embedding, decoder layers, final norm; no lm_head, no hooks
  extractor compute only: HFExtractor.forward (hooks, lm_head argmax on real tokens) + device-side encode
  +compile  the same with torch.compile on the layers' attention/MLP/norm sub-modules (GPU only unless --compile)
  writer    the real extraction loop (features.write_shards: encode, pinned D2H on a side stream, background
            writer threads serializing, sha256-ing, writing and fsyncing shards) for each format; shards rotated
MFU: FLOPs counted for the matmuls actually run, per token: 2 x (q,k,v,o,gate,up,down weights) per layer, plus
attention 4 x n_heads x head_dim x (T+1)/2 per layer (causal: the average query sees (T+1)/2 keys), plus 2 x H x V
for lm_head where it runs (extractor rows only); embedding lookups, norms and elementwise ops count zero.
Divided by --peak-tflops (790: a measured dense bf16 matmul peak of one H200).
Prints a table, the goal ratios (extractor >= 1.15x bare HF; writer on >= 95% of compute only) and a projection
for the reference case (100K samples, ~200M tokens, Kimi-K2.5 H=7168) per format.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))      # the former writer: a test reference

from eagle3_core.features import store_formats as ff  # noqa: E402
from eagle3_core.features.extract import HFExtractor  # noqa: E402
from eagle3_core.features.store import write_shards  # noqa: E402
from reference_paths import concatenating_writer  # noqa: E402

LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 1024, "tie_word_embeddings": False}


def flops_per_token(cfg, seq: int, lm_head: bool) -> float:
    H, I, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or H // nh
    weights = H * nh * hd * 2 + H * nkv * hd * 2 + 3 * H * I          # q, o; k, v; gate, up, down
    attn = 4 * nh * hd * (seq + 1) / 2
    return L * (2 * weights + attn) + (2 * H * cfg.vocab_size if lm_head else 0)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, iters: int, warmup: int) -> float:
    """Seconds per call of fn (after warmup calls)."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / iters


def disk_bandwidth(out_dir: Path, total_bytes: int, file_bytes: int) -> float:
    """Bytes/s writing `total_bytes` as files of `file_bytes` (fsync each), keeping at most 2 on disk."""
    block = os.urandom(min(file_bytes, 256 << 20))
    files, written, t0 = [], 0, time.perf_counter()
    while written < total_bytes:
        path = out_dir / f"dd_{len(files)}.bin"
        with open(path, "wb") as f:
            n = 0
            while n < file_bytes:
                f.write(block)
                n += len(block)
            f.flush()
            os.fsync(f.fileno())
        written += n
        files.append(path)
        if len(files) > 2:
            files[-3].unlink()
    seconds = time.perf_counter() - t0
    for p in files[-2:]:
        p.unlink(missing_ok=True)
    return written / seconds


def writer_micro(out_dir: Path, seq: int, hidden: int, shard_seqs: int, shards: int, threads: int,
                 launches: int) -> dict:
    """The writer alone with a synthetic producer, per writer path: tokens/s of a main thread that, per sequence,
    launches `launches` tiny torch ops (standing in for a forward's kernel launches: they need the GIL) and hands
    bf16 rows of 8*hidden+9 bytes/token to the writer ('none': no writer, the producer's own speed). Measures how
    much the writer threads slow the thread that feeds the GPU."""
    from eagle3_core.features.extract import HostCopy
    from eagle3_core.features.shard_writer import ShardWriter
    from eagle3_core.features.store import shard_parts

    g = torch.Generator().manual_seed(0)
    feats = {"aux": torch.randn(shard_seqs, seq, 3 * hidden, generator=g).bfloat16(),
             "final": torch.randn(shard_seqs, seq, hidden, generator=g).bfloat16(),
             "target_top1": torch.randint(0, 1000, (shard_seqs, seq), dtype=torch.int32, generator=g)}
    part = [{"id": f"s{i}", "input_ids": list(range(seq)), "loss_mask": [1] * seq} for i in range(shard_seqs)]
    x = torch.zeros(16)
    out = {}
    for mode in ("none", "safetensors", "zero_copy"):
        d = out_dir / f"micro_{mode}"
        d.mkdir(exist_ok=True)
        written = []
        t0 = time.perf_counter()
        former = concatenating_writer() if mode == "safetensors" else contextlib.nullcontext()
        with former, ShardWriter(threads) as writer:
            for j in range(shards):
                for _ in range(shard_seqs * launches):
                    x.add_(1)
                host = {k: v.clone() for k, v in feats.items()}                # the D2H copy's stand-in
                if mode == "none":
                    continue
                pieces = [(HostCopy(host), list(range(shard_seqs)), [seq] * shard_seqs)]

                def build(pieces=pieces):
                    return shard_parts(part, pieces), {"ids": "[]"}

                def rotate(path, sha, n, written=written):
                    written.append((path, n))
                    if len(written) > 2:
                        written[-3][0].unlink(missing_ok=True)
                writer.submit(d / f"shard_{j:05d}.safetensors", build, rotate)
            t_prod = time.perf_counter() - t0
        t_all = time.perf_counter() - t0
        out[mode] = (shards * shard_seqs * seq / t_prod, shards * shard_seqs * seq / t_all)
        shutil.rmtree(d, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run with small shapes")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--batch", type=int, default=4, help="sequences per forward (bare HF and extractor)")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--shard-seqs", type=int, default=8, help="sequences per shard in the writer runs")
    ap.add_argument("--writer-shards", type=int, default=None, help="shards per writer run")
    ap.add_argument("--writer-threads", type=int, default=4)
    ap.add_argument("--formats", default="bf16,fp8")
    ap.add_argument("--compile", action="store_true", help="also measure the compiled extractor on CPU")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--disk-gib", type=float, default=None, help="GiB written by the disk test")
    ap.add_argument("--out-dir", default=None, help="where shards and disk-test files go (default: a temp dir)")
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="MFU denominator (H200 measured bf16 peak)")
    ap.add_argument("--writer-paths", default="zero_copy,safetensors",
                    help="writer paths of the full writer runs: zero_copy (new), safetensors (the former one, "
                         "tests/reference_paths.py)")
    ap.add_argument("--micro-only", action="store_true", help="only the synthetic writer micro-benchmark")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, LlamaConfig
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    seq = args.seq or (2048 if not args.tiny else 128)
    iters = args.iters or (10 if not args.tiny else 3)
    writer_shards = args.writer_shards or (8 if not args.tiny else 3)
    disk_gib = args.disk_gib if args.disk_gib is not None else (16.0 if not args.tiny else 0.25)
    out_root = Path(args.out_dir or tempfile.mkdtemp(prefix="extract_bench_"))
    out_root.mkdir(parents=True, exist_ok=True)
    rows = []                                                           # (name, tok/s, MFU, note)

    def row(name, tok_s=None, mfu=None, note=""):
        rows.append((name, tok_s, mfu, note))
        print(f"  {name}: " + (f"{tok_s:,.0f} tok/s" if tok_s else "-") + (f", MFU {mfu:.1%}" if mfu else "")
              + (f"  {note}" if note else ""), flush=True)

    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}, seq {seq}, "
          f"B {args.batch}, dtype {dtype}, out {out_root}")
    disk_bps = None
    try:
        free = shutil.disk_usage(out_root).free
        total = int(min(disk_gib * 2 ** 30, 0.25 * free))
        disk_bps = disk_bandwidth(out_root, total, min(1 << 30, total))
        row("disk write (fsync, rotated)", note=f"{disk_bps / 1e9:.2f} GB/s over {total / 2 ** 30:.1f} GiB")
    except Exception as e:                                              # noqa: BLE001 - a benchmark row, not core code
        row("disk write", note=f"FAILED {e!r}")

    try:
        H = TINY["hidden_size"] * 8 if args.tiny else LLAMA_8B["hidden_size"]
        micro = writer_micro(out_root, seq, H, args.shard_seqs, writer_shards, args.writer_threads,
                             launches=200 if args.tiny else 2000)
        base_tok = micro["none"][0]
        for mode, (tok_prod, tok_all) in micro.items():
            row(f"writer micro ({mode}, {args.writer_threads} threads, H={H})", tok_prod,
                note=f"producer {tok_prod / base_tok:.1%} of no-writer speed; incl. drain {tok_all:,.0f} tok/s, "
                     f"{tok_all * (8 * H + 9) / 1e9:.2f} GB/s")
    except Exception as e:                                              # noqa: BLE001
        traceback.print_exc()
        row("writer micro", note=f"FAILED {e!r}")
    if args.micro_only:
        return

    cfg = LlamaConfig(**(TINY if args.tiny else LLAMA_8B))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, seq), device=device)
    seqs = ids.tolist()
    tokens = args.batch * seq
    f_layers = flops_per_token(cfg, seq, lm_head=False)
    f_extract = flops_per_token(cfg, seq, lm_head=True)
    peak = args.peak_tflops * 1e12
    results = {}

    def measure(name, fn, flops):
        try:
            with torch.no_grad():
                s = timed(fn, device, iters, warmup=2)
            results[name] = tokens / s
            row(name, tokens / s, tokens / s * flops / peak if cuda else None)
        except Exception as e:                                          # noqa: BLE001
            traceback.print_exc()
            row(name, note=f"FAILED {e!r}")

    measure("bare HF forward, decoder layers, no lm_head", lambda: model.model(input_ids=ids, use_cache=False),
            f_layers)
    ex = HFExtractor(model)

    def extract_only():
        out = ex.forward(seqs)
        return ff.encode("bf16", out["aux"], out["final"], out["target_top1"])
    measure("extractor, compute only (bf16 encode)", extract_only, f_extract)
    if (cuda or args.compile) and not args.no_compile:
        try:
            with torch.no_grad():
                ref = {k: v.float() for k, v in ex.forward(seqs).items() if k != "lengths"}
            HFExtractor(model, compile=True)                            # compiles the shared sub-modules in place
            measure("extractor + torch.compile, compute only", extract_only, f_extract)
            with torch.no_grad():
                got = {k: v.float() for k, v in ex.forward(seqs).items() if k != "lengths"}
            diffs = {k: ((got[k] - ref[k]).abs().max() / ref[k].abs().max()).item() for k in ("aux", "final")}
            agree = (got["target_top1"] == ref["target_top1"]).float().mean().item()
            row("compiled vs eager extractor", note=f"max |diff| / max |eager|: aux {diffs['aux']:.2e}, final "
                f"{diffs['final']:.2e}; target_top1 agreement {agree:.4%}")
        except Exception as e:                                          # noqa: BLE001
            row("extractor + torch.compile", note=f"FAILED {e!r}")
    compute_only = max(v for k, v in results.items() if k.startswith("extractor")) if any(
        k.startswith("extractor") for k in results) else None

    bpt = {}
    writer_runs = [(fmt, path) for fmt in args.formats.split(",") if fmt
                   for path in args.writer_paths.split(",") if path]
    for fmt, path in writer_runs:
        name = f"extractor + writer on ({fmt}, {path}, {args.writer_threads} threads)"
        try:
            shard_dir = out_root / f"shards_{fmt}"
            shard_dir.mkdir(exist_ok=True)
            g = torch.Generator().manual_seed(1)
            jobs = []
            for j in range(writer_shards):
                part = [{"id": f"{j}-{i}", "input_ids": torch.randint(0, cfg.vocab_size, (seq,), generator=g).tolist(),
                         "loss_mask": [1] * seq} for i in range(args.shard_seqs)]
                jobs.append((shard_dir / f"shard_{j:05d}.safetensors", part))
            written = []

            def rotate(path, sha, nbytes, part, written=written):
                written.append((path, nbytes, len(part) * seq))
                if len(written) > 2:                                    # keep the disk from filling
                    written[-3][0].unlink(missing_ok=True)
            with torch.no_grad():
                with concatenating_writer() if path == "safetensors" else contextlib.nullcontext():
                    write_shards(ex, jobs[:1], fmt, args.batch * seq, args.writer_threads,
                                 lambda *a: None)                       # warm-up
                    sync(device)
                    t0 = time.perf_counter()
                    n_tok = write_shards(ex, jobs, fmt, args.batch * seq, args.writer_threads, rotate)
                    s = time.perf_counter() - t0
            bpt[fmt] = sum(b for _, b, _ in written) / sum(t for _, _, t in written)
            tok_s = n_tok / s
            results[name] = tok_s
            row(name, tok_s, tok_s * f_extract / peak if cuda else None,
                f"{bpt[fmt]:,.0f} B/token, {tok_s * bpt[fmt] / 1e9:.2f} GB/s written"
                + (f", {tok_s / compute_only:.1%} of compute only" if compute_only else ""))
            shutil.rmtree(shard_dir, ignore_errors=True)
        except Exception as e:                                          # noqa: BLE001
            traceback.print_exc()
            row(name, note=f"FAILED {e!r}")

    base = results.get("bare HF forward, decoder layers, no lm_head")
    print("\n| measurement | tok/s | MFU | vs bare HF | note |\n|---|---|---|---|---|")
    for name, tok_s, mfu, note in rows:
        ratio = f"{tok_s / base:.2f}x" if tok_s and base and not name.startswith("writer micro") else ""
        print(f"| {name} | {f'{tok_s:,.0f}' if tok_s else ''} | {f'{mfu:.1%}' if mfu else ''} | {ratio} | {note} |")
    print(f"\nFLOPs/token: decoder layers {f_layers / 1e9:.2f} G, + lm_head {(f_extract - f_layers) / 1e9:.2f} G "
          f"(peak {args.peak_tflops:.0f} TFLOP/s)")
    if base and compute_only:
        print(f"goal extractor >= 1.15x bare HF: {compute_only / base:.2f}x")
    for fmt, path in writer_runs:
        name = f"extractor + writer on ({fmt}, {path}, {args.writer_threads} threads)"
        if name in results and compute_only:
            print(f"goal writer on >= 95% of compute only ({fmt}, {path}): {results[name] / compute_only:.1%}")
    # projection for the reference case: 100K samples, ~200M tokens, Kimi-K2.5 (H 7168); bytes from the formats'
    # layouts (feature_formats.py), hours at the disk bandwidth measured here (one host)
    H, n_tok = 7168, 200e6
    per_tok = {"bf16": 8 * H + 9, "fp8": 4 * H + 17, "online": 5}
    print("\nreference case projection (100K samples, 200M tokens, H=7168; reference: 9.2 TB, 18.8 h):")
    for fmt, b in per_tok.items():
        hours = f", disk-bound time {n_tok * b / disk_bps / 3600:.1f} h at {disk_bps / 1e9:.2f} GB/s" if disk_bps else ""
        print(f"  {fmt}: {b:,} B/token -> {n_tok * b / 1e12:.2f} TB{hours}")
    shutil.rmtree(out_root, ignore_errors=True) if not args.out_dir else None


if __name__ == "__main__":
    main()
