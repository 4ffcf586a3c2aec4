"""When a run with `train.epochs` unset stops: the plateau rule of the default recipe, and its learning-rate schedule.

The rule (docs/recipes.md, "Until the plateau"): after each epoch the held-out TTT eval's tau_sim (trainer
evaluate_ttt) is smoothed by an exponential moving average (weight SMOOTHING on the new epoch); once at least
MIN_EPOCHS epochs are done and the smoothed score has not risen by MIN_DELTA above its best for PATIENCE epochs, the
plateau is reached. The schedule is warmup-stable-decay (Hu et al. 2024, MiniCPM, arXiv:2404.06395 section 4.1):
linear warmup, a constant peak, and a cosine decay to 0.1 of the peak over DECAY_FRAC of the epochs done so far (at
least one), started by whichever comes first: the plateau, the epoch ceiling (train.max_epochs) less the decay, or
the wall-time ceiling (train.max_train_s) less the decay's estimated time. The run stops at the decay's end, or at
the first epoch end past max_train_s. The best epoch (raw eval tau_sim) is the one exported, as for fixed epochs.
A stable phase needs no total length in advance, which a cosine to the ceiling would: stopped at a plateau it would
leave the weights at a high learning rate, unannealed.

Fallback: with fewer than MIN_EVAL_TOKENS loss-mask tokens held out (train.eval_frac 0, or a split of a few
samples), the plateau cannot be told from noise; train.epochs_for's fixed count and the cosine schedule are used.

Resume: PlateauRule.state_dict() rides in every training checkpoint (key "stopping"); a resumed run restores it, so
it decides the same from the same eval scores. Seconds are counted per epoch (eval included); the part of an
epoch interrupted before a mid-epoch checkpoint is not counted again.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

MIN_EPOCHS = 4            # no plateau is called before this many epochs
PATIENCE = 2              # epochs without a MIN_DELTA rise of the smoothed score
SMOOTHING = 0.5           # EMA weight of the newest epoch's score
MIN_DELTA = 0.01          # tau_sim (tokens): a rise smaller than this is no rise
DECAY_FRAC = 0.2          # decay epochs: this fraction of the epochs at its start, at least 1
MIN_EVAL_TOKENS = 2048    # held-out loss-mask tokens the rule needs (below: the fixed rule); with K = 7 TTT steps
#                           one token's acceptance moves tau_sim by at most 7 / 2048 = 0.0034, a third of MIN_DELTA
FLOOR = 0.1               # the learning rate at the end of the decay, a fraction of the peak (setup.lr_lambda's)

# measured epochs the rule ran (epoch tokens: all tokens of the train samples), for `plan`'s expected count
MEASURED = [
    # configs/e2e_gsm8k.json's 4,000 regenerated answers: tau_sim still rising at 24 fixed epochs (issue 70, one
    # H100) and at the rule's 14 stable epochs (benchmarks/data/plateau_rule_h100.json): the ceilings decide. The one
    # plateau the rule called there (seed 1, plateau_rule_h100_seed1.json) came after epoch 19, 23 epochs with its
    # decay: one short of the ceiling, so the ceiling stays what plan expects at this size
    {"epoch_tokens": 1_112_398, "epochs": None, "source": "e2e_gsm8k, one H100: no plateau by 24 epochs"},
]


def eval_tokens(samples: list[dict]) -> int:
    """Loss-mask tokens of `samples` (mappings with a 'loss_mask': a bool/int tensor [T] or a list of 0/1)."""
    return int(sum(int(m.sum()) if hasattr(m, "sum") else sum(map(int, m)) for m in (s["loss_mask"] for s in samples)))


@dataclass
class PlateauRule:
    """The plateau rule's state (module docstring). max_epochs >= 1; max_train_s None: no wall-time ceiling.
    update() after every epoch; stop(epochs_done) whether to end there; lr_factor(step, ...) the schedule."""
    max_epochs: int
    max_train_s: float | None = None
    smoothed: float | None = None
    best_smoothed: float = -math.inf
    since_best: int = 0
    epoch_seconds: list = field(default_factory=list)
    decay_start: int | None = None          # epochs done when the decay started
    decay_epochs: int = 0
    reason: str | None = None               # 'plateau', 'max_epochs' or 'max_train_s'
    stopped_at: int | None = None

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)

    def seconds(self) -> float:
        return float(sum(self.epoch_seconds))

    def epoch_estimate(self) -> float:
        """Seconds of one more epoch: the mean of the epochs after the first (it compiles), else the first's."""
        later = self.epoch_seconds[1:] or self.epoch_seconds
        return sum(later) / len(later)

    def update(self, epochs_done: int, score: float, epoch_s: float) -> None:
        """Record epoch `epochs_done` (1-based): its eval tau_sim `score` and its seconds; start the decay when
        the plateau or a ceiling calls for it, and set stopped_at when the run ends here."""
        self.epoch_seconds.append(float(epoch_s))
        self.smoothed = score if self.smoothed is None else SMOOTHING * score + (1 - SMOOTHING) * self.smoothed
        if self.smoothed >= self.best_smoothed + MIN_DELTA:
            self.best_smoothed, self.since_best = self.smoothed, 0
        else:
            self.since_best += 1
        over_time = self.max_train_s is not None and self.seconds() >= self.max_train_s
        if self.decay_start is not None:
            if epochs_done >= self.decay_start + self.decay_epochs or over_time:
                self.stopped_at = epochs_done
            return
        if epochs_done >= self.max_epochs or over_time:          # no room left for a decay
            self.reason = self.reason or ("max_train_s" if over_time else "max_epochs")
            self.stopped_at = epochs_done
            return
        decay = max(1, math.ceil(DECAY_FRAC * epochs_done))
        nxt = epochs_done + 1 + max(1, math.ceil(DECAY_FRAC * (epochs_done + 1)))   # one more stable epoch
        room_epochs = self.max_epochs - epochs_done
        room_time = (math.inf if self.max_train_s is None else
                     (self.max_train_s - self.seconds()) / max(self.epoch_estimate(), 1e-9))
        if epochs_done >= MIN_EPOCHS and self.since_best >= PATIENCE:
            reason = "plateau"
        elif nxt > self.max_epochs:
            reason = "max_epochs"
        elif self.max_train_s is not None and (nxt - epochs_done) > room_time:
            reason = "max_train_s"
        else:
            return
        self.reason, self.decay_start = reason, epochs_done
        self.decay_epochs = max(1, min(decay, room_epochs, room_time if math.isinf(room_time) else int(room_time)))

    def stop(self, epochs_done: int) -> bool:
        return self.stopped_at is not None and epochs_done >= self.stopped_at

    def lr_factor(self, step: int, steps_per_epoch: int, warmup: int) -> float:
        """Multiplier of the peak lr at optimizer step `step` (0-based): linear warmup over `warmup` steps, 1 until
        the decay starts, then cosine to FLOOR over decay_epochs x steps_per_epoch steps."""
        if step < warmup:
            return (step + 1) / warmup
        if self.decay_start is None:
            return 1.0
        start, length = self.decay_start * steps_per_epoch, max(1, self.decay_epochs * steps_per_epoch)
        progress = min(1.0, max(0.0, (step - start) / length))
        return FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * progress))

    def summary(self) -> dict:
        """What the manifest and the log keep: the reason, the decay's start and length, the epochs run, seconds."""
        return {"rule": "plateau", "reason": self.reason, "decay_start": self.decay_start,
                "decay_epochs": self.decay_epochs, "stopped_at": self.stopped_at, "max_epochs": self.max_epochs,
                "max_train_s": self.max_train_s, "seconds": round(self.seconds(), 1)}


