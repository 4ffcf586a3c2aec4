"""The reference team's bet, measured: epochs against data, and warm start against scratch (extends scaling_study).

A *point* is one training run: `samples` (the first n of scaling_study.nested_subset's permutation of the train
split, subset seed 0, so sizes nest), a recipe ('plateau': train.epochs unset, the plateau rule of
training.stopping; 'eN': N epochs, warmup + cosine), a draft seed, and for the warm-start arm `warm_from` (samples
of a first run, scratch on that quarter, whose draft then starts training on all `samples`: train.init_from).
Each point's exported draft is measured by the replay evaluator (evaluation.replay_eval) on the pinned held-out
prompts: tau with its bootstrap 95% interval and the per-prompt counts for paired differences.

Resumable: each point's result is RESULTS/<name>.json holding the settings it was made with; a point whose file
holds the same settings is not run again, so separate GPU calls add points to a committed folder. `run_points`
runs, most valuable first, the points its estimate says will finish within the budget and leaves the others for
the next call.

The surface: tau = a + b*x + c*y + d*x*y with x = log10(training samples), y = log10(epochs run), least squares
over every measured point (fit_surface); its prediction at 10x the largest size is an extrapolation, and plan's
cost of that 10x comes from plan.plan_run with the rates this study measured (tenfold_plan).
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.layout import RunLayout
from eagle3_core.pipeline.keys import target_config
from eagle3_core.pipeline.train_stage import claim_training_dir, train_key, train_split
from eagle3_core.studies.scaling_study import nested_subset, subset_sizes
from eagle3_core.target.family import sglang_rule
from eagle3_core.training.checkpoint import export_draft, load_draft
from eagle3_core.training.startup import fresh_draft
from eagle3_core.training.trainer import train

SUBSET_SEED = 0               # one permutation for every point: sizes nest, seeds vary the draft's init only


def point_name(p: dict) -> str:
    """'n7409-plateau-s0', 'n1852-e24-s1', 'warm-n1852to7409-plateau-s0' (file name of the point's results)."""
    stem = f"n{p['samples']}-{p['recipe']}-s{p['seed']}"
    return f"warm-n{p['warm_from']}to{stem[1:]}" if p.get("warm_from") else stem


def recipe_epochs(recipe: str) -> int | None:
    """None for 'plateau', N for 'eN'. Raises ValueError naming the recipe otherwise."""
    if recipe == "plateau":
        return None
    if recipe.startswith("e") and recipe[1:].isdigit() and int(recipe[1:]) >= 1:
        return int(recipe[1:])
    raise ValueError(f"recipe {recipe!r}: use 'plateau' (the plateau rule) or 'eN' (N fixed epochs, e.g. 'e24')")


def study_points(n_train: int, fractions: list[float], grid: list[str], seeds: int = 2) -> list[dict]:
    """Every point of the study in the order of its value, so a budget-cut call keeps the decisive ones: the largest
    size with the plateau rule; the warm-start arm (a quarter grown to all, plateau rule both times); the largest
    size with each fixed recipe of `grid`; the smaller sizes, largest first, plateau then grid; the other seeds of
    the largest size. Sizes: scaling_study.subset_sizes(n_train, fractions)."""
    sizes = subset_sizes(n_train, fractions)
    top, quarter = sizes[-1], max(1, round(n_train / 4))
    pts = [{"samples": top, "recipe": "plateau", "seed": 0},
           {"samples": top, "recipe": "plateau", "seed": 0, "warm_from": quarter}]
    pts += [{"samples": top, "recipe": r, "seed": 0} for r in grid]
    for n in reversed(sizes[:-1]):
        pts += [{"samples": n, "recipe": r, "seed": 0} for r in ["plateau", *grid]]
    pts += [{"samples": top, "recipe": "plateau", "seed": s} for s in range(1, seeds)]
    for p in pts:
        recipe_epochs(p["recipe"])
    return pts


def point_settings(cfg: PipelineConfig, point: dict) -> dict:
    """What a point's result depends on: the point, the train recipe and draft (less init_from and seed, set by the
    point), the eval settings, the target, the held-out prompt ids and the sha256 of the train prompt ids (the prompts
    stage's manifest)."""
    prompts = json.loads((RunLayout(cfg.run_dir).prompts / "manifest.json").read_text())
    train = cfg.train.model_dump(mode="json", exclude={"init_from", "epochs", "device"})
    return {"point": point, "train": train, "draft": cfg.draft.model_dump(mode="json", exclude={"seed"}),
            "eval": cfg.eval.model_dump(mode="json"), "target": cfg.target.model_dump(mode="json"),
            "features": cfg.features.model_dump(mode="json", exclude={"device"}),
            "eval_ids": prompts.get("eval_ids"), "train_ids_sha256": hashlib.sha256(
                json.dumps(prompts.get("train_ids")).encode()).hexdigest()}


def cached_point(results: Path, point: dict, settings: dict) -> dict | None:
    """RESULTS/<name>.json when it was written with these settings, else None."""
    path = results / f"{point_name(point)}.json"
    if path.exists() and (old := json.loads(path.read_text())).get("settings") == settings:
        return old
    return None


class Unfinished(Exception):
    """A point's training reached the call's deadline; its checkpoints stay in its work folder and the next call
    on the same machine resumes it (training.trainer resumes from the newest checkpoint)."""


def _done(summary: dict, epochs: int | None, max_epochs: int) -> bool:
    """Whether the run is over: its fixed epochs run, or the plateau rule has stopped it (or its ceiling)."""
    ran = len(summary["history"])
    if epochs is not None:
        return ran >= epochs
    stop = summary.get("stopping") or {}
    return stop.get("stopped_at") is not None or ran >= max_epochs


def _epochs_that_fit(deadline: float | None, per_epoch: float | None, out: Path, seconds: float) -> int | None:
    """Epochs the next trainer call may run: all (None) without a deadline; 1 before any epoch is timed; else as
    many as the last call's seconds per epoch (compile included: an over-estimate) fit before the deadline. Raises
    Unfinished when not one fits."""
    if deadline is None:
        return None
    k = 1 if per_epoch is None else int((deadline - time.monotonic()) // per_epoch)
    if k < 1 or time.monotonic() >= deadline:
        raise Unfinished(f"{out}: {seconds:.0f} s trained; the next epoch would pass the deadline")
    return k


def steady_seconds(seconds: list[float], call_firsts: list[int]) -> float | None:
    """The epochs' seconds with each trainer call's first epoch (indices `call_firsts`, compile included) counted
    at the median of the others: the training's cost without compiles, so a run split over several calls compares
    with one run in one call. None when no epoch is a call's second or later."""
    rest = sorted(x for i, x in enumerate(seconds) if i not in call_firsts)
    if not rest:
        return None
    return sum(rest) + len(call_firsts) * rest[len(rest) // 2]


def epoch_timing(history: list[dict]) -> dict:
    """{epoch_seconds (each epoch's, s), call_firsts (the indices of each trainer call's first epoch, compile
    included), steady_seconds (steady_seconds)} from the trainer's history; all None for a history written before
    44a2f29, which kept neither (compat.LEGACY_READERS)."""
    if any("epoch_seconds" not in h for h in history):
        return {"epoch_seconds": None, "call_firsts": None, "steady_seconds": None}
    secs, firsts = [h["epoch_seconds"] for h in history], [i for i, h in enumerate(history) if h["call_first"]]
    return {"epoch_seconds": secs, "call_firsts": firsts, "steady_seconds": steady_seconds(secs, firsts)}


def _train_call(train, args: tuple, log, epochs: int | None) -> dict:
    """One trainer call of at most `epochs` epochs (resuming from out's newest checkpoint); its summary with
    call_seconds, the wall time with the GPU synchronised (each call resets dynamo and compiles: calls are few)."""
    t0 = time.monotonic()
    summary = train(*args, log=log, tensorboard=False, stop_after_epochs=epochs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return {**summary, "call_seconds": time.monotonic() - t0}


def train_subset(cfg: PipelineConfig, n: int, recipe: str, seed: int, out: Path, init_from: str | None = None,
                 log=print, deadline: float | None = None) -> dict:
    """Train a draft (draft.seed and train.seed = seed, train.epochs by `recipe`, train.init_from) on the first n
    of the nested subsets of cfg.run_dir's train split, into `out`, and export its best epoch. Without a deadline
    one trainer call; with one, a first call of one epoch times it and later calls run what fits
    (_epochs_that_fit). GPU-seconds: the wall time of those calls (the GPU synchronised; one GPU), summed over
    resumed calls in out/gpu_seconds.json. Returns {export (dir), seconds, epoch_seconds, call_firsts,
    steady_seconds (epoch_timing), epochs (run), best_epoch, stopping, epoch_tokens}. Raises Unfinished when not
    one more epoch fits before `deadline` (time.monotonic()), its checkpoints kept for a later call; ValueError
    when n exceeds the train samples."""
    run = cfg.model_copy(deep=True)
    run.draft.seed, run.train.seed, run.train.epochs, run.train.init_from = seed, seed, recipe_epochs(recipe), init_from
    train_all, eval_s = train_split(run)
    if n > len(train_all):
        raise ValueError(f"point of {n} samples > {len(train_all)} train samples in {cfg.run_dir / 'features'}")
    subset = [train_all[i] for i in nested_subset(len(train_all), n, SUBSET_SEED)]
    draft, lm_head = fresh_draft(run, log=log)
    key = f"{train_key(run)}-n{n}-s{seed}-{init_from}"
    claim_training_dir(out, key)
    clock = out / "gpu_seconds.json"
    old = json.loads(clock.read_text()) if clock.exists() else {}
    seconds = old["seconds"] if old.get("key") == key else 0.0
    per_epoch, ran = None, -1
    while True:
        summary = _train_call(train, (draft, subset, eval_s, lm_head, run.train, out), log,
                              _epochs_that_fit(deadline, per_epoch, out, seconds))
        seconds += summary["call_seconds"]
        clock.write_text(json.dumps({"key": key, "seconds": seconds}))
        added = 1 if ran < 0 else len(summary["history"]) - ran     # a first call: one epoch (a deadline) or all
        if _done(summary, run.train.epochs, run.train.max_epochs) or len(summary["history"]) == ran:
            break                       # no epoch added: the trainer's fixed rule (too few held-out tokens) ended
        ran, per_epoch = len(summary["history"]), summary["call_seconds"] / max(added, 1)
    export = export_draft(load_draft(out / "best"), out / "export", sglang_rule=sglang_rule(target_config(run)))
    return {"export": str(export), "seconds": seconds, **epoch_timing(summary["history"]),
            "epochs": len(summary["history"]),
            "best_epoch": summary["best"]["epoch"], "stopping": summary.get("stopping"),
            "epoch_tokens": sum(len(s["input_ids"]) for s in subset)}


def run_point(cfg: PipelineConfig, point: dict, work: Path, measure, train_fn=train_subset, log=print,
              deadline: float | None = None, clock=time.monotonic, measure_by: float | None = None) -> dict:
    """Train one point under `work`/<name> (the warm arm: its quarter first, from scratch, then all of its samples
    from the quarter's draft) and measure its draft (measured_point). Unfinished from train_fn passes through;
    Unfinished too when its training ends past `measure_by` (by `clock`; None: always measured), its trained
    checkpoints left for the next call on the machine to measure (train_subset resumes a finished run at once)."""
    name, phases, init = point_name(point), [], None
    if point.get("warm_from"):
        q = train_fn(cfg, point["warm_from"], point["recipe"], point["seed"], work / name / "quarter", None, log,
                     deadline)
        phases.append({"phase": "quarter", "samples": point["warm_from"], **q})
        init = q["export"]
    r = train_fn(cfg, point["samples"], point["recipe"], point["seed"], work / name / "all", init, log, deadline)
    phases.append({"phase": "warm" if init else "scratch", "samples": point["samples"], **r})
    if measure_by is not None and (late := clock() - measure_by) > 0:
        raise Unfinished(f"{work / name}: trained, {late:.0f} s too late to measure before the budget's end; the "
                         "next call measures it")
    return measured_point(point, phases, measure, log, clock)


def measured_point(point: dict, phases: list[dict], measure, log=print, clock=time.monotonic) -> dict:
    """The last phase's draft measured with `measure(export_dir) -> replay_measure's entry`. Returns the result
    {point, name, samples, epochs, seconds (GPU-seconds of all its phases, a warm arm's quarter included),
    steady_seconds (the phases' steady_seconds summed: compiles out; None if a phase has none), phases,
    tau, tau_ci95, accept_per_position, per_prompt, device (measure's, None if it names none), measure_seconds
    (the measurement's, by `clock`)}."""
    t0 = clock()
    m = measure(phases[-1]["export"])
    measured = clock() - t0
    name, seconds = point_name(point), sum(p["seconds"] for p in phases)
    steady = [p.get("steady_seconds") for p in phases]
    log(f"team bet: {name}: tau {m['tau']:.3f} ({m['tau_ci95'][0]:.2f}-{m['tau_ci95'][1]:.2f}) after "
        f"{phases[-1]['epochs']} epochs, {seconds:.0f} GPU-s")
    return {"point": point, "name": name, "samples": point["samples"], "epochs": phases[-1]["epochs"],
            "seconds": seconds, "steady_seconds": None if None in steady else sum(steady), "phases": phases,
            **{k: m[k] for k in ("tau", "tau_ci95", "accept_per_position", "per_prompt")}, "device": m.get("device"),
            "measure_seconds": measured}


def quarter_of(point: dict) -> dict | None:
    """The scratch point a warm arm trains on the way (its quarter: warm_from samples, same recipe and seed), None
    for a point that is not a warm arm."""
    if not point.get("warm_from"):
        return None
    return {"samples": point["warm_from"], "recipe": point["recipe"], "seed": point["seed"]}


def quarter_point(warm: dict) -> tuple[dict, list[dict]] | None:
    """(quarter_of(a warm arm's result's point), its phases): the quarter is that point's own training (same
    samples, recipe, seed; from scratch), so measuring its draft measures the point without training it again.
    None for a result that is not a warm arm's."""
    q = quarter_of(warm["point"])
    return (q, [{**warm["phases"][0], "phase": "scratch"}]) if q else None


def quarter_to_measure(point: dict, wanted: set[str], done: list[dict]) -> bool:
    """True when `point` is a warm arm whose quarter is a point of the study (named in `wanted`) not yet done."""
    q = quarter_of(point)
    return bool(q) and point_name(q) in wanted and point_name(q) not in names(done)


def names(done: list[dict]) -> set[str]:
    """The names of the done points' results."""
    return {d["name"] for d in done}


def measure_reserve(done: list[dict]) -> float:
    """Seconds a point's measurement is expected to take: the longest measure_seconds among the done points (0.0
    when none recorded one)."""
    return max((d.get("measure_seconds") or 0.0 for d in done), default=0.0)


def estimate_seconds(point: dict, done: list[dict], default_s: float) -> float:
    """Seconds a point is expected to take: the done points' training seconds per (sample x epoch) times its
    samples (plus the warm arm's quarter) x the epochs (its fixed epochs, else the most any done plateau point ran,
    else 24), plus its measurement (measure_reserve); default_s when nothing is done."""
    rates = [ph["seconds"] / (ph["samples"] * ph["epochs"]) for d in done for ph in d["phases"] if ph["epochs"]]
    if not rates:
        return default_s
    rate = max(rates)
    E = recipe_epochs(point["recipe"]) or max((d["epochs"] for d in done if d["point"]["recipe"] == "plateau"),
                                               default=24)
    return rate * E * (point["samples"] + point.get("warm_from", 0)) + measure_reserve(done)


def call_order(todo: list[dict], only: list[str] | None, study: set[str]) -> tuple[list[dict], list[dict]]:
    """(the points of `todo` this call may run, in order; the ones it leaves for another call). `only`: names of
    the points the call may run, in that order (a user's pick: the study's missing pieces first), None: all of
    `todo` in the study's order. Raises ValueError naming any name of `only` that is not a point of the study
    (`study`: its names), with the names that are, before anything runs."""
    if only is None:
        return todo, []
    if unknown := [n for n in only if n not in study]:
        raise ValueError(f"not points of this study: {unknown}; its points: {sorted(study)}")
    by_name = {point_name(p): p for p in todo}
    return [by_name[n] for n in only if n in by_name], [p for p in todo if point_name(p) not in only]


def run_points(cfg: PipelineConfig, points: list[dict], results: Path, work: Path, measure,
               budget_s: float | None = None, default_s: float = 600.0, partial: bool = False,
               only: list[str] | None = None, train_fn=train_subset, log=print, clock=time.monotonic) -> dict:
    """Every point in order: one whose RESULTS/<name>.json holds the same settings is read back (not rerun); each other
    runs if its estimate (estimate_seconds) fits in what is left of budget_s (None: no budget), and is left for a
    later call if not, so a call fills its budget with what fits, most valuable first; each result is written as
    soon as it is in. With `partial`, the points left are then started anyway, in order, with the rest of the
    budget, the one running at its end stopped (Unfinished), its checkpoints left in `work` for the next call on the
    same machine. Training stops measure_reserve(done) seconds before the budget's end (twice that for a warm arm
    whose quarter is measured too), so the measurements fit in it; a partial point trains to the budget's end and is
    measured if its training ended that early, else by the next call (run_point's measure_by). A warm arm's quarter
    that is also a point of the study is measured as that point (quarter_point), not trained again. `only`: the
    names this call may run, in that order (call_order); the others are read back if done, else left. `clock`:
    seconds, the trainer's deadline clock (time.monotonic). Returns {done: [results], ran: [names], left: [names not
    run, in order], unfinished: name or None}."""
    results.mkdir(parents=True, exist_ok=True)
    t0, done, ran, left, stopped = clock(), [], [], [], []
    deadline = None if budget_s is None else t0 + budget_s
    cached = {point_name(p): cached_point(results, p, point_settings(cfg, p)) for p in points}
    done += [r for r in cached.values() if r]
    wanted = set(cached)
    todo, kept = call_order([p for p in points if not cached[point_name(p)]], only, wanted)

    def run(p: dict, to_the_end: bool = False) -> bool:
        quarter = quarter_to_measure(p, wanted, done)                 # measured too, after p
        by = None if deadline is None else deadline - (1 + quarter) * measure_reserve(done)  # room to measure
        stop, by = (deadline, by) if to_the_end else (by, None)
        try:
            res = run_point(cfg, p, work, measure, train_fn, log, stop, clock, by)
        except Unfinished as e:
            log(f"team bet: {point_name(p)} stopped at the budget's end ({e}); the next call resumes it")
            stopped.append(point_name(p))
            return False
        save(res)
        if quarter and (q := quarter_point(res)):
            log(f"team bet: {point_name(q[0])} is {res['name']}'s quarter: measured, not trained again")
            save(measured_point(*q, measure, log, clock))
        return True

    def save(res: dict) -> None:                    # with the settings it was measured under (cached_point)
        res = {"settings": point_settings(cfg, res["point"]), **res}
        (results / f"{res['name']}.json").write_text(json.dumps(res, indent=1) + "\n")
        done.append(res)
        ran.append(res["name"])

    for p in todo:
        if point_name(p) in names(done):              # measured on the way (a warm arm's quarter)
            continue
        fits = budget_s is None or clock() - t0 + estimate_seconds(p, done, default_s) <= budget_s
        if not (fits and run(p)):
            left.append(p)
    for p in left if partial and not stopped else []:
        if point_name(p) not in names(done) and not run(p, to_the_end=True):  # in order until one is stopped
            break
    left = [point_name(p) for p in left + kept if point_name(p) not in ran]
    if left:
        log(f"team bet: budget spent; {len(left)} point(s) left for the next call: {', '.join(left)}")
    order = {point_name(p): i for i, p in enumerate(points)}
    done.sort(key=lambda d: order.get(d["name"], len(order)))
    return {"done": done, "ran": ran, "left": left, "unfinished": stopped[0] if stopped else None}
