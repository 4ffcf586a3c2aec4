"""How every torchrun rank of this project starts and ends: `rank_main`, the one place the features workers
(features.tp_extract: backends `hf_tp`, `ep_int4`, `sglang`; features.extract_workers) and the DDP trainer
(pipeline.train_ddp) go through.

Why a rank ends with os._exit (the cause of `terminate called without an active exception`, SIGABRT, at a rank's
very end; native stack from a core dump, torch 2.13, CPython 3.11): gloo runs each collective on one of the group's
worker threads (`pt_gloo_runloop`, ProcessGroupGloo::runLoop), which drops its reference to the finished work only
after the waiting main thread has been woken. The barrier before exit is such a work, and it keeps the works issued
before it (collectives on tensors whose Python objects, once Python lets go, are owned by C++): freeing it there
frees them (~AsyncBarrierWork, ~AsyncAllreduceWork, ~AsyncWork), and TensorImpl::decref_pyobject takes the GIL
(pybind11 gil_scoped_acquire). If the main thread has meanwhile returned and entered Py_FinalizeEx, CPython 3.11's
take_gil ends the calling thread with pthread_exit (PyThread_exit_thread); its forced unwind meets the noexcept
destructor and the C++ runtime calls std::terminate. A race, so only sometimes: 6 aborts in 30 runs of a 2-rank gloo
script that ends like a features follower (barrier, destroy_process_group, normal exit) on a 2-core machine at load
10-14, 0 in 35 of the same script through rank_main; 1 in 25 runs of the ep_int4 features test before this module.
destroy_process_group does not prevent it: torch keeps the group, and its threads, alive while anything refers to it
(measured: after destroy_process_group and gc.collect() a features rank still had `pt_gloo_runloop` x2 and
`gloo_tcp_loop` running). os._exit, after the rank's own clean-up, never enters interpreter finalization: no thread
can be ended under it.

The order at exit, on success and on an error alike: (1) the body's own clean-up (the shard writer drained and
closed, the prefetch pool shut down: their `with`/`finally`); (2) every other non-daemon Python thread joined
(a bounded wait; one still alive is an error naming it); (3) garbage collected (a DDP reducer in a reference cycle
holds the group); (4) on success only, a barrier (no rank tears its group down while another is still in a
collective; a failed rank must not wait in a barrier the others may never reach); (5) the process group destroyed;
(6) one line `rank R/W exit C: process group destroyed, live threads: none` (what tests read, checked here:
dist.is_initialized() False and no live non-daemon thread but the main one); (7) stdout and stderr flushed, then
os._exit(C). An error is printed through sys.excepthook first (torch's, which prefixes `[rankR]:`, the prefix
launch.root_cause reads).
"""
from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

import torch.distributed as dist

from eagle3_core.distributed.launch import die_with_parent, emit_line

THREAD_JOIN_S = 120.0          # a writer thread finishing its last shard; longer means a thread nobody stops


def live_threads() -> list[threading.Thread]:
    """The live non-daemon Python threads other than the main one (the ones a normal exit would wait for)."""
    return [t for t in threading.enumerate()
            if t is not threading.main_thread() and not t.daemon and t.is_alive()]


def join_threads(timeout_s: float = THREAD_JOIN_S) -> list[threading.Thread]:
    """Join every live non-daemon thread (live_threads), waiting at most `timeout_s` seconds in all; returns those
    still alive after that."""
    deadline = time.monotonic() + timeout_s
    for t in live_threads():
        t.join(max(0.0, deadline - time.monotonic()))
    return live_threads()


def exit_report(rank: int, world: int, code: int) -> str:
    """The line a rank prints just before it exits: its exit code, whether the process group is destroyed and the
    names of live non-daemon threads (none when clean)."""
    state = "still initialized" if dist.is_available() and dist.is_initialized() else "destroyed"
    names = ", ".join(t.name for t in live_threads()) or "none"
    return f"rank {rank}/{world} exit {code}: process group {state}, live threads: {names}"


def leave(rank: int, world: int, ok: bool, join_timeout_s: float = THREAD_JOIN_S) -> int:
    """Steps (2) to (6) of the module docstring; returns the exit code (1 if not `ok` or a thread outlived the
    join). Never raises: an error while leaving is printed and turns the code to 1."""
    code = 0 if ok else 1
    stuck = join_threads(join_timeout_s)
    if stuck:
        emit_line(f"rank {rank}/{world}: threads still alive at exit after {join_timeout_s:g} s: "
                  f"{', '.join(t.name for t in stuck)} (a writer or prefetch pool not closed)")
        code = 1
    gc.collect()
    try:
        if dist.is_initialized():
            if code == 0:
                dist.barrier()
            dist.destroy_process_group()
    except Exception:                                      # noqa: BLE001 (reported, and the rank fails)
        sys.excepthook(*sys.exc_info())
        code = 1
    emit_line(exit_report(rank, world, code))
    return code


def rank_main(init: Callable[[], None], body: Callable[[], object],
              join_timeout_s: float = THREAD_JOIN_S) -> NoReturn:
    """Run one torchrun rank and end the process (module docstring): die with the parent, `init()` (join the
    process group), `body()`, then leave in order and os._exit(0) on success (a SystemExit of code 0 or None
    too); on an exception (KeyboardInterrupt too) print it with its `[rankR]:` prefix, leave without the barrier
    and os._exit(1). A non-daemon thread still alive `join_timeout_s` seconds after the body is named and the
    exit code is 1. An error in `init()` propagates (no group to leave)."""
    die_with_parent()
    init()
    rank, world = dist.get_rank(), dist.get_world_size()
    ok = True
    try:
        body()
    except SystemExit as e:                                # sys.exit(0) in the body is a success
        ok = e.code in (None, 0)
    except BaseException:                                  # noqa: BLE001 (printed; the exit code says it)
        sys.excepthook(*sys.exc_info())
        ok = False
    code = leave(rank, world, ok, join_timeout_s)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
