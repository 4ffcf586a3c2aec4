"""The one draft training loop, for one process or W data-parallel ranks (torchrun): AdamW, warmup + cosine, grad
clipping, gradient accumulation, bf16 autocast on GPU (fp32 on CPU), token-budget batches, eval on the held-out
split each epoch, best export by simulated tau, TensorBoard scalars, and atomic checkpoints every
`checkpoint_every` optimizer steps that resume mid-epoch to the same bits. Read `train` top to bottom (one
optimizer step: training.optimizer_step; the epoch end: _end_epoch); the data-parallel parts (rank slicing,
zero-weight pads, no_sync, all-reduces, rank-0 writes) sit behind distributed.data_parallel.DataParallel, the
identity on one process.

Legend: W ranks, G = cfg.grad_accum micro-batches per rank per optimizer step, K TTT steps, V target vocab,
N draft vocab, H_t target hidden size.

Recipe defaults follow SpecForge / EAGLE (SpecForge `scripts/train_eagle3.py`, EAGLE `train/main.py`): AdamW betas
(0.9, 0.95), grad clip 0.5.
Resumable state (checkpoint.save_training_state, the keys written in `_checkpoint` and read in
restore_training_state): weights (all but the frozen target embedding: checkpoint.trained_state), optimizer,
scheduler, epoch, position in the epoch's batch order (the order is a pure function of (seed, epoch, sample
lengths)), optimizer steps, metric sums and tokens of the epoch so far (all ranks), best score, history and RNG
states (rank 0's), and the resume key (checkpoint.resume_key: resolved batching, batch tokens, W*G, seed, window
context, the samples), checked field by field before a resume (checkpoint.check_resume).
"""
from __future__ import annotations

import functools
import inspect
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from eagle3_core.config import TrainConfig
from eagle3_core.distributed.data_parallel import DataParallel
from eagle3_core.training.batch_feed import batch_items, device_feed, epoch_batches, make_batch, packed, to_device
from eagle3_core.contract.compat import checkpoint_fingerprint_v4
from eagle3_core.contract.numbers import checkpoint_place, eta_text
from eagle3_core.training.checkpoint import (
    check_resume,
    load_latest_training_state,
    load_trained_state,
    rng_states,
    save_draft,
    resume_key,
    save_training_state,
    trained_state,
    set_rng_states,
)
from eagle3_core.training.draft_model import Eagle3Draft
from eagle3_core.training.optimizer_step import TrainRun, autocast, optimizer_step
from eagle3_core.training.packing import compiled, compiled_training, packed_ttt_loss
from eagle3_core.training.setup import lr_lambda, prepare_training, resolve_device
from eagle3_core.training.stopping import MIN_EVAL_TOKENS, PlateauRule, eval_tokens
from eagle3_core.training.ttt import POSITION_LOSSES, summarize, ttt_loss


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
        with autocast(device):
            _, stats = loss_of(to_device(host, device))
        stats["loss"] = stats["loss"] * stats["n"]          # weight batch means by their counts
        total = stats if total is None else {k: total[k] + stats[k] for k in stats}
    total = {k: v.cpu() for k, v in dp.sum_stats(total, cfg.ttt_length).items()}
    total["loss"] = total["loss"] / total["n"].clamp(min=1)
    return summarize(total)


