"""The `hf_tp` extraction backend against the `hf` backend on one GPU (world size 1), Llama-3.1-8B-shaped
random-weight target, sequences of 2048 tokens.

  python benchmarks/tp_extract_throughput.py            # H200 (about 4 minutes, 16 GB of weights + shards on disk)
  python benchmarks/tp_extract_throughput.py --tiny     # CPU smoke run with small shapes

Every row is the features stage as the pipeline runs it (run_features: target loaded from safetensors,
aux hidden states extracted, shards written with their sha256, manifest), on the same tokenized rows, into a fresh
features/ each time. `hf` runs in this process; `hf_tp` launches torchrun with one process whose rank 0 leads
through tp_extract.Leader (the token ids of every forward broadcast over gloo first). At world size 1
transformers' tensor-parallel plan is not applied (target.load_target shards only for tp_size > 1), so what this
measures is the backend's own cost (torchrun start, process group, leader protocol), not DTensor arithmetic or
NCCL all-reduces; those need several GPUs.

Each backend runs the stage on N and on 2N sequences: the extraction rate is the marginal one, the extra tokens
over the extra seconds (fixed costs such as torchrun's start, imports, CUDA and process-group set-up and the
target load cancel), and the fixed cost per stage run is what is left of the N-sequence run.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.extract_throughput import LLAMA_8B, TINY  # noqa: E402
from eagle3_core.config import PipelineConfig  # noqa: E402
from eagle3_core.contract.manifest import write_manifest  # noqa: E402
from eagle3_core.pipeline.features_stage import run_features  # noqa: E402
from eagle3_core.target.loading import load_target  # noqa: E402


def make_target(path: Path, shape: dict, device: str) -> None:
    """A random-weight LlamaForCausalLM of `shape`, bf16, saved as safetensors in `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**shape)).to(torch.bfloat16)
    model.save_pretrained(path)
    del model


def write_rows(run_dir: Path, n: int, seq: int, vocab: int) -> int:
    """tokenized/train.parquet with n random sequences of `seq` tokens, loss mask on the second half, and the
    tokenized manifest the features key reads. Returns the token count."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    g = torch.Generator().manual_seed(1)
    rows = [{"id": f"s{i}", "input_ids": torch.randint(0, vocab, (seq,), generator=g).tolist(),
             "loss_mask": [0] * (seq // 2) + [1] * (seq - seq // 2)} for i in range(n)]
    (run_dir / "tokenized").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), run_dir / "tokenized" / "train.parquet")
    write_manifest(run_dir / "tokenized" / "manifest.json", {"inputs_key": f"benchmark-{n}x{seq}", "samples": n})
    return n * seq


def stage_seconds(cfg: PipelineConfig) -> float:
    shutil.rmtree(cfg.run_dir / "features", ignore_errors=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    manifest = run_features(cfg, log=lambda line: print("   ", line, flush=True))
    seconds = time.perf_counter() - t0
    assert manifest["samples"] > 0 and manifest["shards"], manifest
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke run)")
    ap.add_argument("--seqs", type=int, default=None, help="sequences (default 128; 8 with --tiny)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 2048; 128 with --tiny)")
    ap.add_argument("--out-dir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = ap.parse_args()
    shape = TINY if args.tiny else LLAMA_8B
    n, seq = args.seqs or (8 if args.tiny else 128), args.seq_len or (128 if args.tiny else 2048)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    scratch = Path(args.out_dir or tempfile.mkdtemp(prefix="tp_extract_"))
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        make_target(scratch / "target", shape, device)
        print(f"target {shape['hidden_size']}x{shape['num_hidden_layers']} written in {time.perf_counter() - t0:.0f}"
              f" s; device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}", flush=True)
        run_dir = scratch / "run"
        base = {"run_dir": str(run_dir), "target": {"model": str(scratch / "target")},
                "features": {"max_length": seq, "shard_samples": 16, "batch_tokens": 4 * seq}}
        hf = PipelineConfig.model_validate(base)
        tp = PipelineConfig.model_validate({**base, "features": {**base["features"], "backend": "hf_tp",
                                                                 "tp_size": 1}})
        load_target(hf.target, device)                              # warm the page cache
        t0 = time.perf_counter()
        model = load_target(hf.target, device)
        if device == "cuda":
            torch.cuda.synchronize()
        load = time.perf_counter() - t0
        del model
        rows = {}
        for name, cfg in (("hf", hf), ("hf_tp (torchrun, world 1)", tp)):
            for k in (n, 2 * n):
                tokens = write_rows(run_dir, k, seq, shape["vocab_size"])
                print(f"{name}, {k} sequences:", flush=True)
                rows[name, k] = (tokens, stage_seconds(cfg))
        print(f"\nsequences of {seq} tokens; target load alone {load:.1f} s (page cache warm)")
        print(f"{'backend':28s} {'seqs':>5s} {'tokens':>8s} {'stage s':>8s}")
        for (name, k), (tokens, seconds) in rows.items():
            print(f"{name:28s} {k:5d} {tokens:8d} {seconds:8.1f}")
        marginal = {}
        for name in ("hf", "hf_tp (torchrun, world 1)"):
            (t1, s1), (t2, s2) = rows[name, n], rows[name, 2 * n]
            marginal[name] = (t2 - t1) / max(s2 - s1, 1e-9)
            print(f"{name:28s} extraction {marginal[name]:8.0f} tok/s (marginal: the extra {t2 - t1} tokens over "
                  f"the extra seconds), fixed cost {s1 - t1 / marginal[name]:.1f} s per stage run")
        a, b = marginal["hf_tp (torchrun, world 1)"], marginal["hf"]
        print(f"hf_tp / hf extraction tok/s: {a / b:.3f}; stage time ratio at {2 * n} sequences "
              f"{rows['hf_tp (torchrun, world 1)', 2 * n][1] / rows['hf', 2 * n][1]:.3f}")
    finally:
        if args.out_dir is None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
