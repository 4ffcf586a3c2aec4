"""EAGLE-3 draft training throughput: our TTT step against SpecForge 0.2.0's on identical shapes and inputs.

GPU (the point of it): python benchmarks/train_throughput.py            Llama-3.1-8B-shaped draft, bf16, T=2048
Kimi-K2.5-sized draft: python benchmarks/train_throughput.py --shape kimi --out kimi.json
                       the draft the pipeline builds for configs/kimi_k25_agentic_100k.json (training.draft_geometry:
                       H 7168, 64 heads x 128, 64 KV heads, I 18432, N 32000, target vocab 163,840, rope theta 1e6)
                       in mode long at 8K, 16K and 32K tokens, ours (compiled, new step) beside SpecForge, 3 runs
                       each (1 warm-up + 2 timed steps); out of memory is reported as that row's result
CPU smoke test:        python benchmarks/train_throughput.py --tiny     small shapes, checks the script runs

Modes (--mode):
  fixed  one batch of B x T tokens, every step the same (the numbers below).
  real   variable-length batches drawn from a real length distribution (benchmarks/data/gsm8k_lengths.json:
         GSM8K conversations under the embedded target's template; --lengths for another JSON list): ours packs
         them into rows of --row-tokens tokens (train.batching 'packed', what the trainer does on CUDA),
         SpecForge gets batches of whole sequences padded to their longest, as its collator does, with as many
         sequences per batch as fill our rows on average. tok/s counts real tokens only, for both.
  long   one sequence of each of --long-lengths tokens (8K, 16K, 32K): tok/s and peak memory.
--repeats R runs each variant R times (fresh weights and compile caches kept) and prints the median, min and max.
--out PATH writes the rows (tok/s median, min, max, MFU, peak GiB, error) and the device as JSON; with --shape kimi
also `rate_for_rates_json`: ours at 16,384 tokens (the config's train.batch_tokens) as a configs/rates.json rate.
Batches of mode long are built on the CPU and moved to the device by each variant, and the target's lm_head and
embedding stay on the CPU, so that one row's memory is what its own step holds.

One measured step = TTT forward (ttt_length steps) + backward + grad clipping + AdamW step, on one batch of
B x T tokens with random weights and random features (aux [B, T, 3H], target final hidden [B, T, H], target
lm_head [V, H]), loss mask all ones. Prints tokens/s, MFU, peak memory per variant and the ratio of ours to
SpecForge's best backend. Each measurement runs in its own try/except: a failure prints its error and the
others still run.

FLOPs (model FLOPs, the same count for every variant, so MFU ratios equal throughput ratios), per token:
  per TTT step, forward: 2 * (2H*(nh+2*nkv)*hd + nh*hd*H + 3*H*I + H*N)        q/k/v, o, MLP, draft lm_head
                         + 4 * nh*hd * ((T+1)/2 + k)                          attention: causal + k diagonal
  training = 3 x forward (backward = 2 x forward) for all of the above, summed over k = 0..K-1,
  + 2 * 3H_t*H * 2 (fc: forward + weight gradient; aux needs no gradient)
  + 2 * H_t*N (teacher logits over the draft vocab, no gradient).
Not counted: norms, RoPE, softmax/loss elementwise work, the optimizer, SpecForge's extra full-vocab
log-sum-exp/argmax of the teacher (we read the target's argmax from the feature store instead).
MFU = FLOPs/s / --peak-tflops: by default the device's dense bf16 peak from NVIDIA's datasheets (H100 SXM and H200
SXM: 989 TFLOP/s; DATASHEET_TFLOPS); numbers in docs/benchmarks.md before 2026-12-06 used 790 TFLOP/s, a bf16 matrix
product measured on the H200 host, and say so.
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))      # the former step: a test reference

from eagle3_core.training import packing  # noqa: E402
from eagle3_core.training.draft_model import DraftShape, Eagle3Draft  # noqa: E402
from eagle3_core.training.packing import packed_ttt_loss  # noqa: E402
from eagle3_core.training.setup import compile_for_training  # noqa: E402
from eagle3_core.training.ttt import ttt_loss  # noqa: E402
from reference_paths import reference_ttt_loss  # noqa: E402
from specforge_side_by_side import fastest_backend, import_specforge  # noqa: E402

FULL = {"H": 4096, "nh": 32, "nkv": 8, "hd": 128, "I": 14336, "V": 128256, "N": 32000, "T": 2048}
TINY = {"H": 64, "nh": 4, "nkv": 2, "hd": 16, "I": 128, "V": 512, "N": 256, "T": 64}
# training.draft_geometry's Kimi-K2.5 recipe on Kimi-K2.5 (SpecForge configs/kimi-k25-eagle3.json's geometry)
KIMI = {"H": 7168, "nh": 64, "nkv": 64, "hd": 128, "I": 18432, "V": 163840, "N": 32000, "T": 16384, "theta": 1e6}
SHAPES = {"llama8b": FULL, "kimi": KIMI}
# dense bf16 tensor-core peaks from NVIDIA's datasheets (SXM parts; the datasheets print twice these "with sparsity")
DATASHEET_TFLOPS = {"H100": 989.0, "H200": 989.0}


@dataclass
class Result:
    name: str
    tok_s: float = float("nan")
    tok_s_min: float = float("nan")
    tok_s_max: float = float("nan")
    runs: int = 0
    mfu: float = float("nan")
    peak_gib: float = float("nan")
    loss: float = float("nan")
    error: str = ""
    failed_runs: str = ""                  # some (not all) runs failed: how many, and the first error


def flops_per_token(s: dict, K: int, context: float | None = None) -> float:
    """Model FLOPs of one training step per token (module docstring); context: mean causal keys per token
    ((T + 1) / 2 for one sequence of T; sum n(n+1)/2 / sum n for documents of lengths n)."""
    H, nh, nkv, hd, I, N, T = (s[k] for k in ("H", "nh", "nkv", "hd", "I", "N", "T"))
    dense = 2 * (2 * H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * I + H * N)
    context = (T + 1) / 2 if context is None else context
    total = 0.0
    for k in range(K):
        total += 3 * (dense + 4 * nh * hd * (context + k))
    return total + 2 * 3 * H * H * 2 + 2 * H * N


def make_inputs(s: dict, B: int, device: torch.device, seed: int = 0) -> dict:
    """Random weights and features, identical for every variant (seeded)."""
    g = torch.Generator().manual_seed(seed)
    H, V, N, T = s["H"], s["V"], s["N"], s["T"]
    vocab = torch.randperm(V, generator=g)[:N].sort().values               # draft vocab: N target ids
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[vocab] = True
    lm_head = torch.randn(V, H, generator=g) * H ** -0.5
    final = torch.randn(B, T, H, generator=g)
    top1 = torch.cat([(final[b] @ lm_head.T).argmax(-1)[None] for b in range(B)])  # the target's argmax
    return {"input_ids": torch.randint(0, V, (B, T), generator=g).to(device),
            "loss_mask": torch.ones(B, T, dtype=torch.bool, device=device),
            "aux": torch.randn(B, T, 3 * H, generator=g).to(device, torch.bfloat16),
            "final": final.to(device, torch.bfloat16), "target_top1": top1.to(device),
            "lm_head": lm_head.to(device), "embed": (torch.randn(V, H, generator=g) * 0.02).to(device),
            "d2t": (vocab - torch.arange(N)).to(device), "t2d": t2d.to(device), "vocab": vocab.to(device)}


def draft_shape(s: dict) -> DraftShape:
    """The DraftShape of the benchmark's shape dict `s` (SHAPES, TINY)."""
    return DraftShape(hidden_size=s["H"], target_hidden_size=s["H"], num_attention_heads=s["nh"],
                      num_key_value_heads=s["nkv"], head_dim=s["hd"], intermediate_size=s["I"],
                      vocab_size=s["V"], draft_vocab_size=s["N"], rope_theta=s.get("theta", 500000.0),
                      max_position_embeddings=max(8192, s["T"] * 2), aux_layer_ids=[1, 15, 28])


