"""The team bet's two plots (PNG, matplotlib's Agg backend), from the measured points (studies/team_bet.py's
results, one dict per point: name, samples, epochs, seconds, tau, tau_ci95, point {samples, recipe, seed,
warm_from?}) and the answers of team_bet_run.answers (surface, tenfold).

- epochs_against_data: tau (95% interval) against training samples, one series per recipe (the plateau rule and
  each fixed epoch count), the fitted surface at each fixed count and the surface's value at 10x the largest size.
- tau_against_gpu_seconds: every point's tau against its GPU-seconds, the warm-start arm drawn as its quarter's
  point joined to the grown draft, beside the scratch points at the full size.
"""
from __future__ import annotations

from pathlib import Path

from eagle3_core.studies.team_bet import quarter_of, recipe_epochs
from eagle3_core.studies.team_bet_surface import surface_tau

NAMES = {"epochs_against_data": "team_bet_epochs_data.png", "tau_against_gpu_seconds": "team_bet_warm_scratch.png"}


def _plots():
    from eagle3_core.evaluation import plots  # matplotlib (Agg backend, ~0.3 s), loaded only when plots are drawn
    return plots


def _finish(fig, ax, path: Path, **labels) -> Path:
    """Log x axis (minor ticks unlabeled), the labels, legend and grid; the figure saved at `path`."""
    ax.set(xscale="log", ylabel="tau (replay, greedy, chain of 5)", **labels)
    ax.xaxis.set_minor_formatter(_plots().plt.NullFormatter())        # after the log scale, which sets its own
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _plots().save_figure(fig, path)


def _errorbar(ax, pts: list[dict], **kw) -> None:
    ax.errorbar([p["x"] for p in pts], [p["tau"] for p in pts],
                yerr=[[p["tau"] - p["tau_ci95"][0] for p in pts], [p["tau_ci95"][1] - p["tau"] for p in pts]],
                capsize=3, **kw)


def _recipes(points: list[dict]) -> dict[str, list[dict]]:
    """Scratch points by recipe ('plateau' first, then fixed counts ascending), each list by samples."""
    out: dict[str, list[dict]] = {}
    for p in sorted((p for p in points if not p["point"].get("warm_from")), key=lambda p: p["samples"]):
        out.setdefault(p["point"]["recipe"], []).append(p)
    return dict(sorted(out.items(), key=lambda kv: recipe_epochs(kv[0]) or 0))


def epochs_against_data(points: list[dict], answers: dict, path: Path, where: str = "") -> Path:
    """PNG at `path`: tau against samples (log x) per recipe, seeds side by side; the surface (answers['surface'])
    as lines at each fixed epoch count and the tenfold prediction as a hollow marker, when answers hold them."""
    plt = _plots().plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    fit, ten = answers.get("surface", {}), answers.get("tenfold")
    for i, (recipe, pts) in enumerate(_recipes(points).items()):
        label = f"{recipe} (epochs run: {sorted({p['epochs'] for p in pts})})"
        _errorbar(ax, [{**p, "x": p["samples"] * (1 + 0.02 * p["point"]["seed"])} for p in pts], fmt="o",
                  color=f"C{i}", label=label)
        E = recipe_epochs(recipe)
        if E and "a" in fit:
            xs = [p["samples"] for p in pts]
            grid = [min(xs) * (max(xs) / min(xs)) ** (k / 20) for k in range(21)]
            ax.plot(grid, [surface_tau(fit, n, E) for n in grid], "-", color=f"C{i}", alpha=0.5)
    if ten:
        ax.plot([ten["samples"], ten["samples_10x"]], [ten["tau_now"], ten["tau_10x"]], "--", color="gray")
        ax.plot([ten["samples_10x"]], [ten["tau_10x"]], "o", mfc="none", color="gray",
                label=f"surface at 10x data, {ten['epochs']} epochs: {ten['tau_10x']:.2f} (extrapolated)")
    return _finish(fig, ax, path, xlabel="training samples",
                   title=f"Epochs against data{': ' + where if where else ''}")


def tau_against_gpu_seconds(points: list[dict], path: Path, where: str = "") -> Path:
    """PNG at `path`: every point's tau against its GPU-seconds (log x), by recipe; each warm-arm point joined to
    the plateau point of its quarter (what it grew from) and marked apart."""
    plt = _plots().plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (recipe, pts) in enumerate(_recipes(points).items()):
        _errorbar(ax, [{**p, "x": p["seconds"]} for p in pts], fmt="o", color=f"C{i}", alpha=0.6,
                  label=f"scratch, {recipe}")
        for p in pts:
            ax.annotate(f"{p['samples']:,}", (p["seconds"], p["tau"]), fontsize=6, xytext=(3, -8),
                        textcoords="offset points")
    for w in (p for p in points if p["point"].get("warm_from")):
        q = next((p for p in points if p["point"] == quarter_of(w["point"])), None)
        if q:
            ax.plot([q["seconds"], w["seconds"]], [q["tau"], w["tau"]], ":", color="black")
        _errorbar(ax, [{**w, "x": w["seconds"]}], fmt="*", markersize=11, color="black",
                  label=f"warm start {w['point']['warm_from']:,} -> {w['samples']:,} (seconds include the quarter)")
    return _finish(fig, ax, path, xlabel="GPU-seconds of training",
                   title=f"Warm start against scratch{': ' + where if where else ''}")


def plot_all(points: list[dict], answers: dict, folder: Path, where: str = "") -> list[Path]:
    """Both plots into `folder` under NAMES' file names. Returns their paths."""
    return [epochs_against_data(points, answers, Path(folder) / NAMES["epochs_against_data"], where),
            tau_against_gpu_seconds(points, Path(folder) / NAMES["tau_against_gpu_seconds"], where)]
