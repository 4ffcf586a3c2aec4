"""The training step near the hardware, in one command: a profile of one step, ours against SpecForge 0.2.0
interleaved in one process, and the compile of the trainer's graphs from an empty and from a warm cache.

  python benchmarks/train_step_profile.py --out step_profile.json       one GPU (H100: about 5-6 minutes)
  python benchmarks/train_step_profile.py --tiny --out /tmp/p.json      CPU, small shapes: checks the script runs

Shapes: benchmarks/train_throughput.py's fixed mode (Llama-3.1-8B-shaped draft, B 1, T 2048, TTT 7, bf16 autocast,
random weights and features, loss mask all ones); its step functions are reused. Variants (--ours):
  fixed  train_throughput --mode fixed's `ours:merged_flex:on:new` (ttt.ttt_loss, dense parts and kernels
         compiled): the row of the earlier ratios (1.41x on one H100, 2026-12-06);
  step   the trainer's path on CUDA: the same tokens as one packed row of one document through
         packing.packed_ttt_loss, a compiled graph per TTT step (train.graph 'step');
  row    the same, the K steps one graph (train.graph 'row', the trainer's choice for long runs).
SpecForge (--specforge): OnlineEagle3Model with its flex_attention backend (its fastest here: 'fa' needs the
flash_attn package, 'usp' a sequence-parallel process group; 'sdpa' materialises the scores of steps >= 1).
SpecForge compiles flex attention itself for sequences over 128 tokens (modeling/draft/flex_attention.py); every
warning torch logs while a variant runs is counted, an unfused flex attention call among them.

Parts, in this order, the JSON written after each (`--out`), each skipped once --budget-s seconds have passed:
  pairs    every variant built and warmed up (its first step, compile included, timed), then --repeats rounds in
           which each variant runs --iters steps (order reversed every other round): tok/s median, min, max; the
           ratio of each ours variant to the first SpecForge backend per round (median, min, max) and MFU against
           the device's datasheet peak and against the bf16 matrix product measured here.
  profile  per variant, torch.profiler over 2 steps: the top --top device kernels by total time (share of the
           step's device time), kernels launched per step, and the step's phases timed by device events over 3
           steps: forward (TTT loss), backward, optimizer (clipping + AdamW).
  compile  the trainer's compile policy (packing.compiled_training, its persistent compile cache included) in a
           fresh process, twice on one new cache folder: cold (empty) and warm; each times its first step (the
           compile, what the first epoch pays) and the steps after it, with torch's cache hit/miss counters
           (TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR are left out of the children's environment: a cold
           start is cold).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from specforge_side_by_side import fastest_backend, import_specforge  # noqa: E402
from train_end_to_end import TorchWarnings  # noqa: E402
from train_throughput import (  # noqa: E402
    DATASHEET_TFLOPS, FULL, TINY, flops_per_token, make_inputs, ours_step_fn, specforge_step_fn)

PHASES = ("forward", "backward", "optimizer")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device: torch.device, n: int) -> float:
    """A bf16 n x n x n matrix product's rate here (median of 10 after 3 warm-ups), TFLOP/s: the measured ceiling."""
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dt), torch.randn(n, n, device=device, dtype=dt)
    times = []
    for i in range(13):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times) / 1e12


def one_document_row(inp: dict) -> dict:
    """inp's fixed batch [1, T] as a packed row holding one document (doc 0, positions 0..T-1): the trainer's
    layout (packing.collate_packed) for the same tokens."""
    B, T = inp["input_ids"].shape
    assert B == 1, "a packed row is one sequence of the batch"
    dev = inp["input_ids"].device
    return {**{k: inp[k] for k in ("input_ids", "loss_mask", "aux", "final", "target_top1")},
            "doc": torch.zeros(1, T, dtype=torch.long, device=dev),
            "position": torch.arange(T, device=dev)[None], "tokens": T}


class Phases:
    """mark(phase) for the step functions: device events (CUDA) or host clocks, read back as ms per phase."""

    def __init__(self, device: torch.device):
        self.device, self.marks = device, []

    def start(self) -> None:
        self.marks = [("start", self._now())]

    def _now(self):
        if self.device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def __call__(self, phase: str) -> None:
        if self.marks:
            self.marks.append((phase, self._now()))

    def read(self) -> dict:
        sync(self.device)
        out = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            out[name] = a.elapsed_time(b) if self.device.type == "cuda" else (b - a) * 1e3
        self.marks = []
        return out


