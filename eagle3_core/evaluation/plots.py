"""PNG plots for the report (matplotlib, Agg backend: no display needed). Each function writes one file and
returns its path. Inputs are the JSON structures of evaluate.measure and evaluation.sglang_bench.verdict."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

LABELS = {"trained": "trained, chain", "trained_tree": "trained, tree", "untrained": "untrained, chain",
          "before_training": "warm start before training, chain"}


def run_label(name: str, run: dict) -> str:
    """'trained, tree (S=3, k=4, T=8)' from a run name and its measure() entry."""
    p = run.get("params") or {}
    shape = f"S={p.get('num_steps')}" + (f", k={p['topk']}, T={p['num_draft_tokens']}" if p.get("topk", 1) > 1
                                          else "")
    return f"{LABELS.get(name, name)} ({shape})" if p else LABELS.get(name, name)


def save_figure(fig, path: Path) -> Path:
    """Lay out `fig`, write it as a PNG at `path` (110 dpi; parent folders made), close it. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_acceptance_per_position(runs: dict[str, dict], path: Path) -> Path:
    """Grouped bars: P(draft token i accepted | tokens before it accepted), per draft position, one bar per run."""
    fig, ax = plt.subplots(figsize=(7, 4))
    n = len(runs)
    width = 0.8 / max(n, 1)
    for j, (name, run) in enumerate(runs.items()):
        acc = run["accept_per_position"]
        xs = [i + 1 + (j - (n - 1) / 2) * width for i in range(len(acc))]
        ax.bar(xs, acc, width, label=run_label(name, run))
    ax.set_xlabel("draft position (depth)")
    ax.set_ylabel("conditional acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_xticks(range(1, max(len(r["accept_per_position"]) for r in runs.values()) + 1))
    ax.set_title("Acceptance per draft position (offline, greedy)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)


def plot_tau(runs: dict[str, dict], path: Path, tau_sim: float | None = None) -> Path:
    """Left: tau with its 95% bootstrap interval per run (and the simulated tau from training). Right: tau per
    prompt category with intervals, for every run."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [1, 1.6]})
    names = list(runs)
    taus = [runs[n]["tau"] for n in names]
    err = [[t - runs[n]["tau_ci95"][0] for n, t in zip(names, taus)],
           [runs[n]["tau_ci95"][1] - t for n, t in zip(names, taus)]]
    ax.bar(range(len(names)), taus, yerr=err, capsize=5, color=[f"C{i}" for i in range(len(names))])
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([run_label(n, runs[n]).replace(" (", "\n(") for n in names], fontsize=7)
    ax.axhline(1.0, color="grey", lw=1, ls=":")
    if tau_sim is not None:
        ax.axhline(tau_sim, color="k", lw=1, ls="--", label=f"simulated tau (training) {tau_sim:.2f}")
        ax.legend(fontsize=8, loc="lower right")
    ax.set_ylim(0, max([tau_sim or 0] + [runs[n]["tau_ci95"][1] for n in names]) * 1.12)
    ax.set_ylabel("acceptance length tau (tokens / verify step)")
    ax.set_title("tau with 95% bootstrap CI")
    cats = sorted({c for r in runs.values() for c in r.get("per_category", {})})
    shown = [n for n in names if runs[n].get("per_category")]
    width = 0.8 / max(len(shown), 1)
    for j, n in enumerate(shown):
        pc = runs[n].get("per_category", {})
        xs = [i + (j - (len(shown) - 1) / 2) * width for i, c in enumerate(cats) if c in pc]
        vals = [pc[c]["tau"] for c in cats if c in pc]
        lo = [pc[c]["tau"] - pc[c]["tau_ci95"][0] for c in cats if c in pc]
        hi = [pc[c]["tau_ci95"][1] - pc[c]["tau"] for c in cats if c in pc]
        ax2.bar(xs, vals, width, yerr=[lo, hi], capsize=3, label=run_label(n, runs[n]), color=f"C{names.index(n)}")
    ax2.set_xticks(range(len(cats)))
    ax2.set_xticklabels(cats, rotation=30, ha="right", fontsize=8)
    ax2.axhline(1.0, color="grey", lw=1, ls=":")
    ax2.set_title("tau per prompt category")
    ax2.legend(fontsize=7)
    return save_figure(fig, path)


def tok_s_annotation(bar: dict) -> str:
    """The text beside a tok/s bar: its value and its ratio against the baseline it names ('' for a baseline)."""
    v = bar["tokens_per_s"]
    if bar["baseline"] == bar["label"]:
        return f" {v:.3g} (baseline)"
    return f" {v:.3g} ({bar['ratio']:.2f}x vs {bar['baseline']})"


def plot_tok_s(bars: list[dict], path: Path, title: str = "Decoding speed, same hardware") -> Path:
    """Horizontal bars of tokens/s, one per {label, tokens_per_s, baseline, ratio} (report_numbers.speed_bars):
    baselines grey, each other bar's ratio against the baseline it names (tok_s_annotation)."""
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(bars) + 1.5))
    labels, vals = [b["label"] for b in bars], [b["tokens_per_s"] for b in bars]
    ax.barh(range(len(vals)), vals, color=["grey" if b["baseline"] == b["label"] else f"C{i}"
                                           for i, b in enumerate(bars)])
    ax.set_yticks(range(len(vals)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    for i, b in enumerate(bars):
        ax.text(b["tokens_per_s"], i, tok_s_annotation(b), va="center", fontsize=8)
    ax.set_xlim(0, max(vals) * 1.6)
    ax.set_xlabel("output tokens / s")
    ax.set_title(title)
    return save_figure(fig, path)


def plot_tok_s_vs_concurrency(per_level: list[dict], path: Path) -> Path:
    """Output tok/s of the baseline and EAGLE3 servers against concurrency (sglang_bench.verdict's per_level)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    cs = [p["concurrency"] for p in per_level]
    ax.plot(cs, [p["baseline_tok_s"] for p in per_level], "o-", color="grey", label="baseline")
    ax.plot(cs, [p["eagle3_tok_s"] for p in per_level], "o-", color="C0", label="EAGLE3")
    for p in per_level:
        ax.annotate(f"{p['speedup']:.2f}x", (p["concurrency"], p["eagle3_tok_s"]), textcoords="offset points",
                    xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs)
    ax.set_xticklabels([str(c) for c in cs])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.set_title("SGLang: tokens/s vs concurrency")
    ax.legend()
    ax.grid(alpha=0.3)
    return save_figure(fig, path)
