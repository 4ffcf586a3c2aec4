"""The train stage under torchrun: `torchrun --nproc-per-node 8 -m eagle3_core.pipeline.train_ddp --config
run.json` (run.json: a PipelineConfig; the features and vocab stages must have finished under its run_dir).

Every rank joins the process group (NCCL on GPUs, gloo on CPU) and runs run_train, the same function as on
one process: each rank checks 1/W of the feature shards' checksums and trains its share of every optimizer step
(trainer.train); rank 0 exports the best epoch and writes the stage manifest (with `world_size`), so later stages
cannot tell the difference. With W ranks the optimisation equals one process with train.grad_accum x W
(data_parallel.py's docstring).
"""
from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path

import torch
import torch.distributed as dist

from eagle3_core.config import PipelineConfig
from eagle3_core.distributed.launch import die_with_parent, emit_line
from eagle3_core.distributed.rank_exit import rank_main
from eagle3_core.pipeline.train_stage import run_train


def init_distributed() -> tuple[int, int, torch.device]:
    """Join torchrun's process group (NCCL on CUDA, gloo on CPU); returns (rank, world size, this rank's
    device: cuda:LOCAL_RANK, or cpu). Raises RuntimeError outside torchrun (no RANK/WORLD_SIZE in the env)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("not started by torchrun: run `torchrun --nproc-per-node N -m "
                           "eagle3_core.pipeline.train_ddp --config run.json`")
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
    cycles and holds the group), wait for every rank, then destroy the group. Only on success: a rank that failed
    must not wait in a barrier the others may never reach. (The trainer's own entry, `main`, ends through
    rank_exit.rank_main, which does this and also ends the process without tearing the interpreter down under
    gloo's threads; this is for scripts that run trainer.train under torchrun themselves.)"""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """`--config run.json` (read and checked before the process group exists, so a bad file fails alone), then
    run_train on this rank through rank_exit.rank_main (group joined, left in order, on an error too)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, type=Path, help="a PipelineConfig JSON file")
    cfg = PipelineConfig.model_validate_json(ap.parse_args(argv).config.read_text())
    kind = "cuda" if torch.cuda.is_available() else "cpu"        # init_distributed's choice
    if cfg.train.device not in ("auto", kind):       # the same config on every rank, each on its own device
        raise ValueError(f"train.device is {cfg.train.device!r}: under torchrun use 'auto' (or {kind!r}); each "
                         f"rank trains on its own device ({'cuda:LOCAL_RANK' if kind == 'cuda' else 'cpu'})")
    rank_main(init_distributed, lambda: run_train(cfg, log=emit_line if dist.get_rank() == 0 else lambda s: None))


if __name__ == "__main__":
    main()
