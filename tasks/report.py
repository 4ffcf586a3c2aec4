"""The report task: collects the stage manifests into report.md/report.json and publishes them as artifacts."""
from __future__ import annotations

import json

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.layout import RunLayout
from eagle3_core.pipeline import report
from tasks.artifacts import publish_report, run_key
from tasks.logs import run_log


# not cached: it computes nothing, and every flow run should carry its own report artifacts
@task(name="report", task_run_name="report", cache_policy=NO_CACHE, timeout_seconds=600)
def report_task(config: PipelineConfig) -> dict:
    """Write run_dir/report.{md,json} from the stage manifests and publish them (Markdown, tables, plots)."""
    with run_log() as log:
        summary = report.collect(config.run_dir)
        summary["plots"] = report.write_plots(summary, config.run_dir)
        md = report.markdown(summary)
        (config.run_dir / "report.md").write_text(md)
        (config.run_dir / "report.json").write_text(json.dumps(summary, indent=2))
        history = json.loads((RunLayout(config.run_dir).manifest("train")).read_text())["history"]
        publish_report(summary, md, history, config.run_dir)
        create_markdown_artifact(report.plots_markdown_inline(summary["plots"], config.run_dir),
                                 key=run_key(config.run_dir, "eagle3-plots"),
                                 description="acceptance per position, tau with CI and per category, tokens/s")
        for warning in report.warnings(summary["eval"], summary.get("llama_cpp")):
            log.warning("report: %s", warning)
        log.info("report written to %s", config.run_dir / "report.md")
        return summary
