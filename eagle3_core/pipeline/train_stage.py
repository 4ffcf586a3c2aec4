"""Stage `train`: the draft trained with TTT on the feature store (1..N ranks), the best epoch exported
(draft/export) and checked by reloading it strictly."""
from __future__ import annotations

from pathlib import Path

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.compat import train_fields_v4
from eagle3_core.contract.layout import RunLayout
from eagle3_core.contract.manifest import read_manifest, write_manifest
from eagle3_core.distributed.data_parallel import DataParallel
from eagle3_core.features.reader import load_samples
from eagle3_core.features.store import bad_shards
from eagle3_core.pipeline import run as stage_run
from eagle3_core.pipeline.keys import init_key, stage_key, target_config, upstream_keys
from eagle3_core.pipeline.stage import Stage
from eagle3_core.target.family import sglang_rule
from eagle3_core.training import trainer  # trainer.train read per call: tests replace it there
from eagle3_core.training.checkpoint import EXPORT_DTYPE, clear_training_state, export_draft, load_draft
from eagle3_core.training.startup import draft_shape, fresh_draft  # noqa: F401 (draft_shape: for callers)


def train_split(cfg: PipelineConfig, dp=None) -> tuple[list, list]:
    """(train, held-out) samples of cfg.run_dir/features: the first int(n * train.eval_frac) are held out. Every
    shard is checked against its record first (features.store.bad_shards: size and mtime, sha256 where they differ), 1/W
    of them on each rank of `dp` (a DataParallel; default one process).
    Raises ValueError on every rank, naming the bad shards this rank found, if any rank found one."""
    dp, store = dp or DataParallel(), RunLayout(cfg.run_dir).features
    shards = (read_manifest(RunLayout(cfg.run_dir).manifest("features")) or {}).get("shards", [])   # none: says so
    bad = bad_shards(store, dp.shard(shards))
    if n_bad := dp.sum_int(len(bad)):
        raise ValueError(f"{n_bad} feature shard(s) corrupt or missing (changed since written), here "
                         f"{[str(store / b) for b in bad]}; rerun the features stage: it extracts exactly those "
                         "shards again")
    samples = load_samples(store, verify=False, keep_dtype=True)       # bf16 stays bf16: batch_feed.to_device widens
    n_eval = int(len(samples) * cfg.train.eval_frac)
    return samples[n_eval:], samples[:n_eval]


def claim_training_dir(out: Path, key: str, accepted: tuple[str, ...] = ()) -> None:
    """Make `out` the training directory of inputs `key`: training state written for other inputs is deleted
    (never resumed from); state of the same inputs (`key`, or an older formula of it: `accepted`) stays, so
    training resumes (each checkpoint's resume key then refuses other batches: checkpoint.check_resume)."""
    out.mkdir(parents=True, exist_ok=True)
    if (out / "inputs_key").exists() and (out / "inputs_key").read_text() not in (key, *accepted):
        clear_training_state(out)
    (out / "inputs_key").write_text(key)


# the train settings that change the trained draft; batching (as asked) and window_context (rows that may be packed)
# count as train_recipe_fields says
TRAIN_RESULT_FIELDS = ("epochs", "lr", "warmup_frac", "batch_tokens", "grad_accum", "grad_clip", "ttt_length",
                       "step_weight", "eval_frac", "seed", "init_from", "init_vocab")
# the ones that change how the same steps are computed or kept, not the draft: out of the key, so that changing
# them resumes a half-trained run (attention and compile give the same results; graph compiles the same step)
TRAIN_HOW_FIELDS = ("checkpoint_every", "keep_checkpoints", "device", "attention", "compile", "graph")


def train_recipe_fields(cfg: PipelineConfig, batching: str | None = None) -> dict:
    """The train settings the train key hashes: TRAIN_RESULT_FIELDS, train.batching as the user asked for it
    ('auto', 'packed' or 'padded', never what this host resolves 'auto' to: a run trained on a GPU node and moved
    to a CPU box keeps its key) and, unless the rows are padded, the window context (TrainConfig.context_tokens;
    padded batches have no windows). `batching` replaces train.batching (the older formula: resolved_train_fields)."""
    t = cfg.train
    batching = batching or t.batching
    return {**t.model_dump(mode="json", include=set(TRAIN_RESULT_FIELDS)), "batching": batching,
            "window_context": t.context_tokens() if batching != "padded" else None, **_plateau_ceilings(t),
            **({"loss": t.loss} if t.loss != "kl" else {})}          # newer than the key: counts when not 'kl'


def resolved_train_fields(cfg: PipelineConfig, batching: str) -> dict:
    """The train settings as the train key hashed them before it hashed the recipe asked for (main up to 24b95b7):
    'auto' batching resolved on the host that keyed the run, `batching` ('packed' on CUDA, 'padded' on a CPU;
    setup.resolved_batching). Equal to train_recipe_fields for an explicit 'packed' or 'padded'.
    Remove when runs written before 7a36c3e are no longer supported: such a run with 'auto' batching then trains
    again (compat.LEGACY_READERS)."""
    resolved = batching if cfg.train.batching == "auto" else cfg.train.batching
    return train_recipe_fields(cfg, resolved)


