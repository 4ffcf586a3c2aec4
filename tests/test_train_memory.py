"""training.train_memory: the peak-memory model of a training step, against every peak the benchmark measured."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from eagle3_core.training import train_memory as tm
from eagle3_core.training.draft_model import DraftShape

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from train_throughput import SHAPES, draft_shape  # noqa: E402  (the drafts the peaks were measured on)

# torch.cuda.get_device_properties(0).total_memory of the H100 that ran out of memory at 32K (its OOM message:
# "total capacity of 79.18 GiB"; benchmarks/data/kimi_draft_32k_h100.log)
H100_BYTES = int(79.18 * tm.GIB)


def shape(name: str) -> DraftShape:
    """The benchmark's draft `name` (the one train_throughput.make_draft builds)."""
    return draft_shape(SHAPES[name])


def test_the_constants_are_the_least_squares_fit_of_the_measured_peaks_and_reproduce_each():
    rows, rest = [], []
    for name, T, peak_gib, _, _ in tm.MEASURED:
        s = shape(name)
        K = tm.MEASURED_TTT
        rows.append([1.0, K * T * tm.widths(s), K * T * s.draft_vocab_size])
        rest.append(peak_gib * tm.GIB - tm.known_bytes(s))
    overhead, a, c = np.linalg.lstsq(np.array(rows), np.array(rest), rcond=None)[0]
    assert (overhead / tm.GIB, a, c) == pytest.approx((tm.OVERHEAD_BYTES / tm.GIB, tm.A_BYTES, tm.C_BYTES), abs=0.01)
    for name, T, peak_gib, _, _ in tm.MEASURED:
        assert tm.train_memory(shape(name), tm.MEASURED_TTT).at(T) / tm.GIB == pytest.approx(peak_gib, rel=0.01)


def test_the_counts_are_the_drafts_own_and_the_kimi_draft_fits_16k_not_32k_on_an_h100():
    P, F = tm.parameter_counts(shape("kimi"))
    assert F == 163840 * 7168                                   # the frozen target embedding
    # fc 3H x H, q/k/v from 2H to 3 x 64 x 128, o, the MLP's three, lm_head N x H, four norms of H
    H = 7168
    assert P == 3 * H * H + 2 * H * 3 * 8192 + 8192 * H + 3 * H * 18432 + 32000 * H + 4 * H
    mem = tm.train_memory(shape("kimi"), 7)
    fit = mem.tokens_that_fit(H100_BYTES)
    assert 16384 <= fit < 32768 and fit % 256 == 0              # measured: 73.3 GiB at 16K, out of memory at 32K
    assert mem.at(fit) + tm.CONTEXT_BYTES <= H100_BYTES < mem.at(fit + 256) + tm.CONTEXT_BYTES
    assert tm.train_memory(shape("kimi"), 3).per_token_bytes == pytest.approx(mem.per_token_bytes * 3 / 7)


def test_row_fit_refuses_only_what_the_counted_parts_alone_exceed():
    from eagle3_core.config import TrainConfig
    s, train = shape("kimi"), TrainConfig(batch_tokens=16384)
    need = tm.train_memory(s, 7).at(16384)
    for gpu, fits, refused in ((need + tm.CONTEXT_BYTES + 1, "yes", False),
                               (need - tm.OVERHEAD_BYTES / 2, "maybe not", False),     # the fitted part decides
                               (need - tm.OVERHEAD_BYTES - 1, "no", True)):
        fact, problems = tm.row_fit(s, train, (8, int(gpu)))
        assert fact["fits"].startswith(fits) and bool(problems) == refused
    fact, problems = tm.row_fit(s, train, None)
    assert problems == [] and "not checked" in fact["gpu"] and fact["peak_gib_estimate"] == pytest.approx(73.3, abs=0.2)
