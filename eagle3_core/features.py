"""Aux hidden-state extraction and the shard store (DESIGN.md 'hidden states').

Legend: T tokens of one sample, H_t target hidden, S samples per shard.
A shard `shard_{i:05d}.safetensors` holds S samples concatenated along T:
  aux [sum T, 3*H_t] (bf16 by default)  outputs of the aux layers, concatenated in id order
  final [sum T, H_t]                      the target's final normed hidden state (lm_head input)
  target_top1 int32 [sum T]               the target's argmax next token at each position
  input_ids int32 [sum T], loss_mask int8 [sum T], offsets int64 [S + 1]
and its sample ids in the safetensors metadata. `head.safetensors` holds the target's embedding and lm_head.
A shard is done when its file exists and its sha256 matches the sidecar written after it; the manifest lists them.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .manifest import read_manifest, sha256_file, sha256_json, write_atomic, write_manifest

STORE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def batches_by_tokens(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped so that (batch size x longest sequence) stays within `budget` tokens; length-sorted."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > budget:              # ascending: i is the longest so far
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


@torch.no_grad()
def extract_batch(model, aux_layer_ids: list[int], seqs: list[list[int]], device: str = "cpu") -> list[dict]:
    """Run the target on right-padded `seqs`; per sample {'aux' [T, 3H_t], 'final' [T, H_t], 'target_top1' [T]}."""
    from .target import capture
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    attn = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.tensor(s)
        attn[b, :len(s)] = 1
    with capture(model, aux_layer_ids) as store:
        logits = model(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False).logits
    aux = torch.cat(store["aux"], dim=-1)                                  # [B, T, 3H_t]
    top1 = logits.argmax(-1)                                               # [B, T]
    return [{"aux": aux[b, :len(s)].cpu(), "final": store["final"][b, :len(s)].cpu(),
             "target_top1": top1[b, :len(s)].to(torch.int32).cpu()} for b, s in enumerate(seqs)]


def shard_done(out_dir: Path, name: str, content_key: str) -> bool:
    """True if the shard exists, was written for the same samples and settings, and its bytes are intact."""
    path, side = out_dir / f"{name}.safetensors", out_dir / f"{name}.json"
    if not (path.exists() and side.exists()):
        return False
    meta = json.loads(side.read_text())
    return meta.get("content_key") == content_key and meta["sha256"] == sha256_file(path)


def write_head(model, out_dir: Path) -> str:
    """Write the target's embedding (and lm_head, if untied) to out_dir/head.safetensors; returns the target id,
    a cheap fingerprint of the weights (config + a checksum of some embedding rows). Safe to call from several
    threads or processes: each writes its own temporary file, then renames it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    head = out_dir / "head.safetensors"                                     # rewritten: it must match this target
    emb = model.get_input_embeddings().weight.detach().float().cpu()
    lm = model.get_output_embeddings().weight.detach().float().cpu()
    tensors = {"embed_tokens": emb.contiguous()}
    if lm.data_ptr() != emb.data_ptr() and not torch.equal(lm, emb):
        tensors["lm_head"] = lm.contiguous()
    tmp = out_dir / f".head.safetensors.tmp.{os.getpid()}.{threading.get_ident()}"
    save_file(tensors, str(tmp))
    tmp.replace(head)
    return sha256_json([model.config.to_dict(), hashlib.sha256(emb[:64].numpy().tobytes()).hexdigest()])


def extract_shard(model, part: list[dict], out_dir: Path, name: str, aux_layer_ids: list[int], batch_tokens: int,
                  content_key: str, store_dtype: str = "bf16", device: str = "cpu") -> dict:
    """Extract and store one shard `name` of tokenized rows `part`, unless it is already complete for
    `content_key` (what makes it valid: samples, tokens, layers, dtype, target). Returns its manifest entry
    {file, sha256, samples, tokens, bytes, ids, extracted}."""
    if not shard_done(out_dir, name, content_key):
        dtype = STORE_DTYPES[store_dtype]
        feats: dict[int, dict] = {}
        for batch in batches_by_tokens([len(r["input_ids"]) for r in part], batch_tokens):
            outs = extract_batch(model, aux_layer_ids, [part[i]["input_ids"] for i in batch], device)
            feats.update(zip(batch, outs))
        lengths = [len(r["input_ids"]) for r in part]
        tensors = {
            "aux": torch.cat([feats[i]["aux"] for i in range(len(part))]).to(dtype).contiguous(),
            "final": torch.cat([feats[i]["final"] for i in range(len(part))]).to(dtype).contiguous(),
            "target_top1": torch.cat([feats[i]["target_top1"] for i in range(len(part))]),
            "input_ids": torch.tensor([t for r in part for t in r["input_ids"]], dtype=torch.int32),
            "loss_mask": torch.tensor([m for r in part for m in r["loss_mask"]], dtype=torch.int8),
            "offsets": torch.tensor([0] + lengths, dtype=torch.long).cumsum(0),
        }
        path = out_dir / f"{name}.safetensors"
        tmp = out_dir / f".{name}.safetensors.tmp"
        save_file(tensors, str(tmp), metadata={"ids": json.dumps([r["id"] for r in part])})
        tmp.replace(path)
        write_atomic(out_dir / f"{name}.json",
                     json.dumps({"sha256": sha256_file(path), "content_key": content_key}).encode())
        extracted = True
    else:
        extracted = False
    side = json.loads((out_dir / f"{name}.json").read_text())
    return {"file": f"{name}.safetensors", "sha256": side["sha256"], "samples": len(part),
            "tokens": sum(len(r["input_ids"]) for r in part),
            "bytes": (out_dir / f"{name}.safetensors").stat().st_size, "ids": [r["id"] for r in part],
            "extracted": extracted}


