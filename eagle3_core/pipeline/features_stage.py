"""Stage `features`: the target's aux hidden states at the aux layer ids for every tokenized sample, sharded
safetensors (features/shard_NNNNN.safetensors, the store manifest, head.json), all at once or one shard per call."""
from __future__ import annotations

import time
from functools import lru_cache
from pathlib import Path

import pyarrow.parquet as pq
import torch

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.layout import RunLayout
from eagle3_core.contract.manifest import cached_manifest, read_manifest, write_manifest
from eagle3_core.distributed.launch import run_torchrun
from eagle3_core.pipeline.keys import aux_ids, stage_key, target_config, target_key, upstream_manifest


def run_features(cfg: PipelineConfig, log=print) -> dict:
    """Aux hidden states of the target at the aux layer ids, sharded safetensors (features/), all shards in one
    call (the Prefect flow runs them one task per shard instead: run_features_shard, finish_features). Backend
    'hf_tp' (a target sharded over features.tp_size GPUs): one torchrun for all shards (tp_extract.run_features_tp)."""
    if cfg.features.backend in TORCHRUN_BACKENDS and not cfg.features.import_from:     # an import runs no target
        return run_features_tp(cfg, log)
    from eagle3_core.features.store import bad_shards, extract_features
    from eagle3_core.target.family import num_layers
    from eagle3_core.target.loading import load_target
    out = RunLayout(cfg.run_dir).features
    key = features_key(cfg)
    if (m := cached_manifest(out / "manifest.json", key)):
        if not (bad := bad_shards(out, m["shards"])):            # data on disk is the source of truth
            return m
        log(f"features: shard(s) {bad} missing or changed since written; extracting them again")
    f = cfg.features
    rows = tokenized_rows(cfg)
    if f.import_from:
        model = _imported(cfg, rows, log)
        ids = model.aux_layer_ids
    else:
        model = load_target(cfg.target, "cuda" if torch.cuda.is_available() else "cpu")
        ids = aux_ids(cfg, num_layers(model.config))
    manifest = extract_features(model, rows, out, ids, f.shard_samples, f.batch_tokens,
                                store_format=f.format, log=log, target=cfg.target.model_dump(),
                                writer_threads=f.writer_threads)
    mark_store(cfg, manifest)
    on_policy_gate(cfg, rows, [manifest["shards"][0]["file"]], log)
    log(f"features: {manifest['samples']} samples, {manifest['tokens']} tokens, aux layers {ids}, "
        f"format {f.format}, {manifest['bytes_per_token']:.0f} bytes/token")
    return write_manifest(out / "manifest.json", {**manifest, "inputs_key": key})


# backends whose ranks share one sharded target in one torchrun (tp_extract): 'ep_int4' loads it with
# target.ep_loading (INT4 experts), 'hf_tp' with transformers' plans
TORCHRUN_BACKENDS = ("hf_tp", "ep_int4")

# the feature settings that change what the store holds; batch_tokens (how samples are batched into forwards),
# writer_threads, backend, tp_size and expert_parallel (how the same forwards are computed and written) do not
FEATURE_RESULT_FIELDS = ("aux_layer_ids", "max_length", "shard_samples", "format")


def on_policy_gate(cfg: PipelineConfig, rows: list[dict], files: list[str], log=print) -> None:
    """The early gate on the first shard (features.on_policy.check_on_policy): logs each source's on-policy
    fraction and raises ValueError below features.min_on_policy. Nothing for a store without argmaxes."""
    from eagle3_core.features.on_policy import check_on_policy, on_policy_by_source, on_policy_line, sources_of
    if cfg.features.format == "online":
        return
    per = on_policy_by_source(RunLayout(cfg.run_dir).features, sources_of(rows), files)
    log(f"features: on-policy on the first shard: {on_policy_line(per)}")
    check_on_policy(per, cfg.features.min_on_policy, "the first shard")


