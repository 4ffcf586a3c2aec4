"""TTT loss and metrics on cases small enough to compute by hand (the numbers below are worked out in comments),
and the TTT step against its reference, the former step (tests/reference_paths.py)."""
import math

import pytest
import torch

from conftest import random_ttt_samples, tiny_draft
from eagle3_core.training.ttt import SoftCrossEntropyFromLogits, collate, summarize, ttt_loss
from reference_paths import reference_ttt_loss, soft_cross_entropy


def _from_teacher_logits(logits, p, mask):
    """ttt_loss's loss (SoftCrossEntropyFromLogits: the teacher as logits z = log p) with soft_cross_entropy's
    arguments."""
    z = p.log()                                                            # -inf where p is 0: exp gives 0 back
    return SoftCrossEntropyFromLogits.apply(logits, z, z.logsumexp(-1), mask.to(p.dtype) / mask.sum())


@pytest.mark.parametrize("loss_fn", [soft_cross_entropy, _from_teacher_logits], ids=["probabilities", "logits"])
def test_soft_cross_entropy_and_its_gradient_by_hand(loss_fn):
    # row 0: draft softmax(ln[1, 2, 1]) = [1/4, 1/2, 1/4] against teacher [1/4, 1/4, 1/2]:
    #        CE = -(1/4 ln 1/4 + 1/4 ln 1/2 + 1/2 ln 1/4) = (1/2 + 1/4 + 1) ln 2 = 1.75 ln 2
    # row 1: draft uniform over 3 against teacher [1, 0, 0]: CE = ln 3
    # row 2: masked out (would be large), so the mean is over rows 0 and 1
    logits = torch.tensor([[[0.0, math.log(2), 0.0], [5.0, 5.0, 5.0], [-9.0, 9.0, 0.0]]], dtype=torch.float64,
                          requires_grad=True)
    p = torch.tensor([[[0.25, 0.25, 0.5], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    loss = loss_fn(logits, p, mask)
    assert abs(loss.item() - (1.75 * math.log(2) + math.log(3)) / 2) < 1e-12
    loss.backward()
    # d loss / d logits = (softmax - teacher) / 2 on supervised rows, 0 elsewhere
    expected = torch.tensor([[[0.0, 0.125, -0.125], [-1 / 3, 1 / 6, 1 / 6], [0.0, 0.0, 0.0]]], dtype=torch.float64)
    assert torch.allclose(logits.grad, expected, atol=1e-12)


def test_ttt_loss_acc_and_tau_by_hand():
    """A draft whose final norm weight is 0 gives all-zero logits: every draft distribution is uniform over
    N = 50 (CE = ln 50 against any teacher) and its argmax is draft id 0 = target id 0 (tiny_draft maps draft i to
    target 2i). One sequence, T = 8, 3 TTT steps, step weight 0.5.

    Index t at step k predicts x_{t+2+k} (supervised iff loss_mask[t+2+k]) and is right iff target_top1[t+1+k]
    is 0. loss_mask = [0,0,0,1,1,1,1,1], target_top1 = [7,7,0,0,3,0,8,9]:
      step 0: t = 1..5 see top1[2..6] = 0,0,3,0,8 -> right at t = 1,2,4: acc 3/5
      step 1: t = 0..4 see top1[2..6]             -> right at t = 0,1,3: acc 3/5
      step 2: t = 0..3 see top1[3..6] = 0,3,0,8   -> right at t = 0,2:   acc 2/4
    chain (right at every step so far, same t): {1,2,4}, {1}, {} -> 3, 1, 0; conditional 3/5, 1/3, 0/1.
    tau_sim = 1 + 3/5 + 3/5*3/5 + 3/5*3/5*1/2 = 2.14. loss = ln 50 * (1 + 0.5 + 0.25).
    """
    d = tiny_draft().double()
    with torch.no_grad():
        d.norm.weight.zero_()
    g = torch.Generator().manual_seed(0)
    T = 8
    batch = {"input_ids": torch.randint(0, 100, (1, T), generator=g),
             "loss_mask": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool),
             "target_top1": torch.tensor([[7, 7, 0, 0, 3, 0, 8, 9]]),
             "aux": torch.randn(1, T, 96, generator=g, dtype=torch.float64),
             "final": torch.randn(1, T, 32, generator=g, dtype=torch.float64)}
    head = torch.randn(50, 32, generator=g, dtype=torch.float64)
    loss, stats = ttt_loss(d, batch, head, ttt_length=3, step_weight=0.5)
    assert abs(loss.item() - math.log(50) * 1.75) < 1e-12
    assert stats["n"].tolist() == [5, 5, 4]
    assert stats["correct"].tolist() == [3, 3, 2]
    assert stats["chain"].tolist() == [3, 1, 0]
    m = summarize(stats)
    assert m["acc"] == [3 / 5, 3 / 5, 2 / 4]
    assert m["cond_acc"] == [3 / 5, 1 / 3, 0.0]
    assert abs(m["tau_sim"] - 2.14) < 1e-12
    assert all(abs(x - math.log(50)) < 1e-12 for x in m["loss"])


@pytest.mark.parametrize("attention", ["eager", "merged_math"])
def test_ttt_loss_equals_the_former_step(attention):
    """The TTT step (RoPE and weight casts once per batch, the loss from the teacher's logits) gives the former
    step's loss, metrics and gradients (fp64, a padded batch of three samples, 3 TTT steps)."""
    g = torch.Generator().manual_seed(5)
    samples = random_ttt_samples(g, ((20, 9), (14, 4), (17, 12)))
    batch = collate(samples)
    head = torch.randn(50, 32, generator=g, dtype=torch.float64)
    results = []
    for loss_fn in (ttt_loss, reference_ttt_loss):
        d = tiny_draft().double().set_attention(attention)
        loss, stats = loss_fn(d, batch, head, 3, step_weight=0.8)
        loss.backward()
        results.append((loss.detach(), stats, {n: p.grad.clone() for n, p in d.named_parameters()
                                               if p.grad is not None}))
    (l0, s0, g0), (l1, s1, g1) = results
    assert torch.allclose(l0, l1, rtol=1e-12, atol=0)
    assert all(torch.equal(s0[k], s1[k]) for k in ("n", "correct", "chain"))
    assert torch.allclose(s0["loss"], s1["loss"], rtol=1e-12, atol=0)
    assert g0.keys() == g1.keys() and g0
    assert all(torch.allclose(g0[n], g1[n], rtol=1e-9, atol=1e-12) for n in g0)


def _topk_samples(g, k: int, head: torch.Tensor, spans=((12, 3), (9, 2))) -> tuple[list[dict], list[dict]]:
    """The same random samples twice, fp32: with their exact final states, and as an fp8_topk store reads them
    back (store_formats.encode/decode with the target head `head` [V, H_t], the top k)."""
    from eagle3_core.features import store_formats as ff
    exact = [{k_: (v.float() if v.is_floating_point() else v) for k_, v in s.items()}
             for s in random_ttt_samples(g, spans)]
    for s in exact:
        s["final"] = s["final"] * 4                                  # logits spread enough to have a tail
    stored = []
    for s in exact:
        enc = ff.encode("fp8_topk", s["aux"], s["final"], s["target_top1"], head)
        assert enc["teacher_logits"].shape == (len(s["input_ids"]), k)
        stored.append({**s, **ff.decode("fp8_topk", enc)})
    return exact, stored


def test_the_fp8_topk_teacher_is_the_exact_top_k_with_the_tail_at_its_exact_mass(monkeypatch):
    """teacher_of on an fp8_topk batch, by hand: over the whole target vocab, the top-k ids keep the exact
    softmax probabilities, the other ids share the exact remaining mass in proportion to their fp8 logits'
    softmax; the teacher is that distribution on the draft vocab (target ids 2i), renormalized."""
    from eagle3_core.features import store_formats as ff
    from eagle3_core.training.ttt import teacher_of
    monkeypatch.setattr(ff, "TEACHER_TOPK", 8)
    g = torch.Generator().manual_seed(3)
    head = torch.randn(100, 32, generator=g)
    draft = tiny_draft()
    exact, stored = _topk_samples(g, 8, head)
    batch = collate(stored)
    z, z_lse = teacher_of(batch, head[0::2], 2, draft)
    for b, (e, s) in enumerate(zip(exact, stored)):
        T = len(e["input_ids"])
        p = (e["final"].double() @ head.double().T).softmax(-1)                  # [T, V] exact
        q8 = (s["final"].double() @ head.double().T).softmax(-1)                 # the fp8 final's
        top = (e["final"] @ head.T).topk(8, dim=-1).indices
        in_top = torch.zeros_like(p, dtype=torch.bool).scatter(-1, top, True)
        tail_mass = p.masked_fill(in_top, 0).sum(-1, keepdim=True)
        q = torch.where(in_top, p, q8.masked_fill(in_top, 0) * tail_mass / q8.masked_fill(in_top, 0).sum(-1, True))
        want = q[:, 0::2] / q[:, 0::2].sum(-1, keepdim=True)
        got = (z[b, :T].double() - z_lse[b, :T, None].double()).exp()
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (got - want).abs().max()
        assert not torch.allclose(q8[:, 0::2] / q8[:, 0::2].sum(-1, True), want, atol=1e-3)   # fp8 alone is off


def test_ttt_loss_on_an_fp8_topk_batch_covering_the_vocab_equals_the_loss_on_exact_final_states(monkeypatch):
    """With k = V every logit is stored exactly: the loss and the counts equal those of the exact final states
    (beside the same fp8 aux states), though the batch's own final states are fp8-rounded."""
    from eagle3_core.features import store_formats as ff
    monkeypatch.setattr(ff, "TEACHER_TOPK", 100)
    g = torch.Generator().manual_seed(4)
    draft = tiny_draft()
    head = torch.randn(100, 32, generator=g)
    exact, stored = _topk_samples(g, 100, head)
    exact = [{**e, "aux": s["aux"]} for e, s in zip(exact, stored)]
    want, ws = ttt_loss(draft, collate(exact), head[0::2], 3)
    got, gs = ttt_loss(draft, collate(stored), head[0::2], 3)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(gs[k], ws[k]) for k in ("n", "correct"))
    from eagle3_core.training.packing import collate_packed        # a packed row carries the teacher too
    row = [(0, 0, 12, 0), (1, 0, 9, 0)]
    packed = collate_packed(stored, row, 24)
    assert packed["teacher_ids"].shape == (1, 24, 100) and packed["tail_shift"].shape == (1, 24, 1)
    assert torch.allclose(ttt_loss(draft, packed, head[0::2], 3)[0],
                          ttt_loss(draft, collate_packed(exact, row, 24), head[0::2], 3)[0], rtol=1e-5, atol=1e-6)
    rounded = [{k_: v for k_, v in s.items() if k_ not in ("teacher_logits", "teacher_ids", "tail_shift")}
               for s in stored]
    assert not torch.allclose(ttt_loss(draft, collate(rounded), head[0::2], 3)[0], want, rtol=1e-4)


def test_tv_loss_by_hand_and_its_gradient():
    """train.loss 'tv' (ttt.tv_from_teacher_logits): row 0, draft q = [1/2, 1/4, 1/4] against teacher p =
    [0.2, 0.3, 0.5]: 1 - (0.2 + 0.25 + 0.25) = 0.3; row 1, q = p: 0; row 2 masked out. Weights 1/2: 0.15. Its
    gradient flows only where q < p (the min takes q): d/d logits of -sum_{n: q_n < p_n} q_n / 2."""
    from eagle3_core.training.ttt import POSITION_LOSSES, tv_from_teacher_logits
    q = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    p = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    logits = torch.stack([q.log(), p.log() + 3.0, torch.tensor([9.0, 0.0, 0.0], dtype=torch.float64)])[None]
    logits.requires_grad_(True)
    z = torch.stack([p.log() - 1.0, p.log(), torch.tensor([0.0, 0.0, 9.0], dtype=torch.float64)])[None]
    weight = torch.tensor([[0.5, 0.5, 0.0]], dtype=torch.float64)
    loss = tv_from_teacher_logits(logits, z, z.logsumexp(-1), weight)
    assert abs(loss.item() - 0.15) < 1e-12 and POSITION_LOSSES["tv"] is tv_from_teacher_logits
    loss.backward()
    # row 0: -(q_1 + q_2) / 2, d/d logit_j of q_1 + q_2 = q_j (1[j in {1, 2}] - (q_1 + q_2))
    s = 0.5
    expected0 = -0.5 * q * (torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64) - s)
    assert torch.allclose(logits.grad[0, 0], expected0, atol=1e-12) and logits.grad[0, 2].abs().max() == 0


