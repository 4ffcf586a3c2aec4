"""Training-time test (TTT) forward, loss and metrics (EAGLE-3 paper arXiv 2503.01840 section 3.2; SpecForge `specforge/core/eagle3.py`).

Legend: B batch, T padded length, H hidden, N draft vocab, K TTT steps.
Alignment (target features f_t after x_0..x_t, target logits z_t predicting x_{t+1}):
  step k, index t: input token x_{t+1+k}, hidden = fused f_t (k=0) or the draft's step k-1 output,
  RoPE position t+k, predicts x_{t+2+k} against softmax(z_{t+1+k}[draft vocab]),
  supervised where loss_mask[t+2+k] = 1 (x_{t+2+k} is an assistant token) and the target's argmax is in the
  draft vocab. So the shift of input, target and mask is the same at every step (handed case C5).
Metrics: acc_k = top-1 agreement of the d2t-mapped draft argmax with the target's argmax over loss-masked positions;
cond_k = P(step k right | steps 0..k-1 right); tau_sim = 1 + sum_k prod_{j<=k} acc_j.
"""
from __future__ import annotations

import torch

from eagle3_core.training.ttt_attention import COMPILE, ttt_caches


def shift_left(x: torch.Tensor, s: int, fill=0) -> torch.Tensor:
    """x[:, t] <- x[:, t + s] along dim 1, padded with `fill` at the end. x [B, T, ...]."""
    if s == 0:
        return x
    pad = torch.full_like(x[:, :s], fill)
    return torch.cat([x[:, s:], pad], dim=1)


def supervised(loss_mask: torch.Tensor, k: int) -> torch.Tensor:
    """[B, T] bool: index t is supervised at TTT step k iff the token it predicts, x_{t+2+k}, has loss_mask 1."""
    return shift_left(loss_mask, 2 + k, False)


FEATURE_KEYS = ("aux", "final", "teacher_logits", "teacher_ids", "tail_shift")    # those a sample has


def feature_keys(sample) -> list[str]:
    """The per-token feature keys `sample` holds: aux and final, and the top-k teacher of fp8_topk (store_formats)."""
    return [k for k in FEATURE_KEYS if k in sample]


def collate(samples: list[dict]) -> dict:
    """Right-pad samples to one batch: input_ids [B, T], loss_mask [B, T], aux [B, T, 3H_t], final [B, T, H_t]
    (the samples' float dtype), fp8_topk's teacher_logits, teacher_ids [B, T, K] and tail_shift [B, T, 1],
    target_top1 [B, T], valid [B, T] (True on real tokens)."""
    T = max(len(s["input_ids"]) for s in samples)
    B = len(samples)
    feats = feature_keys(samples[0])
    out = {"input_ids": torch.zeros(B, T, dtype=torch.long), "loss_mask": torch.zeros(B, T, dtype=torch.bool),
           "target_top1": torch.zeros(B, T, dtype=torch.long), "valid": torch.zeros(B, T, dtype=torch.bool),
           **{k: torch.zeros(B, T, samples[0][k].shape[-1], dtype=samples[0][k].dtype) for k in feats}}
    for b, s in enumerate(samples):
        n = len(s["input_ids"])
        for k in ("input_ids", "loss_mask", "target_top1", *feats):
            out[k][b, :n] = s[k]
        out["valid"][b, :n] = True
    return out


def trim_start(loss_mask: torch.Tensor, ttt_length: int) -> int:
    """First index that steps k >= 1 must compute. Index t feeds only index t of later steps (its output hidden
    and its diagonal key), so a leading region whose tokens no step >= 1 supervises (mask[t+2+k'] = 0 for all
    k' in 1..K-1, i.e. t < first supervised index - K - 1) is skipped; step 0 still runs on it (causal keys)."""
    B, T = loss_mask.shape
    has = loss_mask.any(dim=1)
    first = torch.where(has, loss_mask.float().argmax(dim=1), torch.full((B,), T, device=loss_mask.device))
    return max(0, int(first.min()) - ttt_length - 1)


def _ce_from_teacher_logits(logits, z, z_lse, weight):
    """Forward of SoftCrossEntropyFromLogits: (sum_rows weight * CE, row log-sum-exp of the draft logits)."""
    lf = logits.to(z_lse.dtype)
    lse = torch.logsumexp(lf, dim=-1)
    p = (z.to(lf.dtype) - z_lse[..., None]).exp()                          # teacher softmax, never stored
    return ((lse - (p * lf).sum(-1)) * weight).sum(), lse


