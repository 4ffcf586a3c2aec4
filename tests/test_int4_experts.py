"""The `ep_int4` target (target.int4_experts, target.ep_loading) on tiny DeepSeek-V3 and Kimi-K2.5 targets whose
routed experts are packed INT4 as Kimi-K2.5's published checkpoint packs them (tests/int4_targets.py, packed by
compressed-tensors itself).

What is compared with what, and the tolerances:
- unpacking and dequantization against compressed-tensors' own `unpack_from_int32` / `decompress`: bit for bit,
  on every 32-bit pattern class (random words over the whole int32 range);
- the experts a rank reads from the safetensors against the ones transformers' dequantizing load builds: equal;
- one-process forward against transformers' forward of its dequantizing load, both in fp32 (transformers keeps the
  dequantized experts in bf16 and runs them in bf16; upcast here so that the comparison sees the implementations,
  not two precisions): atol 2e-5 (measured ~1e-6 on values up to ~3.5: another summation order);
- 2 gloo ranks (expert parallel, with head-sharded or whole attention) against one process: same bound.
"""
from pathlib import Path

import pytest
import torch

from eagle3_core.config import TargetConfig
from eagle3_core.distributed.launch import run_torchrun
from eagle3_core.target.ep_loading import load_int4_target
from eagle3_core.target.int4_experts import dequantize_int4, unpack_int4
from eagle3_core.target.loading import capture, decoder, load_target
from conftest import assert_ranks_left_cleanly
from int4_targets import build_int4

FAMILIES = ("deepseek_v3", "kimi_k25")
AUX = [0, 1, 2]                                              # 4 layers: ids in [0, L - 2]
IDS = torch.arange(2 * 12).view(2, 12) * 7 % 128            # tests/ep_int4_worker.py's ids


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """{family: (INT4 dir, bf16 twin dir)}, built once (4 layers: dense, then 3 MoE; 4 experts of width 32)."""
    root = tmp_path_factory.mktemp("int4")
    return {f: (build_int4(f, root / f, layers=4, bf16_twin=root / f"{f}_bf16"), root / f"{f}_bf16")
            for f in FAMILIES}


def _reference(path: Path):
    """transformers' dequantizing load of the INT4 checkpoint, every tensor upcast to fp32."""
    model = load_target(TargetConfig(model=str(path)), "cpu")
    for p in model.parameters():
        p.data = p.data.float()
    return model


def _forward(model) -> dict:
    with torch.no_grad(), capture(model, [0, 1]) as store:
        final = decoder(model)(input_ids=IDS).last_hidden_state
    return {"final": final, "aux": store["aux"]}


def test_unpacking_equals_compressed_tensors_bit_for_bit():
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 6, 16), generator=g, dtype=torch.int64).to(torch.int32)
    packed[0, 0] = torch.tensor([0, -1, 2 ** 31 - 1, -2 ** 31] * 4, dtype=torch.int32)   # edge words
    q = unpack_int4(packed)
    assert q.dtype == torch.int8 and q.shape == (3, 6, 128) and int(q.min()) == -8 and int(q.max()) == 7
    assert torch.equal(q, unpack_from_int32(packed, 4, torch.Size((3, 6, 128))))
    scale = (torch.rand(3, 6, 4, generator=g) * 0.1).to(torch.bfloat16)
    want = (q.view(3, 6, 4, 32).to(torch.bfloat16) * scale[..., None]).view(3, 6, 128)
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))
    for e in range(3):
        theirs = PackedQuantizationCompressor.decompress(
            {"weight_packed": packed[e], "weight_scale": scale[e], "weight_shape": torch.tensor([6, 128])},
            scheme)["weight"]
        mine = dequantize_int4(packed[e], scale[e])
        assert mine.dtype == theirs.dtype == torch.bfloat16
        assert torch.equal(mine.view(torch.int16), theirs.view(torch.int16)), e
    assert torch.equal(dequantize_int4(packed, scale), want)
    out = torch.empty(3, 6, 128)
    assert dequantize_int4(packed, scale, out) is out and torch.equal(out, want.float())


