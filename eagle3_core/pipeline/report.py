"""The run report: Markdown and JSON from the stage manifests (what `make demo` prints and publishes)."""
from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path

import pyarrow.parquet as pq

from eagle3_core.contract.layout import RunLayout
from eagle3_core.evaluation.sampling_compare import compare_sampling, tau_by_temperature_markdown
from eagle3_core.features.on_policy import on_policy_by_source, sources_of
from eagle3_core.pipeline import report_numbers as nums
from eagle3_core.pipeline import report_sections as sections
from eagle3_core.pipeline.nightly import nights_markdown
from eagle3_core.pipeline.table import STAGES


def collect(run_dir: Path, init_from: str | None = None, since: float | None = None,
            earlier: dict | None = None) -> dict:
    """Key numbers of a finished run. init_from: the run's train.init_from (the draft measured before training is
    then a warm start); since: the current flow run's start (Unix seconds; stages done before it are 'skipped' in
    the stage times); earlier: the previous report.json of this run directory (its quiet speeds, for the load
    flag: report_numbers.speed_checks). Raises FileNotFoundError naming a missing manifest."""
    m = {}
    for row in STAGES.values():         # by directory: those a finished run has (Stage.in_report), the others if run
        path = Path(run_dir) / row.directory / "manifest.json"
        if not path.exists() and row.in_report:
            raise FileNotFoundError(f"{path} missing: the run did not finish stage {row.name}")
        if path.exists():
            m[row.directory] = json.loads(path.read_text())
    ev = m["eval"]["summary"]
    r = {
        "run_dir": str(run_dir), "train_prompts": len(m["prompts"]["train_ids"]),
        "eval_prompts": len(m["prompts"]["eval_ids"]), "samples": m["tokenized"]["samples"],
        "tokens": m["tokenized"]["tokens"], "loss_tokens": m["tokenized"]["loss_tokens"],
        "generated_tokens": m["generations"]["completion_tokens"], "server": m["generations"]["server"],
        "feature_bytes_per_token": m["features"]["bytes_per_token"], "aux_layer_ids": m["features"]["aux_layer_ids"],
        "draft_vocab_size": m["vocab"]["draft_vocab_size"], "vocab_coverage": m["vocab"]["coverage"],
        "best_epoch": m["draft"]["best"], "draft_dir": str(RunLayout(run_dir).stored(m["draft"]["export_dir"])),
        "stage_seconds": nums.stage_times(Path(run_dir), m, since), "init_from": init_from and str(init_from),
        "eval": ev,
        "llama_cpp": m["deploy_llama_cpp"].get("summary"),
        "sglang": _optional_manifest(RunLayout(run_dir).manifest("deploy-sglang")).get("verdict"),
        "sampling": compare_sampling(m["generations"].get("sampling"), m["eval"].get("sampling"),
                                     m["eval"].get("serving")),
        "by_source": data_by_source(Path(run_dir), m["vocab"].get("coverage_per_source") or {}),
    } | {"speed": None}
    r["speed"] = nums.speed_checks(r, (earlier or {}).get("speed"))
    return r


def data_by_source(run_dir: Path, coverage: dict) -> dict[str, dict]:
    """Per source of the trained data: samples, supervised tokens, the on-policy fraction (supervised tokens that
    are the target's argmax, from the feature store: features.on_policy; None for an online store) and the draft
    vocab's coverage of its supervised tokens (the vocab manifest's `coverage_per_source`; None for a run before
    it)."""
    layout = RunLayout(run_dir)
    cols = [c for c in ("id", "source", "loss_mask") if c in pq.read_schema(layout.tokenized_train).names]
    rows = pq.read_table(layout.tokenized_train, columns=cols).to_pylist()
    src = sources_of(rows)
    per = _on_policy_once(Path(run_dir), lambda: on_policy_by_source(layout.features, src))
    out: dict[str, dict] = {}
    for r in rows:
        st = out.setdefault(src[r["id"]], {"samples": 0, "supervised": 0})
        st["samples"] += 1
        st["supervised"] += sum(r["loss_mask"])
    for s, st in out.items():
        st["on_policy"] = per[s]["fraction"] if s in per else None
        st["vocab_coverage"] = coverage[s]["coverage"] if s in coverage else None
    return out


