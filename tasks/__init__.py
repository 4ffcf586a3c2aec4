"""Prefect tasks: thin wrappers around eagle3_core.stages, each returning the stage's small manifest."""