def _ce_from_teacher_logits_grad(logits, z, z_lse, weight, lse, grad):
    """Backward of SoftCrossEntropyFromLogits: (softmax(logits) - softmax(z)) * weight * grad, logits' dtype."""
    lf = logits.to(lse.dtype)
    g = (lf - lse[..., None]).exp() - (z.to(lf.dtype) - z_lse[..., None]).exp()
    return (g * (weight * grad)[..., None]).to(logits.dtype)


_COMPILED_CE: dict = {}


def _ce_kernels(cuda: bool):
    """The forward/backward bodies, each compiled into a few fused reductions on CUDA (eager elsewhere, unless
    ttt_attention.COMPILE['everywhere'], tests)."""
    if not (cuda or COMPILE["everywhere"]) or torch.compiler.is_compiling():   # inside a compiled loss: traced
        return _ce_from_teacher_logits, _ce_from_teacher_logits_grad
    if not _COMPILED_CE:
        _COMPILED_CE["fwd"] = torch.compile(_ce_from_teacher_logits, dynamic=None, backend=COMPILE["backend"])
        _COMPILED_CE["bwd"] = torch.compile(_ce_from_teacher_logits_grad, dynamic=None, backend=COMPILE["backend"])
    return _COMPILED_CE["fwd"], _COMPILED_CE["bwd"]


class SoftCrossEntropyFromLogits(torch.autograd.Function):
    """sum_rows weight * CE(p, softmax(logits)) with CE = logsumexp(logits) - sum_n p_n logits_n (equal to
    -sum_n p_n log_softmax(logits)_n because every teacher row sums to 1, or is 0 where weight is 0), the teacher
    given by its logits z and their row log-sum-exp z_lse: p = exp(z - z_lse) is recomputed inside the fused
    forward and backward (bit-for-bit the fp32 softmax of z up to the last ulp), so no [.., N] fp32 teacher tensor
    is read or stored; the backward is one expression, (softmax(logits) - p) * weight. (The reference it is
    checked against, the loss from teacher probabilities: tests/reference_paths.py.)
    logits [..., N] (bf16 under autocast); z [..., N] any float dtype (bf16 teacher logits); z_lse [...] fp32
    (fp64 in tests); weight [...] in z_lse's dtype. Scalar out in z_lse's dtype."""

    @staticmethod
    def forward(ctx, logits, z, z_lse, weight):
        fwd, _ = _ce_kernels(logits.is_cuda)
        loss, lse = fwd(logits, z, z_lse, weight)
        ctx.save_for_backward(logits, z, z_lse, weight, lse)
        return loss

    @staticmethod
    def backward(ctx, grad):
        _, bwd = _ce_kernels(grad.is_cuda)
        return bwd(*ctx.saved_tensors, grad), None, None, None


def tv_from_teacher_logits(logits, z, z_lse, weight):
    """sum_rows weight * TV(p, q): the 'tv' LK loss (arXiv 2602.23881, "LK losses"; vllm-project/speculators'
    `tv`), TV(p, q) = 1 - sum_n min(p_n, q_n) = 0.5 sum_n |p_n - q_n|, the probability that speculative sampling
    rejects a token drafted from q against the target's p at one position (Leviathan et al. 2023, arXiv 2211.17192,
    section 3.1: acceptance sum_n min(p_n, q_n)), so minimising it maximises the expected acceptance directly.
    p = exp(z - z_lse) the teacher over the draft vocab, q = softmax(logits); the same arguments and shapes as
    SoftCrossEntropyFromLogits.apply (logits [..., N], z [..., N], z_lse [...], weight [...] in z_lse's dtype),
    autograd through min (its subgradient: the gradient flows where q_n < p_n). Materialises p and q ([..., N] in
    z_lse's dtype): more memory than the fused cross-entropy."""
    lf = logits.to(z_lse.dtype)
    p = (z.to(lf.dtype) - z_lse[..., None]).exp()
    return ((1 - torch.minimum(p, lf.softmax(-1)).sum(-1)) * weight).sum()


# train.loss -> the loss of one TTT step, (logits, z, z_lse, weight) -> scalar (ttt_loss's position_loss):
# 'kl' the soft cross-entropy against the teacher (KL to it up to the teacher's entropy; EAGLE-3, SpecForge), 'tv'
# the total-variation LK loss
POSITION_LOSSES = {"kl": SoftCrossEntropyFromLogits.apply, "tv": tv_from_teacher_logits}


