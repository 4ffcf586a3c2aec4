"""Extraction backends: the table the features stage dispatches on (pipeline.features_stage), one row per backend
holding every fact about it (`Backend`); no other module compares a backend's name.

A backend gives the feature store an Extractor (features.extract.Extractor) and says how it runs; everything else
is the store's (features.store): the shard plan, content keys, checksums, resume, the manifest and head.json,
written through its one writer (store.write_record). A row declares:

- granularity (`torchrun`): False, per-shard tasks: the flow runs one task per shard in its own process
  (run_features_shard), the target loaded once per process (open_extractor), or all shards in one call
  (run_features; with `workers` a torchrun of whole-target workers each owning shards r, r+W, ...); True, one
  task for all shards: a torchrun of features.tp_size ranks.
- launcher: the module torchrun runs (`python -m`): features.tp_extract for a torchrun row, whose rank 0 alone runs
  the store and writes while the others follow its broadcasts (tp_extract.follow); features.extract_workers for
  a per-shard row's `workers`.
- python: the interpreter and environment of those ranks (run_torchrun's `python` and `env`): this process's, or
  the config's sglang_python (sglang_env.sglang_python); python_check, what check asks of that environment.
- load: who loads the target: every rank of the torchrun its part, or the calling process (or each worker) all.
- memory: the memory model check weighs (target.memory_fit: bytes one rank holds, fit problems); expert_parallel,
  whether the row always splits routed experts by expert.
- replay: no single process holds the target, so eval.evaluator 'auto' replays the target's recorded outputs and a
  sampled evaluation is refused (resolved_evaluator, must_replay).
- outputs: Extractor.forward gives aux [B, T, 3H_t] for every token, and final [B, T, H_t] with its lm_head argmax
  target_top1 [B, T]; training reads final and argmax only at positions p with loss_mask[p + 1] = 1, but the
  store holds them for every token (a sparse store of those positions is a store format's change).
- the backend's name is recorded in each shard's entry and kept out of every key (it changes how features are
  computed, not what); a store mixing backends is refused unless features.mix_backends.

A new backend is a module with its `load` and a row in BACKENDS (docs/architecture.md, "An extraction backend"); a
per-shard backend that loads the whole target needs only the first four fields.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.layout import RunLayout
from eagle3_core.features.extract import Extractor, HFExtractor
from eagle3_core.features.sglang_env import sglang_env_check, sglang_python
from eagle3_core.features.sglang_worker import load_sglang
from eagle3_core.features.specforge_import import aux_spot_check, head_tensors, imported_extractor
from eagle3_core.features.store_formats import needs_head
from eagle3_core.features.vocab_split import split_lm_head
from eagle3_core.target.ep_loading import load_int4_target
from eagle3_core.target.family import num_layers, resolve_aux_ids
from eagle3_core.target import loading  # load_target read per call: tests replace it there
from eagle3_core.target.loading import load_target_config, local_model_dir
from eagle3_core.target.memory_fit import (
    MemoryModel,
    backend_facts,
    ep_int4_fit,
    sglang_fit,
    tensor_parallel_fit,
    whole_target_fit,
)

TP_RANKS = "eagle3_core.features.tp_extract"               # the launcher of a torchrun row: ranks share one target
WORKERS = "eagle3_core.features.extract_workers"           # of a per-shard row's `workers`: each its whole target


def this_python(cfg: PipelineConfig) -> dict:
    """run_torchrun's `python` and `env` for a backend whose ranks run with this process's interpreter: none ({})."""
    return {}


@dataclass(frozen=True)
class Backend:
    """A row of the backend table (module docstring). name: features.backend's value (recorded per shard).
    torchrun: the granularity (False: per-shard tasks in the calling process; True: one torchrun of
    features.tp_size ranks for all shards, rank 0 writing). load(cfg, device, log) -> Extractor: the target (or what
    stands for it) ready to extract, on `device` ('cuda', 'cuda:N' or 'cpu'); under torchrun called on every rank
    of the initialised process group. runs: what `python -m eagle3_core.check` says runs ('{w}': features.tp_size).
    launcher: the module torchrun runs (TP_RANKS, WORKERS). python(cfg) -> run_torchrun's {python, env} ({}: this
    process's). python_check(cfg, gpus, env) -> (facts, problems) of that environment, None: nothing to check.
    memory: its memory model (target.memory_fit; None: it runs no target). expert_parallel: routed experts always
    split by expert (whatever features.expert_parallel says). replay: no single process holds the target (the
    evaluator replays)."""
    name: str
    torchrun: bool
    load: Callable[[PipelineConfig, str, Callable], Extractor]
    runs: str
    launcher: str = WORKERS
    python: Callable[[PipelineConfig], dict] = this_python
    python_check: Callable[[PipelineConfig, tuple[int, int] | None, dict | None],
                           tuple[dict, list[tuple[str, str]]]] | None = None
    memory: MemoryModel | None = whole_target_fit
    expert_parallel: bool = False
    replay: bool = False


def aux_ids_of(cfg: PipelineConfig, model) -> list[int]:
    """features.aux_layer_ids resolved for the loaded target `model` (family.resolve_aux_ids)."""
    return resolve_aux_ids(cfg.features.aux_layer_ids, num_layers(model.config))


def split_extractor(cfg: PipelineConfig, model) -> Extractor:
    """An HFExtractor of this rank's share of a sharded target with lm_head split over the vocabulary across the
    ranks where it is whole (features.vocab_split.split_lm_head), computing fp8_topk's teacher in the forward
    when features.format needs it (store_formats.needs_head)."""
    head = split_lm_head(model)
    return HFExtractor(model, aux_ids_of(cfg, model), split_head=head, teacher=needs_head(cfg.features.format))


def load_hf(cfg: PipelineConfig, device: str, log=print) -> Extractor:
    """'hf': the whole target in this process (target.loading.load_target) as an HFExtractor."""
    model = loading.load_target(cfg.target, device)
    return HFExtractor(model, aux_ids_of(cfg, model))


def load_hf_tp(cfg: PipelineConfig, device: str, log=print) -> Extractor:
    """'hf_tp': this rank's share of the target under transformers' tensor-parallel plan (and its expert-parallel
    plan with features.expert_parallel), features.tp_size ranks."""
    f = cfg.features
    model = loading.load_target(cfg.target, device, tp_size=f.tp_size, expert_parallel=f.expert_parallel)
    return split_extractor(cfg, model)


def load_ep_int4(cfg: PipelineConfig, device: str, log=print) -> Extractor:
    """'ep_int4': this rank's share of a DeepSeek-V3 / Kimi-K2.5 target with its routed experts kept packed INT4
    (target.ep_loading; features.shard_attention picks head-sharded or whole MLA)."""
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else device
    model = load_int4_target(cfg.target, dev, dist.get_rank(), dist.get_world_size(),
                             shard_attention=cfg.features.shard_attention)
    return split_extractor(cfg, model)


def load_specforge_import(cfg: PipelineConfig, device: str, log=print) -> Extractor:
    """'specforge_import' (features.import_from set): SpecForge's offline feature files, every file checked
    against this run's tokenization (specforge_import.imported_extractor); of the target only its config,
    embedding and lm_head are read (head_tensors). Where features.backend loads the whole target in one process
    ('hf': loads_whole_target) the first sample's aux states are checked against the target's own (aux_spot_check)."""
    path = RunLayout(cfg.run_dir).tokenized_train
    rows = pq.read_table(path).to_pylist()
    tcfg = load_target_config(cfg.target)
    ids = resolve_aux_ids(cfg.features.aux_layer_ids, num_layers(tcfg))
    embed, lm, names = head_tensors(local_model_dir(cfg.target), cfg.target.revision)
    extractor = imported_extractor(cfg.features.import_from, rows, tcfg, embed, lm, ids, str(path))
    log(f"features: importing {cfg.features.import_from}; read {names} of the target's weights")
    if loads_whole_target(cfg.features.backend):
        diff = aux_spot_check(extractor, loading.load_target(cfg.target, "cpu"), rows[0])
        log(f"features: sample {rows[0]['id']!r}: imported aux states within {diff:.1%} of the target's")
    return extractor


def _load_sglang(cfg: PipelineConfig, device: str, log=print) -> Extractor:
    """'sglang': SGLang's own ModelRunner on this rank (features/sglang_worker.py, run in the SGLang environment)."""
    return load_sglang(cfg, device, log)


