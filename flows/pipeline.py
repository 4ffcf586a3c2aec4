"""The end-to-end EAGLE-3 pipeline flow. Reads like the diagram in DESIGN.md:

prompts -> regenerate -> tokenize + loss masks -> aux hidden states -> vocab map -> train (TTT) + export
        -> offline tau (HF target verifies) -> deploy on llama.cpp's EAGLE-3 server -> tau, tok/s vs no draft
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from eagle3_core import report
from eagle3_core.config import PipelineConfig, preset
from flows import stages as s


@flow(name="eagle3-pipeline")
def eagle3_pipeline(config: PipelineConfig | None = None) -> dict:
    """Run every stage on `config` (default: the embedded demo preset); publish the report as artifacts."""
    cfg = config or preset("demo")
    s.prompts_flow(cfg)
    s.generation_flow(cfg)
    s.features_flow(cfg)
    s.vocab_flow(cfg)
    s.train_flow(cfg)
    s.evaluate_flow(cfg)
    s.deploy_llama_cpp_flow(cfg)
    summary = report.collect(cfg.run_dir)
    summary["plots"] = report.write_plots(summary, cfg.run_dir)
    md = report.markdown(summary)
    (cfg.run_dir / "report.md").write_text(md)
    (cfg.run_dir / "report.json").write_text(json.dumps(summary, indent=2))
    create_markdown_artifact(md, key="eagle3-report", description="EAGLE-3 draft report")
    create_markdown_artifact(report.plots_markdown_inline(summary["plots"], cfg.run_dir), key="eagle3-plots",
                             description="acceptance per position, tau with CI and per category, tokens/s")
    create_table_artifact([{"stage": k, "seconds": v} for k, v in summary["stage_seconds"].items()],
                          key="eagle3-stage-times")
    get_run_logger().info("report written to %s", cfg.run_dir / "report.md")
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description="Run the EAGLE-3 pipeline as a Prefect flow run.")
    p.add_argument("--preset", default="demo", help="demo | debug_tiny")
    p.add_argument("--run-dir", default=None, help="output directory (default: runs/<preset>)")
    p.add_argument("--config", default=None, help="JSON file with a PipelineConfig (overrides --preset)")
    args = p.parse_args()
    if args.config:
        cfg = PipelineConfig.model_validate_json(Path(args.config).read_text())
    else:
        cfg = preset(args.preset, args.run_dir or f"runs/{args.preset}")
    summary = eagle3_pipeline(cfg)
    print(report.markdown(summary))


if __name__ == "__main__":
    main()
