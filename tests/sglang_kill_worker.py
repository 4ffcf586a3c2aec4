"""A `sglang` extraction rank with a fault injected (tests/test_sglang_backend.py): rank 1 SIGKILLs itself at the
start of its `--kill-at`-th forward, while rank 0's shard writer pauses half-way through shard 1 (so that it is
likely mid-write when the rank dies). Otherwise eagle3_core.features.tp_extract.main with backend 'sglang', over
the SGLang stand-in (tests/sglang_standin on PYTHONPATH)."""
import argparse
import os
import signal
import time

import torch.distributed as dist

from eagle3_core.features import tp_extract
from eagle3_core.features.sglang_extract import SGLangExtractor
from fault_site.fault_injection import pause_mid_write

ap = argparse.ArgumentParser()
ap.add_argument("--kill-at", type=int, required=True)
args, rest = ap.parse_known_args()
calls = [0]
forward = SGLangExtractor.forward


def dying_forward(self, seqs):
    calls[0] += 1
    if dist.get_rank() == 1 and calls[0] == args.kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return forward(self, seqs)


SGLangExtractor.forward = dying_forward
pause_mid_write("shard_00001.safetensors", lambda path: time.sleep(0.5))
tp_extract.main(rest)
