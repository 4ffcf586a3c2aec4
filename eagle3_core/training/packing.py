"""Packed training batches: samples cut into windows and packed into rows of one fixed length.

Legend: L row length (train.batch_tokens), W = L the longest window, C context tokens a window carries
(train.window_context), K TTT steps, n a sample's length.

Why: batches of one shape compile once (no dynamo recompiles as lengths vary, no padding to the longest sample),
and a sample longer than L is trained, not cut.

Windows (`windows`): a sample with n <= L is one piece. A longer one is cut into pieces [a_j, b_j) of at most L
tokens; piece j supervises only the targets u in [c_j, b_j) (c_0 = 0, c_{j+1} = b_j), and carries the C tokens
before c_j as context (a_{j+1} = b_j - C). The ranges [c_j, b_j) partition [0, n), so every supervised token is
trained exactly once at every TTT step, provided C >= K + 1: target u at step k is predicted from index u - 2 - k
(ttt module docstring), which must lie in the same piece. Each prediction of a later piece sees at least C tokens
of its own sample before it; RoPE positions stay the sample's own (a_j + i), as at inference. What is given up:
the draft's attention at a window's start sees C tokens, not the whole prefix (at inference its KV cache holds the
whole sequence); C defaults to min(1024, L // 4) tokens (TrainConfig.context_tokens), so context costs at most a
third more compute on long samples. Its effect on tau against whole-sample training is not measured yet.

Rows (`pack_rows`): pieces in an order seeded by (seed, epoch), placed first-fit into a few open rows of L tokens;
the rest of a row is padding. In a row, every piece is its own document: attention is causal within it (doc ids),
the TTT shifts never cross into the next piece (ttt.ttt_loss checks the doc of each target).
"""
from __future__ import annotations

import random
from contextlib import contextmanager

import torch

from eagle3_core.training.compile_cache import persistent_compile_cache
from eagle3_core.training.ttt import (
    SoftCrossEntropyFromLogits,
    feature_keys,
    loss_dtype_of,
    shift_left,
    step_masks,
    teacher_of,
    ttt_loss,
)
from eagle3_core.training.ttt_attention import (
    COMPILE,
    causal_attention_flex,
    causal_attention_math,
    document_block_mask,
    merge_diagonal_slots,
)

OPEN_ROWS = 8          # rows filled at once by pack_rows (8: 8192-token rows of GSM8K lengths 99.9% full)


def windows(n: int, max_len: int, context: int) -> list[tuple[int, int, int]]:
    """Pieces (a, b, c) of a sample of n tokens: tokens [a, b) (b - a <= max_len), targets supervised from index c
    (a <= c < b; earlier tokens of the piece are context). One piece (0, n, 0) when n <= max_len.
    Raises ValueError if context >= max_len (no progress)."""
    if n <= max_len:
        return [(0, n, 0)]
    if context >= max_len:
        raise ValueError(f"train.window_context {context} must be below train.batch_tokens {max_len}")
    pieces, c = [], 0
    while c < n:
        a = max(0, c - context)
        b = min(n, a + max_len)
        pieces.append((a, b, c))
        c = b
    return pieces


def sample_pieces(lengths: list[int], max_len: int, context: int) -> list[tuple[int, int, int, int]]:
    """(sample index, a, b, c) of every window of every sample (see `windows`), in sample order."""
    return [(i, a, b, c) for i, n in enumerate(lengths) for a, b, c in windows(n, max_len, context)]


def pack_rows(pieces: list[tuple], row_len: int, seed: int) -> list[list[tuple]]:
    """Pieces (tuples whose [1] and [2] are a and b) packed into rows of at most row_len tokens: shuffled by
    `seed`, then first-fit into OPEN_ROWS open rows (the fullest is closed when none has room). A pure function of
    its arguments (resume relies on that). Rows come out in the order they were closed."""
    order = list(pieces)
    random.Random(seed).shuffle(order)
    rows, open_rows = [], []                                 # open: [free tokens, pieces]
    for p in order:
        size = p[2] - p[1]
        if size > row_len:
            raise ValueError(f"piece of {size} tokens does not fit a row of {row_len} (windows() cuts to it)")
        fit = next((r for r in open_rows if r[0] >= size), None)
        if fit is None:
            if len(open_rows) == OPEN_ROWS:
                full = min(open_rows, key=lambda r: r[0])
                open_rows.remove(full)
                rows.append(full[1])
            fit = [row_len, []]
            open_rows.append(fit)
        fit[0] -= size
        fit[1].append(p)
    rows += [r[1] for r in sorted(open_rows, key=lambda r: r[0])]
    return rows


