"""Greedy decoding with the target alone and with an EAGLE-3 draft (chain or tree drafting, greedy verify).

Legend: n prompt tokens, S draft steps per verify, k top-k, T verify tokens (root + T-1 drafts), P committed
positions, V target vocab, H hidden.
Accept rule (greedy, lossless; EAGLE paper section 3, gpt-fast `speculative_decode`, SGLang `verify_tree_greedy`):
the target scores the root (last committed token) and every draft token in one forward, each node attending to
the committed prefix and its own ancestors (a 4D tree mask, RoPE position P + depth); from the root, a child is
accepted while its token equals the target's argmax at its parent; the target's argmax at the last accepted node
is the bonus token. Each verify step yields a+1 tokens. A chain is the tree with k = 1 (T = S + 1).
The draft's positions follow the TTT convention (ttt.py): the pair (target feature f_p, token x_{p+1}) sits at
RoPE position p, and a draft node at depth d after it at p + d.
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from eagle3_core.evaluation.draft_tree import DraftTree, build_tree, greedy_accept, tree_attention_mask
from eagle3_core.target.loading import capture


class TargetRunner:
    """The target with a KV cache and aux capture; counts its forward calls."""

    def __init__(self, model, aux_layer_ids: list[int]):
        self.model, self.aux_layer_ids, self.forward_calls = model, aux_layer_ids, 0
        # transformers >= 5.2x names the KV-cache argument `cache` (`past_key_values` is deprecated)
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    @torch.no_grad()
    def forward(self, ids: list[int], cache, position_ids: list[int] | None = None,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed `ids` after what `cache` holds (causally, unless a bool mask [1, 1, len(ids), P + len(ids)] and
        position ids are given: tree verify). Returns (logits fp32 [len(ids), V], aux [len(ids), 3H_t])."""
        dev = self.model.device
        extra = {} if position_ids is None else {"position_ids": torch.tensor([position_ids], device=dev),
                                                 "attention_mask": attention_mask.to(dev)}
        with capture(self.model, self.aux_layer_ids) as store:
            out = self.model(input_ids=torch.tensor([ids], device=dev), use_cache=True,
                             **{self.cache_arg: cache}, **extra)
        self.forward_calls += 1
        return out.logits[0].float(), torch.cat(store["aux"], dim=-1)[0]


def stop_greedy(tokens: list[int], eos_ids: set[int], max_new: int) -> bool:
    """Whether greedy decoding stops after `tokens`: max_new of them, or the last one is an EOS id (kept)."""
    return len(tokens) >= max_new or (bool(tokens) and tokens[-1] in eos_ids)


@torch.no_grad()
def greedy_generate(target: TargetRunner, prompt: list[int], max_new: int, eos_ids: set[int]) -> dict:
    """Target-only greedy decoding, one token per forward. Returns tokens, the top-2 logit gap at each step
    (for near-tie checks), forward calls, seconds, and decode_s / decode_steps (seconds and forwards after the
    prefill: the target's decode step time)."""
    t0, calls0 = time.perf_counter(), target.forward_calls
    cache = DynamicCache()
    logits, _ = target.forward(prompt, cache)
    t_prefill = time.perf_counter()
    tokens, gaps = [], []
    while True:
        top2 = logits[-1].topk(2)
        tokens.append(int(top2.indices[0]))
        gaps.append(float(top2.values[0] - top2.values[1]))
        if stop_greedy(tokens, eos_ids, max_new):
            break
        logits, _ = target.forward([tokens[-1]], cache)
    t1 = time.perf_counter()
    return {"tokens": tokens, "gaps": gaps, "forward_calls": target.forward_calls - calls0, "seconds": t1 - t0,
            "decode_s": t1 - t_prefill, "decode_steps": len(tokens) - 1}


@dataclass
class SpecState:
    """Committed state between verify steps: target KV cache and draft KV cache both hold n_ctx positions; h [1, 1, H]
    and logits [N] are the draft's output at the last committed token (the root of the next tree)."""
    cache: DynamicCache
    dcache: dict
    h: torch.Tensor
    logits: torch.Tensor
    n_ctx: int
    tokens: list[int]


@torch.no_grad()
def prefill(target: TargetRunner, draft, prompt: list[int]) -> SpecState:
    """Target prefill (first token greedy) and draft prefill on pairs (f_p, x_{p+1}), p = 0..n-1."""
    cache, dcache = DynamicCache(), {}
    logits, aux = target.forward(prompt, cache)                          # [n, V], [n, 3H_t]
    tokens = [int(logits[-1].argmax())]
    n = len(prompt)
    seq, dev = prompt + tokens, draft.fc.weight.device
    out, dlogits = draft.decode(torch.tensor([seq[1:]], device=dev), draft.fuse(aux[None].to(draft.fc.weight)),
                                torch.arange(n, device=dev)[None], dcache)
    return SpecState(cache, dcache, out[:, -1:], dlogits[0, -1], n, tokens)


