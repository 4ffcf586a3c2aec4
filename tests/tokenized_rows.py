"""Tokenized rows for tests that start a run at the features stage: random token ids with a loss mask, written where
the tokenize stage writes them (tokenized/train.parquet and its manifest), so the stages below run on them for real;
and the config of a tiny run that trains a draft on them."""
from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_core.config import DraftConfig, FeatureConfig, PipelineConfig, TargetConfig, TrainConfig
from eagle3_core.contract.manifest import write_manifest


def random_rows(n: int, lengths: tuple[int, int] = (5, 24), prompt_part: int = 2) -> list[dict]:
    """n rows {"id": "r<i>", "input_ids": k ids below 128, "loss_mask": k ints}, k drawn from `lengths` (both ends
    included); the first k // prompt_part tokens stand for the prompt (mask 0), the rest for the answer (mask 1).
    The same rows on every call (random.Random(0))."""
    rng = random.Random(0)
    rows = []
    for i in range(n):
        k = rng.randint(*lengths)
        rows.append({"id": f"r{i}", "input_ids": [rng.randrange(128) for _ in range(k)],
                     "loss_mask": [int(t >= k // prompt_part) for t in range(k)]})
    return rows


def write_tokenized(run_dir: Path, rows: list[dict], **manifest) -> None:
    """`rows` as the tokenize stage's output of the run at `run_dir`: tokenized/train.parquet and a manifest
    holding `manifest` (its inputs_key at least)."""
    (run_dir / "tokenized").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), run_dir / "tokenized" / "train.parquet")
    write_manifest(run_dir / "tokenized" / "manifest.json", manifest)


def tiny_train_run(run_dir: Path, target_dir: Path, **train) -> PipelineConfig:
    """A run over the tiny target at `target_dir` whose features, vocab and train stages take seconds on CPU:
    shards of 4 samples of at most 64 tokens, a 64-token draft vocab, 2 epochs of TTT length 2 over 48-token
    batches at lr 3e-3, the on-policy gate off (random tokens); `train` (TrainConfig fields) on top."""
    return PipelineConfig(run_dir=run_dir, target=TargetConfig(model=str(target_dir)),
                          features=FeatureConfig(max_length=64, shard_samples=4, batch_tokens=128, min_on_policy=0.0),
                          draft=DraftConfig(draft_vocab_size=64),
                          train=TrainConfig(epochs=2, lr=3e-3, batch_tokens=48, ttt_length=2, device="cpu", **train))
