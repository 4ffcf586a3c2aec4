"""The time an unmarked test may take (conftest's guard), scaled by how busy the machine was during that very test.

The guard used to scale by the 1-minute load average read at the test's end. That average lags: a second job that
starts on the same cores (a `make demo` beside `make test`) slows a test for a minute before the average shows it,
and the guard then failed a test that was only slowed (seen: 15 s against the 12 s allowed while the demo started;
0.07 s quiet). The share of the machine's CPU time that other processes took during the test is read from
/proc/stat (the kernel's cumulative CPU counters, man 5 proc) and this process's own CPU time (getrusage), both
before and after, so it has no lag.
"""
from __future__ import annotations

import os
import resource
from dataclasses import dataclass

MAX_SLOWDOWN = 10.0           # the most a busy machine may stretch a test's budget


def machine_busy_s() -> float | None:
    """Seconds of CPU time every process on this machine has used since boot (the 'cpu' line of /proc/stat, all
    fields but idle and iowait, in USER_HZ ticks); None where /proc/stat is not there (not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields[:8]) - fields[3] - fields[4]          # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """Seconds of CPU time (user + system) this process and its reaped children have used."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


@dataclass(frozen=True)
class Sample:
    """One reading: the machine's busy CPU seconds (None: unknown) and this process's CPU seconds."""
    machine: float | None
    own: float

    @classmethod
    def now(cls) -> "Sample":
        return cls(machine_busy_s(), own_cpu_s())


def slowdown(before: Sample, after: Sample, wall_s: float, cores: int) -> float:
    """How much the other processes stretched this interval, >= 1: 1 / (1 - f), f the share of the machine's
    capacity (cores x wall_s) they used, at most MAX_SLOWDOWN; 1 where the machine counters are unknown or the
    interval is empty."""
    if before.machine is None or after.machine is None or wall_s <= 0:
        return 1.0
    others = max(0.0, (after.machine - before.machine) - (after.own - before.own))
    share = min(others / (cores * wall_s), 1.0 - 1.0 / MAX_SLOWDOWN)
    return 1.0 / (1.0 - share)


def budget_s(base_s: float, before: Sample, after: Sample, wall_s: float, load_1min: float, cores: int) -> float:
    """Seconds a test that took `wall_s` may take: `base_s` (for 2 quiet cores) times the larger of the 1-minute
    load average over the cores and `slowdown` during the test, at least `base_s`."""
    return base_s * max(1.0, load_1min / cores, slowdown(before, after, wall_s, cores))
