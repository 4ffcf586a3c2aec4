"""EAGLE-3 draft training: model, data, features, training, evaluation. Never imports prefect (DESIGN.md)."""
