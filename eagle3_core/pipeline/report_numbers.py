"""The report's number rules: which speeds were measured on a loaded machine (flagged, and kept out of the
headline speed-up), each tok/s bar against the baseline its label names, the label of the draft measured before
training (fresh or warm-started), warnings only with enough held-out prompts, and stage times by stage name with
the stages this run skipped said so."""
from __future__ import annotations

from pathlib import Path

from eagle3_core.contract.numbers import percent
from eagle3_core.evaluation.speedup import load_flag
from eagle3_core.pipeline.table import STAGES

# below this many held-out prompts a 95% interval of tau is too wide for a gap to mean a misconfiguration
MIN_PROMPTS_FOR_WARNINGS = 8
# the evaluate stage's runs of the draft (eval/report.json keys) in report order, with their names
# (evaluation.plots.LABELS names them alike, and the warm start's: tests/test_name_copies.py checks the two agree)
RUN_NAMES = {"trained": "trained, chain", "trained_tree": "trained, tree", "untrained": "untrained, chain"}
SPEED_SOURCES = {"offline": "the target alone (offline)", "llama_cpp": "llama.cpp without the draft"}


def baseline_rates(r: dict) -> dict[str, float]:
    """{'offline': the offline target-only tok/s, 'llama_cpp': llama.cpp's no-draft tok/s}, those measured."""
    ev, lc = r["eval"], r.get("llama_cpp") or {}
    rates = {"offline": (ev.get("baseline") or {}).get("tokens_per_s"), "llama_cpp": lc.get("baseline_tokens_per_s")}
    return {k: v for k, v in rates.items() if v}


def speed_checks(r: dict, earlier: dict | None) -> dict:
    """{'flags': {source: reason} for each loaded measurement (evaluation.speedup.load_flag: the load average
    recorded with it, its rate against the same run's earlier quiet rate), 'reference': the quiet rates the next
    report compares with}. earlier: the previous report.json's `speed` entry of this run directory, or None."""
    ref = dict((earlier or {}).get("reference") or {})
    loads = {"offline": r["eval"].get("machine_load"), "llama_cpp": (r.get("llama_cpp") or {}).get("machine_load")}
    flags = {}
    for src, rate in baseline_rates(r).items():
        why = load_flag(loads[src], rate, ref.get(src), SPEED_SOURCES[src])
        if why:
            flags[src] = why
        else:
            ref[src] = max(rate, ref.get(src, 0.0))
    return {"flags": flags, "reference": ref}


def speed_bars(r: dict, run_label) -> list[dict]:
    """The tok/s plot's bars: {label, tokens_per_s, baseline (the label of the bar it is compared with), ratio}.
    Offline drafts against 'target only (offline)', llama.cpp's draft against 'llama.cpp, no draft': never one
    engine's speed against another's baseline. run_label(name, run) labels an offline run."""
    ev, bars = r["eval"], []
    if "baseline" in ev:                                                    # replay evaluations decode nothing
        base, b = "target only (offline)", ev["baseline"]["tokens_per_s"]
        bars.append({"label": base, "tokens_per_s": b, "baseline": base, "ratio": 1.0})
        for name in RUN_NAMES:
            if name in ev and "tokens_per_s" in ev[name]:
                bars.append({"label": run_label(name, ev[name]), "tokens_per_s": ev[name]["tokens_per_s"],
                             "baseline": base, "ratio": ev[name]["tokens_per_s"] / b})
    if (lc := r.get("llama_cpp")):
        base, b = "llama.cpp, no draft", lc["baseline_tokens_per_s"]
        bars += [{"label": base, "tokens_per_s": b, "baseline": base, "ratio": 1.0},
                 {"label": "llama.cpp, EAGLE-3", "tokens_per_s": lc["tokens_per_s"], "baseline": base,
                  "ratio": lc["tokens_per_s"] / b}]
    return bars


def headline(r: dict) -> str:
    """The report's speed-up line: each engine's speed-up of the trained draft, or why it is left out (measured on
    a loaded machine: speed_checks' flags)."""
    flags, parts = (r.get("speed") or {}).get("flags") or {}, []
    ev, lc = r["eval"], r.get("llama_cpp")
    if "baseline" in ev and "speedup" in ev["trained"]:
        parts.append(f"left out, offline: measured on a loaded machine ({flags['offline']})" if "offline" in flags
                     else f"{ev['trained']['speedup']:.2f}x offline (chain, one stream)")
    if lc:
        parts.append(f"left out, llama.cpp: measured on a loaded machine ({flags['llama_cpp']})"
                     if "llama_cpp" in flags else f"{lc['speedup']:.2f}x on llama.cpp (one stream)")
    return "- speed-up of the trained draft: " + ("; ".join(parts) if parts else "not measured (replay evaluation)")


def before_training_label(r: dict) -> str:
    """What the eval's 'untrained' draft is: the draft training started from, a warm start when train.init_from
    named one (the train manifest's `init_from`), else freshly initialized."""
    return "warm start, before training" if r.get("init_from") else "untrained"


def too_few_prompts(ev: dict) -> int | None:
    """The held-out prompts behind the trained draft's tau when fewer than MIN_PROMPTS_FOR_WARNINGS (its
    warnings then stay unsaid), else None."""
    n = ev["trained"].get("prompts") or len(ev.get("eval_ids") or ()) or None
    return n if n is not None and n < MIN_PROMPTS_FOR_WARNINGS else None


def stage_times(run_dir: Path, manifests: dict[str, dict], since: float | None) -> dict[str, float | str]:
    """{stage name (the stage table's, in its order): seconds to 0.1, or 'skipped' for a stage whose manifest was
    written before `since` (Unix seconds: the current flow run's start; None: every stage counts as run)}.
    manifests: by stage directory (Stage.directory)."""
    out = {}
    for name, row in STAGES.items():
        if row.directory not in manifests:
            continue
        path = Path(run_dir) / row.directory / "manifest.json"
        skipped = since is not None and path.exists() and path.stat().st_mtime < since
        out[name] = "skipped" if skipped else round(manifests[row.directory]["seconds"], 1)
    return out


def by_source_markdown(by_source: dict[str, dict]) -> list[str]:
    """The report's per-source table: samples, supervised tokens, on-policy fraction, draft vocab coverage."""
    pct = lambda v: "-" if v is None else percent(v)  # noqa: E731
    lines = ["", "Per source: how much of the trained data the target writes itself (on-policy: supervised tokens "
             "that are the target's argmax) and the draft vocab's coverage of it", "",
             "| source | samples | supervised tokens | on-policy | draft vocab coverage |", "|---|---|---|---|---|"]
    return lines + [f"| {s} | {st['samples']} | {st['supervised']} | {pct(st['on_policy'])} | "
                    f"{pct(st['vocab_coverage'])} |" for s, st in sorted(by_source.items())]
