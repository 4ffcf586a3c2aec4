"""The draft training loop: AdamW, warmup + cosine, grad clipping, gradient accumulation, bf16 autocast on GPU
(fp32 on CPU), token-budget batches, eval on the held-out split each epoch, best export by simulated tau,
TensorBoard scalars, and atomic checkpoints every `checkpoint_every` optimizer steps that resume mid-epoch to the
same bits. Read it top to bottom.

Recipe defaults follow SpecForge / EAGLE (REFERENCE.md section 3): AdamW betas (0.9, 0.95), grad clip 0.5.
Resumable state (checkpoint.save_training_state): weights, optimizer, scheduler, epoch, position in the epoch's
batch order (the order is a pure function of (seed, epoch, sample lengths)), metric sums of the epoch so far,
best score, history and RNG states.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import time
from pathlib import Path

import torch

from .checkpoint import (
    load_latest_training_state,
    rng_states,
    save_draft,
    save_training_state,
    set_rng_states,
)
from .config import TrainConfig
from .draft_model import DraftShape, Eagle3Draft
from .features import batches_by_tokens
from .ttt import collate, summarize, ttt_loss


def build_draft(shape: DraftShape, embed_tokens: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor,
                seed: int) -> Eagle3Draft:
    """A freshly initialised draft with the vocab map installed and, when H == H_t, the target's frozen
    embedding (a draft with its own hidden size trains its own embedding from the seeded init)."""
    draft = Eagle3Draft(shape)
    draft.init_weights(seed)
    with torch.no_grad():
        if shape.hidden_size == shape.target_hidden_size:
            draft.embed_tokens.weight.copy_(embed_tokens)
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
    return draft


def compile_for_training(draft: Eagle3Draft) -> Eagle3Draft:
    """torch.compile the parts of a TTT step that are the same graph at every step (dense layers before and after
    attention); attention (flex compiles its own kernel) and the step loop stay eager. State-dict names are
    unchanged (bound methods are replaced, modules are not wrapped)."""
    draft.attention_inputs = torch.compile(draft.attention_inputs, dynamic=None)
    draft.attention_outputs = torch.compile(draft.attention_outputs, dynamic=None)
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


def _data_fingerprint(samples: list[dict], cfg: TrainConfig) -> str:
    """Identifies the batch orders a checkpoint's position refers to: sample ids and lengths, budget, seed."""
    key = [[s["id"], len(s["input_ids"])] for s in samples] + [cfg.batch_tokens, cfg.seed, cfg.grad_accum]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()


