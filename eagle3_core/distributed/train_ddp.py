"""The train stage under torchrun: `torchrun --nproc-per-node 8 -m eagle3_core.distributed.train_ddp --config
run.json` (run.json: a PipelineConfig; the features and vocab stages must have finished under its run_dir).

Every rank builds the same seeded draft, verifies its 1/W of the feature shards' checksums, and trains with
ddp_trainer.train_ddp (DDP over NCCL on GPUs, gloo on CPU); rank 0 exports the best epoch and writes the stage
manifest exactly as stages.run_train does (plus `world_size`), so later stages cannot tell the difference.
With W ranks the optimisation equals one process with train.grad_accum x W (ddp_trainer's docstring).
"""
from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint import export_draft, load_draft
from ..config import PipelineConfig
from ..features import bad_shards, load_samples
from ..manifest import read_manifest, write_manifest
from .ddp_trainer import train_ddp
from .launch import die_with_parent, emit_line


def init_distributed() -> tuple[int, int, torch.device]:
    """Join torchrun's process group (NCCL on CUDA, gloo on CPU); returns (rank, world size, this rank's
    device: cuda:LOCAL_RANK, or cpu). Raises RuntimeError outside torchrun (no RANK/WORLD_SIZE in the env)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("not started by torchrun: run `torchrun --nproc-per-node N -m "
                           "eagle3_core.distributed.train_ddp --config run.json`")
    die_with_parent()                                  # torchrun SIGKILLed: do not linger in a collective
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def shutdown_distributed() -> None:
    """Leave the process group cleanly on every rank: collect garbage first (a DDP model's reducer sits in reference
    cycles and holds the group; freed at interpreter exit, after the group is gone, its gloo threads abort the
    process with 'terminate called without an active exception'), wait for every rank, then destroy the group.
    Only on success: a rank that failed must not wait in a barrier the others may never reach."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def verify_my_shards(store_dir: Path, rank: int, world: int) -> None:
    """Each rank checks the sha256 of every W-th shard (so a 9 TB store is hashed W times faster than by one
    process); raises ValueError on every rank naming the bad shards if any rank found one."""
    shards = read_manifest(store_dir / "manifest.json")["shards"]
    bad = bad_shards(store_dir, shards[rank::world])
    n_bad = torch.tensor([len(bad)], dtype=torch.float64)
    dist.all_reduce(n_bad)
    if n_bad.item():
        raise ValueError(f"{int(n_bad.item())} feature shard(s) corrupt or missing (this rank: "
                         f"{[str(store_dir / b) for b in bad]}); rerun the features stage: it extracts exactly "
                         "those shards again")


def run_train_ddp(cfg: PipelineConfig, log=print) -> dict:
    """stages.run_train on every rank of an initialised process group; returns the stage manifest."""
    from ..manifest import cached_manifest
    from ..stages import _fresh_draft, claim_training_dir, train_key
    rank, world = dist.get_rank(), dist.get_world_size()
    out = cfg.run_dir / "draft"
    key = train_key(cfg)
    if (m := cached_manifest(out / "manifest.json", key)):
        return m
    t0 = time.monotonic()
    verify_my_shards(cfg.run_dir / "features", rank, world)
    samples = load_samples(cfg.run_dir / "features", verify=False)
    n_eval = int(len(samples) * cfg.train.eval_frac)
    train_s, eval_s = samples[n_eval:], samples[:n_eval]
    draft, lm_head = _fresh_draft(cfg)
    if rank == 0:
        claim_training_dir(out, key)                       # state of other inputs: never resume from it
    dist.barrier()
    summary = train_ddp(draft, train_s, eval_s, lm_head, cfg.train, out, log=log)
    manifest = None
    if rank == 0:
        export = export_draft(load_draft(out / "best"), out / "export")      # bf16, probed bit for bit
        log(f"train: best epoch {summary['best']['epoch']} (tau_sim {summary['best']['tau_sim']:.2f}); "
            f"exported to {export}")
        manifest = write_manifest(out / "manifest.json", {
            "inputs_key": key, "export_dir": str(export), "best": summary["best"], "steps": summary["steps"],
            "history": summary["history"], "train_samples": len(train_s), "eval_samples": len(eval_s),
            "world_size": world, "seconds": time.monotonic() - t0})
    dist.barrier()
    return manifest or read_manifest(out / "manifest.json")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, type=Path, help="a PipelineConfig JSON file")
    args = ap.parse_args(argv)
    cfg = PipelineConfig.model_validate_json(args.config.read_text())
    rank, _, device = init_distributed()
    cfg.train.device = str(device)
    try:
        run_train_ddp(cfg, log=emit_line if rank == 0 else lambda s: None)
    except BaseException:
        dist.destroy_process_group()          # no barrier: the other ranks may never reach it; torchrun stops them
        raise
    shutdown_distributed()


if __name__ == "__main__":
    main()
