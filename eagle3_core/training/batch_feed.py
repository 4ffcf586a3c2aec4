"""The batches of an epoch (their order, a pure function of the seed, the epoch and the sample lengths) and the
host batches made ahead of the training loop, so that the GPU does not wait for the host to read and pack the
next batch (the store's memory-mapped reads, collate_packed's copies) after each step's synchronisation.

`prefetch(make, items)` yields make(item) in order while a background thread makes the next `ahead` ones; the
heavy parts (slicing, copying, pinning) are torch calls that release the GIL. With `pin` the floating and integer
tensors of each batch are page-locked there, so that the trainer's `.to(device, non_blocking=True)` is a real
asynchronous copy (from pageable memory CUDA first copies through a staging buffer, in the caller's thread).
The trainer uses it through `device_feed`: ahead on CUDA, in its own thread on a CPU (measured there: slower).
"""
from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from eagle3_core.config import TrainConfig
from eagle3_core.data.samples import batches_by_tokens
from eagle3_core.training.packing import collate_packed, pack_rows, sample_pieces
from eagle3_core.training.ttt import collate


def packed(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether batches are packed rows (cfg.batching; 'auto': on CUDA)."""
    return cfg.batching == "packed" or (cfg.batching == "auto" and device.type == "cuda")


def epoch_batches(samples: list[dict], cfg: TrainConfig, epoch: int, pack: bool = False) -> list[list]:
    """Epoch `epoch`'s batches in an order seeded by (cfg.seed, epoch); the same on every rank and every run
    (resume relies on it). Padded: lists of sample indices, length-bucketed under cfg.batch_tokens tokens each.
    pack: rows of cfg.batch_tokens tokens, each a list of windows (sample index, a, b, c) (training.packing)."""
    batches = batch_items(samples, cfg, pack, cfg.seed * 1000 + epoch)
    if not pack:                                                # packed rows come out in a seeded order already
        random.Random(cfg.seed * 1000 + epoch).shuffle(batches)
    return batches


def batch_items(samples: list[dict], cfg: TrainConfig, pack: bool, seed: int) -> list[list]:
    """The batches of `samples` under cfg.batch_tokens, unshuffled: length-bucketed lists of sample indices, or
    (pack) rows of windows packed in an order seeded by `seed`."""
    lengths = [len(s["input_ids"]) for s in samples]
    if pack:
        return pack_rows(sample_pieces(lengths, cfg.batch_tokens, cfg.context_tokens()), cfg.batch_tokens, seed)
    return batches_by_tokens(lengths, cfg.batch_tokens)


def make_batch(samples: list[dict], item: list, cfg: TrainConfig, pack: bool) -> dict:
    """The tensors of one epoch_batches item on the host (ttt.collate or packing.collate_packed)."""
    return collate_packed(samples, item, cfg.batch_tokens) if pack else collate([samples[i] for i in item])


def item_ids(samples: list[dict], item: list, pack: bool) -> list:
    """Sample ids of one epoch_batches item (error messages)."""
    return [samples[p[0] if pack else p]["id"] for p in item]


def nonfinite_loss_advice(samples: list[dict], item: list, pack: bool, lr: float) -> str:
    """What a non-finite loss on one epoch_batches item means and what to do, by looking at its samples' features:
    samples whose aux or final states hold NaN or inf are named with their shard file (features.reader.FeatureSample
    .shard_file; a sample without one, e.g. online, by id): they were stored that way, and lowering the learning
    rate would not help; finite features mean the training diverged (lower train.lr)."""
    bad, files = [], []
    for i in dict.fromkeys(p[0] if pack else p for p in item):
        s = samples[i]
        if not all(bool(torch.isfinite(s[k]).all()) for k in ("aux", "final", "teacher_logits", "tail_shift")
                   if k in s):
            bad.append(s["id"])
            if (f := getattr(s, "shard_file", None)) is not None and str(f) not in files:
                files.append(str(f))
    if not bad:
        where = sorted({str(f) for i in item if (f := getattr(samples[i[0] if pack else i], "shard_file", None))})
        return (f"the batch's features are finite{' (' + ', '.join(where) + ')' if where else ''}: the training "
                f"diverged; lower train.lr (now {lr:g})")
    return (f"the features of sample(s) {bad[:4]}{' ...' if len(bad) > 4 else ''} hold NaN or inf"
            + (f", in {', '.join(files)}" if files else "") + ": they were stored that way (an extraction or import "
            "gone wrong, a bad disk), and a lower learning rate would not help. Delete "
            + ("that shard file" if len(files) == 1 else "those shard files" if files else "those samples' shards")
            + " and rerun the features stage (it extracts exactly the missing shards again); for features imported "
            "from SpecForge (features.import_from), fix or drop the source file and import again")


def device_feed(make: Callable, items: Iterable, device: torch.device) -> Iterator:
    """The trainer's feed on `device`: on CUDA `prefetch` two ahead, pinned; elsewhere make(item) in the caller's
    thread. On a CPU a second thread's torch calls bring their own OpenMP team onto the cores torch's training
    threads use (and it spins there between regions): the demo's train stage on 2 cores took 256.9 s with the
    thread against 216.8 s without (same store, same losses)."""
    return prefetch(make, items, ahead=2, pin=True) if device.type == "cuda" else prefetch(make, items, ahead=0)


def to_device(batch: dict, device: torch.device) -> dict:
    """batch (host tensors) on `device`, asynchronously from pinned memory; bf16/fp16 features widened to fp32
    there (the loss's input dtype; exact), so that the host copies half the bytes of fp32."""
    return {k: v.to(device, non_blocking=True).to(torch.float32 if v.dtype in (torch.bfloat16, torch.float16)
                                                  else v.dtype) for k, v in batch.items()}


def pinned(batch: dict) -> dict:
    """batch with every tensor in page-locked host memory (torch.Tensor.pin_memory; needs CUDA)."""
    return {k: v.pin_memory() for k, v in batch.items()}


def prefetch(make: Callable, items: Iterable, ahead: int = 2, pin: bool = False) -> Iterator:
    """make(item) for each of `items`, in order, up to `ahead` of them made in a background thread before the
    caller asks (ahead 0: made in the caller's thread, nothing ahead). pin: each result (a dict of tensors) is
    page-locked (`pinned`) in that thread. An exception raised by make is raised here, at that item's turn.
    Closing the generator early (break, return, an error in the caller) cancels the batches not started yet and
    waits for the one being made."""
    build = (lambda item: pinned(make(item))) if pin else make
    if ahead <= 0:
        yield from map(build, items)
        return
    pool, pending, todo = ThreadPoolExecutor(1, thread_name_prefix="batch-feed"), deque(), iter(items)
    try:
        for item in todo:
            pending.append(pool.submit(build, item))
            if len(pending) > ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