@pytest.mark.parametrize("family", FAMILIES)
def test_the_experts_a_rank_reads_are_transformers_dequantized_experts(targets, family):
    ref = load_target(TargetConfig(model=str(targets[family][0])), "cpu")
    for rank in (0, 1):
        mine = load_int4_target(TargetConfig(model=str(targets[family][0])), "cpu", rank, 2, group=False)
        for i in (1, 2):
            ex = decoder(mine).layers[i].mlp.experts
            assert (ex.first, ex.num_local) == (2 * rank, 2)
            assert ex.gate_up_packed.dtype == torch.int32 and ex.gate_up_packed.shape == (2, 64, 8)
            gu, dn = ex.dequantized()
            theirs = decoder(ref).layers[i].mlp.experts
            assert torch.equal(gu, theirs.gate_up_proj[2 * rank:2 * rank + 2].float())
            assert torch.equal(dn, theirs.down_proj[2 * rank:2 * rank + 2].float())


@pytest.mark.parametrize("family", FAMILIES)
def test_one_process_forward_equals_transformers_dequantizing_load(targets, family):
    ref = _forward(_reference(targets[family][0]))
    mine = _forward(load_int4_target(TargetConfig(model=str(targets[family][0])), "cpu"))
    assert ref["final"].abs().max() > 1.0                     # not a near-zero output that any code would match
    torch.testing.assert_close(mine["final"], ref["final"], atol=2e-5, rtol=0)
    for a, b in zip(mine["aux"], ref["aux"], strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


def test_bf16_experts_are_refused_naming_the_key(targets):
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.\d+\.\w+_proj\.weight is a bf16 expert weight"):
        load_int4_target(TargetConfig(model=str(targets["deepseek_v3"][1])), "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attention", ["heads", "whole"])
def test_two_gloo_ranks_equal_one_process(targets, family, attention, tmp_path):
    """2 ranks under torchrun: experts 2 + 2, shared expert and dense MLP split in 2, attention split by heads (2 of
    4 each) or whole; the residual stream after every layer equals the one-process forward."""
    out = tmp_path / "out.pt"
    lines = []
    run_torchrun([str(Path(__file__).parent / "ep_int4_worker.py"), "--model", str(targets[family][0]), "--out",
                  str(out), *(["--whole-attention"] if attention == "whole" else [])], 2, on_line=lines.append)
    assert_ranks_left_cleanly(lines, 2)
    two = torch.load(out)
    one = _forward(load_int4_target(TargetConfig(model=str(targets[family][0])), "cpu"))
    torch.testing.assert_close(two["final"], one["final"], atol=2e-5, rtol=0)
    for a, b in zip(two["aux"], one["aux"], strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_the_ep_int4_features_stage_writes_the_bf16_backends_store(targets, family, tmp_path):
    """features.backend 'ep_int4' over 2 gloo ranks (experts, heads, shared expert split in 2) on the INT4
    checkpoint against the in-process 'hf' backend on its bf16 twin (same weights, experts stored dequantized):
    the same shards, samples, tokens and argmax tokens, features equal within one bf16 rounding (the stores hold
    bf16; tolerance as in tests/test_tp_extract.py, and most elements bit-identical)."""
    from eagle3_core.contract.manifest import read_manifest
    from eagle3_core.features.store import bad_shards
    from eagle3_core.pipeline.features_stage import run_features
    from feature_stores import assert_same_samples, features_run, run_one_thread
    from tokenized_rows import random_rows
    int4, twin = targets[family]
    one = features_run(tmp_path / "bf16", twin, random_rows(5), aux_layer_ids=AUX)
    run_one_thread(one)
    ep = features_run(tmp_path / "ep", int4, random_rows(5), aux_layer_ids=AUX, backend="ep_int4", tp_size=2)
    lines = []
    m2 = run_features(ep, log=lines.append)
    m1 = read_manifest(one.run_dir / "features" / "manifest.json")
    assert m2["complete"] and m2["backend"] == "ep_int4" and m2["tp_size"] == 2 and m2["expert_parallel"]
    assert not bad_shards(ep.run_dir / "features", m2["shards"])
    assert any("rank 1/2 ran 3 forwards" in x for x in lines), lines[-20:]
    assert_ranks_left_cleanly(lines, 2)
    keys = ("file", "ids", "tokens", "samples")
    assert [{k: s[k] for k in keys} for s in m1["shards"]] == [{k: s[k] for k in keys} for s in m2["shards"]]
    for k in ("store_version", "format", "aux_layer_ids", "hidden_size", "samples", "tokens", "bytes"):
        assert m1[k] == m2[k], k
    assert_same_samples(one.run_dir / "features", ep.run_dir / "features", family)