def _on_policy_once(run_dir: Path, compute) -> dict:
    """compute() (the on-policy fraction per source, which opens every feature shard) once per feature store: kept
    in run_dir/report_on_policy.json under the sha256 of features/manifest.json (rewritten whenever a shard is), so
    a report of a no-op rerun opens no shard."""
    stamp = hashlib.sha256(RunLayout(run_dir).manifest("features").read_bytes()).hexdigest()
    memo = RunLayout(run_dir).report_on_policy
    if memo.exists() and (kept := json.loads(memo.read_text())).get("features_manifest_sha256") == stamp:
        return kept["per_source"]
    per = compute()
    memo.write_text(json.dumps({"features_manifest_sha256": stamp, "per_source": per}, indent=1))
    return per


def _optional_manifest(path: Path) -> dict:
    """A stage manifest that may be missing (the SGLang deployment runs only on GPU hosts)."""
    return json.loads(path.read_text()) if path.exists() else {}


def _runs(ev: dict) -> dict[str, dict]:
    return {k: ev[k] for k in nums.RUN_NAMES if k in ev}


def write_plots(r: dict, run_dir: Path) -> dict[str, str]:
    """PNG plots of a collected run under run_dir/plots; returns {name: path relative to run_dir}."""
    from eagle3_core.evaluation.plots import (  # matplotlib, loaded only when plots are drawn
        plot_acceptance_per_position, plot_tau, plot_tok_s, run_label)
    ev, out = r["eval"], RunLayout(run_dir).report_plots
    runs = _runs(ev)
    tau_sim = (ev.get("consistency") or {}).get("tau_sim_at_steps")
    before = nums.before_training_label(r)
    label = lambda k, d: run_label(k, d).replace("untrained", before)  # noqa: E731
    bars = nums.speed_bars(r, label)
    shown = {("before_training" if k == "untrained" and before != "untrained" else k): d for k, d in runs.items()}
    paths = {"acceptance_per_position": plot_acceptance_per_position(shown, out / "acceptance_per_position.png"),
             "tau": plot_tau(shown, out / "tau.png", tau_sim)}
    if len(bars) > 1:
        flagged = ", ".join((r.get("speed") or {}).get("flags") or {})
        paths["tokens_per_s"] = plot_tok_s(bars, out / "tokens_per_s.png", "Tokens/s on this machine" + (
            f" (loaded machine: {flagged})" if flagged else ""))
    return {k: str(v.relative_to(run_dir)) for k, v in paths.items()}


def embed_images(md: str, run_dir: Path) -> str:
    """`md` with each image that names a PNG file under run_dir (`![tau](plots/tau.png)`) embedded as a base64 data
    URI, for viewers that cannot read the run directory (a Prefect artifact). Other images stay as they are."""
    def embed(m: re.Match) -> str:
        path = Path(run_dir) / m.group(2)
        if m.group(2).startswith(("data:", "http:", "https:")) or not path.is_file():
            return m.group(0)
        return f"![{m.group(1)}](data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()})"
    return re.sub(r"!\[([^\]]*)\]\(([^)\s]+\.png)\)", embed, md)


def _disjoint(a: list[float], b: list[float]) -> bool:
    return a[1] < b[0] or b[1] < a[0]


