"""One GPU's share of Kimi-K2.5 on an 8-GPU node under the `ep_int4` features backend, timed on one H200, and the
node's extraction rate projected from it.

  python benchmarks/int4_ep_throughput.py --out result.json          # H200 (about 5 minutes)
  python benchmarks/int4_ep_throughput.py --tiny --out result.json   # CPU smoke run with small shapes
  python benchmarks/int4_ep_throughput.py --rates-from benchmarks/data/int4_ep_h200.json   # the rates profile

Legend: B = 16,384 tokens per forward (features.batch_tokens of configs/kimi_k25_team_10k_to_100k.json), H 7,168,
I 2,048 (expert width), E 384 routed experts of which 8 per token, W = 8 ranks (EP 8: 48 experts each; TP 8 for
MLA: 8 of 64 heads each). Random weights; Kimi-K2.5's dimensions (transformers' Kimi_K25Config text_config).

Rows (each: median, min and max of 3 timings, each the mean of `--iters` calls after warm-up, CUDA events):
- experts_int4: target.int4_experts.Int4Experts with 48 experts packed INT4 (the layout of the published
  checkpoint), B tokens routed top-8 over 384 experts (about B pairs land on the 48), one layer: dequantize into the
  shared buffer + grouped SwiGLU matmul + weighting and scatter. experts_bf16: the same with the weights already
  bf16 (the bound); dequantize: the dequantization alone. experts_int4_fused (CUDA): the same layer, both grouped
  matmuls reading the packed words and dequantizing in registers (target.int4_grouped_mm), no dequantized buffer.
- mla_8_heads / mla_64_heads: transformers' DeepseekV3Attention (SDPA) on [8, 2048, H], 8 heads (one TP-8 shard,
  as target.ep_loading slices it) and all 64.
- moe_rest: the router (fp32 logits, as transformers runs it) plus the shared expert's 1/8 slice.
- dense_mlp: layer 0's MLP at 1/8 width; lm_head: the chunked lm_head argmax of features.extract on B tokens
  (whole lm_head on every rank).
- end_to_end: a 4-layer Kimi-shaped model of one rank's share (8 heads, 48 experts top-1, so each MoE layer sees
  the B token-expert pairs one EP-8 rank sees; dense MLP at 1/8 width; full vocab) written as an INT4 checkpoint and
  run through the features stage (features.backend 'ep_int4', torchrun of one process, shards written in
  features.format fp8 as the Kimi-K2.5 configs write them), on N and 2N samples of 2,048 tokens: the
  marginal tokens/s (the fixed costs, torchrun start and the load, cancel).
Checks: the Triton dequantization against the torch reference (bit for bit) and the grouped matmul against the
per-expert loop.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_core.target.int4_experts import Int4Experts, dequantize_int4, unpack_int4  # noqa: E402

KIMI = dict(hidden=7168, width=2048, experts=384, topk=8, heads=64, q_lora=1536, kv_lora=512, nope=128, rope=64,
            v=128, vocab=163840, dense=18432, tokens=16384, seq=2048, ranks=8)
TINY = dict(hidden=256, width=128, experts=32, topk=4, heads=8, q_lora=64, kv_lora=32, nope=16, rope=16, v=16,
            vocab=512, dense=512, tokens=512, seq=128, ranks=8)
YARN = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 50000.0}


def timed(fn, dev, iters: int) -> dict:
    """{median_ms, min_ms, max_ms, runs_ms}: 3 timings of the mean of `iters` calls after 2 warm-up calls."""
    for _ in range(2):
        fn()
    runs = []
    for _ in range(3):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            torch.cuda.synchronize()
            runs.append(a.elapsed_time(b) / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            runs.append((time.perf_counter() - t0) * 1e3 / iters)
    return {"median_ms": statistics.median(runs), "min_ms": min(runs), "max_ms": max(runs), "runs_ms": runs}


def random_packed(shape: tuple[int, ...], dev) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed int32 [..., R, K/8] of random nibbles, bf16 scale [..., R, K/32]) for weights of std ~1/sqrt(K)."""
    *lead, K = shape
    packed = torch.randint(-2 ** 31, 2 ** 31, (*lead, K // 8), dtype=torch.int64, device=dev).to(torch.int32)
    scale = torch.full((*lead, K // 32), 1 / (4.6 * K ** 0.5), dtype=torch.bfloat16, device=dev)
    return packed, scale


def gemm_layouts(ex, x, idx, dev, iters: int) -> dict:
    """The two grouped matmuls alone on bf16 weights: [E, N, K] transposed (what Int4Experts passes) against
    [E, K, N] contiguous."""
    local = idx - ex.first
    tok, slot = ((local >= 0) & (local < ex.num_local)).nonzero(as_tuple=True)
    expert = local[tok, slot].sort().values
    xs = x.index_select(0, tok)
    offs = torch.bincount(expert, minlength=ex.num_local).cumsum(0).to(torch.int32)
    gu, dn = (t.clone() for t in ex.dequantized())
    h = torch.randn(xs.shape[0], ex.width, device=x.device, dtype=x.dtype)
    res = {"transposed": timed(lambda: (F.grouped_mm(xs, gu.transpose(-2, -1), offs=offs),
                                        F.grouped_mm(h, dn.transpose(-2, -1), offs=offs)), dev, iters)}
    gu_t, dn_t = gu.transpose(-2, -1).contiguous(), dn.transpose(-2, -1).contiguous()
    res["contiguous"] = timed(lambda: (F.grouped_mm(xs, gu_t, offs=offs), F.grouped_mm(h, dn_t, offs=offs)), dev,
                              iters)
    return res


def experts_rows(d: dict, dev, iters: int, profile: bool = False) -> dict:
    H, I, E_l = d["hidden"], d["width"], d["experts"] // d["ranks"]
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ex = Int4Experts(0, E_l, H, I, F.silu, dtype, device=dev)
    for name, shape in (("gate_up", (E_l, 2 * I, H)), ("down", (E_l, H, I))):
        p, s = random_packed(shape, dev)
        getattr(ex, f"{name}_packed").copy_(p)
        getattr(ex, f"{name}_scale").copy_(s)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(d["tokens"], H, device=dev, dtype=dtype, generator=g)
    idx = torch.rand(d["tokens"], d["experts"], device=dev, generator=g).topk(d["topk"], dim=-1).indices
    w = torch.rand(d["tokens"], d["topk"], device=dev, generator=g)
    pairs = int(((idx >= 0) & (idx < E_l)).sum())
    out = {"pairs_on_rank": pairs, "experts_on_rank": E_l}
    # checks: the Triton kernel against the torch reference, bit for bit; grouped matmul against the loop
    p, s = ex.gate_up_packed[:2], ex.gate_up_scale[:2]
    ref = (unpack_int4(p).view(*s.shape, 32).to(s.dtype) * s[..., None]).view(*p.shape[:-1], -1)
    out["dequantize_bit_identical"] = bool(torch.equal(dequantize_int4(p, s).view(torch.int16),
                                                       ref.view(torch.int16)))
    y = ex(x, idx, w)
    import eagle3_core.target.int4_experts as m
    keep = m._grouped_mm_ok
    m._grouped_mm_ok = lambda *a: False
    try:
        y_loop = ex(x, idx, w)
    finally:
        m._grouped_mm_ok = keep
    out["grouped_vs_loop_max_rel"] = float((y - y_loop).float().abs().max() / y_loop.float().abs().max())
    out["experts_int4"] = timed(lambda: ex(x, idx, w), dev, iters)
    if dev.type == "cuda":
        out.update(fused_rows(ex, (x, idx, w), y, dev, iters))
    if profile and dev.type == "cuda":
        from torch.profiler import ProfilerActivity, profile as prof
        with prof(activities=[ProfilerActivity.CUDA]) as pr:
            for _ in range(3):
                ex(x, idx, w)
            torch.cuda.synchronize()
        out["profile"] = pr.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=70)
        print(out["profile"], flush=True)
        out["gemm_layouts"] = gemm_layouts(ex, x, idx, dev, iters)
    out["dequantize"] = timed(ex.dequantized, dev, iters)
    gu, dn = (t.clone() for t in ex.dequantized())
    ex.dequantized = lambda: (gu, dn)
    out["experts_bf16"] = timed(lambda: ex(x, idx, w), dev, iters)
    del ex, gu, dn
    return out


def fused_rows(ex: Int4Experts, args: tuple, y: torch.Tensor, dev, iters: int) -> dict:
    """experts_int4_fused: the same layer with both matmuls reading the packed words (target.int4_grouped_mm), its
    time and its largest difference from the dequantizing path relative to that path's largest output."""
    ex.fused = True
    try:
        y_fused = ex(*args)
        return {"fused_vs_dequantized_max_rel": float((y_fused - y).float().abs().max() / y.float().abs().max()),
                "experts_int4_fused": timed(lambda: ex(*args), dev, iters)}
    finally:
        ex.fused = False


def use_tiles(path: Path, d: dict) -> dict:
    """Take a tiles sweep's `best` (benchmarks/int4_grouped_mm_tiles.py) as target.int4_grouped_mm's launch shapes
    for this run's two matmul shapes; returns them."""
    from eagle3_core.target import int4_grouped_mm as gmm   # Triton: only a run given --tiles imports it here
    best = json.loads(path.read_text())["best"]
    for name, nk in (("gate_up", (2 * d["width"], d["hidden"])), ("down", (d["hidden"], d["width"]))):
        if best.get(name):
            gmm.TILES[nk] = gmm.Tiles(**best[name])
    return best


def kimi_config(d: dict, heads: int, **kw):
    from transformers import DeepseekV3Config
    cfg = DeepseekV3Config(vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["dense"],
                           moe_intermediate_size=d["width"], num_attention_heads=heads, num_key_value_heads=heads,
                           q_lora_rank=d["q_lora"], kv_lora_rank=d["kv_lora"], qk_nope_head_dim=d["nope"],
                           qk_rope_head_dim=d["rope"], v_head_dim=d["v"], n_group=1, topk_group=1,
                           n_routed_experts=d["experts"], num_experts_per_tok=d["topk"], n_shared_experts=1,
                           first_k_dense_replace=1, max_position_embeddings=262144, rope_parameters=dict(YARN),
                           tie_word_embeddings=False, **kw)
    cfg._attn_implementation = "sdpa"
    return cfg


def layer_rows(d: dict, dev, iters: int) -> dict:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3MLP,
        DeepseekV3RotaryEmbedding,
        DeepseekV3TopkRouter,
    )
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    B, T, H = d["tokens"] // d["seq"], d["seq"], d["hidden"]
    x = torch.randn(B, T, H, device=dev, dtype=dtype)
    out = {}
    for heads in (d["heads"] // d["ranks"], d["heads"]):
        cfg = kimi_config(d, heads)
        attn = DeepseekV3Attention(cfg, 0).to(dev, dtype).eval()
        pe = DeepseekV3RotaryEmbedding(cfg).to(dev)(x, torch.arange(T, device=dev)[None].expand(B, -1))
        with torch.no_grad():
            out[f"mla_{heads}_heads"] = timed(lambda: attn(x, pe, None), dev, iters)
        del attn
    cfg = kimi_config(d, d["heads"])
    router = DeepseekV3TopkRouter(cfg).to(dev)
    torch.nn.init.normal_(router.weight, std=0.02)
    shared = DeepseekV3MLP(cfg, intermediate_size=d["width"] // d["ranks"]).to(dev, dtype)
    dense = DeepseekV3MLP(cfg, intermediate_size=d["dense"] // d["ranks"]).to(dev, dtype)
    lm = torch.nn.Linear(H, d["vocab"], bias=False).to(dev, dtype)
    flat = x.view(-1, H)
    with torch.no_grad():
        out["moe_rest"] = timed(lambda: (router(flat), shared(flat)), dev, iters)
        out["dense_mlp"] = timed(lambda: dense(flat), dev, iters)
        out["lm_head"] = timed(lambda: [lm(flat[a:a + 4096]).argmax(-1) for a in range(0, len(flat), 4096)], dev,
                               max(1, iters // 3))
    return out


def write_checkpoint(d: dict, path: Path, dev) -> None:
    """A 4-layer model of one rank's share (module doc), routed experts packed INT4, the rest bf16 random."""
    from safetensors.torch import save_file

    from eagle3_core.target.loading import auto_model_class
    cfg = kimi_config(d, d["heads"] // d["ranks"], num_hidden_layers=4)
    cfg.intermediate_size = d["dense"] // d["ranks"]
    cfg.n_routed_experts, cfg.num_experts_per_tok = d["experts"] // d["ranks"], 1
    with torch.device("meta"):
        model = auto_model_class(cfg, "bench").from_config(cfg)
    state = {}
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        if ".mlp.experts." in name or "rotary" in name:
            continue
        if p.dim() == 1:
            t = torch.zeros(p.shape) if "bias" in name else torch.ones(p.shape)
        else:
            t = torch.randn(p.shape, device=dev) / p.shape[-1] ** 0.5
        state[name] = t.to(torch.float32 if "mlp.gate." in name else torch.bfloat16).cpu()
    H, I = d["hidden"], d["width"]
    for i in range(1, 4):
        for e in range(cfg.n_routed_experts):
            for mat, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                p, s = random_packed(shape, dev)
                stem = f"model.layers.{i}.mlp.experts.{e}.{mat}"
                state.update({f"{stem}.weight_packed": p.cpu(), f"{stem}.weight_scale": s.cpu(),
                              f"{stem}.weight_shape": torch.tensor(shape)})
    path.mkdir(parents=True)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    cfg.to_json_file(path / "config.json")


def end_to_end(d: dict, dev, samples: int, fmt: str) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3_core.config import FeatureConfig, PipelineConfig, TargetConfig
    from eagle3_core.contract.manifest import write_manifest
    from eagle3_core.pipeline.features_stage import run_features
    root = Path(tempfile.mkdtemp(prefix="int4_e2e_"))
    t0 = time.perf_counter()
    write_checkpoint(d, root / "target", dev)
    out = {"checkpoint_s": time.perf_counter() - t0, "format": fmt, "samples": [], "seconds": [], "tokens": [],
           "bytes": [], "extract_s": []}
    for n in (samples, 2 * samples):
        run = root / f"run{n}"
        g = torch.Generator().manual_seed(n)
        rows = [{"id": f"s{i}", "input_ids": torch.randint(0, d["vocab"], (d["seq"],), generator=g).tolist(),
                 "loss_mask": [1] * d["seq"]} for i in range(n)]
        (run / "tokenized").mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(rows), run / "tokenized" / "train.parquet")
        write_manifest(run / "tokenized" / "manifest.json", {"inputs_key": f"bench-{n}", "samples": n})
        cfg = PipelineConfig(run_dir=run, target=TargetConfig(model=str(root / "target")), features=FeatureConfig(
            max_length=d["seq"], shard_samples=8, batch_tokens=d["tokens"], aux_layer_ids=[0, 1, 2],
            backend="ep_int4", tp_size=1, format=fmt))
        t0 = time.perf_counter()
        m = run_features(cfg, log=lambda s: print(s, flush=True))
        out["seconds"].append(time.perf_counter() - t0)
        out["samples"].append(n)
        out["tokens"].append(m["tokens"])
        out["extract_s"].append(m.get("seconds"))
        out["bytes"].append(m["bytes"])
    # the stage's own extraction seconds (its manifest: shard plan, forwards, shard writes), not torchrun and load
    out["marginal_tok_s"] = (out["tokens"][1] - out["tokens"][0]) / (out["extract_s"][1] - out["extract_s"][0])
    out["tok_s_at_2n"] = out["tokens"][1] / out["extract_s"][1]
    return out


# the node (8 x H200, EP 8 / TP 8): Kimi-K2.5's 61 decoder layers, the first dense
L_MOE, L_DENSE = 60, 1
# two all-reduces per layer (attention's o_proj, the MoE) of B x H bf16 = 235 MB each: not measured here (no
# multi-GPU machine); the stated range assumes 300-600 GB/s of NCCL ring bus bandwidth on NVLink (2 (W-1)/W x 235 MB
# per all-reduce: 0.7-1.4 ms each), i.e. 1.4-2.7 ms per layer, widened to 1-3 ms
COMM_MS_PER_LAYER = (1.0, 3.0)


def projection(result: dict, comm_ms: float) -> dict:
    """The node's extraction rate from one GPU's measured share (all ranks run each forward in lockstep):

        t_forward = L_moe (t_experts + t_mla8 + t_moe_rest) + L_dense (t_mla8 + t_dense) + t_lm_head
                    + (L_moe + L_dense) t_comm
        tok/s     = min(B / t_forward, the writer's rate at world size 1 (end_to_end, rank 0 writes alone))"""
    e, l = result["experts"], result["layers"]
    m = {k: v["median_ms"] for k, v in {**e, **l}.items() if isinstance(v, dict) and "median_ms" in v}
    experts = min(m["experts_int4"], m.get("experts_int4_fused", float("inf")))     # the faster INT4 path
    t = (L_MOE * (experts + m["mla_8_heads"] + m["moe_rest"]) + L_DENSE * (m["mla_8_heads"] + m["dense_mlp"])
         + m["lm_head"] + (L_MOE + L_DENSE) * comm_ms)
    compute = result["dims"]["tokens"] / (t / 1e3)
    writer = result.get("end_to_end", {}).get("marginal_tok_s") or float("inf")
    return {"forward_ms": t, "compute_tok_s": compute, "writer_tok_s": writer, "tok_s": min(compute, writer)}


def rates_profile(result: dict, source: str) -> dict:
    """A configs/rates.json profile: the measured per-layer times, the assumed communication range and the
    projected node rate (scaled) with its formula, planned beside the reference team's profile."""
    e, l = result["experts"], result["layers"]
    mid, lo, hi = (projection(result, c) for c in (sum(COMM_MS_PER_LAYER) / 2, *COMM_MS_PER_LAYER))
    src = f"{source}, {result['device']}, {result['date']}"

    def ms(row, what):
        return {"value": round(row["median_ms"], 3), "unit": "ms per layer (median of 3)", "status": "measured",
                "source": f"{src}: {what}; min {row['min_ms']:.3f}, max {row['max_ms']:.3f}"}
    formula = ("t_forward = 60 (t_experts + t_mla8 + t_moe_rest) + (t_mla8 + t_dense) + t_lm_head + 61 t_comm for "
               "16,384 tokens, t_comm (2 all-reduces per layer, not measured) ")
    node = lambda p, c: {"value": round(p["tok_s"]), "unit": "tok/s", "status": "scaled",  # noqa: E731
                         "source": f"{formula}= {c} ms; {src}"}
    return {"description": "Kimi-K2.5 features on one 8 x H200 node with features.backend 'ep_int4' (EP 8 INT4 "
                           "experts, MLA at 8 heads per GPU): one GPU's share measured on one H200, the node's rate "
                           "projected (docs/benchmarks.md); features rows only, planned beside reference_kimi_k25",
            "beside": "reference_kimi_k25",
            "rates": {
                "experts_int4_ms": ms(e["experts_int4"], "48 experts kept INT4, 16,384 tokens top-8 of 384"),
                "experts_bf16_ms": ms(e["experts_bf16"], "the same with bf16 weights (the bound)"),
                "mla_8_heads_ms": ms(l["mla_8_heads"], "transformers' DeepseekV3Attention, SDPA, [8, 2048, 7168]"),
                "moe_rest_ms": ms(l["moe_rest"], "router (fp32) + 1/8 of the shared expert"),
                "dense_mlp_ms": ms(l["dense_mlp"], "layer 0's MLP at 1/8 width"),
                "lm_head_ms": ms(l["lm_head"], "chunked lm_head argmax, whole vocab, per forward"),
                "comm_ms_per_layer_low": {"value": COMM_MS_PER_LAYER[0], "unit": "ms per layer", "status": "given",
                                          "source": "assumed, not measured: 2 NCCL all-reduces of 235 MB at "
                                                    "300-600 GB/s bus bandwidth, widened"},
                "comm_ms_per_layer_high": {"value": COMM_MS_PER_LAYER[1], "unit": "ms per layer", "status": "given",
                                           "source": "assumed, not measured (as comm_ms_per_layer_low)"},
                "writer_tok_s": {"value": round(mid["writer_tok_s"]), "unit": "tok/s", "status": "measured",
                                 "source": f"{src}: the ep_int4 features stage at world size 1, 4-layer one-rank "
                                           f"share, fp8 store, marginal rate (rank 0 writes every shard)"},
                "extraction_tok_s_per_replica": node(mid, sum(COMM_MS_PER_LAYER) / 2),
                "extraction_tok_s_per_replica_slow": node(hi, COMM_MS_PER_LAYER[1]),
                "extraction_tok_s_per_replica_fast": node(lo, COMM_MS_PER_LAYER[0]),
                "gpus_per_extraction_replica": {"value": 8, "unit": "GPUs", "status": "given",
                                                "source": "one 8 x H200 node (EP 8)"}}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="small shapes on CPU (a smoke run of every code path)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--samples", type=int, default=32, help="N of the end-to-end rows (N and 2N samples)")
    ap.add_argument("--format", default="fp8", help="features.format of the end-to-end rows (fp8: the reference "
                                                    "config's)")
    ap.add_argument("--profile", action="store_true", help="the experts' CUDA kernels and other orders of them")
    ap.add_argument("--rates-from", type=Path, default=None, metavar="RESULT_JSON",
                    help="write a finished result's profile into --rates (no run)")
    ap.add_argument("--rates", type=Path, default=Path(__file__).resolve().parents[1] / "configs" / "rates.json")
    ap.add_argument("--profile-name", default="kimi_k25_ep_int4_h200")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: experts, layers, end_to_end")
    ap.add_argument("--tiles", type=Path, default=None, metavar="TILES_JSON",
                    help="the fused row's launch shapes: the `best` of benchmarks/int4_grouped_mm_tiles.py's result")
    a = ap.parse_args()
    if a.rates_from:
        result = json.loads(a.rates_from.read_text())
        data = json.loads(a.rates.read_text())
        data["profiles"][a.profile_name] = rates_profile(result, f"benchmarks/int4_ep_throughput.py "
                                                                 f"({a.rates_from.name})")
        a.rates.write_text(json.dumps(data, indent=2) + "\n")
        for c in (*COMM_MS_PER_LAYER, sum(COMM_MS_PER_LAYER) / 2):
            print(f"t_comm {c} ms/layer:", {k: round(v, 1) for k, v in projection(result, c).items()})
        return
    d = TINY if a.tiny else KIMI
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    import transformers
    result = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if dev.type == "cuda" else
              "cpu", "torch": torch.__version__, "transformers": transformers.__version__, "dims": d,
              "iters": a.iters, "fused_tiles": use_tiles(a.tiles, d) if a.tiles else "defaults"}
    for name, fn in (("experts", lambda: experts_rows(d, dev, a.iters, a.profile)),
                     ("layers", lambda: layer_rows(d, dev, a.iters)),
                     ("end_to_end", lambda: end_to_end(d, dev, a.samples, a.format))):
        if name in a.skip.split(","):
            continue
        t0 = time.perf_counter()
        try:
            result[name] = fn()
        except Exception:                                         # keep the other sections' numbers
            result[name] = {"error": traceback.format_exc()[-3000:]}
        result[name]["section_s"] = time.perf_counter() - t0
        print(json.dumps({name: result[name]}, indent=1), flush=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
        if dev.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