def collate_packed(samples: list[dict], row: list[tuple], row_len: int) -> dict:
    """One packed row as a batch of B = 1: input_ids, loss_mask, target_top1, valid [1, L]; aux [1, L, 3H_t],
    final [1, L, H_t] (the samples' float dtype) and fp8_topk's teacher keys (ttt.collate); doc [1, L] int64
    (piece number in the row, -1 on padding);
    position [1, L] int64 (RoPE position: index in the sample). loss_mask is 0 on a piece's context (before c)."""
    first = samples[row[0][0]]
    out = {"input_ids": torch.zeros(1, row_len, dtype=torch.long),
           "loss_mask": torch.zeros(1, row_len, dtype=torch.bool),
           "target_top1": torch.zeros(1, row_len, dtype=torch.long),
           "valid": torch.zeros(1, row_len, dtype=torch.bool),
           "doc": torch.full((1, row_len), -1, dtype=torch.long),
           "position": torch.zeros(1, row_len, dtype=torch.long),
           **{k: torch.zeros(1, row_len, first[k].shape[-1], dtype=first[k].dtype) for k in feature_keys(first)}}
    at = 0
    for d, (i, a, b, c) in enumerate(row):
        s, n = samples[i], b - a
        for k in ("input_ids", "target_top1", *feature_keys(first)):
            out[k][0, at:at + n] = s[k][a:b]
        mask = torch.as_tensor(s["loss_mask"][a:b]).bool().clone()
        mask[:c - a] = False                                  # context: seen, not trained
        out["loss_mask"][0, at:at + n] = mask
        out["valid"][0, at:at + n] = True
        out["doc"][0, at:at + n] = d
        out["position"][0, at:at + n] = torch.arange(a, b)
        at += n
    return out


def compiled(device: torch.device) -> bool:
    """Whether the TTT kernels (flex attention, the diagonal merge, the loss) run compiled on `device`: on CUDA,
    or anywhere under ttt_attention.COMPILE['everywhere'] (tests)."""
    return device.type == "cuda" or COMPILE["everywhere"]


_COMPILED_STEPS: dict = {}           # backend -> (first, later): the torch.compile'd TTT steps of a packed row
_COMPILED_ROWS: dict = {}            # backend -> torch.compile'd ttt_loss: the K steps of a row as one graph
GRAPH_SCOPE = ["step"]               # 'step' or 'row': set by compiled_training for the length of a train() call
# Above this many trained tokens (epochs x train tokens) train.graph 'auto' compiles a row as one graph. Measured on
# an H200 (benchmarks/train_loop_real_lengths.py, 576-wide draft, N 8192, TTT 7, rows of 4608, 921K tokens per
# epoch): first epoch 38.3 s per step graph against 59.7 s per row graph (compile), later epochs 9.8 s against
# 6.7 s, so the row graph pays off after 21.4 / 3.1 epochs of 921K tokens.
ROW_GRAPH_TOKENS = 6_400_000


def _causal_part(draft):
    """The attention kernel with log-sum-exp for the step-0 keys: flex on GPU (merged_flex), written out else."""
    return causal_attention_flex if draft.midlayer.self_attn.impl == "merged_flex" else causal_attention_math


def _step_end(draft, hidden, attn, weights, z, z_lse, weight, m_step, top1, position_loss):
    """The rest of a TTT step after attention: the layer's output, the step's loss against the teacher
    (position_loss: ttt.POSITION_LOSSES) and the count of positions where the draft's argmax is the target's.
    Returns (hidden, loss_k, right [B, L] bool, correct)."""
    B, nh, L, hd = attn.shape
    out, logits = draft.attention_outputs(hidden, attn.transpose(1, 2).reshape(B, L, nh * hd), weights)
    loss = position_loss(logits, z, z_lse, weight)
    right = (draft.draft_to_target(logits.argmax(-1)) == top1) & m_step
    return out, loss, right, right.sum()


def first_step(draft, aux, tokens, positions, weights, doc, block_mask, z, z_lse, weight, m_step, top1,
               position_loss=SoftCrossEntropyFromLogits.apply):
    """TTT step 0 of a packed row: fc fusion of aux [B, L, 3H_t], the decoder layer attending causally within
    documents, loss and count (tensors as in ttt.ttt_loss at k = 0, already shifted). Returns
    (k0, v0 [B, nkv, L, hd] the step-0 keys/values, hidden [B, L, H], loss_k, right [B, L] bool, correct)."""
    hidden = draft.fuse(aux)
    q, k, v = draft.attention_inputs(tokens, hidden, positions, draft.rope(positions), weights)
    attn, _ = _causal_part(draft)(q, k, v, doc, block_mask)
    return (k, v, *_step_end(draft, hidden, attn, weights, z, z_lse, weight, m_step, top1, position_loss))


