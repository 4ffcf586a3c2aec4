"""Stage `features`: the target's aux hidden states at the aux layer ids for every tokenized sample, sharded
safetensors (features/shard_NNNNN.safetensors, the store manifest, head.json), by the backend features.backend
names (features.backends: its granularity, who loads the target).

One stage, two ways to run it: `run_features` (every shard in one call: in this process, under a torchrun of the
backend's ranks, or with `workers` whole-target workers) and, for per-shard backends, the flow's shard tasks
(`run_features_shard` for each shard, then `finish_features`). Every path goes through pipeline.run (the done
check: key and intact shards) and writes features/manifest.json only through the store's one writer
(store.write_record, which writes head.json on every path)."""
from __future__ import annotations

import time
from pathlib import Path

import pyarrow.parquet as pq

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.compat import head_keys, shard_backend
from eagle3_core.contract.layout import RunLayout
from eagle3_core.contract.manifest import read_manifest
from eagle3_core.contract.shard_plan import plan_ranges
from eagle3_core.features.backends import backend_name, close_extractors, selected_backend
from eagle3_core.features.on_policy import check_on_policy, on_policy_by_source, on_policy_line, sources_of
from eagle3_core.features.specforge_import import feature_files
from eagle3_core.features.store import bad_shards, entry_holds, refuse_mixed_backends, write_record
from eagle3_core.features.store_run import extract_here, launch
from eagle3_core.pipeline import run as stage_run
from eagle3_core.pipeline.keys import stage_key, target_key, upstream_keys, upstream_manifest
from eagle3_core.pipeline.stage import Shards, Stage

# the feature settings that change what the store holds
FEATURE_RESULT_FIELDS = ("aux_layer_ids", "max_length", "shard_samples", "format")
# the ones that change how the same forwards are batched, computed and written, not what is stored (import_from
# counts through import_key, what the imported files are)
FEATURE_HOW_FIELDS = ("batch_tokens", "writer_threads", "backend", "tp_size", "expert_parallel", "shard_attention",
                      "mix_backends", "import_from", "mem_fraction_static")


def on_policy_gate(cfg: PipelineConfig, rows: list[dict], files: list[str], log=print) -> None:
    """The early gate on the first shard (features.on_policy.check_on_policy): logs each source's on-policy
    fraction and raises ValueError below features.min_on_policy. Nothing for a store without argmaxes."""
    if cfg.features.format == "online":
        return
    t = cfg.generation.temperature                  # sampled regeneration: the log-probability gate, not argmax
    per = on_policy_by_source(RunLayout(cfg.run_dir).features, sources_of(rows), files, t if t > 0 else None)
    log(f"features: on-policy on the first shard: {on_policy_line(per)}")
    check_on_policy(per, cfg.features.min_on_policy, "the first shard")


def features_key(cfg: PipelineConfig, up: dict | None = None) -> str:
    """Inputs key of the features stage: the tokenized data (`up`: {'tokenize': its key}; default: read from its
    manifest), the feature settings that change the stored result (FEATURE_RESULT_FIELDS), the target, and an
    import's files (import_key)."""
    up = upstream_keys(cfg, ROW) if up is None else up
    return stage_key(up["tokenize"], cfg.features.model_dump(mode="json", include=set(FEATURE_RESULT_FIELDS)),
                     target_key(cfg), *([import_key(cfg)] if cfg.features.import_from else []))


def import_key(cfg: PipelineConfig) -> dict:
    """What identifies an import (features.import_from) in a key: the directory and each file's name, size and
    mtime (a stat per file, no read)."""
    src = Path(cfg.features.import_from)
    return {"import_from": str(src), "files": [[str(p.relative_to(src)), p.stat().st_size, p.stat().st_mtime_ns]
                                               for p in feature_files(src)]}


def store_key(cfg: PipelineConfig) -> str:
    """Key of the feature store apart from its samples (the settings that change what a shard holds, the target):
    features/head.json names it, and each shard's content key names its samples, so that a grown run keeps every
    finished shard."""
    return stage_key("store", cfg.features.model_dump(mode="json", include=set(FEATURE_RESULT_FIELDS) -
                                                      {"shard_samples"}), target_key(cfg))


