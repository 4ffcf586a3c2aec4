"""`python -m eagle3_core.features_probe CONFIG --backends hf,sglang --samples 4`: the same few samples of a run
extracted by two features backends, compared: per aux layer and for the final state the relative difference,
the argmax agreement, and each backend's tokens/s; exit code 0 when they agree within TOLERANCE, 1 otherwise.

Legend: T tokens of the samples (all positions, prompt and answer), H_t target hidden.
The samples are the first `--samples` rows of the run's tokenized/train.parquet (the tokenize stage must have run).
Each backend extracts them through the features stage itself (pipeline.features_stage.run_features) on a run of
its own, features_probe/<backend>/ under the run directory, stored as bf16 whatever features.format says (fp8
would add its own rounding to the comparison); backend 'hf' runs with tp_size 1, the others with the config's
tp_size and expert_parallel. Every probe extracts afresh: the stage's key leaves out how a store was computed
(backend, tp_size, expert_parallel, the SGLang build, ...), so a kept store could be another setup's; the report
names the ranks each backend ran on.

Measures, over all T positions of all samples (a, b: the two backends' states, fp32 from the bf16 stores):
- per aux layer k and for `final`: rel = ||a - b||_F / ||b||_F, and the worst token's ||a_t - b_t|| / ||b_t||;
- argmax agreement: the share of positions whose target_top1 is the same;
- tokens/s: T / the stage's extraction seconds (model load excluded; the first batches' warm-up included, so a
  probe of a few samples under-states a backend's steady rate).

TOLERANCE, and why: both stores are bf16, whose rounding is 2^-9 relative (0.2%) per element; two correct
forwards of the same weights differ by their kernels' summation order (SGLang's fused MoE and absorbed MLA
against transformers' eager modules), a few roundings per layer that the residual stream carries on. Assumed to
grow like a random walk, with the square root of the depth: ~8 roundings (1.6%) over Kimi-K2.5's 61 layers. So
the aux layers and the final state agree when rel <= 2% each. A layer-id mistake (the neighbouring layer's
output) is far outside it: on the tiny test targets neighbouring layers differ by more than 20x the tolerance
(tests/test_features_probe.py). Argmax: positions whose top-2 logits lie within that noise may flip; >= 98% must
agree. The worst token is printed, not judged (a near-zero state makes its ratio large). Whether 2% holds for
SGLang against transformers on Kimi-K2.5 is what the probe on the node measures; this bound is written before.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from eagle3_core.config import PipelineConfig, config_or_preset
from eagle3_core.contract.layout import RunLayout
from eagle3_core.contract.manifest import read_manifest, sha256_json, write_manifest
from eagle3_core.features.backends import loads_whole_target
from eagle3_core.features.reader import load_samples
from eagle3_core.pipeline.features_stage import run_features

TOLERANCE = {"aux_rel": 0.02, "final_rel": 0.02, "argmax_agree": 0.98}
PROBE_DIR = "features_probe"


def probe_run(cfg: PipelineConfig, backend: str, rows: list[dict]) -> PipelineConfig:
    """The config of `backend`'s probe run: features_probe/<backend>/ under the run directory with `rows` as its
    tokenized data (written here; the same rows leave a finished store done), bf16, no import."""
    f = cfg.features
    par = {"tp_size": 1, "expert_parallel": False} if loads_whole_target(backend) else {}
    sub = cfg.model_copy(update={"run_dir": Path(cfg.run_dir) / PROBE_DIR / backend, "features": f.model_copy(
        update={"backend": backend, "format": "bf16", "import_from": None, **par})})
    layout = RunLayout(sub.run_dir)
    layout.tokenized_train.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), layout.tokenized_train)
    write_manifest(layout.tokenized_train.parent / "manifest.json",
                   {"inputs_key": sha256_json(["features-probe", rows]), "rows": len(rows)})
    return sub


def _rel(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(||a - b||_F / ||b||_F, max over rows t of ||a_t - b_t|| / ||b_t||) of [T, H] tensors."""
    d = (a - b).norm(dim=-1)
    return float(d.norm() / b.norm().clamp_min(1e-30)), float((d / b.norm(dim=-1).clamp_min(1e-30)).max())