def teacher(final: torch.Tensor, target_head_draft: torch.Tensor, ttt_length: int):
    """The teacher of every TTT step, without gradient: (z [B, T + K + 1, N] = final @ target_head_draft^T, the
    target's logits over the draft vocab, zero-padded by K + 1 positions so that step k's teacher z_{t+1+k} is
    the view z[:, 1 + k:1 + k + T]; z_lse [B, T + K + 1] their log-sum-exp in loss_dtype_of(final.dtype)).
    final [B, T, H_t], target_head_draft [N, H_t]."""
    with torch.no_grad():
        z = final @ target_head_draft.T
        z = torch.cat([z, z.new_zeros(z.shape[0], ttt_length + 1, z.shape[-1])], dim=1)
        return z, z.to(loss_dtype_of(final.dtype)).logsumexp(-1)


def target_to_draft(draft, n_draft: int) -> torch.Tensor:
    """[V] int64: the draft id of each target id (draft.d2t), -1 for target ids outside the draft vocab."""
    drafts = torch.arange(n_draft, device=draft.t2d.device)
    out = torch.full((draft.t2d.shape[0],), -1, dtype=torch.long, device=draft.t2d.device)
    return out.index_copy(0, draft.draft_to_target(drafts), drafts)


def teacher_of(batch: dict, target_head_draft: torch.Tensor, ttt_length: int, draft):
    """The batch's teacher (z, z_lse) as teacher() gives it from the final states; where the batch holds the
    target's exact top-k logits (store_formats fp8_topk: teacher_logits, teacher_ids [B, T, k], tail_shift
    [B, T, 1]), the logits outside the top k are shifted by tail_shift (their exact total mass) and the top k in
    the draft vocab (draft.d2t) take their exact values."""
    if "teacher_ids" not in batch:
        return teacher(batch["final"], target_head_draft, ttt_length)
    with torch.no_grad():
        N = target_head_draft.shape[0]
        z = batch["final"] @ target_head_draft.T + batch["tail_shift"]          # [B, T, N]
        d = target_to_draft(draft, N)[batch["teacher_ids"]]                    # [B, T, k], -1: not in the vocab
        z = torch.cat([z, z.new_zeros(*z.shape[:-1], 1)], dim=-1)              # a spare column for those
        z = z.scatter(-1, torch.where(d >= 0, d, N), batch["teacher_logits"].to(z.dtype))[..., :N]
        z = torch.cat([z, z.new_zeros(z.shape[0], ttt_length + 1, N)], dim=1)
        return z, z.to(loss_dtype_of(batch["final"].dtype)).logsumexp(-1)


def step_masks(mask: torch.Tensor, in_vocab: torch.Tensor, k: int, doc: torch.Tensor | None = None):
    """(m_step, m_loss), bool [B, T], of TTT step k: m_step where the target x_{t+2+k} is supervised (and, in a
    packed row with document ids `doc` [B, T], in t's own document); m_loss where besides its target's argmax is
    in the draft vocab (in_vocab [B, T], by position of that argmax, shifted here) (module docstring)."""
    m_step = supervised(mask, k)
    if doc is not None:
        m_step = m_step & (shift_left(doc, 2 + k, -2) == doc)
    return m_step, m_step & shift_left(in_vocab, 1 + k, False)


