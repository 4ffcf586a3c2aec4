"""Prefect tasks that run torchrun: multi-GPU training, multi-worker extraction and extraction from a target
sharded over several GPUs (eagle3_core.distributed).

Each streams every line of torchrun and its workers into the run log as it comes, holds the `gpu` tag (a `gpu`
concurrency limit of 1 per host keeps two of them off the same GPUs), and leaves no process behind: the launcher
stops torchrun's whole tree when the flow run is cancelled (Prefect raises TerminationSignal in the flow's thread)
or fails, and torchrun dies with the thread that started it if the flow process is SIGKILLed.
A retried task (or flow-run retry) starts torchrun again, which resumes from the newest checkpoint (training) or
extracts only the missing shards (features).
"""
from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.layout import RunLayout
from eagle3_core.contract.manifest import read_manifest
from eagle3_core.distributed.launch import run_torchrun
from eagle3_core.pipeline.features_stage import run_features


@task(name="torchrun", cache_policy=NO_CACHE, tags=["gpu"])
def torchrun_task(args: list[str], nproc_per_node: int, log_file: str | None = None, nnodes: int = 1,
                  node_rank: int = 0, rdzv_endpoint: str | None = None) -> None:
    """`torchrun --nproc-per-node N <args>` with its output in the run log (and `log_file`)."""
    run_torchrun(args, nproc_per_node, on_line=get_run_logger().info, log_path=Path(log_file) if log_file else None,
                 nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint)


@task(name="train-ddp", cache_policy=NO_CACHE, tags=["gpu"])
def train_ddp_task(config: PipelineConfig, nproc_per_node: int, nnodes: int = 1, node_rank: int = 0,
                   rdzv_endpoint: str | None = None) -> dict:
    """The train stage on `nproc_per_node` GPUs (x `nnodes` hosts) with DDP; returns the draft manifest."""
    out = RunLayout(config.run_dir).draft
    out.mkdir(parents=True, exist_ok=True)
    cfg_file = out / "ddp_config.json"
    cfg_file.write_text(config.model_dump_json())
    torchrun_task.fn(["-m", "eagle3_core.pipeline.train_ddp", "--config", str(cfg_file)], nproc_per_node,
                     str(out / "torchrun.log"), nnodes, node_rank, rdzv_endpoint)
    return read_manifest(out / "manifest.json")


@task(name="features-multi-gpu", cache_policy=NO_CACHE, tags=["gpu"])
def features_distributed_task(config: PipelineConfig, nproc_per_node: int, nnodes: int = 1, node_rank: int = 0,
                              rdzv_endpoint: str | None = None) -> dict:
    """The features stage with one extraction worker per GPU, each loading the whole target (run_features with
    `workers`); returns the features manifest."""
    return run_features(config, log=get_run_logger().info, workers=nproc_per_node, nnodes=nnodes,
                        node_rank=node_rank, rdzv_endpoint=rdzv_endpoint)


@task(name="features-tp", cache_policy=NO_CACHE, tags=["gpu"])
def features_tp_task(config: PipelineConfig, nnodes: int = 1, node_rank: int = 0,
                     rdzv_endpoint: str | None = None) -> dict:
    """The features stage for a torchrun backend ('hf_tp', 'ep_int4': features.backends): the target sharded over
    features.tp_size GPUs (all shards in one torchrun, every rank's lines in the run log and features/torchrun.log);
    returns the manifest."""
    return run_features(config, log=get_run_logger().info, nnodes=nnodes, node_rank=node_rank,
                        rdzv_endpoint=rdzv_endpoint)