BACKENDS: dict[str, Backend] = {b.name: b for b in [
    Backend("hf", False, load_hf, "HF transformers in process (HFExtractor)", launcher=WORKERS,
            memory=whole_target_fit),
    Backend("hf_tp", True, load_hf_tp,
            "transformers' tensor-parallel plan over {w} torchrun ranks (features/tp_extract.py)",
            launcher=TP_RANKS, memory=tensor_parallel_fit, replay=True),
    Backend("ep_int4", True, load_ep_int4,
            "{w} torchrun ranks, routed experts kept INT4 as stored, 1/{w} of them per rank, MLA heads split (this "
            "project's plan for DeepSeek-V3 / Kimi-K2.5: target/ep_loading.py)",
            launcher=TP_RANKS, memory=ep_int4_fit, expert_parallel=True, replay=True),
    Backend("sglang", True, _load_sglang,
            "SGLang's own ModelRunner in {w} torchrun ranks (tensor parallel, its kernels and INT4 MoE), in the "
            "environment of the config's sglang_python (features/sglang_worker.py)",
            launcher=TP_RANKS, python=sglang_python, python_check=sglang_env_check, memory=sglang_fit, replay=True),
    Backend("specforge_import", False, load_specforge_import,
            "SpecForge's offline feature files imported (features.import_from); no target forward",
            launcher=WORKERS, memory=None),
]}

