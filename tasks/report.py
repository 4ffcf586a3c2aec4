"""The report task: collects the stage manifests into report.md/report.json and publishes them as artifacts."""
from __future__ import annotations

import json

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext

from eagle3_core.check import render
from eagle3_core.config import PipelineConfig
from eagle3_core.contract.layout import RunLayout
from eagle3_core.pipeline import report
from eagle3_core.pipeline.table import STAGES, stage_done
from tasks.artifacts import publish_report, run_key
from tasks.logs import run_log


def run_started_at() -> float | None:
    """The current flow run's start (Unix seconds): stages whose manifests are older were skipped by this run."""
    ctx = FlowRunContext.get()
    start = ctx.flow_run.start_time if ctx and ctx.flow_run else None
    return start.timestamp() if start else None


def written_report(config: PipelineConfig) -> str:
    """The run's report.md as the report task wrote it (what `python -m flows.pipeline` prints at the end)."""
    return RunLayout(config.run_dir).report_md.read_text()


def earlier_report(config: PipelineConfig) -> dict | None:
    """The run directory's previous report.json (its quiet speeds, for the load flag), None before the first."""
    path = RunLayout(config.run_dir).report_json
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except ValueError:                      # a report cut short by a crash: no earlier speeds
        return None


# not cached: it computes nothing, and every flow run should carry its own report artifacts
@task(name="report", task_run_name="report", cache_policy=NO_CACHE, timeout_seconds=600)
def report_task(config: PipelineConfig) -> dict:
    """Write run_dir/report.{md,json} from the stage manifests and publish them (Markdown, tables, plots)."""
    with run_log() as log:
        summary = report.collect(config.run_dir, config.train.init_from, run_started_at(), earlier_report(config))
        summary["plots"] = report.write_plots(summary, config.run_dir)
        md = report.markdown(summary)
        (run := RunLayout(config.run_dir)).report_md.write_text(md)
        run.report_json.write_text(json.dumps(summary, indent=2))
        history = json.loads((RunLayout(config.run_dir).manifest("train")).read_text())["history"]
        publish_report(summary, md, history, config.run_dir)
        create_markdown_artifact(report.plots_markdown_inline(summary["plots"], config.run_dir),
                                 key=run_key(config.run_dir, "eagle3-plots"),
                                 description="acceptance per position, tau with CI and per category, tokens/s")
        for warning in report.warnings(summary["eval"], summary.get("llama_cpp")):
            log.warning("report: %s", warning)
        for source, why in summary["speed"]["flags"].items():
            log.warning("report: %s speeds measured on a loaded machine (%s): flagged, left out of the speed-up",
                        source, why)
        log.info("report written to %s", run.report_md)
        return summary


def check_summary(facts: dict) -> str:
    """A few lines of check's facts for the run log's first screen: the target, its aux layers, the draft vocab
    and the disk the features need against what is free."""
    v, d, aux = facts.get("vocab") or {}, facts.get("disk") or {}, facts.get("aux_layer_ids")
    if isinstance(aux, dict):                              # {'ours (layer outputs)': [...], 'sglang': {...}, ...}
        aux = next(iter(aux.values()), None)
    return (f"check: passed: target {facts.get('target')} ({facts.get('family')}, {facts.get('layers')} layers, "
            f"hidden {facts.get('hidden_size')}); aux layers {aux}; draft vocab {v.get('N')} of {v.get('V')}; "
            f"features need {d.get('features_gb')} GB, {d.get('free_gb')} GB free at {d.get('where')}")


def publish_check(config: PipelineConfig, facts: dict) -> str:
    """Publish every fact as the markdown artifact `check-<run>`; returns check_summary's line naming it, which
    plan_stages_task logs with the plan (the log keeps its first screen for what the run will do)."""
    key = run_key(config.run_dir, "check")
    create_markdown_artifact(f"# check of {config.run_dir}\n\n```\n{render(facts)}\n```\n", key=key,
                             description="every fact check read from the config and the target's config files")
    return f"{check_summary(facts)}; every fact in the artifact {key}"


@task(name="plan-stages", task_run_name="plan-stages", cache_policy=NO_CACHE)
def plan_stages_task(config: PipelineConfig, refresh: bool = False, said: list[str] = ()) -> dict:
    """Log what this run will do, as the run log's first message: the stages done for these inputs (skipped) and
    those to run, then the lines `said` (check's summary, the night's plan) in the same message. A stage after one
    that runs is listed to run: it is skipped only if its inputs come out the same. Returns {'skip': [...],
    'run': [...]}."""
    skip, run = [], []
    for stage in STAGES:
        try:
            done = not refresh and not run and stage_done(config, stage)
        except (FileNotFoundError, KeyError, ValueError):        # an upstream stage not done: no key yet
            done = False
        (skip if done else run).append(stage)
    if skip:
        plan = f"plan: skip {', '.join(skip)} (done for these inputs); run {', '.join(run) or 'nothing'}"
    else:
        plan = "plan: run every stage (none done for these inputs)"        # one line: the graph names them
    get_run_logger().info("%s", "\n".join([plan, *said]))
    return {"skip": skip, "run": run}
