"""The one reader training uses for every storage format of the feature store (features.store writes it),
including the online one that stores nothing: samples read from their shards on access, checked against the
manifest's sha256 once, and the target's head (embedding, lm_head).

Legend: T tokens of one sample, H_t target hidden, V target vocab.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3_core.config import TargetConfig
from eagle3_core.contract.manifest import read_manifest
from eagle3_core.features import store_formats as ff
from eagle3_core.features.extract import HFExtractor
from eagle3_core.features.store import bad_shards
from eagle3_core.target import loading  # load_target read per call: tests replace it there


class FeatureSample(Mapping):
    """One training sample: 'id', 'input_ids' int64 [T], 'loss_mask' bool [T] held in memory; 'aux' fp32
    [T, 3H_t], 'final' fp32 [T, H_t] (bf16 from a bf16 store read with load_samples(keep_dtype=True)),
    'target_top1' int64 [T] produced on access by the sample's source (read from a shard, or computed by the
    target in online mode) and kept only in a small cache. An fp8_topk store adds 'teacher_logits' fp32 [T, K],
    'teacher_ids' int64 [T, K] and 'tail_shift' fp32 [T, 1] (store_formats)."""

    KEYS = ("id", "input_ids", "loss_mask", "aux", "final", "target_top1")
    TOPK_KEYS = ("id", "input_ids", "loss_mask", "aux", "final", "target_top1", "teacher_logits", "teacher_ids",
                 "tail_shift")

    def __init__(self, sid: str, input_ids: torch.Tensor, loss_mask: torch.Tensor, source, where):
        self._own = {"id": sid, "input_ids": input_ids, "loss_mask": loss_mask}
        self._source, self._where = source, where

    def __getitem__(self, key):
        if key in self._own:
            return self._own[key]
        if key in self._keys()[3:]:
            return self._source.features(self._own["id"], self._where, self._own["input_ids"])[key]
        raise KeyError(key)

    def _keys(self) -> tuple[str, ...]:
        return self.TOPK_KEYS if getattr(self._source, "fmt", None) == "fp8_topk" else self.KEYS

    @property
    def shard_file(self) -> Path | None:
        """The shard file holding this sample's features (None where they are computed on access: online)."""
        store = getattr(self._source, "store_dir", None)
        return None if store is None else Path(store) / self._where[0]

    def __iter__(self):
        return iter(self._keys())

    def __len__(self):
        return len(self._keys())


class _Cache:
    """A tiny LRU of decoded features: `collate` reads aux, final and top1 of one sample in a row."""

    def __init__(self, size: int = 8):
        self.items: OrderedDict = OrderedDict()
        self.size = size

    def get(self, key, make):
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        value = self.items[key] = make()
        if len(self.items) > self.size:
            self.items.popitem(last=False)
        return value


class _ShardSource:
    """Features read from the shards (memory-mapped, only the sample's rows) and decoded (feature_formats.decode;
    widen: to fp32)."""

    def __init__(self, store_dir: Path, fmt: str, widen: bool = True):
        self.store_dir, self.fmt, self.widen, self.cache = store_dir, fmt, widen, _Cache()
        self.open = lru_cache(maxsize=32)(lambda file: safe_open(str(self.store_dir / file), "pt"))

    def features(self, sid, where, input_ids):
        file, a, b = where

        def read():
            f = self.open(file)
            stored = {k: f.get_slice(k)[a:b] for k in f.keys() if k not in ("input_ids", "loss_mask", "offsets")}
            return ff.decode(self.fmt, stored, self.widen)
        return self.cache.get(sid, read)


class _OnlineSource:
    """Features computed by the target for one sample at a time on access (nothing stored), fp32 on the CPU."""

    def __init__(self, extractor):
        self.extractor, self.cache = extractor, _Cache()

    def features(self, sid, where, input_ids):
        def run():
            out = self.extractor([input_ids.tolist()])[0]
            return {"aux": out["aux"].float(), "final": out["final"].float(),
                    "target_top1": out["target_top1"].long()}
        return self.cache.get(sid, run)


def load_samples(store_dir: Path, verify: bool = True, target_model=None,
                 keep_dtype: bool = False) -> list[FeatureSample]:
    """The samples of a feature store, in row order, whatever its format (store_formats.FORMATS).

    Each is a FeatureSample (a read-only Mapping; see its docstring for keys, shapes and dtypes). verify: check
    every shard against its record first (bad_shards: size and mtime, the sha256 where those disagree; in
    parallel). Online stores run the target on access: `target_model` (an HF causal
    LM) or the manifest's target config, loaded on CUDA if available. keep_dtype: a bf16 store's aux and final
    come as stored, bf16 (for the trainer, which widens them on the device: half the host copying). Raises
    FileNotFoundError if the store has no manifest, ValueError naming every shard that is missing or fails its
    checksum (rerunning the features stage extracts exactly those again) or if the store is incomplete.
    """
    store_dir = Path(store_dir)
    manifest = read_manifest(store_dir / "manifest.json")
    if manifest is None:
        raise FileNotFoundError(f"{store_dir}/manifest.json missing: run the features stage first")
    fmt = manifest.get("format", manifest.get("dtype"))
    if not manifest.get("complete", True):
        raise ValueError(f"feature store {store_dir} is incomplete ({len(manifest['shards'])} shards listed); "
                         "rerun the features stage to finish it")
    if verify and (bad := bad_shards(store_dir, manifest["shards"])):
        raise ValueError(f"feature shard(s) {[str(store_dir / b) for b in bad]} corrupt or missing (changed "
                         "since written, sha256 mismatch); rerun the features stage: it extracts exactly those "
                         "shards again")
    if fmt == "online":
        if target_model is None:
            target_model = loading.load_target(TargetConfig(**manifest["target"]),
                                               "cuda" if torch.cuda.is_available() else "cpu")
        source = _OnlineSource(HFExtractor(target_model, manifest["aux_layer_ids"]))
    else:
        source = _ShardSource(store_dir, fmt, widen=not keep_dtype)
    samples = []
    for shard in manifest["shards"]:
        with safe_open(str(store_dir / shard["file"]), "pt") as f:
            ids = json.loads(f.metadata()["ids"])
            tok, mask, off = f.get_tensor("input_ids"), f.get_tensor("loss_mask"), f.get_tensor("offsets").tolist()
        for i, sid in enumerate(ids):
            a, b = off[i], off[i + 1]
            samples.append(FeatureSample(sid, tok[a:b].long(), mask[a:b].bool(), source, (shard["file"], a, b)))
    return samples


def load_head(store_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens [V, H_t], lm_head [V, H_t]) of the target, fp32."""
    with safe_open(str(Path(store_dir) / "head.safetensors"), "pt") as f:
        emb = f.get_tensor("embed_tokens")
        lm = f.get_tensor("lm_head") if "lm_head" in f.keys() else emb
    return emb, lm
