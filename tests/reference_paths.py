"""Reference implementations, kept only to check the fast ones (docs/architecture.md: they live with the tests). Production
code has one path per computation; these are the former paths, imported by the equivalence tests and by the
benchmarks that measure the speed-up (benchmarks/ put tests/ on sys.path).

- `reference_ttt_loss`: the former TTT step of ttt.ttt_loss: RoPE tables and weight casts at every step, and the
  loss from the teacher's fp32 probabilities (`soft_cross_entropy`) instead of its logits
  (ttt.SoftCrossEntropyFromLogits). Same loss, metrics and gradients up to rounding (tests/test_ttt.py).
- `write_shard_concat` / `concatenating_writer`: the former shard writer: the pieces concatenated (one copy) and
  serialized by `safetensors.torch.save` (another, made holding the GIL), then the same file contract as
  shard_writer.write_shard_parts (temporary file, fsync, rename). safetensors reads the same tensors and metadata
  back from both (tests/test_features.py).
"""
from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

import torch
from safetensors.torch import save

from eagle3_core.contract.manifest import write_atomic
from eagle3_core.features import shard_writer
from eagle3_core.training.ttt import count_step, shift_left, supervised, trim_start


class SoftCrossEntropy(torch.autograd.Function):
    """sum_rows weight * CE(p, softmax(logits)) with CE = logsumexp(logits) - sum_n p_n logits_n (equal to
    -sum_n p_n log_softmax(logits)_n because every teacher row sums to 1, or is 0 where weight is 0).
    Saves the logits and the row log-sum-exp; the backward is (softmax(logits) - p) * weight.
    logits [..., N] any float dtype; p [..., N] fp32/fp64 (no gradient); weight [...] (no gradient). Scalar out.
    """

    @staticmethod
    def forward(ctx, logits, p, weight):
        lf = logits.to(p.dtype)
        lse = torch.logsumexp(lf, dim=-1)                                   # [...]
        ce = lse - (p * lf).sum(-1)
        ctx.save_for_backward(logits, p, weight, lse)
        return (ce * weight).sum()

    @staticmethod
    def backward(ctx, grad):
        logits, p, weight, lse = ctx.saved_tensors
        g = (logits.to(p.dtype) - lse[..., None]).exp_().sub_(p).mul_((weight * grad)[..., None])
        return g.to(logits.dtype), None, None


def soft_cross_entropy(logits: torch.Tensor, p: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over positions where `mask` of the soft cross-entropy -sum_n p_n log softmax(logits)_n (nats).
    logits [B, T, N]; p [B, T, N] teacher probabilities (rows sum to 1 where mask); mask [B, T] bool.
    Returns a scalar in p's dtype; 0 when the mask is empty."""
    weight = mask.to(p.dtype) / mask.sum().clamp(min=1)
    return SoftCrossEntropy.apply(logits, p, weight)


def reference_ttt_loss(draft, batch: dict, target_head_draft: torch.Tensor, ttt_length: int,
                       step_weight: float = 0.8, trim: bool = True):
    """ttt.ttt_loss by the former step (module docstring): same arguments, same (loss, stats)."""
    ids, mask, top1 = batch["input_ids"], batch["loss_mask"], batch["target_top1"]
    B, T = ids.shape
    positions = torch.arange(T, device=ids.device).expand(B, T)
    in_vocab = draft.t2d[top1]                                             # [B, T] target argmax in draft vocab
    loss_dtype = torch.float64 if batch["final"].dtype == torch.float64 else torch.float32
    with torch.no_grad():
        z = batch["final"] @ target_head_draft.T                           # [B, T, N] z_t[draft vocab]
        z = torch.cat([z, z.new_zeros(B, ttt_length + 1, z.shape[-1])], dim=1)
        p_target = z.to(loss_dtype).softmax(-1)                            # [B, T + K + 1, N] probabilities
        p_target[:, T:] = 0
    hidden = draft.fuse(batch["aux"])                                      # [B, T, H]
    start = trim_start(mask, ttt_length) if trim else 0
    cache_k, cache_v = [], []
    total = 0.0
    stats = {"n": [], "correct": [], "chain": [], "loss": []}
    chain = None
    for k in range(ttt_length):
        s0 = start if k > 0 else 0
        if k == 1 and start:
            hidden, chain = hidden[:, start:], chain[:, start:]
        tokens = shift_left(ids, 1 + k)[:, s0:]                            # x_{t+1+k}
        hidden, logits = draft.step(tokens, hidden, (positions + k)[:, s0:], cache_k, cache_v)  # RoPE per step
        m_step = supervised(mask, k)[:, s0:]
        m_loss = m_step & shift_left(in_vocab, 1 + k, False)[:, s0:]
        loss_k = soft_cross_entropy(logits, p_target[:, 1 + k + s0:1 + k + T], m_loss)
        total = total + (step_weight ** k) * loss_k
        chain = count_step(stats, draft, logits, top1, k, s0, m_step, chain, loss_k)   # the same counts
    return total, {k: torch.stack(v) for k, v in stats.items()}


def write_shard_concat(path: Path, parts: dict[str, list[torch.Tensor]], metadata: dict[str, str]) -> tuple[str, int]:
    """shard_writer.write_shard_parts by the former writer (module docstring): same arguments, a file safetensors
    reads back to the same tensors and metadata; returns (sha256 hex of its bytes, size in bytes)."""
    data = save({k: torch.cat(v) for k, v in parts.items()}, metadata=metadata)
    sha = hashlib.sha256(data).hexdigest()
    write_atomic(path, data)
    return sha, len(data)


@contextlib.contextmanager
def concatenating_writer():
    """Within the block, shard_writer.ShardWriter (and so features.write_shards) writes with write_shard_concat:
    the former writer path, for benchmarks/extract_throughput.py."""
    fast = shard_writer.write_shard_parts
    shard_writer.write_shard_parts = write_shard_concat
    try:
        yield
    finally:
        shard_writer.write_shard_parts = fast
