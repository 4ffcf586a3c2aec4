"""A training process for test_trainer's SIGKILL test: trains the tiny draft on fixed data into OUT_DIR.

Usage: python tests/train_worker.py OUT_DIR [PAUSE_AT_STEP]. With PAUSE_AT_STEP, once the checkpoint of that
optimizer step is written the process prints PAUSED and sleeps, so that the test kills it at a known point.
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import tiny_draft
from eagle3_core.config import TrainConfig
from eagle3_core.training.trainer import train

# 12 samples in batches of 4 (80-token budget): 3 optimizer steps per epoch, a checkpoint after each
CFG = TrainConfig(epochs=3, lr=3e-3, batch_tokens=80, ttt_length=3, warmup_frac=0.1, checkpoint_every=1,
                  keep_checkpoints=2, device="cpu")


def samples(n=12, T=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, 100, (T,), generator=g)
        mask = torch.zeros(T, dtype=torch.bool)
        mask[T // 2:] = True
        out.append({"id": f"s{i}", "input_ids": ids, "loss_mask": mask, "aux": torch.randn(T, 96, generator=g),
                    "final": torch.randn(T, 32, generator=g), "target_top1": torch.roll(ids, -1) // 2 * 2})
    return out


def main():
    torch.set_num_threads(1)                                     # the same kernels in every process
    out_dir, pause = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None

    def log(msg):
        print(msg, flush=True)
        if pause is not None and msg.startswith(f"train: checkpoint step {pause} "):
            print("PAUSED", flush=True)
            time.sleep(600)

    data = samples()
    lm_head = torch.randn(100, 32, generator=torch.Generator().manual_seed(5))
    train(tiny_draft(), data, samples(4, seed=1), lm_head, CFG, out_dir, log=log)


if __name__ == "__main__":
    main()
