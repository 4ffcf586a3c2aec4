"""Data-parallel draft training (torch DDP) that is the same optimisation as `trainer.train` on one process.

Legend: W world size (ranks), G = cfg.grad_accum micro-batches per rank per optimizer step, K TTT steps.

The equivalence (tested: tests/test_distributed.py): one process with grad_accum = W*G takes, per optimizer step,
the next W*G batches of the epoch's batch order (trainer._epoch_batches, a pure function of seed, epoch and sample
lengths) and steps on grad = 1/(W*G) * sum_b grad(mean loss of batch b). Here rank r takes micro-batches
[r*G, (r+1)*G) of that same group, backpropagates loss_b / G, and DDP averages the gradients over the W ranks:
the same 1/(W*G) * sum_b. Only the summation order differs (float tolerance). When the epoch's last group is
short, a rank with fewer than G real batches runs a zero-weight micro-batch so that every rank joins every
all-reduce; its gradient is exactly zero.

Each rank reads only the samples of its own micro-batches (FeatureSample reads shards on access), so the feature
store must be on storage every rank can read (a shared file system, or a copy per node). Rank 0 writes the
checkpoints (the same keys and fingerprint as trainer.train with grad_accum = W*G, so a run can resume on another
world size with the same global batch, or in one process), TensorBoard and the exported drafts.
"""
from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..checkpoint import (
    load_latest_training_state,
    rng_states,
    save_draft,
    save_training_state,
)
from ..config import TrainConfig
from ..draft_model import Eagle3Draft
from ..features import batches_by_tokens
from ..trainer import (
    _autocast,
    _data_fingerprint,
    _epoch_batches,
    _to,
    lr_lambda,
    prepare_training,
    restore_training_state,
)
from ..ttt import collate, summarize, ttt_loss


class TTTLoss(nn.Module):
    """The draft with its TTT loss as `forward`, so that DDP sees the forward that uses the parameters (the draft
    itself is driven through `step`/`fuse`, which DDP cannot hook). head_draft [N, H_t] is a plain attribute,
    not a buffer: DDP neither broadcasts nor all-reduces it."""

    def __init__(self, draft: Eagle3Draft, head_draft: torch.Tensor, cfg: TrainConfig):
        super().__init__()
        self.draft, self.head_draft, self.cfg = draft, head_draft, cfg

    def forward(self, batch: dict):
        return ttt_loss(self.draft, batch, self.head_draft, self.cfg.ttt_length, self.cfg.step_weight)


def rank_micro_batches(group: list[list[int]], rank: int, accum: int) -> list[list[int] | None]:
    """This rank's `accum` micro-batches of one optimizer step's `group` (W*G batches, fewer at an epoch's end):
    positions [rank*accum, (rank+1)*accum); None marks a zero-weight pad."""
    mine = group[rank * accum:(rank + 1) * accum]
    return mine + [None] * (accum - len(mine))


