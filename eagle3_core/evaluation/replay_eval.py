"""Chain acceptance replayed on the target's recorded greedy output: the draft side of speculative decoding exactly as
speculate.py runs it, the target side read from one recording per prompt instead of a target forward per verify.

Why it is the same measurement: greedy verification is lossless, so the committed tokens of a chain run are the
target's greedy tokens g_1..g_M (speculate.py; EAGLE paper section 3). At a verify step with P committed positions
(root s[P], s = prompt + g) the target accepts draft token d_i while d_i = s[P + i], its bonus token is the next
token of s, and the aux hidden states of the kept nodes are the target's at positions P..P+a of s. The recording
holds g (speculate.greedy_generate, the evaluator's own baseline) and the aux hidden states of one forward over s;
the draft then decodes, proposes and catches up as in speculate.prefill / propose / commit (same KV cache, RoPE
positions, fused features). What differs from evaluate.measure: the aux states come from one forward over s rather
than from the verify forwards (float rounding of a batched against an incremental forward; a draft token on a
near-tie can flip), and a chain that runs past the end of g counts as accepted there (those tokens are cut by
max_new or EOS either way, so tau and the verify steps are unaffected; the last step's `accepted` may be longer).
Cost per draft: its own forwards only (benchmarks/replay_eval_speed.py: 18x fewer seconds per further draft than
decoding on CPU, the embedded target).
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from eagle3_core.evaluation.acceptance import bootstrap_ci
from eagle3_core.evaluation.draft_tree import build_tree
from eagle3_core.evaluation.speculate import TargetRunner, greedy_generate, stop_greedy


@torch.no_grad()
def batched_greedy(model, prompts: list[list[int]], max_new: int, eos_ids: set[int], pad_id: int,
                   batch: int) -> list[list[int]]:
    """Greedy continuations of `prompts`, `batch` at a time: left-padded, HF `generate` (do_sample False, one
    beam). Each continuation is cut by speculate.stop_greedy, as greedy_generate stops. Float rounding
    of a padded batch against one prompt alone can flip a near-tie (not seen in fp32: tests/test_replay_eval.py)."""
    dev, out = model.device, []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for j, p in enumerate(chunk):
            ids[j, width - len(p):], mask[j, width - len(p):] = torch.tensor(p), 1
        gen = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new,
                             do_sample=False, num_beams=1, eos_token_id=sorted(eos_ids) or None,
                             pad_token_id=pad_id)
        for row in gen[:, width:].tolist():
            g = []
            for t in row:
                g.append(t)
                if stop_greedy(g, eos_ids, max_new):
                    break
            out.append(g)
    return out


@torch.no_grad()
def record_target(target: TargetRunner, prompts: list[list[int]], max_new: int, eos_ids: set[int],
                  batch: int = 1, pad_id: int = 0) -> list[dict]:
    """One recording per prompt: {prompt (ids), tokens (greedy g_1..g_M: M = max_new or up to EOS), aux (float32
    [n + M, 3H_t] on CPU: the target's aux hidden states over prompt + g, one forward)}. batch 1: g by
    speculate.greedy_generate (the decoding evaluator's own baseline, one forward per token); batch > 1: by
    batched_greedy (`batch` prompts per HF generate, padded with pad_id; what makes a recording fast on a GPU)."""
    if batch > 1:
        tokens = batched_greedy(target.model, prompts, max_new, eos_ids, pad_id, batch)
    else:
        tokens = [greedy_generate(target, p, max_new, eos_ids)["tokens"] for p in prompts]
    out = []
    for p, g in zip(prompts, tokens, strict=True):
        _, aux = target.forward(p + g, DynamicCache())
        out.append({"prompt": list(p), "tokens": g, "aux": aux.float().cpu()})
    return out


@torch.no_grad()
def replay_chain(draft, rec: dict, num_steps: int) -> dict:
    """Chain drafting of `num_steps` tokens per verify step against one recording (module docstring).

    draft: an Eagle3Draft in eval mode (its device and dtype are used). Returns {accepted (draft tokens accepted
    per verify step), verify_steps, tokens_from_verify (M - 1: the prefill gives g_1), roots (the position in
    prompt + g of each verify step's root token)}, as
    speculate.speculative_generate counts them. Raises ValueError if the recording holds no generated token."""
    s, n, M = rec["prompt"] + rec["tokens"], len(rec["prompt"]), len(rec["tokens"])
    if M == 0:
        raise ValueError("replay_chain: the recording has no generated token (max_new 0?)")
    w = draft.fc.weight
    aux = rec["aux"].to(w)

    def decode(tokens: list[int], feats: torch.Tensor, start: int, cache: dict):
        return draft.decode(torch.tensor([tokens], device=w.device), draft.fuse(feats[None]),
                            torch.arange(start, start + len(tokens), device=w.device)[None], cache)

    dcache = {}
    out, logits = decode(s[1:n + 1], aux[:n], 0, dcache)             # pairs (f_p, x_{p+1}), p = 0..n-1
    h, logits, P, accepted, roots = out[:, -1:], logits[0, -1], n, [], []
    while P - n + 1 < M:                                             # g_1..g_{P-n+1} committed, root s[P]
        roots.append(P)
        tree = build_tree(draft, s[P], h, logits, dcache, P, num_steps, 1, num_steps + 1)
        a = 0
        while a < num_steps and (P + a + 1 >= len(s) or tree.tokens[a + 1] == s[P + a + 1]):
            a += 1
        accepted.append(a)
        if P - n + 1 + a + 1 >= M:                                   # g_M committed: done
            break
        out, lg = decode(s[P + 1:P + a + 2], aux[P:P + a + 1], P, dcache)   # accepted + bonus, kept nodes' aux
        h, logits, P = out[:, -1:], lg[0, -1], P + a + 1
    return {"accepted": accepted, "verify_steps": len(accepted), "tokens_from_verify": M - 1, "roots": roots}


def replay_measure(draft, recordings: list[dict], num_steps: int, keep_runs: bool = False) -> dict:
    """tau of `draft` over the recordings (replay_chain each), as summarize_runs gives it; with keep_runs the
    runs themselves under 'runs'."""
    runs = [replay_chain(draft, r, num_steps) for r in recordings]
    return {**summarize_runs(runs, num_steps), **({"runs": runs} if keep_runs else {})}


def summarize_runs(runs: list[dict], num_steps: int) -> dict:
    """replay_chain results (in prompt order; those of prompt chunks replayed apart may be concatenated) summed
    into {tau, tau_ci95 (acceptance.bootstrap_ci), prompts, accept_per_position (fraction of verify steps that
    reached position i and accepted it), per_prompt ([tokens_from_verify, verify_steps] per recording, for
    acceptance.paired_bootstrap_diff_ci)}."""
    produced, steps = [r["tokens_from_verify"] for r in runs], [r["verify_steps"] for r in runs]
    acc = [a for r in runs for a in r["accepted"]]
    per_pos = []
    for i in range(num_steps):
        reached = sum(1 for a in acc if a >= i)
        per_pos.append(sum(1 for a in acc if a >= i + 1) / reached if reached else 0.0)
    return {"tau": sum(produced) / max(sum(steps), 1), "tau_ci95": bootstrap_ci(produced, steps),
            "prompts": len(runs), "accept_per_position": per_pos,
            "per_prompt": [[p, st] for p, st in zip(produced, steps, strict=True)]}
