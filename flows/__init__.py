"""Prefect flows: one per pipeline stage, and the end-to-end flow that chains them."""