def ttt_loss(draft, batch: dict, target_head_draft: torch.Tensor, ttt_length: int, step_weight: float = 0.8,
             trim: bool = True, position_loss=SoftCrossEntropyFromLogits.apply):
    """Weighted TTT loss and per-step counts for one batch (tensors of `batch` on the draft's device).

    target_head_draft [N, H_t]: rows of the target's lm_head for the draft vocab (in draft-id order).
    Loss = sum_k step_weight**k * loss_k, loss_k the soft cross-entropy against softmax(z_{t+1+k}[draft vocab])
    averaged over positions supervised at step k whose target argmax is in the draft vocab (module docstring).
    position_loss: the loss of one step, (logits, z, z_lse, weight) -> scalar (POSITION_LOSSES: train.loss);
    default the soft cross-entropy above, loss_k then as stated.
    trim: skip the leading unsupervised region at steps >= 1 (same loss and metrics, less compute; trim_start).
    Packed rows (eagle3_core.training.packing.collate_packed: 'doc' and 'position' in the batch) are never trimmed (one
    shape per row); attention stays within a document, RoPE positions are the batch's, and a position is
    supervised only where the token it predicts is in its own document; their flex BlockMask may come built in
    batch['block_mask'] (packing.packed_ttt_loss, which compiles this whole function for the packed rows of long
    runs and otherwise runs the same steps as its own compiled graphs).
    Returns (loss scalar, stats) where stats holds per-step tensors 'n' (supervised positions), 'correct',
    'chain' (positions right at every step so far) and 'loss'. Callers check finiteness.
    """
    ids, mask, top1 = batch["input_ids"], batch["loss_mask"], batch["target_top1"]
    B, T = ids.shape
    doc = batch.get("doc")                                                 # packed rows: [B, T] document ids
    if doc is not None:
        positions, trim = batch["position"], False                         # one shape per row: never trimmed
    else:
        positions = torch.arange(T, device=ids.device).expand(B, T)
    in_vocab = draft.t2d[top1]                                             # [B, T] target argmax in draft vocab
    loss_dtype = loss_dtype_of(batch["final"].dtype)
    z, z_lse = teacher_of(batch, target_head_draft, ttt_length, draft)     # once for all steps
    # RoPE tables and the bf16/fp16 casts of the step's matmul weights once per batch, not at every step
    if doc is None:
        cos, sin = draft.rope(torch.arange(T + ttt_length, device=ids.device).expand(B, -1))   # [B, T + K, hd]
    dt = torch.get_autocast_dtype(ids.device.type) if torch.is_autocast_enabled(ids.device.type) else None
    weights = draft.step_weights(dt) if dt is not None else None
    hidden = draft.fuse(batch["aux"])                                      # [B, T, H]
    start = trim_start(mask, ttt_length) if trim else 0
    # plain lists for the one-layer draft (what the compiled row graph traces); room for later layers' caches else
    cache_k, cache_v = ttt_caches() if draft.shape.num_hidden_layers > 1 else ([], [])
    total = 0.0
    stats = {"n": [], "correct": [], "chain": [], "loss": []}
    chain = None
    for k in range(ttt_length):
        s0 = start if k > 0 else 0                                         # first index this step computes
        if k == 1 and start:
            hidden, chain = hidden[:, start:], chain[:, start:]
        tokens = shift_left(ids, 1 + k)[:, s0:]                            # x_{t+1+k}
        rope = (cos[:, k + s0:k + T], sin[:, k + s0:k + T]) if doc is None else draft.rope(positions + k)
        hidden, logits = draft.step(tokens, hidden, (positions + k)[:, s0:], cache_k, cache_v,
                                    rope=rope, weights=weights, doc=doc, block_mask=batch.get("block_mask"))
        m_step, m_loss = (m[:, s0:] for m in step_masks(mask, in_vocab, k, doc))
        weight = m_loss.to(loss_dtype) / m_loss.sum().clamp(min=1)         # mean over supervised positions
        loss_k = position_loss(logits, z[:, 1 + k + s0:1 + k + T],                       # teacher z_{t+1+k}: views
                               z_lse[:, 1 + k + s0:1 + k + T], weight)
        total = total + (step_weight ** k) * loss_k
        chain = count_step(stats, draft, logits, top1, k, s0, m_step, chain, loss_k)
    return total, {k: torch.stack(v) for k, v in stats.items()}


def count_step(stats: dict, draft, logits: torch.Tensor, top1: torch.Tensor, k: int, s0: int, m_step: torch.Tensor,
                chain: torch.Tensor | None, loss_k: torch.Tensor) -> torch.Tensor:
    """Append TTT step k's counts to `stats` without gradients: supervised positions ('n'), draft argmax equal to
    the target's top1 ('correct'), right at every step so far ('chain'), and its loss. logits [B, Tq, N] from index
    s0; top1 [B, T] target argmax ids; m_step [B, Tq] bool; chain [B, Tq] bool of the steps before (None at
    step 0). Returns the chain including step k."""
    with torch.no_grad():
        pred = draft.draft_to_target(logits.argmax(-1))                # [B, Tq] target ids
        right = (pred == shift_left(top1, 1 + k)[:, s0:]) & m_step
        chain = right if chain is None else chain & right
        stats["n"].append(m_step.sum())
        stats["correct"].append(right.sum())
        stats["chain"].append(chain.sum())
        stats["loss"].append(loss_k.detach())
    return chain


def loss_dtype_of(dtype: torch.dtype) -> torch.dtype:
    """The loss is computed in fp32, or fp64 when the inputs are fp64 (exactness tests)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def summarize(stats: dict) -> dict:
    """acc_k, cond_k, tau_sim and loss_k from summed per-step counts (see module docstring)."""
    n = stats["n"].double().clamp(min=1)
    acc = (stats["correct"].double() / n).tolist()
    chain = stats["chain"].double()
    prev = torch.cat([stats["n"][:1].double(), chain[:-1]])
    cond = (chain / prev.clamp(min=1)).tolist()
    tau_sim, prod = 1.0, 1.0
    for a in acc:
        prod *= a
        tau_sim += prod
    return {"acc": acc, "cond_acc": cond, "tau_sim": tau_sim, "loss": stats["loss"].tolist()}