IMPORT = "specforge_import"                        # the backend features.import_from selects, whatever .backend says


def backend_name(cfg: PipelineConfig) -> str:
    """The backend that runs: 'specforge_import' when features.import_from is set (an import runs no target),
    else features.backend."""
    return IMPORT if cfg.features.import_from else cfg.features.backend


def selected_backend(cfg: PipelineConfig) -> Backend:
    """BACKENDS' row of backend_name(cfg). Raises ValueError naming features.backend and the known backends."""
    name = backend_name(cfg)
    if name not in BACKENDS or (name == IMPORT and not cfg.features.import_from):
        known = [n for n in BACKENDS if n != IMPORT]
        raise ValueError(f"features.backend {name!r} is not a features backend; choose one of {known} (or set "
                         f"features.import_from to import SpecForge's files)")
    return BACKENDS[name]


def loads_whole_target(backend: str) -> bool:
    """True when backend `backend` (features.backend) loads the whole target in the calling process (a per-shard
    row that runs one: 'hf'); False for a torchrun row, an import, or a name not in BACKENDS."""
    row = BACKENDS.get(backend)
    return row is not None and not row.torchrun and row.memory is not None


def must_replay(backend: str) -> bool:
    """True when no single process holds the target with backend `backend` (its row's replay): the evaluator
    replays recorded outputs and a sampled evaluation is refused. False for a name not in BACKENDS."""
    row = BACKENDS.get(backend)
    return row is not None and row.replay


def resolved_evaluator(evaluator: str, features_backend: str) -> str:
    """'decode' or 'replay' for eval.evaluator given features.backend (config.eval_config.EvalConfig.evaluator):
    'auto' replays where must_replay(features_backend)."""
    if evaluator != "auto":
        return evaluator
    return "replay" if must_replay(features_backend) else "decode"


def memory_facts(cfg: PipelineConfig, tcfg, gpus: tuple[int, int] | None) -> tuple[dict, list[tuple[str, str]]]:
    """(facts, problems) of features.backend's memory model on `gpus` (target.memory_fit.backend_facts with its row's
    memory and expert_parallel; a name not in BACKENDS: the facts every backend shares, no problem). The row of
    features.backend, not of an import (features.import_from), is weighed: it names the target the run holds."""
    row = BACKENDS.get(cfg.features.backend)
    return backend_facts(cfg, tcfg, gpus, row.memory if row else None, bool(row and row.expert_parallel))


def local_device() -> str:
    """This process's device for a whole-target backend: cuda:LOCAL_RANK under torchrun, 'cuda' in a single
    process with a GPU, else 'cpu'."""
    if not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{os.environ['LOCAL_RANK']}" if "LOCAL_RANK" in os.environ else "cuda"


_opened: dict[tuple, Extractor] = {}


def open_extractor(cfg: PipelineConfig, log=print) -> Extractor:
    """The selected per-shard backend's Extractor, loaded once per process for all shards of a run (the flow's
    shard tasks, threads of one process, share it; close_extractors frees it). Raises ValueError for a torchrun
    backend (its ranks load the target: tp_extract)."""
    backend = selected_backend(cfg)
    if backend.torchrun:
        raise ValueError(f"features.backend {backend.name!r} extracts all shards in one torchrun (run_features), "
                         f"not one shard per task")
    tokenized = RunLayout(cfg.run_dir).tokenized_train
    key = (backend.name, cfg.target.model_dump_json(), cfg.features.model_dump_json(), str(tokenized),
           tokenized.stat().st_mtime_ns if backend.name == IMPORT else None)
    if key not in _opened:
        _opened.clear()
        _opened[key] = backend.load(cfg, local_device(), log)
    return _opened[key]


def close_extractors() -> None:
    """Free the Extractor open_extractor holds (the target's weights)."""
    _opened.clear()