def build(name: str, s: dict, inp: dict, device: torch.device, K: int, mark) -> callable:
    """The step function of variant `name` ('ours:fixed', 'ours:step', 'ours:row', 'specforge:BACKEND')."""
    kind, what = name.split(":", 1)
    if kind == "specforge":
        import_specforge()                      # without Triton (a CPU): its loss module's PyTorch stand-in
        return specforge_step_fn(s, inp, device, K, what, mark=mark)
    attention = "merged_flex" if device.type == "cuda" else "merged_math"       # flex has no backward on a CPU
    if what == "fixed":
        return ours_step_fn(s, inp, device, K, attention, True, mark=mark)
    return ours_step_fn(s, inp, device, K, attention, False, batches=[one_document_row(inp)], graph=what, mark=mark)


def window(step, device: torch.device, iters: int) -> float:
    """tok/s of `iters` steps."""
    sync(device)
    t0, tokens = time.perf_counter(), 0
    for _ in range(iters):
        _, n = step()
        tokens += n
    sync(device)
    return tokens / (time.perf_counter() - t0)


def warned(lines: list[str]) -> dict:
    """Torch's warnings of a variant: count, unfused flex attention calls among them, the distinct lines."""
    unfused = [w for w in lines if "unfused" in w.lower() or "without torch.compile" in w.lower()]
    return {"count": len(lines), "unfused_flex": len(unfused), "distinct": sorted(set(w[:300] for w in lines))[:10]}


