"""The team bet in one call (benchmarks/scaling_study_gpu.py --team-bet): its cost first, the data stages (the
regenerated answers restored from, or kept in, the committed results folder), the points that fit the budget, and
the answers of what is measured so far (team_bet_surface).

RESULTS (a folder meant to be committed, e.g. benchmarks/data/team_bet): <point>.json per measured point,
generations/ (the generation stage's shards: the target's answers as token ids and text, with their records;
restored into the run before the generation stage, which then sends nothing), data.json (the data stages' measured
rates), rates.json (plan's rates measured by this study), summary.json and summary.md. Features, the replay
recording and the training folders stay in the run directory and are made again on another machine.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.layout import RunLayout
from eagle3_core.contract.manifest import busy_seconds, shard_records
from eagle3_core.evaluation.replay_eval import record_target, replay_measure
from eagle3_core.evaluation.speculate import TargetRunner
from eagle3_core.pipeline.features_stage import run_features
from eagle3_core.pipeline.generation_stage import run_generation
from eagle3_core.pipeline.keys import aux_ids
from eagle3_core.pipeline.prompts_stage import run_prompts
from eagle3_core.pipeline.tokenize_stage import run_tokenize
from eagle3_core.pipeline.vocab_stage import run_vocab
from eagle3_core.studies import team_bet_surface as ts
from eagle3_core.studies.scaling_study import held_out_prompts
from eagle3_core.target.family import num_layers
from eagle3_core.target.loading import load_target
from eagle3_core.training.checkpoint import load_draft


def prompt_ids(cfg: PipelineConfig) -> dict:
    """The prompts stage's manifest (train_ids, eval_ids: the pinned held-out prompts)."""
    return json.loads((RunLayout(cfg.run_dir).prompts / "manifest.json").read_text())


def copy_new(src: Path, dst: Path, pattern: str = "shard_*") -> list[str]:
    """Copy the files of `src` matching `pattern` that `dst` lacks (metadata kept); returns their names."""
    dst.mkdir(parents=True, exist_ok=True)
    new = [p for p in sorted(src.glob(pattern)) if not (dst / p.name).exists()] if src.exists() else []
    for p in new:
        shutil.copy2(p, dst / p.name)
    return [p.name for p in new]


def generation_rate(generations: Path) -> float | None:
    """Output tok/s of the calls that generated the shards in `generations`: their completion tokens over the wall
    time any of them ran (manifest.busy_seconds of the shard records' started_at/ended_at), wherever and whenever
    they ran; None without a timed shard record."""
    records = shard_records(generations)
    busy = busy_seconds(records)
    return sum(r["completion_tokens"] for r in records) / busy if busy > 0 else None


def data_stages(cfg: PipelineConfig, results: Path, log=print) -> dict:
    """prompts, generation (its shards restored from RESULTS/generations first, kept there after), tokenize,
    features, vocab. Returns data.json {generation_tok_s, output_tokens_per_sample, tokens_per_sample,
    extraction_tok_s, hidden_size}, kept in RESULTS/data.json. The two rates are those of the work itself, never
    of a call that found it done: generation from the shard records (generation_rate), extraction from the features
    manifest's tokens_per_s (the shards this call extracted), else the value already in RESULTS/data.json."""
    run = RunLayout(cfg.run_dir)
    run_prompts(cfg, log=log)
    restored = copy_new(results / "generations", run.generations)
    gen = run_generation(cfg, log=log)
    kept = copy_new(run.generations, results / "generations")
    log(f"team bet: {len(restored)} generation file(s) restored from {results}, {len(kept)} kept there")
    tok = run_tokenize(cfg, log=log)
    feat = run_features(cfg, log=log)
    run_vocab(cfg, log=log)
    old = json.loads((results / "data.json").read_text()) if (results / "data.json").exists() else {}
    data = {"generation_tok_s": generation_rate(results / "generations") or old.get("generation_tok_s"),
            "output_tokens_per_sample": gen.get("completion_tokens", 0) / max(len(prompt_ids(cfg)["train_ids"]), 1),
            "tokens_per_sample": tok["tokens"] / tok["samples"],
            "extraction_tok_s": feat.get("tokens_per_s") or old.get("extraction_tok_s"),
            "hidden_size": feat["hidden_size"]}
    (results / "data.json").write_text(json.dumps(data, indent=1) + "\n")
    return data