def later_step(draft, hidden, tokens, positions, weights, doc, block_mask, k0, v0, diag_k, diag_v, slot,
               z, z_lse, weight, m_step, top1, position_loss=SoftCrossEntropyFromLogits.apply):
    """TTT step k >= 1 of a packed row, one shape for every k (so one compiled graph): diag_k/diag_v
    [K - 1, B, nkv, L, hd] hold the keys/values of steps 1..k-1 in slots 0..k-2 (the rest is ignored); slot, an
    int64 scalar tensor k - 1, is where this step's own key goes (ttt_attention.merge_diagonal_slots). Returns
    (k, v of this step, hidden, loss_k, right, correct)."""
    q, k, v = draft.attention_inputs(tokens, hidden, positions, draft.rope(positions), weights)
    out0, lse0 = _causal_part(draft)(q, k0, v0, doc, block_mask)
    idx = torch.arange(diag_k.shape[0], device=slot.device)
    own = (idx == slot).view(-1, 1, 1, 1, 1)
    attn = merge_diagonal_slots(q, out0, lse0, torch.where(own, k[None], diag_k), torch.where(own, v[None], diag_v),
                                idx <= slot)
    return (k, v, *_step_end(draft, hidden, attn, weights, z, z_lse, weight, m_step, top1, position_loss))


def packed_ttt_loss(draft, batch: dict, head_draft: torch.Tensor, ttt_length: int, step_weight: float = 0.8,
                    position_loss=SoftCrossEntropyFromLogits.apply):
    """ttt.ttt_loss of a packed row (collate_packed's batch, on the draft's device; same arguments and returns,
    same rule: ttt module docstring). Where kernels are compiled (`compiled`), each TTT step is one
    torch.compile'd graph with its backward: step 0 (`first_step`) and steps 1..K-1 (`later_step`, one graph for
    all: the diagonal keys sit in K - 1 fixed slots), so a row compiles 2 graphs, not K, and each is a step's
    layer, attention, loss and metrics fused (a 576-wide draft otherwise spends most of a step launching a
    thousand small kernels one by one). The shifts of inputs, targets and masks by k, the teacher logits and the
    row's flex BlockMask (ttt_attention.document_block_mask) are made here, outside the graphs. Inside a train()
    call whose train.graph resolves to 'row' (compiled_training), ttt_loss is compiled whole instead: one graph of
    K steps, slower to compile, faster per row (ROW_GRAPH_TOKENS). Elsewhere ttt_loss runs as is."""
    if not compiled(batch["input_ids"].device) or draft.shape.num_hidden_layers > 1:   # step graphs: layer 0 only
        return ttt_loss(draft, batch, head_draft, ttt_length, step_weight, position_loss=position_loss)
    if GRAPH_SCOPE[0] == "row":
        if draft.midlayer.self_attn.impl == "merged_flex":
            batch = {**batch, "block_mask": document_block_mask(batch["doc"])}
        fn = _COMPILED_ROWS.get(COMPILE["backend"])
        if fn is None:
            fn = _COMPILED_ROWS[COMPILE["backend"]] = torch.compile(ttt_loss, dynamic=False, backend=COMPILE["backend"])
        return fn(draft, batch, head_draft, ttt_length, step_weight, position_loss=position_loss)
    fns = _COMPILED_STEPS.get(COMPILE["backend"])
    if fns is None:
        fns = _COMPILED_STEPS[COMPILE["backend"]] = tuple(
            torch.compile(f, dynamic=False, backend=COMPILE["backend"]) for f in (first_step, later_step))
    ids, mask, top1, doc, pos = (batch[k] for k in ("input_ids", "loss_mask", "target_top1", "doc", "position"))
    B, L = ids.shape
    block_mask = document_block_mask(doc) if draft.midlayer.self_attn.impl == "merged_flex" else None
    in_vocab = draft.t2d[top1]
    ldt = loss_dtype_of(batch["final"].dtype)
    z, z_lse = teacher_of(batch, head_draft, ttt_length, draft)          # [B, L + K + 1, N], [B, L + K + 1]
    dt = torch.get_autocast_dtype(ids.device.type) if torch.is_autocast_enabled(ids.device.type) else None
    weights = draft.step_weights(dt) if dt is not None else None
    total, chain, keys, values = 0.0, None, [], []
    stats = {"n": [], "correct": [], "chain": [], "loss": []}
    for k in range(ttt_length):
        m_step, m_loss = step_masks(mask, in_vocab, k, doc)              # x_{t+2+k} supervised, same document
        per_step = (shift_left(ids, 1 + k), pos + k, weights, doc, block_mask)
        step_teacher = (z[:, 1 + k:1 + k + L], z_lse[:, 1 + k:1 + k + L],
                        m_loss.to(ldt) / m_loss.sum().clamp(min=1), m_step, shift_left(top1, 1 + k), position_loss)
        if k == 0:
            k0, v0, hidden, loss_k, right, correct = fns[0](draft, batch["aux"], *per_step, *step_teacher)
        else:
            if k == 1:             # requires grad like the slots of later steps (one graph); its grad is unused
                empty = k0.new_zeros(k0.shape).requires_grad_(torch.is_grad_enabled())
            slots = [torch.stack(c + [empty] * (ttt_length - 1 - len(c))) for c in (keys, values)]
            kk, vv, hidden, loss_k, right, correct = fns[1](draft, hidden, *per_step, k0, v0, *slots,
                                                            torch.full((), k - 1, device=ids.device), *step_teacher)
            keys.append(kk)
            values.append(vv)
        total = total + (step_weight ** k) * loss_k
        with torch.no_grad():
            chain = right if chain is None else chain & right
            for name, value in (("n", m_step.sum()), ("correct", correct), ("chain", chain.sum()),
                                ("loss", loss_k.detach())):
                stats[name].append(value)
    return total, {k: torch.stack(v) for k, v in stats.items()}


