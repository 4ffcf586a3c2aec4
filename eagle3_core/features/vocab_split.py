"""The target's lm_head split over the vocabulary across the ranks of a sharded extraction (features backends
`ep_int4`, and `hf_tp` where transformers' plan leaves lm_head whole): each rank multiplies by its slice of the
rows only, and what leaves the slices is gathered exactly.

Legend: W ranks, r this rank, V target vocab, V_r this rank's rows, H_t target hidden, N tokens, K teacher top-k.
Rank r holds rows [start_r, stop_r) of lm_head.weight [V, H_t], torch.chunk's split (ceil(V / W) rows per rank,
the last ones shorter): the Megatron/SGLang vocab-parallel head (ParallelLMHead, VocabParallelEmbedding), which
SGLang follows with a gather of the logits; here only per-token reductions are gathered:

- argmax (target_top1): each rank's max logit and its argmax, all-gathered [W, N]; the winner is the largest
  value, the lowest rank on a tie, so the lowest vocabulary index wins as torch.argmax does over the whole row.
  A logit is the same dot product whichever rows sit beside it, so the result is the one-process argmax.
- teacher top-k (store_formats' fp8_topk): each rank's top-K of its fp32 logits (ids made global), all-gathered;
  the top-K of those W K candidates is the whole row's top-K. The tail's logsumexp, exact and of the fp8-rounded
  final state, is each rank's logsumexp outside the global top-K, combined by a logsumexp over ranks (equal to the
  one-process value up to fp32 summation order).

Every rank must call the collectives in the same order on the same (replicated) final states, as the sharded
forward already does (features.tp_extract: the followers run every forward the leader runs).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from eagle3_core.features import store_formats as ff
from eagle3_core.target.family import text_config


def vocab_range(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of rank `rank`'s rows of a [vocab, H] head split in `world` (torch.chunk's sizes:
    ceil(vocab / world) each, the last ones shorter or empty)."""
    per = -(-vocab // world)
    return min(rank * per, vocab), min((rank + 1) * per, vocab)


def _gather(t: torch.Tensor) -> torch.Tensor:
    """All ranks' `t` (same shape everywhere) stacked: [W, *t.shape]."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.stack(out)


class SplitHead:
    """This rank's rows of the lm_head. weight: the whole lm_head.weight [V, H_t] (this rank's slice is copied
    and the rest dropped by the caller). Collective methods: every rank calls them together."""

    def __init__(self, weight: torch.Tensor):
        self.vocab = weight.shape[0]
        self.start, self.stop = vocab_range(self.vocab, dist.get_rank(), dist.get_world_size())
        self.weight = weight.detach()[self.start:self.stop].clone()            # [V_r, H_t], model dtype
        self._fp32 = None

    def top1(self, rows: torch.Tensor) -> torch.Tensor:
        """int64 [N]: argmax over the whole vocab of rows [N, H_t] @ lm_head^T, in the model dtype (as the
        unsplit nn.Linear computes it)."""
        n = rows.shape[0]
        if self.stop > self.start:
            val, idx = F.linear(rows, self.weight).max(-1)                     # [N], [N] local
            idx = idx + self.start
        else:                                                              # an empty slice never wins
            val = torch.full((n,), float("-inf"), dtype=rows.dtype, device=rows.device)
            idx = torch.zeros(n, dtype=torch.long, device=rows.device)
        vals, ids = _gather(val), _gather(idx)                             # [W, N]
        winner = vals.argmax(0)                                            # first (lowest) rank on a tie
        return ids.gather(0, winner[None]).squeeze(0)

    def whole(self) -> torch.Tensor:
        """The whole lm_head.weight [V, H_t] (all-gathered; a collective)."""
        per = -(-self.vocab // dist.get_world_size())
        pad = torch.zeros(per, self.weight.shape[1], dtype=self.weight.dtype, device=self.weight.device)
        pad[:self.stop - self.start] = self.weight
        return _gather(pad).flatten(0, 1)[:self.vocab]

    def exact_top(self, final: torch.Tensor, rounded: torch.Tensor, k: int | None = None):
        """store_formats.exact_top's (values fp32 [..., K], ids int32 [..., K], tail_shift fp32 [..., 1]) with
        the head split: final and rounded [..., H_t] replicated on every rank. Raises ValueError if K > V."""
        k = k or ff.TEACHER_TOPK
        if k > self.vocab:
            raise ValueError(f"teacher top-{k} over a target vocab of {self.vocab}: K must not exceed V")
        if self._fp32 is None:
            self._fp32 = self.weight.float()
        rows, rnd = final.reshape(-1, final.shape[-1]), rounded.reshape(-1, rounded.shape[-1])
        n = rows.shape[0]
        vals, shift = torch.empty(n, k, device=rows.device), torch.zeros(n, 1, device=rows.device)
        ids = torch.empty(n, k, dtype=torch.int32, device=rows.device)
        for a in range(0, n, ff.HEAD_CHUNK):
            v, i, s = self._top_chunk(rows[a:a + ff.HEAD_CHUNK], rnd[a:a + ff.HEAD_CHUNK], k)
            vals[a:a + ff.HEAD_CHUNK], ids[a:a + ff.HEAD_CHUNK], shift[a:a + ff.HEAD_CHUNK, 0] = v, i, s
        lead = final.shape[:-1]
        return vals.view(*lead, k), ids.view(*lead, k), shift.view(*lead, 1)

    def _top_chunk(self, rows: torch.Tensor, rnd: torch.Tensor, k: int):
        """One chunk [c, H_t] of exact_top: (values [c, K], ids int32 [c, K], tail shift [c])."""
        c, w, width = rows.shape[0], self._fp32, self.stop - self.start
        z = rows.float() @ w.T                                               # [c, V_r]
        kk = min(k, width)
        cand_v = torch.full((c, k), float("-inf"), device=rows.device)
        cand_i = torch.full((c, k), -1, dtype=torch.long, device=rows.device)
        if kk:
            v, i = z.topk(kk, dim=-1)
            cand_v[:, :kk], cand_i[:, :kk] = v, i + self.start
        all_v = _gather(cand_v).permute(1, 0, 2).reshape(c, -1)               # [c, W K]
        all_i = _gather(cand_i).permute(1, 0, 2).reshape(c, -1)
        top_v, pos = all_v.topk(k, dim=-1)                                   # the whole row's top-K
        top_i = all_i.gather(1, pos)
        if k == self.vocab:
            return top_v, top_i.to(torch.int32), torch.zeros(c, device=rows.device)
        mine = (top_i >= self.start) & (top_i < self.stop)                   # [c, K] ids in this slice
        hit = torch.zeros(c, width + 1, dtype=torch.bool, device=rows.device)
        hit.scatter_(1, torch.where(mine, top_i - self.start, width), True)
        hit = hit[:, :width]                                                  # [c, V_r] top-K members here

        def tail_lse(logits):                                                # [c]: over ranks, outside top-K
            return _gather(logits.masked_fill(hit, float("-inf")).logsumexp(-1)).logsumexp(0)
        shift = tail_lse(z) - tail_lse(rnd.float() @ w.T)
        return top_v, top_i.to(torch.int32), shift



def split_lm_head(model) -> SplitHead | None:
    """This rank's SplitHead of `model`'s lm_head when the weight is whole ([V, H_t], not a DTensor: ep_int4's
    load, or a tensor-parallel plan without an lm_head entry), its whole weight then released (unless tied to
    the input embedding, which stays); None when a plan already shards it (transformers' `colwise_gather_output`
    gathers the logits itself). Call on every rank of the initialised process group."""
    lm = model.get_output_embeddings()
    w = lm.weight
    if isinstance(w, DTensor) or w.shape[0] != text_config(model.config).vocab_size:
        return None
    head = SplitHead(w)
    if w is not model.get_input_embeddings().weight:
        lm.weight = torch.nn.Parameter(w.new_empty(0, w.shape[1]), requires_grad=False)
    return head
