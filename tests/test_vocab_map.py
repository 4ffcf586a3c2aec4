import pytest
import torch

from eagle3_core.data.vocab_map import build_vocab_map, count_tokens, draft_to_target_ids


def test_offsets_and_mask_from_counts():
    ids = [torch.tensor([5, 5, 5, 7, 7, 9, 1]), torch.tensor([9, 9, 2])]
    masks = [torch.tensor([1, 1, 1, 1, 1, 1, 0]), torch.tensor([1, 1, 0])]
    counts = count_tokens(ids, masks, 12)
    assert counts.tolist() == [0, 0, 0, 0, 0, 3, 0, 2, 0, 3, 0, 0]     # masked-out 1 and 2 not counted
    d2t, t2d = build_vocab_map(counts, 3)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert draft_to_target_ids(d2t).tolist() == [5, 7, 9]                # sorted by target id
    assert d2t.tolist() == [5, 6, 7]                                      # offsets: target = draft + d2t
    assert t2d.nonzero().flatten().tolist() == [5, 7, 9]


def test_fewer_distinct_tokens_than_draft_vocab_fills_deterministically():
    counts = torch.zeros(10, dtype=torch.long)
    counts[[8, 3]] = torch.tensor([4, 1])
    d2t, t2d = build_vocab_map(counts, 5)
    targets = draft_to_target_ids(d2t).tolist()
    assert targets == [0, 1, 2, 3, 8]           # seen ids 8, 3, then the lowest unseen ids 0, 1, 2
    assert int(t2d.sum()) == 5
    assert torch.equal(build_vocab_map(counts, 5)[0], d2t)


def test_ties_break_by_lower_id():
    counts = torch.tensor([1, 2, 2, 2, 0])
    d2t, _ = build_vocab_map(counts, 2)
    assert draft_to_target_ids(d2t).tolist() == [1, 2]


def test_d2t_t2d_round_trip_and_consistency():
    from eagle3_core.data.vocab_map import check_vocab_map, target_to_draft_ids
    counts = torch.randint(0, 50, (300,), generator=torch.Generator().manual_seed(0))
    counts[::7] = 0
    for N in (1, 64, 200, 300):                  # 200 and 300 exceed the distinct tokens seen: filled
        d2t, t2d = build_vocab_map(counts, N)
        check_vocab_map(d2t, t2d, "test")
        targets = draft_to_target_ids(d2t)
        t2d_ids = target_to_draft_ids(t2d)
        assert torch.equal(t2d_ids[targets], torch.arange(N))                 # draft -> target -> draft
        in_vocab = t2d.nonzero().flatten()
        assert torch.equal(targets[t2d_ids[in_vocab]], in_vocab)              # target -> draft -> target
        assert (t2d_ids[~t2d] == -1).all() and int(t2d.sum()) == N
        seen = (counts > 0).nonzero().flatten()
        if N >= len(seen):
            assert t2d[seen].all()                                            # every seen token kept
    bad = d2t.clone()
    bad[0] += 1
    with pytest.raises(ValueError, match="different target ids"):
        check_vocab_map(bad, t2d, "test")