def compare(dir_a: Path, dir_b: Path) -> dict:
    """Backend a against backend b on two stores of the same samples: {'aux': [{layer, rel, worst_token}] per aux
    layer, 'final': {rel, worst_token}, 'argmax_agree', 'tokens', 'ok'} (ok: every measure within TOLERANCE).
    Raises ValueError if the stores hold other samples, tokens or layers."""
    ma, mb = read_manifest(dir_a / "manifest.json"), read_manifest(dir_b / "manifest.json")
    if ma["aux_layer_ids"] != mb["aux_layer_ids"]:
        raise ValueError(f"{dir_a} holds aux layers {ma['aux_layer_ids']}, {dir_b} {mb['aux_layer_ids']}")
    H = ma["hidden_size"]
    cat = {k: ([], []) for k in ("aux", "final", "target_top1")}
    for a, b in zip(load_samples(dir_a), load_samples(dir_b), strict=True):
        if a["id"] != b["id"] or not torch.equal(a["input_ids"], b["input_ids"]):
            raise ValueError(f"sample {a['id']!r} of {dir_a} is not sample {b['id']!r} of {dir_b}")
        for k, (xs, ys) in cat.items():
            xs.append(a[k])
            ys.append(b[k])
    a, b = ({k: torch.cat(v[i]) for k, v in cat.items()} for i in (0, 1))
    aux = [dict(zip(("rel", "worst_token"), _rel(a["aux"][:, j * H:(j + 1) * H], b["aux"][:, j * H:(j + 1) * H]),
                    strict=True), layer=lid) for j, lid in enumerate(ma["aux_layer_ids"])]
    final = dict(zip(("rel", "worst_token"), _rel(a["final"], b["final"]), strict=True))
    agree = float((a["target_top1"] == b["target_top1"]).float().mean())
    ok = (all(x["rel"] <= TOLERANCE["aux_rel"] for x in aux) and final["rel"] <= TOLERANCE["final_rel"]
          and agree >= TOLERANCE["argmax_agree"])
    return {"aux": aux, "final": final, "argmax_agree": agree, "tokens": int(a["target_top1"].numel()), "ok": ok}


def probe(cfg: PipelineConfig, backends: list[str], samples: int, log=print) -> dict:
    """Extract the first `samples` tokenized rows with each of the two `backends` (probe_run, run_features) and
    compare them (compare: the first backend against the second), each extracted afresh. Returns {backends,
    samples, tokens_per_s {backend: rate}, seconds {backend: the stage's wall seconds, load included}, ranks
    {backend: the ranks its stage ran on (features.tp_size of a torchrun backend, else 1)}, **compare(...)}. Raises
    ValueError for other than two distinct backends or a run without tokenized rows."""
    if len(backends) != 2 or backends[0] == backends[1]:
        raise ValueError(f"--backends takes two different backends, e.g. hf,sglang; got {backends}")
    path = RunLayout(cfg.run_dir).tokenized_train
    if not path.exists():
        raise ValueError(f"{path} does not exist: run the tokenize stage first (the probe extracts its rows)")
    rows = pq.read_table(path).slice(0, samples).to_pylist()
    dirs, rates, walls, ranks = {}, {}, {}, {}
    for backend in backends:
        sub = probe_run(cfg, backend, rows)
        shutil.rmtree(RunLayout(sub.run_dir).features, ignore_errors=True)     # afresh (module docstring)
        t0 = time.monotonic()
        run_features(sub, log)
        walls[backend] = time.monotonic() - t0
        dirs[backend] = RunLayout(sub.run_dir).features
        m = read_manifest(dirs[backend] / "manifest.json")
        rates[backend] = m["tokens"] / m["seconds"] if m.get("seconds") else None
        ranks[backend] = read_manifest(RunLayout(sub.run_dir).manifest("features")).get("tp_size", 1)
    return {"backends": backends, "samples": len(rows), "tokens_per_s": rates, "seconds": walls, "ranks": ranks,
            **compare(dirs[backends[0]], dirs[backends[1]])}


def render(r: dict) -> str:
    """The probe's report as text lines (one per measure, with the tolerance)."""
    a, b = r["backends"]
    lines = [f"features probe: {a} against {b}, {r['samples']} samples, {r['tokens']} tokens"]
    for x in r["aux"]:
        lines.append(f"  aux layer {x['layer']:>3}: rel {x['rel']:.2e} (<= {TOLERANCE['aux_rel']}), worst token "
                     f"{x['worst_token']:.2e}")
    lines.append(f"  final        : rel {r['final']['rel']:.2e} (<= {TOLERANCE['final_rel']}), worst token "
                 f"{r['final']['worst_token']:.2e}")
    lines.append(f"  argmax agree : {r['argmax_agree']:.2%} (>= {TOLERANCE['argmax_agree']:.0%})")
    for k in (a, b):
        rate = r["tokens_per_s"][k]
        lines.append(f"  {k:<13}: " + (f"{rate:,.0f} tok/s extracting" if rate else "rate not recorded") +
                     f", {r['seconds'][k]:.1f} s with loading" +
                     (f", {r['ranks'][k]} rank(s)" if k in r.get("ranks", {}) else ""))
    lines.append("  " + ("EQUAL within the tolerance" if r["ok"] else "DIFFERENT: beyond the tolerance"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config", help="a PipelineConfig JSON file (or preset name) of a run whose tokenize stage ran")
    ap.add_argument("--backends", default="hf,hf_tp", help="two features backends, comma-separated")
    ap.add_argument("--samples", type=int, default=4, help="the first this many tokenized samples")
    a = ap.parse_args(argv)
    try:
        r = probe(config_or_preset(a.config), a.backends.split(","), a.samples)
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 2
    print(render(r))
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
