"""The draft training loop: AdamW, warmup + cosine, grad clipping, accumulation, per-epoch eval, best checkpoint
by simulated tau, TensorBoard scalars, atomic resumable state. Read it top to bottom.

Recipe defaults follow SpecForge / EAGLE (REFERENCE.md section 3): AdamW betas (0.9, 0.95), grad clip 0.5.
"""
from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch

from .checkpoint import load_training_state, save_draft, save_training_state
from .config import TrainConfig
from .draft_model import DraftShape, Eagle3Draft
from .features import batches_by_tokens
from .ttt import collate, summarize, ttt_loss


def build_draft(shape: DraftShape, embed_tokens: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor,
                seed: int) -> Eagle3Draft:
    """A freshly initialised draft with the target's frozen embedding and the vocab map installed."""
    draft = Eagle3Draft(shape)
    draft.init_weights(seed)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(embed_tokens)
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
    return draft


def lr_lambda(step: int, total: int, warmup: int) -> float:
    """Linear warmup to 1, then cosine to 0.1 of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _epoch_batches(samples: list[dict], cfg: TrainConfig, epoch: int) -> list[list[int]]:
    """Length-bucketed batches under the token budget, in an order seeded by (seed, epoch)."""
    batches = batches_by_tokens([len(s["input_ids"]) for s in samples], cfg.batch_tokens)
    random.Random(cfg.seed * 1000 + epoch).shuffle(batches)
    return batches


@torch.no_grad()
def evaluate_ttt(draft: Eagle3Draft, samples: list[dict], head_draft: torch.Tensor, cfg: TrainConfig) -> dict:
    """TTT metrics (acc_k, cond_acc_k, tau_sim, loss_k) over `samples` without gradients."""
    draft.eval()
    total = None
    for batch in batches_by_tokens([len(s["input_ids"]) for s in samples], cfg.batch_tokens):
        _, stats = ttt_loss(draft, collate([samples[i] for i in batch]), head_draft, cfg.ttt_length, cfg.step_weight)
        stats["loss"] = stats["loss"] * stats["n"]          # weight batch means by their counts
        total = stats if total is None else {k: total[k] + stats[k] for k in stats}
    total["loss"] = total["loss"] / total["n"].clamp(min=1)
    return summarize(total)


def train(draft: Eagle3Draft, train_samples: list[dict], eval_samples: list[dict], target_lm_head: torch.Tensor,
          cfg: TrainConfig, out_dir: Path, log=print, stop_after_epochs: int | None = None) -> dict:
    """Train `draft` in place; resume from out_dir/training_state if present. Returns a summary dict.

    target_lm_head [V, H_t] fp32. Writes out_dir/last (and out_dir/best when eval samples exist) as SGLang draft
    directories and out_dir/training_state.pt after each epoch. Raises FloatingPointError naming epoch, step and
    batch on a non-finite loss, before anything of that epoch is saved. `stop_after_epochs` ends this call after
    that many epochs (a time-boxed run); calling again resumes where it stopped, with the same schedule.
    """
    from torch.utils.tensorboard import SummaryWriter

    torch.manual_seed(cfg.seed)
    head_draft = target_lm_head[draft.draft_to_target(torch.arange(draft.shape.draft_vocab_size))]  # [N, H_t]
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    steps_per_epoch = math.ceil(len(_epoch_batches(train_samples, cfg, 0)) / cfg.grad_accum)
    total_steps = steps_per_epoch * cfg.epochs
    warmup = max(1, int(cfg.warmup_frac * total_steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, total_steps, warmup))
    state = load_training_state(out_dir, draft, opt, sched)
    start_epoch = state["epoch"] + 1 if state else 0
    best = state["best"] if state else {"tau_sim": -1.0, "epoch": -1}
    history = state["history"] if state else []
    if state:
        log(f"train: resumed after epoch {state['epoch']} from {out_dir}")
    tb = SummaryWriter(str(out_dir / "tensorboard"))
    step = start_epoch * steps_per_epoch
    t0 = time.monotonic()
    end_epoch = cfg.epochs if stop_after_epochs is None else min(cfg.epochs, start_epoch + stop_after_epochs)
    for epoch in range(start_epoch, end_epoch):
        draft.train()
        sums, n_tokens = None, 0
        batches = _epoch_batches(train_samples, cfg, epoch)
        for b_idx, batch_ids in enumerate(batches):
            batch = collate([train_samples[i] for i in batch_ids])
            loss, stats = ttt_loss(draft, batch, head_draft, cfg.ttt_length, cfg.step_weight)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite loss {loss.item()} at epoch {epoch}, step {step}, batch "
                                         f"{b_idx} (samples {[train_samples[i]['id'] for i in batch_ids][:4]}...); "
                                         f"lower train.lr or check the features of these samples")
            (loss / cfg.grad_accum).backward()
            stats["loss"] = stats["loss"] * stats["n"]
            sums = stats if sums is None else {k: sums[k] + stats[k] for k in stats}
            n_tokens += int(batch["valid"].sum())
            if (b_idx + 1) % cfg.grad_accum == 0 or b_idx + 1 == len(batches):
                gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                tb.add_scalar("train/loss", loss.item(), step)
                tb.add_scalar("train/grad_norm", float(gnorm), step)
                tb.add_scalar("train/lr", sched.get_last_lr()[0], step)
                step += 1
        sums["loss"] = sums["loss"] / sums["n"].clamp(min=1)
        train_m = summarize(sums)
        eval_m = evaluate_ttt(draft, eval_samples, head_draft, cfg) if eval_samples else None
        score = (eval_m or train_m)["tau_sim"]
        record = {"epoch": epoch, "train": train_m, "eval": eval_m, "tokens": n_tokens,
                  "seconds": time.monotonic() - t0}
        history.append(record)
        for k, a in enumerate(train_m["acc"]):
            tb.add_scalar(f"train/acc_{k}", a, epoch)
        tb.add_scalar("train/tau_sim", train_m["tau_sim"], epoch)
        if eval_m:
            tb.add_scalar("eval/tau_sim", eval_m["tau_sim"], epoch)
        log(f"train: epoch {epoch} loss {sum(train_m['loss']):.3f} acc_0 {train_m['acc'][0]:.3f} "
            f"tau_sim {train_m['tau_sim']:.2f}" + (f" eval tau_sim {eval_m['tau_sim']:.2f}" if eval_m else "")
            + f" ({time.monotonic() - t0:.0f} s)")
        save_draft(draft, out_dir / "last")
        if score > best["tau_sim"]:
            best = {"tau_sim": score, "epoch": epoch}
            save_draft(draft, out_dir / "best")
        save_training_state(out_dir, draft, opt, sched, epoch, best, history)
    tb.close()
    return {"best": best, "history": history, "steps": step, "best_dir": str(out_dir / "best"),
            "last_dir": str(out_dir / "last")}
