"""Offline acceptance-length (tau) measurement: the HF target verifies the draft's chain or tree greedily.

tau = tokens produced by verify steps / verify steps (each step counts its bonus token; the prefill's first token
is not counted). Per-position acceptance: P(draft token at depth i accepted | depths 1..i-1 accepted). Lossless
check: the speculative output must equal target-only greedy output of the same implementation; a mismatch where
the reference's top-2 logit gap is below `tie_gap` is a counted near-tie (docs/benchmarks.md, 'Greedy losslessness in floating point'), anything else
fails. Speeds: tokens/s with the draft against target-only greedy decoding on the same prompts and hardware.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from eagle3_core.evaluation.speculate import TargetRunner, greedy_generate, speculative_generate
from eagle3_core.evaluation.speedup import model_from_measurement

# a measured tau this far (relative) from the simulated tau of training is flagged
TAU_GAP_FLAG = 0.2


def _percentile_bootstrap(k: int, stat, n: int, seed: int) -> tuple[float, float]:
    """95% percentile interval of stat(idx) over n resamples idx of range(k) with replacement (seeded)."""
    rng = random.Random(seed)
    vals = sorted(stat([rng.randrange(k) for _ in range(k)]) for _ in range(n))
    return vals[int(0.025 * n)], vals[int(0.975 * n) - 1]


def _tau_of(per_prompt_tokens, per_prompt_steps, idx: list[int]) -> float:
    return sum(per_prompt_tokens[i] for i in idx) / max(sum(per_prompt_steps[i] for i in idx), 1)


def bootstrap_ci(per_prompt_tokens: list[int], per_prompt_steps: list[int], n: int = 1000, seed: int = 0):
    """95% percentile bootstrap interval of the ratio tau over prompts."""
    return _percentile_bootstrap(len(per_prompt_tokens),
                                 lambda idx: _tau_of(per_prompt_tokens, per_prompt_steps, idx), n, seed)


def paired_bootstrap_diff_ci(a: list[tuple[int, int]], b: list[tuple[int, int]], n: int = 1000, seed: int = 0):
    """95% percentile bootstrap interval of tau_a - tau_b for two drafts measured on the same prompts: a and b hold
    (tokens_from_verify, verify_steps) per prompt, in the same prompt order; each resample draws prompts once and
    uses them for both drafts (paired), so prompt difficulty cancels. Raises ValueError if the lists differ in
    length or are empty."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired comparison needs the same prompts: {len(a)} vs {len(b)} per-prompt results")
    (ta, sa), (tb, sb) = zip(*a), zip(*b)
    return _percentile_bootstrap(len(a), lambda idx: _tau_of(ta, sa, idx) - _tau_of(tb, sb, idx), n, seed)


VERDICTS = ("equal", "near_tie", "mismatch")                # compare_outputs' answers, the keys of a 'lossless' count


def compare_outputs(spec: list[int], ref: list[int], ref_gaps: list[float], tie_gap: float) -> str:
    """'equal', 'near_tie' (first difference where the reference's top-2 gap < tie_gap) or 'mismatch' (VERDICTS)."""
    if spec == ref:
        return "equal"
    for i, (a, b) in enumerate(zip(spec, ref)):
        if a != b:
            return "near_tie" if ref_gaps[i] < tie_gap else "mismatch"
    return "mismatch"                                                     # one is a strict prefix of the other


@dataclass
class SpecRun:
    """One speculative configuration to measure: a draft, S steps, top-k and T verify tokens (chain: topk 1,
    T = S + 1), on the prompts at `prompt_idx` (None: all)."""
    draft: object
    num_steps: int
    topk: int = 1
    num_draft_tokens: int | None = None
    prompt_idx: list[int] | None = None

    def params(self) -> dict:
        return {"num_steps": self.num_steps, "topk": self.topk,
                "num_draft_tokens": self.num_draft_tokens or self.num_steps + 1}


def _tau_summary(runs: list[dict]) -> dict:
    produced, steps = [r["tokens_from_verify"] for r in runs], [r["verify_steps"] for r in runs]
    return {"tau": sum(produced) / max(sum(steps), 1), "tau_ci95": bootstrap_ci(produced, steps),
            "prompts": len(runs)}


