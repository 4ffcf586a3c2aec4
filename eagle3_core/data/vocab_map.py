"""The draft vocabulary: d2t offsets and t2d mask (SGLang `python/sglang/srt/models/llama_eagle3.py`; vLLM
`llama_eagle3.py` reads the same offsets).

The target's marker tokens (think, tool calls, end of turn: data.markers) and then the most frequent target tokens
on loss-masked positions, N in all, form the draft vocab, sorted by target id.
d2t int64 [N]: target_id = draft_id + d2t[draft_id] (SGLang's offset convention). t2d bool [V].
Ties break by lower target id; if fewer than N distinct tokens are seen, the lowest unseen ids fill the rest, so
the map is deterministic and never short (a known crash in other trainers).
"""
from __future__ import annotations

import torch


def count_tokens(input_ids: list[torch.Tensor], loss_masks: list[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """int64 [V] counts of token ids at positions where the loss mask is 1."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in zip(input_ids, loss_masks):
        counts += torch.bincount(ids[mask.bool()].long(), minlength=vocab_size)
    return counts


def build_vocab_map(counts: torch.Tensor, draft_vocab_size: int,
                    always: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [N], t2d bool [V]) from token counts [V]. always: target ids kept in the draft vocab whatever
    their counts (the target's marker tokens: think, tool calls, end of turn; data.markers), the rest by count.
    Raises ValueError if N > V or `always` holds more than N ids or an id outside [0, V)."""
    V = counts.numel()
    N = draft_vocab_size
    if N > V:
        raise ValueError(f"draft_vocab_size {N} exceeds the target vocab {V}")
    always = sorted(set(always or []))
    if len(always) > N or any(not 0 <= t < V for t in always):
        raise ValueError(f"tokens kept in the draft vocab {always[:8]} do not fit a draft vocab of {N} of {V}")
    key = counts.clone()
    key[always] = counts.max() + 1 if counts.numel() else 1                 # ahead of every counted token
    # sort by count descending, then id ascending: stable sort on -count keeps ids in order among ties
    order = torch.sort(-key, stable=True).indices
    chosen = torch.sort(order[:N]).values                           # [N] target ids, ascending
    d2t = chosen - torch.arange(N)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """[N] target id of each draft id."""
    return torch.arange(d2t.numel()) + d2t


def target_to_draft_ids(t2d: torch.Tensor) -> torch.Tensor:
    """int64 [V]: the draft id of each target id in the draft vocab, -1 elsewhere (draft ids follow target order)."""
    return torch.where(t2d, torch.cumsum(t2d.long(), 0) - 1, torch.full_like(t2d, -1, dtype=torch.long))


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor, where: str) -> None:
    """Raise ValueError naming `where` unless d2t (int64 [N] offsets) and t2d (bool [V]) describe the same N
    target ids in ascending order (what SGLang's d2t and vLLM's t2d both assume)."""
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise ValueError(f"{where}: d2t must be int64 and t2d bool, got {d2t.dtype} and {t2d.dtype}")
    targets = draft_to_target_ids(d2t)
    if not torch.equal(targets, t2d.nonzero().flatten()):
        raise ValueError(f"{where}: d2t and t2d name different target ids; rebuild the vocab map")


def coverage_by_source(input_ids: list[torch.Tensor], loss_masks: list[torch.Tensor], sources: list[str],
                       t2d: torch.Tensor) -> dict[str, dict]:
    """Per source {'supervised': tokens, 'in_vocab': of them in the draft vocab, 'coverage': the fraction}: how
    much of each source's supervised data the draft can predict at all (t2d bool [V])."""
    out: dict[str, dict] = {}
    for ids, mask, src in zip(input_ids, loss_masks, sources):
        sup = ids[mask.bool()].long()
        st = out.setdefault(src, {"supervised": 0, "in_vocab": 0})
        st["supervised"] += int(sup.numel())
        st["in_vocab"] += int(t2d[sup].sum())
    for st in out.values():
        st["coverage"] = st["in_vocab"] / max(st["supervised"], 1)
    return out
