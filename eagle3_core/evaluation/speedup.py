"""Speedup model of speculative decoding: tokens/s with and without a draft from step times and acceptance.

One verify cycle (EAGLE-3 chain drafting, EAGLE-3 paper section 3 / SGLang's EAGLE worker): the draft runs
`num_steps` S forward steps to propose S tokens, then the target verifies them in one forward over S + 1 positions
and the draft takes in the accepted tokens' features. With conditional acceptance a_k at draft position k (the
probability that draft token k is accepted given that tokens 1..k-1 were), the expected tokens per cycle are

    tau = 1 + sum_{k=1..S} prod_{j<=k} a_j                       (the bonus token plus the accepted draft tokens)

and with t_target the time of one target decode step (baseline: one token each), t_draft the draft's time per
cycle (S proposal steps plus taking in the accepted tokens) and t_verify the target's verify forward:

    tokens/s without speculation = 1 / t_target
    tokens/s with speculation    = tau / (t_draft + t_verify + t_overhead)
    break-even tau               = (t_draft + t_verify + t_overhead) / t_target

All times are seconds per cycle or per step, for one sequence (batch 1): at high concurrency the verify forward costs
more than a decode step and the break-even tau rises; measure at the batch size you serve.
"""
from __future__ import annotations


def expected_tau(accept_per_position: list[float], num_steps: int | None = None) -> float:
    """tau = 1 + sum_k prod_{j<=k} a_j over the first `num_steps` positions (default: all).

    accept_per_position: conditional acceptance a_k in [0, 1] (evaluate.measure's `accept_per_position`,
    ttt.summarize's acc_k). Raises ValueError for a value outside [0, 1] or more steps than positions given."""
    acc = list(accept_per_position)
    S = len(acc) if num_steps is None else num_steps
    if S > len(acc):
        raise ValueError(f"num_steps {S} > {len(acc)} acceptance rates given")
    if any(not 0.0 <= a <= 1.0 for a in acc):
        raise ValueError(f"acceptance rates must lie in [0, 1]: {acc}")
    tau, prod = 1.0, 1.0
    for a in acc[:S]:
        prod *= a
        tau += prod
    return tau


def speedup_model(t_target_s: float, t_draft_s: float, t_verify_s: float, tau: float,
                  t_overhead_s: float = 0.0) -> dict:
    """Predicted decoding speed with and without speculation (formulas in the module docstring).

    t_target_s: seconds per target decode step (one token); t_draft_s: the draft's seconds per verify cycle (all S
    proposal steps and the catch-up on accepted tokens); t_verify_s: seconds of one target verify forward;
    t_overhead_s: other seconds per cycle (sampling, tree building, scheduling); tau: tokens per cycle (measured, or
    `expected_tau`). Returns {baseline_tokens_per_s, spec_tokens_per_s, speedup, cycle_s, break_even_tau, tau}.
    Raises ValueError for a non-positive time or tau < 1."""
    if min(t_target_s, t_verify_s) <= 0 or t_draft_s < 0 or t_overhead_s < 0:
        raise ValueError(f"step times must be positive: t_target {t_target_s}, t_draft {t_draft_s}, "
                         f"t_verify {t_verify_s}, t_overhead {t_overhead_s}")
    if tau < 1.0:
        raise ValueError(f"tau {tau} < 1: every verify step yields at least the bonus token")
    cycle = t_draft_s + t_verify_s + t_overhead_s
    base, spec = 1.0 / t_target_s, tau / cycle
    return {"baseline_tokens_per_s": base, "spec_tokens_per_s": spec, "speedup": spec / base, "cycle_s": cycle,
            "break_even_tau": cycle / t_target_s, "tau": tau}


def model_from_measurement(run: dict, baseline: dict) -> dict:
    """The speedup model fed with one offline evaluation (evaluate.measure): step times from its timers (target
    decode step from the baseline run, draft and verify seconds per verify step from the speculative run), tau
    measured and tau expected from the acceptance per position; next to the measured tokens/s.

    run: a draft's entry of measure's report (needs `timing` {draft_s, verify_s, other_s}, verify_steps, tau,
    accept_per_position, tokens_per_s, baseline_tokens_per_s); baseline: measure's 'baseline' entry (needs
    `decode_s`, `decode_steps`). Returns speedup_model's keys plus t_target_s, t_draft_s, t_verify_s, t_other_s,
    tau_expected, measured_tokens_per_s, measured_baseline_tokens_per_s, measured_speedup."""
    steps = max(run["verify_steps"], 1)
    t = run["timing"]
    t_target = baseline["decode_s"] / max(baseline["decode_steps"], 1)
    t_draft, t_verify, t_other = t["draft_s"] / steps, t["verify_s"] / steps, t["other_s"] / steps
    out = speedup_model(t_target, t_draft, t_verify, run["tau"], t_other)
    return {**out, "t_target_s": t_target, "t_draft_s": t_draft, "t_verify_s": t_verify, "t_other_s": t_other,
            "tau_expected": expected_tau(run["accept_per_position"]),
            "measured_tokens_per_s": run["tokens_per_s"], "measured_baseline_tokens_per_s":
            run["baseline_tokens_per_s"], "measured_speedup": run["speedup"]}


def speed_disagreement(measured_tps: float, earlier_tps: float, slots: int, what: str,
                       margin: float = 2.0) -> str | None:
    """A warning when one stream measured `measured_tps` output tok/s on a server that produced `earlier_tps`
    tok/s in all over `slots` parallel slots earlier (the generation stage, same server and model): a stream alone
    decodes at least as fast as one slot of a full server (earlier_tps / slots), so a measurement `margin` times
    below that was slowed by something else (a busy machine) and the speed-up computed from it is not the
    engine's. None when they agree or there is no earlier rate."""
    if earlier_tps <= 0 or slots < 1:
        return None
    floor = earlier_tps / slots
    if measured_tps * margin >= floor:
        return None
    return (f"{what} measured {measured_tps:.2f} tok/s on one stream, but the same server produced "
            f"{earlier_tps:.1f} tok/s over {slots} slots during generation ({floor:.1f} tok/s per slot at least for "
            f"one stream): the machine was probably busy while it measured, so the speed-up is not the engine's; "
            f"run the stage again on a quiet machine (refresh)")


# a speed measured while the 1-minute load average exceeded the CPUs, or below half the same stage's earlier quiet
# rate, was slowed by something else than the engine
SLOWER_THAN_EARLIER = 2.0


def load_flag(load: dict | None, tokens_per_s: float | None = None, earlier_tps: float | None = None,
              what: str = "the target alone") -> str | None:
    """Why a speed measurement was taken on a loaded machine, or None when nothing says so.

    load: contract.numbers.machine_load() taken at the measurement ({'loadavg_1m', 'cpus'}); flagged when the load
    average exceeds the CPUs (processes waited for a core). tokens_per_s / earlier_tps: this measurement and the
    same stage's earlier unflagged rate on this run directory (output tok/s, same prompts and engine); flagged when
    this one is SLOWER_THAN_EARLIER times slower. A flagged speed stays in the report, marked, and out of the
    headline speed-up."""
    reasons = []
    if load and load.get("loadavg_1m") is not None and load["loadavg_1m"] > load.get("cpus", 1):
        reasons.append(f"load average {load['loadavg_1m']:.1f} on {load['cpus']} CPUs")
    if tokens_per_s and earlier_tps and tokens_per_s * SLOWER_THAN_EARLIER < earlier_tps:
        reasons.append(f"{what} measured {tokens_per_s:.1f} tok/s against {earlier_tps:.1f} earlier on this run")
    return "; ".join(reasons) or None
