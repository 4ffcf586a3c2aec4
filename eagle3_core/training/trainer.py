"""The one draft training loop, for one process or W data-parallel ranks (torchrun): AdamW, warmup + cosine, grad
clipping, gradient accumulation, bf16 autocast on GPU (fp32 on CPU), token-budget batches, eval on the held-out
split each epoch, best export by simulated tau, TensorBoard scalars, and atomic checkpoints every
`checkpoint_every` optimizer steps that resume mid-epoch to the same bits. Read `train` top to bottom; the
data-parallel parts (rank slicing, zero-weight pads, no_sync, all-reduces, rank-0 writes) sit behind
distributed.data_parallel.DataParallel, the identity on one process.

Legend: W ranks, G = cfg.grad_accum micro-batches per rank per optimizer step, K TTT steps, V target vocab,
N draft vocab, H_t target hidden size.

Recipe defaults follow SpecForge / EAGLE (SpecForge `scripts/train_eagle3.py`, EAGLE `train/main.py`): AdamW betas (0.9, 0.95), grad clip 0.5.
Resumable state (checkpoint.save_training_state, the keys written in `train` and read in restore_training_state):
weights, optimizer, scheduler, epoch, position in the epoch's batch order (the order is a pure function of (seed,
epoch, sample lengths)), optimizer steps, metric sums and tokens of the epoch so far (all ranks), best score,
history and RNG states (rank 0's), and the resume key (checkpoint.resume_key: resolved batching, batch tokens,
W*G, seed, window context, the samples), checked field by field before a resume (checkpoint.check_resume).
"""
from __future__ import annotations

import functools
import inspect
import json
import math
import time
from pathlib import Path

import torch
from torch import nn

from eagle3_core.config import TrainConfig
from eagle3_core.distributed.data_parallel import DataParallel
from eagle3_core.training.batch_feed import (
    batch_items,
    device_feed,
    epoch_batches,
    item_ids,
    nonfinite_loss_advice,
    make_batch,
    packed,
    to_device,
)
from eagle3_core.contract.compat import checkpoint_fingerprint_v4
from eagle3_core.contract.numbers import checkpoint_place, eta_text
from eagle3_core.training.checkpoint import (
    check_resume,
    load_latest_training_state,
    rng_states,
    save_draft,
    resume_key,
    save_training_state,
    set_rng_states,
)
from eagle3_core.training.draft_model import Eagle3Draft
from eagle3_core.training.packing import compiled, compiled_training, packed_ttt_loss
from eagle3_core.training.setup import lr_lambda, prepare_training, resolve_device
from eagle3_core.training.stopping import MIN_EVAL_TOKENS, PlateauRule, eval_tokens
from eagle3_core.training.ttt import POSITION_LOSSES, summarize, ttt_loss


def _autocast(device: torch.device):
    """bf16 autocast on GPU; plain fp32 on CPU (bf16 matmuls there are slow and only add rounding)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


class TTTLoss(nn.Module):
    """The draft with its TTT loss as `forward`, so that DDP sees the forward that uses the parameters (the draft
    itself is driven through `step`/`fuse`, which DDP cannot hook). head_draft [N, H_t] is a plain attribute, not
    a buffer: DDP neither broadcasts nor all-reduces it. forward(batch) -> ttt.ttt_loss's (loss, stats)."""

    def __init__(self, draft: Eagle3Draft, head_draft: torch.Tensor, cfg: TrainConfig):
        super().__init__()
        self.draft, self.head_draft, self.cfg = draft, head_draft, cfg

    def forward(self, batch: dict):
        if "doc" in batch:                                              # packed rows: compiled graphs
            return packed_ttt_loss(self.draft, batch, self.head_draft, self.cfg.ttt_length, self.cfg.step_weight,
                                   POSITION_LOSSES[self.cfg.loss])
        return ttt_loss(self.draft, batch, self.head_draft, self.cfg.ttt_length, self.cfg.step_weight,
                        position_loss=POSITION_LOSSES[self.cfg.loss])


