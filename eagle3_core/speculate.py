"""Greedy decoding with the target alone and with an EAGLE-3 draft (chain drafting, greedy verify).

Legend: n prompt tokens, S draft steps per verify, V target vocab, H hidden.
Accept rule (greedy, lossless; EAGLE paper section 3, gpt-fast `speculative_decode`): the target scores
[last token, d_1..d_S] in one forward; d_i is accepted while it equals the target's argmax at the position before it;
the target's argmax after the last accepted draft token is the bonus token. Each verify step yields a+1 tokens.
The draft's positions follow the TTT convention (ttt.py): the pair (target feature f_p, token x_{p+1}) sits at
RoPE position p, and chain step i from there at p + i.
"""
from __future__ import annotations

import inspect
import time

import torch
from transformers import DynamicCache

from .target import capture


class TargetRunner:
    """The target with a KV cache and aux capture; counts its forward calls."""

    def __init__(self, model, aux_layer_ids: list[int]):
        self.model, self.aux_layer_ids, self.forward_calls = model, aux_layer_ids, 0
        # transformers >= 5.2x names the KV-cache argument `cache` (`past_key_values` is deprecated)
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    @torch.no_grad()
    def forward(self, ids: list[int], cache) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed `ids` after what `cache` holds. Returns (logits fp32 [len(ids), V], aux [len(ids), 3H_t])."""
        with capture(self.model, self.aux_layer_ids) as store:
            out = self.model(input_ids=torch.tensor([ids], device=self.model.device), use_cache=True,
                             **{self.cache_arg: cache})
        self.forward_calls += 1
        return out.logits[0].float(), torch.cat(store["aux"], dim=-1)[0]


def _stop(tokens: list[int], eos_ids: set[int], max_new: int) -> bool:
    return len(tokens) >= max_new or (bool(tokens) and tokens[-1] in eos_ids)


@torch.no_grad()
def greedy_generate(target: TargetRunner, prompt: list[int], max_new: int, eos_ids: set[int]) -> dict:
    """Target-only greedy decoding, one token per forward. Returns tokens, the top-2 logit gap at each step
    (for near-tie checks), forward calls and seconds."""
    t0, calls0 = time.perf_counter(), target.forward_calls
    cache = DynamicCache()
    logits, _ = target.forward(prompt, cache)
    tokens, gaps = [], []
    while True:
        top2 = logits[-1].topk(2)
        tokens.append(int(top2.indices[0]))
        gaps.append(float(top2.values[0] - top2.values[1]))
        if _stop(tokens, eos_ids, max_new):
            break
        logits, _ = target.forward([tokens[-1]], cache)
    return {"tokens": tokens, "gaps": gaps, "forward_calls": target.forward_calls - calls0,
            "seconds": time.perf_counter() - t0}


@torch.no_grad()
def speculative_generate(target: TargetRunner, draft, prompt: list[int], max_new: int, eos_ids: set[int],
                         num_steps: int) -> dict:
    """Chain speculative decoding with `num_steps` draft tokens per verify step.

    Returns tokens, accepted (draft tokens accepted per verify step), verify_steps, tokens_from_verify (tokens
    the verify steps produced, after EOS / max_new truncation), forward_calls (prefill + verify steps), seconds.
    """
    t0, calls0 = time.perf_counter(), target.forward_calls
    cache, dcache = DynamicCache(), {}
    logits, aux = target.forward(prompt, cache)                          # prefill: [n, V], [n, 3H_t]
    tokens = [int(logits[-1].argmax())]
    n = len(prompt)
    # draft prefill: pairs (f_p, x_{p+1}) at positions p = 0..n-1
    seq = prompt + tokens
    out, dlogits = draft.decode(torch.tensor([seq[1:]]), draft.fuse(aux[None].to(draft.fc.weight.dtype)),
                                torch.arange(n)[None], dcache)
    h, dl = out[:, -1:], dlogits[0, -1]
    n_ctx = n                                                            # committed draft positions
    accepted, produced = [], 0
    while not _stop(tokens, eos_ids, max_new):
        proposals = []
        for i in range(num_steps):                                       # draft chain at positions n_ctx + i
            proposals.append(int(draft.draft_to_target(dl.argmax())))
            if i + 1 < num_steps:
                h, dlog = draft.decode(torch.tensor([[proposals[-1]]]), h, torch.tensor([[n_ctx + i]]), dcache)
                dl = dlog[0, -1]
        vlogits, vaux = target.forward([tokens[-1]] + proposals, cache)  # verify: [S+1, V]
        preds = vlogits.argmax(-1).tolist()
        a = 0
        while a < num_steps and proposals[a] == preds[a]:
            a += 1
        new = proposals[:a] + [preds[a]]
        accepted.append(a)
        extra = cache.get_seq_length() - (n_ctx + 1 + a)                 # keep last token + accepted drafts
        if extra > 0:
            cache.crop(-extra)                                           # transformers 5: negative = drop count
        dcache["k"], dcache["v"] = dcache["k"][:, :, :n_ctx], dcache["v"][:, :, :n_ctx]
        out, dlogits = draft.decode(torch.tensor([new]), draft.fuse(vaux[None, :a + 1].to(draft.fc.weight.dtype)),
                                    torch.arange(n_ctx, n_ctx + a + 1)[None], dcache)
        h, dl = out[:, -1:], dlogits[0, -1]
        n_ctx += a + 1
        for tok in new:
            if _stop(tokens, eos_ids, max_new):
                break
            tokens.append(tok)
            produced += 1
    return {"tokens": tokens, "accepted": accepted, "verify_steps": len(accepted), "tokens_from_verify": produced,
            "forward_calls": target.forward_calls - calls0, "seconds": time.perf_counter() - t0}
