"""Peak GPU memory of one draft training step, so that `check` can say before any stage runs whether a packed row
of train.batch_tokens tokens fits the training GPU (the reference case's draft at 32K-token rows does not fit an
80 GB H100: measured, out of memory).

The model, in bytes (P trainable parameters, F frozen ones: the target's embedding; H_t target hidden, N draft
vocab, K TTT steps, L draft layers, W = H + nh*hd + 2*nkv*hd + I the widths one decoder layer keeps per token,
T tokens of the row):

    fixed       = 18 P          fp32 weights, fp32 gradients, AdamW's two fp32 moments, the bf16 copy cast per step
                + 4 F           the frozen embedding, fp32
                + 4 N H_t       the teacher's lm_head rows over the draft vocab, fp32
                + OVERHEAD      what is left: compiled-graph workspace, the batch, the allocator's rounding
    per token   = K (A L W + C N)

OVERHEAD, A and C are a least-squares fit to the peaks `benchmarks/train_throughput.py --mode long` measured
(torch.cuda.max_memory_allocated of our compiled step, flex attention, TTT 7; MEASURED): every measured peak is
within 0.4% of the model. Not measured, so extrapolated: other TTT lengths (taken as linear in K), more than one
draft layer (linear in L), and the trainer's own extras beyond the benchmark's step (a batch of features copied
ahead: 57 KB a token for Kimi-K2.5's aux and final hidden states in bf16, about 2% of the per-token estimate).
What CUDA itself holds (its context, about 0.5 GiB) is outside torch's count: row_fit and
TrainMemory.tokens_that_fit keep CONTEXT_BYTES free.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from eagle3_core.config import TrainConfig
from eagle3_core.training.draft_model import DraftShape, Eagle3Draft

GIB = 2 ** 30
# (draft, row tokens, peak GiB, device, date) measured by benchmarks/train_throughput.py --mode long: the Kimi-K2.5
# draft (--shape kimi: H 7168, 64 x 128 heads, 64 KV heads, I 18432, N 32000, V 163840; benchmarks/data/
# kimi_draft_h100.log and kimi_draft_16k_h100.log) and the Llama-3.1-8B-shaped draft (H 4096, 32 x 128 heads,
# 8 KV heads, I 14336, N 32000, V 128256; docs/benchmarks.md, "--mode long --step whole")
MEASURED = (("kimi", 8192, 52.3, "NVIDIA H100 80GB HBM3", "2026-12-07"),
            ("kimi", 16384, 73.3, "NVIDIA H100 80GB HBM3", "2026-12-07"),
            ("llama8b", 8192, 29.5, "NVIDIA H200", "2026-12-02"),
            ("llama8b", 16384, 43.9, "NVIDIA H200", "2026-12-02"),
            ("llama8b", 32768, 72.1, "NVIDIA H200", "2026-12-02"))
MEASURED_TTT = 7
OVERHEAD_BYTES = 5.90 * GIB
A_BYTES = 5.09                  # per TTT step, per token, per unit of a layer's widths W
C_BYTES = 4.38                  # per TTT step, per token, per draft-vocab logit
CONTEXT_BYTES = 1 * GIB         # left free for CUDA's context and the allocator's slack


@dataclass(frozen=True)
class TrainMemory:
    """fixed_bytes + per_token_bytes x tokens: the peak of one training step on a row of that many tokens."""
    fixed_bytes: float
    per_token_bytes: float

    def at(self, tokens: int) -> float:
        """Peak bytes of a step on a row of `tokens` tokens."""
        return self.fixed_bytes + self.per_token_bytes * tokens

    def tokens_that_fit(self, gpu_bytes: int) -> int:
        """The most tokens a row may hold on a GPU of `gpu_bytes` (CONTEXT_BYTES kept free), rounded down to a
        multiple of 256; 0 where the fixed part alone does not fit."""
        room = gpu_bytes - CONTEXT_BYTES - self.fixed_bytes
        return max(0, math.floor(room / self.per_token_bytes / 256) * 256)


def widths(s: DraftShape) -> int:
    """W: the widths one draft decoder layer keeps per token (hidden, queries, keys and values, MLP)."""
    return s.hidden_size + s.num_attention_heads * s.head_dim + 2 * s.num_key_value_heads * s.head_dim \
        + s.intermediate_size


def parameter_counts(s: DraftShape) -> tuple[int, int]:
    """(trainable, frozen) parameters of the draft of shape `s`, counted on the meta device (no memory)."""
    with torch.device("meta"):
        draft = Eagle3Draft(s)
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in draft.parameters()) - trainable


def known_bytes(s: DraftShape) -> int:
    """The fixed bytes the model counts exactly: 18 P + 4 F + 4 N H_t (module docstring)."""
    P, F = parameter_counts(s)
    return 18 * P + 4 * F + 4 * s.draft_vocab_size * s.target_hidden_size


def train_memory(s: DraftShape, ttt_length: int) -> TrainMemory:
    """The peak-memory model of a training step of the draft of shape `s` with `ttt_length` TTT steps."""
    per_token = ttt_length * (A_BYTES * s.num_hidden_layers * widths(s) + C_BYTES * s.draft_vocab_size)
    return TrainMemory(known_bytes(s) + OVERHEAD_BYTES, per_token)


def row_fit(s: DraftShape, train: TrainConfig, gpus: tuple[int, int] | None) -> tuple[dict, list[tuple[str, str]]]:
    """(facts, problems) of one packed row of train.batch_tokens tokens on one of `gpus` ((count, bytes per GPU);
    None: no GPU, not checked). Refused only where the parts the model counts (weights, gradients, optimizer state,
    activations) exceed the GPU by themselves, without OVERHEAD_BYTES and CONTEXT_BYTES (a fitted constant and an
    allowance, so never the reason of a refusal): then the problem names train.batch_tokens and the longest row that
    fits with the whole estimate. Within those two of the GPU, the fact says it may not fit."""
    mem, T = train_memory(s, train.ttt_length), train.batch_tokens
    fact = {"row_tokens": T, "peak_gib_estimate": round(mem.at(T) / GIB, 1),
            "fixed_gib": round(mem.fixed_bytes / GIB, 1), "per_token_mib": round(mem.per_token_bytes / 2 ** 20, 3)}
    if not gpus:
        return {**fact, "gpu": "none given (check --gpus NxSIZE): not checked"}, []
    have = gpus[1]
    fact["gpu_gib"] = round(have / GIB, 1)
    if mem.at(T) + CONTEXT_BYTES <= have:
        return {**fact, "fits": "yes"}, []
    if mem.at(T) - OVERHEAD_BYTES <= have:
        return {**fact, "fits": f"maybe not: within {(OVERHEAD_BYTES + CONTEXT_BYTES) / GIB:.1f} GiB of the GPU "
                                f"(the model's fitted overhead and CUDA's context)"}, []
    fit = mem.tokens_that_fit(have)
    fix = (f"set train.batch_tokens to {fit:,} or less (longer samples are cut into windows)"
           if fit > train.context_tokens() else "train on GPUs with more memory, or a smaller draft "
           "(draft.intermediate_size, draft.draft_vocab_size)")
    return {**fact, "fits": "no"}, [("train.batch_tokens", (
        f"a training row of {T:,} tokens needs about {mem.at(T) / GIB:.0f} GiB on the GPU ({mem.fixed_bytes / GIB:.0f} "
        f"GiB fixed + {mem.per_token_bytes / 2 ** 20:.2f} MiB per token at TTT {train.ttt_length}; "
        f"training.train_memory), more than the {have / GIB:.0f} GiB of one training GPU: {fix}"))]
