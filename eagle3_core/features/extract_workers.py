"""Feature extraction with one worker process per GPU, each owning whole shards: `torchrun --nproc-per-node 8 -m
eagle3_core.features.extract_workers --config run.json` (several hosts: the same command on each with torchrun's
--nnodes/--node-rank/--rdzv-endpoint; docs/scaling.md). The features stage launches it
(pipeline.features_stage.run_features with `workers`) and returns the features manifest.

Legend: W workers (global ranks), S samples per shard.
The shard plan is the one of features.store.extract_features (shard i = rows [i*S, (i+1)*S), the same content key), and
worker r owns shards r, r+W, r+2W, ... Inside a shard the batches are the same (batches_by_tokens over that
shard's rows), so a store written by W workers has the same shard files, byte for byte on CPU, as one written
by one process (tests/test_distributed_extract.py). Each worker writes its finished shards into its own part
manifest (features/parts/rank_{r}.json, rewritten atomically after every shard, so a killed run keeps them);
after a barrier rank 0 merges the parts into manifest.json through the store's one writer (store.write_record,
which writes head.json too). Rank 0 alone writes head.safetensors. The workers join a gloo process group for these
few small messages only; the target forwards never communicate.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch.distributed as dist

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.layout import RunLayout
from eagle3_core.contract.compat import shard_backend
from eagle3_core.contract.manifest import read_manifest, write_manifest
from eagle3_core.features.backends import local_device, selected_backend
from eagle3_core.features.store import (
    STORE_VERSION,
    bad_shards,
    entry_holds,
    refuse_mixed_backends,
    shard_entry,
    shard_plan,
    write_head,
    write_record,
    write_shards,
)
from eagle3_core.features.tp_extract import worker_main

PARTS = "parts"


def _known_shards(out_dir: Path) -> dict[str, dict]:
    """Shard records of an earlier merged manifest and of every part manifest (any world size), by file, each
    with its backend (compat.shard_backend for records written before entries named it)."""
    merged = read_manifest(out_dir / "manifest.json") or {}
    known = {s["file"]: {**s, "backend": shard_backend(s, merged)} for s in merged.get("shards", [])}
    for part in sorted((out_dir / PARTS).glob("rank_*.json")):
        known.update({s["file"]: s for s in (read_manifest(part) or {}).get("shards", [])})
    return known


def extract_owned(extractor, rows: list[dict], out_dir: Path, shard_samples: int, batch_tokens: int,
                  store_format: str, rank: int, world: int, target_id: str, header: dict, writer_threads: int = 2,
                  log=print, backend: str = "hf", mix_backends: bool = False) -> dict:
    """Extract the shards worker `rank` of `world` owns (plan[rank::world]) that are not already on disk with
    their checksum and content key; returns and writes its part manifest parts/rank_{rank:05d}.json. Each new
    entry names `backend`; kept shards of another backend are refused unless `mix_backends`
    (store.refuse_mixed_backends)."""
    plan = shard_plan(rows, shard_samples, extractor.aux_layer_ids, store_format, target_id,
                      (read_manifest(out_dir / "manifest.json") or {}).get("shards", []))
    mine = plan[rank::world]
    known = _known_shards(out_dir)
    candidates = [known[f] for f, part, key in mine if f in known
                  and entry_holds(out_dir, known[f], part, extractor.aux_layer_ids, store_format, target_id, key)]
    bad = set(bad_shards(out_dir, candidates))
    done = {e["file"]: e for e in candidates if e["file"] not in bad}
    if len(done) < len(mine):
        refuse_mixed_backends(list(done.values()), {}, backend, mix_backends, out_dir)
    for f, _, _ in mine:                                   # stale or half-written files of my shards only
        if f not in done:
            (out_dir / f).unlink(missing_ok=True)
            for tmp in out_dir.glob(f".{f}.tmp*"):
                tmp.unlink(missing_ok=True)
    part_path = out_dir / PARTS / f"rank_{rank:05d}.json"
    lock, todo = threading.Lock(), [(f, part, key) for f, part, key in mine if f not in done]
    by_file = {f: key for f, _, key in todo}

    def publish(extra: dict | None = None) -> dict:
        return write_manifest(part_path, {**header, "rank": rank, "world": world, "num_shards": len(plan),
                                          "shards": sorted(done.values(), key=lambda e: e["file"]), **(extra or {})})

    def record(path: Path, sha: str, nbytes: int, part: list[dict]) -> None:
        entry = shard_entry(path, sha, nbytes, part, by_file[path.name], backend)
        with lock:
            done[path.name] = entry
            publish()

    publish()
    t0 = time.monotonic()
    n_tok = write_shards(extractor, [(out_dir / f, part) for f, part, _ in todo], store_format, batch_tokens,
                         writer_threads, record)
    seconds = time.monotonic() - t0
    log(f"features: rank {rank}/{world}: {len(todo)} of my {len(mine)} shards extracted, {n_tok} tokens in "
        f"{seconds:.1f} s" + (f" ({n_tok / seconds:,.0f} tok/s)" if todo and seconds else ""))
    return publish({"shards_extracted": len(todo), "tokens_extracted": n_tok, "seconds": seconds})


def merge_parts(out_dir: Path, world: int) -> dict:
    """manifest.json (and head.json: store.write_record, the store's one writer) from the part manifests of ranks
    0..world-1 (the layout of features.store.extract_features' manifest, with 'workers' and per-worker throughput
    added); parts of ranks >= world (an earlier run on more workers) are deleted afterwards. Raises ValueError if
    parts disagree on the store's header or shards are missing (rerun the stage: it extracts only those)."""
    paths = [out_dir / PARTS / f"rank_{r:05d}.json" for r in range(world)]
    parts = [read_manifest(p) for p in paths if p.exists()]
    head_keys = ("store_version", "format", "aux_layer_ids", "hidden_size", "target", "target_id", "samples",
                 "store_key")
    header = {k: parts[0].get(k) for k in head_keys} if parts else {}
    for p in parts:
        if {k: p.get(k) for k in head_keys} != header:
            raise ValueError(f"part manifests in {out_dir / PARTS} disagree on the store (rank {p['rank']}); delete "
                             f"{out_dir / PARTS} and rerun the features stage")
    shards = sorted((s for p in parts for s in p["shards"]), key=lambda e: e["file"])
    n_tok, n_bytes = sum(s["tokens"] for s in shards), sum(s["bytes"] for s in shards)
    complete = bool(parts) and len(parts) == world and len(shards) == parts[0]["num_shards"]
    manifest = {**header, "shards": shards, "complete": complete, "tokens": n_tok, "bytes": n_bytes,
                "bytes_per_token": n_bytes / max(n_tok, 1), "workers": world,
                "shards_extracted": sum(p.get("shards_extracted", 0) for p in parts),
                "seconds": max((p.get("seconds", 0.0) for p in parts), default=0.0),
                "tokens_per_s_per_worker": [p.get("tokens_extracted", 0) / p["seconds"] if p.get("seconds") else None
                                            for p in parts]}
    for stale in (out_dir / PARTS).glob("rank_*.json"):
        if stale not in paths:
            stale.unlink(missing_ok=True)
    if not complete:
        raise ValueError(f"features: {out_dir} has {len(shards)} of {parts[0]['num_shards'] if parts else '?'} "
                         f"shards from {len(parts)} of {world} workers; rerun the stage to finish it")
    return write_record(out_dir / "manifest.json", manifest)


def run_worker(cfg: PipelineConfig, store_key: str | None = None, log=print) -> None:
    """One extraction worker of an initialised gloo process group (torchrun) of a per-shard backend
    (features.backends; each worker loads it whole on its device): rank 0 writes the target head and broadcasts
    the target id, every rank extracts its shards, rank 0 merges the parts after a barrier (`store_key` in the
    manifest and head.json)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = RunLayout(cfg.run_dir).features
    backend, f = selected_backend(cfg), cfg.features
    extractor = backend.load(cfg, local_device(), log)
    rows = pq.read_table(RunLayout(cfg.run_dir).tokenized_train).to_pylist()
    box = [None]
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        box[0] = write_head(extractor, out, (read_manifest(out / "manifest.json") or {}).get("target_id"))
    dist.broadcast_object_list(box, src=0)
    header = {"store_version": STORE_VERSION, "format": f.format, "aux_layer_ids": extractor.aux_layer_ids,
              "hidden_size": extractor.hidden_size, "target": cfg.target.model_dump(), "target_id": box[0],
              "samples": len(rows), "store_key": store_key}
    extract_owned(extractor, rows, out, f.shard_samples, f.batch_tokens, f.format, rank, world, box[0], header,
                  f.writer_threads, log, backend.name, f.mix_backends)
    dist.barrier()
    if rank == 0:
        merge_parts(out, world)
    dist.barrier()


def main(argv: list[str] | None = None) -> None:
    # gloo: coordination only, a few small CPU messages
    worker_main(argv, __doc__.split("\n")[0], run_worker, init=lambda: dist.init_process_group("gloo"))


if __name__ == "__main__":
    main()
