"""EAGLE-3 draft training for SGLang-served targets: data, generation, features, training, evaluation and the pipeline
stages, as plain Python (no orchestrator: Prefect lives in tasks/ and flows/). docs/architecture.md maps the folders
and their layer order."""
