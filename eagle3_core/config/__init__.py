"""Run configuration as pydantic models (flow parameters and UI forms), one module per stage, composed by
PipelineConfig (pipeline_config.py) with its named presets. Unknown fields are refused (strict.py). This package is
the lowest layer: it imports nothing else of eagle3_core. Its names are re-exported here, so that a config is written
`from eagle3_core.config import PipelineConfig, TrainConfig`."""
from eagle3_core.config.eval_config import EvalConfig, SGLangDeployConfig, check_tree_params
from eagle3_core.config.feature_config import FeatureConfig
from eagle3_core.config.generation_config import GenerationConfig, ServerConfig
from eagle3_core.config.mix import DataMix, SourceSpec
from eagle3_core.config.pipeline_config import ConfigFileError, PipelineConfig, config_or_preset, load_config, preset
from eagle3_core.config.prompt_config import PromptConfig
from eagle3_core.config.target_config import EMBEDDED, TargetConfig, default_aux_layer_ids
from eagle3_core.config.train_config import (
    RECIPE_EPOCH_TOKENS,
    RECIPE_EPOCHS,
    RECIPE_MAX_EPOCHS,
    DraftConfig,
    TrainConfig,
)

__all__ = ["EMBEDDED", "RECIPE_EPOCHS", "RECIPE_EPOCH_TOKENS", "RECIPE_MAX_EPOCHS", "ConfigFileError", "DataMix",
           "DraftConfig", "EvalConfig", "FeatureConfig", "GenerationConfig", "PipelineConfig", "PromptConfig",
           "SGLangDeployConfig", "ServerConfig", "SourceSpec", "TargetConfig", "TrainConfig", "check_tree_params",
           "config_or_preset", "default_aux_layer_ids", "load_config", "preset"]
