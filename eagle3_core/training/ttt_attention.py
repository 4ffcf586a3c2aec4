"""Training-time-test (TTT) attention (EAGLE-3 paper section 3.2; SpecForge `specforge/core/eagle3.py`): three implementations of one rule.

Legend: B batch, nh query heads, nkv kv heads (rep = nh // nkv), T step-0 keys, Tq queries, hd head dim,
k = len(keys) - 1 the TTT step.

Rule: at step k, the query at index i attends causally to the step-0 keys 0..i and, from each later step
j = 1..k, only to the key at the same index i (the "diagonal"). Queries may cover only the last Tq <= T indices
(steps >= 1 skip a leading region no loss reaches): query i is index T - Tq + i. Padding is on the right, so the
causal rule alone keeps it out of real positions. Packed rows (eagle3_core.training.packing) pass `doc` [B, T] int64:
the causal part is then also limited to keys of the query's own document (doc[key] == doc[query]); the diagonal keys
are the query's own index, always its document.

- `ttt_attention_eager`: scores against all step-0 keys materialised ([B, nh, Tq, T]), diagonal scores
  appended, one softmax. Simple; the reference the others are tested against.
- `ttt_attention_merged`: the causal part by any attention kernel that also returns its log-sum-exp (flex
  attention on GPU: no [Tq, T] matrix in memory), then the k diagonal terms merged in exactly by their
  log-sum-exp: softmax over the union of keys = weighted sum of the parts, weights exp(lse_part - lse_all).
  Gradients flow through lse (flex attention supports that), so autograd needs no custom backward.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

try:  # torch >= 2.9
    from torch.nn.attention.flex_attention import AuxRequest  # optional: torch >= 2.9 only
except ImportError:  # pragma: no cover - older torch: the deprecated return_lse flag
    AuxRequest = None

IMPLEMENTATIONS = ("eager", "merged_math", "merged_flex")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision inputs (softmax), the input's own dtype otherwise (fp32, fp64 in tests)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _grouped(q: torch.Tensor, nkv: int) -> torch.Tensor:
    """q [B, nh, Tq, hd] -> [B, nkv, rep, Tq, hd] (a view): query heads grouped by their kv head (GQA)."""
    B, nh, Tq, hd = q.shape
    return q.view(B, nkv, nh // nkv, Tq, hd)


def _visible(Tq: int, T: int, device, doc: torch.Tensor | None) -> torch.Tensor:
    """Bool mask of the step-0 keys each query sees: [Tq, T] causal, or [B, 1, 1, Tq, T] causal and same
    document when `doc` [B, T] is given (query i is index T - Tq + i)."""
    causal = torch.ones(Tq, T, dtype=torch.bool, device=device).tril(diagonal=T - Tq)
    if doc is None:
        return causal
    same = doc[:, T - Tq:, None] == doc[:, None, :]                        # [B, Tq, T]
    return (causal & same)[:, None, None]


def ttt_attention_eager(q: torch.Tensor, keys: list, values: list, doc: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, nh, Tq, hd]; keys/values: k+1 tensors, entry 0 [B, nkv, T, hd] (step 0), entries j >= 1
    [B, nkv, Tq, hd] (step j, same indices as q); doc: optional [B, T] document ids (packed rows). Returns
    [B, nh, Tq, hd] in q's dtype."""
    B, nh, Tq, hd = q.shape
    nkv, T = keys[0].shape[1], keys[0].shape[2]
    acc = acc_dtype(q.dtype)
    scale = 1.0 / math.sqrt(hd)
    qg = _grouped(q, nkv)                                                  # [B, nkv, rep, Tq, hd]
    scores0 = (qg @ keys[0][:, :, None].transpose(-1, -2)).to(acc) * scale  # [B, nkv, rep, Tq, T]
    scores0 = scores0.masked_fill(~_visible(Tq, T, q.device, doc), float("-inf"))
    diag = [(qg * kj[:, :, None]).sum(-1, keepdim=True).to(acc) * scale for kj in keys[1:]]  # k x [.., Tq, 1]
    probs = torch.cat([scores0, *diag], dim=-1).softmax(-1).to(q.dtype)   # [B, nkv, rep, Tq, T+k]
    out = probs[..., :T] @ values[0][:, :, None]                           # [B, nkv, rep, Tq, hd]
    for j, vj in enumerate(values[1:]):
        out = out + probs[..., T + j:T + j + 1] * vj[:, :, None]
    return out.reshape(B, nh, Tq, hd)