def tokenized_rows(cfg: PipelineConfig) -> list[dict]:
    return pq.read_table(RunLayout(cfg.run_dir).tokenized_train).to_pylist()


def feature_shards(cfg: PipelineConfig) -> list[int]:
    """Shard ids of the features stage: shard i holds the tokenized samples of shard_plan.plan_ranges (the plan of
    features.store.extract_features: features.shard_samples each, a finished earlier shard keeping its own)."""
    upstream_manifest(cfg.run_dir, "tokenize")
    store = read_manifest(RunLayout(cfg.run_dir).manifest("features")) or {}
    ids = pq.read_table(RunLayout(cfg.run_dir).tokenized_train, columns=["id"])["id"].to_pylist()
    return list(range(len(plan_ranges(ids, cfg.features.shard_samples, store.get("shards", [])))))


def store_intact(cfg: PipelineConfig):
    """The features stage's intact check (run.decide): the shards its manifest lists (store.bad_shards)."""
    out = RunLayout(cfg.run_dir).features
    return lambda manifest: bad_shards(out, manifest["shards"])


def _finished_entries(cfg: PipelineConfig, keys: tuple[str, str], rows: list[dict] | None = None,
                      only: int | None = None) -> tuple[int, dict[int, dict]]:
    """(number of shards in the plan, {shard: its store manifest entry} for every shard (or shard `only`) complete
    on disk for the current inputs: head.json names the store key (compat.head_keys: or, written before it did, the
    stage key: keys = (store key, stage key)) and the store's target, the entry holds the content key of its
    samples, loss masks, layers, format and target (store.entry_holds), and the file is intact (size and mtime as
    recorded, no read)). No target loaded; one read of the tokenized rows and the manifests."""
    layout = RunLayout(cfg.run_dir)
    out, rows = layout.features, rows if rows is not None else tokenized_rows(cfg)
    head, store = read_manifest(layout.features_head), read_manifest(layout.manifest("features"))
    ranges = plan_ranges([r["id"] for r in rows], cfg.features.shard_samples, (store or {}).get("shards", []))
    if (head is None or store is None or head.get("inputs_key") not in head_keys(*keys)
            or head.get("target_id") != store.get("target_id")):
        return len(ranges), {}
    by_file, done = {e["file"]: e for e in store.get("shards", [])}, {}
    for k, (a, b) in enumerate(ranges):
        entry = by_file.get(f"shard_{k:05d}.safetensors")
        if (only is None or k == only) and entry is not None and \
                entry_holds(out, entry, rows[a:b], store["aux_layer_ids"], store["format"], store["target_id"]):
            done[k] = entry
    bad = set(bad_shards(out, list(done.values())))
    return len(ranges), {k: e for k, e in done.items() if e["file"] not in bad}


def mixed_backend_problems(cfg: PipelineConfig) -> list[tuple[str, str]]:
    """[('features.backend', message)] when this run's backend would add shards to a store whose shards kept for
    the current inputs (_finished_entries) another backend wrote, and features.mix_backends is false: the refusal
    extract_features makes (store.refuse_mixed_backends), made before any rank or target loads. No target loaded;
    the tokenized rows are read only where the store holds another backend's shards. Empty otherwise (also with
    no store or nothing left to extract)."""
    layout, backend = RunLayout(cfg.run_dir), backend_name(cfg)
    store = read_manifest(layout.manifest("features"))
    if cfg.features.mix_backends or not store or not layout.tokenized_train.exists() or \
            all(shard_backend(e, store) == backend for e in store.get("shards", [])):
        return []
    try:
        n, done = _finished_entries(cfg, (store_key(cfg), features_key(cfg)))
    except (OSError, ValueError):                  # no tokenize manifest yet: nothing of this store is kept
        return []
    if len(done) == n:                             # nothing left to extract: the store is finished as it is
        return []
    try:
        refuse_mixed_backends(list(done.values()), store, backend, False, layout.features)
    except ValueError as e:
        return [("features.backend", str(e))]
    return []