def evaluate_ttt(draft: Eagle3Draft, samples: list[dict], head_draft: torch.Tensor, cfg: TrainConfig,
                 dp: DataParallel | None = None) -> dict:
    """TTT metrics over `samples` without gradients: ttt.summarize's {'acc', 'cond_acc', 'loss'} (K floats each)
    and 'tau_sim'. head_draft [N, H_t] on the draft's device. With `dp` (W ranks, every rank calling) the batches
    are split round-robin over the ranks and the sums added over them; default: one process, every batch. Where
    kernels are compiled (CUDA) it runs in grad mode without a backward, so that it reuses the training graphs:
    dynamo guards on grad mode, and a second set of graphs would double the compile time (the first epoch of
    benchmarks/train_loop_real_lengths.py on an H200 took 76 s more than the next, eval graphs included)."""
    with torch.set_grad_enabled(compiled(head_draft.device)):   # compiled: the training graphs (no 2nd compile)
        return _evaluate(draft, samples, head_draft, cfg, dp or DataParallel())


def _evaluate(draft: Eagle3Draft, samples: list[dict], head_draft: torch.Tensor, cfg: TrainConfig,
              dp: DataParallel) -> dict:
    draft.eval()
    device = head_draft.device
    pack = packed(cfg, device)
    total, loss_of = None, TTTLoss(draft, head_draft, cfg)
    for host in device_feed(lambda item: make_batch(samples, item, cfg, pack),
                            dp.shard(batch_items(samples, cfg, pack, cfg.seed)), device):
        with _autocast(device):
            _, stats = loss_of(to_device(host, device))
        stats["loss"] = stats["loss"] * stats["n"]          # weight batch means by their counts
        total = stats if total is None else {k: total[k] + stats[k] for k in stats}
    total = {k: v.cpu() for k, v in dp.sum_stats(total, cfg.ttt_length).items()}
    total["loss"] = total["loss"] / total["n"].clamp(min=1)
    return summarize(total)


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