def restore_training_state(state: dict, draft, opt, sched, device: torch.device, path: Path) -> tuple:
    """Load a training checkpoint (checkpoint.save_training_state's dict, read from `path`) into the draft
    (checkpoint.load_trained_state), optimizer, scheduler and RNGs. Returns (epoch, batch, step, metric sums on
    `device` or None, tokens, best, history) to continue from."""
    load_trained_state(draft, state["model"], path)
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

    One process, or every rank of an initialised torch.distributed process group (torchrun; cfg.device 'auto' or
    'cuda' is then this rank's cuda:LOCAL_RANK, see resolve_device). W ranks with grad_accum G take the optimizer
    steps of one process with grad_accum W*G (distributed/data_parallel.py says why) and write checkpoints with the
    same keys and resume key, so a run resumes on another world size with the same global batch. Every rank passes
    the same samples (read lazily: a rank touches only its micro-batches) and the same seeded draft; rank 0 alone
    logs and writes files.

    target_lm_head [V, H_t] fp32. Writes out_dir/last (and out_dir/best, chosen by eval tau_sim, or train tau_sim
    without eval samples) as SGLang draft directories at each epoch end, resumable checkpoints every
    cfg.checkpoint_every optimizer steps and at each epoch end (the newest cfg.keep_checkpoints kept), and
    TensorBoard scalars under out_dir/tensorboard unless `tensorboard` is False (hosts without the package).
    Raises FloatingPointError on every rank, naming epoch, step and batch, on a non-finite loss (any rank) or
    gradient norm, before that step changes the weights or anything is saved (optimizer_step); ValueError naming
    the field if the checkpoint was written for other batches (checkpoint.check_resume: resolved batching, batch
    tokens, W*G, seed, window context, samples). `stop_after_epochs` / `stop_after_steps` end this call after that
    many epochs / optimizer steps (time-boxed runs, resume tests); calling again resumes. `on_step(step, loss)`
    runs on every rank after each optimizer step (loss: the step's mean micro-batch loss over all ranks);
    `on_epoch(epochs_done, epochs)` on rank 0 after each epoch, its out_dir/last written (progress bars, snapshots).
    Batches: packed rows (cfg.batching; 'auto' on CUDA) or padded ones (epoch_batches); where kernels are compiled,
    the run is inside packing.compiled_training (packed: dynamo fails rather than run flex attention unfused).
    Epochs count from 1 wherever a user reads them (log lines, errors, history, best); a checkpoint keeps the
    0-based index of the epoch it continues. Returns {'best', 'history', 'steps', 'step_losses' (each optimizer step
    of this call, as for on_step), 'tokens' (real tokens trained on by this rank in this call), 'best_dir',
    'last_dir', 'stopping' (the plateau rule's summary, or None)}.
    """
    run, prog, epoch0, batch0 = _start(draft, train_samples, target_lm_head, cfg, Path(out_dir), log, tensorboard)
    t0, group_size = time.monotonic(), cfg.grad_accum * run.dp.world      # batches per step, over all ranks
    end_epoch = run.epochs if stop_after_epochs is None else min(run.epochs, epoch0 + stop_after_epochs)
    for epoch in range(epoch0, end_epoch):
        if run.rule is not None and run.rule.stop(epoch):               # resumed after the rule's last epoch
            break
        epoch_t0 = time.monotonic()
        draft.train()
        batches = epoch_batches(train_samples, cfg, epoch, run.pack)
        plan = [(g0, run.dp.micro_batches(batches[g0:g0 + group_size], cfg.grad_accum))   # one optimizer step each
                for g0 in range(batch0 if epoch == epoch0 else 0, len(batches), group_size)]
        feed = device_feed(lambda item: make_batch(train_samples, item, cfg, run.pack),   # CUDA: made ahead
                           [ids or batches[g0] for g0, micro in plan for ids in micro], run.device)
        for g0, micro in plan:
            mean, gnorm, prog.sums, tokens = optimizer_step(run, feed, micro, prog.sums, epoch, prog.step, g0,
                                                            len(batches[g0:g0 + group_size]))
            _record_step(run, prog, mean, gnorm, tokens, on_step)
            if prog.step % cfg.checkpoint_every == 0 and g0 + group_size < len(batches):
                _checkpoint(run, prog, epoch, g0 + group_size)
            if stop_after_steps is not None and prog.steps_this_call >= stop_after_steps:
                return _finish(run, prog)
        if _end_epoch(run, prog, epoch, epoch0, epoch_t0, t0, eval_samples, on_epoch):
            break
    return _finish(run, prog)


@dataclass
class _Progress:
    """What a train() call changes as it goes: optimizer steps done, this epoch's metric sums (per-step tensors,
    loss weighted by counts; None before its first batch) and tokens, best {'tau_sim', 'epoch'}, history (one dict
    per epoch: epoch, train, eval, tokens, seconds since this call's loop start, epoch_seconds (its own, eval
    included), call_first (the first epoch of its train() call: compile included), lr), this call's step losses,
    tokens of this rank and steps."""
    step: int
    sums: dict | None
    n_tokens: int
    best: dict
    history: list
    step_losses: list = field(default_factory=list)
    my_tokens: int = 0
    steps_this_call: int = 0


def _start(draft: Eagle3Draft, train_samples: list[dict], target_lm_head: torch.Tensor, cfg: TrainConfig,
           out_dir: Path, log, tensorboard: bool) -> tuple[TrainRun, _Progress, int, int]:
    """The optimizer, schedule, resume key and plateau rule of a train() call, its progress restored from the
    newest checkpoint (or a fresh start), the DDP wrap and TensorBoard writer. Returns (run, progress, epoch,
    batch) to continue from."""
    dp = DataParallel.from_process_group()
    say = log if dp.is_main else (lambda s: None)
    device = resolve_device(cfg)
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
    resumed, prog, epoch0, batch0 = _resume(draft, train_samples, cfg, out_dir, opt, sched, rule, resume, dp, say,
                                            device)
    model = dp.wrap(TTTLoss(draft, head_draft, cfg), device)      # DDP broadcasts rank 0's weights here
    tb = None
    if dp.is_main and tensorboard:
        from torch.utils.tensorboard import SummaryWriter  # optional heavy dependency (tensorboard)
        tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=prog.step if resumed else None)
    return (TrainRun(draft, head_draft, model, params, opt, sched, cfg, dp, device, pack, train_samples, out_dir,
                     rule, resume, tb, say, epochs), prog, epoch0, batch0)


def _resume(draft: Eagle3Draft, train_samples: list[dict], cfg: TrainConfig, out_dir: Path, opt, sched,
            rule: PlateauRule | None, resume: dict, dp: DataParallel, say, device: torch.device) -> tuple:
    """The newest complete checkpoint under out_dir written for the same batches (check_resume: ValueError naming
    the field otherwise) loaded into draft, optimizer, scheduler, rule and RNGs, or a fresh start. Returns
    (resumed, progress, epoch, batch); on ranks > 0 the progress holds no epoch sums or tokens (rank 0 carries the
    restored ones, which are of all ranks)."""
    ranks = f" on {dp.world} ranks" if dp.world > 1 else ""
    group_size, pack = cfg.grad_accum * dp.world, packed(cfg, device)
    state, path = load_latest_training_state(out_dir, say)
    if state is not None:
        check_resume(state, resume, path, lambda: checkpoint_fingerprint_v4(train_samples, cfg, group_size, pack))
        if rule is not None and state.get("stopping"):       # the rule decides on as it would have
            rule.load_state_dict(state["stopping"])
        epoch0, batch0, step, sums, n_tokens, best, history = restore_training_state(state, draft, opt, sched, device,
                                                                                      path)
        say(f"train: resumed from {path.name} (epoch {epoch0 + 1}, batch {batch0}, step {step}){ranks}")
    else:
        epoch0, batch0, step, sums, n_tokens = 0, 0, 0, None, 0
        best, history = {"tau_sim": -1.0, "epoch": -1}, []
    if not dp.is_main:             # restored epoch sums and tokens are of all ranks: rank 0 alone carries them on
        sums, n_tokens = None, 0
    return state is not None, _Progress(step, sums, n_tokens, best, history), epoch0, batch0


def _record_step(run: TrainRun, prog: _Progress, mean: float, gnorm: float, tokens: int, on_step) -> None:
    """Record one optimizer step: its loss, tokens, TensorBoard scalars (loss, grad norm, lr), then on_step."""
    prog.n_tokens, prog.my_tokens = prog.n_tokens + tokens, prog.my_tokens + tokens
    prog.step_losses.append(mean)
    if run.tb:
        run.tb.add_scalar("train/loss", prog.step_losses[-1], prog.step)
        run.tb.add_scalar("train/grad_norm", gnorm, prog.step)
        run.tb.add_scalar("train/lr", run.sched.get_last_lr()[0], prog.step)
    prog.step += 1
    prog.steps_this_call += 1
    if on_step is not None:
        on_step(prog.step, prog.step_losses[-1])


def _checkpoint(run: TrainRun, prog: _Progress, epoch: int, batch: int) -> None:
    """Everything needed to continue at batch `batch` of epoch `epoch` with the same bits. Every rank joins (sums
    and tokens are added over ranks); rank 0 writes. Rank 0 runs the first micro-batch of every step, so its
    `sums` is None exactly at an epoch boundary."""
    dp, sums = run.dp, prog.sums
    all_sums, tokens = dp.sum_stats(sums, run.cfg.ttt_length), dp.sum_int(prog.n_tokens)
    if dp.is_main:
        save_training_state(run.out_dir, {
            "model": trained_state(run.draft), "optimizer": run.opt.state_dict(), "scheduler": run.sched.state_dict(),
            "epoch": epoch, "batch": batch, "step": prog.step, "resume": run.resume, "tokens": tokens,
            "sums": {k: v.cpu() for k, v in all_sums.items()} if sums is not None else {},
            "best": prog.best, "history": json.dumps(prog.history), "rng": rng_states(),
            "stopping": run.rule.state_dict() if run.rule else {}}, prog.step, run.cfg.keep_checkpoints)
    run.say(f"train: checkpoint step {prog.step} ({checkpoint_place(epoch, batch)})")


def _end_epoch(run: TrainRun, prog: _Progress, epoch: int, epoch0: int, epoch_t0: float, t0: float,
               eval_samples: list[dict], on_epoch) -> bool:
    """Epoch end: metrics over all ranks, eval, history, the plateau rule's update, export of out_dir/last (and
    best), a checkpoint at the start of the next epoch. Returns True where the plateau rule stops the run."""
    dp, rule, say, epochs = run.dp, run.rule, run.say, run.epochs
    epoch_sums = {k: v.cpu() for k, v in dp.sum_stats(prog.sums, run.cfg.ttt_length).items()}
    epoch_sums["loss"] = epoch_sums["loss"] / epoch_sums["n"].clamp(min=1)
    train_m = summarize(epoch_sums)
    eval_m = evaluate_ttt(run.draft, eval_samples, run.head_draft, run.cfg, dp) if eval_samples else None
    score = (eval_m or train_m)["tau_sim"]
    now = time.monotonic()
    prog.history.append({"epoch": epoch + 1, "train": train_m, "eval": eval_m, "tokens": dp.sum_int(prog.n_tokens),
                         "seconds": now - t0, "epoch_seconds": now - epoch_t0, "call_first": epoch == epoch0,
                         "lr": run.sched.get_last_lr()[0]})
    decaying = rule is not None and rule.decay_start is not None
    if rule is not None:        # the ranks' mean seconds: every rank decides the same (scores are all-reduced)
        secs = dp.sum(torch.tensor([now - epoch_t0], dtype=torch.float64, device=run.device))
        rule.update(epoch + 1, score, float(secs[0]) / dp.world)
    if run.tb:
        _epoch_scalars(run.tb, prog.step, train_m, eval_m)
    elapsed = time.monotonic() - t0
    say(f"train: epoch {epoch + 1} of {'at most ' if rule else ''}{epochs}: loss {sum(train_m['loss']):.3f} acc_0 "
        f"{train_m['acc'][0]:.3f} tau_sim {train_m['tau_sim']:.2f}"
        + (f" eval tau_sim {eval_m['tau_sim']:.2f}" if eval_m else "")
        + f" ({elapsed:.0f} s" + eta_text(elapsed, epoch + 1 - epoch0, epochs - epoch - 1)
        + (f", {dp.world} ranks)" if dp.world > 1 else ")"))
    if dp.is_main:
        save_draft(run.draft, run.out_dir / "last")
        if on_epoch is not None:
            on_epoch(epoch + 1, epochs)
    if score > prog.best["tau_sim"]:
        prog.best = {"tau_sim": score, "epoch": epoch + 1}
        if dp.is_main:
            save_draft(run.draft, run.out_dir / "best")
    if rule is not None and not decaying and rule.decay_start is not None:
        say(f"train: {rule.reason} after epoch {epoch + 1} (smoothed eval tau_sim {rule.smoothed:.3f}): "
            f"learning-rate decay over {rule.decay_epochs} epoch(s)")
    prog.sums, prog.n_tokens = None, 0
    _checkpoint(run, prog, epoch + 1, 0)
    if rule is not None and rule.stop(epoch + 1):
        say(f"train: stopped after epoch {epoch + 1} by the plateau rule ({rule.reason}); best epoch "
            f"{prog.best['epoch']}")
        return True
    return False


def _finish(run: TrainRun, prog: _Progress) -> dict:
    """Close TensorBoard, wait for rank 0's files, and return train()'s result."""
    if run.tb:
        run.tb.close()
    run.dp.barrier()                                          # rank 0's files exist when any rank returns
    return {"best": prog.best, "history": prog.history, "steps": prog.step, "step_losses": prog.step_losses,
            "tokens": prog.my_tokens, "best_dir": str(run.out_dir / "best"), "last_dir": str(run.out_dir / "last"),
            "stopping": run.rule.summary() if run.rule else None}


def _epoch_scalars(tb, step: int, train_m: dict, eval_m: dict | None) -> None:
    """TensorBoard: per-step acc_k, cond_acc_k and tau_sim of the epoch's train (and eval) metrics at `step`."""
    for split, m in (("train", train_m), ("eval", eval_m)):
        if m is None:
            continue
        for k, (a, c) in enumerate(zip(m["acc"], m["cond_acc"])):
            tb.add_scalar(f"{split}/acc_{k}", a, step)
            tb.add_scalar(f"{split}/cond_acc_{k}", c, step)
        tb.add_scalar(f"{split}/tau_sim", m["tau_sim"], step)
