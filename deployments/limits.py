"""The `gpu` tag concurrency limit and the work pools, created idempotently on the Prefect server in use."""
from __future__ import annotations

import asyncio
import os

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

GPU_TAG = "gpu"
CPU_POOL = "eagle3-cpu"   # process pool: prompts, generation (HTTP to the server), vocab
GPU_POOL = "eagle3-gpu"   # process pool, workers on GPU hosts: features, train, evaluate, the end-to-end flow


def gpu_slots() -> int:
    """Tasks tagged `gpu` that may run at once: EAGLE3_GPU_SLOTS, else the GPUs torch sees, at least 1."""
    if os.environ.get("EAGLE3_GPU_SLOTS"):
        return int(os.environ["EAGLE3_GPU_SLOTS"])
    import torch
    return max(torch.cuda.device_count(), 1)


async def ensure_gpu_limit(slots: int | None = None) -> int:
    """Create (or update) the `gpu` tag concurrency limit; returns its value."""
    slots = slots or gpu_slots()
    async with get_client() as client:
        try:
            if (await client.read_concurrency_limit_by_tag(GPU_TAG)).concurrency_limit == slots:
                return slots
        except ObjectNotFound:
            pass
        await client.create_concurrency_limit(tag=GPU_TAG, concurrency_limit=slots)
    return slots


async def ensure_work_pools() -> None:
    """Create the CPU and GPU process work pools if they are missing."""
    async with get_client() as client:
        for name, what in ((CPU_POOL, "CPU stages"), (GPU_POOL, "GPU stages (one worker per GPU)")):
            try:
                await client.create_work_pool(WorkPoolCreate(name=name, type="process", description=what))
            except ObjectAlreadyExists:
                pass


def ensure_all() -> None:
    asyncio.run(ensure_gpu_limit())
    asyncio.run(ensure_work_pools())
