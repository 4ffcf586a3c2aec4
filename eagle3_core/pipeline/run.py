"""The one done decision of a stage: its inputs key (and the older keys it accepts) computed once, the manifest that
holds one of them with its outputs intact, or none (the stage runs).

A task of the pipeline asks once (docs/architecture.md, "Data on disk is the source of truth"): the flow decides
whether Prefect's cache may answer (`done`, before the task); the task's cache policy takes that decision for its
key (`adopt`, inside the task run); the stage body takes it from the task run (`decision`) and runs only if it is not
done (`run`). Called outside a task (a script, torchrun ranks, a test), `decision` decides on the spot. The shard
tasks of a sharded stage the same way: the plan decides for every shard at once (`decide_shards`), each shard
task's cache policy adopts its shard's decision and its body takes it (`adopt`, `decision` with the shard).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.manifest import read_manifest, write_manifest
from eagle3_core.contract.run_stage import changed_outputs, record_outputs
from eagle3_core.pipeline.keys import upstream_keys
from eagle3_core.pipeline.stage import Stage, row_of


@dataclass(frozen=True)
class Decision:
    """A stage's done decision for one config: `key` (its inputs key, what a new manifest holds), `accepted` (key
    first, then its older formulas), `manifest` (the manifest on disk if it holds one of them and its outputs are
    intact; None: run the stage), `changed` (the outputs found missing or changed, for the log)."""
    stage: str
    out: Path
    key: str
    accepted: tuple[str, ...]
    manifest: dict | None
    changed: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()


@dataclass(frozen=True)
class ShardDecision:
    """A shard task's done decision: `key` (its stage's inputs key, which the task's cache key names) and `record`
    (the shard's record, or its store entry, when it is finished for the current inputs; None: the shard runs)."""
    stage: str
    shard: int
    key: str
    record: dict | None


# the task-run id of the running Prefect task (installed by the task layer, tasks/cache.py; eagle3_core never imports
# prefect): None outside a task
scope_id: Callable[[], str | None] = lambda: None
_pending: dict[tuple, tuple[str, Decision | ShardDecision]] = {}  # (stage, run_dir, shard) -> (config JSON, the flow's)
_adopted: dict[tuple, tuple[str, Decision | ShardDecision]] = {}  # (stage, run_dir, shard) -> (task run, its decision)
_lock = threading.Lock()
CALLS = {"decide": 0}                                   # done decisions made in this process (tests count them)


def decide(cfg: PipelineConfig, stage: Stage | str) -> Decision:
    """Stage `stage`'s done decision now (its row, or a registered stage's name: stage.row_of): row.key(cfg, up) and
    row.older(cfg, up) with `up` the upstream keys read once from their manifests (keys.upstream_keys), then the
    manifest in its directory if it holds one of them and its outputs (its `files` record, and
    row.intact(cfg)(manifest) where given) are intact. Raises FileNotFoundError naming an upstream stage that has
    not run."""
    row = row_of(stage)
    with _lock:
        CALLS["decide"] += 1
    up = upstream_keys(cfg, row)
    k = row.key(cfg, up)
    accepted = (k, *row.older(cfg, up))
    out = Path(cfg.run_dir) / row.directory
    manifest, changed = read_manifest(out / "manifest.json"), ()
    if manifest is not None and manifest.get("inputs_key") in accepted:
        changed = tuple(changed_outputs(out, manifest, row.intact(cfg) if row.intact else None))
    done = manifest if manifest is not None and manifest.get("inputs_key") in accepted and not changed else None
    return Decision(row.name, out, k, accepted, done, changed, row.outputs)


def decide_shard(cfg: PipelineConfig, stage: Stage | str, shard: int) -> ShardDecision:
    """Shard `shard` of sharded stage `stage`'s done decision now: the stage's key from its upstream keys (read once)
    and the shard's record if it is finished for them (Stage.shards.done)."""
    row = row_of(stage)
    with _lock:
        CALLS["decide"] += 1
    up = upstream_keys(cfg, row)
    return ShardDecision(row.name, shard, row.key(cfg, up), row.shards.done(cfg, shard, up))


def decide_shards(cfg: PipelineConfig, stage: Stage | str) -> dict:
    """The plan of sharded stage `stage`, its done decision for every shard at once: the stage's key from its
    upstream keys (read once), then Stage.shards.status(cfg, up) ({'shards', 'done', 'records': {shard: record},
    ...}); each shard's decision is kept for its task (adopt, decision), unless the status says the stage runs no
    task per shard ('per_shard' False). Returns the status without its records."""
    row = row_of(stage)
    with _lock:
        CALLS["decide"] += 1
    up = upstream_keys(cfg, row)
    key, status = row.key(cfg, up), dict(row.shards.status(cfg, up))
    records, cfg_json = status.pop("records"), cfg.model_dump_json()
    if status.get("per_shard", True):
        with _lock:
            for k in status["shards"]:
                _pending[_slot(cfg, row, k)] = (cfg_json, ShardDecision(row.name, k, key, records.get(k)))
    return status


def _slot(cfg: PipelineConfig, stage: Stage | str, shard: int | None = None) -> tuple:
    return row_of(stage).name, str(Path(cfg.run_dir).resolve()), shard


def _decide(cfg: PipelineConfig, stage: Stage | str, shard: int | None) -> Decision | ShardDecision:
    return decide(cfg, stage) if shard is None else decide_shard(cfg, stage, shard)


def done(cfg: PipelineConfig, stage: Stage | str) -> dict | None:
    """The flow's question before a task of `stage`: its done manifest, or None. The decision is kept for the task
    call that follows (its cache policy adopts it: `adopt`), so that the task decides nothing again."""
    d = decide(cfg, stage)
    with _lock:
        _pending[_slot(cfg, stage)] = (cfg.model_dump_json(), d)
    return d.manifest


def adopt(cfg: PipelineConfig, stage: Stage | str, scope: str, shard: int | None = None) -> Decision | ShardDecision:
    """The cache policy's decision for task run `scope` (of shard `shard`, for a shard task): the flow's (`done`, or
    the plan's: `decide_shards`, for the same config), else one made now; kept for the body of that task run
    (`decision`)."""
    with _lock:
        cfg_json, d = _pending.pop(_slot(cfg, stage, shard), (None, None))
    if d is None or cfg_json != cfg.model_dump_json():
        d = _decide(cfg, stage, shard)
    with _lock:
        _adopted[_slot(cfg, stage, shard)] = (scope, d)        # replaces one a cache hit left (its body never ran)
    return d


def decision(cfg: PipelineConfig, stage: Stage | str, shard: int | None = None) -> Decision | ShardDecision:
    """The body's decision (of shard `shard`, for a shard's body): the one its task run's cache policy adopted,
    else one made now."""
    scope, slot = scope_id(), _slot(cfg, stage, shard)
    with _lock:
        if scope is not None and _adopted.get(slot, (None,))[0] == scope:
            return _adopted.pop(slot)[1]
    return _decide(cfg, stage, shard)


def run(d: Decision, body: Callable[[], dict], outputs: Sequence[str] | None = None,
        write: Callable[[Path, dict], dict] = write_manifest, log=None) -> dict:
    """The stage's manifest for decision `d`: the done manifest as it is (`body` not called), else `body()`'s dict
    plus inputs_key, seconds (the body's wall time unless it says its own) and the `files` record of `outputs`
    (names relative to the stage directory; default: its row's, Stage.outputs), written atomically by `write`
    (manifest.write_manifest; the feature store passes store.write_record, its manifest's one writer). `log` names
    outputs found changed."""
    if d.manifest is not None:
        return d.manifest
    if d.changed and log is not None:
        log(f"{d.out.name}: {list(d.changed)} missing or changed since written; running the stage again")
    t0 = time.monotonic()
    manifest = body()
    outputs = d.outputs if outputs is None else outputs
    files = {"files": record_outputs(d.out, outputs)} if outputs else {}
    return write(d.out / "manifest.json", {"seconds": time.monotonic() - t0, **manifest, "inputs_key": d.key,
                                           **files})


def release(cfg: PipelineConfig, stage: Stage | str) -> None:
    """Drop the decisions kept for the tasks of `stage`, its shards' too (after they returned: one answered from
    Prefect's cache never ran its body, which would have taken it)."""
    name, run_dir, _ = _slot(cfg, stage)
    with _lock:
        for kept in (_pending, _adopted):
            for slot in [slot for slot in kept if slot[:2] == (name, run_dir)]:
                del kept[slot]


def invalidate(cfg: PipelineConfig, stage: Stage | str) -> None:
    """Forget that stage `stage` is done under cfg.run_dir (its manifest and its shards' sidecars, and any decision
    kept for a task), so that its next run recomputes everything. Data files stay until they are overwritten."""
    out = Path(cfg.run_dir) / row_of(stage).directory
    for path in [out / "manifest.json", out / "head.json", *out.glob("shard_*.json")]:
        path.unlink(missing_ok=True)
    release(cfg, stage)