def make_draft(s: dict, inp: dict, device: torch.device) -> Eagle3Draft:
    with torch.device(device):
        draft = Eagle3Draft(draft_shape(s))
    draft.init_weights(0)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(inp["embed"])
        draft.d2t.copy_(inp["d2t"])
        draft.t2d.copy_(inp["t2d"])
    return draft


def timed(step, device: torch.device, warmup: int, iters: int) -> tuple[float, float, float]:
    """(real tokens per second, peak GiB, last loss) of `step()` (which returns (loss, real tokens)) after
    `warmup` untimed calls."""
    loss = None
    for _ in range(warmup):
        loss, _ = step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0, tokens = time.perf_counter(), 0
    for _ in range(iters):
        loss, n = step()
        tokens += n
    if device.type == "cuda":
        torch.cuda.synchronize()
    tok_s = tokens / (time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else float("nan")
    return tok_s, peak, float(loss)


def packed_row(s: dict, lengths: list[int], row_len: int, device: torch.device, g: torch.Generator,
               lm_head: torch.Tensor) -> dict:
    """A packed row (eagle3_core.training.packing's layout: doc ids, per-document positions) of random features holding
    documents of `lengths` (sum <= row_len); loss mask from 30% into each document (the prompt before it)."""
    doc = torch.full((1, row_len), -1, dtype=torch.long)
    position = torch.zeros(1, row_len, dtype=torch.long)
    mask = torch.zeros(1, row_len, dtype=torch.bool)
    at = 0
    for d, n in enumerate(lengths):
        doc[0, at:at + n], position[0, at:at + n] = d, torch.arange(n)
        mask[0, at + int(0.3 * n):at + n] = True
        at += n
    return {**_features(s, 1, row_len, device, g, lm_head), "loss_mask": mask.to(device), "doc": doc.to(device),
            "position": position.to(device), "tokens": at}


def padded_batch(s: dict, lengths: list[int], device: torch.device, g: torch.Generator, lm_head: torch.Tensor) -> dict:
    """Sequences of `lengths` padded to the longest (SpecForge's collator): attention_mask 0 on padding, loss mask
    from 30% into each sequence."""
    B, T = len(lengths), max(lengths)
    attn = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        attn[b, :n] = 1
        mask[b, int(0.3 * n):n] = True
    return {**_features(s, B, T, device, g, lm_head), "loss_mask": mask.to(device),
            "attention_mask": attn.to(device), "tokens": sum(lengths)}


def _features(s: dict, B: int, T: int, device: torch.device, g: torch.Generator, lm_head: torch.Tensor) -> dict:
    """Random token ids, aux [B, T, 3H] and final [B, T, H] bf16 on `device`, and the target's argmax of final."""
    H = s["H"]
    final = torch.randn(B, T, H, generator=g).to(device, torch.bfloat16)
    top1 = torch.cat([torch.cat([(final[b, a:a + 4096].to(lm_head.device).float() @ lm_head.T).argmax(-1).to(device)
                                 for a in range(0, T, 4096)])[None] for b in range(B)])   # [4096, V] at a time
    return {"input_ids": torch.randint(0, s["V"], (B, T), generator=g).to(device),
            "aux": torch.randn(B, T, 3 * H, generator=g).to(device, torch.bfloat16), "final": final,
            "target_top1": top1}


def real_batches(s: dict, lengths: list[int], row_len: int, n: int, device, lm_head, seed: int = 0):
    """n packed rows for ours and n padded batches for SpecForge drawn from `lengths` (a real distribution),
    SpecForge's batches holding as many sequences as our rows do on average. Returns (ours, theirs, per_batch)."""
    from eagle3_core.training.packing import pack_rows
    rng = torch.Generator().manual_seed(seed)
    draw = [min(lengths[int(i)], row_len) for i in torch.randint(0, len(lengths), (n * row_len,), generator=rng)]
    rows = pack_rows([(i, 0, m) for i, m in enumerate(draw)], row_len, seed)[:n]
    ours = [packed_row(s, [m for _, _, m in r], row_len, device, rng, lm_head) for r in rows]
    per_batch = max(1, round(sum(len(r) for r in rows) / len(rows)))
    theirs = [padded_batch(s, draw[j * per_batch:(j + 1) * per_batch], device, rng, lm_head) for j in range(n)]
    return ours, theirs, per_batch


def on_device(batch: dict, device: torch.device) -> dict:
    """`batch` with its tensors on `device` (mode long builds its batches on the CPU)."""
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def ours_step_fn(s: dict, inp: dict, device: torch.device, K: int, attention: str, compile_: bool,
                 fast: bool = True, batches: list[dict] | None = None, whole: bool = False,
                 graph: str | None = None, mark=None):
    """A training step of ours: on the fixed batch of `inp`, or cycling through `batches` (packed rows). whole:
    packed rows through packing.packed_ttt_loss, the trainer's path for runs of more than packing.ROW_GRAPH_TOKENS
    tokens (the whole TTT loss one compiled graph: train.graph 'row'); graph 'step' or 'row': packed rows through
    packed_ttt_loss with that graph scope (set at every step, so that variants of both scopes can alternate).
    mark(phase): called after the forward, the backward and the optimizer step ('forward', 'backward',
    'optimizer'; benchmarks/train_step_profile.py times the phases with it)."""
    graph = "row" if whole else graph
    draft = make_draft(s, inp, device).set_attention(attention)
    loss_fn = packed_ttt_loss if graph else ttt_loss if fast else reference_ttt_loss
    mark = mark or (lambda phase: None)
    if compile_:
        compile_for_training(draft)
    head_draft = inp["lm_head"][inp["vocab"].to(inp["lm_head"].device)].to(device)   # [N, H_t] fp32
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    keys = ("input_ids", "loss_mask", "aux", "final", "target_top1", "doc", "position")
    if batches is None:
        batches = [{**inp, "tokens": inp["input_ids"].numel()}]
    batches = [on_device(b, device) for b in batches]
    if device.type != "cuda":                                              # fp32 on CPU, as the trainer does
        batches = [{k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in b.items()}
                   for b in batches]
    it = itertools.cycle(batches)

    def step():
        b = next(it)
        if graph:
            packing.GRAPH_SCOPE[0] = graph
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, _ = loss_fn(draft, {k: b[k] for k in keys if k in b}, head_draft, K, 0.8)
        mark("forward")
        loss.backward()
        mark("backward")
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark("optimizer")
        return loss.detach(), b["tokens"]
    return step


def specforge_step_fn(s: dict, inp: dict, device: torch.device, K: int, backend: str,
                      batches: list[dict] | None = None, mark=None):
    """SpecForge 0.2.0: OnlineEagle3Model around LlamaForCausalLMEagle3 (built from its config: under
    transformers 5.x from_pretrained leaves its rotary caches uninitialised), bf16 weights with its
    BF16Optimizer (fp32 master weights, AdamW, clip 0.5), loss sum_k 0.8**k ploss_k as SpecForge's trainer."""
    OnlineEagle3Model, LlamaForCausalLMEagle3, _ = import_specforge()   # without Triton: its loss in PyTorch
    from specforge.optimizer import BF16Optimizer
    from transformers.models.llama.configuration_llama import LlamaConfig

    cfg = LlamaConfig(hidden_size=s["H"], num_attention_heads=s["nh"], num_key_value_heads=s["nkv"],
                      head_dim=s["hd"], intermediate_size=s["I"], vocab_size=s["V"], num_hidden_layers=1,
                      max_position_embeddings=max(8192, s["T"] * 2), rms_norm_eps=1e-5, hidden_act="silu",
                      rope_theta=s.get("theta", 500000.0), tie_word_embeddings=False, pretraining_tp=1)
    cfg.draft_vocab_size = s["N"]
    with torch.device(device):
        model = LlamaForCausalLMEagle3(cfg, attention_backend=backend)
    ours = make_draft(s, inp, device)                                       # the same initial weights
    missing, unexpected = model.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("rotary" in m or "inv_freq" in m for m in missing), (missing, unexpected)
    del ours
    model = model.to(device, torch.bfloat16)
    model.embed_tokens.weight.requires_grad_(False)                         # the target's, frozen
    model.d2t.copy_(inp["d2t"])
    model.t2d.copy_(inp["t2d"])
    wrapper = OnlineEagle3Model(draft_model=model, length=K, attention_backend=backend)
    opt = BF16Optimizer(model, lr=1e-4, max_grad_norm=0.5, total_steps=1000)
    opt.configure_grad_norm_reduction(enabled=False)
    lm_head = inp["lm_head"].to(device, torch.bfloat16)
    if batches is None:
        batches = [{**inp, "attention_mask": torch.ones_like(inp["input_ids"]), "tokens": inp["input_ids"].numel()}]
    batches = [on_device(b, device) for b in batches]
    it = itertools.cycle(batches)
    mark = mark or (lambda phase: None)

    def step():
        b = next(it)
        plosses, *_ = wrapper(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                              target=None, loss_mask=b["loss_mask"][..., None].long(), hidden_states=b["aux"],
                              target_hidden_for_compact=b["final"], target_head_weight=lm_head)
        loss = sum(0.8 ** i * pl for i, pl in enumerate(plosses))
        mark("forward")
        loss.backward()
        mark("backward")
        opt.step()                                   # BF16Optimizer: clipping, AdamW on fp32 masters, zero grads
        mark("optimizer")
        return loss.detach(), b["tokens"]
    return step


def measure(name: str, make_step, s: dict, K: int, device, warmup: int, iters: int, peak_tflops: float,
            context: float | None = None):
    """One variant's Result; context: mean causal keys per real token (flops_per_token)."""
    res = Result(name)
    try:
        step = make_step()
        tok_s, peak, loss = timed(step, device, warmup, iters)
        res.tok_s, res.peak_gib, res.loss = tok_s, peak, loss
        res.mfu = tok_s * flops_per_token(s, K, context) / (peak_tflops * 1e12)
    except Exception as e:  # noqa: BLE001 (a benchmark: report the failure, go on with the other variants)
        res.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        traceback.print_exc(limit=4)
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"  {name}: " + (f"{res.tok_s:,.0f} tok/s, MFU {res.mfu:.1%}, peak {res.peak_gib:.1f} GiB, "
                           f"loss {res.loss:.4f}" if not res.error else f"FAILED {res.error}"), flush=True)
    return res


