"""The feature store: extraction into checksummed shards, resumable per shard (features.reader reads it back for
training).

Legend: T tokens of one sample, H_t target hidden, S samples per shard.
A shard `shard_{i:05d}.safetensors` holds S samples concatenated along T: the format's feature tensors
(feature_formats.py; e.g. bf16 aux [sum T, 3H_t], final [sum T, H_t], target_top1 int32 [sum T]) plus
input_ids int32 [sum T], loss_mask int8 [sum T], offsets int64 [S + 1], and its sample ids in the metadata.
`head.safetensors` holds the target's embedding and lm_head. `manifest.json` lists the finished shards only, each
with its sha256, byte size, mtime, sample ids, token count, a content key (samples, tokens, loss masks, layers,
format, target) and the extraction backend that wrote it; it is rewritten atomically after every shard, so it never
names a shard that is not complete on disk. `write_record` is its one writer (and head.json's).
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3_core.contract.compat import content_key_before_loss_mask, shard_backend, stored_loss_mask_equals
from eagle3_core.contract.manifest import file_intact, read_manifest, sha256_json, write_manifest
from eagle3_core.contract.shard_plan import plan_ranges
from eagle3_core.data.samples import batches_by_tokens
from eagle3_core.features import store_formats as ff
from eagle3_core.features.extract import HFExtractor, HostCopy
from eagle3_core.features.shard_writer import ShardWriter

STORE_VERSION = 2


# ---- verification -------------------------------------------------------------------------------------------

def bad_shards(store_dir: Path, entries: list[dict], threads: int = 4, checksum: bool = False) -> list[str]:
    """Files of `entries` (manifest shard records) that are missing, of another size, or changed since they were
    written (manifest.file_intact: size and mtime against the record, sha256 only where those disagree or with
    `checksum`, the full verification of `python -m eagle3_core.verify`). Shards needing a hash are hashed in
    parallel (hashlib releases the GIL)."""
    with ThreadPoolExecutor(threads) as pool:
        ok = list(pool.map(lambda e: file_intact(Path(store_dir) / e["file"], e, checksum), entries))
    return [e["file"] for e, good in zip(entries, ok) if not good]


# ---- extraction ---------------------------------------------------------------------------------------------

def write_head(extractor, out_dir: Path, prev_target_id: str | None) -> str:
    """head.safetensors (embedding, lm_head if untied, fp32), unless it is there for the same target; returns an
    id of the target weights (config + a checksum of some embedding rows), part of every shard's content key.
    The weights come from `extractor.head_weights()` (gathered whole from a tensor-parallel target)."""
    emb, lm = extractor.head_weights()
    target_id = sha256_json([extractor.model.config.to_dict(),
                             hashlib.sha256(emb[:64].float().cpu().numpy().tobytes()).hexdigest()])
    if target_id == prev_target_id and (out_dir / "head.safetensors").exists():
        return target_id
    tied = lm is emb
    emb = emb.float().cpu()
    lm = emb if tied else lm.float().cpu()
    tensors = {"embed_tokens": emb.contiguous()}
    if lm.data_ptr() != emb.data_ptr() and not torch.equal(lm, emb):
        tensors["lm_head"] = lm.contiguous()
    tmp = out_dir / ".head.safetensors.tmp"
    save_file(tensors, str(tmp))
    tmp.replace(out_dir / "head.safetensors")
    return target_id


def shard_parts(part: list[dict], pieces: list[tuple[HostCopy, list[int], list[int]]]) -> dict:
    """A shard's tensors in row order from per-batch host copies (pieces = (copy, indices into part, lengths)),
    each feature tensor as the list of its samples' row slices of the host copies (no concatenation:
    shard_writer.write_shard_parts writes them to the file as they are), plus input_ids int32 [sum T], loss_mask
    int8 [sum T] and offsets int64 [S + 1] as one piece each."""
    rows_of: dict[int, tuple[dict, int, int]] = {}
    for copy, idx, lens in pieces:
        host = copy.wait()
        for b, (i, n) in enumerate(zip(idx, lens)):
            rows_of[i] = (host, b, n)
    parts = {}
    if rows_of:
        keys = next(iter(rows_of.values()))[0].keys()
        parts = {k: [rows_of[i][0][k][rows_of[i][1], :rows_of[i][2]] for i in range(len(part))] for k in keys}
    lengths = [len(r["input_ids"]) for r in part]
    parts["input_ids"] = [torch.tensor([t for r in part for t in r["input_ids"]], dtype=torch.int32)]
    parts["loss_mask"] = [torch.tensor([m for r in part for m in r["loss_mask"]], dtype=torch.int8)]
    parts["offsets"] = [torch.tensor([0] + lengths, dtype=torch.long).cumsum(0)]
    return {k: [t.contiguous() for t in v] for k, v in parts.items()}


def write_shards(extractor, jobs: list[tuple[Path, list[dict]]], store_format: str, batch_tokens: int,
                 writer_threads: int, on_written) -> int:
    """The extraction loop: for each (shard path, rows) run the extractor on length-bucketed batches under
    `batch_tokens`, encode on the device, copy to pinned host memory, and hand the shard to the background writer,
    which checksums and writes it and then calls `on_written(path, sha256, nbytes, rows)` (from a writer thread).
    The GPU never waits for the disk unless writer_threads + 1 shards are already queued; the samples' rows go
    straight from the host copies to the file (shard_parts, shard_writer.write_shard_parts). Returns the number of
    tokens extracted."""
    n_tokens = 0
    in_forward = getattr(extractor, "teacher", False)                  # a vocab-split head: forward's 'teacher'
    head = extractor.head_weights()[1] if ff.needs_head(store_format) and not in_forward else None
    with ShardWriter(writer_threads) as writer:
        for path, part in jobs:
            pieces = []
            if store_format != "online":
                for batch in batches_by_tokens([len(r["input_ids"]) for r in part], batch_tokens):
                    out = extractor.forward([part[i]["input_ids"] for i in batch])
                    enc = ff.encode(store_format, out["aux"], out["final"], out["target_top1"], head,
                                    out.get("teacher"))
                    pieces.append((HostCopy(enc), batch, out["lengths"].tolist()))
            n_tokens += sum(len(r["input_ids"]) for r in part)

            def build(part=part, pieces=pieces):
                return shard_parts(part, pieces), {"ids": json.dumps([r["id"] for r in part])}

            writer.submit(path, build, lambda p, sha, n, part=part: on_written(p, sha, n, part))
    return n_tokens


def shard_entry(path: Path, sha: str, nbytes: int, part: list[dict], content_key: str, backend: str) -> dict:
    """The manifest entry of one finished shard: file name, sha256, bytes, mtime_ns (manifest.file_stamp, so that
    done checks need no read), samples, tokens, sample ids, the content key that says which samples, tokens,
    layers, format and target it holds, and the extraction backend that wrote it (out of the content key)."""
    return {"file": path.name, "sha256": sha, "bytes": nbytes, "mtime_ns": path.stat().st_mtime_ns,
            "samples": len(part), "tokens": sum(len(r["input_ids"]) for r in part), "ids": [r["id"] for r in part],
            "content_key": content_key, "backend": backend}


def content_key(part: list[dict], aux_layer_ids: list[int], store_format: str, target_id: str) -> str:
    """The key a shard of tokenized rows `part` is stored under: a shard is reused only for the same samples,
    tokens, loss masks (the shard stores them; training reads them from there), layers, format and target
    (target_id: see write_head)."""
    rows = [[r["id"], list(r["input_ids"]), [int(m) for m in r["loss_mask"]]] for r in part]
    return sha256_json([STORE_VERSION, "loss_mask", rows, aux_layer_ids, store_format, target_id])


def entry_holds(store_dir: Path, entry: dict, part: list[dict], aux_layer_ids: list[int], store_format: str,
                target_id: str, key: str | None = None) -> bool:
    """Whether manifest entry `entry` was written for tokenized rows `part` with these layers, format and target:
    its content key is content_key(...) (`key`, if already computed), or, for an entry written before loss masks
    were in the key (compat.content_key_before_loss_mask), the shard stores the rows' loss masks.
    Remove the second test when runs written before bc5e252 are no longer supported (compat.LEGACY_READERS)."""
    key = key or content_key(part, aux_layer_ids, store_format, target_id)
    if entry.get("content_key") == key:
        return True
    if entry.get("content_key") != content_key_before_loss_mask(part, aux_layer_ids, store_format, target_id):
        return False
    return stored_loss_mask_equals(Path(store_dir) / entry["file"], part)


def write_record(path: Path, record: dict) -> dict:
    """The one writer of a feature store's manifest.json (`path`): the store's record (header, finished shards) as
    the store rewrites it after every shard, the worker merge, and the features stage's manifest (the same record
    with its inputs_key, pipeline.run.run's `write`). Where the record names its store key, head.json beside it
    gets {inputs_key: store key, target_id} too, on every path, so that a later run checks its shards without
    loading the target (pipeline.features_stage.feature_status). Returns `record`."""
    path = Path(path)
    write_manifest(path, record)
    if record.get("store_key") and record.get("target_id"):
        head = {"inputs_key": record["store_key"], "target_id": record["target_id"]}
        if read_manifest(path.with_name("head.json")) != head:
            write_manifest(path.with_name("head.json"), head)
    return record


def refuse_mixed_backends(kept: list[dict], store: dict, backend: str, allowed: bool, where: Path) -> None:
    """Raise ValueError (naming the shards, their backend and features.mix_backends) if `backend` would add shards
    to a store whose `kept` entries another backend wrote, unless `allowed`: the backend is out of the key (it
    changes how features are computed, not what), but one store is one backend's unless the config says
    otherwise."""
    other = sorted({shard_backend(e, store) for e in kept} - {backend})
    if other and not allowed:
        files = [e["file"] for e in kept if shard_backend(e, store) != backend]
        raise ValueError(f"feature store {where} holds shards of backend {other} ({files[:3]}"
                         f"{' ...' if len(files) > 3 else ''}) and this run extracts with {backend!r}: set "
                         f"features.mix_backends true to keep them beside the new ones, or features.backend "
                         f"{other[0]!r} to finish the store with the backend that began it, or refresh the stage")


def shard_plan(rows: list[dict], shard_samples: int, aux_layer_ids: list[int], store_format: str, target_id: str,
               previous: list[dict]) -> list[tuple[str, list[dict], str]]:
    """[(file name, rows, content key)] of every shard (ranges: plan_ranges over the earlier entries `previous`)."""
    return [(f"shard_{k:05d}.safetensors", rows[a:b], content_key(rows[a:b], aux_layer_ids, store_format, target_id))
            for k, (a, b) in enumerate(plan_ranges([r["id"] for r in rows], shard_samples, previous))]


def extract_features(model, rows: list[dict], out_dir: Path, aux_layer_ids: list[int] | None, shard_samples: int,
                     batch_tokens: int, store_format: str = "bf16", log=print, target: dict | None = None,
                     writer_threads: int = 2, only_shards: set[int] | None = None, backend: str = "hf",
                     store_key: str | None = None, mix_backends: bool = False) -> dict:
    """Extract and store features for tokenized `rows` ({id, input_ids, loss_mask}); resumable per shard.

    model: an HF causal LM (wrapped in HFExtractor) or an Extractor (extract.Extractor: what a features backend
    gives, features.backends). aux_layer_ids None: the config's defaults. store_format: one of
    store_formats.FORMATS; 'online' stores only tokens and needs `target` (the TargetConfig as a dict) so that
    training can load the target. Shards listed in an earlier manifest for the same content that are intact
    (bad_shards: size and mtime as recorded) are kept; any other shard (missing, corrupt, other inputs) is extracted
    again. backend: the name recorded in each new shard's entry (out of its content key); a store whose kept shards
    another backend wrote is refused unless `mix_backends` (refuse_mixed_backends). store_key: the store's key
    (pipeline.features_stage.store_key) recorded in the manifest and head.json (write_record). Returns the
    manifest (also out_dir/manifest.json, rewritten after every shard by write_record); when nothing was left to
    do it says so via `log`. only_shards: extract just these plan indices (shard i holds rows
    plan_ranges(...)[i], shard_samples each unless an earlier entry keeps its own); other shards' files are left
    alone and their earlier manifest entries kept (unverified) while their content key still matches, and an
    incomplete store is no error (the caller finishes the others; the manifest says `complete`).
    Raises ValueError on an unknown format, an online store without `target`, an index in only_shards out of
    range or mixed backends; RuntimeError if a full extraction (only_shards None) leaves shards missing. The model
    runs on its own device.
    """
    ff.check_format(store_format)
    if store_format == "online" and target is None:
        raise ValueError("store_format 'online' needs `target` (the TargetConfig dict) so training can load it")
    extractor = HFExtractor(model, aux_layer_ids) if isinstance(model, torch.nn.Module) else model
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    previous = read_manifest(out_dir / "manifest.json") or {}
    target_id = write_head(extractor, out_dir, previous.get("target_id"))
    ids = extractor.aux_layer_ids
    header = {"store_version": STORE_VERSION, "format": store_format, "aux_layer_ids": ids,
              "hidden_size": extractor.hidden_size, "target": target, "target_id": target_id,
              "samples": len(rows), "store_key": store_key}
    plan = shard_plan(rows, shard_samples, ids, store_format, target_id, previous.get("shards", []))
    selected = _selected_shards(plan, only_shards, len(rows), shard_samples)
    done = _kept_entries(out_dir, plan, previous, selected, ids, store_format, target_id, log)
    todo = [(f, part, key) for f, part, key in plan if f in selected and f not in done]
    if todo:
        refuse_mixed_backends(list(done.values()), previous, backend, mix_backends, out_dir)
    _remove_stale_files(out_dir, done, selected, only_shards)
    t0 = time.monotonic()
    record = _StoreRecord(out_dir / "manifest.json", header, len(plan), done)
    if not todo:
        log(f"features: all {len(selected)} shards asked for in {out_dir} are complete; nothing to extract")
    by_file = {file: key for file, _, key in todo}
    extracted_tokens = write_shards(
        extractor, [(out_dir / f, part) for f, part, _ in todo], store_format, batch_tokens, writer_threads,
        lambda path, sha, nbytes, part: record.add(shard_entry(path, sha, nbytes, part, by_file[path.name], backend)))
    seconds = time.monotonic() - t0
    manifest = record.publish({"shards_extracted": len(todo), "seconds": seconds,
                               "tokens_per_s": extracted_tokens / seconds if todo else None})
    if only_shards is None and not manifest["complete"]:
        raise RuntimeError(f"features: {out_dir} is missing shards after extraction; rerun to finish it")
    return manifest


def _selected_shards(plan: list[tuple[str, list[dict], str]], only_shards: set[int] | None, n_rows: int,
                     shard_samples: int) -> set[str]:
    """File names of the plan's shards this call extracts (all, or the indices `only_shards`); ValueError for an
    index out of range."""
    if only_shards is not None and (outside := sorted(set(only_shards) - set(range(len(plan))))):
        raise ValueError(f"features: shard indices {outside} are out of range: {n_rows} rows make {len(plan)} "
                         f"shards of {shard_samples} samples")
    return {plan[i][0] for i in (range(len(plan)) if only_shards is None else only_shards)}


def _kept_entries(out_dir: Path, plan: list[tuple[str, list[dict], str]], previous: dict, selected: set[str],
                  aux_layer_ids: list[int], store_format: str, target_id: str, log) -> dict:
    """{file: entry} of the earlier manifest's shards that hold their planned content (entry_holds), each with
    its backend; the selected ones only if intact (bad_shards; the others are logged and extracted again), the
    others unverified: their own extraction (or a full run) checks them."""
    prev = {s["file"]: {**s, "backend": shard_backend(s, previous)} for s in previous.get("shards", [])}
    candidates = [prev[f] for f, part, key in plan
                  if f in prev and entry_holds(out_dir, prev[f], part, aux_layer_ids, store_format, target_id, key)]
    bad = set(bad_shards(out_dir, [e for e in candidates if e["file"] in selected]))
    done = {e["file"]: e for e in candidates if e["file"] not in bad}
    if bad:
        log(f"features: {len(bad)} shard(s) failed their checksum or are missing, extracting again: {sorted(bad)}")
    return done


def _remove_stale_files(out_dir: Path, done: dict, selected: set[str], only_shards: set[int] | None) -> None:
    """Delete the shard files and leftover `.shard_*.tmp*` files this call may replace (a selected shard's, or any
    tmp file on a full run) that are not kept in `done`."""
    def ours(name: str) -> bool:
        if name.startswith("."):
            return only_shards is None or name[1:].split(".tmp")[0] in selected
        return name in selected

    for stale in list(out_dir.glob("shard_*.safetensors")) + list(out_dir.glob(".shard_*.tmp*")):
        if stale.name not in done and ours(stale.name):
            stale.unlink(missing_ok=True)


@dataclass(frozen=True)
class _StoreRecord:
    """The store's manifest.json (`path`) while shards are extracted: `header` plus the finished shards `done`
    ({file: entry}) out of `n_shards` planned, rewritten by write_record after every shard (add runs on the
    writer threads, hence the lock)."""
    path: Path
    header: dict
    n_shards: int
    done: dict
    lock: threading.Lock = field(default_factory=threading.Lock)

    def publish(self, extra: dict | None = None) -> dict:
        shards = sorted(self.done.values(), key=lambda e: e["file"])
        n_tok, n_bytes = sum(s["tokens"] for s in shards), sum(s["bytes"] for s in shards)
        return write_record(self.path, {
            **self.header, "shards": shards, "complete": len(shards) == self.n_shards, "tokens": n_tok,
            "bytes": n_bytes, "bytes_per_token": n_bytes / max(n_tok, 1), **(extra or {})})

    def add(self, entry: dict) -> None:
        with self.lock:
            self.done[entry["file"]] = entry
            self.publish()


# ---- reading: one interface for every format ---------------------------------------------------------------