def features_key(cfg: PipelineConfig) -> str:
    """Inputs key of the features stage: the tokenized data, the feature settings that change the stored result
    (FEATURE_RESULT_FIELDS) and the target."""
    return stage_key(upstream_manifest(cfg.run_dir, "tokenized")["inputs_key"],
                cfg.features.model_dump(mode="json", include=set(FEATURE_RESULT_FIELDS)), target_key(cfg),
                *([import_key(cfg)] if cfg.features.import_from else []))


def import_key(cfg: PipelineConfig) -> dict:
    """What identifies an import (features.import_from) in a key: the directory and each file's name, size and
    mtime (a stat per file, no read)."""
    from eagle3_core.features.specforge_import import feature_files
    src = Path(cfg.features.import_from)
    return {"import_from": str(src), "files": [[str(p.relative_to(src)), p.stat().st_size, p.stat().st_mtime_ns]
                                               for p in feature_files(src)]}


_imports: dict[tuple, object] = {}


def _imported(cfg: PipelineConfig, rows: list[dict], log=print):
    """The ImportedExtractor of features.import_from for this run's tokenized rows, every file checked once per
    process (the flow's shard tasks share it). It reads the target's config and exactly its embedding and lm_head
    tensors (specforge_import.head_tensors), under every backend; where the target runs in this process (backend
    'hf') the first sample's aux states are checked against the target's own (aux_spot_check)."""
    from eagle3_core.features.specforge_import import aux_spot_check, head_tensors, imported_extractor
    from eagle3_core.target.family import num_layers
    from eagle3_core.target.loading import local_model_dir
    path = RunLayout(cfg.run_dir).tokenized_train
    key = (cfg.features.import_from, str(path), path.stat().st_mtime_ns, cfg.target.model_dump_json(),
           tuple(cfg.features.aux_layer_ids or ()))
    if key not in _imports:
        _imports.clear()
        tcfg = target_config(cfg)
        ids = aux_ids(cfg, num_layers(tcfg))
        embed, lm, names = head_tensors(local_model_dir(cfg.target), cfg.target.revision)
        extractor = imported_extractor(Path(cfg.features.import_from), rows, tcfg, embed, lm, ids, str(path))
        log(f"features: importing {cfg.features.import_from}; read {names} of the target's weights")
        if cfg.features.backend == "hf":
            diff = aux_spot_check(extractor, loaded_target(cfg.target.model_dump_json(), "cpu"), rows[0])
            log(f"features: sample {rows[0]['id']!r}: imported aux states within {diff:.1%} of the target's")
        _imports[key] = extractor
    return _imports[key]


def store_key(cfg: PipelineConfig) -> str:
    """Key of the feature store apart from its samples (the settings that change what a shard holds, the target):
    features/head.json names it, and each shard's content key names its samples, so that a grown run keeps every
    finished shard."""
    return stage_key("store", cfg.features.model_dump(mode="json", include=set(FEATURE_RESULT_FIELDS) -
                                                      {"shard_samples"}), target_key(cfg))


def _ranges(cfg: PipelineConfig, ids: list[str] | None = None) -> list[tuple[int, int]]:
    from eagle3_core.contract.shard_plan import plan_ranges
    store = read_manifest(RunLayout(cfg.run_dir).features / "manifest.json") or {}
    if ids is None:
        ids = pq.read_table(RunLayout(cfg.run_dir).tokenized_train, columns=["id"])["id"].to_pylist()
    return plan_ranges(ids, cfg.features.shard_samples, store.get("shards", []))


def feature_shards(cfg: PipelineConfig) -> list[int]:
    """Shard ids of the features stage: shard i holds the tokenized samples of shard_plan.plan_ranges (the plan of
    features.extract_features: features.shard_samples each, a finished earlier shard keeping its own)."""
    upstream_manifest(cfg.run_dir, "tokenized")
    return list(range(len(_ranges(cfg))))