@dataclass
class _PromptCounter:
    """Counts decoded prompts for on_prompt(done, total, name)."""
    total: int
    on_prompt: object = None
    done: int = 0

    def tick(self, result: dict, name: str) -> dict:
        self.done += 1
        if self.on_prompt is not None:
            self.on_prompt(self.done, self.total, name)
        return result


def _baseline_summary(base: list[dict]) -> dict:
    b_tok, b_sec = sum(len(r["tokens"]) for r in base), sum(r["seconds"] for r in base)
    return {"tokens": b_tok, "seconds": b_sec, "tokens_per_s": b_tok / b_sec, "prompts": len(base),
            "target_forward_calls": sum(r["forward_calls"] for r in base),
            "decode_s": sum(r["decode_s"] for r in base),
            "decode_steps": sum(r["decode_steps"] for r in base)}


def _accept_per_position(outs: list[dict], num_steps: int) -> list[float]:
    """P(draft token at depth i + 1 accepted | depths 1..i accepted), i < num_steps (0.0 where none reached i)."""
    accepted = [a for r in outs for a in r["accepted"]]
    per_pos = []
    for i in range(num_steps):
        reached = sum(1 for a in accepted if a >= i)
        per_pos.append(sum(1 for a in accepted if a >= i + 1) / reached if reached else 0.0)
    return per_pos


def _run_summary(run: SpecRun, outs: list[dict], idx: list[int], base: list[dict], categories: list[str],
                 tie_gap: float) -> dict:
    """One run's entry of measure's report (without speedup_model) from its outputs `outs` on the prompts `idx`
    and the baseline's outputs `base` on every prompt. Raises AssertionError if the counted target forward calls
    differ from prefills + verify steps."""
    steps = sum(r["verify_steps"] for r in outs)
    calls = sum(r["forward_calls"] for r in outs)
    assert calls == len(idx) + steps, f"{calls} target forwards != {len(idx)} prefills + {steps} verifies"
    verdicts = [compare_outputs(r["tokens"], base[i]["tokens"], base[i]["gaps"], tie_gap) for r, i in zip(outs, idx)]
    by_cat: dict[str, list] = {}
    for r, i in zip(outs, idx):
        by_cat.setdefault(categories[i], []).append(r)
    tok, secs = sum(len(r["tokens"]) for r in outs), sum(r["seconds"] for r in outs)
    base_tps = sum(len(base[i]["tokens"]) for i in idx) / sum(base[i]["seconds"] for i in idx)
    return {
        "params": run.params(), **_tau_summary(outs),
        "per_category": {c: _tau_summary(rs) for c, rs in sorted(by_cat.items())},
        "accept_per_position": _accept_per_position(outs, run.num_steps),
        "tokens_from_verify": sum(r["tokens_from_verify"] for r in outs),
        "per_prompt": [[r["tokens_from_verify"], r["verify_steps"]] for r in outs],
        "verify_steps": steps, "target_forward_calls": calls, "tokens": tok, "seconds": secs,
        "tokens_per_s": tok / secs, "baseline_tokens_per_s": base_tps, "speedup": (tok / secs) / base_tps,
        "lossless": {v: verdicts.count(v) for v in VERDICTS},
        "timing": {k: sum(r["timing"][k] for r in outs) for k in outs[0]["timing"]} if outs else {},
    }


