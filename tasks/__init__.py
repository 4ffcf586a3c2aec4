"""Prefect tasks: thin wrappers around eagle3_core.pipeline, each returning the stage's small manifest."""