def resolve_device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _autocast(device: torch.device):
    """bf16 autocast on GPU; plain fp32 on CPU (bf16 matmuls there are slow and only add rounding)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def evaluate_ttt(draft: Eagle3Draft, samples: list[dict], head_draft: torch.Tensor, cfg: TrainConfig) -> dict:
    """TTT metrics (acc_k, cond_acc_k, tau_sim, loss_k) over `samples` without gradients."""
    draft.eval()
    device = head_draft.device
    total = None
    for batch in batches_by_tokens([len(s["input_ids"]) for s in samples], cfg.batch_tokens):
        with _autocast(device):
            _, stats = ttt_loss(draft, _to(collate([samples[i] for i in batch]), device), head_draft,
                                cfg.ttt_length, cfg.step_weight)
        stats["loss"] = stats["loss"] * stats["n"]          # weight batch means by their counts
        total = stats if total is None else {k: total[k] + stats[k] for k in stats}
    total["loss"] = total["loss"] / total["n"].clamp(min=1)
    return summarize({k: v.cpu() for k, v in total.items()})


def prepare_training(draft, target_lm_head: torch.Tensor, cfg: TrainConfig, device: torch.device):
    """Move the draft to `device`, pick its TTT attention (cfg.attention; 'auto': merged_flex on CUDA, eager on
    CPU), compile it if cfg.compile, seed torch with cfg.seed, and build the AdamW optimizer (betas 0.9/0.95, no
    weight decay, fused on CUDA). Returns (head_draft [N, H_t]: the target lm_head rows of the draft vocab, opt)."""
    draft.to(device)
    draft.set_attention(cfg.attention if cfg.attention != "auto" else
                        ("merged_flex" if device.type == "cuda" else "eager"))
    if cfg.compile:
        compile_for_training(draft)
    torch.manual_seed(cfg.seed)
    vocab_ids = draft.draft_to_target(torch.arange(draft.shape.draft_vocab_size, device=device))
    head_draft = target_lm_head.to(device)[vocab_ids]                      # [N, H_t]
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0,
                            fused=device.type == "cuda")
    return head_draft, opt


def restore_training_state(state: dict, draft, opt, sched, device: torch.device) -> tuple:
    """Load a training checkpoint (checkpoint.save_training_state's dict) into the draft, optimizer, scheduler and
    RNGs. Returns (epoch, batch, step, metric sums on `device` or None, tokens, best, history) to continue from."""
    draft.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    set_rng_states(state["rng"])
    sums = {k: v.to(device) for k, v in state["sums"].items()} if state["sums"] else None
    return (state["epoch"], state["batch"], state["step"], sums, state["tokens"], state["best"],
            json.loads(state["history"]))


def train(draft: Eagle3Draft, train_samples: list[dict], eval_samples: list[dict], target_lm_head: torch.Tensor,
          cfg: TrainConfig, out_dir: Path, log=print, stop_after_epochs: int | None = None, on_epoch=None) -> dict:
    """Train `draft` in place (moved to cfg.device); resume from the newest checkpoint in out_dir/checkpoints.

    target_lm_head [V, H_t] fp32. Writes out_dir/last (and out_dir/best, chosen by eval tau_sim, or train tau_sim
    without eval samples) as SGLang draft directories at each epoch end, and resumable checkpoints every
    cfg.checkpoint_every optimizer steps and at each epoch end (the newest cfg.keep_checkpoints kept).
    Raises FloatingPointError naming epoch, step and batch on a non-finite loss or gradient norm, before that
    step changes the weights or anything is saved; ValueError if the checkpoint was written for other data.
    `stop_after_epochs` ends this call after that many epochs (a time-boxed run); calling again resumes.
    on_epoch(epochs_done, epochs): called after each epoch (e.g. to move a progress bar).
    Returns {'best', 'history', 'steps', 'best_dir', 'last_dir'}.
    """
    from torch.utils.tensorboard import SummaryWriter

    out_dir = Path(out_dir)
    device = resolve_device(cfg)
    head_draft, opt = prepare_training(draft, target_lm_head, cfg, device)
    params = [p for p in draft.parameters() if p.requires_grad]
    batches_per_epoch = len(_epoch_batches(train_samples, cfg, 0))
    steps_per_epoch = math.ceil(batches_per_epoch / cfg.grad_accum)
    total_steps = steps_per_epoch * cfg.epochs
    warmup = max(1, int(cfg.warmup_frac * total_steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, total_steps, warmup))
    fingerprint = _data_fingerprint(train_samples, cfg)

    # --- resume: the newest complete checkpoint, or a fresh start
    state, path = load_latest_training_state(out_dir, log)
    if state is not None:
        if state["data"] != fingerprint:
            raise ValueError(f"checkpoint {path} was written for other training data or batching; delete "
                             f"{path.parent} to train from scratch, or restore the original data and settings")
        epoch0, batch0, step, sums, n_tokens, best, history = restore_training_state(state, draft, opt, sched, device)
        log(f"train: resumed from {path.name} (epoch {epoch0}, batch {batch0}, step {step})")
    else:
        epoch0, batch0, step, sums, n_tokens = 0, 0, 0, None, 0
        best, history = {"tau_sim": -1.0, "epoch": -1}, []

    def checkpoint(epoch: int, batch: int) -> None:
        """Everything needed to continue at batch `batch` of epoch `epoch` with the same bits."""
        save_training_state(out_dir, {
            "model": draft.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "epoch": epoch, "batch": batch, "step": step, "data": fingerprint, "tokens": n_tokens,
            "sums": {k: v.cpu() for k, v in sums.items()} if sums else {},
            "best": best, "history": json.dumps(history), "rng": rng_states()}, step, cfg.keep_checkpoints)
        log(f"train: checkpoint step {step} (epoch {epoch}, batch {batch})")

    tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=step if state is not None else None)
    t0 = time.monotonic()
    end_epoch = cfg.epochs if stop_after_epochs is None else min(cfg.epochs, epoch0 + stop_after_epochs)
    for epoch in range(epoch0, end_epoch):
        draft.train()
        batches = _epoch_batches(train_samples, cfg, epoch)
        for b_idx in range(batch0 if epoch == epoch0 else 0, len(batches)):
            batch_ids = batches[b_idx]
            batch = _to(collate([train_samples[i] for i in batch_ids]), device)
            with _autocast(device):
                loss, stats = ttt_loss(draft, batch, head_draft, cfg.ttt_length, cfg.step_weight)
            where = (f"epoch {epoch}, step {step}, batch {b_idx} (samples "
                     f"{[train_samples[i]['id'] for i in batch_ids][:4]}...)")
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite loss {loss.item()} at {where}; lower train.lr or check "
                                         f"the features of these samples")
            (loss / cfg.grad_accum).backward()
            stats["loss"] = stats["loss"] * stats["n"]
            sums = stats if sums is None else {k: sums[k] + stats[k] for k in stats}
            n_tokens += int(batch["valid"].sum())
            if (b_idx + 1) % cfg.grad_accum == 0 or b_idx + 1 == len(batches):
                gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                if not torch.isfinite(gnorm):
                    raise FloatingPointError(f"non-finite gradient norm at {where}; lower train.lr or check "
                                             f"the features of these samples")
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                tb.add_scalar("train/loss", loss.item(), step)
                tb.add_scalar("train/grad_norm", float(gnorm), step)
                tb.add_scalar("train/lr", sched.get_last_lr()[0], step)
                step += 1
                if step % cfg.checkpoint_every == 0 and b_idx + 1 < len(batches):
                    checkpoint(epoch, b_idx + 1)
        sums = {k: v.cpu() for k, v in sums.items()}
        sums["loss"] = sums["loss"] / sums["n"].clamp(min=1)
        train_m = summarize(sums)
        eval_m = evaluate_ttt(draft, eval_samples, head_draft, cfg) if eval_samples else None
        score = (eval_m or train_m)["tau_sim"]
        history.append({"epoch": epoch, "train": train_m, "eval": eval_m, "tokens": n_tokens,
                        "seconds": time.monotonic() - t0})
        for split, m in (("train", train_m), ("eval", eval_m)):
            for k, (a, c) in enumerate(zip(m["acc"], m["cond_acc"]) if m else ()):
                tb.add_scalar(f"{split}/acc_{k}", a, step)
                tb.add_scalar(f"{split}/cond_acc_{k}", c, step)
            if m:
                tb.add_scalar(f"{split}/tau_sim", m["tau_sim"], step)
        elapsed = time.monotonic() - t0
        eta = elapsed / (epoch + 1 - epoch0) * (cfg.epochs - epoch - 1)
        log(f"train: epoch {epoch + 1} of {cfg.epochs}: loss {sum(train_m['loss']):.3f} acc_0 {train_m['acc'][0]:.3f} "
            f"tau_sim {train_m['tau_sim']:.2f}" + (f" eval tau_sim {eval_m['tau_sim']:.2f}" if eval_m else "")
            + f" ({elapsed:.0f} s" + (f", ETA {eta / 60:.1f} min)" if eta > 0 else ")"))
        if on_epoch is not None:
            on_epoch(epoch + 1, cfg.epochs)
        save_draft(draft, out_dir / "last")
        if score > best["tau_sim"]:
            best = {"tau_sim": score, "epoch": epoch}
            save_draft(draft, out_dir / "best")
        sums, n_tokens = None, 0
        checkpoint(epoch + 1, 0)
    tb.close()
    return {"best": best, "history": history, "steps": step, "best_dir": str(out_dir / "best"),
            "last_dir": str(out_dir / "last")}
