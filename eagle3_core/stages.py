"""The public stage API in one namespace (tasks/, flows/, tests/ and benchmarks/ call `stages.run_prompts`,
`stages.STAGE_DIRS`, ...). The code lives in eagle3_core/pipeline/: keys, layout, the stage table, one module per
stage.

Run layout: prompts/ generations/ tokenized/ features/ vocab/ draft/ eval/ deploy_llama_cpp/ deploy_sglang/, each
with manifest.json.
"""
from __future__ import annotations

from .pipeline.deploy import (
    deploy_llama_cpp_key,
    deploy_sglang_key,
    deploy_sglang_skip,
    run_deploy_llama_cpp,
    run_deploy_sglang,
)
from .pipeline.evaluate import category, evaluate_key, run_evaluate
from .pipeline.features import (
    FEATURE_RESULT_FIELDS,
    feature_shard_done,
    feature_shards,
    feature_status,
    features_key,
    finish_features,
    loaded_target,
    mark_store,
    run_features,
    run_features_shard,
    tokenized_rows,
)
from .pipeline.generation import (
    finish_generation,
    generation_key,
    generation_servers,
    generation_plan,
    generation_shard_done,
    generation_shard_key,
    generation_shard_needs_server,
    generation_shards,
    generation_status,
    generation_stage_key,
    run_generation,
    run_generation_shard,
)
from .pipeline.keys import CODE_VERSION, aux_ids, stage_key, target_config, target_key, upstream_manifest
from .pipeline.layout import RunLayout
from .pipeline.prompts import prompts_key, run_prompts
from .pipeline.run_stage import run_stage
from .pipeline.table import STAGE_DIRS, STAGES, Stage, inputs_key, invalidate_stage, stage_done
from .pipeline.tokenize import run_tokenize, tokenize_key
from .pipeline.train import claim_training_dir, draft_shape, fresh_draft, run_train, train_key, train_split
from .pipeline.vocab import run_vocab, vocab_key

__all__ = [
    "CODE_VERSION", "FEATURE_RESULT_FIELDS", "STAGES", "STAGE_DIRS", "RunLayout", "Stage", "aux_ids", "category",
    "claim_training_dir", "deploy_llama_cpp_key", "deploy_sglang_key", "deploy_sglang_skip", "draft_shape",
    "evaluate_key", "feature_shard_done", "feature_shards", "feature_status", "features_key", "finish_features", "finish_generation",
    "fresh_draft", "generation_key", "generation_plan", "generation_servers", "generation_shard_done",
    "generation_shard_key", "generation_shard_needs_server", "generation_shards", "generation_status", "generation_stage_key", "inputs_key", "invalidate_stage", "loaded_target", "mark_store",
    "prompts_key", "run_deploy_llama_cpp", "run_deploy_sglang", "run_evaluate", "run_features",
    "run_features_shard", "run_generation", "run_generation_shard", "run_prompts", "run_stage", "run_tokenize",
    "run_train", "run_vocab", "stage_done", "stage_key", "target_config", "target_key", "tokenize_key",
    "tokenized_rows", "train_key", "train_split", "upstream_manifest", "vocab_key",
]
