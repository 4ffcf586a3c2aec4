"""Feature extraction from a target sharded over several GPUs with transformers' own tensor-parallel plan (and its
expert-parallel plan for MoE targets): the `hf_tp` backend; with features.backend 'ep_int4' the same ranks hold a
DeepSeek-V3 / Kimi-K2.5 target with its routed experts packed INT4 (target.ep_loading), the rest unchanged. `torchrun
--nproc-per-node N -m eagle3_core.features.tp_extract --config run.json` with features.tp_size = N; `run_features_tp` is
the stage function that launches it (pipeline.features_stage) and returns the features manifest, like run_features.

Legend: W = tp_size ranks (one process per GPU), B batch, T padded length, H_t target hidden.
Every rank holds 1/W of the sharded weights (target.load_target with tp_size; plans: the config's
`base_model_tp_plan`, `base_model_ep_plan`) and all ranks run every forward together: the collectives inside the
sharded layers need each rank on the same batch. The residual stream is replicated after each decoder layer
(row-wise projections all-reduce their outputs), so the aux capture of extract.HFExtractor applies unchanged and
every rank ends up holding the same aux [B, T, 3H_t] and final [B, T, H_t].

Shards are written once, by rank 0 (the leader), through the one-process code path itself: rank 0 runs
features.extract_features with a `Leader` extractor whose every forward first tells the other ranks (followers)
which sequences to run (a broadcast of the token ids), so the store's plan, content keys, checksums, resume and
manifest are those of the `hf` backend (same file names and manifest format). A killed rank ends the run (torchrun
stops the others); the shard writer's tmp-fsync-rename and the manifest rewritten after each finished shard mean
that what the manifest lists is complete, and a rerun extracts only the rest.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from eagle3_core.config import PipelineConfig, load_config
from eagle3_core.contract.layout import RunLayout
from eagle3_core.distributed.launch import die_with_parent, emit_line
from eagle3_core.features.extract import HFExtractor

_FORWARD, _HEAD, _STOP = "forward", "head", "stop"


def _send(command: tuple) -> tuple:
    """Broadcast one command from rank 0 to every rank (pickled, over the CPU group: a few KB of token ids);
    returns it on every rank."""
    box = [command if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, device=torch.device("cpu"))
    return box[0]


class Leader:
    """Rank 0's Extractor (extract.Extractor) over a tensor-parallel HFExtractor: each call is first broadcast to
    the followers (`follow`), then run here; `stop()` releases them. Outputs as HFExtractor's."""

    def __init__(self, inner: HFExtractor):
        self.inner = inner
        self.model, self.aux_layer_ids = inner.model, inner.aux_layer_ids
        self.hidden_size, self.device = inner.hidden_size, inner.device

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


def run_worker(cfg: PipelineConfig, log=print) -> dict | None:
    """One rank of the `hf_tp` extraction (an initialised process group of features.tp_size ranks): load the
    target's shard, then lead (rank 0: features.extract_features, the store written here) or follow. Returns the
    store manifest on rank 0, None elsewhere. Raises ValueError if the world size is not features.tp_size."""
    import pyarrow.parquet as pq

    from eagle3_core.features.store import extract_features
    from eagle3_core.target.family import num_layers, resolve_aux_ids
    from eagle3_core.target.loading import load_target
    f, rank, world = cfg.features, dist.get_rank(), dist.get_world_size()
    if world != f.tp_size:
        raise ValueError(f"features.tp_size = {f.tp_size} but torchrun started {world} processes; launch with "
                         f"--nproc-per-node {f.tp_size} (times nodes)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if f.backend == "ep_int4":               # INT4 experts and the project's own plan (target.ep_loading)
        from eagle3_core.target.ep_loading import load_int4_target
        model = load_int4_target(cfg.target, torch.device(device, torch.cuda.current_device()) if device == "cuda"
                                 else device, rank, world, shard_attention=f.shard_attention)
    else:
        model = load_target(cfg.target, device, tp_size=f.tp_size, expert_parallel=f.expert_parallel)
    inner = HFExtractor(model, resolve_aux_ids(f.aux_layer_ids, num_layers(model.config)))
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    held = local + list(model.buffers())          # ep_int4's packed experts are buffers
    log(f"features: rank {rank}/{world} holds {sum(p.numel() for p in local)} parameters "
        f"({sum(p.numel() * p.element_size() for p in held) / 1e9:.2f} GB with buffers)")
    if rank != 0:
        n = follow(inner)
        log(f"features: rank {rank}/{world} ran {n} forwards")
        dist.barrier()                # leave together: a rank tearing its groups down first aborted (SIGABRT)
        return None
    leader = Leader(inner)
    try:
        rows = pq.read_table(RunLayout(cfg.run_dir).tokenized_train).to_pylist()
        manifest = extract_features(leader, rows, RunLayout(cfg.run_dir).features, inner.aux_layer_ids, f.shard_samples,
                                    f.batch_tokens, store_format=f.format, log=log, target=cfg.target.model_dump(),
                                    writer_threads=f.writer_threads)
    finally:
        leader.stop()                 # on an error too: the followers leave their loop and the run ends at once
    dist.barrier()
    return manifest


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, type=Path, help="a PipelineConfig JSON file")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    die_with_parent()
    init_group()
    try:
        run_worker(cfg, log=emit_line)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
