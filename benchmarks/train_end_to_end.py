"""End to end on a real store: our features + vocab + train stages against SpecForge 0.2.0's online training (the
target's forward inside its training loop) on the same regenerated samples, in one process, with the ratio.

  python benchmarks/train_end_to_end.py --config configs/e2e_gsm8k.json [--target DIR] [--out RESULT.json]

Data (not timed in the ratio): prompts, regeneration (server.kind 'transformers': the target in this process on
the GPU) and tokenization, each cached by its manifest; both trainers start from the same tokenized samples, in a
process that has started CUDA and imported what both use (`warm_process`).
Ours, timed: the features stage (target load, aux hidden states into the store), the vocab map and the train
stage (packed rows, per-epoch held-out eval, checkpoints and the SGLang export included), each run afresh (their
folders are deleted first). The train stage's log lines and every warning torch logs while it runs are printed
and counted (a recompile or an unfused flex attention would show there).

SpecForge, timed from the target's load to the last optimizer step: per batch, the target's forward (our
HFExtractor: the same model, dtype, aux layers and capture as our features stage; SpecForge 0.2.0 captures from an
SGLang server only, which this machine cannot run) and then SpecForge's own training step (OnlineEagle3Model around
LlamaForCausalLMEagle3 with its flex_attention backend, bf16 weights, its BF16Optimizer with warmup + cosine, loss
sum_k step_weight**k ploss_k, as its trainer). Same train samples, epochs, TTT length, draft vocab (our vocab map),
initial weights (our fresh draft), learning rate, gradient clip and tokens per step: SpecForge's batches are our
trainer's padded length buckets under train.batch_tokens (its collator pads to the longest), ours packed rows of
train.batch_tokens. Not given to SpecForge: eval, checkpoints, export (ours pays for them).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from eagle3_core.config import PipelineConfig, TargetConfig, load_config  # noqa: E402


class TorchWarnings(logging.Handler):
    """Every WARNING or worse that torch's loggers (dynamo, inductor, flex attention) or `warnings` emit."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.name}: {record.getMessage()}")

    def __enter__(self):
        logging.getLogger("torch").addHandler(self)
        self._show = warnings.showwarning
        warnings.showwarning = lambda m, c, f, n, *a: self.lines.append(f"{c.__name__}: {m} ({f}:{n})")
        return self

    def __exit__(self, *exc):
        logging.getLogger("torch").removeHandler(self)
        warnings.showwarning = self._show


def data_stages(cfg: PipelineConfig) -> dict:
    from eagle3_core.pipeline.generation_stage import run_generation
    from eagle3_core.pipeline.prompts_stage import run_prompts
    from eagle3_core.pipeline.tokenize_stage import run_tokenize
    out = {}
    for name, stage in (("prompts", run_prompts), ("generation", run_generation),
                        ("tokenize", run_tokenize)):
        t0 = time.monotonic()
        stage(cfg)
        out[name] = time.monotonic() - t0
        print(f"== {name}: {out[name]:.1f} s", flush=True)
    warm_process()
    return out


def warm_process() -> None:
    """What a process pays once, here and not in whichever trainer is timed first (ours, when generation is
    cached): CUDA's and cuBLAS's start-up and the imports both trainers use, transformers' model classes (with
    its optional scikit-learn) and torch._dynamo (flex attention, torch.compile): about 12 s on the H200 host,
    measured with cProfile in a cold features stage."""
    from transformers import AutoModelForCausalLM  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401
    torch.compiler.reset()                                  # imports torch._dynamo; nothing is compiled yet
    if torch.cuda.is_available():
        torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")
        torch.cuda.synchronize()


def profiled(stage, name: str, where: Path | None):
    """`stage` run under cProfile when `where` is a folder: the stats go to where/NAME.prof (and the top 40 by
    cumulative and top 25 by own time to where/NAME.txt); otherwise `stage` itself."""
    if where is None:
        return stage

    def run(*args, **kwargs):
        import cProfile
        import io
        import pstats
        where.mkdir(parents=True, exist_ok=True)
        prof = cProfile.Profile()
        try:
            return prof.runcall(stage, *args, **kwargs)
        finally:
            prof.dump_stats(str(where / f"{name}.prof"))
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            (where / f"{name}.txt").write_text(text.getvalue())
    return run


