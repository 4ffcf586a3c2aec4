"""Draft and training settings: the draft's vocab and geometry, the recipe, batching, checkpoints, warm start."""
from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from eagle3_core.config.strict import StrictModel


CAPACITY_FIELDS = ("num_hidden_layers", "variant")


class DraftConfig(StrictModel):
    draft_vocab_size: int = Field(32000, ge=2, description="N, the draft vocabulary (capped at the target's V)")
    seed: int = Field(0, description="seed of the draft's initial weights")
    # the draft's own geometry; None: the target family's recipe (target_family.draft_geometry)
    num_attention_heads: int | None = Field(None, ge=1, description="draft query heads (None: family recipe)")
    num_key_value_heads: int | None = Field(None, ge=1, description="draft KV heads (None: family recipe)")
    head_dim: int | None = Field(None, ge=1, description="draft head size (None: family recipe; never MLA's "
                                                         "qk_rope_head_dim)")
    intermediate_size: int | None = Field(None, ge=1, description="draft MLP width (None: family recipe)")
    rope_theta: float | None = Field(None, gt=0, description="draft RoPE base (None: family recipe)")
    rope_scaling: dict | Literal["none"] | None = Field(
        None, description="None: family recipe; 'none': plain RoPE; or a {'rope_type': 'llama3', ...} dict")
    max_position_embeddings: int | None = Field(None, ge=1, description="draft positions, at least the target's "
                                                                        "context (None: family recipe)")

    # capacity options (eagle3_core.training.capacity: what they are, which engines serve them); a wider MLP is
    # intermediate_size above. In the train key only away from their defaults (key_fields).
    num_hidden_layers: int = Field(1, ge=1, le=8, description="draft decoder layers (EAGLE-3: 1; layers after the "
                                   "first take the hidden stream alone; llama.cpp serves 1 only)")
    variant: Literal["eagle3", "eagle3.1"] = Field(
        "eagle3", description="'eagle3.1' (arXiv 2605.09992): an RMSNorm per aux hidden state before fc (fc_norm) "
        "and the normed hidden state fed to the next draft step (norm_output); SGLang and vLLM >= 0.22 serve it")

    def capacity(self) -> dict:
        """The capacity options as DraftShape fields: num_hidden_layers, fc_norm, norm_output."""
        v31 = self.variant == "eagle3.1"
        return {"num_hidden_layers": self.num_hidden_layers, "fc_norm": v31, "norm_output": v31}

    def key_fields(self) -> dict:
        """The draft settings a stage key hashes: every field, the capacity options only away from their defaults
        (so that keys written before they existed stay the same)."""
        fields = type(self).model_fields
        return {k: v for k, v in self.model_dump(mode="json").items()
                if k not in CAPACITY_FIELDS or getattr(self, k) != fields[k].default}

    def geometry(self) -> dict:
        """The geometry fields (target_family.GEOMETRY_FIELDS) as a dict; None entries mean 'derive'."""
        return {k: getattr(self, k) for k in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                              "intermediate_size", "rope_theta", "rope_scaling",
                                              "max_position_embeddings")}


# The default recipe (benchmarks/recipe_tau_time.py on 4,000 regenerated GSM8K answers, one H200; docs/recipes.md):
# lr 1e-3 and 6 epochs of ~1.1M tokens beat SpecForge's recipe in less than its wall time. Smaller data keeps
# training longer, up to 12 epochs (1,000 answers: 12 epochs tau 2.22 against 6 epochs 2.00).
RECIPE_EPOCHS, RECIPE_EPOCH_TOKENS, RECIPE_MAX_EPOCHS = 6, 1_100_000, 12


