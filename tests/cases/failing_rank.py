"""A torchrun worker (gloo, CPU) whose rank 1 fails before the broadcast rank 0 waits in: rank 0 then raises gloo's
'Connection closed by peer'. `raise` (default): rank 1 raises ValueError; `kill`: rank 1 SIGKILLs itself. Written
for launch.root_cause (tests/test_distributed.py); tests/data/torchrun/*.log are its output under torch 2.13."""
import os
import signal
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} up", flush=True)
if rank == 1:
    if sys.argv[1:] == ["kill"]:
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError("the real cause: shard 3 is bad")
dist.broadcast(torch.zeros(1), 1)
