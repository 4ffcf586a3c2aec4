"""target.int4_grouped_mm, the grouped matmul that reads packed INT4 words, run by Triton's interpreter on the CPU
(a child process with TRITON_INTERPRET=1 and the Triton that `make setup` installs apart from .venv's packages, so
no other test sees Triton), against compressed-tensors' dequantization followed by the matmul in fp32; and its CUDA
path compiled for sm_90 without a GPU."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3_core.target.int4_experts import Int4Experts
from tests.int4_targets import pack_expert, quant_scheme

ROOT = Path(__file__).resolve().parents[1]
TRITON_SITE = Path(sys.prefix) / "triton-interpret"        # Makefile: pip install --target $(VENV)/triton-interpret

CHILD = """
import sys, torch
from eagle3_core.target.int4_grouped_mm import Tiles, grouped_mm_int4
from eagle3_core.target.int4_experts import Int4Experts
d = torch.load(sys.argv[1])
out = {f"{name}/{i}": grouped_mm_int4(c["x"], c["offs"], c["packed"], c["scale"], t and Tiles(*t))
       for name, c in d["cases"].items() for i, t in enumerate(d["tiles"])}
E, H, I = d["experts_shape"]
ex = Int4Experts(0, E, H, I, torch.nn.functional.silu, torch.bfloat16)
ex.load_state_dict(d["experts"])
for fused in (True, False):
    ex.fused = fused
    out[f"experts_fused_{fused}"] = ex(*d["experts_args"])
torch.save(out, sys.argv[2])
"""


# the CUDA path compiled without a GPU: Triton's own LLVM and ptxas, for sm_90 (H100 and H200)
COMPILE = """
import json, re
from eagle3_core.target.int4_grouped_mm import DEFAULT_TILES as T, compile_sm90
out = {}
for bk, unpack, w_first in ((128, 0, False), (64, 1, False), (32, 0, True), (128, 2, True), (64, 2, False)):
    ptx = compile_sm90(T._replace(bk=bk, unpack=unpack, w_first=w_first)).asm["ptx"]
    out[f"{bk}/{unpack}/{w_first}"] = {"mma": sorted(set(re.findall(r"wgmma\.mma_async[a-z0-9._]*", ptx))),
                                       "int_to_float": len(re.findall(r"cvt\.rn\.f32\.[su]32", ptx)),
                                       "to_bf16": len(re.findall(r"cvt\.rn\.bf16", ptx))}
