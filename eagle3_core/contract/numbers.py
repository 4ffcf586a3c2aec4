"""Numbers as a person reads them in a run log or report: an ETA only once there is a rate, byte sizes and
fractions in words, and the machine's load at a measurement (a speed measured on a busy machine is flagged,
evaluation.speedup.load_flag)."""
from __future__ import annotations

import os

# an ETA from less than this much measured work is noise (the first item of a stage is mostly start-up)
MIN_ETA_ELAPSED_S = 1.0


def eta_text(elapsed_s: float, measured: int, remaining: int) -> str:
    """', ETA 3.2 min' (', ETA 40 s' under a minute, ', ETA 2.5 h' from 2 h) from `measured` items that ran here
    in `elapsed_s` seconds (items found done on disk or answered from a cache are not a rate) and `remaining`
    items still to run. '' until there is a rate (nothing measured yet, or under MIN_ETA_ELAPSED_S of it) and
    once nothing remains: a stage's first line never says 'ETA 0.0 min'."""
    if measured <= 0 or remaining <= 0 or elapsed_s < MIN_ETA_ELAPSED_S:
        return ""
    eta = elapsed_s / measured * remaining
    if eta >= 7200:
        return f", ETA {eta / 3600:.1f} h"
    return f", ETA {eta / 60:.1f} min" if eta >= 60 else f", ETA {eta:.0f} s"


def human_bytes(n: float) -> str:
    """'4.6 kB', '1.23 GB' (decimal units, as disks are sold); '512 B' below 1 kB."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def percent(fraction: float) -> str:
    """'100.0%', '37.5%': a fraction (0..1) as a percentage to one decimal, never a bare '1'."""
    return f"{fraction:.1%}"


def machine_load() -> dict:
    """{'loadavg_1m': the 1-minute load average, 'cpus': CPUs this process may run on} at the time of a speed
    measurement (os.getloadavg; None where the platform has none)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"loadavg_1m": None if load is None else round(load, 2), "cpus": cpus}


def checkpoint_place(epoch: int, batch: int) -> str:
    """Where a training checkpoint resumes, in words: 'epoch 3, batch 40' inside an epoch (epoch 0-based), 'after
    epoch 10' at an epoch boundary (epoch = the epochs done: never 'epoch 11, batch 0' after the last of 10)."""
    if batch == 0:
        return f"after epoch {epoch}" if epoch > 0 else "before the first epoch"
    return f"epoch {epoch + 1}, batch {batch}"
