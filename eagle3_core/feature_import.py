"""`python -m eagle3_core.feature_import CONFIG DIR`: SpecForge's offline features (*.ckpt) imported into a run's
feature store (the features stage with features.import_from = DIR; eagle3_core.features.specforge_import checks and
reads the files). The tokenize stage must have run."""
from __future__ import annotations

import argparse

from eagle3_core.config import config_or_preset
from eagle3_core.contract.layout import RunLayout
from eagle3_core.features.specforge_import import FeatureImportError
from eagle3_core.pipeline.features_stage import run_features


def main(argv: list[str] | None = None) -> int:
    """CLI: import SpecForge feature files into a run's features/ (the tokenize stage must have run)."""
    p = argparse.ArgumentParser(prog="python -m eagle3_core.feature_import",
                                description="Import SpecForge offline features (*.ckpt) into a run's feature store")
    p.add_argument("config", help="JSON file with a PipelineConfig, or a preset name")
    p.add_argument("source", help="the directory SpecForge's prepare_hidden_states.py wrote")
    args = p.parse_args(argv)
    cfg = config_or_preset(args.config)
    cfg.features.import_from = args.source
    try:
        m = run_features(cfg)
    except FeatureImportError as e:
        print(f"import failed, nothing written: {e}")
        return 2
    print(f"imported {m['samples']} samples ({m['tokens']} tokens) into {RunLayout(cfg.run_dir).features}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
