"""The lm_head split over the vocabulary across ranks (features.vocab_split; the `ep_int4` backend's head, and
`hf_tp`'s where its plan leaves lm_head whole) against the whole head in one process, on 2 gloo ranks
(tests/vocab_split_worker.py).

What is compared: the argmax (target_top1) equal token for token; fp8_topk's teacher (store_formats.exact_top) with
the same top-K logits bit for bit and the same ids, and the tail shift within fp32 summation order (the split sums
each slice's tail first: measured ~1e-7, bound 1e-5, where a tail missing a slice is off by O(1)); head_weights'
gathered lm_head equal to the checkpoint's.
"""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eagle3_core.config import TargetConfig
from eagle3_core.distributed.launch import run_torchrun
from eagle3_core.features.store_formats import TEACHER_TOPK, exact_top, fp8_rounded
from eagle3_core.features.vocab_split import vocab_range
from eagle3_core.target.ep_loading import load_int4_target
from conftest import assert_ranks_left_cleanly
from int4_targets import build_int4


def test_vocab_range_is_torch_chunks_split():
    for vocab, world in [(131, 2), (128, 2), (163_840, 8), (10, 4), (3, 4)]:
        got = [vocab_range(vocab, r, world) for r in range(world)]
        sizes = [len(c) for c in torch.arange(vocab).chunk(world)] + [0] * world
        assert [b - a for a, b in got] == sizes[:world]
        assert got[0][0] == 0 and got[-1][1] == vocab and all(got[i][1] == got[i + 1][0] for i in range(world - 1))


def _assert_teacher(split, final, head):
    vals, ids, shift = exact_top(final, fp8_rounded(final), head)
    assert torch.equal(split[0], vals) and torch.equal(split[1], ids)
    torch.testing.assert_close(split[2], shift, atol=1e-5, rtol=0)
    assert shift.abs().max() > 1e-3                         # the fp8 rounding moves the tail: a real comparison


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The worker's outputs over 2 gloo ranks on a tiny Kimi-K2.5 INT4 target (vocab 128), and the target's dir."""
    root = tmp_path_factory.mktemp("vocab_split")
    model = build_int4("kimi_k25", root / "kimi", layers=2)
    lines = []
    run_torchrun([str(Path(__file__).parent / "vocab_split_worker.py"), "--model", str(model), "--out",
                  str(root / "out.pt")], 2, on_line=lines.append)
    assert_ranks_left_cleanly(lines, 2)
    return torch.load(root / "out.pt"), model


@pytest.mark.slow
def test_split_argmax_and_teacher_equal_the_whole_head(two_ranks):
    got = two_ranks[0]["random"]
    assert [s[0] for s in two_ranks[0]["slices"]] == [(0, 66), (66, 131)]
    whole = F.linear(got["final"].bfloat16(), got["head"].bfloat16()).argmax(-1)
    assert torch.equal(got["top1"], whole)
    assert len(set(whole.tolist()) & set(range(66))) and len(set(whole.tolist()) & set(range(66, 131)))
    _assert_teacher(got["teacher"], got["final"], got["head"])


@pytest.mark.slow
def test_the_ep_int4_extractor_gathers_the_one_process_head(two_ranks):
    """The INT4 target over 2 ranks, lm_head 64 + 64 rows: its argmax and teacher equal the whole lm_head's on the
    same final states; each rank keeps only its slice; head_weights gathers the checkpoint's lm_head."""
    got, model_dir = two_ranks[0]["target"], two_ranks[1]
    assert [s[1] for s in two_ranks[0]["slices"]] == [(0, 64), (64, 128)] and got["held_rows"] == 0
    lm = load_int4_target(TargetConfig(model=str(model_dir)), "cpu").get_output_embeddings().weight.detach()
    assert torch.equal(got["lm"], lm)
    final, lengths = got["final"], got["lengths"].tolist()
    whole = F.linear(final, lm).argmax(-1)
    for b, n in enumerate(lengths):
        assert torch.equal(got["target_top1"][b, :n].long(), whole[b, :n])
        assert not got["target_top1"][b, n:].any()
    assert len(set(whole[0].tolist())) > 1
    vals, ids, shift = got["teacher"]
    assert vals.shape == (2, 12, TEACHER_TOPK)
    real = [(b, slice(0, n)) for b, n in enumerate(lengths)]
    for b, s in real:
        _assert_teacher((vals[b, s], ids[b, s], shift[b, s]), final[b, s], lm)
