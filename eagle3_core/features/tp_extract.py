"""The torchrun worker of the features backends that shard one target over several GPUs (features.backends rows
with `torchrun`: `hf_tp`, transformers' tensor-parallel plan, and its expert-parallel plan for MoE targets;
`ep_int4`, a DeepSeek-V3 / Kimi-K2.5 target with its routed experts packed INT4, target.ep_loading). `torchrun
--nproc-per-node N -m eagle3_core.features.tp_extract --config run.json` with features.tp_size = N; the features
stage launches it (pipeline.features_stage.run_features) and returns the features manifest.

Legend: W = tp_size ranks (one process per GPU), B batch, T padded length, H_t target hidden.
Every rank loads its share of the target (the backend's `load`; plans: the config's `base_model_tp_plan`,
`base_model_ep_plan`, or ep_loading's) and all ranks run every forward together: the collectives inside the
sharded layers need each rank on the same batch. The residual stream is replicated after each decoder layer
(row-wise projections all-reduce their outputs), so the aux capture of extract.HFExtractor applies unchanged and
every rank ends up holding the same aux [B, T, 3H_t] and final [B, T, H_t].

Rank roles: shards are written once, by rank 0 (the leader), through the one-process code path itself: rank 0
runs features.store.extract_features with a `Leader` extractor whose every forward first tells the other ranks
(followers) which sequences to run (a broadcast of the token ids), so the store's plan, content keys, checksums,
resume, manifest and head.json are those of the `hf` backend, written by the store's one writer
(store.write_record). A killed rank ends the run (torchrun stops the others); the shard writer's
tmp-fsync-rename and the manifest rewritten after each finished shard mean that what the manifest lists is
complete, and a rerun extracts only the rest.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from eagle3_core.config import PipelineConfig, load_config
from eagle3_core.contract.layout import RunLayout
from eagle3_core.distributed.launch import emit_line
from eagle3_core.distributed.rank_exit import rank_main
from eagle3_core.features.backends import selected_backend
from eagle3_core.features.extract import HFExtractor
from eagle3_core.features.store import extract_features

_FORWARD, _HEAD, _STOP = "forward", "head", "stop"


def _send(command: tuple) -> tuple:
    """Broadcast one command from rank 0 to every rank (pickled, over the CPU group: a few KB of token ids);
    returns it on every rank."""
    box = [command if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, device=torch.device("cpu"))
    return box[0]


class Leader:
    """Rank 0's Extractor (extract.Extractor) over its rank's HFExtractor: each call is first broadcast to
    the followers (`follow`), then run here; `stop()` releases them. Outputs as HFExtractor's."""

    def __init__(self, inner: HFExtractor):
        self.inner = inner
        self.model, self.aux_layer_ids = inner.model, inner.aux_layer_ids
        self.hidden_size, self.device = inner.hidden_size, inner.device
        self.teacher = getattr(inner, "teacher", False)      # fp8_topk's teacher comes with each forward

    def forward(self, seqs: list[list[int]]) -> dict:
        _send((_FORWARD, seqs))
        return self.inner.forward(seqs)

    def __call__(self, seqs: list[list[int]]) -> list[dict]:
        _send((_FORWARD, seqs))
        return self.inner(seqs)

    def head_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        _send((_HEAD,))
        return self.inner.head_weights()

    def stop(self) -> None:
        _send((_STOP,))


def follow(inner: HFExtractor) -> int:
    """A follower rank's loop: run every forward (and head gather) rank 0 broadcasts, discarding the outputs (rank
    0 holds the same replicated tensors), until it says stop. Returns the number of forwards run."""
    n = 0
    while True:
        command = _send(None)
        if command[0] == _STOP:
            return n
        if command[0] == _HEAD:
            inner.head_weights()
        else:
            assert command[0] == _FORWARD, command
            inner.forward(command[1])
            n += 1


def init_group() -> None:
    """The process group of a torchrun worker: gloo for the leader's CPU broadcasts, plus NCCL for the sharded
    layers' collectives when there are GPUs (one group serving both device types; transformers reuses it)."""
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)


def run_worker(cfg: PipelineConfig, store_key: str | None = None, log=print) -> dict | None:
    """One rank of a torchrun backend's extraction (an initialised process group of features.tp_size ranks):
    load the target's share (the backend's `load`), then lead (rank 0: features.store.extract_features, the store
    written here, with `store_key` in its manifest and head.json) or follow. Returns the store manifest on rank 0,
    None elsewhere. Raises ValueError if the world size is not features.tp_size or the backend is not a torchrun
    one."""
    f, rank, world = cfg.features, dist.get_rank(), dist.get_world_size()
    backend = selected_backend(cfg)
    if not backend.torchrun:
        raise ValueError(f"features.backend {backend.name!r} is not sharded over torchrun ranks (features.backends)")
    if world != f.tp_size:
        raise ValueError(f"features.tp_size = {f.tp_size} but torchrun started {world} processes; launch with "
                         f"--nproc-per-node {f.tp_size} (times nodes)")
    inner = backend.load(cfg, "cuda" if torch.cuda.is_available() else "cpu", log)
    model = inner.model
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    held = local + list(model.buffers())          # ep_int4's packed experts are buffers
    log(f"features: rank {rank}/{world} holds {sum(p.numel() for p in local)} parameters "
        f"({sum(p.numel() * p.element_size() for p in held) / 1e9:.2f} GB with buffers)")
    if rank != 0:
        n = follow(inner)
        log(f"features: rank {rank}/{world} ran {n} forwards")
        return None                   # rank_exit.rank_main meets the other ranks at a barrier, then leaves
    leader = Leader(inner)
    try:
        rows = pq.read_table(RunLayout(cfg.run_dir).tokenized_train).to_pylist()
        manifest = extract_features(leader, rows, RunLayout(cfg.run_dir).features, inner.aux_layer_ids,
                                    f.shard_samples, f.batch_tokens, store_format=f.format, log=log,
                                    target=cfg.target.model_dump(), writer_threads=f.writer_threads,
                                    backend=backend.name, store_key=store_key, mix_backends=f.mix_backends)
    finally:
        leader.stop()                 # on an error too: the followers leave their loop and the run ends at once
    return manifest


def worker_main(argv: list[str] | None, description: str, run, init=init_group) -> None:
    """The command line of a torchrun features worker: `--config` (a PipelineConfig JSON file, read before the
    process group exists, so a bad file fails alone) and `--store-key`; then the rank runs through
    rank_exit.rank_main: `init()` the process group, `run(cfg, store_key, log=emit_line)` (its lines to torchrun's
    output), and leave in order (threads joined, group destroyed, os._exit), on an error too."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--config", required=True, type=Path, help="a PipelineConfig JSON file")
    ap.add_argument("--store-key", default=None, help="the store key recorded in the manifest and head.json "
                                                      "(pipeline.features_stage.store_key)")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    rank_main(init, lambda: run(cfg, args.store_key, log=emit_line))


def main(argv: list[str] | None = None) -> None:
    worker_main(argv, __doc__.split("\n")[0], run_worker)


if __name__ == "__main__":
    main()
