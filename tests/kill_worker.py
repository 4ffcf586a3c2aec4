"""A torchrun extraction rank with a fault injected (tests/feature_stores.py kill_a_rank_then_rerun): rank 1
SIGKILLs itself at the start of its `--kill-at`-th forward of `--extractor` ('hf': HFExtractor, the `hf_tp`
backend's; 'sglang': SGLangExtractor, over the SGLang stand-in of tests/sglang_standin on PYTHONPATH), while rank
0's shard writer pauses half-way through shard 1 (so that it is likely mid-write when the rank dies; shard 0 is
written at once). Otherwise eagle3_core.features.tp_extract.main."""
import argparse
import os
import signal
import time

import torch.distributed as dist

from eagle3_core.features import tp_extract
from fault_site.fault_injection import pause_mid_write

ap = argparse.ArgumentParser()
ap.add_argument("--kill-at", type=int, required=True)
ap.add_argument("--extractor", choices=("hf", "sglang"), required=True)
args, rest = ap.parse_known_args()
if args.extractor == "sglang":
    from eagle3_core.features.sglang_extract import SGLangExtractor as Extractor
else:
    from eagle3_core.features.extract import HFExtractor as Extractor
calls = [0]
forward = Extractor.forward


def dying_forward(self, seqs):
    calls[0] += 1
    if dist.get_rank() == 1 and calls[0] == args.kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return forward(self, seqs)


Extractor.forward = dying_forward
pause_mid_write("shard_00001.safetensors", lambda path: time.sleep(0.5))
tp_extract.main(rest)
