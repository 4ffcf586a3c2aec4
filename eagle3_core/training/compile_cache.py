"""A persistent torch.compile cache for training runs on the same machine, so that the compile of a run's TTT graphs
(the largest fixed cost of a short run: first epoch 24-59 s against ~10 s later on one GPU) is paid once per
machine, torch version and GPU, not once per run.

What is kept (torch's own on-disk caches, "modular caching" in PyTorch's compile-time caching recipe,
pytorch.org/tutorials/recipes/torch_compile_caching_tutorial): inductor's FX graph cache (the generated kernels,
Triton's compiled binaries bundled in), the AOTAutograd cache (the traced and partitioned forward/backward graphs)
and autotuning results, all under TORCHINDUCTOR_CACHE_DIR (torch/_inductor/runtime/cache_dir_utils.py). torch
validates every entry against its own version, Triton's and the GPU; the folder is also named by torch's version,
Python's and the device (`cache_dir_for`), so that versions never share one. torch's "Mega-Cache"
(torch.compiler.save_cache_artifacts / load_cache_artifacts) serialises these same caches into one blob to move
them between machines; on one machine the folder itself is that cache.

AOTAutograd skips graphs that hold a custom autograd.Function unless
torch._functorch.config.autograd_cache_allow_custom_autograd_functions is set; the TTT loss
(ttt.SoftCrossEntropyFromLogits) is one, so it is set while the cache is on: dynamo traces the Function's forward
and backward into the graph the cache key is computed from, so a changed backward is a cache miss
(tests/test_compile_cache.py checks that).

Turn it off with EAGLE3_COMPILE_CACHE=off (torch's defaults then apply: a cache under the system's temp folder);
EAGLE3_COMPILE_CACHE=PATH puts it elsewhere; a TORCHINDUCTOR_CACHE_DIR the user set to a folder of their own is
kept as it is (benchmarks set one to measure a cold compile).
"""
from __future__ import annotations

import importlib
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from eagle3_core.target.loading import cache_root


def _torch(module: str):
    """One of torch's own compile modules (torch has no public API for these settings; torch's caching recipe
    names them)."""
    return importlib.import_module(module)


ENV = "EAGLE3_COMPILE_CACHE"          # 'off' (or '0', 'false'): torch's defaults; a path: the cache's parent folder
OFF = ("off", "0", "false", "no")


def device_name(device: torch.device) -> str:
    """The device's name as torch reports it ('NVIDIA H100 80GB HBM3'), 'cpu' on a CPU."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def cache_dir_for(device: torch.device, root: Path | None = None) -> Path:
    """root/compile/<torch version>-py<major.minor>-<device name>, a name safe on any file system: the folder of
    compiled artifacts valid for this torch, Python and device. root: default EAGLE3_COMPILE_CACHE if it is a path,
    else the run cache root (target.loading.cache_root: EAGLE3_CACHE or ~/.cache/eagle3-pipeline)."""
    if root is None:
        env = os.environ.get(ENV, "")
        root = Path(env) if env and env.lower() not in OFF else cache_root()
    key = f"torch{torch.__version__}-py{sys.version_info.major}.{sys.version_info.minor}-{device_name(device)}"
    return Path(root) / "compile" / re.sub(r"[^A-Za-z0-9._+-]+", "_", key)


def _clear_inductor_memory_caches() -> None:
    """Forget inductor's in-process lookups of cache paths (what torch's own temporary_cache_dir does on a switch)."""
    _torch("torch._inductor.utils").clear_caches()


@contextmanager
def persistent_compile_cache(device: torch.device, log=print):
    """Within the block, torch.compile reads and writes its caches in cache_dir_for(device), with AOTAutograd's
    cache allowed for custom autograd Functions (module docstring); both restored on exit. Does nothing (one log
    line says why) under EAGLE3_COMPILE_CACHE=off or when TORCHINDUCTOR_CACHE_DIR names another folder than
    torch's default (torch itself sets the variable to its default once it has looked the folder up)."""
    functorch_config = _torch("torch._functorch.config")
    default_cache_dir = _torch("torch._inductor.runtime.cache_dir_utils").default_cache_dir
    setting = os.environ.get(ENV, "")
    if setting.lower() in OFF:
        log(f"train: compile cache: torch's default ({ENV}={setting})")
        yield None
        return
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if before is not None and os.path.abspath(before) != os.path.abspath(default_cache_dir()):
        log(f"train: compile cache: TORCHINDUCTOR_CACHE_DIR={before} (set by the environment)")
        yield Path(before)
        return
    where = cache_dir_for(device)
    where.mkdir(parents=True, exist_ok=True)
    warm = any(where.iterdir())
    log(f"train: compile cache {where} ({'warm' if warm else 'empty: this run compiles and fills it'}; "
        f"{ENV}=off turns it off)")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(where)
    _clear_inductor_memory_caches()
    try:
        with functorch_config.patch(autograd_cache_allow_custom_autograd_functions=True):
            yield where
    finally:
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before
        _clear_inductor_memory_caches()
