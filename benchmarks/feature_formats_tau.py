"""Drafts trained the same way on bf16, fp8 and online features of the embedded default: bytes/token and tau.

  python -m flows.pipeline --preset demo --run-dir runs/demo          # once: prompts, tokenized data, vocab map
  python benchmarks/feature_formats_tau.py --run-dir runs/demo         # ~3 x (extraction + training + eval)
  python benchmarks/feature_formats_tau.py --run-dir runs/demo --tiny  # smoke run: 8 samples, 1 epoch

For each format: features of the run's tokenized samples (features.extract_features, the run's feature settings),
read back through features.load_samples, a draft with the same shape, seed, vocab map and TrainConfig (the run's
preset) trained on them, then tau of its best epoch measured offline on the run's held-out prompts (evaluate.measure,
the verify step of the evaluation stage). Differences between formats come from the stored features only.
Goal (issue 12): fp8 tau within 2% of bf16 at no more than half the bytes per token. Prints a table; writes
<out>/feature_formats_tau.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from eagle3_core.config import default_aux_layer_ids, preset  # noqa: E402
from eagle3_core.data import prompt_set as prompts_mod  # noqa: E402
from eagle3_core.data.chat import prompt_ids  # noqa: E402
from eagle3_core.evaluation.acceptance import measure  # noqa: E402
from eagle3_core.evaluation.speculate import TargetRunner  # noqa: E402
from eagle3_core.features.store import extract_features  # noqa: E402
from eagle3_core.features.reader import load_head, load_samples  # noqa: E402
from eagle3_core.target.loading import load_target, load_tokenizer  # noqa: E402
from eagle3_core.training.checkpoint import load_draft  # noqa: E402
from eagle3_core.training.draft_geometry import draft_shape  # noqa: E402
from eagle3_core.training.trainer import train  # noqa: E402
from eagle3_core.training.setup import build_draft  # noqa: E402


def run_format(fmt: str, cfg, model, cpu_model, rows, vocab, prompts, eos, out: Path, log) -> dict:
    ids = cfg.features.aux_layer_ids or default_aux_layer_ids(model.config.num_hidden_layers)
    t0 = time.monotonic()
    m = extract_features(model, rows, out / "features", ids, cfg.features.shard_samples, cfg.features.batch_tokens,
                         store_format=fmt, log=log, target=cfg.target.model_dump())
    t_extract = time.monotonic() - t0
    samples = load_samples(out / "features", target_model=model)
    shape = draft_shape(model.config, cfg.draft.draft_vocab_size, ids)
    emb, lm = load_head(out / "features")
    draft = build_draft(shape, emb, vocab["d2t"], vocab["t2d"], cfg.draft.seed)
    n_eval = int(len(samples) * cfg.train.eval_frac)
    t0 = time.monotonic()
    summary = train(draft, samples[n_eval:], samples[:n_eval], lm, cfg.train, out / "draft", log=log)
    t_train = time.monotonic() - t0
    trained = load_draft(Path(summary["best_dir"]))
    report = measure(TargetRunner(cpu_model, ids), {"trained": trained}, prompts, cfg.eval.max_new_tokens, eos,
                     cfg.eval.num_draft_steps, cfg.eval.tie_gap)["trained"]
    return {"format": fmt, "epochs": cfg.train.epochs, "ttt_length": cfg.train.ttt_length,
            "bytes_per_token": m["bytes_per_token"], "bytes": m["bytes"], "tokens": m["tokens"],
            "tau": report["tau"], "tau_ci95": report["tau_ci95"], "tau_sim": summary["best"]["tau_sim"],
            "lossless": report["lossless"], "extract_s": t_extract, "train_s": t_train}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", required=True, help="a run with prompts/, tokenized/ and vocab/ (demo preset)")
    ap.add_argument("--preset", default="demo", help="preset whose feature/train/eval settings are used")
    ap.add_argument("--formats", default="bf16,fp8,online")
    ap.add_argument("--out", default=None, help="output directory (default: <run-dir>/feature_formats)")
    ap.add_argument("--tiny", action="store_true", help="8 samples, 1 epoch, 2 prompts x 8 tokens")
    ap.add_argument("--device", default=None, help="extraction, online features and training (default: cuda if "
                                                    "available); offline evaluation runs on the CPU")
    ap.add_argument("--attention", default=None, help="override train.attention (e.g. merged_math: no compile "
                                                       "per sequence length for a small draft)")
    ap.add_argument("--target-gguf", default=None, help="GGUF file of the target (default: the embedded one)")
    ap.add_argument("--longer", default="", help="extra bf16 runs with other epochs:ttt_length, e.g. '20:3,20:7' "
                                                 "(issue 4: a longer run against the preset's)")
    args = ap.parse_args()
    run_dir = Path(args.run_dir)
    cfg = preset(args.preset, run_dir)
    out = Path(args.out) if args.out else run_dir / "feature_formats"
    rows = pq.read_table(run_dir / "tokenized" / "train.parquet").to_pylist()
    eval_rows = prompts_mod.read_rows(run_dir / "prompts" / "eval.parquet")
    if args.tiny:
        rows, eval_rows = rows[:8], eval_rows[:2]
        cfg.train.epochs, cfg.eval.max_new_tokens, cfg.features.shard_samples = 1, 8, 4
    if args.target_gguf:
        cfg.target.model, cfg.target.gguf_file = str(Path(args.target_gguf).parent), Path(args.target_gguf).name
    if args.attention:
        cfg.train.attention = args.attention
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_target(cfg.target, device)
    cpu_model = model if device == "cpu" else load_target(cfg.target)
    tok = load_tokenizer(cfg.target)
    prompts = [prompt_ids(tok, r["messages"]) for r in eval_rows]
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    vocab = load_file(str(run_dir / "vocab" / "vocab_map.safetensors"))
    runs = [(fmt, cfg) for fmt in args.formats.split(",")]
    for spec in filter(None, args.longer.split(",")):
        epochs, ttt = map(int, spec.split(":"))
        runs.append(("bf16", cfg.model_copy(update={"train": cfg.train.model_copy(
            update={"epochs": epochs, "ttt_length": ttt})})))
    results = []
    for fmt, run_cfg in runs:
        name = f"{fmt}-e{run_cfg.train.epochs}-ttt{run_cfg.train.ttt_length}"
        torch.manual_seed(run_cfg.train.seed)
        results.append(run_format(fmt, run_cfg, model, cpu_model, rows, vocab, prompts, eos, out / name,
                                  log=lambda s, name=name: print(f"[{name}] {s}", flush=True)))
    (out / "feature_formats_tau.json").write_text(json.dumps(results, indent=2))
    ref = next((r for r in results if r["format"] == "bf16"), results[0])
    print(f"\n{len(rows)} samples, {ref['tokens']} tokens; {len(prompts)} held-out prompts x "
          f"{cfg.eval.max_new_tokens} tokens, {cfg.eval.num_draft_steps} draft tokens per verify step")
    print("| format | epochs | TTT | bytes/token | vs bf16 | tau (95% CI) | vs bf16 | tau_sim | extract s | train s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        lo, hi = r["tau_ci95"]
        print(f"| {r['format']} | {r['epochs']} | {r['ttt_length']} | {r['bytes_per_token']:,.1f} | {r['bytes_per_token'] / ref['bytes_per_token']:.3f} "
              f"| {r['tau']:.3f} ({lo:.2f}-{hi:.2f}) | {r['tau'] / ref['tau'] - 1:+.1%} | {r['tau_sim']:.3f} "
              f"| {r['extract_s']:.0f} | {r['train_s']:.0f} |")


if __name__ == "__main__":
    main()
