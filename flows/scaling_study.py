"""The scaling-study flow: tau against training-data size on the user's own target (studies/scaling_study.py).

The data stages run (or come back from their manifests) as in the pipeline; then one task per size trains a draft
on a nested subset with the same recipe and measures it offline; the last task fits the trend and publishes the
table, the plot and the Markdown summary as artifacts. A retried flow run re-runs only the sizes that failed.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from prefect import flow

from eagle3_core.config import PipelineConfig, load_config, preset
from flows import stage_flows as s
from tasks.scaling_study import (finish_task, size_task, sizes_task, team_bet_answers_task, team_bet_generations_task,
                                 team_bet_points_task)

DEFAULT_FRACTIONS = [0.125, 0.25, 0.5, 1.0]


@flow(name="scaling-study")
def scaling_study_flow(config: PipelineConfig = s.DEMO, fractions: list[float] = DEFAULT_FRACTIONS,  # noqa: B006
                       extrapolate_to: list[int] | None = None, seed: int = 0) -> dict:
    """Train drafts on nested subsets (fractions of the training samples) with one recipe, measure each offline on
    the same held-out prompts, fit tau against log(samples) and mark predictions beyond the largest size as
    extrapolated. Holds the run directory's lock throughout."""
    with s.locked(config):
        s.prompts_flow(config)
        s.generation_flow(config)
        s.features_flow(config)
        s.vocab_flow(config)
        # one size after another (each uses the whole GPU); a failed size does not stop the others
        states = [size_task(config, n, seed, return_state=True) for n in sizes_task(config, fractions)]
        sizes = [st.result() for st in states]                       # raises the first failed size
        return finish_task(config, sizes, extrapolate_to or [])


@flow(name="team-bet")
def team_bet_flow(config: PipelineConfig, results: str, fractions: list[float] = DEFAULT_FRACTIONS,  # noqa: B006
                  grid: list[str] = ["e6", "e12"], seeds: int = 2, budget_s: float | None = None,  # noqa: B006
                  partial: bool = False) -> dict:
    """The team bet (eagle3_core/studies/team_bet.py): epochs against data and warm start against scratch, each
    point's result in `results` (committed between runs: a point already there is not run again), the regenerated
    answers restored from and kept in results/generations, the points within budget_s, then the answers."""
    with s.locked(config):
        s.prompts_flow(config)
        team_bet_generations_task(config, results, "restore")
        s.generation_flow(config)
        team_bet_generations_task(config, results, "keep")
        s.features_flow(config)
        s.vocab_flow(config)
        run = team_bet_points_task(config, fractions, grid, seeds, results, budget_s, partial)
        return team_bet_answers_task(config, run, results)


def main() -> None:
    p = argparse.ArgumentParser(description="Run the scaling study (tau vs training samples) as a Prefect flow.")
    p.add_argument("--preset", default="demo")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--config", default=None, help="JSON file with a PipelineConfig (overrides --preset)")
    p.add_argument("--fractions", default="0.125,0.25,0.5,1")
    p.add_argument("--extrapolate-to", default="", help="comma-separated sample counts to predict tau at")
    a = p.parse_args()
    cfg = (load_config(a.config) if a.config
           else preset(a.preset, a.run_dir or f"runs/{a.preset}"))
    res = scaling_study_flow(cfg, [float(x) for x in a.fractions.split(",")],
                             [int(x) for x in a.extrapolate_to.split(",") if x])
    print(Path(res["plot"]).with_name("study.md").read_text())


if __name__ == "__main__":
    main()