def expected_epochs(epoch_tokens: int, max_epochs: int) -> tuple[int, str]:
    """The epochs `plan` expects the rule to run on data of `epoch_tokens` tokens an epoch: the MEASURED point
    nearest in log epoch tokens (its epochs scaled by its epoch tokens / these, the old rule's inverse scaling;
    a point that never reached a plateau gives the ceiling), at most max_epochs. Returns (epochs, its source)."""
    p = min(MEASURED, key=lambda m: abs(math.log(m["epoch_tokens"] / max(epoch_tokens, 1))))
    if p["epochs"] is None:
        return max_epochs, p["source"]
    return max(MIN_EPOCHS, min(max_epochs, math.ceil(p["epochs"] * p["epoch_tokens"] / max(epoch_tokens, 1)))), \
        p["source"]


def planned_epochs(train, epoch_tokens: int) -> tuple[int, str]:
    """What `plan` plans for a TrainConfig `train`: (epochs, how they were chosen). train.epochs when set; unset, the
    rule's expected count (expected_epochs) with its ceilings named (the held-out split is not known before the
    features exist: a split too small for the rule gives train.epochs_for instead, named too)."""
    if train.epochs is not None:
        return train.epochs, f"{train.epochs} epochs"
    E, source = expected_epochs(epoch_tokens, train.max_epochs)
    wall = f" and {train.max_train_s:g} s of training" if train.max_train_s else ""
    return E, (f"{E} epochs expected until the plateau ({source}); ceiling {train.max_epochs} epochs{wall}; "
               f"{train.epochs_for(epoch_tokens)} by the fixed rule if the held-out split is too small")
