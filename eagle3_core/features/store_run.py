"""A feature store extracted by the run's features backend, with nothing of the features stage's keys or manifest:
in this process with a per-shard backend's Extractor (extract_here), or under torchrun (launch: the backend's
features.tp_size ranks, or whole-target workers). The features stage (pipeline.features_stage) and the evaluate
stage's replay recordings (their aux states, pipeline.evaluate_stage) both extract through it."""
from __future__ import annotations

import pyarrow.parquet as pq

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.layout import RunLayout
from eagle3_core.contract.manifest import read_manifest
from eagle3_core.distributed.launch import run_torchrun
from eagle3_core.features.backends import open_extractor, selected_backend
from eagle3_core.features.store import extract_features


def extract_here(cfg: PipelineConfig, skey: str, log, only_shards: set[int] | None = None,
             rows: list[dict] | None = None) -> dict:
    """The store extraction in this process with the selected per-shard backend's Extractor (open_extractor:
    loaded once per process)."""
    f, backend = cfg.features, selected_backend(cfg)
    extractor = open_extractor(cfg, log)
    rows = rows if rows is not None else pq.read_table(RunLayout(cfg.run_dir).tokenized_train).to_pylist()
    return extract_features(extractor, rows,
                            RunLayout(cfg.run_dir).features, extractor.aux_layer_ids, f.shard_samples,
                            f.batch_tokens, store_format=f.format, log=log, target=cfg.target.model_dump(),
                            writer_threads=f.writer_threads, only_shards=only_shards, backend=backend.name,
                            store_key=skey, mix_backends=f.mix_backends)


def launch(cfg: PipelineConfig, skey: str, workers: int | None, log, **rdzv) -> dict:
    """All shards under torchrun, running the row's launcher with its python (foreign_python): a torchrun row's
    features.tp_size ranks (tp_extract), or a per-shard row's `workers` whole-target workers per node
    (extract_workers); `rdzv`: nnodes, node_rank, rdzv_endpoint when the ranks span hosts.
    Every line the ranks print goes to `log` (and features/torchrun.log for a sharded target). Returns the store
    manifest rank 0 wrote. Raises TorchrunError if a rank fails (finished shards are kept: rerun to finish)."""
    f, backend, out = cfg.features, selected_backend(cfg), RunLayout(cfg.run_dir).features
    if workers and backend.torchrun:
        raise ValueError(f"features.backend {backend.name!r}: its ranks share one sharded target (features.tp_size); "
                         f"workers each load the whole target (backend 'hf')")
    nnodes = rdzv.get("nnodes", 1)
    if backend.torchrun and f.tp_size % nnodes:
        raise ValueError(f"features.tp_size = {f.tp_size} is not a multiple of nnodes = {nnodes}")
    out.mkdir(parents=True, exist_ok=True)
    config_file = out / ("tp_config.json" if backend.torchrun else "workers_config.json")
    config_file.write_text(cfg.model_dump_json())
    run_torchrun(["-m", backend.launcher, "--config", str(config_file), "--store-key", skey],
                 f.tp_size // nnodes if backend.torchrun else workers, on_line=log,
                 log_path=out / "torchrun.log" if backend.torchrun else None, **rdzv, **foreign_python(cfg))
    manifest = read_manifest(out / "manifest.json")
    if manifest is None or not manifest.get("complete"):
        raise RuntimeError(f"features: {out}/manifest.json does not list every shard after the torchrun (node "
                           f"{rdzv.get('node_rank', 0)}; node 0 writes it): rerun the stage to finish it")
    how = (f"target sharded over {f.tp_size} ranks ({backend.name})" if backend.torchrun
           else f"{manifest['workers']} workers")
    return {**manifest, **({"tp_size": f.tp_size, "expert_parallel": f.expert_parallel or backend.expert_parallel}
                           if backend.torchrun else {}), "how": how}


def foreign_python(cfg: PipelineConfig) -> dict:
    """run_torchrun's `python` and `env` for the run's features backend, its row's python: 'sglang' with
    cfg.sglang_python runs the ranks with that interpreter (features.sglang_env.sglang_python); every other backend
    with this process's ({})."""
    return selected_backend(cfg).python(cfg)
