"""Packed rows and windows (eagle3_core.training.packing): every supervised token trained exactly once, a packed row's
loss equal to its samples' losses computed apart, and one compiled graph for rows of any sample lengths."""
import os
import random
from collections import Counter

import pytest
import torch
import torch._dynamo
import torch._dynamo.config

from conftest import random_ttt_samples, tiny_draft
from eagle3_core.config import TrainConfig
from eagle3_core.training import packing
from eagle3_core.training import ttt as ttt_mod
from eagle3_core.training import ttt_attention
from eagle3_core.training.batch_feed import epoch_batches
from eagle3_core.training.packing import collate_packed, pack_rows, packed_ttt_loss, sample_pieces, windows
from eagle3_core.training.setup import compile_for_training
from eagle3_core.training.ttt import collate, supervised, ttt_loss


def _trained_targets(samples, rows, row_len, K):
    """(sample, target index u, step k) of every position ttt_loss supervises in the packed rows, by ttt_loss's
    rule read off the batch: mask[t + 2 + k] and doc[t + 2 + k] == doc[t]; u = position[t] + 2 + k."""
    seen = Counter()
    for row in rows:
        b = collate_packed(samples, row, row_len)
        for k in range(K):
            same = ttt_mod.shift_left(b["doc"], 2 + k, -2) == b["doc"]
            for t in torch.nonzero((supervised(b["loss_mask"], k) & same)[0]).flatten().tolist():
                seen[(row[int(b["doc"][0, t])][0], int(b["position"][0, t]) + 2 + k, k)] += 1
    return seen


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_windows_train_every_supervised_token_exactly_once(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    K, row_len, context = 3, 40, 9
    spans = [(rng.randint(5, 130), rng.randint(0, 20)) for _ in range(12)]   # several longer than a row
    samples = random_ttt_samples(g, [(n, min(f, n - 1)) for n, f in spans])
    for s in samples:                                      # holes in the mask too (multi-turn: user turns between)
        s["loss_mask"][torch.rand(len(s["loss_mask"]), generator=g) < 0.2] = False
    rows = pack_rows(sample_pieces([len(s["input_ids"]) for s in samples], row_len, context), row_len, seed)
    assert all(sum(b - a for _, a, b, _ in row) <= row_len for row in rows)
    seen = _trained_targets(samples, rows, row_len, K)
    expected = Counter((i, u, k) for i, s in enumerate(samples) for k in range(K)
                       for u in torch.nonzero(s["loss_mask"]).flatten().tolist() if u >= 2 + k)
    assert seen == expected                                 # the same (sample, token, step) set, each once
    assert any(len(windows(len(s["input_ids"]), row_len, context)) > 2 for s in samples)


def test_windows_carry_their_context_and_positions():
    assert windows(10, 16, 4) == [(0, 10, 0)]
    assert windows(40, 16, 4) == [(0, 16, 0), (12, 28, 16), (24, 40, 28)]
    with pytest.raises(ValueError, match="window_context"):
        windows(40, 16, 16)
    s = random_ttt_samples(torch.Generator().manual_seed(0), [(40, 0)])
    b = collate_packed(s, [(0, 12, 28, 16)], 20)
    assert b["position"][0, :16].tolist() == list(range(12, 28)) and b["doc"][0, 16:].tolist() == [-1] * 4
    assert not b["loss_mask"][0, :4].any() and b["loss_mask"][0, 4:16].all()     # context seen, not trained
    assert torch.equal(b["aux"][0, :16], s[0]["aux"][12:28])


@pytest.mark.parametrize("attention", ["eager", "merged_math"])
def test_a_packed_row_gives_the_loss_and_gradients_of_the_padded_batch(attention):
    """Three samples in one row (fp64) against the same three as a padded batch [3, 20] (each step's loss is the
    mean over all supervised positions of the batch in both): equal counts, step losses, loss and gradients. A row
    whose attention or shifts crossed into the next sample would differ."""
    g = torch.Generator().manual_seed(3)
    samples = random_ttt_samples(g, ((20, 9), (14, 4), (17, 12)))
    head = torch.randn(50, 32, generator=g, dtype=torch.float64)
    K, out = 3, []
    for batch in (collate_packed(samples, [(1, 0, 14, 0), (0, 0, 20, 0), (2, 0, 17, 0)], 56),  # 5 pad tokens
                  collate(samples)):
        d = tiny_draft().double().set_attention(attention)
        loss, stats = ttt_loss(d, batch, head, K, step_weight=0.8, trim=False)
        loss.backward()
        out.append((loss.detach(), stats, [p.grad for p in d.parameters() if p.requires_grad]))
    (lp, sp, gp), (lb, sb, gb) = out
    assert all(torch.equal(sp[k], sb[k]) for k in ("n", "correct", "chain")) and sp["n"].min() > 0
    assert torch.allclose(sp["loss"], sb["loss"], rtol=1e-12, atol=0)
    assert torch.allclose(lp, lb, rtol=1e-12, atol=0)
    assert all(torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(gp, gb))


def test_document_mask_agrees_between_attention_implementations():
    g = torch.Generator().manual_seed(1)
    B, nh, nkv, T, hd = 1, 4, 2, 24, 8
    q = torch.randn(B, nh, T, hd, generator=g, dtype=torch.float64)
    keys = [torch.randn(B, nkv, T, hd, generator=g, dtype=torch.float64) for _ in range(3)]
    values = [torch.randn(B, nkv, T, hd, generator=g, dtype=torch.float64) for _ in range(3)]
    doc = torch.tensor([[0] * 10 + [1] * 9 + [-1] * 5])
    eager = ttt_attention.ttt_attention_eager(q, keys, values, doc)
    merged = ttt_attention.ttt_attention_merged(q, keys, values, doc=doc)
    assert torch.allclose(eager, merged, rtol=1e-12, atol=1e-12)
    apart = ttt_attention.ttt_attention_eager(q[:, :, 10:19], [k[:, :, 10:19] for k in keys],
                                              [v[:, :, 10:19] for v in values])
    assert torch.allclose(eager[:, :, 10:19], apart, rtol=1e-12, atol=1e-12)    # document 1 sees only itself


@pytest.mark.parametrize("Tq", [24, 20])
def test_flex_document_mask_equals_the_written_out_one(Tq):
    """Forward only: flex attention's backward does not run on CPU (the GPU benchmark's --check compares
    gradients there)."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, Tq, 8, generator=g)
    k, v = torch.randn(1, 2, 24, 8, generator=g), torch.randn(1, 2, 24, 8, generator=g)
    doc = torch.tensor([[0] * 10 + [1] * 9 + [-1] * 5])
    with torch.no_grad():
        (a, la), (b, lb) = (ttt_attention.causal_attention_flex(q, k, v, doc),
                            ttt_attention.causal_attention_math(q, k, v, doc))
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(la, lb, atol=1e-5)


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    """Compile as on CUDA, with the aot_eager backend (no C++ compiler needed), on fresh dynamo caches."""
    monkeypatch.setitem(ttt_attention.COMPILE, "backend", "aot_eager")
    monkeypatch.setitem(ttt_attention.COMPILE, "everywhere", True)
    monkeypatch.setattr(ttt_attention, "_COMPILED_MERGE", None)
    monkeypatch.setattr(ttt_mod, "_COMPILED_CE", {})
    monkeypatch.setattr(packing, "_COMPILED_STEPS", {})
    monkeypatch.setattr(packing, "_COMPILED_ROWS", {})
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(recompile_limit=32):
        yield
    torch._dynamo.reset()


def _train_steps(batches, K=3):
    d = compile_for_training(tiny_draft().set_attention("merged_math"))
    head = torch.randn(50, 32, generator=torch.Generator().manual_seed(0))
    counts = []
    for b in batches:
        b = {k: v.float() if v.is_floating_point() else v for k, v in b.items()}
        loss, _ = ttt_loss(d, b, head, K, step_weight=0.8)
        loss.backward()
        counts.append(_graphs())
    return counts


@pytest.mark.slow
def test_packed_rows_of_any_lengths_compile_once(compiled_on_cpu):
    """Rows of samples of varying lengths (and a long sample in windows) add no graph after the first row; a
    padded batch of another shape does (the counter is live; dynamo then turns its dimensions dynamic, which
    flex attention's compiled kernel, static in shape on CUDA, cannot)."""
    g = torch.Generator().manual_seed(2)
    samples = random_ttt_samples(g, [(n, 2) for n in (9, 23, 31, 14, 70, 12, 27, 5, 18, 33)])
    cfg = TrainConfig(batch_tokens=48, ttt_length=3, window_context=8, batching="packed")
    rows = epoch_batches(samples, cfg, 0, pack=True)
    assert len(rows) >= 4 and len({sum(b - a for _, a, b, _ in r) for r in rows}) > 1
    counts = _train_steps([collate_packed(samples, r, 48) for r in rows[:4]])
    assert counts[0] > 0 and counts[1:] == [counts[0]] * 3, counts
    padded = _train_steps([collate(samples[i:i + 2]) for i in (0, 2)])
    assert padded[0] > counts[-1], (counts, padded)


@pytest.mark.slow
@pytest.mark.parametrize("scope,loss", [("step", "kl"), ("row", "kl"), ("step", "tv"), ("row", "tv")])
def test_the_packed_loss_compiles_per_step_or_per_row_equal_to_eager(compiled_on_cpu, monkeypatch, scope, loss):
    """packed_ttt_loss where kernels are compiled (here aot_eager on CPU), per step (step 0 and steps 1..K-1, one
    graph for all: fixed diagonal slots) or per row (the K steps one graph): loss, every gradient and the
    per-step counts equal eager ttt_loss's on the same rows, with either train.loss (the loss a parameter of the
    compiled steps); the K = 4 steps of a row make 2 graphs (per row: 1), and rows of other sample lengths (a
    long sample's windows among them) add none after the first row."""
    from eagle3_core.training.ttt import POSITION_LOSSES
    monkeypatch.setattr(packing, "GRAPH_SCOPE", [scope])
    g = torch.Generator().manual_seed(3)
    samples = random_ttt_samples(g, [(n, 2) for n in (9, 23, 31, 14, 70, 12, 27, 5, 18, 33)])
    samples = [{k: v.float() if v.is_floating_point() else v for k, v in s.items()} for s in samples]
    cfg = TrainConfig(batch_tokens=48, ttt_length=4, window_context=8, batching="packed")
    rows = epoch_batches(samples, cfg, 0, pack=True)[:4]
    head = torch.randn(50, 32, generator=torch.Generator().manual_seed(0))
    added = []                                            # graphs made by packed_ttt_loss's call, per row
    for row in rows:
        b = collate_packed(samples, row, 48)
        results = []
        for fn in (ttt_loss, packed_ttt_loss):
            d = tiny_draft().set_attention("merged_math")
            before = _graphs()
            value, stats = fn(d, b, head, 4, 0.8, position_loss=POSITION_LOSSES[loss])
            value.backward()
            if fn is packed_ttt_loss:
                added.append(_graphs() - before)
            results.append((value.detach(), stats, {n: p.grad for n, p in d.named_parameters() if p.grad is not None}))
        (la, sa, ga), (lb, sb, gb) = results
        assert torch.allclose(la, lb, rtol=1e-5, atol=1e-6), (la, lb)
        assert all(torch.equal(sa[k], sb[k]) for k in ("n", "correct", "chain")), (sa, sb)
        assert ga.keys() == gb.keys() and all(torch.allclose(ga[n], gb[n], rtol=1e-4, atol=1e-6) for n in ga)
    assert added == [2 if scope == "step" else 1, 0, 0, 0], added


def test_graph_scope_auto_picks_the_row_graph_for_long_runs_only():
    """train.graph 'auto': one graph per TTT step up to ROW_GRAPH_TOKENS trained tokens, per row above; a set
    value is kept."""
    auto = TrainConfig()
    assert packing.graph_scope(auto, packing.ROW_GRAPH_TOKENS) == "step"
    assert packing.graph_scope(auto, packing.ROW_GRAPH_TOKENS + 1) == "row"
    assert packing.graph_scope(TrainConfig(graph="step"), 10 ** 12) == "step"
    assert packing.graph_scope(TrainConfig(graph="row"), 1) == "row"


def test_packed_training_with_a_long_sample_learns_and_resumes_to_the_same_bits(tmp_path):
    """train() on packed rows (a sample of 130 tokens in windows of a 48-token row among 20-token ones): the loss
    goes down, every token of every sample is fed (context counted once per window), and a run stopped after 5
    steps and resumed ends with the weights of one never stopped."""
    from eagle3_core.training.trainer import train
    from train_worker import CFG, samples
    data = samples(10)
    g = torch.Generator().manual_seed(9)
    long = random_ttt_samples(g, [(130, 3)], aux=96, final=32)[0]
    data.append({"id": "long", **{k: v.float() if v.is_floating_point() else v for k, v in long.items()}})
    lm_head = torch.randn(100, 32, generator=torch.Generator().manual_seed(5))
    cfg = CFG.model_copy(update={"batching": "packed", "batch_tokens": 48, "window_context": 8, "epochs": 3,
                                 "checkpoint_every": 2})
    full = train(tiny_draft(), data, [], lm_head, cfg, tmp_path / "full", log=lambda s: None, tensorboard=False)
    h = full["history"]
    assert sum(h[-1]["train"]["loss"]) < sum(h[0]["train"]["loss"])
    fed = sum(b - a for a, b, _ in windows(130, 48, 8)) + 10 * 20
    assert [r["tokens"] for r in h] == [fed] * 3
    part = tmp_path / "part"
    train(tiny_draft(), data, [], lm_head, cfg, part, log=lambda s: None, tensorboard=False, stop_after_steps=5)
    lines = []
    train(tiny_draft(), data, [], lm_head, cfg, part, log=lines.append, tensorboard=False)
    assert any("resumed from step_000000004.pt" in line for line in lines), lines
    a, b = (torch.load(p / "checkpoints" / sorted(os.listdir(p / "checkpoints"))[-1], weights_only=True)
            for p in (tmp_path / "full", part))
    assert all(torch.equal(t, b["model"][k]) for k, t in a["model"].items())


@pytest.mark.slow
def test_eval_reuses_the_training_graphs_and_the_compile_policy_is_restored(compiled_on_cpu, tmp_path):
    """train() on packed rows, compiled (aot_eager on CPU): the same graphs with held-out eval each epoch as
    without it (eval runs in grad mode, reusing them), and dynamo's settings are back as they were afterwards."""
    from eagle3_core.training.trainer import train
    from train_worker import CFG, samples
    lm_head = torch.randn(100, 32, generator=torch.Generator().manual_seed(5))
    cfg = CFG.model_copy(update={"batching": "packed", "batch_tokens": 48, "window_context": 8, "epochs": 1,
                                 "checkpoint_every": 100})
    counts, lines = [], []
    for i, held_out in enumerate(([], samples(4, seed=1))):
        torch._dynamo.utils.counters.clear()
        train(tiny_draft(), samples(10), held_out, lm_head, cfg, tmp_path / str(i), log=lines.append,
              tensorboard=False)
        counts.append(_graphs())
    assert counts[0] > 0 and counts[1] == counts[0], counts
    assert any("dynamo fails past 32 graphs" in line for line in lines), lines   # max(limit, 2K + 2)
    assert torch._dynamo.config.recompile_limit == 32 and not torch._dynamo.config.fail_on_recompile_limit_hit


def test_a_run_trained_before_packing_existed_stays_done(tmp_path):
    """train_key leaves train.batching and train.window_context out while they are at their defaults: the key is
    the one of the train settings as they were before (the 17 fields below), so a finished run is not retrained
    after an upgrade; set either, and the key changes. Since the keys hash results only, that formula is the older
    key the train stage still accepts (train_older_keys, contract.compat.train_fields_v4)."""
    import json

    from eagle3_core.config import preset
    from eagle3_core.pipeline.keys import stage_key
    from eagle3_core.pipeline.train_stage import train_older_keys
    before = ["epochs", "lr", "warmup_frac", "batch_tokens", "grad_accum", "grad_clip", "ttt_length", "step_weight",
              "eval_frac", "seed", "checkpoint_every", "keep_checkpoints", "device", "attention", "compile",
              "init_from", "init_vocab"]
    for stage, key in (("features", "f"), ("vocab", "v")):
        (tmp_path / stage).mkdir()
        (tmp_path / stage / "manifest.json").write_text(json.dumps({"inputs_key": key}))
    cfg = preset("demo", tmp_path)
    old = {k: v for k, v in cfg.train.model_dump(mode="json").items() if k in before}
    draft_before = {k: v for k, v in cfg.draft.model_dump(mode="json").items()     # before the capacity options
                    if k not in ("num_hidden_layers", "variant")}
    assert len(old) == len(before) and train_older_keys(cfg)[-1] == stage_key("f", "v", old, draft_before)
    assert train_older_keys(cfg.model_copy(update={"train": cfg.train.model_copy(update={"batching": "packed"})})) \
        != train_older_keys(cfg)
    assert train_older_keys(cfg.model_copy(update={"train": cfg.train.model_copy(update={"window_context": 64})})) \
        != train_older_keys(cfg)
