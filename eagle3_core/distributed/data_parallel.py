"""The data-parallel parts of the one training loop (trainer.train), the identity on one process.

Legend: W world size (ranks), r this rank, G = train.grad_accum micro-batches per rank per optimizer step,
K TTT steps.

Why W ranks equal one process with grad_accum W*G (tested: tests/test_distributed.py): one process takes, per
optimizer step, the next W*G batches of the epoch's batch order (trainer.epoch_batches, a pure function of seed,
epoch and sample lengths) and steps on grad = 1/(W*G) * sum_b grad(mean loss of batch b). Rank r takes
micro-batches [r*G, (r+1)*G) of that same group, backpropagates loss_b / G, and DDP averages the gradients over the
W ranks: the same 1/(W*G) * sum_b, only in another summation order (float tolerance). When the epoch's last group is
short, a rank with fewer than G real batches runs a zero-weight micro-batch so that every rank joins every
all-reduce; its gradient is exactly zero.

Each rank reads only the samples of its own micro-batches (FeatureSample reads shards on access), so the feature
store must be on storage every rank can read (a shared file system, or a copy per node). Rank 0 alone writes
checkpoints, TensorBoard scalars and exported drafts. Nothing here knows the draft or the loss.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

STAT_KEYS = ("n", "correct", "chain", "loss")         # ttt.ttt_loss's per-step metric tensors, each [K]


@dataclass(frozen=True)
class DataParallel:
    """Rank `rank` of `world` data-parallel ranks; `device` holds the tensors of its collectives (CUDA under
    NCCL, which has no CPU tensors). With world 1 (the default) every method is the identity and no collective
    runs, so one process needs no process group; with world > 1 every rank must make the same calls in the same
    order (each collective blocks until all ranks reach it)."""

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @classmethod
    def from_process_group(cls) -> DataParallel:
        """This process's place in the initialised torch.distributed process group (torchrun), else rank 0 of 1."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        nccl = dist.get_backend() == "nccl"
        return cls(dist.get_rank(), dist.get_world_size(),
                   torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        """True on rank 0, the one rank that writes files and logs."""
        return self.rank == 0

    def micro_batches(self, group: list[list[int]], accum: int) -> list[list[int] | None]:
        """This rank's micro-batches of one optimizer step's `group` (the next W*G batches of the epoch's order,
        fewer at an epoch's end): positions [r*G, (r+1)*G). On W > 1 ranks the list is padded to G with None (a
        zero-weight micro-batch); on one process it is the group itself (no padding: nothing to wait for)."""
        mine = group[self.rank * accum:(self.rank + 1) * accum]
        return mine + [None] * (accum - len(mine)) if self.world > 1 else mine

    def shard(self, items: list) -> list:
        """Every W-th item starting at r (round-robin: evaluation batches, shards to hash); all on one process."""
        return items[self.rank::self.world]

    def wrap(self, module: nn.Module, device: torch.device) -> nn.Module:
        """DistributedDataParallel(module) on W > 1 ranks (it broadcasts rank 0's parameters once, here; buffers
        are not broadcast again at each forward: the draft's d2t/t2d never change); `module` on one process."""
        if self.world == 1:
            return module
        return DistributedDataParallel(module, broadcast_buffers=False,
                                       device_ids=[device.index] if device.index is not None else None)

    def sync_gradients(self, model: nn.Module, last: bool):
        """Context for one micro-batch's forward and backward: DDP all-reduces gradients only on the step's `last`
        micro-batch (no_sync on the others: one all-reduce per optimizer step); nothing on one process."""
        return model.no_sync() if self.world > 1 and not last else nullcontext()

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (on a device the backend reduces: `device`, or the training device) summed over ranks, in place
        (every rank gets the sum); `t` itself on one process."""
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def sum_int(self, n: int) -> int:
        """An integer count summed over ranks (through float64: exact below 2**53)."""
        if self.world == 1:
            return n
        return int(self.sum(torch.tensor([n], dtype=torch.float64, device=self.device)).item())

    def all_true(self, flag: bool) -> bool:
        """True iff `flag` is True on every rank (e.g. 'my loss is finite': every rank then raises together)."""
        if self.world == 1:
            return flag
        return self.sum(torch.tensor([float(flag)], device=self.device)).item() == self.world

    def sum_stats(self, stats: dict | None, K: int) -> dict | None:
        """Per-TTT-step metric sums (STAT_KEYS, each [K]) summed over ranks, on `device`: counts int64, loss sums
        float64 (added in float64: the ranks' float32 sums lose nothing); a rank that has no batch yet passes None
        (it adds zeros). One process: `stats` unchanged."""
        if self.world == 1:
            return stats
        zeros = torch.zeros(K, dtype=torch.float64)
        flat = torch.stack([(stats[k].double() if stats else zeros).to(self.device) for k in STAT_KEYS])  # [4, K]
        self.sum(flat)
        return {k: flat[i] if k == "loss" else flat[i].long() for i, k in enumerate(STAT_KEYS)}

    def barrier(self) -> None:
        """Wait for every rank (e.g. until rank 0's files exist); nothing on one process."""
        if self.world > 1:
            dist.barrier()