class TrainConfig(StrictModel):
    epochs: int | None = Field(None, ge=1, description="passes over the train samples; None: until the held-out "
                               "tau_sim stops rising, within max_epochs and max_train_s (training.stopping; with "
                               "too few held-out tokens the fixed rule epochs_for)")
    max_epochs: int = Field(24, ge=1, description="epochs unset: the ceiling of the plateau rule's epochs")
    max_train_s: float | None = Field(None, gt=0, description="epochs unset: the plateau rule's wall-time ceiling "
                                      "in seconds of training and held-out eval (None: none)")
    lr: float = Field(1e-3, gt=0, description="peak learning rate (the default recipe's; SpecForge 1e-4, EAGLE 5e-5)")
    warmup_frac: float = Field(0.05, ge=0, le=1, description="fraction of steps in linear warmup, then cosine "
                               "(epochs unset: of max_epochs' steps, then constant until the rule's decay)")
    batch_tokens: int = Field(4096, ge=16, description="token budget of one optimizer micro-batch")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    grad_clip: float = Field(0.5, gt=0, description="gradient norm clipped to this before each step")
    ttt_length: int = Field(7, ge=1, description="training-time-test steps K (EAGLE-3, SpecForge: 7)")
    step_weight: float = Field(0.8, gt=0, description="loss weight of TTT step k is step_weight**k")
    eval_frac: float = Field(0.05, ge=0, lt=1, description="fraction of feature samples held out for eval loss")
    seed: int = Field(0, description="seed of torch and of the batch order")
    checkpoint_every: int = Field(200, ge=1, description="optimizer steps between resumable checkpoints "
                                                         "(one is also written at every epoch end)")
    keep_checkpoints: int = Field(3, ge=1, description="newest resumable checkpoints kept on disk")
    device: str = Field("auto", description="'auto' (CUDA when available, else CPU), 'cpu', 'cuda', 'cuda:1'...")
    attention: Literal["auto", "eager", "merged_math", "merged_flex"] = Field(
        "auto", description="TTT attention implementation; 'auto': merged_flex on CUDA, eager on CPU (same results)")
    compile: bool = Field(False, description="torch.compile the draft's dense parts and the loss (GPU)")
    batching: Literal["auto", "packed", "padded"] = Field(
        "auto", description="'packed': samples (long ones cut into windows) packed into rows of batch_tokens "
        "tokens, one shape for every batch (eagle3_core.training.packing); 'padded': length-bucketed batches padded to "
        "their longest sample; 'auto': packed on CUDA (compiled kernels see one shape), padded on CPU")
    graph: Literal["auto", "step", "row"] = Field(
        "auto", description="packed rows where compiled (GPU): 'step' compiles one graph per TTT step (2 graphs, "
        "quicker to compile), 'row' the K steps of a row as one graph (faster per step, slower to compile); 'auto': "
        "'row' when the run trains more than packing.ROW_GRAPH_TOKENS tokens (epochs x train tokens), else 'step'")
    window_context: int | None = Field(None, ge=1, description="packed: tokens of its own sample a window of a "
                                       "sample longer than batch_tokens carries before its first trained token "
                                       "(>= ttt_length + 1, < batch_tokens); None: min(1024, batch_tokens // 4), "
                                       "at least ttt_length + 1")
    init_from: str | None = Field(None, description="warm start: an EAGLE-3 draft directory in SGLang's format "
                                  "(ours, SpecForge's, a public one) or an earlier run directory (its draft/export); "
                                  "None: a fresh draft (eagle3_core.training.warm_start)")
    loss: Literal["kl", "tv"] = Field(
        "kl", description="the TTT loss per step: 'kl' the soft cross-entropy against the target's softmax (EAGLE-3, "
        "SpecForge); 'tv' the total variation 1 - sum min(p, q), the expected rejection of a drafted token under "
        "speculative sampling (LK losses, arXiv 2602.23881; vllm-project/speculators `tv`): ttt.POSITION_LOSSES")
    init_vocab: Literal["keep", "rebuild"] = Field(
        "keep", description="with init_from: 'keep' the draft's d2t/t2d (the vocab stage reuses them; "
        "draft.draft_vocab_size must equal its N) or 'rebuild' the map from this run's data (lm_head rows are then "
        "carried by target token id)")

    def epochs_for(self, epoch_tokens: int) -> int:
        """The epochs of a run whose train samples hold `epoch_tokens` tokens (all tokens, not only the loss
        mask's): `epochs` when set, else the default recipe's rule (RECIPE_*: 6 epochs from ~1.1M tokens an epoch
        up, below that ceil(6 x 1.1M / epoch_tokens) epochs, at most 12; measured in docs/recipes.md)."""
        if self.epochs is not None:
            return self.epochs
        if epoch_tokens >= RECIPE_EPOCH_TOKENS:
            return RECIPE_EPOCHS
        return min(RECIPE_MAX_EPOCHS, math.ceil(RECIPE_EPOCHS * RECIPE_EPOCH_TOKENS / max(epoch_tokens, 1)))

    def resolved(self, epoch_tokens: int) -> TrainConfig:
        """This config with `epochs` set: epochs_for(epoch_tokens) (itself when epochs is already set)."""
        return self if self.epochs is not None else self.model_copy(update={"epochs": self.epochs_for(epoch_tokens)})

    def context_tokens(self) -> int:
        """The window context in effect (window_context, or its default; eagle3_core.training.packing.windows)."""
        if self.window_context is not None:
            return self.window_context
        return max(self.ttt_length + 1, min(1024, self.batch_tokens // 4))

    @model_validator(mode="after")
    def _windows_progress(self):
        if self.batching != "padded" and not self.ttt_length + 1 <= self.context_tokens() < self.batch_tokens:
            raise ValueError(f"train.window_context {self.context_tokens()} must be at least ttt_length + 1 = "
                             f"{self.ttt_length + 1} (a window's first trained token is predicted from inside it) "
                             f"and below batch_tokens {self.batch_tokens}; set train.window_context in between")
        return self