def causal_attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor | None = None,
                          block_mask=None):
    """Causal attention with its log-sum-exp, written out (CPU, tests). q [B, nh, Tq, hd], k/v [B, nkv, T, hd];
    query i is index T - Tq + i; doc: optional [B, T] document ids (keys of other documents hidden); block_mask:
    ignored (causal_attention_flex's signature). Returns
    (out [B, nh, Tq, hd] q's dtype, lse [B, nh, Tq] fp32 or fp64)."""
    B, nh, Tq, hd = q.shape
    nkv, T = k.shape[1], k.shape[2]
    acc = acc_dtype(q.dtype)
    scores = (_grouped(q, nkv) @ k[:, :, None].transpose(-1, -2)).to(acc) / math.sqrt(hd)
    scores = scores.masked_fill(~_visible(Tq, T, q.device, doc), float("-inf"))   # [B, nkv, rep, Tq, T]
    lse = scores.logsumexp(-1)
    out = (scores - lse[..., None]).exp().to(q.dtype) @ v[:, :, None]
    return out.reshape(B, nh, Tq, hd), lse.reshape(B, nh, Tq)


_BLOCK_MASKS: dict = {}
_DOC_MASK: list = [None, 0, None]      # (doc, Tq, block mask) of the last packed batch: built once, used at K steps
_COMPILED_FLEX = None


def _causal_block_mask(Tq: int, T: int, device: torch.device):
    """Flex block mask of the causal rule with queries at the last Tq of T indices; cached per shape."""
    key = (Tq, T, str(device))
    if key not in _BLOCK_MASKS:
        offset = T - Tq

        def causal(b, h, q_idx, kv_idx):
            return q_idx + offset >= kv_idx

        _BLOCK_MASKS[key] = create_block_mask(causal, None, None, Tq, T, device=device)
    return _BLOCK_MASKS[key]


def document_block_mask(doc: torch.Tensor, Tq: int | None = None):
    """Flex BlockMask of the causal rule within documents: doc [B, T] int64 document ids, queries at the last Tq
    (default T) of the T indices. Built eagerly (outside any compiled region, where create_block_mask belongs:
    torch.nn.attention.flex_attention's docs); packing.packed_ttt_loss builds one per packed row."""
    B, T = doc.shape
    Tq = Tq or T
    offset = T - Tq

    def causal_same_doc(b, h, q_idx, kv_idx):
        return (q_idx + offset >= kv_idx) & (doc[b, q_idx + offset] == doc[b, kv_idx])

    return create_block_mask(causal_same_doc, B, None, Tq, T, device=doc.device)


def _document_block_mask(doc: torch.Tensor, Tq: int):
    """document_block_mask, rebuilt only when `doc` changes (the K steps of one batch share it)."""
    if _DOC_MASK[0] is not doc or _DOC_MASK[1] != Tq:     # the cache holds `doc` itself: its memory is not reused
        _DOC_MASK[:] = [doc, Tq, document_block_mask(doc, Tq)]
    return _DOC_MASK[2]


