"""Is the compiled extractor exact enough to be the default? HFExtractor with compile=True against the eager one on
a real target's weights and real data: argmax agreement (target_top1 over real tokens) and the error of the aux and
final hidden states, with the eager bf16 extractor's own agreement with an fp32 forward as the yardstick.

  python benchmarks/compiled_extractor_check.py --config configs/e2e_gsm8k.json [--target DIR] [--samples 512] \
      [--out FILE.json]

Rows: the first --samples of the config's tokenized store (run the data stages first: recipe_tau_time.py or the
pipeline). Target: the config's (the embedded SmolLM2-135M by default) in the features stage's dtype (bf16 on a GPU),
once eager, then with its attention/MLP/norm sub-modules compiled in place (HFExtractor(compile=True)), and once in
fp32 eager. Batches: packing.batches_by_tokens under --batch-tokens, the same for every pass. Prints and writes
{tokens, argmax agreement of compiled vs eager and of eager vs fp32 (fractions of real tokens), aux and final:
max |diff| / max |eager| and mean |diff| / mean |eager|, tokens/s of each pass after a warm-up}. The issue's bar for
compiled as the default: agreement >= 0.999.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3_core.config import TargetConfig, load_config  # noqa: E402


def run(extractor, rows: list[dict], batches: list[list[int]]) -> tuple[dict, float]:
    """Outputs over real tokens concatenated (aux [N, 3H] and final [N, H] float32 on CPU, top1 int64 [N]) and
    the tokens/s of the pass (after one warm-up batch)."""
    extractor.forward([rows[i]["input_ids"] for i in batches[0]])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    out, t0 = {"aux": [], "final": [], "top1": []}, time.perf_counter()
    for b in batches:
        o = extractor.forward([rows[i]["input_ids"] for i in b])
        for j, n in enumerate(o["lengths"].tolist()):
            out["aux"].append(o["aux"][j, :n].float().cpu())
            out["final"].append(o["final"][j, :n].float().cpu())
            out["top1"].append(o["target_top1"][j, :n].long().cpu())
    seconds = time.perf_counter() - t0
    cat = {k: torch.cat(v) for k, v in out.items()}
    return cat, len(cat["top1"]) / seconds


def errors(a: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (a - ref).abs()
    return {"max_rel": float(d.max() / ref.abs().max()), "mean_rel": float(d.mean() / ref.abs().mean())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, type=Path)
    ap.add_argument("--target", default=None, help="target directory instead of the config's target.model")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    from eagle3_core.data.samples import batches_by_tokens
    from eagle3_core.features.extract import HFExtractor
    from eagle3_core.pipeline.features_stage import tokenized_rows
    from eagle3_core.pipeline.keys import aux_ids
    from eagle3_core.target.family import num_layers
    from eagle3_core.target.loading import load_target
    cfg = load_config(a.config)
    if a.target:
        cfg = cfg.model_copy(update={"target": TargetConfig(model=a.target)})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = tokenized_rows(cfg)[:a.samples]
    batches = batches_by_tokens([len(r["input_ids"]) for r in rows], a.batch_tokens)
    ref_model = load_target(cfg.target, device, torch.float32)
    ids = aux_ids(cfg, num_layers(ref_model.config))
    ref, _ = run(HFExtractor(ref_model, ids), rows, batches)
    del ref_model
    model = load_target(cfg.target, device)
    eager, eager_tps = run(HFExtractor(model, ids), rows, batches)
    compiled, compiled_tps = run(HFExtractor(model, ids, compile=True), rows, batches)
    res = {"target": cfg.target.model, "dtype": str(next(model.parameters()).dtype), "device": device,
           "samples": len(rows), "tokens": len(eager["top1"]), "aux_layer_ids": ids,
           "argmax_compiled_vs_eager": float((compiled["top1"] == eager["top1"]).double().mean()),
           "argmax_eager_vs_fp32": float((eager["top1"] == ref["top1"]).double().mean()),
           "argmax_compiled_vs_fp32": float((compiled["top1"] == ref["top1"]).double().mean()),
           "aux_compiled_vs_eager": errors(compiled["aux"], eager["aux"]),
           "aux_eager_vs_fp32": errors(eager["aux"], ref["aux"]),
           "final_compiled_vs_eager": errors(compiled["final"], eager["final"]),
           "tokens_per_s": {"eager": eager_tps, "compiled": compiled_tps}}
    res["compiled_qualifies"] = res["argmax_compiled_vs_eager"] >= 0.999
    print(json.dumps(res, indent=2))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