def replay_measurer(cfg: PipelineConfig, device: str, batch: int, log=print):
    """measure(export_dir) -> replay_eval.replay_measure's entry (tau, tau_ci95, accept_per_position, per_prompt)
    of that draft on the held-out prompts and the device's name (device: torch.cuda.get_device_name, or 'CPU'),
    against one recording of the target (fp32 on `device`, `batch` prompts per batched generate), kept at
    RUN_DIR/team_bet/recording.pt while its settings hold."""
    path = RunLayout(cfg.run_dir).team_bet / "recording.pt"
    settings = {"eval": cfg.eval.model_dump(mode="json"), "target": cfg.target.model_dump(mode="json"),
                "batch": batch, "eval_ids": prompt_ids(cfg)["eval_ids"]}
    if path.exists() and torch.load(path, weights_only=True)["settings"] == settings:
        recs = torch.load(path, weights_only=True)["recordings"]
    else:
        t0 = time.monotonic()
        _, prompts, eos = held_out_prompts(cfg)
        target = load_target(cfg.target, device, torch.float32)
        recs = record_target(TargetRunner(target, aux_ids(cfg, num_layers(target.config))), prompts,
                             cfg.eval.max_new_tokens, eos, batch=batch, pad_id=min(eos, default=0))
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"settings": settings, "recordings": recs}, path)
        log(f"team bet: recorded the target on {len(prompts)} held-out prompts in {time.monotonic() - t0:.0f} s")

    where = torch.cuda.get_device_name(device) if str(device).startswith("cuda") else "CPU"

    def measure(export: str) -> dict:
        return {**replay_measure(load_draft(Path(export)).to(device).eval(), recs, cfg.eval.num_draft_steps),
                "device": where}
    return measure


def committed_points(results: Path) -> list[dict]:
    """Every measured point in RESULTS (a <point>.json holding its point and tau), by samples then name, whatever
    study settings wrote it (for answers and plots redrawn from the committed results, without a GPU)."""
    pts = [json.loads(f.read_text()) for f in sorted(Path(results).glob("*.json"))]
    return sorted((p for p in pts if "point" in p and "tau" in p), key=lambda p: (p["samples"], p["name"]))


def answers(cfg: PipelineConfig, done: list[dict], data: dict | None, where: str, plan_run=None, markdown=None) -> dict:
    """What the measured points say so far: the surface and its 10x prediction with the cost of that 10x by
    `plan_run` and `markdown` (plan's, passed in: studies sit below plan; None: no cost), warm start against
    scratch, and every point's tau with its interval."""
    out = {"points": [{k: p[k] for k in ("name", "samples", "epochs", "seconds", "tau", "tau_ci95")}
                      for p in done], "warm_against_scratch": ts.warm_against_scratch(done)}
    pts = [{"samples": p["samples"], "epochs": p["epochs"], "tau": p["tau"], "recipe": p["point"]["recipe"]}
           for p in done if not p["point"].get("warm_from")]
    try:
        out["surface"] = ts.fit_surface(pts)
    except ValueError as e:
        out["surface"] = {"not_yet": str(e)}
        return out
    ten = out["tenfold"] = ts.tenfold(out["surface"], pts)
    if data and plan_run and any(p["phases"] for p in done):
        plan = ts.tenfold_plan(cfg, ts.study_rates(data, done, where), ten["samples_10x"], ten["epochs"], plan_run)
        out["tenfold_plan"] = {"total_hours": plan["total_hours"], "gpu_hours": plan["gpu_hours"],
                               "markdown": markdown(plan["plan"])}
    return out
