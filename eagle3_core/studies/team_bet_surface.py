"""The team bet's answers from its measured points (studies/team_bet.py): the surface tau(samples, epochs), its
prediction at 10x data with plan's cost of that 10x, warm start against scratch with paired intervals.

The surface: tau = a + b*x + c*y + d*x*y, x = log10(training samples), y = log10(epochs run), ordinary least
squares. b is the gain per 10x data at one epoch, c per 10x epochs at one sample; the slope per decade of data
at E epochs is b + d*log10(E), of epochs at N samples c + d*log10(N). A bottleneck reading: at the largest size,
compare the gain of 10x data (b + d*y) with what the epochs measured there already bought.
"""
from __future__ import annotations

import math

import torch

from eagle3_core.config import PipelineConfig
from eagle3_core.evaluation.acceptance import paired_bootstrap_diff_ci
from eagle3_core.studies.team_bet import point_name, quarter_of, recipe_epochs
from eagle3_core.training.stopping import planned_epochs

TERMS = ("a", "b", "c", "d")


def fit_surface(points: list[dict]) -> dict:
    """Least squares tau = a + b*x + c*y + d*x*y (module docstring) over points [{samples, epochs, tau}]. Returns
    {a, b, c, d, r2, points, rmse}. Raises ValueError with fewer than 4 points or fewer than 2 distinct sizes or 2
    distinct epoch counts (the terms are not identified: add points at another size or another epoch count)."""
    xs = [math.log10(p["samples"]) for p in points]
    ys = [math.log10(p["epochs"]) for p in points]
    if len(points) < 4 or len(set(xs)) < 2 or len(set(ys)) < 2:
        raise ValueError(f"the surface needs >= 4 points over >= 2 sizes and >= 2 epoch counts; got {len(points)} "
                         f"points, {len(set(xs))} size(s), {len(set(ys))} epoch count(s): measure more points")
    X = torch.tensor([[1.0, x, y, x * y] for x, y in zip(xs, ys, strict=True)], dtype=torch.float64)
    t = torch.tensor([p["tau"] for p in points], dtype=torch.float64)
    if torch.linalg.matrix_rank(X) < 4:
        raise ValueError("the points do not identify the interaction term (sizes and epochs vary together): "
                         "add a fixed-epoch point at another size")
    coef = torch.linalg.lstsq(X, t.unsqueeze(1)).solution.squeeze(1)
    res = t - X @ coef
    ss_tot = float(((t - t.mean()) ** 2).sum())
    return {**dict(zip(TERMS, coef.tolist(), strict=True)), "points": len(points),
            "r2": 1 - float((res ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0,
            "rmse": float((res ** 2).mean().sqrt())}


def surface_tau(fit: dict, samples: float, epochs: float) -> float:
    x, y = math.log10(samples), math.log10(epochs)
    return fit["a"] + fit["b"] * x + fit["c"] * y + fit["d"] * x * y


def tenfold(fit: dict, points: list[dict]) -> dict:
    """The surface at the largest measured size N and at 10N, both at the epochs the largest size's plateau point
    ran (else its most epochs): {samples, epochs, tau_now, tau_10x, gain, slope_data_per_decade, extrapolated}."""
    n = max(p["samples"] for p in points)
    top = [p for p in points if p["samples"] == n]
    plateau = [p for p in top if p.get("recipe") == "plateau"]
    E = max(p["epochs"] for p in (plateau or top))
    now, ten = surface_tau(fit, n, E), surface_tau(fit, 10 * n, E)
    return {"samples": n, "samples_10x": 10 * n, "epochs": E, "tau_now": now, "tau_10x": ten, "gain": ten - now,
            "slope_data_per_decade": fit["b"] + fit["d"] * math.log10(E), "extrapolated": True}


def tenfold_plan(cfg: PipelineConfig, rates: dict, samples: int, epochs: int, plan_run, gpus: int = 1) -> dict:
    """plan_run (plan.plan_run, passed in: studies sit below plan in the layer order) of cfg grown to `samples`
    training prompts with `epochs` fixed epochs under `rates` (e.g. study_rates'), on `gpus` GPUs: {total_hours,
    gpu_hours, stages (plan_run's rows), plan (plan_run's whole result, for plan.markdown)}."""
    grown = cfg.model_copy(update={
        "prompts": cfg.prompts.model_copy(update={"num_train": samples}),
        "train": cfg.train.model_copy(update={"epochs": epochs})})
    p = plan_run(grown, rates, gpus)
    return {"total_hours": p["total_hours"], "gpu_hours": sum(r["gpu_hours"] for r in p["stages"]),
            "stages": p["stages"], "plan": p}


def study_rates(data: dict, points: list[dict], where: str) -> dict:
    """plan's rates measured by this study: `data` {generation_tok_s, output_tokens_per_sample, tokens_per_sample,
    extraction_tok_s, hidden_size} from its data stages, and train token passes/s pooled over the points' phases:
    the sum of epoch_tokens x epochs over the sum of their steady_seconds (compiles out, team_bet.steady_seconds;
    seconds where a phase has none), so the large points that a 10x run resembles weigh by their tokens, not the
    small ones' per-epoch overheads by their number. Each rate marked 'measured' with `where`. Raises ValueError
    when no point has a trained phase."""
    def r(v, unit):
        return {"value": v, "unit": unit, "status": "measured", "source": where}
    phases = [ph for p in points for ph in p["phases"] if ph["epochs"]]
    if not phases:
        raise ValueError("no trained phase among the points yet: the training rate is not measured")
    passes = sum(ph["epoch_tokens"] * ph["epochs"] for ph in phases) / sum(
        ph.get("steady_seconds") or ph["seconds"] for ph in phases)
    return {"generation_tok_s_per_server": r(data["generation_tok_s"], "output tok/s"),
            "gpus_per_server": {"value": 1, "unit": "devices", "status": "given", "source": "one GPU"},
            "output_tokens_per_sample": r(data["output_tokens_per_sample"], "tokens"),
            "tokens_per_sample": r(data["tokens_per_sample"], "tokens"),
            "extraction_tok_s_per_replica": r(data["extraction_tok_s"], "tok/s"),
            "gpus_per_extraction_replica": {"value": 1, "unit": "devices", "status": "given", "source": "one GPU"},
            "target_hidden_size": r(data["hidden_size"], "H_t"),
            "train_tok_s_per_gpu": r(passes, "token passes/s")}


def warm_against_scratch(points: list[dict]) -> list[dict]:
    """Each warm-arm point against the scratch point of the same samples, recipe and seed: both taus, their
    GPU-seconds (the warm arm's includes its quarter's) with their steady_seconds (team_bet.steady_seconds:
    compiles out; None where a point has none) and the paired bootstrap 95% interval of warm - scratch
    (acceptance.paired_bootstrap_diff_ci: the same held-out prompts resampled for both)."""
    rows = []
    for w in (p for p in points if p["point"].get("warm_from")):
        key = {k: w["point"][k] for k in ("samples", "recipe", "seed")}
        s = next((p for p in points if p["point"] == key), None)
        if s is None:
            continue
        rows.append({"samples": w["samples"], "quarter": w["point"]["warm_from"], "warm_tau": w["tau"],
                     "warm_ci95": w["tau_ci95"], "warm_seconds": w["seconds"], "scratch_tau": s["tau"],
                     "scratch_ci95": s["tau_ci95"], "scratch_seconds": s["seconds"],
                     "warm_steady_seconds": w.get("steady_seconds"),
                     "scratch_steady_seconds": s.get("steady_seconds"), "warm_minus_scratch":
                     w["tau"] - s["tau"], "ci95_paired": paired_bootstrap_diff_ci(w["per_prompt"], s["per_prompt"])})
    return rows


def study_plan(cfg: PipelineConfig, rates: dict, points: list[dict], n_train: int, plan_run) -> dict:
    """What the study costs on one GPU under `rates`, before it runs: plan_run's (plan.plan_run, passed in as
    tenfold_plan's) data stages of cfg and, per
    point, E x samples x tokens_per_sample / train_tok_s_per_gpu (E: its fixed epochs, or plan's expected epochs
    for the plateau rule, stopping.planned_epochs; the warm arm's quarter counted in the warm arm, and 0 for the
    point that quarter is: team_bet.quarter_point). Returns {data_hours,
    points: [{name, epochs, hours}], train_hours, total_hours}."""
    p = plan_run(cfg, rates, 1)
    data_h = sum(r["hours"] for r in p["stages"] if r["stage"] in ("generation", "features"))
    T, rate = rates["tokens_per_sample"]["value"], rates["train_tok_s_per_gpu"]["value"]
    quarters = {point_name(q) for q in map(quarter_of, points) if q}

    def epochs(pt: dict, n: int) -> int:
        return recipe_epochs(pt["recipe"]) or planned_epochs(cfg.train.model_copy(update={"epochs": None}),
                                                             round(n * T))[0]
    rows = []
    for pt in points:
        trained = [] if point_name(pt) in quarters else [n for n in (pt.get("warm_from"), pt["samples"]) if n]
        rows.append({"name": point_name(pt), "epochs": epochs(pt, pt["samples"]),
                     "hours": sum((epochs(pt, n) * n * T / rate / 3600 for n in trained), 0.0)})
    train_h = sum(r["hours"] for r in rows)
    return {"data_hours": data_h, "points": rows, "train_hours": train_h, "total_hours": data_h + train_h,
            "samples": n_train}
