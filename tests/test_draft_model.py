"""The draft's TTT attention against a naive flattened-mask recomputation, and TTT steps against the inference-time
chain with a KV cache (the convention shared by trainer and evaluator)."""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import random_ttt_samples, tiny_draft
from eagle3_core.training.ttt import shift_left, supervised
from eagle3_core.training.ttt_attention import ttt_attention

IMPLS = ("eager", "merged_math")     # "merged_flex" has no backward on CPU: checked forward-only below


def naive_ttt_logits(d, aux, ids, K):
    """Per step k, recompute all steps 0..k from scratch and attend with an explicit [T, T*(k+1)] mask:
    step-0 keys causal, step-j keys (j>=1) only at the same index (EAGLE-3 paper section 3.2)."""
    B, T = ids.shape
    s = d.shape
    layer = d.midlayer
    out_logits = []
    hidden = d.fuse(aux)
    ks, vs = [], []
    for k in range(K):
        tok = shift_left(ids, 1 + k)
        x = torch.cat([layer.input_layernorm(d.embed_tokens(tok)), layer.hidden_norm(hidden)], -1)
        cos, sin = d.rope(torch.arange(T).expand(B, T) + k)
        q, kk, vv = layer.self_attn.project(x, cos, sin)
        ks.append(kk)
        vs.append(vv)
        keys = torch.cat(ks, dim=2).repeat_interleave(s.num_attention_heads // s.num_key_value_heads, 1)
        vals = torch.cat(vs, dim=2).repeat_interleave(s.num_attention_heads // s.num_key_value_heads, 1)
        mask = torch.zeros(T, T * (k + 1), dtype=torch.bool)
        mask[:, :T] = torch.ones(T, T, dtype=torch.bool).tril()
        for j in range(1, k + 1):
            mask[:, j * T:(j + 1) * T] = torch.eye(T, dtype=torch.bool)
        attn = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask).transpose(1, 2).reshape(B, T, -1)
        a = hidden + layer.self_attn.o_proj(attn)
        hidden = a + layer.mlp(layer.post_attention_layernorm(a))
        out_logits.append(d.lm_head(d.norm(hidden)))
    return out_logits


def naive_ttt_attention(q, keys, values):
    """Query by query: gather the keys step k may see (step-0 keys 0..i, then key i of each step j >= 1), one
    softmax, weighted sum. q [B, nh, T, hd]; keys/values: k+1 tensors [B, nkv, T, hd]."""
    B, nh, T, hd = q.shape
    rep = nh // keys[0].shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(nh):
            for i in range(T):
                ks = [keys[0][b, h // rep, :i + 1]] + [kj[b, h // rep, i:i + 1] for kj in keys[1:]]
                vs = [values[0][b, h // rep, :i + 1]] + [vj[b, h // rep, i:i + 1] for vj in values[1:]]
                w = torch.softmax(torch.cat(ks) @ q[b, h, i] / math.sqrt(hd), dim=0)
                out[b, h, i] = w @ torch.cat(vs)
    return out


@pytest.mark.parametrize("impl", (*IMPLS, "merged_flex"))
@pytest.mark.parametrize("ttt_length", (1, 3, 7))
def test_ttt_attention_equals_naive_per_step_recomputation(impl, ttt_length):
    """Acceptance: float64, random inputs, every step k < ttt_length, to 1e-10; GQA (4 query, 2 kv heads)."""
    g = torch.Generator().manual_seed(ttt_length)
    B, nh, nkv, T, hd = 2, 4, 2, 10, 8
    keys = [torch.randn(B, nkv, T, hd, generator=g, dtype=torch.float64) for _ in range(ttt_length)]
    values = [torch.randn(B, nkv, T, hd, generator=g, dtype=torch.float64) for _ in range(ttt_length)]
    for k in range(ttt_length):
        q = torch.randn(B, nh, T, hd, generator=g, dtype=torch.float64)
        ours = ttt_attention(q, keys[:k + 1], values[:k + 1], impl)
        naive = naive_ttt_attention(q, keys[:k + 1], values[:k + 1])
        assert (ours - naive).abs().max() < 1e-10, f"{impl} step {k}: {(ours - naive).abs().max()}"


def test_merged_ttt_attention_gradients_equal_eager():
    """The log-sum-exp merge differentiates through lse: its gradients must equal the materialised softmax's."""
    g = torch.Generator().manual_seed(9)
    B, nh, nkv, T, Tq, hd, K = 1, 4, 2, 9, 6, 8, 4
    q = torch.randn(B, nh, Tq, hd, generator=g, dtype=torch.float64)
    keys = [torch.randn(B, nkv, T if j == 0 else Tq, hd, generator=g, dtype=torch.float64) for j in range(K)]
    values = [torch.randn_like(k) for k in keys]
    grads = []
    for impl in IMPLS:
        leaves = [t.clone().requires_grad_() for t in (q, *keys, *values)]
        out = ttt_attention(leaves[0], leaves[1:1 + K], leaves[1 + K:], impl)
        grads.append(torch.autograd.grad((out * torch.arange(out.numel()).view_as(out).sin()).sum(), leaves))
    for a, b in zip(*grads):
        assert (a - b).abs().max() < 1e-10
    with torch.no_grad():                         # flex, forward only on CPU, with queries at the last Tq indices
        flex = ttt_attention(q, keys, values, "merged_flex")
    assert (flex - ttt_attention(q, keys, values, "eager")).abs().max() < 1e-10


def ttt_logits(d, aux, ids, K, caches=None):
    """The K TTT steps' logits over ids [B, T] with aux [B, T, 3H_t]; `caches`: the (keys, values) TTT cache lists
    to fill (ttt_attention.ttt_caches() for a multi-layer draft), fresh lists by default."""
    B, T = ids.shape
    hidden = d.fuse(aux)
    (ck, cv), outs = caches if caches is not None else ([], []), []
    for k in range(K):
        hidden, logits = d.step(shift_left(ids, 1 + k), hidden, torch.arange(T).expand(B, T) + k, ck, cv)
        outs.append(logits)
    return outs


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ttt_length", (1, 3, 7))
def test_ttt_draft_steps_match_naive_recomputation(impl, ttt_length):
    d = tiny_draft().double().set_attention(impl)
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(2, 12, 96, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 100, (2, 12), generator=g)
    with torch.no_grad():
        fused, naive = ttt_logits(d, aux, ids, ttt_length), naive_ttt_logits(d, aux, ids, ttt_length)
    for k, (a, b) in enumerate(zip(fused, naive)):
        assert torch.allclose(a, b, atol=1e-10), f"step {k} differs by {(a - b).abs().max()}"


def test_ttt_steps_equal_inference_chain_with_kv_cache():
    """TTT step k at index t must compute what the serving-time draft computes at chain step k after the prefix
    0..t: same inputs, same RoPE positions (t+k), same visible keys."""
    d = tiny_draft().double()
    g = torch.Generator().manual_seed(2)
    T, K, t = 14, 4, 6
    aux = torch.randn(1, T, 96, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 100, (1, T), generator=g)
    with torch.no_grad():
        assert_serving_chain_equals_ttt(d, aux, ids, t, ttt_logits(d, aux, ids, K))


def assert_serving_chain_equals_ttt(d, aux, ids, t, train_logits):
    """The serving-time chain (Eagle3Draft.decode with its KV cache) after the prefix pairs (f_p, x_{p+1}) at
    positions 0..t gives, at chain step k, TTT step k's logits at index t (train_logits[k], batch 1), to 1e-10."""
    cache = {}
    h, logits = d.decode(ids[:, 1:t + 2], d.fuse(aux[:, :t + 1]), torch.arange(t + 1)[None], cache)
    assert torch.allclose(logits[0, t], train_logits[0][0, t], atol=1e-10)
    h = h[:, -1:]
    for k in range(1, len(train_logits)):
        h, logits = d.decode(ids[:, t + 1 + k:t + 2 + k], h, torch.tensor([[t + k]]), cache)
        assert torch.allclose(logits[0, 0], train_logits[k][0, t], atol=1e-10), f"step {k}"


def test_supervised_positions_shift_with_the_inputs():
    """Handed case C5: a 6-token sequence whose assistant span (indices 3..5) runs to the end. Index t at step k
    predicts x_{t+2+k}; exactly the reachable assistant tokens are supervised."""
    mask = torch.tensor([[0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    assert supervised(mask, 0)[0].nonzero().flatten().tolist() == [1, 2, 3]      # predict x3, x4, x5
    assert supervised(mask, 1)[0].nonzero().flatten().tolist() == [0, 1, 2]      # predict x3, x4, x5
    assert supervised(mask, 2)[0].nonzero().flatten().tolist() == [0, 1]         # predict x4, x5
    assert supervised(mask, 4)[0].nonzero().flatten().tolist() == []             # nothing reachable


def test_rope_positions_advance_by_step():
    d = tiny_draft()
    cos0, _ = d.rope(torch.arange(5)[None] + 2)
    cos1, _ = d.rope(torch.arange(2, 7)[None])
    assert torch.equal(cos0, cos1)


def test_trimmed_ttt_loss_equals_full_loss_and_gradients():
    """Skipping the leading unsupervised region at steps >= 1 changes nothing but the compute."""
    from eagle3_core.training.ttt import collate, trim_start, ttt_loss
    g = torch.Generator().manual_seed(3)
    samples = random_ttt_samples(g, ((30, 18), (24, 12), (28, 21)))
    batch = collate(samples)
    batch["aux"], batch["final"] = batch["aux"].double(), batch["final"].double()
    assert trim_start(batch["loss_mask"], 3) == 12 - 3 - 1
    head = torch.randn(50, 32, generator=g, dtype=torch.float64)
    results = []
    for trim in (False, True):
        d = tiny_draft().double()
        loss, stats = ttt_loss(d, batch, head, 3, trim=trim)
        loss.backward()
        results.append((loss.detach(), stats, {n: p.grad.clone() for n, p in d.named_parameters()
                                               if p.grad is not None}))
    (l0, s0, g0), (l1, s1, g1) = results
    assert torch.allclose(l0, l1, atol=1e-12)
    assert all(torch.equal(s0[k], s1[k]) for k in ("n", "correct", "chain"))
    assert all(torch.allclose(g0[n], g1[n], atol=1e-10) for n in g0)
