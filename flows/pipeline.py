"""The end-to-end EAGLE-3 pipeline flow. Reads like the diagram in docs/architecture.md:

prompts -> regenerate -> tokenize + loss masks -> aux hidden states -> vocab map -> train (TTT) + export
        -> offline tau (HF target verifies) -> deploy on llama.cpp's EAGLE-3 server (GGUF targets) or on SGLang
        (EAGLE3; HF targets on a GPU host) -> tau, tok/s vs no draft
"""
from __future__ import annotations

import argparse

from prefect import flow

from eagle3_core.config import PipelineConfig, load_config, preset
from flows import stage_flows as s
from flows.sigterm import exit_on_sigterm
from tasks.control import ALL_STAGES, check_task
from tasks.nightly import finish_night_task, plan_night_task
from tasks.report import plan_stages_task, report_task, written_report


@flow(name="eagle3-pipeline", flow_run_name=s.run_name("pipeline"), on_cancellation=[s.say_cancelled],
      on_crashed=[s.end_cancelled])
def eagle3_pipeline(config: PipelineConfig = s.DEMO, refresh: bool = False, nightly: bool = False,
                    gpus: int = 1) -> dict:
    """Run every stage on `config` (default: the embedded demo preset) and publish the report as artifacts.
    refresh=True recomputes every stage; otherwise finished stages and shards are reused. nightly=True (what the
    nightly schedule passes) makes it a night's work (eagle3_core.pipeline.nightly): every prompt of the sources, only
    the new ones regenerated and extracted, a warm start from last night's draft, promoted/ updated only if tau is not
    worse, and the report's table of nights. Holds the run directory's lock throughout (a second run of the same
    directory is refused, naming this one). The run is named '<run>-pipeline' and its stage subflows
    '<run>-<stage>', tagged run:<run> and stage:<stage>; its log holds every stage's summary line.

    Args:
        config: the run's settings (a preset's values); run_dir is the run: every stage writes under it, and the
            run's name and run: tag come from its last folder.
        refresh: recompute every stage, ignoring what is done on disk (off: finished stages and shards are reused).
        nightly: a night's work on this run (what the nightly schedule passes): every prompt of the sources, only
            the new ones regenerated and extracted, a warm start from the current draft, promoted only if tau is
            not worse; off: one run of the config as it is.
        gpus: GPUs of this host for the features stage's whole-target workers (a per-shard backend such as 'hf';
            a torchrun backend uses features.tp_size) and for DDP training; 1: one process each."""
    s.label(config, "pipeline")
    said = [check_task(config)]       # config + target config files only: fails in seconds
    with s.locked(config), s.pipeline_progress(config.run_dir, ALL_STAGES):    # this run's page: stage k of N
        if nightly:
            config, night, night_said = plan_night_task(config)
            said += night_said
        plan_stages_task(config, refresh, said)          # the log's first message: what will run, check, the night
        s.forget(config, refresh, *ALL_STAGES)
        s.prompts_flow(config)
        s.generation_flow(config)
        s.features_flow(config, gpus=gpus)
        s.vocab_flow(config)
        s.train_flow(config, gpus=gpus)
        s.evaluate_flow(config)
        s.deploy_llama_cpp_flow(config)
        s.deploy_sglang_flow(config)
        if nightly:
            finish_night_task(config, night)
        return report_task(config)


def main() -> None:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description="Run the EAGLE-3 pipeline as a Prefect flow run.")
    p.add_argument("--preset", default="demo", help="demo | debug_tiny")
    p.add_argument("--run-dir", default=None, help="output directory (default: runs/<preset>)")
    p.add_argument("--config", default=None, help="JSON file with a PipelineConfig (overrides --preset)")
    p.add_argument("--refresh", action="store_true", help="recompute every stage")
    args = p.parse_args()
    if args.config:
        cfg = load_config(args.config)
    else:
        cfg = preset(args.preset, args.run_dir or f"runs/{args.preset}")
    eagle3_pipeline(cfg, refresh=args.refresh)
    print(written_report(cfg))


if __name__ == "__main__":
    main()
