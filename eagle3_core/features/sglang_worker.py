"""The `sglang` features backend's `load` (its row in features.backends): this torchrun rank's share of the
target in SGLang's own ModelRunner, as an Extractor. The ranks are features.tp_extract's (one torchrun of
features.tp_size ranks: rank 0 leads and writes the store through features.store.extract_features, the others follow
its broadcasts), run by the python of the SGLang environment (the config's sglang_python;
features.sglang_env.sglang_python, its row's python, puts this project first on its PYTHONPATH).

Legend: W ranks (one GPU each), L target decoder layers.
Every rank builds SGLang's ModelRunner on its GPU (features/sglang_runner.py: tp_size W, ep_size W with
features.expert_parallel, else 1; features.mem_fraction_static) and sets the aux layers under the pinned version's
layer-id rule; all ranks run every prefill batch together (SGLang's collectives, and the argmax's all-gather, need
each rank on the same batch). Only rank 0 reads the target's embedding and lm_head, from the checkpoint
(specforge_import.head_tensors), for head.safetensors.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from eagle3_core.config import PipelineConfig
from eagle3_core.features.sglang_extract import SGLangExtractor
from eagle3_core.features.specforge_import import head_tensors
from eagle3_core.target.family import resolve_aux_ids


def load_sglang(cfg: PipelineConfig, device: str, log=print) -> SGLangExtractor:
    """This rank's SGLangExtractor: SGLang's runner over the torchrun world (its default group initialised,
    tp_extract.init_group), the aux layers resolved for the target's L and set (sglang_runner.Runner.set_aux_layers),
    the head read from the checkpoint on rank 0 only. `device`: ignored (each rank takes cuda:LOCAL_RANK, as
    SGLang's gpu_id). Raises ValueError if the world size is not features.tp_size, for a GGUF target, or for aux
    ids the layer-id rule cannot express; what SGLang raises (no GPU, weights that do not fit)."""
    from eagle3_core.features.sglang_runner import Runner  # optional: imports SGLang, in its own environment only
    f, t, rank, world = cfg.features, cfg.target, dist.get_rank(), dist.get_world_size()
    if world != f.tp_size:
        raise ValueError(f"features.tp_size = {f.tp_size} but torchrun started {world} processes; launch with "
                         f"--nproc-per-node {f.tp_size}")
    if t.gguf_file:
        raise ValueError(f"target.gguf_file {t.gguf_file!r}: the 'sglang' features backend loads safetensors "
                         f"checkpoints (a directory or hub name as target.model)")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    runner = Runner(t.model, t.revision, t.trust_remote_code, f.tp_size, f.tp_size if f.expert_parallel else 1,
                    rank, local, f.mem_fraction_static, int(os.environ.get("MASTER_PORT", "0")) + 1)
    ids = resolve_aux_ids(f.aux_layer_ids, runner.num_layers)
    inputs = runner.set_aux_layers(ids)
    log(f"features: rank {rank}/{world}: SGLang runner ready (tp {f.tp_size}, ep "
        f"{f.tp_size if f.expert_parallel else 1}); aux layers {ids} = inputs of layers {inputs}")

    def head():
        emb, lm, _ = head_tensors(t.model, t.revision)
        return emb, lm

    dev = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    return SGLangExtractor(runner, ids, runner.hidden_size, runner.config, dev, head if rank == 0 else None)
