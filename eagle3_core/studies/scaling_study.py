"""Draft quality against training-data size: drafts trained with one recipe on nested subsets of one feature store,
each measured with the offline evaluator on the same held-out prompts; a trend of tau against log(samples).

Layout under the run directory: scaling/n_<samples>/ (draft training state, export/, manifest.json) and
scaling/{study.json, study.md, tau_vs_samples.png}. Subsets are nested (the first n of one seeded permutation of the
training samples), so a larger size contains every smaller one, and the held-out split is the train stage's.
"""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.layout import RunLayout
from eagle3_core.contract.manifest import cached_manifest, write_manifest
from eagle3_core.data.markers import stop_ids
from eagle3_core.data.prompt_set import read_rows
from eagle3_core.evaluation.acceptance import SpecRun, measure
from eagle3_core.evaluation.speculate import TargetRunner
from eagle3_core.features.reader import load_samples
from eagle3_core.pipeline.evaluate_stage import category, held_out_prompt_ids
from eagle3_core.pipeline.keys import stage_key, target_config, upstream_manifest
from eagle3_core.pipeline.train_stage import claim_training_dir, train_key, train_split
from eagle3_core.target.family import sglang_rule
from eagle3_core.target.loading import generation_eos_ids, load_target, load_tokenizer
from eagle3_core.training.checkpoint import export_draft, load_draft
from eagle3_core.training.startup import fresh_draft
from eagle3_core.training.trainer import train


def subset_sizes(n_train: int, fractions: list[float]) -> list[int]:
    """Distinct sample counts round(f * n_train) (at least 1) for fractions in (0, 1], ascending. Raises ValueError
    for a fraction outside (0, 1] or fewer than 2 distinct sizes (no trend from one point)."""
    if any(not 0.0 < f <= 1.0 for f in fractions):
        raise ValueError(f"scaling fractions must lie in (0, 1]: {fractions}")
    sizes = sorted({max(1, round(f * n_train)) for f in fractions})
    if len(sizes) < 2:
        raise ValueError(f"fractions {fractions} of {n_train} training samples give {len(sizes)} distinct size(s); "
                         f"a trend needs at least 2: use more samples or more distinct fractions")
    return sizes


def nested_subset(n_train: int, n: int, seed: int) -> list[int]:
    """Indices of the first `n` of one seeded permutation of range(n_train): subset(n) is a prefix of subset(m > n)."""
    order = list(range(n_train))
    random.Random(seed).shuffle(order)
    return sorted(order[:n])


def fit_log_trend(samples: list[int], taus: list[float]) -> dict:
    """Least-squares line tau = a + b * log10(samples). Returns {intercept, slope_per_decade, r2, points}. Raises
    ValueError with fewer than 2 distinct sizes."""
    xs = [math.log10(s) for s in samples]
    if len(set(xs)) < 2:
        raise ValueError("a trend needs at least 2 distinct sample counts")
    mx, my = sum(xs) / len(xs), sum(taus) / len(taus)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, taus, strict=True)) / sxx
    a = my - b * mx
    ss_res = sum((y - (a + b * x)) ** 2 for x, y in zip(xs, taus, strict=True))
    ss_tot = sum((y - my) ** 2 for y in taus)
    return {"intercept": a, "slope_per_decade": b, "r2": 1 - ss_res / ss_tot if ss_tot > 0 else 1.0,
            "points": len(xs)}


def predict(trend: dict, samples: int, measured_max: int) -> dict:
    """The trend's tau at `samples`; `extrapolated` is True beyond the largest measured size."""
    return {"samples": samples, "tau": trend["intercept"] + trend["slope_per_decade"] * math.log10(samples),
            "extrapolated": samples > measured_max}


def size_key(cfg: PipelineConfig, n: int, seed: int) -> str:
    """Inputs key of one size: the training stage's key (features, vocab, recipe), the size, the subset seed, the
    eval settings and the held-out prompts."""
    return stage_key(train_key(cfg), n, seed, cfg.eval, upstream_manifest(cfg.run_dir, "prompts")["inputs_key"])


def measure_offline(cfg: PipelineConfig, draft, device: str = "cpu") -> dict:
    """tau of `draft` by the offline evaluator on cfg.run_dir's held-out prompts (measure_drafts). Returns
    evaluate.measure's entry for the draft (tau, tau_ci95, accept_per_position, lossless, prompts, ...)."""
    return measure_drafts(cfg, {"draft": draft}, device)["draft"]


def held_out_prompts(cfg: PipelineConfig) -> tuple[list[dict], list[list[int]], set[int]]:
    """(rows of cfg.run_dir's prompts/eval.parquet, their token ids through the target's chat template with each
    row's tools and generation.chat_template_kwargs (evaluate_stage.held_out_prompt_ids, as the evaluate stage
    renders them), every id the target stops on: data.markers.stop_ids): what the offline evaluators decode from."""
    tok = load_tokenizer(cfg.target)
    rows = read_rows(RunLayout(cfg.run_dir).prompts_eval)
    eos = set(stop_ids(tok, generation_eos_ids(cfg.target)))
    return rows, held_out_prompt_ids(cfg, tok, rows), eos


