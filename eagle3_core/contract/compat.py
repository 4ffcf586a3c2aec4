"""Runs written before a change, still read: every older record or key formula this code accepts, in one place.

Each rule names what an earlier version wrote and how it is read now, so that a finished run stays done after an
upgrade (docs/architecture.md, "Runs written before a change"). A rule stays while runs it reads may exist; the
stage or module that applies it imports it from here. Rules that need their module's own code stay there (the
records' file stamps: manifest.file_intact hashes a record without mtime_ns). LEGACY_READERS lists every such
reader, here or elsewhere, with the commit since which runs no longer need it and its removal rule.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
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
    since then is not in an older key).
    Remove with the *_FIELDS_V4 tuples when runs written before f66665b are no longer supported: their stages then
    run again (compat.LEGACY_READERS)."""
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
    """The prompt settings as the prompts key hashed them: every field, eval_ids only when set.
    Remove when runs written before f66665b are no longer supported (compat.LEGACY_READERS)."""
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
    same upstream keys and draft settings, stage_key over this dict is the key an earlier run's manifest holds.
    Remove when runs written before f66665b are no longer supported (compat.LEGACY_READERS)."""
    defaults = TrainConfig.model_fields
    dump = train.model_dump(mode="json", include=set(TRAIN_FIELDS_V4))
    return {k: v for k, v in dump.items()
            if not (k in _UNSET_WHEN_DEFAULT_V4 and getattr(train, k) == defaults[k].default)}


def checkpoint_fingerprint_v4(samples: list[dict], train: TrainConfig, global_accum: int, pack: bool) -> str:
    """The `data` fingerprint training checkpoints held before they held a resume key (checkpoint.resume_key):
    sha256 of the samples' ids and lengths, batch tokens, seed, W*G and, for packed rows, the window context.
    Remove when runs written before f66665b are no longer supported: their half-trained runs then refuse to resume
    (compat.LEGACY_READERS)."""
    key = [[s["id"], len(s["input_ids"])] for s in samples] + [train.batch_tokens, train.seed, global_accum]
    if pack:
        key += ["packed", train.context_tokens()]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()


# ---- feature store ----------------------------------------------------------------------------------------------

def content_key_before_loss_mask(part: list[dict], aux_layer_ids: list[int], store_format: str,
                                 target_id: str) -> str:
    """The content key of feature shards written before loss masks were part of it (store version 2).
    Remove when runs written before bc5e252 are no longer supported: their shards are then extracted again
    (compat.LEGACY_READERS)."""
    return sha256_json([2, [[r["id"], list(r["input_ids"])] for r in part], aux_layer_ids, store_format, target_id])


def stored_loss_mask_equals(path: Path, part: list[dict]) -> bool:
    """Whether the shard at `path` (one written under content_key_before_loss_mask) stores the loss masks of rows
    `part`: its loss_mask tensor (int8 [sum T], 1 byte per token read, not the features). False if unreadable.
    Remove with content_key_before_loss_mask (runs written before bc5e252) (compat.LEGACY_READERS)."""
    try:
        with safe_open(str(path), "pt") as f:
            stored = f.get_tensor("loss_mask").tolist()
    except (OSError, KeyError, RuntimeError):
        return False
    return stored == [int(m) for r in part for m in r["loss_mask"]]


def shard_backend(entry: dict, store: dict) -> str:
    """The extraction backend of a store entry: its own `backend`; entries written before each shard named its
    backend take the store's (the hf_tp stage recorded one for the whole store), else 'hf' (the only backend of
    stores without either).
    Remove the fallbacks when runs written before f66665b are no longer supported: their stores then count as
    another backend's (compat.LEGACY_READERS)."""
    return entry.get("backend") or store.get("backend") or "hf"


def head_keys(store_key: str, stage_key: str) -> tuple[str, str]:
    """The keys features/head.json may hold for the current store: the store key, or (written before head.json
    named the store key) the features stage's inputs key of the same, not grown, data.
    Remove the stage key when runs written before 1e5d694 are no longer supported: their shards are then extracted
    again (compat.LEGACY_READERS)."""
    return store_key, stage_key


# ---- every reader of older runs, with its removal rule ----------------------------------------------------------

LEGACY_RUN = "tests/data/legacy_run"       # the fixture of a run an earlier main wrote (tests/test_legacy_readers.py)


@dataclass(frozen=True)
class LegacyReader:
    """One rule by which this code reads what an earlier version wrote. readers: the functions that apply it
    ('folder.module.function' under eagle3_core; each one's docstring names LEGACY_READERS and the commit `since`);
    reads: what runs written before `since` hold; since: the commit of main from which runs no longer hold it;
    remove_when: when the rule may go and what breaks for such a run once it is gone; exercised_by: the fixture
    (LEGACY_RUN) or tests that read such a record."""
    name: str
    readers: tuple[str, ...]
    reads: str
    since: str
    remove_when: str
    exercised_by: tuple[str, ...]


