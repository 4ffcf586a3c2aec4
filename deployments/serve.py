"""Serve the pipeline's deployments to a running Prefect server (`make server` in one shell, `make deploy` in
another): the end-to-end flow with a nightly schedule (off until you switch it on in the UI) and one deployment
per stage, all with the demo preset as parameter defaults. `serve` runs flow runs in this process; GPU work pools
and concurrency limits come with the orchestration issue.
"""
from __future__ import annotations

from prefect import serve
from prefect.schedules import Cron

from eagle3_core.config import preset
from flows import stages
from flows.pipeline import eagle3_pipeline

# nightly runs are opt-in: the schedule is created inactive; switch it on in the UI
NIGHTLY = Cron("0 2 * * *", timezone="UTC", active=False)


def main() -> None:
    params = {"config": preset("demo").model_dump(mode="json")}
    deployments = [eagle3_pipeline.to_deployment(name="eagle3-pipeline", parameters=params, schedule=NIGHTLY)]
    for fl in (stages.prompts_flow, stages.generation_flow, stages.features_flow, stages.vocab_flow,
               stages.train_flow, stages.evaluate_flow, stages.deploy_llama_cpp_flow):
        deployments.append(fl.to_deployment(name=fl.name, parameters=params))
    serve(*deployments)


if __name__ == "__main__":
    main()