def measure_drafts(cfg: PipelineConfig, drafts: dict, device: str = "cpu", on_prompt=None) -> dict:
    """Each draft of {name: Eagle3Draft} by the offline evaluator on cfg.run_dir's held-out prompts: chain drafting
    with cfg.eval.num_draft_steps, greedy, cfg.eval.max_new_tokens per prompt, against one target-only baseline;
    the target in fp32 on `device` ('cpu', 'cuda', 'cuda:1'; each draft is moved there, its dtype kept).
    Returns {name: evaluate.measure's entry}; on_prompt as evaluate.measure's."""
    rows, prompts, eos = held_out_prompts(cfg)
    aux = {tuple(d.shape.aux_layer_ids) for d in drafts.values()}
    if len(aux) != 1:
        raise ValueError(f"measure_drafts: the drafts read different aux layers {sorted(aux)}; measure them apart")
    report = measure(TargetRunner(load_target(cfg.target, device, torch.float32), list(aux.pop())),
                     {k: SpecRun(d.to(device).eval(), cfg.eval.num_draft_steps) for k, d in drafts.items()}, prompts,
                     [category(r) for r in rows], cfg.eval.max_new_tokens, eos, cfg.eval.tie_gap, on_prompt)
    return {k: report[k] for k in drafts}


def study_sizes(cfg: PipelineConfig, fractions: list[float]) -> list[int]:
    """subset_sizes of the train split of cfg.run_dir/features (sample count only; no shard is read)."""
    n = len(load_samples(RunLayout(cfg.run_dir).features, verify=False))
    return subset_sizes(n - int(n * cfg.train.eval_frac), fractions)


def train_and_measure(cfg: PipelineConfig, n: int, seed: int = 0, log=print) -> dict:
    """Train a draft with cfg's recipe (cfg.train, cfg.draft) on `n` training samples (nested_subset of the train
    split of cfg.run_dir/features), export it, and measure its tau with the offline evaluator on the held-out
    prompts (chain drafting, cfg.eval.num_draft_steps, greedy). Cached: a size whose manifest holds the same key is
    returned as it is. Returns the size's manifest {samples, tokens, tau, tau_ci95, accept_per_position, acc_k
    (TTT eval accuracies of the best epoch), tau_sim, best_epoch, export_dir, per_prompt (evaluate.measure's, for
    paired comparisons), seconds}. Raises ValueError if `n`
    exceeds the training samples.
    Remove the per_prompt test when study points written before 3fd89c7 are no longer supported
    (compat.LEGACY_READERS)."""
    out = RunLayout(cfg.run_dir).scaling / f"n_{n}"
    key = size_key(cfg, n, seed)
    if (m := cached_manifest(out / "manifest.json", key)) and "per_prompt" in m:     # older manifests: measure again
        return m
    t0 = time.monotonic()
    train_all, eval_s = train_split(cfg)
    if n > len(train_all):
        raise ValueError(f"scaling size {n} > {len(train_all)} training samples in {cfg.run_dir / 'features'}")
    train_s = [train_all[i] for i in nested_subset(len(train_all), n, seed)]
    draft, lm_head = fresh_draft(cfg)
    claim_training_dir(out, key)
    summary = train(draft, train_s, eval_s, lm_head, cfg.train, out, log=log)
    export = export_draft(load_draft(out / "best"), out / "export", sglang_rule=sglang_rule(target_config(cfg)))

    r = measure_offline(cfg, load_draft(export))
    best = next(h for h in summary["history"] if h["epoch"] == summary["best"]["epoch"])
    metrics = best["eval"] or best["train"]
    tokens = sum(int(s["loss_mask"].sum()) for s in train_s)
    log(f"scaling: {n} samples ({tokens} supervised tokens): tau {r['tau']:.2f} "
        f"({r['tau_ci95'][0]:.2f}-{r['tau_ci95'][1]:.2f}), tau_sim {summary['best']['tau_sim']:.2f}")
    return write_manifest(out / "manifest.json", {
        "inputs_key": key, "samples": n, "tokens": tokens, "tau": r["tau"], "tau_ci95": r["tau_ci95"],
        "accept_per_position": r["accept_per_position"], "acc_k": metrics["acc"],
        "tau_sim": summary["best"]["tau_sim"], "best_epoch": summary["best"]["epoch"], "export_dir": str(export),
        "eval_prompts": r["prompts"], "per_prompt": r["per_prompt"], "lossless": r["lossless"],
        "seconds": time.monotonic() - t0})