def propose(draft, state: SpecState, num_steps: int, topk: int = 1, num_draft_tokens: int | None = None) -> DraftTree:
    """The draft tree for the next verify step (draft_tree.build_tree; a chain when topk is 1)."""
    T = num_draft_tokens if num_draft_tokens is not None else num_steps + 1
    return build_tree(draft, state.tokens[-1], state.h, state.logits, state.dcache, state.n_ctx, num_steps, topk, T)


@torch.no_grad()
def verify(target: TargetRunner, state: SpecState, tree: DraftTree) -> tuple[list[int], int, torch.Tensor]:
    """One target forward over the tree. Returns (accepted nodes, bonus token, aux [T, 3H_t]). The target cache then
    holds the T tree positions too: `commit` keeps the accepted ones, `rollback` drops them all."""
    P = state.n_ctx
    logits, aux = target.forward(tree.tokens, state.cache, [P + d for d in tree.depth],
                                 tree_attention_mask(tree, P))        # [T, V], [T, 3H_t]
    path, bonus = greedy_accept(tree, logits.argmax(-1).tolist())
    return path, bonus, aux


def rollback(state: SpecState) -> None:
    """Drop what `verify` appended to the target cache (to verify another tree from the same state)."""
    extra = state.cache.get_seq_length() - state.n_ctx
    if extra > 0:
        state.cache.crop(-extra)                                         # transformers 5: negative = drop count


@torch.no_grad()
def commit(draft, state: SpecState, tree: DraftTree, path: list[int], bonus: int, aux: torch.Tensor) -> list[int]:
    """Keep the root and accepted nodes in the target cache, extend the draft with their target features.
    Returns the new tokens (accepted draft tokens + bonus); state.tokens is not extended (the caller truncates)."""
    P, keep = state.n_ctx, [0] + path
    if keep == list(range(len(keep))):                                   # a prefix of the tree (always for a chain)
        state.cache.crop(-(state.cache.get_seq_length() - P - len(keep)))
    else:                                                                # gather the accepted branch after the prefix
        idx = torch.tensor(keep, device=aux.device) + P
        for layer in state.cache.layers:
            layer.keys = torch.cat([layer.keys[..., :P, :], layer.keys.index_select(-2, idx)], -2)
            layer.values = torch.cat([layer.values[..., :P, :], layer.values.index_select(-2, idx)], -2)
    new = [tree.tokens[j] for j in path] + [bonus]
    dev = draft.fc.weight.device
    out, dlogits = draft.decode(torch.tensor([new], device=dev), draft.fuse(aux[None, keep].to(draft.fc.weight)),
                                torch.arange(P, P + len(keep), device=dev)[None], state.dcache)
    state.h, state.logits, state.n_ctx = out[:, -1:], dlogits[0, -1], P + len(keep)
    return new


@torch.no_grad()
def speculative_generate(target: TargetRunner, draft, prompt: list[int], max_new: int, eos_ids: set[int],
                         num_steps: int, topk: int = 1, num_draft_tokens: int | None = None) -> dict:
    """Speculative decoding: chain (topk 1, S draft tokens per verify step) or tree (SGLang's top-k tree of
    `num_draft_tokens` verify tokens, root included). Raises ValueError on tree parameters SGLang rejects.

    Returns tokens, accepted (draft tokens accepted per verify step), verify_steps, tokens_from_verify (tokens
    the verify steps produced, after EOS / max_new truncation), forward_calls (prefill + verify steps), seconds,
    timing {prefill_s, draft_s (proposals and the draft's catch-up on accepted tokens), verify_s (target verify
    forwards), other_s (the rest after the prefill: acceptance, bookkeeping)}.
    """
    clock = time.perf_counter
    t0, calls0 = clock(), target.forward_calls
    state = prefill(target, draft, prompt)
    t_prefill = clock()
    accepted, produced, draft_s, verify_s = [], 0, 0.0, 0.0
    while not stop_greedy(state.tokens, eos_ids, max_new):
        ta = clock()
        tree = propose(draft, state, num_steps, topk, num_draft_tokens)
        tb = clock()
        path, bonus, aux = verify(target, state, tree)
        tc = clock()
        new = commit(draft, state, tree, path, bonus, aux)
        draft_s, verify_s = draft_s + (tb - ta) + (clock() - tc), verify_s + (tc - tb)
        accepted.append(len(path))
        for tok in new:
            if stop_greedy(state.tokens, eos_ids, max_new):
                break
            state.tokens.append(tok)
            produced += 1
    t1 = clock()
    return {"tokens": state.tokens, "accepted": accepted, "verify_steps": len(accepted),
            "tokens_from_verify": produced, "forward_calls": target.forward_calls - calls0, "seconds": t1 - t0,
            "timing": {"prefill_s": t_prefill - t0, "draft_s": draft_s, "verify_s": verify_s,
                       "other_s": (t1 - t_prefill) - draft_s - verify_s}}