def _in_compile_scope(fn):
    """Run train() inside packing.compiled_training (its compile policy, restored on return or error). With
    cfg.epochs None: the plateau rule (training.stopping) when the eval samples hold at least MIN_EVAL_TOKENS
    loss-mask tokens (cfg passed on as it is), else cfg.epochs resolved by TrainConfig.epochs_for the train
    samples' tokens (the fallback), each said in the log."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = inspect.signature(fn).bind(*args, **kwargs)
        bound.apply_defaults()
        cfg, log = bound.arguments["cfg"], bound.arguments["log"]
        say = log if DataParallel.from_process_group().is_main else (lambda s: None)
        epoch_tokens = sum(len(s["input_ids"]) for s in bound.arguments["train_samples"])
        held_out = eval_tokens(bound.arguments["eval_samples"]) if cfg.epochs is None else 0
        if cfg.epochs is None and held_out >= MIN_EVAL_TOKENS:
            say(f"train: epochs until the held-out tau_sim stops rising (plateau rule on {held_out:,} held-out "
                f"tokens), at most {cfg.max_epochs} epochs" + (f" and {cfg.max_train_s:g} s" if cfg.max_train_s
                                                                 else ""))
        elif cfg.epochs is None:
            cfg = bound.arguments["cfg"] = cfg.resolved(epoch_tokens)
            say(f"train: {cfg.epochs} epochs by the default recipe's rule ({epoch_tokens:,} tokens an epoch): "
                f"{held_out:,} held-out loss tokens are too few for the plateau rule (needs {MIN_EVAL_TOKENS:,}; "
                f"raise train.eval_frac, or set train.epochs)")
        device = resolve_device(cfg)
        with compiled_training(cfg, device, packed(cfg, device), say, (cfg.epochs or cfg.max_epochs) * epoch_tokens):
            return fn(*bound.args, **bound.kwargs)
    return wrapper


@_in_compile_scope
def train(draft: Eagle3Draft, train_samples: list[dict], eval_samples: list[dict], target_lm_head: torch.Tensor,
          cfg: TrainConfig, out_dir: Path, log=print, stop_after_epochs: int | None = None,
          stop_after_steps: int | None = None, on_step=None, tensorboard: bool = True, on_epoch=None) -> dict:
    """Train `draft` in place on cfg.device; resume from the newest checkpoint in out_dir/checkpoints.

    One process, or every rank of an initialised torch.distributed process group (torchrun; cfg.device 'auto' or 'cuda'
    is then this rank's cuda:LOCAL_RANK, see resolve_device). W ranks with grad_accum G take the optimizer steps of one
    process with grad_accum W*G (distributed/data_parallel.py says why) and write checkpoints with the same keys and
    resume key, so a run resumes on another world size with the same global batch. Every rank passes the same
    samples (read lazily: a rank touches only its micro-batches) and the same seeded draft; rank 0 alone logs and
    writes files.

    target_lm_head [V, H_t] fp32. Writes out_dir/last (and out_dir/best, chosen by eval tau_sim, or train tau_sim
    without eval samples) as SGLang draft directories at each epoch end, resumable checkpoints every
    cfg.checkpoint_every optimizer steps and at each epoch end (the newest cfg.keep_checkpoints kept), and
    TensorBoard scalars under out_dir/tensorboard unless `tensorboard` is False (hosts without the package).
    Raises FloatingPointError on every rank, naming epoch, step and batch, on a non-finite loss (any rank) or
    gradient norm, before that step changes the weights or anything is saved; ValueError naming the field if the
    checkpoint was written for other batches (checkpoint.check_resume: resolved batching, batch tokens, W*G, seed,
    window context, samples). `stop_after_epochs` / `stop_after_steps` end this call after
    that many epochs / optimizer steps (time-boxed runs, resume tests); calling again resumes. `on_step(step, loss)`
    runs on every rank after each optimizer step (loss: the step's mean micro-batch loss over all ranks);
    `on_epoch(epochs_done, epochs)` on rank 0 after each epoch, its out_dir/last written (progress bars, snapshots).
    Batches: packed rows (cfg.batching; 'auto' on CUDA) or padded ones (epoch_batches); where kernels are compiled,
    the run is inside packing.compiled_training (packed: dynamo fails rather than run flex attention unfused).
    Epochs count from 1 wherever a user reads them (log lines, errors, history, best); a checkpoint keeps the 0-based
    index of the epoch it continues. Returns {'best', 'history', 'steps', 'step_losses' (each optimizer step of this call, as for on_step), 'tokens'
    (real tokens trained on by this rank in this call), 'best_dir', 'last_dir'}.
    """
    dp = DataParallel.from_process_group()
    say = log if dp.is_main else (lambda s: None)
    ranks = f" on {dp.world} ranks" if dp.world > 1 else ""
    out_dir, device = Path(out_dir), resolve_device(cfg)
    head_draft, opt = prepare_training(draft, target_lm_head, cfg, device)
    pack = packed(cfg, device)
    params = [p for p in draft.parameters() if p.requires_grad]
    group_size = cfg.grad_accum * dp.world                      # batches per optimizer step, over all ranks
    # epochs unset (and enough held out): the plateau rule, warmup-stable-decay to its decision (training.stopping)
    rule = PlateauRule(cfg.max_epochs, cfg.max_train_s) if cfg.epochs is None else None
    epochs = cfg.epochs or cfg.max_epochs                     # the rule's ceiling
    steps_per_epoch = math.ceil(len(epoch_batches(train_samples, cfg, 0, pack)) / group_size)
    total_steps = steps_per_epoch * epochs
    warmup = max(1, int(cfg.warmup_frac * total_steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, (lambda s: rule.lr_factor(s, steps_per_epoch, warmup)) if rule
                                              else (lambda s: lr_lambda(s, total_steps, warmup)))
    resume = resume_key(train_samples, "packed" if pack else "padded", cfg.batch_tokens, group_size, cfg.seed,
                        cfg.context_tokens() if pack else None)

    # --- resume: the newest complete checkpoint (written for the same batches), or a fresh start
    state, path = load_latest_training_state(out_dir, say)
    if state is not None:
        check_resume(state, resume, path, lambda: checkpoint_fingerprint_v4(train_samples, cfg, group_size, pack))
        if rule is not None and state.get("stopping"):       # the rule decides on as it would have
            rule.load_state_dict(state["stopping"])
        epoch0, batch0, step, sums, n_tokens, best, history = restore_training_state(state, draft, opt, sched, device)
        say(f"train: resumed from {path.name} (epoch {epoch0 + 1}, batch {batch0}, step {step}){ranks}")
    else:
        epoch0, batch0, step, sums, n_tokens = 0, 0, 0, None, 0
        best, history = {"tau_sim": -1.0, "epoch": -1}, []
    if not dp.is_main:             # restored epoch sums and tokens are of all ranks: rank 0 alone carries them on
        sums, n_tokens = None, 0
    model = dp.wrap(TTTLoss(draft, head_draft, cfg), device)      # DDP broadcasts rank 0's weights here

    def checkpoint(epoch: int, batch: int) -> None:
        """Everything needed to continue at batch `batch` of epoch `epoch` with the same bits. Every rank joins
        (sums and tokens are added over ranks); rank 0 writes. Rank 0 runs the first micro-batch of every step,
        so its `sums` is None exactly at an epoch boundary."""
        all_sums, tokens = dp.sum_stats(sums, cfg.ttt_length), dp.sum_int(n_tokens)
        if dp.is_main:
            save_training_state(out_dir, {
                "model": draft.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "epoch": epoch, "batch": batch, "step": step, "resume": resume, "tokens": tokens,
                "sums": {k: v.cpu() for k, v in all_sums.items()} if sums is not None else {},
                "best": best, "history": json.dumps(history), "rng": rng_states(),
                "stopping": rule.state_dict() if rule else {}}, step, cfg.keep_checkpoints)
        say(f"train: checkpoint step {step} ({checkpoint_place(epoch, batch)})")

    tb = None
    if dp.is_main and tensorboard:
        from torch.utils.tensorboard import SummaryWriter
        tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=step if state is not None else None)

    def finish() -> dict:
        if tb:
            tb.close()
        dp.barrier()                                          # rank 0's files exist when any rank returns
        return {"best": best, "history": history, "steps": step, "step_losses": step_losses, "tokens": my_tokens,
                "best_dir": str(out_dir / "best"), "last_dir": str(out_dir / "last"),
                "stopping": rule.summary() if rule else None}

    t0, step_losses, my_tokens, steps_this_call = time.monotonic(), [], 0, 0
    end_epoch = epochs if stop_after_epochs is None else min(epochs, epoch0 + stop_after_epochs)
    for epoch in range(epoch0, end_epoch):
        if rule is not None and rule.stop(epoch):               # resumed after the rule's last epoch
            break
        epoch_t0 = time.monotonic()
        draft.train()
        batches = epoch_batches(train_samples, cfg, epoch, pack)
        plan = [(g0, dp.micro_batches(batches[g0:g0 + group_size], cfg.grad_accum))       # one optimizer step each
                for g0 in range(batch0 if epoch == epoch0 else 0, len(batches), group_size)]
        feed = device_feed(lambda item: make_batch(train_samples, item, cfg, pack),   # CUDA: made ahead
                           [ids or batches[g0] for g0, micro in plan for ids in micro], device)
        for g0, micro in plan:
            group = batches[g0:g0 + group_size]
            # [sum of micro-batch losses, count, then per micro-batch: 1 where its loss is not finite] over all
            # ranks, and this rank's flags: read with the gradient norm in the step's one host sync (a check per
            # micro-batch would stop the host between every forward and its backward)
            loss_sum = torch.zeros(2 + len(micro), dtype=torch.float64, device=device)
            mine, losses = torch.zeros(len(micro), dtype=torch.float64, device=device), []
            for m, batch_ids in enumerate(micro):
                real = batch_ids is not None                               # None: a zero-weight pad (W > 1)
                host = next(feed)
                batch = to_device(host, device)
                with dp.sync_gradients(model, last=m + 1 == len(micro)):   # all-reduce on the last one only
                    with _autocast(device):
                        loss, stats = model(batch)
                    (loss / cfg.grad_accum if real else loss * 0.0).backward()
                losses.append(loss.detach())
                if real:
                    stats["loss"] = stats["loss"] * stats["n"]      # weight batch means by their counts
                    sums = stats if sums is None else {k: sums[k] + stats[k] for k in stats}
                    tokens = int(host["valid"].sum())                 # on the host: no device sync
                    n_tokens, my_tokens = n_tokens + tokens, my_tokens + tokens
                    loss_sum[:2] += torch.stack([loss.detach().double(), loss.new_ones((), dtype=torch.float64)])
                    mine[m] = (~torch.isfinite(loss.detach())).double()
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)   # the same on every rank: grads synced
            loss_sum[2:] = mine
            loss_sum = dp.sum(loss_sum)
            gnorm, mean, *flags = torch.cat([gnorm.double()[None], (loss_sum[0] / loss_sum[1])[None], loss_sum[2:],
                                             mine]).tolist()                  # the step's one host sync
            if any(flags):                                     # every rank stops at this step, before opt.step
                raise _nonfinite_loss(flags[len(micro):], micro, losses, epoch, step, g0, dp, cfg, train_samples,
                                      pack)
            if not math.isfinite(gnorm):
                raise FloatingPointError(f"non-finite gradient norm at epoch {epoch + 1}, step {step} (batches "
                                         f"{g0}..{g0 + len(group) - 1}); lower train.lr or check the features "
                                         f"of this step's samples")
            opt.step()                                 # queued: the host goes on to the next batch meanwhile
            sched.step()
            opt.zero_grad(set_to_none=True)
            step_losses.append(mean)
            if tb:
                tb.add_scalar("train/loss", step_losses[-1], step)
                tb.add_scalar("train/grad_norm", gnorm, step)
                tb.add_scalar("train/lr", sched.get_last_lr()[0], step)
            step += 1
            steps_this_call += 1
            if on_step is not None:
                on_step(step, step_losses[-1])
            if step % cfg.checkpoint_every == 0 and g0 + group_size < len(batches):
                checkpoint(epoch, g0 + group_size)
            if stop_after_steps is not None and steps_this_call >= stop_after_steps:
                return finish()
        # --- epoch end: metrics over all ranks, eval, export, a checkpoint at the start of the next epoch
        epoch_sums = {k: v.cpu() for k, v in dp.sum_stats(sums, cfg.ttt_length).items()}
        epoch_sums["loss"] = epoch_sums["loss"] / epoch_sums["n"].clamp(min=1)
        train_m = summarize(epoch_sums)
        eval_m = evaluate_ttt(draft, eval_samples, head_draft, cfg, dp) if eval_samples else None
        score = (eval_m or train_m)["tau_sim"]
        history.append({"epoch": epoch + 1, "train": train_m, "eval": eval_m, "tokens": dp.sum_int(n_tokens),
                        "seconds": time.monotonic() - t0, "lr": sched.get_last_lr()[0]})
        decaying = rule is not None and rule.decay_start is not None
        if rule is not None:        # the ranks' mean seconds: every rank decides the same (scores are all-reduced)
            secs = dp.sum(torch.tensor([time.monotonic() - epoch_t0], dtype=torch.float64, device=device))
            rule.update(epoch + 1, score, float(secs[0]) / dp.world)
        if tb:
            _epoch_scalars(tb, step, train_m, eval_m)
        elapsed = time.monotonic() - t0
        say(f"train: epoch {epoch + 1} of {'at most ' if rule else ''}{epochs}: loss {sum(train_m['loss']):.3f} acc_0 "
            f"{train_m['acc'][0]:.3f} tau_sim {train_m['tau_sim']:.2f}"
            + (f" eval tau_sim {eval_m['tau_sim']:.2f}" if eval_m else "")
            + f" ({elapsed:.0f} s" + eta_text(elapsed, epoch + 1 - epoch0, epochs - epoch - 1)
            + (f", {dp.world} ranks)" if dp.world > 1 else ")"))
        if dp.is_main:
            save_draft(draft, out_dir / "last")
            if on_epoch is not None:
                on_epoch(epoch + 1, epochs)
        if score > best["tau_sim"]:
            best = {"tau_sim": score, "epoch": epoch + 1}
            if dp.is_main:
                save_draft(draft, out_dir / "best")
        if rule is not None and not decaying and rule.decay_start is not None:
            say(f"train: {rule.reason} after epoch {epoch + 1} (smoothed eval tau_sim {rule.smoothed:.3f}): "
                f"learning-rate decay over {rule.decay_epochs} epoch(s)")
        sums, n_tokens = None, 0
        checkpoint(epoch + 1, 0)
        if rule is not None and rule.stop(epoch + 1):
            say(f"train: stopped after epoch {epoch + 1} by the plateau rule ({rule.reason}); best epoch "
                f"{best['epoch']}")
            break
    return finish()


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


def _epoch_scalars(tb, step: int, train_m: dict, eval_m: dict | None) -> None:
    """TensorBoard: per-step acc_k, cond_acc_k and tau_sim of the epoch's train (and eval) metrics at `step`."""
    for split, m in (("train", train_m), ("eval", eval_m)):
        if m is None:
            continue
        for k, (a, c) in enumerate(zip(m["acc"], m["cond_acc"])):
            tb.add_scalar(f"{split}/acc_{k}", a, step)
            tb.add_scalar(f"{split}/cond_acc_{k}", c, step)
        tb.add_scalar(f"{split}/tau_sim", m["tau_sim"], step)