def causal_attention_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor | None = None,
                          block_mask=None):
    """As causal_attention_math, by flex attention (fused kernel; compiled on first use on CUDA, where it is
    meant to run: uncompiled flex materialises the scores, and its backward does not run on CPU). The compiled
    kernel is static in shape: packed rows (one shape) compile once; trainer.prepare_training makes dynamo fail,
    not fall back to the uncompiled path, if shapes still vary past its recompile limit. block_mask: the
    BlockMask of `doc` built beforehand (document_block_mask; required inside a compiled region, where
    create_block_mask cannot run), else built here.
    Returns (out [B, nh, Tq, hd] q's dtype, lse [B, nh, Tq] fp32)."""
    global _COMPILED_FLEX
    fn = flex_attention
    if q.is_cuda and not torch.compiler.is_compiling():
        if _COMPILED_FLEX is None:
            _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
        fn = _COMPILED_FLEX
    Tq, T = q.shape[2], k.shape[2]
    mask = block_mask if block_mask is not None else (
        _causal_block_mask(Tq, T, q.device) if doc is None else _document_block_mask(doc, Tq))
    if AuxRequest is not None:
        out, aux = fn(q, k, v, block_mask=mask, enable_gqa=True, return_aux=AuxRequest(lse=True))
        return out, aux.lse
    out, lse = fn(q, k, v, block_mask=mask, enable_gqa=True, return_lse=True)  # pragma: no cover
    return out, lse


_COMPILED_MERGE = None
COMPILE = {"backend": "inductor", "everywhere": False}   # tests: {"aot_eager", True} compiles on CPU too


def ttt_attention_merged(q: torch.Tensor, keys: list, values: list, causal=causal_attention_math,
                         compile_merge: bool = False, doc: torch.Tensor | None = None,
                         block_mask=None) -> torch.Tensor:
    """Same contract as ttt_attention_eager; the causal part by `causal` (causal_attention_math or
    causal_attention_flex), the diagonal terms merged by log-sum-exp in fp32 (fp64 for fp64 inputs).
    compile_merge: on CUDA (or anywhere under compile_everywhere, tests), run the merge (about 10 elementwise
    passes per diagonal key, forward and backward) as one torch.compile'd graph per step count (K - 1 graphs:
    the list length is part of the graph); block_mask: see causal_attention_flex."""
    global _COMPILED_MERGE
    out0, lse0 = causal(q, keys[0], values[0], doc, block_mask)           # [B, nh, Tq, hd], [B, nh, Tq]
    if len(keys) == 1:
        return out0
    merge = _merge_diagonal
    if compile_merge and (q.is_cuda or COMPILE["everywhere"]) and not torch.compiler.is_compiling():
        if _COMPILED_MERGE is None:
            _COMPILED_MERGE = torch.compile(_merge_diagonal, dynamic=None, backend=COMPILE["backend"])
        merge = _COMPILED_MERGE
    return merge(q, out0, lse0, keys[1:], values[1:])