def _plateau_ceilings(t) -> dict:
    """The plateau rule's ceilings (train.max_epochs, max_train_s) where they change the draft: epochs unset and
    set away from their defaults (at their defaults out of the key, so that keys written before the rule had them
    stay the same)."""
    if t.epochs is not None:
        return {}
    fields = type(t).model_fields
    return {k: getattr(t, k) for k in ("max_epochs", "max_train_s") if getattr(t, k) != fields[k].default}


def train_key(cfg: PipelineConfig, up: dict | None = None) -> str:
    """Inputs key of the training stage: the features and vocab keys (`up`: {'features', 'vocab': their keys};
    default: read from their manifests), the train recipe (train_recipe_fields; any number of GPUs, any host), the
    draft settings, and the warm-start draft's weights (train.init_from)."""
    up = upstream_keys(cfg, ROW) if up is None else up
    return _key(cfg, up, train_recipe_fields(cfg))


def _key(cfg: PipelineConfig, up: dict, train_fields: dict) -> str:
    return stage_key(up["features"], up["vocab"], train_fields, cfg.draft.key_fields(),
                     *([init_key(cfg)] if cfg.train.init_from is not None else []))


def train_older_keys(cfg: PipelineConfig, up: dict | None = None) -> tuple[str, ...]:
    """The keys a finished train stage may hold for the same settings, so that it stays done and its checkpoints
    resume: with 'auto' batching, the keys it had when the key hashed 'auto' as resolved on the host that trained
    (packed rows on CUDA, padded on a CPU: resolved_train_fields), and the key from before the keys hashed results
    only (compat.train_fields_v4: every train field hashed).
    Remove the resolved keys when runs written before 7a36c3e are no longer supported, the compat one when those
    before f66665b are not: such a train stage then trains again (compat.LEGACY_READERS)."""
    if cfg.train.loss != "kl":                                          # older runs all trained with 'kl'
        return ()
    up = upstream_keys(cfg, ROW) if up is None else up
    resolved = [_key(cfg, up, resolved_train_fields(cfg, b)) for b in ("packed", "padded")
                if cfg.train.batching == "auto"]
    return (*resolved, _key(cfg, up, train_fields_v4(cfg.train)))


def run_train(cfg: PipelineConfig, log=print, on_epoch=None) -> dict:
    """Train the draft with TTT (draft/), then export the best epoch as an SGLang-loadable directory
    (draft/export), validated by reloading it strictly and comparing logits exactly. The same on every rank of an
    initialised process group (torchrun: distributed/train_ddp.py): each rank trains its share (trainer.train),
    rank 0 alone exports and writes the manifest (its `world_size` says how many ranks trained; its `files` the
    export's, checked by the next run's done check). Logs 'epoch e of E' with an ETA; on_epoch(epochs_done,
    epochs) after each epoch (rank 0)."""
    dp = DataParallel.from_process_group()
    out = RunLayout(cfg.run_dir).draft
    d = stage_run.decision(cfg, ROW)
    key, older = d.key, d.accepted[1:]

    def body() -> dict:
        train_s, eval_s = train_split(cfg, dp)
        draft, lm_head = fresh_draft(cfg, log)
        if dp.is_main:
            claim_training_dir(out, key, older)
        dp.barrier()                                   # no rank resumes from state of other inputs
        summary = trainer.train(draft, train_s, eval_s, lm_head, cfg.train, out, log=log, on_epoch=on_epoch)
        if not dp.is_main:
            return {}
        export = export_draft(load_draft(out / "best"), out / "export",      # bf16, probed bit for bit
                              sglang_rule=sglang_rule(target_config(cfg)))
        log(f"train: best epoch {summary['best']['epoch']} (tau_sim {summary['best']['tau_sim']:.2f}); "
            f"exported to {export}")
        return {"export_dir": RunLayout(cfg.run_dir).relative(export),
                "export_dtype": str(EXPORT_DTYPE).removeprefix("torch."),
                "best": summary["best"], "steps": summary["steps"], "history": summary["history"],
                "stopping": summary["stopping"],
                "train_samples": len(train_s), "eval_samples": len(eval_s), "world_size": dp.world}

    manifest = stage_run.run(d, body, log=log,
                             write=write_manifest if dp.is_main else (lambda path, m: m))
    dp.barrier()                                   # the manifest exists when any rank returns
    return manifest if dp.is_main else read_manifest(out / "manifest.json")


EXPORT_FILES = ("export/model.safetensors", "export/config.json")     # the train stage's outputs later stages read


ROW = Stage("train", train_key, run_train, upstream=("features", "vocab"), older=train_older_keys,
            outputs=EXPORT_FILES, summary=("train_samples", "steps", "export_dir"), timeout_h=96, tags=("gpu",),
            progress=("on_epoch", "epochs"))