print(json.dumps(out))
"""


def _packed_experts(E: int, N: int, K: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed int32 [E, N, K/8], scale bf16 [E, N, K/32], W bf16 [E, N, K]) by compressed-tensors' compressor and
    decompressor (pack-quantized, 4 bits, symmetric, groups of 32)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    scheme = quant_scheme()
    packs = [pack_expert(torch.randn(N, K, generator=g) / K ** 0.5) for _ in range(E)]
    W = [PackedQuantizationCompressor.decompress(p, scheme)["weight"] for p in packs]
    return (torch.stack([p["weight_packed"] for p in packs]), torch.stack([p["weight_scale"] for p in packs]),
            torch.stack(W))


def _case(counts: list[int], N: int, K: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    packed, scale, W = _packed_experts(len(counts), N, K, g)
    x = torch.randn(sum(counts), K, generator=g).to(torch.bfloat16)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    starts = [0, *offs[:-1].tolist()]
    ref = torch.cat([x[a:b].float() @ W[e].float().T for e, (a, b) in enumerate(zip(starts, offs.tolist()))])
    return {"x": x, "offs": offs, "packed": packed, "scale": scale, "ref": ref}


def _child(args: list[str], **env) -> str:
    """Run `python -c args...` with the Triton of TRITON_SITE importable; its stdout."""
    if not (TRITON_SITE / "triton").is_dir():
        raise AssertionError(f"{TRITON_SITE} holds no Triton: run `make setup` (it installs Triton there for this "
                             f"test only)")
    env = os.environ | env | {"PYTHONPATH": os.pathsep.join([str(TRITON_SITE), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _run_child(tmp_path: Path, data: dict) -> dict:
    torch.save(data, tmp_path / "in.pt")
    _child([CHILD, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], TRITON_INTERPRET="1")
    return torch.load(tmp_path / "out.pt")


# the default launch shape, then the others' code paths: unpack 1, unpack 2 (nibble pairs) with the weight tile as the
# first MMA operand and row and column tiles of different sizes
TILES = [None, (32, 64, 64, 1, False, 4, 3), (64, 32, 128, 2, True, 4, 3)]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[dict, dict]:
    cases = {  # experts with no rows, one row, rows across tile edges (64), N not a multiple of 64, K/32 odd
        "uneven": _case([70, 0, 3, 130, 1], N=72, K=192, seed=0),
        "k96_one_expert": _case([129], N=40, K=96, seed=1),
    }
    g = torch.Generator().manual_seed(2)
    E, H, I = 3, 64, 32
    ex = Int4Experts(0, E, H, I, torch.nn.functional.silu, torch.bfloat16)
    for name, (n, k) in (("gate_up", (2 * I, H)), ("down", (H, I))):
        packed, scale, _ = _packed_experts(E, n, k, g)
        getattr(ex, f"{name}_packed").copy_(packed)
        getattr(ex, f"{name}_scale").copy_(scale)
    hidden = torch.randn(50, H, generator=g).to(torch.bfloat16)
    index = torch.randint(0, 5, (50, 2), generator=g)            # experts 3 and 4 live on another rank
    weights = torch.rand(50, 2, generator=g)
    data = {"cases": {k: {n: c[n] for n in ("x", "offs", "packed", "scale")} for k, c in cases.items()}, "tiles": TILES,
            "experts": ex.state_dict(), "experts_shape": (E, H, I), "experts_args": (hidden, index, weights)}
    return cases, _run_child(tmp_path_factory.mktemp("int4_gmm"), data)


@pytest.mark.parametrize("tiles", range(len(TILES)))
@pytest.mark.parametrize("name", ["uneven", "k96_one_expert"])
def test_the_fused_int4_matmul_is_compressed_tensors_dequantization_then_the_matmul(results, name, tiles):
    cases, out = results
    ref, mine = cases[name]["ref"], out[f"{name}/{tiles}"]
    assert mine.dtype == torch.bfloat16 and mine.shape == ref.shape
    assert ref.abs().max() > 1.0                                   # not near-zero outputs any code would match
    same = mine == ref.to(torch.bfloat16)                          # one rounding of the fp32 result
    assert same.float().mean() >= 0.999, same.float().mean()
    ulp = ref.abs().clamp_min(2 ** -126).log2().floor().exp2() * 2 ** -7
    assert ((mine.float() - ref).abs() <= ulp).all()


def test_int4_experts_fused_equals_its_dequantizing_path(results):
    _, out = results
    fused, buffered = out["experts_fused_True"], out["experts_fused_False"]
    assert fused.abs().max() > 0.05 and (fused == 0).all(-1).sum() > 0   # tokens routed elsewhere stay zero rows
    # the fused path rounds act(gate) * up to bf16 before the routing weight, as the CUDA grouped_mm path does; the
    # CPU loop rounds once after it: bf16-rounding differences, small against the output's scale
    torch.testing.assert_close(fused, buffered, atol=2 ** -7 * float(buffered.abs().max()), rtol=2 ** -6)


def test_unpack_2_falls_back_to_unpack_0_before_sm90_only():
    out = _child(["from eagle3_core.target.int4_grouped_mm import Tiles, usable; "
                  "t = Tiles(128, 128, 64, 2, False, 8, 3); "
                  "print([usable(t, c).unpack for c in ((8, 0), (8, 9), (9, 0), (10, 0), None)])"])
    assert out.strip() == "[0, 0, 2, 2, 2]"


def test_the_cuda_path_compiles_for_sm90_to_tensor_core_mma_without_int_to_float_conversions():
    for bk, ptx in json.loads(_child([COMPILE]).strip().splitlines()[-1]).items():
        assert ptx["mma"] and all(".f32.bf16.bf16" in m for m in ptx["mma"]), (bk, ptx)   # bf16 in, fp32 sums
        assert ptx["int_to_float"] == 0 and ptx["to_bf16"] > 0, (bk, ptx)    # the nibble's float by its bits


def _bf16(bits: int) -> float:
    """The bf16 value of 16 bits (0..65535)."""
    return torch.tensor([bits - 65536 * (bits >> 15)], dtype=torch.int16).view(torch.bfloat16).item()


def _bf16_bits(v: float) -> int:
    """v rounded once to bf16 (fp64 -> fp32 is exact for the values here; fp32 -> bf16 rounds to nearest even)."""
    return torch.tensor([v], dtype=torch.float64).float().to(torch.bfloat16).view(torch.int16).item() & 0xFFFF


def _run_pairs_asm(asm: str, word: int, scale_bits: int) -> list[int]:
    """PAIRS_ASM executed instruction by instruction on one word and one bf16 scale (bits): the 16-bit values of
    its outputs $0-$7. Knows the PTX instructions the string uses (mov, shr, lop3, sub/mul .rn.bf16x2) and
    fails on any other."""
    regs = {"$8": word & 0xFFFFFFFF, "$9": scale_bits}
    val = lambda a: int(a, 16) if a.startswith("0x") else regs[a]  # noqa: E731
    for ins in (i.strip() for i in asm.strip()[1:-1].split(";") if i.strip()):
        op, _, rest = ins.partition(" ")
        args = re.findall(r"\{[^}]*\}|[^,\s]+", rest)
        halves = lambda a: [h.strip() for h in a[1:-1].split(",")]  # noqa: E731
        if op == ".reg":
            continue
        if op == "mov.b32" and args[0].startswith("{"):
            lo, hi = halves(args[0])
            regs[lo], regs[hi] = val(args[1]) & 0xFFFF, val(args[1]) >> 16
        elif op == "mov.b32":
            regs[args[0]] = ((val(halves(args[1])[1]) << 16) | val(halves(args[1])[0]) if args[1].startswith("{")
                             else val(args[1]))
        elif op == "shr.b32":
            regs[args[0]] = val(args[1]) >> int(args[2])
        elif op == "lop3.b32":
            a, b, c, lut = (val(x) for x in args[1:])
            regs[args[0]] = sum(((lut >> (((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | ((c >> i) & 1))) & 1) << i
                                for i in range(32))
        elif op in ("sub.rn.bf16x2", "mul.rn.bf16x2"):
            f = (lambda p, q: p - q) if op.startswith("sub") else (lambda p, q: p * q)
            x, y = val(args[1]), val(args[2])
            regs[args[0]] = (_bf16_bits(f(_bf16(x & 0xFFFF), _bf16(y & 0xFFFF)))
                             | _bf16_bits(f(_bf16(x >> 16), _bf16(y >> 16))) << 16)
        else:
            raise AssertionError(f"an instruction this emulation does not know: {ins}")
    return [regs[f"${i}"] for i in range(8)]


def test_the_inline_ptx_makes_each_nibble_q_times_scale_rounded_once():
    asm = _child(["from eagle3_core.target.int4_grouped_mm import PAIRS_ASM; print(PAIRS_ASM.value)"]).strip()
    g = torch.Generator().manual_seed(3)
    words = [0x76543210, 0xFEDCBA98, *torch.randint(0, 2 ** 32, (6,), generator=g, dtype=torch.int64).tolist()]
    scales = (torch.randn(5, generator=g) * 0.01).to(torch.bfloat16).tolist() + [-0.0625, 1.0, 3.0e-3]
    for word in words:
        q = [((word >> (4 * i)) & 0xF) - 8 for i in range(8)]
        for s in scales:
            s_bits = torch.tensor([s], dtype=torch.bfloat16).view(torch.int16).item() & 0xFFFF
            want = [_bf16_bits(qi * _bf16(s_bits)) for qi in q]           # compressed-tensors: q.to(bf16) * scale
            assert _run_pairs_asm(asm, word, s_bits) == want, (hex(word), s)