def _all_sum(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def _sum_stats(stats: dict | None, K: int, device) -> dict:
    """Per-step metric sums summed over ranks (zeros for a rank that had no batch)."""
    keys = ("n", "correct", "chain", "loss")
    flat = torch.stack([stats[k].double() if stats else torch.zeros(K, dtype=torch.float64, device=device)
                        for k in keys])                                   # [4, K]
    flat = _all_sum(flat.to(device))
    return {k: flat[i].cpu() for i, k in enumerate(keys)}


@torch.no_grad()
def evaluate_sharded(draft: Eagle3Draft, samples: list, head_draft: torch.Tensor, cfg: TrainConfig) -> dict:
    """TTT metrics over `samples`, their batches split round-robin over the ranks and the sums all-reduced."""
    draft.eval()
    device, rank, world = head_draft.device, dist.get_rank(), dist.get_world_size()
    total = None
    batches = batches_by_tokens([len(s["input_ids"]) for s in samples], cfg.batch_tokens)
    for batch in batches[rank::world]:
        with _autocast(device):
            _, stats = ttt_loss(draft, _to(collate([samples[i] for i in batch]), device), head_draft,
                                cfg.ttt_length, cfg.step_weight)
        stats["loss"] = stats["loss"] * stats["n"]
        total = stats if total is None else {k: total[k] + stats[k] for k in stats}
    sums = _sum_stats(total, cfg.ttt_length, device)
    sums["loss"] = sums["loss"] / sums["n"].clamp(min=1)
    return summarize(sums)


def train_ddp(draft: Eagle3Draft, train_samples: list, eval_samples: list, target_lm_head: torch.Tensor,
              cfg: TrainConfig, out_dir: Path, log=print, stop_after_steps: int | None = None,
              on_step=None, tensorboard: bool = True) -> dict:
    """trainer.train's contract under an initialised process group (torchrun): train `draft` in place on
    cfg.device (this rank's device, e.g. 'cuda:3' or 'cpu'), resume from the newest checkpoint in
    out_dir/checkpoints, write out_dir/{last,best} and checkpoints from rank 0. Every rank passes the same
    samples (they are read lazily: only this rank's micro-batches are touched) and the same seeded draft.

    target_lm_head [V, H_t] fp32. Raises FloatingPointError on every rank when any rank sees a non-finite loss or
    the gradient norm is non-finite (before that step changes the weights), ValueError if the checkpoint was
    written for other data or another global batch. `stop_after_steps` ends this call after that many optimizer
    steps in total (time-boxed runs, resume tests); calling again resumes. `on_step(step, loss)` is called on
    every rank after each optimizer step (loss: the step's mean micro-batch loss over all ranks); `tensorboard`
    False writes no TensorBoard scalars (benchmark hosts without the package).
    Returns {'best', 'history', 'steps', 'step_losses' (mean micro-batch loss of each step of this call, over all
    ranks), 'tokens' (real tokens trained on by this rank in this call), 'best_dir', 'last_dir'}.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    out_dir, device = Path(out_dir), torch.device(cfg.device if cfg.device != "auto" else "cpu")
    one_process = cfg.model_copy(update={"grad_accum": cfg.grad_accum * world})   # what this run equals
    head_draft, opt = prepare_training(draft, target_lm_head, cfg, device)
    params = [p for p in draft.parameters() if p.requires_grad]
    group_size = cfg.grad_accum * world
    batches_per_epoch = len(_epoch_batches(train_samples, cfg, 0))
    total_steps = math.ceil(batches_per_epoch / group_size) * cfg.epochs
    warmup = max(1, int(cfg.warmup_frac * total_steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, total_steps, warmup))
    fingerprint = _data_fingerprint(train_samples, one_process)

    state, path = load_latest_training_state(out_dir, log if rank == 0 else (lambda s: None))
    if state is not None:
        if state["data"] != fingerprint:
            raise ValueError(f"checkpoint {path} was written for other training data or another global batch "
                             f"(world size x grad_accum = {group_size} batches per step); delete {path.parent} "
                             f"to train from scratch, or restore the original data and settings")
        epoch0, batch0, step, sums, n_tokens, best, history = restore_training_state(state, draft, opt, sched, device)
        if rank == 0:
            log(f"train: resumed from {path.name} (epoch {epoch0}, batch {batch0}, step {step}) on {world} ranks")
    else:
        epoch0, batch0, step, sums, n_tokens = 0, 0, 0, None, 0
        best, history = {"tau_sim": -1.0, "epoch": -1}, []
    if rank != 0:                  # epoch metric sums restored from a checkpoint are global: rank 0 carries them
        sums, n_tokens = None, 0
    # DDP broadcasts rank 0's parameters and buffers once here; buffers (d2t, t2d) never change afterwards
    model = DistributedDataParallel(TTTLoss(draft, head_draft, cfg), broadcast_buffers=False,
                                    device_ids=[device.index] if device.type == "cuda" else None)

    def checkpoint(epoch: int, batch: int) -> None:
        """trainer.train's checkpoint keys and dtypes; `sums` and `tokens` summed over ranks (all ranks join).
        Rank 0 always runs the first micro-batch of a step, so its `sums` is None exactly at an epoch boundary."""
        global_sums = _sum_stats(sums, cfg.ttt_length, device)
        tokens = int(_all_sum(torch.tensor([n_tokens], dtype=torch.float64, device=device)).item())
        if rank == 0:
            saved = {k: v.float() if k == "loss" else v.long() for k, v in global_sums.items()} if sums else {}
            save_training_state(out_dir, {
                "model": draft.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "epoch": epoch, "batch": batch, "step": step, "data": fingerprint, "tokens": tokens, "sums": saved,
                "best": best, "history": json.dumps(history), "rng": rng_states()}, step, cfg.keep_checkpoints)
            log(f"train: checkpoint step {step} (epoch {epoch}, batch {batch})")

    tb = None
    if rank == 0 and tensorboard:
        from torch.utils.tensorboard import SummaryWriter
        tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=step if state is not None else None)
    t0, step_losses, my_tokens, steps_this_call = time.monotonic(), [], 0, 0
    for epoch in range(epoch0, cfg.epochs):
        draft.train()
        batches = _epoch_batches(train_samples, cfg, epoch)
        for g0 in range(batch0 if epoch == epoch0 else 0, len(batches), group_size):
            group = batches[g0:g0 + group_size]
            micro = rank_micro_batches(group, rank, cfg.grad_accum)
            loss_sum = torch.zeros(2, dtype=torch.float64, device=device)          # [sum of losses, count]
            for m, batch_ids in enumerate(micro):
                real = batch_ids is not None
                batch = _to(collate([train_samples[i] for i in (batch_ids if real else group[0])]), device)
                sync = m + 1 == len(micro)                                  # all-reduce on the last one only
                with (model.no_sync() if not sync else nullcontext()), _autocast(device):
                    loss, stats = model(batch)
                    where = (f"epoch {epoch}, step {step}, rank {rank} (samples "
                             f"{[train_samples[i]['id'] for i in batch_ids][:4] if real else []}...)")
                    finite = _all_sum(torch.tensor([float(torch.isfinite(loss)) if real else 1.0],
                                                   device=device))
                    if finite.item() < world:
                        raise FloatingPointError(
                            f"non-finite loss at {where}" if real and not torch.isfinite(loss) else
                            f"non-finite loss on another rank at epoch {epoch}, step {step}; see its error")
                    (loss * (1.0 / cfg.grad_accum if real else 0.0)).backward()
                if real:
                    stats["loss"] = stats["loss"] * stats["n"]
                    sums = stats if sums is None else {k: sums[k] + stats[k] for k in stats}
                    n_tokens += int(batch["valid"].sum())
                    my_tokens += int(batch["valid"].sum())
                    loss_sum += torch.stack([loss.detach().double(), loss.new_ones((), dtype=torch.float64)])
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)   # same on every rank: grads are synced
            if not torch.isfinite(gnorm):
                raise FloatingPointError(f"non-finite gradient norm at epoch {epoch}, step {step}; lower "
                                         f"train.lr or check the features of this step's samples")
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            loss_sum = _all_sum(loss_sum)
            step_losses.append(float(loss_sum[0] / loss_sum[1]))
            if tb:
                tb.add_scalar("train/loss", step_losses[-1], step)
                tb.add_scalar("train/grad_norm", float(gnorm), step)
                tb.add_scalar("train/lr", sched.get_last_lr()[0], step)
            step += 1
            steps_this_call += 1
            if on_step is not None:
                on_step(step, step_losses[-1])
            end = g0 + group_size
            if step % cfg.checkpoint_every == 0 and end < len(batches):
                checkpoint(epoch, end)
            if stop_after_steps is not None and steps_this_call >= stop_after_steps:
                return _finish(tb, best, history, step, step_losses, my_tokens, out_dir)
        epoch_sums = _sum_stats(sums, cfg.ttt_length, device)
        epoch_sums["loss"] = epoch_sums["loss"] / epoch_sums["n"].clamp(min=1)
        train_m = summarize(epoch_sums)
        eval_m = evaluate_sharded(draft, eval_samples, head_draft, cfg) if eval_samples else None
        tokens = int(_all_sum(torch.tensor([n_tokens], dtype=torch.float64, device=device)).item())
        history.append({"epoch": epoch, "train": train_m, "eval": eval_m, "tokens": tokens,
                        "seconds": time.monotonic() - t0})
        score = (eval_m or train_m)["tau_sim"]
        if tb:
            for split, mt in (("train", train_m), ("eval", eval_m)):
                for k, (a, c) in enumerate(zip(mt["acc"], mt["cond_acc"]) if mt else ()):
                    tb.add_scalar(f"{split}/acc_{k}", a, step)
                    tb.add_scalar(f"{split}/cond_acc_{k}", c, step)
                if mt:
                    tb.add_scalar(f"{split}/tau_sim", mt["tau_sim"], step)
        if rank == 0:
            log(f"train: epoch {epoch} loss {sum(train_m['loss']):.3f} acc_0 {train_m['acc'][0]:.3f} "
                f"tau_sim {train_m['tau_sim']:.2f}" + (f" eval tau_sim {eval_m['tau_sim']:.2f}" if eval_m else "")
                + f" ({time.monotonic() - t0:.0f} s, {world} ranks)")
            save_draft(draft, out_dir / "last")
        if score > best["tau_sim"]:
            best = {"tau_sim": score, "epoch": epoch}
            if rank == 0:
                save_draft(draft, out_dir / "best")
        sums, n_tokens = None, 0
        checkpoint(epoch + 1, 0)
    return _finish(tb, best, history, step, step_losses, my_tokens, out_dir)


def _finish(tb, best, history, step, step_losses, my_tokens, out_dir: Path) -> dict:
    if tb:
        tb.close()
    dist.barrier()                                                   # rank 0's files exist when any rank returns
    return {"best": best, "history": history, "steps": step, "step_losses": step_losses, "tokens": my_tokens,
            "best_dir": str(out_dir / "best"), "last_dir": str(out_dir / "last")}