_GONE = "remove when runs written before {} are no longer supported: "
LEGACY_READERS = (
    LegacyReader("trainer history without epoch seconds", ("studies.team_bet.epoch_timing",),
                 "training checkpoints whose history has no epoch_seconds / call_first", "44a2f29",
                 _GONE.format("44a2f29") + "a team-bet point resumed from such a checkpoint fails (KeyError) instead "
                 "of recording no steady seconds",
                 ("tests/test_team_bet.py::test_steady_seconds_without_compiles",)),
    LegacyReader("record without mtime_ns", ("contract.manifest.file_intact",),
                 "data-file records (stage manifests, shard records) without mtime_ns", "bc5e252",
                 "nothing to remove: such a record takes the path of a changed mtime (its sha256 compared); only the "
                 "words go once runs written before bc5e252 are no longer supported", (LEGACY_RUN,)),
    LegacyReader("content key before loss masks",
                 ("contract.compat.content_key_before_loss_mask", "contract.compat.stored_loss_mask_equals",
                  "features.store.entry_holds"),
                 "feature shard entries keyed without the rows' loss masks (store version 2)", "bc5e252",
                 _GONE.format("bc5e252") + "their feature shards count as unfinished and are extracted again",
                 (LEGACY_RUN,)),
    LegacyReader("head.json naming the stage key", ("contract.compat.head_keys",),
                 "features/head.json holding the features stage's inputs key, not the store key", "1e5d694",
                 _GONE.format("1e5d694") + "their head.json matches no key, so every feature shard is extracted "
                 "again", (LEGACY_RUN,)),
    LegacyReader("prompts without prompt_sha256", ("generation.regenerate.prompt_digests",),
                 "prompts/train.parquet without its prompt_sha256 column", "1e5d694",
                 _GONE.format("1e5d694") + "the generation stage cannot read their prompt file", (LEGACY_RUN,)),
    LegacyReader("generation records keyed by the whole stage",
                 ("pipeline.generation_stage.generation_plan", "pipeline.generation_stage._record_ok"),
                 "generation shard records holding generation_key (the stage's key), no rows_sha256", "1e5d694",
                 _GONE.format("1e5d694") + "their generation shards are answered again", (LEGACY_RUN,)),
    LegacyReader("stage keys before result-only keys",
                 ("contract.compat.fields_v4", "contract.compat.prompt_fields_v4", "contract.compat.train_fields_v4",
                  "pipeline.prompts_stage.prompts_older_keys", "pipeline.train_stage.train_older_keys",
                  "pipeline.evaluate_stage.evaluate_older_keys", "pipeline.deploy_stage.deploy_llama_cpp_older_keys",
                  "pipeline.deploy_stage.deploy_sglang_older_keys"),
                 "prompts, train, evaluate and deploy manifests whose inputs key hashed every field (CODE_VERSION 4)",
                 "f66665b", _GONE.format("f66665b") + "those stages, and every stage below them, run again",
                 (LEGACY_RUN, "tests/test_keys.py::test_stages_whose_key_formula_changed_accept_the_older_key_of_the_"
                              "same_settings")),
    LegacyReader("shard entries without their backend", ("contract.compat.shard_backend",),
                 "feature store entries without `backend`", "f66665b",
                 _GONE.format("f66665b") + "their entries name no backend, so a rerun that adds shards to such a "
                 "store refuses it as another backend's (features.mix_backends)", (LEGACY_RUN,)),
    LegacyReader("checkpoints without a resume key",
                 ("contract.compat.checkpoint_fingerprint_v4", "training.checkpoint.check_resume"),
                 "training checkpoints holding the `data` fingerprint, no resume key", "f66665b",
                 _GONE.format("f66665b") + "a half-trained run of theirs is refused on resume (ValueError) and "
                 "trains from scratch once its draft/ is deleted",
                 ("tests/test_trainer.py::test_a_checkpoint_written_before_resume_keys_resumes_by_its_fingerprint",)),
    LegacyReader("train key with 'auto' batching resolved",
                 ("pipeline.train_stage.resolved_train_fields", "pipeline.train_stage.train_older_keys"),
                 "train manifests and checkpoints keyed with train.batching 'auto' as the host resolved it",
                 "7a36c3e", _GONE.format("7a36c3e") + "such a train stage with 'auto' batching trains again",
                 ("tests/test_keys.py::test_the_train_key_hashes_the_batching_asked_for_not_the_host",)),
    LegacyReader("prompts manifests without digests",
                 ("data.held_out.digests_from_files", "data.held_out.reconcile", "data.prompt_set.earlier_prompts"),
                 "prompts/manifest.json without eval_digests / train_digests", "735a5a6",
                 _GONE.format("735a5a6") + "growing such a run finds its earlier held-out and trained prompts by id "
                 "alone (a row whose id changed is lost), or fails once reconcile's missing-digests case goes",
                 (LEGACY_RUN,)),
    LegacyReader("tokenized rows without source", ("features.on_policy.sources_of",),
                 "tokenized/train.parquet without its `source` column", "0722f12",
                 _GONE.format("0722f12") + "the on-policy fraction per source (features stage, report) fails on "
                 "their rows (no source)", (LEGACY_RUN,)),
    LegacyReader("prompts manifests without kept_routes", ("pipeline.prompts_stage.routes_stale",),
                 "prompts/manifest.json without kept_routes", "d264da2",
                 _GONE.format("d264da2") + "their prompts stage with kept 'auto' sources of mode 'keep' is not run "
                 "again to probe those sources", (LEGACY_RUN,)),
    LegacyReader("scaling points without per_prompt", ("studies.scaling_study.train_and_measure",),
                 "scaling/n_*/manifest.json without per_prompt", "3fd89c7",
                 _GONE.format("3fd89c7") + "such a cached point is returned without per_prompt and the paired "
                 "comparison fails on it (KeyError)", ()),
    LegacyReader("checkpoints holding the frozen embedding", ("training.checkpoint.load_trained_state",),
                 "training checkpoints whose model holds embed_tokens.weight where it is the target's (frozen)",
                 "42aa5c7", "nothing to remove: load_state_dict loads the embedding such a checkpoint holds, the one "
                 "the run rebuilt from its feature store; only the words go once runs written before 42aa5c7 are no "
                 "longer supported",
                 ("tests/test_checkpoint.py::"
                  "test_training_checkpoints_leave_out_the_frozen_target_embedding_and_load_older_ones",)),
)
