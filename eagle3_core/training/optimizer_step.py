"""One optimizer step of the draft training loop (training.trainer.train): forward and backward of this rank's G
micro-batches, the all-reduced loss and gradient norm read in one host sync, the non-finite checks, then AdamW and
the scheduler. TrainRun carries what every step (and the loop around it) of one train() call shares.

Legend: W ranks, G = cfg.grad_accum micro-batches per rank per optimizer step, K TTT steps, N draft vocab, H_t
target hidden size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from eagle3_core.config import TrainConfig
from eagle3_core.distributed.data_parallel import DataParallel
from eagle3_core.training.batch_feed import item_ids, nonfinite_loss_advice, to_device
from eagle3_core.training.draft_model import Eagle3Draft
from eagle3_core.training.stopping import PlateauRule


def autocast(device: torch.device):
    """bf16 autocast on GPU; plain fp32 on CPU (bf16 matmuls there are slow and only add rounding)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


@dataclass(frozen=True)
class TrainRun:
    """The fixed parts of one train() call: the draft, head_draft [N, H_t], `model` (trainer.TTTLoss, DDP-wrapped
    on W ranks), the trainable `params`, optimizer and scheduler, config, ranks (`dp`), device, packed rows or not,
    the train samples, out_dir, the plateau rule (None with cfg.epochs set), the checkpoints' resume key, the
    TensorBoard writer (None: rank > 0 or no TensorBoard), `say` (log on rank 0, nothing elsewhere) and the
    epoch ceiling `epochs`."""
    draft: Eagle3Draft
    head_draft: torch.Tensor
    model: nn.Module
    params: list
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    cfg: TrainConfig
    dp: DataParallel
    device: torch.device
    pack: bool
    train_samples: list
    out_dir: Path
    rule: PlateauRule | None
    resume: dict
    tb: object
    say: object
    epochs: int


def optimizer_step(run: TrainRun, feed, micro: list, sums: dict | None, epoch: int, step: int, g0: int,
                   n_group: int) -> tuple[float, float, dict | None, int]:
    """Forward and backward of this rank's micro-batches `micro` (ids of each, None for a zero-weight pad; their
    host batches the next ones of `feed`), then one optimizer step (gradients all-reduced on the last micro-batch).
    g0: the step's first batch in the epoch's order, n_group its batch count over all ranks (error messages).
    Returns (mean micro-batch loss over all ranks, gradient norm, `sums` with the real micro-batches' stats added
    (loss weighted by counts), real tokens this rank trained on). Raises FloatingPointError on every rank, naming
    epoch, step and batches, on a non-finite loss (any rank) or gradient norm, before the weights change."""
    dp, cfg, device = run.dp, run.cfg, run.device
    # [sum of micro-batch losses, count, then per micro-batch: 1 where its loss is not finite] over all
    # ranks, and this rank's flags: read with the gradient norm in the step's one host sync (a check per
    # micro-batch would stop the host between every forward and its backward)
    loss_sum = torch.zeros(2 + len(micro), dtype=torch.float64, device=device)
    mine, losses, n_tokens = torch.zeros(len(micro), dtype=torch.float64, device=device), [], 0
    for m, batch_ids in enumerate(micro):
        real = batch_ids is not None                               # None: a zero-weight pad (W > 1)
        host = next(feed)
        batch = to_device(host, device)
        with dp.sync_gradients(run.model, last=m + 1 == len(micro)):   # all-reduce on the last one only
            with autocast(device):
                loss, stats = run.model(batch)
            (loss / cfg.grad_accum if real else loss * 0.0).backward()
        losses.append(loss.detach())
        if real:
            stats["loss"] = stats["loss"] * stats["n"]      # weight batch means by their counts
            sums = stats if sums is None else {k: sums[k] + stats[k] for k in stats}
            n_tokens += int(host["valid"].sum())              # on the host: no device sync
            loss_sum[:2] += torch.stack([loss.detach().double(), loss.new_ones((), dtype=torch.float64)])
            mine[m] = (~torch.isfinite(loss.detach())).double()
    gnorm = torch.nn.utils.clip_grad_norm_(run.params, cfg.grad_clip)   # the same on every rank: grads synced
    loss_sum[2:] = mine
    loss_sum = dp.sum(loss_sum)
    gnorm, mean, *flags = torch.cat([gnorm.double()[None], (loss_sum[0] / loss_sum[1])[None], loss_sum[2:],
                                     mine]).tolist()                  # the step's one host sync
    if any(flags):                                     # every rank stops at this step, before opt.step
        raise _nonfinite_loss(flags[len(micro):], micro, losses, epoch, step, g0, dp, cfg, run.train_samples,
                              run.pack)
    if not math.isfinite(gnorm):
        raise FloatingPointError(f"non-finite gradient norm at epoch {epoch + 1}, step {step} (batches "
                                 f"{g0}..{g0 + n_group - 1}); lower train.lr or check the features "
                                 f"of this step's samples")
    run.opt.step()                                 # queued: the host goes on to the next batch meanwhile
    run.sched.step()
    run.opt.zero_grad(set_to_none=True)
    return mean, gnorm, sums, n_tokens


def _nonfinite_loss(mine: list[float], micro: list, losses: list, epoch: int, step: int, g0: int, dp, cfg,
                    train_samples: list[dict], pack: bool) -> FloatingPointError:
    """The error of a step with a non-finite micro-batch loss on some rank: on the rank that had it, naming epoch,
    step, batch, rank and samples with nonfinite_loss_advice; elsewhere, pointing to that rank's error.
    mine: this rank's flags per micro-batch (1.0: non-finite); losses: its micro-batch losses."""
    m = next((i for i, bad in enumerate(mine) if bad), None)
    if m is None:
        return FloatingPointError(f"non-finite loss on another rank at epoch {epoch + 1}, step {step}; see its error")
    where = (f"epoch {epoch + 1}, step {step}, batch {g0 + dp.rank * cfg.grad_accum + m}"
             + (f", rank {dp.rank}" if dp.world > 1 else "")
             + f" (samples {item_ids(train_samples, micro[m] or [], pack)[:4]}...)")
    return FloatingPointError(f"non-finite loss {losses[m].item()} at {where}: "
                              f"{nonfinite_loss_advice(train_samples, micro[m], pack, cfg.lr)}")