def _merge_diagonal(q, out0, lse0, keys: list, values: list) -> torch.Tensor:
    """The causal part (out0, lse0) merged with the diagonal keys/values of steps 1..k (ttt_attention_merged)."""
    B, nh, Tq, hd = q.shape
    nkv = keys[0].shape[1]
    acc = acc_dtype(q.dtype)
    qg = _grouped(q, nkv)
    scale = 1.0 / math.sqrt(hd)
    qa = qg.to(acc)                                                       # diagonal dot products in fp32
    diag = [(qa * kj[:, :, None].to(acc)).sum(-1).reshape(B, nh, Tq) * scale for kj in keys]  # k x [B, nh, Tq]
    lse = torch.logsumexp(torch.stack([lse0.to(acc), *diag]), dim=0)      # [B, nh, Tq], all visible keys
    out = (lse0.to(acc) - lse).exp()[..., None] * out0.to(acc)            # causal part, re-weighted
    for s_j, vj in zip(diag, values):
        w = (s_j - lse).exp().view(B, nkv, nh // nkv, Tq, 1)
        out = out + (w * vj[:, :, None].to(acc)).reshape(B, nh, Tq, hd)
    return out.to(q.dtype)


def merge_diagonal_slots(q, out0, lse0, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor):
    """_merge_diagonal with the diagonal keys/values of steps 1..S in fixed slots, so that every TTT step >= 1 has
    one shape (packing.packed_ttt_loss compiles one graph for all of them). q, out0 [B, nh, Tq, hd]; lse0
    [B, nh, Tq]; keys/values [S, B, nkv, Tq, hd]; valid [S] bool: slots of steps not yet run are False and take
    no weight (their contents are ignored). Returns [B, nh, Tq, hd] in q's dtype; fp32 (fp64) inside."""
    B, nh, Tq, hd = q.shape
    S, nkv = keys.shape[0], keys.shape[2]
    acc = acc_dtype(q.dtype)
    qa = _grouped(q, nkv).to(acc)                                         # [B, nkv, rep, Tq, hd]
    s = (qa[None] * keys[:, :, :, None].to(acc)).sum(-1) / math.sqrt(hd)  # [S, B, nkv, rep, Tq]
    s = s.masked_fill(~valid.view(S, 1, 1, 1, 1), float("-inf"))
    l0 = lse0.to(acc).view(1, B, nkv, nh // nkv, Tq)
    lse = torch.logsumexp(torch.cat([l0, s]), dim=0)                      # [B, nkv, rep, Tq], all visible keys
    out = (l0[0] - lse).exp()[..., None] * _grouped(out0, nkv).to(acc)    # causal part, re-weighted
    out = out + ((s - lse).exp()[..., None] * values[:, :, :, None].to(acc)).sum(0)
    return out.reshape(B, nh, Tq, hd).to(q.dtype)


def ttt_attention(q: torch.Tensor, keys: list, values: list, impl: str = "eager",
                  compile_merge: bool = False, doc: torch.Tensor | None = None, block_mask=None) -> torch.Tensor:
    """Dispatch to one implementation by name (IMPLEMENTATIONS); compile_merge: see ttt_attention_merged; doc:
    optional [B, T] document ids of packed rows; block_mask: optional flex BlockMask of doc (merged_flex only,
    see causal_attention_flex). Raises ValueError for an unknown name."""
    if impl == "eager":
        return ttt_attention_eager(q, keys, values, doc)
    if impl == "merged_math":
        return ttt_attention_merged(q, keys, values, causal_attention_math, compile_merge, doc)
    if impl == "merged_flex":
        return ttt_attention_merged(q, keys, values, causal_attention_flex, compile_merge, doc, block_mask)
    raise ValueError(f"unknown TTT attention {impl!r}; choose one of {IMPLEMENTATIONS}")


def cached_attention(q, k, v, cache: dict, tag: str) -> torch.Tensor:
    """Batch-1 attention of T new queries q [1, nh, T, hd] over the P cached keys of cache['k'+tag] and the new
    ones, causal among the new; extends the cache in place. Returns [1, T, nh*hd]."""
    if "k" + tag in cache:
        k = torch.cat([cache["k" + tag], k], dim=2)
        v = torch.cat([cache["v" + tag], v], dim=2)
    cache["k" + tag], cache["v" + tag] = k, v
    T, P = q.shape[2], k.shape[2] - q.shape[2]
    mask = torch.ones(T, T + P, dtype=torch.bool, device=q.device).tril(diagonal=P)  # [T, P+T]
    rep = q.shape[1] // k.shape[1]
    attn = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)
    return attn.transpose(1, 2).reshape(1, T, -1)


class _LaterCaches(list):
    """The TTT caches of layers 1..L-1, kept beside layer 0's: a list attribute of the cache_k list."""


def later_caches(cache_k: list, cache_v: list, i: int) -> tuple[list, list]:
    """(keys, values) TTT cache lists of later layer i (0-based among layers 1..L-1), created on first use. They
    hang on layer 0's cache_k list (ttt.ttt_loss passes plain lists; a later layer's cache lives as long as it)."""
    if not hasattr(cache_k, "later"):
        raise ValueError("a multi-layer draft's TTT step needs cache lists made by draft_model.ttt_caches()")
    while len(cache_k.later) <= i:
        cache_k.later.append(([], []))
    return cache_k.later[i]


def ttt_caches() -> tuple[list, list]:
    """(cache_k, cache_v): empty TTT cache lists for Eagle3Draft.step, with room for later layers' caches."""
    k = _LaterCaches()
    k.later = []
    return k, []
