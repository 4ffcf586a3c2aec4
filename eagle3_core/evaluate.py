"""Offline acceptance-length (tau) measurement: the HF target verifies the draft's chain greedily.

tau = tokens produced by verify steps / verify steps (each step counts its bonus token; the prefill's first token
is not counted). Per-position acceptance: P(draft token i accepted | tokens 0..i-1 accepted). Lossless check: the
speculative output must equal target-only greedy output of the same implementation; a mismatch where the
reference's top-2 logit gap is below `tie_gap` is a counted near-tie (REFERENCE.md section 4), anything else fails.
"""
from __future__ import annotations

import random

from .speculate import TargetRunner, greedy_generate, speculative_generate


def bootstrap_ci(per_prompt_tokens: list[int], per_prompt_steps: list[int], n: int = 1000, seed: int = 0):
    """95% percentile bootstrap interval of the ratio tau over prompts."""
    rng = random.Random(seed)
    k = len(per_prompt_tokens)
    vals = []
    for _ in range(n):
        idx = [rng.randrange(k) for _ in range(k)]
        steps = sum(per_prompt_steps[i] for i in idx)
        vals.append(sum(per_prompt_tokens[i] for i in idx) / max(steps, 1))
    vals.sort()
    return vals[int(0.025 * n)], vals[int(0.975 * n) - 1]


def compare_outputs(spec: list[int], ref: list[int], ref_gaps: list[float], tie_gap: float) -> str:
    """'equal', 'near_tie' (first difference where the reference's top-2 gap < tie_gap) or 'mismatch'."""
    if spec == ref:
        return "equal"
    for i, (a, b) in enumerate(zip(spec, ref)):
        if a != b:
            return "near_tie" if ref_gaps[i] < tie_gap else "mismatch"
    return "mismatch"                                                     # one is a strict prefix of the other


def measure(target: TargetRunner, drafts: dict, prompts: list[list[int]], max_new: int, eos_ids: set[int],
            num_steps: int, tie_gap: float) -> dict:
    """Measure baseline and each draft in `drafts` (name -> draft module) on the same tokenized prompts.

    Returns {'baseline': {...}, name: {tau, tau_ci95, accept_per_position, tokens, verify_steps,
    target_forward_calls, tokens_per_s, lossless: {equal, near_tie, mismatch}}}.
    Raises AssertionError if the counted target forward calls differ from prefills + verify steps.
    """
    base = [greedy_generate(target, p, max_new, eos_ids) for p in prompts]
    b_tok = sum(len(r["tokens"]) for r in base)
    report = {"baseline": {"tokens": b_tok, "seconds": sum(r["seconds"] for r in base),
                           "tokens_per_s": b_tok / sum(r["seconds"] for r in base),
                           "target_forward_calls": sum(r["forward_calls"] for r in base)}}
    for name, draft in drafts.items():
        runs = [speculative_generate(target, draft, p, max_new, eos_ids, num_steps) for p in prompts]
        steps = sum(r["verify_steps"] for r in runs)
        calls = sum(r["forward_calls"] for r in runs)
        assert calls == len(prompts) + steps, f"{calls} target forwards != {len(prompts)} prefills + {steps} verifies"
        produced = [r["tokens_from_verify"] for r in runs]
        accepted = [a for r in runs for a in r["accepted"]]
        per_pos = []
        for i in range(num_steps):
            reached = sum(1 for a in accepted if a >= i)
            per_pos.append(sum(1 for a in accepted if a >= i + 1) / reached if reached else 0.0)
        verdicts = [compare_outputs(r["tokens"], b["tokens"], b["gaps"], tie_gap) for r, b in zip(runs, base)]
        tok = sum(len(r["tokens"]) for r in runs)
        secs = sum(r["seconds"] for r in runs)
        report[name] = {
            "tau": sum(produced) / max(steps, 1),
            "tau_ci95": bootstrap_ci(produced, [r["verify_steps"] for r in runs]),
            "accept_per_position": per_pos, "tokens_from_verify": sum(produced), "verify_steps": steps,
            "target_forward_calls": calls, "tokens": tok, "seconds": secs, "tokens_per_s": tok / secs,
            "speedup": (tok / secs) / report["baseline"]["tokens_per_s"],
            "lossless": {v: verdicts.count(v) for v in ("equal", "near_tie", "mismatch")},
        }
    return report
