"""Chain acceptance under sampling (temperature > 0), replayed exactly on the target's own sampled trajectories.

Legend: n prompt tokens, M generated tokens, S draft steps per verify step, V target vocab, N draft vocab,
p the target's and q the draft's distribution at one position, both after temperature, top-k and top-p
(filtered_probs).

The coupling, and why it is exact. Speculative sampling (Leviathan et al. 2023, arXiv 2211.17192, section 2.3;
Chen et al. 2023, arXiv 2302.01318, algorithm 2): the draft samples y ~ q, the target accepts it with probability
min(1, p(y)/q(y)); on a rejection it emits a token from normalize(max(0, p - q)) and the verify step ends; after S
accepted drafts it emits a bonus token from p. At one position the emitted token x and the verdict have the law
    P(x emitted, accepted) = q(x) min(1, p(x)/q(x)) = min(p(x), q(x)),
    P(x emitted, rejected) = (1 - sum_y min(p(y), q(y))) * max(0, p(x) - q(x)) / sum_y max(0, p(y) - q(y))
                           = p(x) - min(p(x), q(x))        (the two sums are equal),
so x ~ p (lossless), and given x the position was accepted with probability min(p(x), q(x)) / p(x) =
min(1, q(x)/p(x)). Either way the next context is the prefix + x, so the sequence of (emitted token, verdict) has
the same law as: draw the trajectory x_1, x_2, ... from the target alone, and accept each drafted position
independently with probability min(1, q(x)/p(x)), q being the draft's distribution at that position of its verify
step given the prefix ('sampled' rule). A greedy-draft engine (llama.cpp's speculative decoding; vLLM with argmax
drafts; SGLang before its PR 26312) proposes y = argmax q and accepts while the target's own sample x equals it;
the emitted token is x either way, so given x the position is accepted exactly when x == argmax q ('greedy_draft'
rule). At temperature 0 p and q are one-hot at their argmax and both rules accept exactly when x == argmax q: the
greedy replay (replay_eval.replay_chain), which the tests check on the trained debug_tiny draft.

The replay reads, per recording (record_sampled: one trajectory per prompt and seed), the tokens x_t, p_t(x_t) and
the aux hidden states over prompt + tokens (one target forward), and runs the draft as replay_eval.replay_chain does:
on an accepted position the draft is fed x (its sampled token on acceptance, its argmax for greedy_draft), after a
verify step it catches up on the accepted tokens and the emitted one with the target's aux states.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from eagle3_core.config.sampling_config import SamplingConfig
from eagle3_core.evaluation.acceptance import bootstrap_ci
from eagle3_core.evaluation.speculate import TargetRunner, stop_greedy

RULES = ("sampled", "greedy_draft")


def filtered_probs(logits: torch.Tensor, s: SamplingConfig, temperature_last: bool = False) -> torch.Tensor:
    """The sampling distribution of `logits` [..., V] under `s`: fp32 probabilities [..., V].

    temperature 0: one-hot at the argmax (first index on a tie, as torch.argmax). Else temperature, then top-k
    (tokens below the k-th largest logit dropped; ties at the k-th kept, as transformers' TopKLogitsWarper), then
    top-p (the smallest set of most probable tokens whose probability reaches top_p; the most probable is always
    kept: sglang `top_k_top_p_min_p_sampling_from_probs_torch`, vLLM `apply_top_k_top_p`), renormalized. That is
    the order of SGLang, vLLM and transformers; temperature_last=True gives llama.cpp's default sampler chain
    (common/sampling.cpp: top_k, top_p, then temperature), where top-p reads the untempered distribution."""
    logits = logits.float()
    if s.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    if not temperature_last:
        logits = logits / s.temperature
    if s.top_k > 0 and s.top_k < logits.shape[-1]:
        kth = logits.topk(s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        probs, order = logits.softmax(-1).sort(-1, descending=True)
        drop_sorted = probs.cumsum(-1) - probs > s.top_p                 # mass before a token already exceeds top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    if temperature_last:
        logits = logits / s.temperature
    return logits.softmax(-1)


@torch.no_grad()
def sample_trajectory(target: TargetRunner, prompt: list[int], max_new: int, eos_ids: set[int], s: SamplingConfig,
                      generator: torch.Generator) -> list[int]:
    """The target alone decoding `prompt` at `s` (one token per forward, sampled from filtered_probs with
    `generator`, a CPU torch.Generator; temperature 0: speculate.greedy_generate's tokens), cut by
    speculate.stop_greedy. Returns the generated token ids."""
    cache, tokens = DynamicCache(), []
    logits, _ = target.forward(prompt, cache)
    while True:
        probs = filtered_probs(logits[-1], s).cpu()
        tokens.append(int(probs.argmax()) if s.greedy else int(torch.multinomial(probs, 1, generator=generator)))
        if stop_greedy(tokens, eos_ids, max_new):
            return tokens
        logits, _ = target.forward([tokens[-1]], cache)


def trajectory_seed(seed: int, prompt_index: int) -> int:
    """The generator seed of the trajectory of prompt `prompt_index` at seed `seed` (the coin flips of its replay
    use this + 1)."""
    return (seed * 1_000_003 + prompt_index) * 2


@torch.no_grad()
def record_sampled(target: TargetRunner, prompts: list[list[int]], max_new: int, eos_ids: set[int],
                   s: SamplingConfig, seeds: list[int], on_trajectory=None) -> list[dict]:
    """One recording per prompt and seed (prompt-major): {prompt, prompt_index, seed, tokens (x_1..x_M sampled at
    `s`: sample_trajectory), p_x (float32 [M]: p_t(x_t), the target's filtered probability of each recorded token,
    from one forward over prompt + tokens), aux (float32 [n + M, 3H_t] on CPU, the same forward)}.
    on_trajectory(done, total, tokens): called after each recording (tokens: its sampled token count)."""
    out, total = [], len(prompts) * len(seeds)
    for i, p in enumerate(prompts):
        for seed in seeds:
            g = torch.Generator().manual_seed(trajectory_seed(seed, i))
            x = sample_trajectory(target, p, max_new, eos_ids, s, g)
            logits, aux = target.forward(p + x, DynamicCache())          # [n + M, V]: row n - 1 + t predicts x_t
            probs = filtered_probs(logits[len(p) - 1:len(p) - 1 + len(x)], s)
            p_x = probs.gather(-1, torch.tensor(x, device=probs.device)[:, None])[:, 0]
            out.append({"prompt": list(p), "prompt_index": i, "seed": seed, "tokens": x, "p_x": p_x.float().cpu(),
                        "aux": aux.float().cpu()})
            if on_trajectory is not None:
                on_trajectory(len(out), total, len(x))
    return out


def accept_probability(rule: str, q: torch.Tensor, target_ids: torch.Tensor, x: int, p_x: float) -> float:
    """The probability that a drafted position is accepted given the emitted token x (module docstring).

    q [N]: the draft's filtered distribution over its vocab; target_ids [N]: the target id of each draft id (d2t);
    p_x: p(x) > 0 (x was sampled from p). 'sampled': min(1, q(x) / p(x)), q(x) the draft mass on target id x (0
    when x is outside the draft vocab); 'greedy_draft': 1.0 when x is the draft's argmax, else 0.0."""
    if rule == "greedy_draft":
        return float(int(target_ids[q.argmax()]) == x)
    assert rule == "sampled", f"unknown accept rule {rule!r}: one of {RULES}"
    assert p_x > 0, f"p(x) = {p_x}: the recorded token must have been possible under the target"
    return min(1.0, float(q[target_ids == x].sum()) / p_x)


@torch.no_grad()
def replay_chain_sampled(draft, rec: dict, num_steps: int, s: SamplingConfig, rule: str,
                         coins: torch.Generator) -> dict:
    """Chain drafting of `num_steps` positions per verify step against one sampled recording, each drafted position
    accepted by `rule` (accept_probability; a coin from `coins` per drafted position reached). The draft side is
    replay_eval.replay_chain's (same decode calls, RoPE positions and catch-up), a chain that runs past the end of
    the recording counts as accepted there, as there. Returns {accepted, verify_steps, tokens_from_verify, roots}
    as replay_chain. Raises ValueError if the recording holds no generated token."""
    seq, n, M = rec["prompt"] + rec["tokens"], len(rec["prompt"]), len(rec["tokens"])
    if M == 0:
        raise ValueError("replay_chain_sampled: the recording has no generated token (max_new 0?)")
    w = draft.fc.weight
    aux, dev = rec["aux"].to(w), w.device
    target_ids = None

    def decode(tokens: list[int], feats: torch.Tensor, start: int, cache: dict):
        return draft.decode(torch.tensor([tokens], device=dev), feats,
                            torch.arange(start, start + len(tokens), device=dev)[None], cache)

    dcache = {}
    out, logits = decode(seq[1:n + 1], draft.fuse(aux[:n][None]), 0, dcache)     # pairs (f_p, x_{p+1})
    h, logits, P, accepted, roots = out[:, -1:], logits[0, -1], n, [], []
    while P - n + 1 < M:                                                # x_1..x_{P-n+1} committed, root seq[P]
        roots.append(P)
        if target_ids is None:
            target_ids = draft.draft_to_target(torch.arange(logits.shape[-1], device=dev))
        cache, h_in, lg, a = dict(dcache), h, logits, 0                  # every layer's committed cache
        while a < num_steps:
            t = P + a + 1                                               # the position drafted now holds seq[t]
            if t < len(seq):
                prob = accept_probability(rule, filtered_probs(lg, s), target_ids, seq[t], float(rec["p_x"][t - n]))
                if not float(torch.rand(1, generator=coins)) < prob:
                    break
            a += 1
            if a < num_steps:                                           # the draft goes on from the accepted token
                h_in, lg = decode([seq[t] if t < len(seq) else 0], h_in, P + a - 1, cache)
                lg = lg[0, -1]
        accepted.append(a)
        if P - n + 1 + a + 1 >= M:                                      # x_M committed: done
            break
        out, lg = decode(seq[P + 1:P + a + 2], draft.fuse(aux[P:P + a + 1][None]), P, dcache)
        h, logits, P = out[:, -1:], lg[0, -1], P + a + 1
    return {"accepted": accepted, "verify_steps": len(accepted), "tokens_from_verify": M - 1, "roots": roots}


def replay_measure_sampled(draft, recordings: list[dict], num_steps: int, s: SamplingConfig,
                           rules: tuple[str, ...] = RULES) -> dict:
    """tau of `draft` on sampled recordings (record_sampled) under each accept rule: {rule: {tau, tau_ci95 (95%
    bootstrap over prompts, each prompt's seeds resampled together: intervals over prompts and seeds), prompts,
    trajectories, accept_per_position, per_prompt ([tokens_from_verify, verify_steps] per prompt, summed over its
    seeds, for evaluate.paired_bootstrap_diff_ci)}}. The coin flips of a recording are seeded by its prompt and
    seed (trajectory_seed + 1): the same for every draft, so two drafts compare on the same coins."""
    out = {}
    for rule in rules:
        runs = []
        for rec in recordings:
            coins = torch.Generator().manual_seed(trajectory_seed(rec["seed"], rec["prompt_index"]) + 1)
            runs.append(replay_chain_sampled(draft, rec, num_steps, s, rule, coins))
        per: dict[int, list[int]] = {}
        for rec, r in zip(recordings, runs, strict=True):
            tot = per.setdefault(rec["prompt_index"], [0, 0])
            tot[0], tot[1] = tot[0] + r["tokens_from_verify"], tot[1] + r["verify_steps"]
        produced, steps = [v[0] for v in per.values()], [v[1] for v in per.values()]
        acc = [a for r in runs for a in r["accepted"]]
        per_pos = []
        for i in range(num_steps):
            reached = sum(1 for a in acc if a >= i)
            per_pos.append(sum(1 for a in acc if a >= i + 1) / reached if reached else 0.0)
        out[rule] = {"tau": sum(produced) / max(sum(steps), 1), "tau_ci95": bootstrap_ci(produced, steps),
                     "prompts": len(per), "trajectories": len(runs), "accept_per_position": per_pos,
                     "per_prompt": [list(v) for v in per.values()], "accepted": [r["accepted"] for r in runs]}
    return out