def ours(cfg: PipelineConfig, profile: Path | None = None, profile_stages: set = frozenset()) -> dict:
    """Our features, vocab and train stages from scratch; seconds of each, train log and torch warnings.
    profile: a folder for the cProfile stats of profile_stages (`profiled`; their timings include its overhead)."""
    from eagle3_core.contract.layout import RunLayout
    from eagle3_core.pipeline.features_stage import run_features
    from eagle3_core.pipeline.train_stage import run_train
    from eagle3_core.pipeline.vocab_stage import run_vocab
    run = RunLayout(cfg.run_dir)
    for d in (run.features, run.vocab, run.draft):
        shutil.rmtree(d, ignore_errors=True)
    res, lines = {}, []
    for name, stage in (("features", run_features), ("vocab", run_vocab)):
        t0 = time.monotonic()
        profiled(stage, name, profile if name in profile_stages else None)(cfg)
        res[name] = time.monotonic() - t0
        print(f"== ours {name}: {res[name]:.1f} s", flush=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    torch._dynamo.utils.counters.clear()
    t0 = time.monotonic()
    with TorchWarnings() as warned:
        train_stage = profiled(run_train, "train", profile if "train" in profile_stages else None)
        m = train_stage(cfg, log=lambda s: (lines.append(s), print(s, flush=True)))
    res["train"] = time.monotonic() - t0
    res["train_log"], res["torch_warnings"] = lines, warned.lines
    res["graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    res["steps"], res["best"] = m["steps"], m["best"]
    res["tokens"] = sum(h["tokens"] for h in m["history"])
    print(f"== ours train: {res['train']:.1f} s, {res['steps']} steps, {res['graphs']} dynamo graphs, "
          f"{len(warned.lines)} torch warnings" + "".join(f"\n   {w[:400]}" for w in warned.lines), flush=True)
    return res


def specforge_online(cfg: PipelineConfig, device: torch.device, on_epoch=None) -> dict:
    """SpecForge's training loop with the target's forward per batch (module docstring); seconds and steps. On a
    CPU (a check that the script runs): sdpa attention, and specforge_side_by_side's PyTorch stand-in for its
    Triton loss. on_epoch(epochs_done, seconds, model): after each epoch, SpecForge's draft module; the time it
    takes is left out of the clock."""
    from specforge_side_by_side import fastest_backend, import_specforge, specforge_draft, specforge_inputs
    OnlineEagle3Model, _, _ = import_specforge()
    from specforge.optimizer import BF16Optimizer

    from eagle3_core.features.extract import HFExtractor
    from eagle3_core.pipeline.keys import aux_ids
    from eagle3_core.pipeline.train_stage import fresh_draft, train_split
    from eagle3_core.target.family import num_layers
    from eagle3_core.target.loading import load_target
    from eagle3_core.training.batch_feed import epoch_batches
    t = cfg.train
    backend = fastest_backend(device)
    train_s, _ = train_split(cfg)
    t = t.resolved(sum(len(s["input_ids"]) for s in train_s))
    seqs = [(torch.as_tensor(s["input_ids"]).long(), torch.as_tensor(s["loss_mask"]).bool()) for s in train_s]
    init, lm_head = fresh_draft(cfg)
    t0 = time.monotonic()
    target = load_target(cfg.target, str(device))
    extractor = HFExtractor(target, aux_ids(cfg, num_layers(target.config)))
    model = specforge_draft(init, backend).to(device, torch.bfloat16)
    model.embed_tokens.weight.requires_grad_(False)                  # the target's, frozen (as ours)
    wrapper = OnlineEagle3Model(draft_model=model, length=t.ttt_length, attention_backend=backend)
    batches0 = epoch_batches(train_s, t, 0)
    total = len(batches0) * t.epochs
    opt = BF16Optimizer(model, lr=t.lr, max_grad_norm=t.grad_clip, total_steps=total, warmup_ratio=t.warmup_frac)
    opt.configure_grad_norm_reduction(enabled=False)
    head = lm_head.to(device, torch.bfloat16)
    steps, tokens, marks = 0, 0, []
    for epoch in range(t.epochs):
        for ids in epoch_batches(train_s, t, epoch):
            out = extractor.forward([seqs[i][0] for i in ids])          # aux [B, T, 3H_t], final [B, T, H_t]
            B, T = out["aux"].shape[:2]
            b = {"input_ids": torch.zeros(B, T, dtype=torch.long), "loss_mask": torch.zeros(B, T, dtype=torch.bool),
                 "valid": torch.arange(T)[None] < out["lengths"][:, None], "aux": out["aux"], "final": out["final"]}
            for row, i in enumerate(ids):
                n = len(seqs[i][0])
                b["input_ids"][row, :n], b["loss_mask"][row, :n] = seqs[i]
            # shifted as SpecForge's TargetHead.preprocess shifts them (specforge_side_by_side.specforge_inputs)
            plosses, *_ = wrapper(**specforge_inputs(b, device, torch.bfloat16), target_head_weight=head)
            loss = sum(t.step_weight ** k * pl for k, pl in enumerate(plosses))
            loss.backward()
            opt.step()
            steps, tokens = steps + 1, tokens + int(out["lengths"].sum())
        if device.type == "cuda":
            torch.cuda.synchronize()
        marks.append(time.monotonic() - t0)
        print(f"== specforge epoch {epoch + 1}: {marks[-1]:.1f} s, last loss {loss.detach().item():.3f}", flush=True)
        if on_epoch is not None:
            paused = time.monotonic()
            on_epoch(epoch + 1, marks[-1], model)
            t0 += time.monotonic() - paused
    seconds = time.monotonic() - t0
    return {"seconds": seconds, "epochs_at": marks, "steps": steps, "tokens": tokens,
            "final_loss": loss.detach().item(),
            "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, type=Path, help="PipelineConfig JSON (configs/e2e_gsm8k.json)")
    ap.add_argument("--target", default=None, help="target directory instead of the config's target.model")
    ap.add_argument("--skip", default="", help="comma-separated: ours, specforge (the other one reads results "
                                               "of an earlier run from --out)")
    ap.add_argument("--out", type=Path, default=None, help="result JSON (default RUN_DIR/e2e.json)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where SpecForge trains (ours: the stages' own choice)")
    ap.add_argument("--profile", type=Path, default=None,
                    help="folder for cProfile stats of our stages (NAME.prof, NAME.txt); timings include it")
    ap.add_argument("--profile-stages", default="features,vocab,train", help="which of our stages --profile covers")
    a = ap.parse_args()
    cfg = load_config(a.config)
    if a.target:
        cfg = cfg.model_copy(update={"target": TargetConfig(model=a.target)})
    out = a.out or Path(cfg.run_dir) / "e2e.json"
    res = json.loads(out.read_text()) if out.exists() else {}
    skip = set(filter(None, a.skip.split(",")))
    res["data"] = data_stages(cfg)
    if "ours" not in skip:
        res["ours"] = ours(cfg, a.profile, set(a.profile_stages.split(",")))
    if "specforge" not in skip:
        res["specforge"] = specforge_online(cfg, torch.device(a.device))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    if "ours" in res and "specforge" in res:
        o, s = res["ours"], res["specforge"]
        mine = o["features"] + o["vocab"] + o["train"]
        print(f"ours: features {o['features']:.1f} s + vocab {o['vocab']:.1f} s + train {o['train']:.1f} s = "
              f"{mine:.1f} s ({o['steps']} steps, {o['tokens']:,} tokens trained over {cfg.train.epochs} epochs)\n"
              f"SpecForge 0.2.0 online (target forward + its step): {s['seconds']:.1f} s ({s['steps']} steps, "
              f"{s['tokens']:,} tokens)\nratio SpecForge / ours: {s['seconds'] / mine:.2f}x "
              f"(written to {out})")
    if not math.isfinite(res.get("specforge", {}).get("final_loss", 0.0)):
        sys.exit("SpecForge's loss is not finite")


if __name__ == "__main__":
    main()