def warnings(ev: dict, llama_cpp: dict | None = None) -> list[str]:
    """Warnings the numbers support, each a sentence: only where a 95% interval excludes agreement (with 2 held-out
    prompts the intervals are wide and most gaps are noise, not a misconfiguration).

    - simulated vs measured tau: evaluate.tau_consistency flagged the gap, the simulation ran on held-out samples
      and the simulated tau lies outside the measured tau's interval (simulated on the training samples, as small
      runs without held-out features do, it is inflated by overfitting: no evidence of a misconfiguration);
    - llama.cpp vs offline tau: the two intervals do not overlap;
    - tau below 1.2: the whole interval of the trained draft's tau lies below 1.2.
    None of them with fewer than report_numbers.MIN_PROMPTS_FOR_WARNINGS held-out prompts (the report says so).
    ev: the evaluate stage's summary; llama_cpp: the deploy stage's summary or None."""
    out, tr = [], ev["trained"]
    if nums.too_few_prompts(ev):
        return []
    lo, hi = tr["tau_ci95"]
    cons = ev.get("consistency")
    if cons and cons["flagged"] and cons["metrics_from"] == "eval" and not lo <= cons["tau_sim_at_steps"] <= hi:
        out.append(f"{cons['note']} (the simulated tau lies outside the measured tau's 95% interval "
                   f"{lo:.2f}-{hi:.2f})")
    off = tr.get("rules", {}).get("greedy_draft", tr)                   # llama.cpp's accept rule when sampled
    if llama_cpp and _disjoint(llama_cpp["tau_ci95"], off["tau_ci95"]):
        a, b = llama_cpp["tau_ci95"], off["tau_ci95"]
        out.append(f"the engine's tau {llama_cpp['tau']:.2f} (95% interval {a[0]:.2f}-{a[1]:.2f}) and the offline "
                   f"tau {off['tau']:.2f} ({b[0]:.2f}-{b[1]:.2f}) disagree: check the aux layer ids and d2t of the "
                   f"exported draft")
    if hi < 1.2:
        out.append(f"tau {tr['tau']:.2f} (95% interval {lo:.2f}-{hi:.2f}) is below 1.2, which usually means a "
                   f"misconfiguration (aux layer ids, d2t, chat template), not a weak draft")
    return out


def plots_markdown_inline(plots: dict[str, str], run_dir: Path) -> str:
    """The plots as Markdown images with base64 data URIs (a Prefect artifact cannot refer to local files)."""
    return "\n\n".join(f"![{name}](data:image/png;base64,"
                       f"{base64.b64encode((Path(run_dir) / rel).read_bytes()).decode()})"
                       for name, rel in plots.items()) + "\n"


def markdown(r: dict) -> str:
    """The run report in Markdown from report.collect's numbers (plots: write_plots' paths under "plots"), one
    section after another (report_sections)."""
    ev = r["eval"]
    before = nums.before_training_label(r)
    runs = {(before if k == "untrained" else k): d for k, d in _runs(ev).items()}
    flags = (r.get("speed") or {}).get("flags") or {}
    lines = sections.summary_lines(r) + sections.acceptance_lines(ev, runs, flags)
    lines += sections.category_lines(runs) + sections.consistency_lines(ev) + sections.speedup_model_lines(runs)
    for name, rel in (r.get("plots") or {}).items():
        lines += ["", f"![{name}]({rel})"]
    lines += sections.llama_cpp_lines(r.get("llama_cpp"), ev["trained"], flags)
    lines += sections.sglang_lines(r.get("sglang"))
    lines += sections.warning_lines(ev, warnings(ev, r.get("llama_cpp")))
    lines += tau_by_temperature_markdown(ev, r.get("llama_cpp"))
    if r.get("sampling"):
        lines += sampling_markdown(r["sampling"])
    lines += nights_markdown(Path(r["run_dir"]))
    return "\n".join(lines + sections.stage_time_lines(r["stage_seconds"])) + "\n"


def sampling_markdown(sp: dict) -> list[str]:
    """Markdown lines of `compare_sampling`'s result: a table of every side and a warning naming each mismatch."""
    lines = ["", "## Sampling", "", "| | temperature | top_p | top_k | thinking mode |", "|---|---|---|---|---|"]
    for name in ("regeneration", "evaluation", "serving (declared)"):
        d = sp.get(name.split(" ")[0])
        if d is not None:
            top_k = d.get("top_k", 0) or "off"
            lines.append(f"| {name} | {d['temperature']:g} | {d['top_p']:g} | {top_k} | {d['thinking']} |")
    if sp["mismatch"]:
        lines += ["", (f"**Warning**: regeneration and evaluation sample differently ({', '.join(sp['mismatch'])}): "
                       f"the draft is measured on another distribution than it was trained on; regenerate with the "
                       f"sampling you serve, or measure with the one you trained on.")]
    if sp.get("serving_mismatch"):
        lines += ["", (f"**Warning**: evaluation and the declared serving settings differ "
                       f"({', '.join(sp['serving_mismatch'])}): the measured tau is not the served one; set "
                       f"eval.sampling to the serving settings.")]
    return lines