def store_manifest(shards: list[dict], aux_layer_ids: list[int], store_dtype: str, seconds: float) -> dict:
    """The store's manifest from its shard entries (extract_shard's return values, in order)."""
    total_tokens = sum(s["tokens"] for s in shards)
    total_bytes = sum(s["bytes"] for s in shards)
    return {"aux_layer_ids": aux_layer_ids, "dtype": store_dtype,
            "shards": [{k: v for k, v in s.items() if k != "extracted"} for s in shards],
            "samples": sum(s["samples"] for s in shards), "tokens": total_tokens, "bytes": total_bytes,
            "bytes_per_token": total_bytes / max(total_tokens, 1),
            "shards_extracted": sum(s["extracted"] for s in shards), "seconds": seconds}


def extract_features(model, rows: list[dict], out_dir: Path, aux_layer_ids: list[int], shard_samples: int,
                     batch_tokens: int, store_dtype: str = "bf16", device: str = "cpu", log=print) -> dict:
    """Extract and store features for tokenized `rows` ({id, input_ids, loss_mask}); resumable per shard.

    Returns the manifest (also written to out_dir/manifest.json). Shards already complete are skipped; when all
    are, nothing is computed (handed case C8). Raises ValueError on an unknown store dtype.
    """
    if store_dtype not in STORE_DTYPES:
        raise ValueError(f"unknown feature dtype {store_dtype!r}; choose one of {sorted(STORE_DTYPES)}")
    target_id = write_head(model, out_dir)
    shards, t0 = [], time.monotonic()
    for start in range(0, len(rows), shard_samples):
        part = rows[start:start + shard_samples]
        # a shard is reused only for the same samples, tokens, layers, dtype and target
        content_key = sha256_json([[r["id"], r["input_ids"]] for r in part] + [aux_layer_ids, store_dtype, target_id])
        shards.append(extract_shard(model, part, out_dir, f"shard_{start // shard_samples:05d}", aux_layer_ids,
                                    batch_tokens, content_key, store_dtype, device))
    manifest = store_manifest(shards, aux_layer_ids, store_dtype, time.monotonic() - t0)
    if manifest["shards_extracted"] == 0:
        log(f"features: all {len(shards)} shards in {out_dir} are complete; nothing to extract")
    return write_manifest(out_dir / "manifest.json", manifest)


def load_samples(store_dir: Path) -> list[dict]:
    """All samples of a store as fp32 tensors: {id, input_ids int64 [T], loss_mask bool [T], aux [T, 3H_t],
    final [T, H_t], target_top1 int64 [T]}. Raises ValueError naming a shard whose checksum does not match."""
    manifest = read_manifest(store_dir / "manifest.json")
    if manifest is None:
        raise FileNotFoundError(f"{store_dir}/manifest.json missing: run the features stage first")
    samples = []
    for shard in manifest["shards"]:
        path = store_dir / shard["file"]
        if sha256_file(path) != shard["sha256"]:
            raise ValueError(f"feature shard {path} is corrupt (sha256 mismatch); delete it and rerun extraction")
        with safe_open(str(path), "pt") as f:
            ids = json.loads(f.metadata()["ids"])
            t = {k: f.get_tensor(k) for k in f.keys()}
        off = t["offsets"].tolist()
        for i, sid in enumerate(ids):
            a, b = off[i], off[i + 1]
            samples.append({"id": sid, "input_ids": t["input_ids"][a:b].long(), "loss_mask": t["loss_mask"][a:b].bool(),
                            "aux": t["aux"][a:b].float(), "final": t["final"][a:b].float(),
                            "target_top1": t["target_top1"][a:b].long()})
    return samples


def load_head(store_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens [V, H_t], lm_head [V, H_t]) of the target, fp32."""
    with safe_open(str(store_dir / "head.safetensors"), "pt") as f:
        emb = f.get_tensor("embed_tokens")
        lm = f.get_tensor("lm_head") if "lm_head" in f.keys() else emb
    return emb, lm