def check_equivalence(s: dict, device: torch.device, K: int) -> None:
    """Loss and gradients of our merged_flex attention against eager on this device (small T)."""
    small = {**s, "T": min(s["T"], 256)}
    inp = make_inputs(small, 1, device, seed=1)
    batch = {k: inp[k] for k in ("input_ids", "loss_mask", "aux", "final", "target_top1")}
    batch = {k: v.float() if v.is_floating_point() else v for k, v in batch.items()}
    out = {}
    impl = "merged_flex" if device.type == "cuda" else "merged_math"        # flex has no backward on CPU
    for name, attn, fast, amp in (("eager old step fp32", "eager", False, False),
                                  (f"{impl} new step fp32", impl, True, False),
                                  (f"{impl} old step bf16", impl, False, True),
                                  (f"{impl} new step bf16", impl, True, True)):
        if amp and device.type != "cuda":
            continue
        d = make_draft(small, inp, device).set_attention(attn)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss, _ = (ttt_loss if fast else reference_ttt_loss)(d, batch, inp["lm_head"][inp["vocab"]], K)
        loss.backward()
        out[name] = (loss.item(), torch.cat([p.grad.flatten() for p in d.parameters() if p.grad is not None]))
    names = list(out)
    for a, b in ((names[0], names[1]), (names[2], names[3]) if len(names) == 4 else (None, None)):
        if a is None:
            continue
        (la, ga), (lb, gb) = out[a], out[b]
        print(f"check (T={small['T']}): loss {a} {la:.6f}, {b} {lb:.6f}; gradient max rel diff "
              f"{((ga - gb).abs().max() / ga.abs().max()).item():.2e}")