def measure(target: TargetRunner, runs: dict[str, SpecRun], prompts: list[list[int]], categories: list[str],
            max_new: int, eos_ids: set[int], tie_gap: float, on_prompt=None) -> dict:
    """Measure target-only greedy decoding on every prompt, then each run on its prompts.

    on_prompt(done, total, name): called after each decoded prompt (baseline and every run: total = prompts +
    the runs' prompts; name 'baseline' or the run's), for progress lines and bars.

    prompts: tokenized prompts; categories: one label per prompt (for tau per category).
    Returns {'baseline': {tokens, seconds, tokens_per_s, target_forward_calls, prompts}, name: {params, tau,
    tau_ci95, per_category {cat: {tau, tau_ci95, prompts}}, accept_per_position, tokens_from_verify, per_prompt
    ([tokens_from_verify, verify_steps] per prompt, for paired comparisons),
    verify_steps, target_forward_calls, tokens, seconds, tokens_per_s, baseline_tokens_per_s (same prompts),
    speedup, prompts, lossless {equal, near_tie, mismatch}, timing {prefill_s, draft_s, verify_s, other_s},
    speedup_model (speedup.model_from_measurement)}}; the baseline also has decode_s, decode_steps. tokens/s are
    tokens / wall seconds.
    Raises AssertionError if the counted target forward calls differ from prefills + verify steps.
    """
    assert len(categories) == len(prompts), f"{len(categories)} categories for {len(prompts)} prompts"
    counter = _PromptCounter(len(prompts) + sum(len(r.prompt_idx) if r.prompt_idx is not None else len(prompts)
                                                for r in runs.values()), on_prompt)
    base = [counter.tick(greedy_generate(target, p, max_new, eos_ids), "baseline") for p in prompts]
    report = {"baseline": _baseline_summary(base)}
    for name, run in runs.items():
        idx = run.prompt_idx if run.prompt_idx is not None else list(range(len(prompts)))
        outs = [counter.tick(speculative_generate(target, run.draft, prompts[i], max_new, eos_ids, run.num_steps,
                                                  run.topk, run.num_draft_tokens), name) for i in idx]
        report[name] = _run_summary(run, outs, idx, base, categories, tie_gap)
        if outs:
            report[name]["speedup_model"] = model_from_measurement(report[name], report["baseline"])
    return report


def tau_consistency(tau_measured: float, draft_manifest: dict, num_steps: int) -> dict:
    """Simulated tau from training (the best epoch's TTT accuracies, ttt.summarize: tau_sim = 1 + sum_k
    prod_{j<=k} acc_j) against the measured tau, over the draft steps both cover (min(K, S)).

    draft_manifest: the train stage's manifest ({best: {epoch, tau_sim}, history: [{epoch, train, eval}]}).
    Returns {tau_sim (as trained, K steps), tau_sim_at_steps, steps_compared, metrics_from ('eval'|'train'),
    tau_measured, relative_gap ((measured - simulated) / simulated), flagged, note}.
    Raises ValueError naming the key if the manifest lacks the best epoch's metrics.
    """
    best = draft_manifest.get("best") or {}
    record = next((h for h in draft_manifest.get("history", []) if h.get("epoch") == best.get("epoch")), None)
    if record is None:
        raise ValueError(f"draft manifest has no history entry for the best epoch {best.get('epoch')}: cannot "
                         f"compare simulated and measured tau; retrain or pass the train stage's manifest")
    source = "eval" if record.get("eval") else "train"
    acc = record[source]["acc"]
    m = min(len(acc), num_steps)
    tau_sim_s, prod = 1.0, 1.0
    for a in acc[:m]:
        prod *= a
        tau_sim_s += prod
    gap = (tau_measured - tau_sim_s) / tau_sim_s
    flagged = abs(gap) > TAU_GAP_FLAG
    note = (f"measured tau {tau_measured:.2f} vs simulated {tau_sim_s:.2f} over {m} draft steps "
            f"({gap:+.0%}; simulated on {'held-out' if source == 'eval' else 'training'} samples)")
    if flagged and gap < 0:
        note += (": the draft accepts far less at inference than in training. Check that inference uses the "
                 "training features (aux layer ids, d2t, chat template)" + ("; the simulation ran on training "
                                                                            "data, so overfitting also shows here"
                                                                            if source == "train" else ""))
    elif flagged:
        note += ": inference accepts far more than training predicted; check the training metrics"
    return {"tau_sim": best.get("tau_sim"), "tau_sim_at_steps": tau_sim_s, "steps_compared": m,
            "metrics_from": source, "tau_measured": tau_measured, "relative_gap": gap, "flagged": flagged,
            "note": note}
