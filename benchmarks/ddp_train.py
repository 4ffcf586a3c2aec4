"""Multi-GPU scaling: DDP draft training and multi-worker extraction on 1 and on N GPUs (random weights, no
downloads, about 5 minutes on 2 H200s).

  python benchmarks/ddp_train.py                 # GPU host: 1 GPU, then all GPUs (or --gpus N)
  python benchmarks/ddp_train.py --tiny          # CPU check with gloo, tiny shapes, 2 processes

Training: the Llama-3.1-8B-shaped draft of benchmarks/train_throughput.py (H 4096, T 2048, K 7 TTT steps, bf16,
merged_flex attention), random features, under torchrun + trainer.train. Equal global batch: 1 GPU with
grad_accum N, N GPUs with grad_accum 1, the same seeded data and draft; the first 2 steps are warm-up. Reports
tokens/s per GPU, scaling efficiency (per-GPU tok/s on N / on 1) and the largest loss-curve difference.
Extraction: a Llama-3.1-8B-shaped random target (bf16), extract_workers.extract_owned per rank, each GPU owning the
same number of shards (weak scaling), bf16 features written to --extract-dir (default /dev/shm, so that the
GPUs, not this host's disk, are measured; docs/scaling.md uses the disk bandwidth measured separately).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_core.distributed.launch import run_torchrun

TRAIN_FULL = {"H": 4096, "nh": 32, "nkv": 8, "hd": 128, "I": 14336, "V": 128256, "N": 32000, "T": 2048}
TRAIN_TINY = {"H": 64, "nh": 4, "nkv": 2, "hd": 16, "I": 128, "V": 512, "N": 256, "T": 64}


def train_worker(args) -> None:
    import torch.distributed as dist

    from eagle3_core.config import TrainConfig
    from eagle3_core.training.trainer import train
    from train_throughput import make_draft, make_inputs
    rank, world = dist.get_rank(), dist.get_world_size()             # joined by train_ddp.init_distributed
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    s = TRAIN_TINY if args.tiny else TRAIN_FULL
    T, n_batches = s["T"], args.global_batches * args.steps
    inp = make_inputs(s, args.seqs_per_batch, torch.device("cpu"))      # one batch of features, reused
    if device.type == "cpu":                                           # no autocast on CPU: fp32 features
        inp["aux"], inp["final"] = inp["aux"].float(), inp["final"].float()
    samples = []
    for i in range(n_batches * args.seqs_per_batch):                  # views of the same features, new ids
        b = i % args.seqs_per_batch
        samples.append({"id": f"s{i}", "input_ids": torch.roll(inp["input_ids"][b], i), "loss_mask":
                        inp["loss_mask"][b], "aux": inp["aux"][b], "final": inp["final"][b],
                        "target_top1": inp["target_top1"][b]})
    cfg = TrainConfig(epochs=1, lr=1e-4, warmup_frac=0.0, batch_tokens=args.seqs_per_batch * T,
                      grad_accum=args.global_batches // world, ttt_length=7 if not args.tiny else 3,
                      checkpoint_every=10 ** 9, device=str(device), compile=False)
    draft = make_draft(s, {k: v.to(device) for k, v in inp.items()}, device)
    times, losses = [], []

    def on_step(step, loss):
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter())
        losses.append(loss)
    with tempfile.TemporaryDirectory() as out:
        res = train(draft, samples, [], inp["lm_head"], cfg, Path(out), log=lambda m: None,
                    stop_after_steps=args.steps - 1, on_step=on_step, tensorboard=False)
    warm = 2
    tokens = torch.tensor([res["tokens"] / len(times) * (len(times) - warm)], dtype=torch.float64)
    dist.all_reduce(tokens)                                            # tokens of the timed steps, all ranks
    tok_s = tokens.item() / (times[-1] - times[warm - 1])
    if rank == 0:
        Path(args.result).write_text(json.dumps({"tok_s": tok_s, "tok_s_per_gpu": tok_s / world,
                                                 "losses": losses, "world": world}))


def extract_worker(args) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    from eagle3_core.features.extract import HFExtractor
    from eagle3_core.features.extract_workers import extract_owned
    from eagle3_core.features.store import STORE_VERSION
    from extract_throughput import LLAMA_8B, TINY
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    cfg = LlamaConfig(**(TINY if args.tiny else LLAMA_8B))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if cuda else torch.float32,
                                                 attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    ex = HFExtractor(model, compile=cuda)
    T = 2048 if not args.tiny else 128
    g = torch.Generator().manual_seed(1)
    n_shards = args.shards_per_gpu * world
    rows = [{"id": f"r{i}", "input_ids": torch.randint(0, cfg.vocab_size, (T,), generator=g).tolist(),
             "loss_mask": [1] * T} for i in range(n_shards * args.seqs_per_shard)]
    out = Path(args.extract_dir) / f"ddp_extract_{world}_{os.getppid()}"
    out.mkdir(parents=True, exist_ok=True)
    header = {"store_version": STORE_VERSION, "format": "bf16", "aux_layer_ids": ex.aux_layer_ids,
              "hidden_size": ex.hidden_size, "target": None, "target_id": "random", "samples": len(rows)}
    warm = rows[:args.seqs_per_shard]                                  # one untimed shard (compile, allocator)
    with torch.no_grad():
        extract_owned(ex, warm, out / "warmup", args.seqs_per_shard, args.seqs_per_shard * T, "bf16", 0, 1,
                      "random", {**header, "samples": len(warm)}, 4, log=lambda m: None)
        dist.barrier()
        part = extract_owned(ex, rows, out, args.seqs_per_shard, args.seqs_per_shard * T, "bf16", rank, world,
                             "random", header, 4, log=lambda m: None)
    tok = torch.tensor([part["tokens_extracted"], part["seconds"]], dtype=torch.float64)
    all_tok = [torch.zeros_like(tok) for _ in range(world)]
    dist.all_gather(all_tok, tok)
    if rank == 0:
        per_gpu = [float(t[0] / t[1]) for t in all_tok]
        Path(args.result).write_text(json.dumps({"tok_s_per_gpu": sum(per_gpu) / world, "per_rank": per_gpu,
                                                 "world": world}))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU gloo check with tiny shapes, 2 processes")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs of the multi-GPU runs (default: all)")
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per training run (2 are warm-up)")
    ap.add_argument("--seqs-per-batch", type=int, default=2, help="T-token sequences per micro-batch")
    ap.add_argument("--shards-per-gpu", type=int, default=6)
    ap.add_argument("--seqs-per-shard", type=int, default=4)
    ap.add_argument("--extract-dir", default="/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir())
    ap.add_argument("--only", choices=["train", "extract"], default=None)
    ap.add_argument("--worker", choices=["train", "extract"], help=argparse.SUPPRESS)
    ap.add_argument("--global-batches", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import torch.distributed as dist

        from eagle3_core.distributed.rank_exit import rank_main
        from eagle3_core.pipeline.train_ddp import init_distributed
        # the project's torchrun ranks' one start and end (threads joined, group destroyed, os._exit)
        rank_main(init_distributed if args.worker == "train" else lambda: dist.init_process_group("gloo"),
                  lambda: (train_worker if args.worker == "train" else extract_worker)(args))
    n = args.gpus or (2 if args.tiny or not torch.cuda.is_available() else torch.cuda.device_count())
    if n < 2:
        print(f"only {n} GPU visible: the scaling runs need 2 or more (use --tiny on CPU)")
    env = {"CUDA_VISIBLE_DEVICES": ""} if args.tiny else {}
    env["OMP_NUM_THREADS"] = "1" if args.tiny else "8"
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("train", "extract"):
            if args.only and kind != args.only:
                continue
            for world in sorted({1, n}):
                result = Path(tmp) / f"{kind}_{world}.json"
                cmd = [__file__, "--worker", kind, "--global-batches", str(n), "--result", str(result),
                       "--steps", str(args.steps), "--seqs-per-batch", str(args.seqs_per_batch),
                       "--shards-per-gpu", str(args.shards_per_gpu), "--seqs-per-shard", str(args.seqs_per_shard),
                       "--extract-dir", args.extract_dir] + (["--tiny"] if args.tiny else [])
                t0 = time.monotonic()
                try:
                    run_torchrun(cmd, world, on_line=lambda x, k=kind, w=world: print(f"[{k} x{w}] {x}", flush=True),
                                 env=env, grace_s=10)
                    results[(kind, world)] = json.loads(result.read_text())
                except Exception as e:                                  # noqa: BLE001 - a benchmark row
                    results[(kind, world)] = {"error": repr(e)[:300]}
                print(f"[{kind} x{world}] done in {time.monotonic() - t0:.0f} s", flush=True)
    dev = "cpu (gloo, tiny)" if args.tiny else torch.cuda.get_device_name()
    print(f"\n{dev}, torch {torch.__version__}, {n} GPUs in the multi-GPU runs\n")
    print("| run | GPUs | tok/s total | tok/s per GPU | scaling efficiency | note |\n|---|---|---|---|---|---|")
    for kind in ("train", "extract"):
        one = results.get((kind, 1), {})
        for world in sorted({1, n}):
            r = results.get((kind, world))
            if r is None:
                continue
            if "error" in r:
                print(f"| {kind} | {world} | | | | FAILED {r['error']} |")
                continue
            eff = r["tok_s_per_gpu"] / one["tok_s_per_gpu"] if "tok_s_per_gpu" in one else float("nan")
            note = ""
            if kind == "train" and world > 1 and "losses" in one:
                d = max(abs(a - b) for a, b in zip(one["losses"], r["losses"]))
                note = f"loss curve vs 1 GPU: max |diff| {d:.2e} over {len(r['losses'])} steps (first {r['losses'][0]:.4f})"
            if kind == "extract" and world > 1:
                note = "per rank: " + ", ".join(f"{x:,.0f}" for x in r["per_rank"])
            print(f"| {kind} | {world} | {r['tok_s_per_gpu'] * world:,.0f} | {r['tok_s_per_gpu']:,.0f} | "
                  f"{eff:.1%} | {note} |")
    print("\ngoals (issue 11): training >= 90%, extraction >= 95% scaling efficiency; equal global batch in both "
          "training runs (1 GPU: grad_accum N)")


if __name__ == "__main__":
    main()
