"""Tasks of the scaling-study flows (flows/scaling_study.py): the sizes to train, one draft per size, the fit; the
team bet's generations kept and restored, its points within a budget, its answers."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import torch

from prefect import get_run_logger, task
from prefect.artifacts import create_image_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.layout import RunLayout
from eagle3_core.plan import markdown, plan_run
from eagle3_core.studies import scaling_study as study
from eagle3_core.studies import team_bet, team_bet_plots, team_bet_run
from tasks.artifacts import run_key
from tasks.logs import run_log
from tasks.retry import RETRY_OPTIONS, retry_if_transient


@task(name="scaling-sizes", cache_policy=NO_CACHE)
def sizes_task(config: PipelineConfig, fractions: list[float]) -> list[int]:
    """The training-set sizes of the study: `fractions` of the run's training samples (scaling_study.study_sizes)."""
    sizes = study.study_sizes(config, fractions)
    get_run_logger().info("scaling study: sizes %s", sizes)
    return sizes


# the size's manifest on disk (keyed by its inputs) is the cache: an equal rerun returns it at once
@task(name="scaling-size", task_run_name="scaling-size-{n}", cache_policy=NO_CACHE, tags=["gpu"],
      retry_condition_fn=retry_if_transient, **RETRY_OPTIONS)
def size_task(config: PipelineConfig, n: int, seed: int) -> dict:
    """Train on `n` samples and measure tau (scaling_study.train_and_measure)."""
    with run_log() as log:
        return study.train_and_measure(config, n, seed, log=log.info)


@task(name="scaling-finish", cache_policy=NO_CACHE)
def finish_task(config: PipelineConfig, sizes: list[dict], extrapolate_to: list[int]) -> dict:
    """Fit the trend, write the plot and publish table, image and Markdown artifacts."""
    res = study.finish_study(config, sizes, extrapolate_to)
    create_table_artifact([{"samples": z["samples"], "tokens": z["tokens"], "tau": round(z["tau"], 3),
                            "tau_ci95": f"{z['tau_ci95'][0]:.2f}-{z['tau_ci95'][1]:.2f}",
                            "tau_sim": round(z["tau_sim"], 3), "acc_0": round(z["acc_k"][0], 3)}
                           for z in res["sizes"]], key=run_key(config.run_dir, "scaling-study"),
                          description="tau per training-set size")
    url = "data:image/png;base64," + base64.b64encode(Path(res["plot"]).read_bytes()).decode()
    create_image_artifact(url, key=run_key(config.run_dir, "scaling-study-plot"),
                          description="tau and acc_k against training samples")
    create_markdown_artifact(res["markdown"], key=run_key(config.run_dir, "scaling-study-summary"),
                             description="scaling study")
    return {k: v for k, v in res.items() if k != "markdown"}


@task(name="team-bet-generations", cache_policy=NO_CACHE)
def team_bet_generations_task(config: PipelineConfig, results: str, direction: str) -> list[str]:
    """'restore': RESULTS/generations' shards into the run (the generation stage then sends nothing); 'keep': the
    run's shards into RESULTS/generations. Returns the files copied."""
    run, kept = RunLayout(config.run_dir).generations, Path(results) / "generations"
    files = team_bet_run.copy_new(kept, run) if direction == "restore" else team_bet_run.copy_new(run, kept)
    get_run_logger().info("team bet: %s %d generation file(s)", direction, len(files))
    return files


@task(name="team-bet-points", cache_policy=NO_CACHE, tags=["gpu"])
def team_bet_points_task(config: PipelineConfig, fractions: list[float], grid: list[str], seeds: int, results: str,
                         budget_s: float | None, partial: bool) -> dict:
    """The points not yet in RESULTS, in the order of their value, within the budget (team_bet.run_points), each
    measured by the replay evaluator; the run's train split sets the sizes."""
    from eagle3_core.features.reader import load_samples
    n = len(load_samples(RunLayout(config.run_dir).features, verify=False))
    points = team_bet.study_points(n - int(n * config.train.eval_frac), fractions, grid, seeds)
    with run_log() as log:
        measure = team_bet_run.replay_measurer(config, "cuda" if torch.cuda.is_available() else "cpu", 64,
                                               log=log.info)
        return team_bet.run_points(config, points, Path(results), RunLayout(config.run_dir).team_bet, measure,
                                   budget_s=budget_s, partial=partial, log=log.info)


@task(name="team-bet-answers", cache_policy=NO_CACHE)
def team_bet_answers_task(config: PipelineConfig, run: dict, results: str) -> dict:
    """The answers so far (team_bet_run.answers, plan's cost of 10x data with RESULTS/data.json's rates when a
    benchmark call measured them), as RESULTS/summary.json, a Markdown artifact of every point and the two plots
    (team_bet_plots.plot_all) in RESULTS and as image artifacts."""
    data_file = Path(results) / "data.json"
    data = json.loads(data_file.read_text()) if data_file.exists() else None
    out = {"ran": run["ran"], "left": run["left"], "unfinished": run["unfinished"],
           **team_bet_run.answers(config, run["done"], data, "team-bet flow", plan_run, markdown)}
    (Path(results) / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
    md = ["| point | samples | epochs | GPU s | tau (95% CI) |", "|---|---|---|---|---|"]
    md += [f"| {p['name']} | {p['samples']} | {p['epochs']} | {p['seconds']:.0f} | {p['tau']:.3f} "
           f"({p['tau_ci95'][0]:.2f}-{p['tau_ci95'][1]:.2f}) |" for p in out["points"]]
    create_markdown_artifact("\n".join(md), key=run_key(config.run_dir, "team-bet"), description="team bet points")
    for path in team_bet_plots.plot_all(run["done"], out, Path(results), "team-bet flow"):
        url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
        create_image_artifact(url, key=run_key(config.run_dir, path.stem.replace("_", "-")),
                              description=f"team bet: {path.stem}")
    return out