def pairs(variants: list[str], s: dict, inp: dict, device: torch.device, K: int, a) -> tuple[dict, dict]:
    """Part 'pairs' (module docstring). Returns (result, {name: (step, phases)}) for the profile."""
    steps, res, logs = {}, {"variants": {}, "rounds": []}, {}
    for name in variants:
        phases = Phases(device)
        with TorchWarnings() as w:
            try:
                step = build(name, s, inp, device, K, phases)
                sync(device)
                t0 = time.perf_counter()
                step()
                sync(device)
                first = time.perf_counter() - t0
                step()                                        # a second warm-up: allocator and autotune settle
                steps[name] = (step, phases)
                res["variants"][name] = {"first_step_s": round(first, 2)}
            except Exception as e:  # noqa: BLE001 (a benchmark: report it, go on with the others)
                res["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        logs[name] = list(w.lines)
        print(f"built {name}: {res['variants'][name]}", flush=True)
    for r in range(a.repeats):
        row = {}
        for name in (list(steps) if r % 2 == 0 else list(reversed(steps))):
            with TorchWarnings() as w:
                row[name] = window(steps[name][0], device, a.iters)
            logs[name] += w.lines
        res["rounds"].append(row)
        print(f"round {r + 1}: " + ", ".join(f"{n} {v:,.0f} tok/s" for n, v in row.items()), flush=True)
    flops = flops_per_token(s, K)
    for name, v in res["variants"].items():
        runs = [row[name] for row in res["rounds"] if name in row]
        if runs:
            med = statistics.median(runs)
            v.update(tok_s_median=med, tok_s_min=min(runs), tok_s_max=max(runs), runs=len(runs),
                     tflops=med * flops / 1e12)
        v["torch_warnings"] = warned(logs[name])
    anchor = next((n for n in steps if n.startswith("specforge")), None)
    res["ratios"] = {}
    for name in (n for n in steps if n.startswith("ours") and anchor):
        per = [row[name] / row[anchor] for row in res["rounds"]]
        res["ratios"][f"{name} / {anchor}"] = {"median": statistics.median(per), "min": min(per), "max": max(per),
                                               "per_round": per}
    return res, steps


def kernels(prof, device: torch.device) -> list[tuple[str, float, int]]:
    """(name, total us, calls) of the device kernels in a profile (CUDA), or of the aten ops' own CPU time."""
    from torch.autograd import DeviceType
    by = {}
    if device.type == "cuda":
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                t, n = by.get(e.name, (0.0, 0))
                by[e.name] = (t + e.time_range.elapsed_us(), n + 1)
    else:
        for e in prof.key_averages():
            if e.key.startswith("aten::") and e.self_cpu_time_total > 0:
                by[e.key] = (e.self_cpu_time_total, e.count)
    return sorted(((k, t, n) for k, (t, n) in by.items()), key=lambda x: -x[1])


def profile_step(step, phases: Phases, device: torch.device, top: int, n: int = 2) -> dict:
    """Part 'profile' for one variant (module docstring)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(n):
            step()
        sync(device)
    rows = kernels(prof, device)
    total = sum(t for _, t, _ in rows)
    copies = sum(c for k, _, c in rows if k.startswith(("Memcpy", "Memset")))
    launched = sum(c for _, _, c in rows) - copies
    per_phase = {p: [] for p in PHASES}
    for _ in range(3):
        phases.start()
        step()
        for p, ms in phases.read().items():
            per_phase[p].append(ms)
    return {"device_ms_per_step": total / n / 1e3, "kernels_per_step": launched / n, "copies_per_step": copies / n,
            "phases_ms": {p: statistics.median(v) for p, v in per_phase.items() if v},
            "top": [{"name": k[:160], "ms_per_step": t / n / 1e3, "share": t / total if total else 0.0,
                     "calls_per_step": c / n} for k, t, c in rows[:top]]}


def device_inputs(s: dict, device: torch.device) -> dict:
    """make_inputs' keys for B = 1, drawn on `device` (seconds, where make_inputs' CPU draws and argmax of the 8B
    shapes take ~10 s): for the compile timing, whose graphs depend on shapes and dtypes, not values."""
    g = torch.Generator(device).manual_seed(0)
    H, V, N, T = s["H"], s["V"], s["N"], s["T"]
    vocab = torch.randperm(V, generator=g, device=device)[:N].sort().values
    t2d = torch.zeros(V, dtype=torch.bool, device=device)
    t2d[vocab] = True

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, device=device).to(dtype)
    return {"input_ids": torch.randint(0, V, (1, T), generator=g, device=device),
            "loss_mask": torch.ones(1, T, dtype=torch.bool, device=device),
            "aux": randn(1, T, 3 * H, dtype=torch.bfloat16), "final": randn(1, T, H, dtype=torch.bfloat16),
            "target_top1": vocab[torch.randint(0, N, (1, T), generator=g, device=device)],
            "lm_head": randn(V, H) * H ** -0.5, "embed": randn(V, H) * 0.02,
            "d2t": vocab - torch.arange(N, device=device), "t2d": t2d, "vocab": vocab}


def compile_child(a) -> None:
    """One fresh process's compile (part 'compile'): the trainer's policy and cache on one packed row."""
    from eagle3_core.config import TrainConfig
    from eagle3_core.training import ttt_attention
    from eagle3_core.training.packing import compiled_training
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() and not a.tiny else "cpu"))
    if device.type != "cuda":                                  # compile on the CPU too (tests' switch)
        ttt_attention.COMPILE.update(everywhere=True, backend=a.child_backend)
    s, K = dict(TINY if a.tiny else FULL), a.ttt
    inp = device_inputs(s, device)
    cfg = TrainConfig(ttt_length=K, batch_tokens=s["T"], batching="packed", graph=a.child_graph)
    counters, lines = torch._dynamo.utils.counters, []
    with compiled_training(cfg, device, True, lines.append):
        step = build(f"ours:{a.child_graph}", s, inp, device, K, None)
        times = []
        for _ in range(4):
            sync(device)
            t0 = time.perf_counter()
            step()
            sync(device)
            times.append(time.perf_counter() - t0)
    later = statistics.median(times[1:])
    print("CHILD_RESULT " + json.dumps({
        "first_step_s": times[0], "later_step_s": later, "compile_s": times[0] - later, "log": lines,
        "caches": {k: dict(counters[k]) for k in ("inductor", "aot_autograd") if k in counters}}), flush=True)


def compile_part(a) -> dict:
    """Part 'compile': the child twice on one new cache folder (cold, then warm)."""
    folder = tempfile.mkdtemp(prefix="eagle3-compile-cache-")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["EAGLE3_COMPILE_CACHE"] = folder
    cmd = [sys.executable, __file__, "--compile-child", "--ttt", str(a.ttt), "--child-graph", a.child_graph,
           "--child-backend", a.child_backend] + (["--tiny"] if a.tiny else []) + \
        (["--device", a.device] if a.device else [])
    out = {"cache_folder": folder, "graph": a.child_graph}
    for name in ("cold", "warm"):
        t0 = time.perf_counter()
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(60, a.budget_s))
        found = [line for line in run.stdout.splitlines() if line.startswith("CHILD_RESULT ")]
        out[name] = json.loads(found[-1][len("CHILD_RESULT "):]) if found else {
            "error": f"rc {run.returncode}: {(run.stderr or run.stdout)[-1500:]}"}
        out[name]["process_s"] = time.perf_counter() - t0
        print(f"compile {name}: " + json.dumps({k: v for k, v in out[name].items() if k != "log"})[:600], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes on the CPU (checks the script runs)")
    ap.add_argument("--out", default=None, help="write the JSON here too (after each part)")
    ap.add_argument("--device", default=None, help="default: cuda if available (not with --tiny), else cpu")
    ap.add_argument("--ours", default="fixed,step", help="our variants: fixed, step, row (module docstring)")
    ap.add_argument("--specforge", default=None, help="SpecForge backends (default flex_attention on CUDA, sdpa "
                                                      "on a CPU; '' for none); the first is the ratio's anchor")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (pairs)")
    ap.add_argument("--iters", type=int, default=None, help="steps per variant per round (default 10; --tiny 2)")
    ap.add_argument("--ttt", type=int, default=7, help="TTT steps K")
    ap.add_argument("--top", type=int, default=25, help="kernels listed per profile")
    ap.add_argument("--parts", default="pairs,profile,compile", help="which parts to run")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip the parts not started by then")
    ap.add_argument("--matmul", type=int, default=8192, help="size of the bf16 matrix product timed as the ceiling")
    ap.add_argument("--compile-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-graph", default="step", choices=("step", "row"), help="part compile: train.graph")
    ap.add_argument("--child-backend", default=None, help="part compile off CUDA: torch.compile backend "
                                                          "(default inductor; --tiny aot_eager: seconds)")
    a = ap.parse_args()
    a.child_backend = a.child_backend or ("aot_eager" if a.tiny else "inductor")
    if a.compile_child:
        return compile_child(a)
    warnings.simplefilter("always")                     # count every warning, not the first of each place
    t_start = time.perf_counter()
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() and not a.tiny else "cpu"))
    if device.type != "cuda":                           # compiled as on CUDA, by --child-backend (tests' switch)
        from eagle3_core.training import ttt_attention
        ttt_attention.COMPILE.update(everywhere=True, backend=a.child_backend)
    s, K = dict(TINY if a.tiny else FULL), a.ttt
    a.iters = a.iters or (2 if a.tiny else 10)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in DATASHEET_TFLOPS.items() if k in name), None)
    res = {"device": name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "shapes": s, "ttt": K,
           "gflop_per_token": flops_per_token(s, K) / 1e9, "datasheet_bf16_dense_tflops": peak,
           "matmul_tflops_measured": matmul_tflops(device, 256 if a.tiny else a.matmul)}

    def write():
        res["elapsed_s"] = time.perf_counter() - t_start
        text = json.dumps(res, indent=2, default=float).replace("NaN", "null")
        if a.out:
            Path(a.out).write_text(text)
        return text

    parts = set(filter(None, a.parts.split(",")))
    backends = a.specforge if a.specforge is not None else fastest_backend(device)
    variants = [f"ours:{v}" for v in filter(None, a.ours.split(","))] + \
        [f"specforge:{b}" for b in filter(None, backends.split(","))]
    steps = {}
    if parts & {"pairs", "profile"}:
        inp = make_inputs(s, 1, device)
        res["pairs"], steps = pairs(variants, s, inp, device, K, a)
        for v in res["pairs"]["variants"].values():
            if "tflops" in v:
                v["mfu_datasheet"] = v["tflops"] / peak if peak else None
                v["mfu_measured_matmul"] = v["tflops"] / res["matmul_tflops_measured"]
        write()
    if "profile" in parts:
        res["profile"] = {}
        for vname, (step, phases) in steps.items():
            if time.perf_counter() - t_start > a.budget_s:
                res["profile"][vname] = {"skipped": "budget"}
                continue
            try:
                res["profile"][vname] = profile_step(step, phases, device, a.top)
            except Exception as e:  # noqa: BLE001
                res["profile"][vname] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            write()
    steps.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if "compile" in parts:
        res["compile"] = compile_part(a) if time.perf_counter() - t_start < a.budget_s else {"skipped": "budget"}
    print(write())
    summary(res)


def summary(res: dict) -> None:
    """The short table printed last."""
    print(f"\n{res['device']}, torch {res['torch']}, {res['date']}: {res['gflop_per_token']:.2f} GFLOP/token, "
          f"bf16 matmul measured {res['matmul_tflops_measured']:.0f} TFLOP/s, datasheet "
          f"{res['datasheet_bf16_dense_tflops']}")
    for n, v in res.get("pairs", {}).get("variants", {}).items():
        if "tok_s_median" in v:
            print(f"  {n}: {v['tok_s_median']:,.0f} tok/s [{v['tok_s_min']:,.0f}-{v['tok_s_max']:,.0f}] "
                  f"first step {v['first_step_s']} s, warnings {v['torch_warnings']['count']} "
                  f"(unfused flex {v['torch_warnings']['unfused_flex']})")
        else:
            print(f"  {n}: {v}")
    for k, r in res.get("pairs", {}).get("ratios", {}).items():
        print(f"  {k}: {r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]")
    for n, p in res.get("profile", {}).items():
        if "top" in p:
            print(f"  profile {n}: {p['device_ms_per_step']:.1f} ms device, {p['kernels_per_step']:.0f} kernels/step,"
                  f" phases {', '.join(f'{k} {v:.1f} ms' for k, v in p['phases_ms'].items())}")
    for n in ("cold", "warm"):
        c = res.get("compile", {}).get(n)
        if c and "compile_s" in c:
            print(f"  compile {n}: first step {c['first_step_s']:.1f} s, later {c['later_step_s'] * 1e3:.0f} ms, "
                  f"process {c['process_s']:.1f} s")


if __name__ == "__main__":
    main()