def profile(make_step, device: torch.device, rows: int = 20) -> None:
    """Top CUDA kernels of one step (what bounds it)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof
    step = make_step()
    step()
    step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with prof(activities=acts) as p:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(p.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60))


def packed_check(s: dict, device: torch.device, K: int) -> None:
    """Loss and gradients of a packed row (three documents): merged_flex (or merged_math on CPU) against eager."""
    small = {**s, "T": 256}
    inp = make_inputs(small, 1, device, seed=2)
    row = packed_row(small, [100, 80, 60], 256, device, torch.Generator().manual_seed(3), inp["lm_head"])
    row = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in row.items()}
    impl = "merged_flex" if device.type == "cuda" else "merged_math"
    out = {}
    for attn in ("eager", impl):
        d = make_draft(small, inp, device).set_attention(attn)
        loss, _ = ttt_loss(d, {k: v for k, v in row.items() if k != "tokens"}, inp["lm_head"][inp["vocab"]], K)
        loss.backward()
        out[attn] = (loss.item(), torch.cat([p.grad.flatten() for p in d.parameters() if p.grad is not None]))
    (la, ga), (lb, gb) = out["eager"], out[impl]
    print(f"check packed row (documents 100, 80, 60 in 256, fp32): loss eager {la:.6f}, {impl} {lb:.6f}; "
          f"gradient max rel diff {((ga - gb).abs().max() / ga.abs().max()).item():.2e}")


def summary_row(name: str, runs: list[Result]) -> Result:
    """The median run (by tok/s) of `runs`, named with min and max; a failure if every run failed."""
    ok = sorted((r for r in runs if not r.error), key=lambda r: r.tok_s)
    if not ok:
        return runs[0]
    med = ok[len(ok) // 2] if len(ok) % 2 else Result(name, statistics.median(r.tok_s for r in ok),
                                                      mfu=statistics.median(r.mfu for r in ok),
                                                      peak_gib=max(r.peak_gib for r in ok), loss=ok[0].loss)
    spread = f" [min {ok[0].tok_s:,.0f}, max {ok[-1].tok_s:,.0f}, {len(ok)} runs]" if len(ok) > 1 else ""
    failed = [r.error for r in runs if r.error]
    return Result(name + spread, med.tok_s, ok[0].tok_s, ok[-1].tok_s, len(ok), med.mfu, med.peak_gib, med.loss,
                  failed_runs=f"{len(failed)} of {len(runs)} runs failed: {failed[0]}" if failed else "")


def write_json(path: str, args, s: dict, K: int, device: torch.device, results: list[Result]) -> dict:
    """The rows as JSON at `path` (and returned): device, shapes, TTT steps, and per row its name, tok/s median,
    min and max, runs, MFU, peak GiB and error (out of memory included: that row's result); with --shape kimi the
    rate configs/rates.json's profile kimi_k25_draft takes (ours at T=16384, the config's train.batch_tokens)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = [{"variant": r.name.split(" [")[0], "tok_s": r.tok_s, "tok_s_min": r.tok_s_min, "tok_s_max": r.tok_s_max,
             "runs": r.runs, "mfu": r.mfu, "peak_gib": r.peak_gib, "loss": r.loss, "error": r.error,
             "failed_runs": r.failed_runs}
            for r in results]
    out = {"device": name, "torch": torch.__version__, "shape": args.shape, "shapes": s, "ttt": K, "mode": args.mode,
           "repeats": args.repeats, "rows": rows}
    ours16 = [r for r in rows if r["variant"].startswith("T=16384:ours") and not r["error"]]
    if args.shape == "kimi" and ours16:
        best = max(ours16, key=lambda r: r["tok_s"])
        out["rate_for_rates_json"] = {
            "value": round(best["tok_s"]), "unit": "token passes/s", "status": "measured",
            "source": f"benchmarks/train_throughput.py --shape kimi on one {name}, {time.strftime('%Y-%m-%d')}: "
                      f"{best['variant']} median of {best['runs']} (min {best['tok_s_min']:,.0f}, max "
                      f"{best['tok_s_max']:,.0f}), one 16,384-token sequence, TTT {K}"}
    text = json.dumps(out, indent=2, default=float).replace("NaN", "null")      # strict JSON: no NaN
    Path(path).write_text(text)
    print(text)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes on CPU (smoke test of this script)")
    ap.add_argument("--shape", choices=tuple(SHAPES), default="llama8b",
                    help="the draft: llama8b (Llama-3.1-8B's) or kimi (Kimi-K2.5's, as draft_geometry builds it; "
                         "defaults then: --mode long, --compile on, --repeats 3, --warmup 1, --iters 2)")
    ap.add_argument("--out", default=None, help="write the rows as JSON to this path (and print it)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--mode", choices=("fixed", "real", "long"), default=None, help="see the module docstring "
                                                                                     "(default fixed)")
    ap.add_argument("--batch", type=int, default=1, help="fixed: sequences per step (B)")
    ap.add_argument("--seq", type=int, default=None, help="fixed: sequence length T (default 2048; --tiny 64)")
    ap.add_argument("--row-tokens", type=int, default=None, help="real: tokens per packed row (default 8192; "
                                                                 "--tiny 256)")
    ap.add_argument("--lengths", default=str(Path(__file__).with_name("data") / "gsm8k_lengths.json"),
                    help="real: JSON with a 'lengths' list (or a bare list) of sample token lengths")
    ap.add_argument("--long-lengths", default=None, help="long: comma-separated sequence lengths (default "
                                                         "8192,16384,32768; --tiny 128,256)")
    ap.add_argument("--repeats", type=int, default=None, help="runs of each variant: median, min and max "
                                                              "printed (default 1)")
    ap.add_argument("--ttt", type=int, default=7, help="TTT steps K")
    ap.add_argument("--iters", type=int, default=None, help="timed steps (default 10; --tiny 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; --tiny 1)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="bf16 dense peak for MFU (default: the "
                                                                     "device's datasheet figure, DATASHEET_TFLOPS)")
    ap.add_argument("--attention", default=None,
                    help="our TTT attention implementations to measure, comma-separated (default: "
                         "merged_flex on CUDA; merged_math on CPU, where flex has no backward)")
    ap.add_argument("--compile", default=None, help="our variants without/with torch.compile: off,on (the "
                                                     "default)")
    ap.add_argument("--step", default="old,new",
                    help="fixed: our TTT step paths: new (ttt.ttt_loss: RoPE and weight casts once per batch, fused "
                         "loss from teacher logits) and/or old (the former step, tests/reference_paths.py; both "
                         "with the attention merge compiled on CUDA); real and long: new (kernels compiled, "
                         "steps eager) and/or whole (packing.packed_ttt_loss, the trainer's path for long runs: "
                         "the whole TTT loss one compiled graph, train.graph 'row')")
    ap.add_argument("--specforge", default=None,
                    help="SpecForge attention backends to measure, comma-separated ('' for none; default "
                         "flex_attention on CUDA, sdpa elsewhere: flex attention has no backward on a CPU)")
    ap.add_argument("--check", action="store_true", help="first compare merged_flex with eager (loss, grads), "
                                                         "also on a packed row")
    ap.add_argument("--profile", default="", help="profile one step of this variant, e.g. "
                                                  "ours:merged_flex:on:new or specforge:flex_attention")
    args = ap.parse_args()
    kimi = args.shape == "kimi"
    args.mode = args.mode or ("long" if kimi else "fixed")
    args.compile = args.compile or ("on" if kimi else "off,on")
    args.repeats = args.repeats or (3 if kimi else 1)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu"))
    s = dict(TINY if args.tiny else SHAPES[args.shape])
    if args.tiny and kimi:                                   # Kimi's proportions at toy size: no GQA, theta 1e6
        s.update(nkv=s["nh"], theta=1e6)
    if args.seq:
        s["T"] = args.seq
    iters = args.iters or (2 if args.tiny or kimi else 10)
    warmup = args.warmup or (1 if args.tiny or kimi else 3)
    B, K = args.batch, args.ttt
    if args.peak_tflops is None:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        args.peak_tflops = next((v for k, v in DATASHEET_TFLOPS.items() if k in name), float("nan"))
    shown = {k: v for k, v in s.items() if not (args.mode == "long" and k == "T")}    # long: T is each row's length
    print(f"mode {args.mode}, shapes {shown}, TTT {K}, device {device} "
          f"({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), torch {torch.__version__}")
    inp = make_inputs({**s, "T": min(s["T"], 256)} if args.mode == "long" else s, B, device)   # long: its own rows
    if args.check:
        for check in (check_equivalence, packed_check):
            try:
                check(s, device, K)
            except Exception:  # noqa: BLE001 (report and go on to the timings)
                traceback.print_exc(limit=4)
        torch._dynamo.reset()            # the checks' shapes and dtypes must not use up the timed runs' recompiles
    attentions = list(filter(None, (args.attention or ("merged_flex" if device.type == "cuda"
                                                       else "merged_math")).split(",")))
    compiles = list(filter(None, args.compile.split(",")))
    specforge = args.specforge if args.specforge is not None else fastest_backend(device)
    backends = list(filter(None, specforge.split(",")))
    if args.mode == "fixed":
        print(f"B {B}, T {s['T']}; model FLOPs per token per training step: {flops_per_token(s, K) / 1e9:.2f} GFLOP "
              f"(formula in the module docstring); peak {args.peak_tflops:.0f} TFLOP/s")
        cases = [("", s, None, None, None)]
    elif args.mode == "real":
        row = args.row_tokens or (256 if args.tiny else 8192)
        data = json.loads(Path(args.lengths).read_text())
        lengths = data["lengths"] if isinstance(data, dict) else data
        ours_b, theirs_b, per = real_batches(s, lengths, row, 4, device, inp["lm_head"])
        docs = [n for r in ours_b for n in torch.bincount(r["doc"][r["doc"] >= 0]).tolist()]
        ctx = sum(n * (n + 1) / 2 for n in docs) / sum(docs)
        fill = sum(r["tokens"] for r in ours_b) / (row * len(ours_b))
        pad = sum(b["tokens"] for b in theirs_b) / sum(b["input_ids"].numel() for b in theirs_b)
        print(f"{len(lengths)} real lengths ({Path(args.lengths).name}: mean {statistics.mean(lengths):.0f}, max "
              f"{max(lengths)}); ours: rows of {row} tokens, {fill:.1%} real; SpecForge: {per} sequences per batch "
              f"padded to the longest, {pad:.1%} real; tok/s counts real tokens")
        cases = [("", s, ours_b, theirs_b, ctx)]
    else:
        lens = [int(x) for x in (args.long_lengths or ("128,256" if args.tiny else "8192,16384,32768")).split(",")]
        cases = []
        for T in lens:
            sT = {**s, "T": T}
            g = torch.Generator().manual_seed(T)
            cpu = torch.device("cpu")                                    # moved to the device per variant
            cases.append((f"T={T}:", sT, [packed_row(sT, [T], T, cpu, g, inp["lm_head"])],
                          [padded_batch(sT, [T], cpu, g, inp["lm_head"])], None))
        inp["lm_head"], inp["embed"] = inp["lm_head"].cpu(), inp["embed"].cpu()   # each variant takes its copy
    steps = list(filter(None, args.step.split(",")))
    if args.mode == "fixed" and "whole" in steps:
        sys.exit("--step whole needs packed rows: --mode real or long")
    if args.mode != "fixed":
        steps = [x for x in steps if x != "old"] or ["new"]

    variants = []
    for prefix, sc, ours_b, theirs_b, ctx in cases:
        for attn in attentions:
            for c in compiles:
                for st in steps:
                    variants.append((f"{prefix}ours:{attn}:{c}:{st}", sc, ctx, lambda a=attn, c=c, st=st, sc=sc,
                                     ob=ours_b: ours_step_fn(sc, inp, device, K, a, c == "on", st != "old", ob,
                                                             st == "whole")))
        for backend in backends:
            variants.append((f"{prefix}specforge:{backend}", sc, ctx, lambda b=backend, sc=sc, tb=theirs_b:
                             specforge_step_fn(sc, inp, device, K, b, tb)))

    if args.profile:
        make = {n: m for n, _, _, m in variants}.get(args.profile)
        if make is None:
            print(f"--profile {args.profile!r}: not one of {[n for n, _, _, _ in variants]}")
        else:
            try:
                profile(make, device)
            except Exception:  # noqa: BLE001 (report and go on to the timings)
                traceback.print_exc(limit=4)

    results = [summary_row(name, [measure(name, make, sc, K, device, warmup, iters, args.peak_tflops, ctx)
                                  for _ in range(args.repeats)]) for name, sc, ctx, make in variants]

    print("\n| variant | tok/s | MFU | peak GiB | loss |\n|---|---|---|---|---|")
    for r in results:
        if r.error:
            print(f"| {r.name} | failed: {r.error[:120]} | | | |")
        else:
            print(f"| {r.name} | {r.tok_s:,.0f} | {r.mfu:.1%} | {r.peak_gib:.1f} | {r.loss:.4f} |")
    for prefix, *_ in cases:
        ok = [r for r in results if not r.error and r.name.startswith(prefix)]
        by_name = {r.name.split(" [")[0]: r for r in ok}
        for r in ok:
            base = r.name.split(" [")[0]
            old = by_name.get(base[:-len(":new")] + ":old") if base.endswith(":new") else None
            if old:
                print(f"{base} / {old.name.split(' [')[0]}: {r.tok_s / old.tok_s:.2f}x")
        ours = [r for r in ok if r.name[len(prefix):].startswith("ours")]
        theirs = [r for r in ok if r.name[len(prefix):].startswith("specforge")]
        if ours and theirs:
            a, b = max(ours, key=lambda r: r.tok_s), max(theirs, key=lambda r: r.tok_s)
            print(f"{prefix or args.mode}: best ours {a.name.split(' [')[0]} {a.tok_s:,.0f} tok/s / best SpecForge "
                  f"{b.name.split(' [')[0]} {b.tok_s:,.0f} tok/s = {a.tok_s / b.tok_s:.2f}x (goal >= 1.5x)")
        elif ours and backends:
            print(f"{prefix or args.mode}: no SpecForge measurement succeeded: ratio not available (errors above)")
    if args.out:
        write_json(args.out, args, s, K, device, results)


if __name__ == "__main__":
    main()
