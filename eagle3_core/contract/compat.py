"""Runs written before a change, still read: every older record or key formula this code accepts, in one place.

Each rule names what an earlier version wrote and how it is read now, so that a finished run stays done after an
upgrade (docs/architecture.md, "Runs written before a change"). A rule stays while runs it reads may exist; the
stage or module that applies it imports it from here. Rules of a lower layer's files (the records' file stamps:
manifest.file_intact hashes a record without mtime_ns) stay with those files.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import BaseModel
from safetensors import safe_open

from eagle3_core.config import PromptConfig, TrainConfig
from eagle3_core.contract.manifest import sha256_json

# ---- stage keys before they hashed results only (CODE_VERSION 4, until the result-only keys) --------------------
# A stage accepts, besides its key, the key its older formula gives for the same settings (pipeline.table's
# Stage.older): such a run stays done, and the stages below it stay done (they name the key its manifest holds).


def fields_v4(model: BaseModel, fields: tuple[str, ...]) -> dict:
    """`model`'s JSON dump of `fields` (the fields it had when the older key hashed all of them: a field added
    since then is not in an older key)."""
    return model.model_dump(mode="json", include=set(fields))


# every field of these settings was hashed by the stage(s) that read them
EVAL_FIELDS_V4 = ("evaluator", "num_draft_steps", "max_new_tokens", "tie_gap", "tree_topk", "tree_num_draft_tokens",
                  "tree_prompts", "untrained_prompts")                       # evaluate, deploy-llama-cpp
DEPLOY_SGLANG_FIELDS_V4 = ("enabled", "baseline_url", "eagle3_url", "tp_size", "ep_size", "extra_args", "num_steps",
                           "topk", "num_draft_tokens", "concurrency", "max_running_requests", "cuda_graph_max_bs",
                           "max_new_tokens", "per_category", "startup_timeout_s")
PROMPT_FIELDS_V4 = ("sources", "mix", "num_train", "num_eval", "eval_ids", "seed", "max_reject_frac", "overlong",
                    "over_budget")


def prompt_fields_v4(prompts: PromptConfig) -> dict:
    """The prompt settings as the prompts key hashed them: every field, eval_ids only when set."""
    return fields_v4(prompts, tuple(f for f in PROMPT_FIELDS_V4 if f != "eval_ids" or prompts.eval_ids is not None))


# TrainConfig's fields when the train key hashed all of them (device, attention, compile, checkpoint_every,
# keep_checkpoints included); batching, window_context and graph only when set away from their defaults
TRAIN_FIELDS_V4 = ("epochs", "lr", "warmup_frac", "batch_tokens", "grad_accum", "grad_clip", "ttt_length",
                   "step_weight", "eval_frac", "seed", "checkpoint_every", "keep_checkpoints", "device", "attention",
                   "compile", "batching", "graph", "window_context", "init_from", "init_vocab")
_UNSET_WHEN_DEFAULT_V4 = ("batching", "window_context", "graph")


def train_fields_v4(train: TrainConfig) -> dict:
    """The train settings as the train key hashed them before it hashed results only: every field of
    TRAIN_FIELDS_V4, less batching, window_context and graph where they have their defaults (JSON mode). With the
    same upstream keys and draft settings, stage_key over this dict is the key an earlier run's manifest holds."""
    defaults = TrainConfig.model_fields
    dump = train.model_dump(mode="json", include=set(TRAIN_FIELDS_V4))
    return {k: v for k, v in dump.items()
            if not (k in _UNSET_WHEN_DEFAULT_V4 and getattr(train, k) == defaults[k].default)}


def checkpoint_fingerprint_v4(samples: list[dict], train: TrainConfig, global_accum: int, pack: bool) -> str:
    """The `data` fingerprint training checkpoints held before they held a resume key (checkpoint.resume_key):
    sha256 of the samples' ids and lengths, batch tokens, seed, W*G and, for packed rows, the window context."""
    key = [[s["id"], len(s["input_ids"])] for s in samples] + [train.batch_tokens, train.seed, global_accum]
    if pack:
        key += ["packed", train.context_tokens()]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()


# ---- feature store ----------------------------------------------------------------------------------------------

def content_key_before_loss_mask(part: list[dict], aux_layer_ids: list[int], store_format: str,
                                 target_id: str) -> str:
    """The content key of feature shards written before loss masks were part of it (store version 2)."""
    return sha256_json([2, [[r["id"], list(r["input_ids"])] for r in part], aux_layer_ids, store_format, target_id])


def stored_loss_mask_equals(path: Path, part: list[dict]) -> bool:
    """Whether the shard at `path` (one written under content_key_before_loss_mask) stores the loss masks of rows
    `part`: its loss_mask tensor (int8 [sum T], 1 byte per token read, not the features). False if unreadable."""
    try:
        with safe_open(str(path), "pt") as f:
            stored = f.get_tensor("loss_mask").tolist()
    except (OSError, KeyError, RuntimeError):
        return False
    return stored == [int(m) for r in part for m in r["loss_mask"]]


def shard_backend(entry: dict, store: dict) -> str:
    """The extraction backend of a store entry: its own `backend`; entries written before each shard named its
    backend take the store's (the hf_tp stage recorded one for the whole store), else 'hf' (the only backend of
    stores without either)."""
    return entry.get("backend") or store.get("backend") or "hf"


def head_keys(store_key: str, stage_key: str) -> tuple[str, str]:
    """The keys features/head.json may hold for the current store: the store key, or (written before head.json
    named the store key) the features stage's inputs key of the same, not grown, data."""
    return store_key, stage_key