def plot_study(sizes: list[dict], trend: dict, extrapolations: list[dict], path: Path) -> Path:
    """PNG: tau (with 95% CI) and acc_k against training samples (log x), the fitted trend, dashed where it is
    extrapolated."""
    import matplotlib  # slow import (matplotlib, ~0.3 s), for the plot only
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # slow import (matplotlib, ~0.3 s), for the plot only
    ns = [s["samples"] for s in sizes]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.errorbar(ns, [s["tau"] for s in sizes], yerr=[[s["tau"] - s["tau_ci95"][0] for s in sizes],
                                                     [s["tau_ci95"][1] - s["tau"] for s in sizes]],
               fmt="o", capsize=3, label="measured tau (95% CI)")
    lo, hi = min(ns), max(ns)
    xs = [lo * (hi / lo) ** (i / 20) for i in range(21)]
    a.plot(xs, [predict(trend, x, hi)["tau"] for x in xs], "-", color="gray",
           label=f"trend: {trend['slope_per_decade']:+.2f} tau per 10x samples")
    if extrapolations:
        far = max(e["samples"] for e in extrapolations)
        xe = [hi * (far / hi) ** (i / 20) for i in range(21)]
        a.plot(xe, [predict(trend, x, hi)["tau"] for x in xe], "--", color="gray", label="extrapolated")
        for e in extrapolations:
            a.annotate(f"{e['tau']:.2f} (extrapolated)", (e["samples"], e["tau"]), fontsize=8)
    a.set(xscale="log", xlabel="training samples", ylabel="tau (offline, greedy)", title="Acceptance length")
    a.legend(fontsize=8)
    K = max(len(s["acc_k"]) for s in sizes)
    for k in range(K):
        b.plot(ns, [s["acc_k"][k] if k < len(s["acc_k"]) else float("nan") for s in sizes], marker=".",
               label=f"acc_{k}")
    b.set(xscale="log", xlabel="training samples", ylabel="TTT accuracy (held-out)", title="acc_k", ylim=(0, 1))
    b.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def finish_study(cfg: PipelineConfig, sizes: list[dict], extrapolate_to: list[int] | None = None) -> dict:
    """Fit the trend, plot, and write scaling/{study.json, study.md, tau_vs_samples.png}. Returns the study
    {sizes, trend, predictions, plot, markdown}."""
    sizes = sorted(sizes, key=lambda s: s["samples"])
    trend = fit_log_trend([s["samples"] for s in sizes], [s["tau"] for s in sizes])
    hi = sizes[-1]["samples"]
    preds = [predict(trend, n, hi) for n in (extrapolate_to or [])]
    out = RunLayout(cfg.run_dir).scaling
    plot = plot_study(sizes, trend, [p for p in preds if p["extrapolated"]], out / "tau_vs_samples.png")
    md = ["# tau against training data", "",
          f"Recipe: {cfg.train.epochs or 'rule-chosen (train.epochs_for)'} epochs, lr {cfg.train.lr}, TTT length "
          f"{cfg.train.ttt_length}; offline "
          f"evaluator, {cfg.eval.num_draft_steps} draft steps, greedy, {sizes[0].get('eval_prompts', '?')} held-out "
          "prompts.", "",
          "| training samples | supervised tokens | tau | 95% CI | tau_sim (TTT) | acc_0 | best epoch |",
          "|---|---|---|---|---|---|---|"]
    for s in sizes:
        md.append(f"| {s['samples']} | {s['tokens']} | {s['tau']:.3f} | {s['tau_ci95'][0]:.2f}-"
                  f"{s['tau_ci95'][1]:.2f} | {s['tau_sim']:.2f} | {s['acc_k'][0]:.3f} | {s['best_epoch']} |")
    md += ["", f"Trend: tau = {trend['intercept']:.3f} + {trend['slope_per_decade']:.3f} * log10(samples) "
           f"(R^2 {trend['r2']:.2f}, {trend['points']} sizes)."]
    for p in preds:
        md.append(f"- {p['samples']} samples: tau {p['tau']:.2f}"
                  + (" (**extrapolated** beyond the largest measured size: a guess, not a measurement)"
                     if p["extrapolated"] else " (interpolated)"))
    study = {"sizes": sizes, "trend": trend, "predictions": preds, "plot": str(plot), "markdown": "\n".join(md) + "\n"}
    (out / "study.md").write_text(study["markdown"])
    (out / "study.json").write_text(json.dumps(study, indent=2))
    return study


def run_scaling_study(cfg: PipelineConfig, fractions: list[float], extrapolate_to: list[int] | None = None,
                      seed: int = 0, log=print) -> dict:
    """Every size of the study in this process (the Prefect flow runs one task per size instead), then
    finish_study. Needs the features and vocab stages of cfg.run_dir."""
    sizes = [train_and_measure(cfg, n, seed, log) for n in study_sizes(cfg, fractions)]
    return finish_study(cfg, sizes, extrapolate_to)
