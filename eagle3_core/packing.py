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

from .ttt import ttt_loss
from .ttt_attention import COMPILE, document_block_mask

OPEN_ROWS = 8          # rows filled at once by pack_rows (8: 8192-token rows of GSM8K lengths 99.9% full)


def batches_by_tokens(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped so that (batch size x longest sequence) stays within `budget` tokens; length-sorted."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > budget:              # ascending: i is the longest so far
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


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
    final [1, L, H_t] (the samples' float dtype); doc [1, L] int64 (piece number in the row, -1 on padding);
    position [1, L] int64 (RoPE position: index in the sample). loss_mask is 0 on a piece's context (before c)."""
    first = samples[row[0][0]]
    out = {"input_ids": torch.zeros(1, row_len, dtype=torch.long),
           "loss_mask": torch.zeros(1, row_len, dtype=torch.bool),
           "target_top1": torch.zeros(1, row_len, dtype=torch.long),
           "valid": torch.zeros(1, row_len, dtype=torch.bool),
           "doc": torch.full((1, row_len), -1, dtype=torch.long),
           "position": torch.zeros(1, row_len, dtype=torch.long),
           "aux": torch.zeros(1, row_len, first["aux"].shape[-1], dtype=first["aux"].dtype),
           "final": torch.zeros(1, row_len, first["final"].shape[-1], dtype=first["final"].dtype)}
    at = 0
    for d, (i, a, b, c) in enumerate(row):
        s, n = samples[i], b - a
        for k in ("input_ids", "target_top1", "aux", "final"):
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


_COMPILED_LOSS: dict = {}            # backend -> torch.compile'd ttt_loss (one graph per row shape)


def packed_ttt_loss(draft, batch: dict, head_draft: torch.Tensor, ttt_length: int, step_weight: float = 0.8):
    """ttt.ttt_loss of a packed row (collate_packed's batch, on the draft's device; same arguments and returns).
    Where kernels are compiled (`compiled`), the whole TTT forward (K steps: layers, attention, loss, metrics) is one
    torch.compile'd graph with one backward: rows have one shape, so it compiles once, and the thousand or so small
    kernels a K = 7 step launches one by one eagerly (a 576-wide draft spends most of a step launching them) are
    fused. merged_flex: the row's BlockMask (ttt_attention.document_block_mask) is built here, outside the graph.
    Elsewhere ttt_loss runs as is."""
    if not compiled(batch["input_ids"].device):
        return ttt_loss(draft, batch, head_draft, ttt_length, step_weight)
    if draft.midlayer.self_attn.impl == "merged_flex":
        batch = {**batch, "block_mask": document_block_mask(batch["doc"])}
    fn = _COMPILED_LOSS.get(COMPILE["backend"])
    if fn is None:
        fn = _COMPILED_LOSS[COMPILE["backend"]] = torch.compile(ttt_loss, dynamic=False, backend=COMPILE["backend"])
    return fn(draft, batch, head_draft, ttt_length, step_weight)


@contextmanager
def compiled_training(cfg, device: torch.device, pack: bool, log):
    """The compile policy of one train() call (cfg: a TrainConfig). Compiled kernels must never fall back, unseen,
    to eager ones (flex attention's eager path materialises the [T, T] scores). Packed rows have one shape, so the
    whole TTT loss is one graph (packed_ttt_loss; the held-out eval runs in grad mode and reuses it): dynamo's
    caches are reset (this run's graphs alone count), its recompile limit raised to 2K + 2 (room for the kernel
    graphs of ttt_loss called directly, one per TTT step count) and set to fail past it instead of running
    eagerly; both settings are restored on exit. Padded batches on CUDA recompile per shape: a warning
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
        yield
        return
    limit = max(dynamo.recompile_limit, 2 * cfg.ttt_length + 2)
    torch._dynamo.reset()
    log(f"train: packed rows of {cfg.batch_tokens} tokens (windows carry {cfg.context_tokens()} tokens of "
        f"context); dynamo fails past {limit} graphs per function instead of running eagerly")
    with dynamo.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True):
        yield
