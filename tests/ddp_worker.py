"""A torchrun worker for tests/test_distributed.py (gloo on CPU).

  torchrun --standalone --nproc-per-node 2 tests/ddp_worker.py train OUT_DIR [STOP_AFTER_STEPS]
      trains the tiny draft of train_worker.py with trainer.train (train.grad_accum 1 per rank); rank 0
      writes OUT_DIR/result.json (steps, step losses)
  torchrun --standalone --nproc-per-node 2 tests/ddp_worker.py hold
      joins the process group, prints 'rank R pid P ready' and sleeps (the cancellation test kills it)
"""
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import tiny_draft
from eagle3_core.distributed.launch import emit_line
from eagle3_core.distributed.rank_exit import rank_main
from eagle3_core.pipeline.train_ddp import init_distributed
from eagle3_core.training.trainer import train
from train_worker import CFG, samples

LM_HEAD_SEED = 5


def main():
    torch.set_num_threads(1)                                     # the same kernels in every process
    rank_main(init_distributed, _body)                           # the trainer entry's own start and end


def _body():
    rank = dist.get_rank()
    if sys.argv[1] == "hold":
        emit_line(f"rank {rank} pid {os.getpid()} ready")            # one write: ranks share a pipe
        time.sleep(600)
        return
    out_dir, stop = Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None
    lm_head = torch.randn(100, 32, generator=torch.Generator().manual_seed(LM_HEAD_SEED))
    res = train(tiny_draft(), samples(), samples(4, seed=1), lm_head, CFG, out_dir,
                log=emit_line, stop_after_steps=stop)                # train logs on rank 0 only
    if rank == 0:
        (out_dir / "result.json").write_text(json.dumps({"steps": res["steps"], "step_losses": res["step_losses"],
                                                         "history": res["history"]}))


if __name__ == "__main__":
    main()