def tokenized_rows(cfg: PipelineConfig) -> list[dict]:
    return pq.read_table(RunLayout(cfg.run_dir).tokenized_train).to_pylist()


@lru_cache(maxsize=1)
def loaded_target(target_json: str, device: str, dtype: torch.dtype | None = None):
    """The target, loaded once per process for all feature shards (or in-process generation shards, fp32) of a run
    (cleared by finish_features and finish_generation). dtype None: load_target's default."""
    from eagle3_core.config import TargetConfig
    from eagle3_core.target.loading import load_target
    return load_target(TargetConfig.model_validate_json(target_json), device, dtype)


def mark_store(cfg: PipelineConfig, store: dict) -> None:
    """features/head.json: the stage inputs key and the target id (features._write_head) the store in features/
    was last written for, so that feature_shard_done can check a shard without loading the target."""
    write_manifest(RunLayout(cfg.run_dir).features_head,
                   {"inputs_key": store_key(cfg), "target_id": store["target_id"]})


def _finished_entries(cfg: PipelineConfig, rows: list[dict] | None = None,
                      only: int | None = None) -> tuple[int, dict[int, dict]]:
    """(number of shards in the plan, {shard: its store manifest entry} for every shard (or shard `only`) complete
    on disk for the current inputs: listed with the content key of its samples, loss masks, layers, format and
    target (features.entry_holds), and intact (manifest.file_intact: size and mtime as recorded, no read)). One
    read of the tokenized rows and the manifests."""
    from eagle3_core.contract.shard_plan import plan_ranges
    from eagle3_core.features.store import bad_shards, entry_holds
    out = RunLayout(cfg.run_dir).features
    rows = rows if rows is not None else tokenized_rows(cfg)
    head, store = read_manifest(RunLayout(cfg.run_dir).features_head), read_manifest(out / "manifest.json")
    ranges = plan_ranges([r["id"] for r in rows], cfg.features.shard_samples, (store or {}).get("shards", []))
    # head.json of stores written before it named store_key carries the stage key (the same data, not grown)
    if (head is None or store is None or head.get("inputs_key") not in (store_key(cfg), features_key(cfg))
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


def _feature_shard_entry(cfg: PipelineConfig, shard: int, rows: list[dict] | None = None) -> dict | None:
    """The store manifest's entry of feature shard `shard` if it is complete on disk for the current inputs."""
    return _finished_entries(cfg, rows, only=shard)[1].get(shard)


def feature_status(cfg: PipelineConfig) -> dict:
    """{shards, done} of the features stage from one read of the tokenized rows and the store manifest."""
    n, done = _finished_entries(cfg)
    return {"shards": list(range(n)), "done": sorted(done)}


def feature_shard_done(cfg: PipelineConfig, shard: int) -> bool:
    """True if feature shard `shard` is complete on disk for the current inputs (content key matches, file intact:
    manifest.file_intact)."""
    return _feature_shard_entry(cfg, shard) is not None


def run_features_shard(cfg: PipelineConfig, shard: int, log=print) -> dict:
    """Aux hidden states of one shard of tokenized samples (features/shard_{shard:05d}.safetensors, listed in
    features/manifest.json with its sha256 and content key) via features.extract_features(only_shards={shard}).
    Idempotent: a shard complete for the same inputs and samples is not recomputed, and the target is loaded (once
    per process) only when one is not. Shards must run one after another (each rewrites the store manifest).
    Returns the shard's manifest entry {shard, file, sha256, bytes, samples, tokens, ids, content_key, extracted,
    inputs_key, seconds}. Raises ValueError for a shard id out of range, or for features.backend 'hf_tp' (its
    ranks extract all shards in one torchrun: run_features)."""
    from eagle3_core.features.store import extract_features
    if cfg.features.backend != "hf" and not cfg.features.import_from:
        raise ValueError(f"features.backend {cfg.features.backend!r} extracts all shards in one torchrun "
                         f"(run_features / tasks.distributed.features_tp_task), not one shard per task")
    from eagle3_core.target.family import num_layers
    want = feature_shards(cfg)
    if shard not in want:
        raise ValueError(f"feature shard {shard} is out of range: {cfg.run_dir}/tokenized has {len(want)} shards "
                         f"of {cfg.features.shard_samples} samples")
    out, key, t0 = RunLayout(cfg.run_dir).features, features_key(cfg), time.monotonic()
    rows = tokenized_rows(cfg)
    entry = _feature_shard_entry(cfg, shard, rows)
    extracted = entry is None
    if extracted:
        f = cfg.features
        if f.import_from:
            model = _imported(cfg, rows, log)
            ids = model.aux_layer_ids
        else:
            model = loaded_target(cfg.target.model_dump_json(), "cuda" if torch.cuda.is_available() else "cpu")
            ids = aux_ids(cfg, num_layers(model.config))
        store = extract_features(model, rows, out, ids, f.shard_samples,
                                 f.batch_tokens, store_format=f.format, log=log, target=cfg.target.model_dump(),
                                 writer_threads=f.writer_threads, only_shards={shard})
        mark_store(cfg, store)
        entry = next(e for e in store["shards"] if e["file"] == f"shard_{shard:05d}.safetensors")
        log(f"features: shard {shard}: {entry['samples']} samples, {entry['tokens']} tokens in "
            f"{time.monotonic() - t0:.1f} s")
        if shard == 0:
            on_policy_gate(cfg, rows, [entry["file"]], log)
    return {**entry, "shard": shard, "inputs_key": key, "extracted": extracted, "seconds": time.monotonic() - t0}


def finish_features(cfg: PipelineConfig, shard_manifests: list[dict], log=print) -> dict:
    """The features stage's manifest (the store manifest plus inputs_key, as run_features writes it) once every
    shard of feature_shards has a manifest for the current inputs (any order) and is intact on disk; frees the
    target loaded for the shards. A stage already done for these inputs is returned as it is on disk. Raises
    ValueError naming the shards that are missing, stale or corrupt (rerun them with run_features_shard)."""
    from eagle3_core.features.store import bad_shards
    loaded_target.cache_clear()
    _imports.clear()
    key, want, out = features_key(cfg), feature_shards(cfg), RunLayout(cfg.run_dir).features
    # done already (no shard was extracted since: extraction rewrites the store manifest without inputs_key) and
    # intact: keep it as written, with the timing of the run that extracted the shards
    if (m := cached_manifest(out / "manifest.json", key)) and not bad_shards(out, m["shards"]):
        return m
    by_id = {m["shard"]: m for m in shard_manifests if m.get("inputs_key") == key}
    rows = tokenized_rows(cfg)
    # data on disk is the source of truth: each shard must be listed and intact for the current inputs
    finished = _finished_entries(cfg, rows)[1]
    if (missing := [i for i in want if i not in by_id or i not in finished]):
        raise ValueError(f"feature shards {missing} of {out} are missing, stale or corrupt: run them "
                         f"(run_features_shard) before finish_features")
    store = read_manifest(out / "manifest.json")
    if not store.get("complete"):
        raise ValueError(f"{out}/manifest.json does not list every shard: run the missing ones (run_features_shard)")
    ran = [by_id[i] for i in want if by_id[i].get("extracted")]
    seconds = sum(by_id[i]["seconds"] for i in want)
    ran_s = sum(m["seconds"] for m in ran)
    manifest = {**store, "shards_extracted": len(ran), "seconds": seconds,
                "tokens_per_s": sum(m["tokens"] for m in ran) / ran_s if ran and ran_s > 0 else None}
    log(f"features: {manifest['samples']} samples, {manifest['tokens']} tokens, aux layers "
        f"{manifest['aux_layer_ids']}, format {manifest['format']}, {manifest['bytes_per_token']:.0f} bytes/token")
    return write_manifest(out / "manifest.json", {**manifest, "inputs_key": key})


def run_features_tp(cfg: PipelineConfig, log=print, **rdzv) -> dict:
    """run_features for features.backend 'hf_tp': torchrun of features.tp_size processes (`rdzv`: nnodes,
    node_rank, rdzv_endpoint when the ranks span hosts; node 0's call returns the manifest). Every line the ranks
    print goes to `log` and to features/torchrun.log. Same cache as run_features (inputs key, shards checked
    against their sha256). Raises TorchrunError if a rank fails (finished shards are kept: rerun to finish)."""
    from eagle3_core.features.store import bad_shards
    f = cfg.features
    if f.backend not in TORCHRUN_BACKENDS:
        raise ValueError(f"run_features_tp needs features.backend in {TORCHRUN_BACKENDS}, got {f.backend!r}")
    out, key = RunLayout(cfg.run_dir).features, features_key(cfg)
    if (m := cached_manifest(out / "manifest.json", key)) and not bad_shards(out, m["shards"]):
        return m
    out.mkdir(parents=True, exist_ok=True)
    config_file = out / "tp_config.json"
    config_file.write_text(cfg.model_dump_json())
    nnodes = rdzv.get("nnodes", 1)
    if f.tp_size % nnodes:
        raise ValueError(f"features.tp_size = {f.tp_size} is not a multiple of nnodes = {nnodes}")
    run_torchrun(["-m", "eagle3_core.features.tp_extract", "--config", str(config_file)], f.tp_size // nnodes,
                 on_line=log, log_path=out / "torchrun.log", **rdzv)
    manifest = read_manifest(out / "manifest.json")
    mark_store(cfg, manifest)
    log(f"features: {manifest['samples']} samples, {manifest['tokens']} tokens, target sharded over {f.tp_size} "
        f"ranks ({'INT4 experts, expert' if f.backend == 'ep_int4' else 'expert' if f.expert_parallel else 'tensor'}"
        f" parallel), format {manifest['format']}, "
        f"{manifest['bytes_per_token']:.0f} bytes/token")
    return write_manifest(out / "manifest.json", {**manifest, "inputs_key": key, "tp_size": f.tp_size,
                                                  "expert_parallel": f.expert_parallel or f.backend == "ep_int4",
                                                  "backend": f.backend})


def run_features_distributed(cfg: PipelineConfig, nproc_per_node: int, log=print, **rdzv) -> dict:
    """run_features with `nproc_per_node` worker processes (one per GPU) under torchrun; `rdzv`: nnodes,
    node_rank, rdzv_endpoint for several hosts (node 0's call returns the manifest). Every line the workers print
    goes to `log`. Raises TorchrunError if a worker fails (finished shards are kept: rerun to finish)."""
    from eagle3_core.features.store import bad_shards
    if cfg.features.backend != "hf":
        raise ValueError(f"features.backend {cfg.features.backend!r}: its ranks share one sharded target "
                         f"(tp_extract.run_features_tp); these workers each load the whole target")
    out = RunLayout(cfg.run_dir).features
    key = features_key(cfg)                         # the stage's own key: one definition (pipeline.features)
    if (m := cached_manifest(out / "manifest.json", key)) and not bad_shards(out, m["shards"]):
        return m
    out.mkdir(parents=True, exist_ok=True)
    config_file = out / "workers_config.json"
    config_file.write_text(cfg.model_dump_json())
    run_torchrun(["-m", "eagle3_core.features.extract_workers", "--config", str(config_file)], nproc_per_node,
                 on_line=log, **rdzv)
    manifest = read_manifest(out / "manifest.json")
    log(f"features: {manifest['samples']} samples, {manifest['tokens']} tokens by {manifest['workers']} workers, "
        f"format {manifest['format']}, {manifest['bytes_per_token']:.0f} bytes/token")
    return write_manifest(out / "manifest.json", {**manifest, "inputs_key": key})
