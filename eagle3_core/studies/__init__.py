"""Studies over many drafts of one run: tau against training-data size (scaling_study)."""