def refuse_mixed_store(cfg: PipelineConfig) -> None:
    """Raise ValueError (mixed_backend_problems' message) before a features run loads anything."""
    if problems := mixed_backend_problems(cfg):
        raise ValueError(problems[0][1])


def feature_records(cfg: PipelineConfig, up: dict | None = None) -> dict:
    """{shards, done, per_shard, records} of the features stage from one read of the tokenized rows and the store's
    records (no target loaded), given the upstream keys `up` (default: read): shard ids, those complete on disk for
    the current inputs, whether the backend runs one task per shard (features.backends: False, one torchrun for
    all) and {complete shard: its store entry}."""
    n, done = _finished_entries(cfg, (store_key(cfg), features_key(cfg, up)))
    return {"shards": list(range(n)), "done": sorted(done), "per_shard": not selected_backend(cfg).torchrun,
            "records": done}


def feature_status(cfg: PipelineConfig) -> dict:
    """{shards, done, per_shard} of the features stage (feature_records without the records)."""
    return {k: v for k, v in feature_records(cfg).items() if k != "records"}


def feature_shard_entry(cfg: PipelineConfig, shard: int, up: dict | None = None) -> dict | None:
    """Feature shard `shard`'s store entry if it is complete on disk for the current inputs (content key matches,
    file intact: manifest.file_intact), given the upstream keys `up` (default: read); read without loading the
    target."""
    return _finished_entries(cfg, (store_key(cfg), features_key(cfg, up)), only=shard)[1].get(shard)


def feature_shard_done(cfg: PipelineConfig, shard: int) -> bool:
    """True if feature shard `shard` is complete on disk for the current inputs (feature_shard_entry)."""
    return feature_shard_entry(cfg, shard) is not None


def run_features(cfg: PipelineConfig, log=print, workers: int | None = None, **rdzv) -> dict:
    """The features stage, every shard in one call; returns its manifest (features/manifest.json: the store's
    record with the inputs key). Per-shard backends extract in this process (the flow runs one task per shard
    instead: run_features_shard, finish_features), or with `workers` worker processes per node under torchrun
    (one per GPU, each loading the whole target); torchrun backends run one torchrun of features.tp_size ranks
    (the row's launcher with its python, e.g. 'sglang' in the environment of cfg.sglang_python: store_run.launch).
    `rdzv`: nnodes, node_rank, rdzv_endpoint when the ranks span hosts (node 0's call returns the manifest). Done
    already (key, and every listed shard intact): the manifest, nothing run; a shard missing or changed since
    written is extracted again alone. Raises TorchrunError if a rank fails (finished
    shards are kept: rerun to finish), ValueError for an unknown backend or a store mixing backends."""
    backend = selected_backend(cfg)
    d, skey = stage_run.decision(cfg, ROW), store_key(cfg)

    def body() -> dict:
        refuse_mixed_store(cfg)                    # before any rank (or this process) loads the target
        if backend.torchrun or workers:
            manifest = launch(cfg, skey, workers, log, **rdzv)
        else:
            try:
                manifest = {**extract_here(cfg, skey, log), "how": "in this process"}
            finally:
                close_extractors()
            on_policy_gate(cfg, tokenized_rows(cfg), [manifest["shards"][0]["file"]], log)
        log(f"features: {manifest['samples']} samples, {manifest['tokens']} tokens, aux layers "
            f"{manifest['aux_layer_ids']}, backend {backend.name}, {manifest.pop('how')}, format "
            f"{manifest['format']}, {manifest['bytes_per_token']:.0f} bytes/token")
        return {**manifest, "backend": backend.name}

    return stage_run.run(d, body, write=write_record, log=log)


