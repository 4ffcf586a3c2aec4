"""The scaling-study flow: tau against training-data size on the user's own target (eagle3_core/scaling_study.py).

The data stages run (or come back from their manifests) as in the pipeline; then one task per size trains a draft
on a nested subset with the same recipe and measures it offline; the last task fits the trend and publishes the
table, the plot and the Markdown summary as artifacts. A retried flow run re-runs only the sizes that failed.
"""
from __future__ import annotations

import argparse
import base64
from pathlib import Path

from prefect import flow, task
from prefect.artifacts import create_image_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from eagle3_core import scaling_study as study
from eagle3_core.config import PipelineConfig, load_config, preset
from flows import stages as s
from tasks.artifacts import run_key
from tasks.logs import run_log
from tasks.retry import RETRY_OPTIONS, retry_if_transient

DEFAULT_FRACTIONS = [0.125, 0.25, 0.5, 1.0]


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
        states = [size_task(config, n, seed, return_state=True) for n in study.study_sizes(config, fractions)]
        sizes = [st.result() for st in states]                       # raises the first failed size
        return finish_task(config, sizes, extrapolate_to or [])


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