def graph_scope(cfg, tokens: int) -> str:
    """'step' or 'row': cfg.graph (a TrainConfig's), 'auto' resolved by the trained tokens (epochs x train
    tokens) against ROW_GRAPH_TOKENS (packed_ttt_loss)."""
    if cfg.graph != "auto":
        return cfg.graph
    return "row" if tokens > ROW_GRAPH_TOKENS else "step"


@contextmanager
def compiled_training(cfg, device: torch.device, pack: bool, log, tokens: int = 0):
    """The compile policy of one train() call (cfg: a TrainConfig; tokens: epochs x train tokens, for
    graph_scope). Compiled kernels must never fall back, unseen, to eager ones (flex attention's eager path
    materialises the [T, T] scores). Packed rows have one shape, so the TTT loss compiles once (packed_ttt_loss:
    a graph per step or per row; the held-out eval runs in grad mode and reuses them): dynamo's caches are reset
    (this run's graphs alone count), its recompile limit raised to 2K + 2 (room for the kernel graphs of
    ttt_loss called directly, one per TTT step count) and set to fail past it instead of running eagerly; the
    compiled artifacts are read from and kept in a persistent cache (compile_cache.persistent_compile_cache: a
    later run on this machine skips most of the compile); these settings and the graph scope are restored on exit. Padded batches on CUDA recompile per shape: a warning
    line says so. `log` gets one line either way."""
    if not compiled(device):
        log(f"train: {'packed rows' if pack else 'padded batches'} on {device.type}, kernels not compiled")
        yield
        return
    dynamo = torch._dynamo.config          # where torch documents these knobs (torch.compiler troubleshooting)
    if not pack:
        log(f"train: WARNING padded batches on {device.type}: every new batch shape recompiles flex attention, "
            f"and past torch._dynamo's recompile limit ({dynamo.recompile_limit}) it runs an unfused path that "
            f"materialises the scores; set train.batching 'packed' (one shape)")
        with persistent_compile_cache(device, log):
            yield
        return
    limit = max(dynamo.recompile_limit, 2 * cfg.ttt_length + 2)
    torch._dynamo.reset()
    scope, before = graph_scope(cfg, tokens), GRAPH_SCOPE[0]
    log(f"train: packed rows of {cfg.batch_tokens} tokens (windows carry {cfg.context_tokens()} tokens of "
        f"context), one compiled graph per {'row' if scope == 'row' else 'TTT step'} ({tokens:,} tokens to "
        f"train); dynamo fails past {limit} graphs per function instead of running eagerly")
    GRAPH_SCOPE[0] = scope
    try:
        with dynamo.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True), \
                persistent_compile_cache(device, log):
            yield
    finally:
        GRAPH_SCOPE[0] = before