def run_features_shard(cfg: PipelineConfig, shard: int, log=print) -> dict:
    """Aux hidden states of one shard of tokenized samples (features/shard_{shard:05d}.safetensors, listed in
    features/manifest.json with its sha256, content key and backend) via features.store.extract_features(only_shards=
    {shard}), for a per-shard backend. Idempotent: a shard complete for the same inputs and samples is not
    recomputed, and the target is loaded (once per process: open_extractor) only when one is not. Shards must run
    one after another (each rewrites the store manifest). Returns the shard's manifest entry {shard, file, sha256,
    bytes, samples, tokens, ids, content_key, backend, extracted, inputs_key, seconds}. Raises ValueError for a
    shard id out of range, or for a torchrun backend (its ranks extract all shards in one torchrun:
    run_features)."""
    if selected_backend(cfg).torchrun:
        raise ValueError(f"features.backend {cfg.features.backend!r} extracts all shards in one torchrun "
                         f"(run_features / tasks.distributed.features_tp_task), not one shard per task")
    want = feature_shards(cfg)
    if shard not in want:
        raise ValueError(f"feature shard {shard} is out of range: {cfg.run_dir}/tokenized has {len(want)} shards "
                         f"of {cfg.features.shard_samples} samples")
    d, t0 = stage_run.decision(cfg, ROW, shard), time.monotonic()          # the shard task's one done decision
    key, entry = d.key, d.record
    extracted = entry is None
    if extracted:
        refuse_mixed_store(cfg)                    # before the target loads
        rows = tokenized_rows(cfg)
        store = extract_here(cfg, store_key(cfg), log, {shard}, rows)
        entry = next(e for e in store["shards"] if e["file"] == f"shard_{shard:05d}.safetensors")
        log(f"features: shard {shard}: {entry['samples']} samples, {entry['tokens']} tokens in "
            f"{time.monotonic() - t0:.1f} s")
        if shard == 0:
            on_policy_gate(cfg, rows, [entry["file"]], log)
    return {**entry, "shard": shard, "inputs_key": key, "extracted": extracted, "seconds": time.monotonic() - t0}


def finish_features(cfg: PipelineConfig, shard_manifests: list[dict], log=print) -> dict:
    """The features stage's manifest once every shard of feature_shards has a manifest for the current inputs (any
    order) and is intact on disk (the store's record plus inputs_key, shards_extracted, the shard tasks' seconds and
    tokens_per_s); frees the target loaded for the shards. A stage already done for these inputs is returned as it
    is on disk. Raises ValueError naming the shards that are missing, stale or corrupt (rerun them with
    run_features_shard)."""
    close_extractors()
    d, skey, out = stage_run.decision(cfg, ROW), store_key(cfg), \
        RunLayout(cfg.run_dir).features
    key = d.key

    def body() -> dict:
        want = feature_shards(cfg)
        by_id = {m["shard"]: m for m in shard_manifests if m.get("inputs_key") == key}
        # data on disk is the source of truth: each shard must be listed and intact for the current inputs
        finished = _finished_entries(cfg, (skey, key))[1]
        if (missing := [i for i in want if i not in by_id or i not in finished]):
            raise ValueError(f"feature shards {missing} of {out} are missing, stale or corrupt: run them "
                             f"(run_features_shard) before finish_features")
        store = read_manifest(out / "manifest.json")
        if not store.get("complete"):
            raise ValueError(f"{out}/manifest.json does not list every shard: run the missing ones "
                             f"(run_features_shard)")
        ran = [by_id[i] for i in want if by_id[i].get("extracted")]
        ran_s = sum(m["seconds"] for m in ran)
        log(f"features: {store['samples']} samples, {store['tokens']} tokens, aux layers {store['aux_layer_ids']}, "
            f"backend {selected_backend(cfg).name}, format {store['format']}, {store['bytes_per_token']:.0f} "
            f"bytes/token")
        return {**store, "backend": selected_backend(cfg).name, "shards_extracted": len(ran),
                "seconds": sum(by_id[i]["seconds"] for i in want),
                "tokens_per_s": sum(m["tokens"] for m in ran) / ran_s if ran and ran_s > 0 else None}

    return stage_run.run(d, body, write=write_record, log=log)


ROW = Stage("features", features_key, run_features, upstream=("tokenize",), intact=store_intact,
            shards=Shards(run_features_shard, finish_features, feature_records, feature_shard_entry, "features-shard",
                          "finish-features", tags=("gpu",), timeout_h=12),
            summary=("samples", "tokens", "format", "bytes_per_token", "shards_extracted"), timeout_h=1)
