"""conftest's time guard (time_guard.py): the budget of an unmarked test grows by how busy other processes kept the
machine during the test itself, read from the kernel's counters, not from the lagging load average."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import time_guard
from time_guard import Sample, budget_s, slowdown


def test_the_slowdown_is_one_over_the_share_left_to_the_test():
    # 2 cores for 10 s: 20 CPU-seconds of capacity
    assert slowdown(Sample(100.0, 5.0), Sample(108.0, 13.0), 10.0, 2) == pytest.approx(1.0)     # all of it ours
    assert slowdown(Sample(100.0, 5.0), Sample(118.0, 13.0), 10.0, 2) == pytest.approx(2.0)     # others: 10 of 20
    assert slowdown(Sample(100.0, 5.0), Sample(115.0, 5.0), 10.0, 2) == pytest.approx(4.0)      # others: 15 of 20
    assert slowdown(Sample(0.0, 0.0), Sample(500.0, 0.0), 10.0, 2) == pytest.approx(time_guard.MAX_SLOWDOWN)
    assert slowdown(Sample(None, 0.0), Sample(None, 9.0), 10.0, 2) == 1.0                         # not Linux
    assert slowdown(Sample(1.0, 0.0), Sample(1.0, 0.0), 0.0, 2) == 1.0


def test_the_budget_takes_the_larger_of_the_load_average_and_the_slowdown():
    quiet, busy = (Sample(100.0, 5.0), Sample(108.0, 13.0)), (Sample(100.0, 5.0), Sample(118.0, 13.0))
    assert budget_s(10.0, *quiet, 10.0, load_1min=0.5, cores=2) == 10.0
    assert budget_s(10.0, *quiet, 10.0, load_1min=6.0, cores=2) == pytest.approx(30.0)
    assert budget_s(10.0, *busy, 10.0, load_1min=1.0, cores=2) == pytest.approx(20.0)


def test_busy_processes_started_beside_a_test_stretch_its_budget_at_once():
    """As many busy loops as cores, for 1.5 s: the others take most of the machine, seen within the interval (the
    1-minute load average would still be near its old value)."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.5)                                  # the interpreters are up and spinning
        before, t0 = Sample.now(), time.monotonic()
        time.sleep(1.5)
        after, wall = Sample.now(), time.monotonic() - t0
    finally:
        for p in loops:
            p.kill()
            p.wait()
    assert after.own - before.own < 0.2                  # this process slept: the busy time was the loops'
    assert slowdown(before, after, wall, os.cpu_count() or 1) > 3.0