def test_the_ttt_step_takes_its_loss_as_an_argument_and_the_default_is_unchanged():
    """ttt_loss(position_loss=...) sums step_weight**k times the given loss of each step (here 'tv', recomputed
    from the step's own arguments by 1 - sum min(softmax z, softmax logits)); the default is the soft
    cross-entropy ('kl'), bit for bit, and so is the trainer's loss with train.loss at its default."""
    from eagle3_core.config import TrainConfig
    from eagle3_core.training.trainer import TTTLoss
    from eagle3_core.training.ttt import POSITION_LOSSES
    g = torch.Generator().manual_seed(5)
    batch = collate(random_ttt_samples(g, ((20, 9), (14, 4), (17, 12))))
    head = torch.randn(50, 32, generator=g, dtype=torch.float64)
    d = tiny_draft().double()
    seen = []

    def spy(logits, z, z_lse, weight):
        seen.append((logits.detach(), z, z_lse, weight))
        return POSITION_LOSSES["tv"](logits, z, z_lse, weight)
    tv, stats = ttt_loss(d, batch, head, 3, step_weight=0.8, position_loss=spy)
    by_hand = [((1 - torch.minimum(lg.softmax(-1), (zz - zl[..., None]).exp()).sum(-1)) * w).sum()
               for lg, zz, zl, w in seen]
    assert len(seen) == 3 and torch.allclose(stats["loss"], torch.stack(by_hand), rtol=1e-12, atol=0)
    assert abs(tv.item() - sum(0.8 ** k * float(v) for k, v in enumerate(by_hand))) < 1e-12
    assert all(0 < float(v) < 1 for v in by_hand)                      # a rejection probability per position
    kl, _ = ttt_loss(d, batch, head, 3, step_weight=0.8)
    assert torch.equal(kl, ttt_loss(d, batch, head, 3, step_weight=0.8, position_loss=POSITION_LOSSES["kl"])[0])
    assert torch.equal(kl, TTTLoss(d, head, TrainConfig(ttt_length=3, step_weight=0.8, batching="padded"))(batch)[0])
    assert torch.equal(tv, TTTLoss(d, head, TrainConfig(ttt_length=3, step_weight=0.8, batching="padded",
                                                          loss="tv"))(batch)[0])
