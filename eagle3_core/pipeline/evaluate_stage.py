"""Stage `evaluate`: pre-flight of the exported draft, then offline tau on the held-out prompts (chain, tree,
untrained), eval/report.json."""
from __future__ import annotations

import json
import time
from pathlib import Path

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.layout import RunLayout
from eagle3_core.contract.run_stage import run_stage
from eagle3_core.data import prompt_set as prompts_mod
from eagle3_core.data.chat import prompt_ids
from eagle3_core.pipeline.keys import stage_key, target_config, upstream_manifest
from eagle3_core.pipeline.train_stage import fresh_draft
from eagle3_core.training.checkpoint import load_draft


def evaluate_key(cfg: PipelineConfig) -> str:
    """Inputs key of the evaluate stage: the trained draft, the eval settings and the held-out prompts."""
    return stage_key(upstream_manifest(cfg.run_dir, "draft")["inputs_key"], cfg.eval,
                     upstream_manifest(cfg.run_dir, "prompts")["inputs_key"])


def category(row: dict) -> str:
    """Prompt category for tau per category: meta['category'] (Spec-Bench rows) or the row's source."""
    meta = json.loads(row.get("meta") or "{}")
    return str(meta.get("category") or row.get("source") or "all")


def run_evaluate(cfg: PipelineConfig, log=print, on_progress=None) -> dict:
    """Pre-flight check of the exported draft against the target, then offline tau on the held-out prompts: the
    trained draft as a chain and as an SGLang-style tree, an untrained draft as a chain; simulated vs measured tau
    (eval/report.json). Logs 'n of N' decoded prompts with an ETA after each; on_progress(done, total, run name)
    too. Raises PreflightError listing every mismatch between the draft and the target."""
    from eagle3_core.evaluation.acceptance import SpecRun, measure, tau_consistency
    from eagle3_core.evaluation.preflight import preflight
    from eagle3_core.evaluation.speculate import TargetRunner
    from eagle3_core.target.loading import load_target, load_tokenizer
    out = RunLayout(cfg.run_dir).eval
    up = upstream_manifest(cfg.run_dir, "draft")

    def body() -> dict:
        preflight(Path(up["export_dir"]), target_config(cfg))
        tok = load_tokenizer(cfg.target)
        model = load_target(cfg.target)
        rows = prompts_mod.read_rows(RunLayout(cfg.run_dir).prompts_eval)
        kwargs = cfg.generation.chat_template_kwargs or None          # the thinking mode the draft was trained in
        prompts = [prompt_ids(tok, r["messages"], json.loads(r["tools"]) if r.get("tools") else None, kwargs)
                   for r in rows]
        trained = load_draft(Path(up["export_dir"]))
        untrained, _ = fresh_draft(cfg)
        ids = trained.shape.aux_layer_ids
        eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        e, S = cfg.eval, cfg.eval.num_draft_steps

        def subset(n: int | None) -> list[int] | None:                     # the first n held-out prompts
            return None if n is None else list(range(min(n, len(prompts))))

        runs = {"trained": SpecRun(trained, S)}
        if e.tree_topk > 1:
            runs["trained_tree"] = SpecRun(trained, S, e.tree_topk, e.tree_num_draft_tokens, subset(e.tree_prompts))
        runs["untrained"] = SpecRun(untrained, S, prompt_idx=subset(e.untrained_prompts))
        t_measure = time.monotonic()

        def progress(done: int, total: int, name: str) -> None:
            eta = (time.monotonic() - t_measure) / done * (total - done)
            log(f"evaluate: {done} of {total} prompt decodes ({name})"
                + (f", ETA {eta / 60:.1f} min" if eta else ""))
            if on_progress is not None:
                on_progress(done, total, name)

        report = measure(TargetRunner(model, ids), runs, prompts, [category(r) for r in rows], e.max_new_tokens,
                         eos, e.tie_gap, on_prompt=progress)
        report.update({"eval_ids": [r["id"] for r in rows], "num_draft_steps": S,
                       "max_new_tokens": e.max_new_tokens, "aux_layer_ids": ids, "preflight": "passed",
                       "sampling": {"temperature": 0.0, "top_p": 1.0, "greedy": True,
                                    "chat_template_kwargs": cfg.generation.chat_template_kwargs},
                       "consistency": tau_consistency(report["trained"]["tau"], up, S)})
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(report, indent=2))
        tree = report.get("trained_tree")
        log(f"eval: tau trained {report['trained']['tau']:.2f} (chain)"
            + (f", {tree['tau']:.2f} (tree k={e.tree_topk}, T={e.tree_num_draft_tokens})" if tree else "")
            + f", untrained {report['untrained']['tau']:.2f}; lossless {report['trained']['lossless']}; simulated "
            + f"tau {report['consistency']['tau_sim_at_steps']:.2f} over "
            + f"{report['consistency']['steps_compared']} steps")
        return {"report": str(out / "report.json"), "summary": report, "sampling": report["sampling"]}

    return run_stage(out, evaluate_key(cfg), body)


