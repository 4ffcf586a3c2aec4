"""Stage `evaluate`: pre-flight of the exported draft, then offline tau on the held-out prompts (chain, tree,
untrained), eval/report.json."""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.compat import EVAL_FIELDS_V4, fields_v4
from eagle3_core.contract.layout import RunLayout
from eagle3_core.contract.manifest import read_manifest, sha256_json, write_manifest
from eagle3_core.contract.numbers import eta_text, machine_load
from eagle3_core.data import prompt_set as prompts_mod
from eagle3_core.data.chat import prompt_ids
from eagle3_core.data.markers import stop_ids
from eagle3_core.evaluation.acceptance import SpecRun, measure, tau_consistency
from eagle3_core.evaluation.preflight import preflight
from eagle3_core.evaluation.replay_eval import replay_measure
from eagle3_core.evaluation.replay_record import breakdown, greedy_outputs, marker_ids
from eagle3_core.evaluation.replay_sampled import record_sampled, replay_measure_sampled
from eagle3_core.evaluation.speculate import TargetRunner
from eagle3_core.features.backends import close_extractors, must_replay, resolved_evaluator, selected_backend
from eagle3_core.features.reader import load_samples
from eagle3_core.features.store import bad_shards, write_record
from eagle3_core.features.store_run import extract_here, launch
from eagle3_core.pipeline import run as stage_run
from eagle3_core.pipeline.keys import stage_key, target_config, target_key, upstream_keys, upstream_manifest
from eagle3_core.pipeline.stage import Stage
from eagle3_core.target.loading import generation_eos_ids, load_target, load_tokenizer
from eagle3_core.training.checkpoint import load_draft
from eagle3_core.training.startup import fresh_draft

# the feature settings that change a replay recording's store: features_stage.FEATURE_RESULT_FIELDS (a stage module
# imports no other: tests/test_name_copies.py checks the two agree)
REPLAY_FEATURE_FIELDS = ("aux_layer_ids", "max_length", "shard_samples", "format")

def evaluate_key(cfg: PipelineConfig, up: dict | None = None) -> str:
    """Inputs key of the evaluate stage: the trained draft and the held-out prompts (`up`: {'train', 'prompts':
    their keys}; default: read from their manifests) and the eval settings (every one changes the report), the
    evaluator as it resolves ('auto': replay for a sharded features backend, else decode)."""
    up = upstream_keys(cfg, ROW) if up is None else up
    e = cfg.eval
    # the sampling settings count only when sampled (greedy ignores top_p, top_k and seeds: a greedy run's key is
    # the key it had before they existed); the declared serving settings where measured (eval.measured_samplings)
    sampled = ({} if e.sampling.greedy else {"sampling": e.sampling.model_dump(mode="json"),
                                              "sampled_seeds": e.sampled_seeds})
    if len(e.measured_samplings) > 1:
        sampled.update({"serving": e.serving.model_dump(mode="json"), "sampled_seeds": e.sampled_seeds})
    return stage_key(up["train"], {**e.model_dump(mode="json", exclude={"sampling", "sampled_seeds", "serving"}),
                                    "evaluator": resolved_evaluator(e.evaluator, cfg.features.backend), **sampled},
                     up["prompts"])


def evaluate_older_keys(cfg: PipelineConfig, up: dict | None = None) -> tuple[str, ...]:
    """The key an evaluate stage finished before the keys hashed results only holds (the evaluator unresolved;
    none for sampled settings: older runs all measured greedily).
    Remove when runs written before f66665b are no longer supported: their evaluation then runs again
    (compat.LEGACY_READERS)."""
    if not cfg.eval.sampling.greedy or len(cfg.eval.measured_samplings) > 1:
        return ()
    up = upstream_keys(cfg, ROW) if up is None else up
    return (stage_key(up["train"], fields_v4(cfg.eval, EVAL_FIELDS_V4), up["prompts"]),)


def category(row: dict) -> str:
    """Prompt category for tau per category: meta['category'] (Spec-Bench rows) or the row's source."""
    meta = json.loads(row.get("meta") or "{}")
    return str(meta.get("category") or row.get("source") or "all")


def held_out_prompt_ids(cfg: PipelineConfig, tok, rows: list[dict]) -> list[list[int]]:
    """Token ids of each held-out row ({messages, tools (JSON text)}) as the target was asked during regeneration:
    the chat template with the row's tools and generation.chat_template_kwargs (the thinking mode the draft was
    trained in) and the generation prompt. What every offline evaluator decodes from (both evaluators of the
    evaluate stage, the replay recording, studies.scaling_study.held_out_prompts)."""
    kwargs = cfg.generation.chat_template_kwargs or None
    return [prompt_ids(tok, r["messages"], json.loads(r["tools"]) if r.get("tools") else None, kwargs) for r in rows]


def _replay(cfg: PipelineConfig, tok, prompts, cats, drafts: dict, eos: set[int], log) -> dict:
    """eval.evaluator 'replay': the target's greedy outputs from the serving engine, their aux states from the
    features backend (replay_recordings), each draft replayed against them, tau overall and by category, context
    length and segment (replay_record.breakdown). Returns the report's runs {name: replay_measure + breakdown,
    per_category, lossless} and {evaluator, recording}."""
    outputs = greedy_outputs(cfg, prompts, eos, log)
    recs = replay_recordings(cfg, prompts, outputs, log)
    markers = marker_ids(tok)
    report = {"evaluator": "replay", "recording": {"prompts": len(recs), "tokens": sum(map(len, outputs)),
                                                  "server": cfg.server.kind, "features_backend":
                                                  cfg.features.backend}}
    for name, (draft, idx) in drafts.items():
        idx = list(range(len(recs))) if idx is None else idx
        sel = [recs[i] for i in idx]
        r = replay_measure(draft.eval(), sel, cfg.eval.num_draft_steps, keep_runs=True)
        r["breakdown"] = breakdown(r.pop("runs"), sel, [cats[i] for i in idx], markers)
        r["per_category"] = r["breakdown"]["category"]
        r["tokens_from_verify"] = sum(p for p, _ in r["per_prompt"])
        r["verify_steps"] = sum(st for _, st in r["per_prompt"])
        r["params"] = {"num_steps": cfg.eval.num_draft_steps, "topk": 1}
        r["lossless"] = "by construction (the draft replayed against the target's own greedy output)"
        report[name] = r
    return report


def _sampled(cfg: PipelineConfig, target, prompts, drafts: dict, eos: set[int], log, s=None) -> dict:
    """Sampling settings `s` (default eval.sampling) at temperature > 0: one trajectory per held-out prompt and seed
    (s.seed .. + eval.sampled_seeds - 1) sampled by the target in this process (`target`: a
    speculate.TargetRunner), each draft replayed against them under both accept rules (replay_sampled). Returns the
    report's runs {name: the 'sampled' rule's replay_measure_sampled + rules {rule: tau, tau_ci95, per_prompt}, params, lossless} and
    {evaluator 'replay_sampled', recording}."""
    e = cfg.eval
    s = e.sampling if s is None else s
    seeds = list(range(s.seed, s.seed + e.sampled_seeds))
    t0 = time.monotonic()

    def progress(done: int, total: int, tokens: int) -> None:       # the sampling is the stage's longest silence
        log(f"evaluate: {done} of {total} trajectories sampled at temperature {s.temperature:g} ({tokens} tokens)"
            + eta_text(time.monotonic() - t0, done, total - done))
    recs = record_sampled(target, prompts, e.max_new_tokens, eos, s, seeds, on_trajectory=progress)
    log(f"evaluate: sampled {len(recs)} trajectories ({len(prompts)} held-out prompts x {len(seeds)} seeds, "
        f"{sum(len(r['tokens']) for r in recs)} tokens) at temperature {s.temperature:g}")
    report = {"evaluator": "replay_sampled", "recording": {"prompts": len(prompts), "seeds": seeds,
                                                          "tokens": sum(len(r["tokens"]) for r in recs),
                                                          "server": "transformers (this process)"}}
    for name, (draft, idx) in drafts.items():
        keep = set(range(len(prompts)) if idx is None else idx)
        m = replay_measure_sampled(draft.eval(), [r for r in recs if r["prompt_index"] in keep],
                                   e.num_draft_steps, s)
        r = {k: v for k, v in m["sampled"].items() if k != "accepted"}
        report[name] = {**r, "rules": {rule: {k: m[rule][k] for k in ("tau", "tau_ci95", "per_prompt")}
                                       for rule in m},
                        "tokens_from_verify": sum(p for p, _ in r["per_prompt"]),
                        "verify_steps": sum(st for _, st in r["per_prompt"]),
                        "params": {"num_steps": e.num_draft_steps, "topk": 1},
                        "lossless": "by construction (the target's own samples; exact coupling: replay_sampled)"}
    return report


def replay_recordings(cfg, prompts: list[list[int]], outputs: list[list[int]], log=print) -> list[dict]:
    """replay_eval recordings {prompt, tokens, aux (float32 [n + M, 3H_t])}: the aux states of prompt + output
    extracted by the run's features backend (features.store_run, as the features stage extracts) into a store of
    the evaluate stage's own, eval/replay/ (its tokenized/train.parquet holds the sequences: what torchrun ranks
    read); a rerun with the same sequences, settings and target reads that store again, extracting nothing."""
    sub = cfg.model_copy(update={"run_dir": RunLayout(cfg.run_dir).eval / "replay",
                                 "features": cfg.features.model_copy(update={"import_from": None})})
    layout = RunLayout(sub.run_dir)
    seqs = [p + g for p, g in zip(prompts, outputs, strict=True)]
    settings = sub.features.model_dump(mode="json", include=set(REPLAY_FEATURE_FIELDS))
    key = stage_key("replay-recording", seqs, settings, target_key(sub))
    done = read_manifest(layout.features / "manifest.json")
    if not done or done.get("inputs_key") != key or bad_shards(layout.features, done.get("shards", [])):
        rows = [{"id": f"eval-{i}", "input_ids": s, "loss_mask": [0] * len(p) + [1] * len(g)}
                for i, (s, p, g) in enumerate(zip(seqs, prompts, outputs, strict=True))]
        layout.tokenized_train.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), layout.tokenized_train)
        write_manifest(layout.tokenized_train.parent / "manifest.json",
                       {"inputs_key": sha256_json(["replay-recording", seqs]), "rows": len(rows)})
        if selected_backend(sub).torchrun:
            store = launch(sub, key, None, log)
        else:
            try:
                store = extract_here(sub, key, log, rows=rows)
            finally:
                close_extractors()
        write_record(layout.features / "manifest.json", {**{k: v for k, v in store.items() if k != "how"},
                                                          "inputs_key": key})
    samples = load_samples(layout.features)
    return [{"prompt": p, "tokens": g, "aux": s["aux"].float()} for p, g, s in zip(prompts, outputs, samples,
                                                                                  strict=True)]


def run_evaluate(cfg: PipelineConfig, log=print, on_progress=None) -> dict:
    """Pre-flight check of the exported draft against the target, then offline tau on the held-out prompts: the
    trained draft as a chain and as an SGLang-style tree, an untrained draft as a chain; simulated vs measured tau
    (eval/report.json). Logs 'n of N' decoded prompts with an ETA after each; on_progress(done, total, run name)
    too. Raises PreflightError listing every mismatch between the draft and the target, ValueError for sampled
    settings with a sharded features backend."""
    up = upstream_manifest(cfg.run_dir, "train")
    return stage_run.run(stage_run.decision(cfg, ROW), lambda: _evaluate(cfg, up, log, on_progress), log=log)


@dataclass(frozen=True)
class _Held:
    """What the evaluate stage's measurements share: the train manifest `up`, the target's tokenizer, the held-out
    rows, their prompt ids (held_out_prompt_ids) and categories, the trained and untrained drafts, the ids the
    target stops on, and the target in this process (`runners`: loaded once, by target_runner)."""
    cfg: PipelineConfig
    up: dict
    tok: object
    rows: list
    prompts: list
    cats: list
    trained: object
    untrained: object
    eos: set
    log: Callable
    runners: list = field(default_factory=list)

    def subset(self, n: int | None) -> list[int] | None:
        """The first n held-out prompts (None: all)."""
        return None if n is None else list(range(min(n, len(self.prompts))))

    def drafts(self) -> dict:
        """{name: (draft, prompt indices)}: the trained draft on every prompt, the untrained on
        eval.untrained_prompts."""
        return {"trained": (self.trained, None),
                "untrained": (self.untrained, self.subset(self.cfg.eval.untrained_prompts))}

    def target_runner(self) -> TargetRunner:
        """The target in this process (a speculate.TargetRunner over the draft's aux ids), loaded once per stage
        however many measurements read it."""
        if not self.runners:
            self.runners.append(TargetRunner(load_target(self.cfg.target), self.trained.shape.aux_layer_ids))
        return self.runners[0]


def _evaluate(cfg: PipelineConfig, up: dict, log, on_progress) -> dict:
    """The evaluate stage's body (run_evaluate): the check of sampled settings, the pre-flight, then the evaluator
    the settings choose (sampled replay, replay, or decode)."""
    if not cfg.eval.sampling.greedy and must_replay(cfg.features.backend):
        raise ValueError(f"eval.sampling.temperature {cfg.eval.sampling.temperature} with features.backend "
                         f"{cfg.features.backend!r}: the sampled replay reads the target's probabilities of its "
                         f"own samples, which needs the target in one process (features.backend 'hf'); set "
                         f"eval.sampling.temperature 0 for this run")
    export_dir = RunLayout(cfg.run_dir).stored(up["export_dir"])
    preflight(export_dir, target_config(cfg))
    tok = load_tokenizer(cfg.target)
    rows = prompts_mod.read_rows(RunLayout(cfg.run_dir).prompts_eval)
    prompts = held_out_prompt_ids(cfg, tok, rows)
    trained = load_draft(export_dir)
    untrained, _ = fresh_draft(cfg)
    eos = set(stop_ids(tok, generation_eos_ids(cfg.target)))        # every id the target stops on
    held = _Held(cfg, up, tok, rows, prompts, [category(r) for r in rows], trained, untrained, eos, log)
    if not cfg.eval.sampling.greedy:
        return _evaluate_sampled(held)
    if resolved_evaluator(cfg.eval.evaluator, cfg.features.backend) == "replay":
        return _evaluate_replay(held)
    return _evaluate_decode(held, on_progress)


def _evaluate_sampled(held: _Held) -> dict:
    """eval.sampling at temperature > 0: both drafts replayed against the target's samples (_sampled), logged."""
    e = held.cfg.eval
    report = _sampled(held.cfg, held.target_runner(), held.prompts, held.drafts(), held.eos, held.log)
    result = _write_report(held, report)
    held.log("eval (sampled replay at temperature " + f"{e.sampling.temperature:g}): " + "; ".join(
        f"{name} tau " + ", ".join(f"{r['tau']:.2f} ({rule})" for rule, r in report[name]["rules"].items())
        for name in ("trained", "untrained")))
    return result


def _evaluate_replay(held: _Held) -> dict:
    """eval.evaluator 'replay' (greedy): both drafts replayed against the serving engine's outputs (_replay),
    logged with tau by segment."""
    report = _replay(held.cfg, held.tok, held.prompts, held.cats, held.drafts(), held.eos, held.log)
    result = _write_report(held, report)
    held.log(f"eval (replay): tau trained {report['trained']['tau']:.2f} (chain), untrained "
             f"{report['untrained']['tau']:.2f}; by segment " + ", ".join(
                 f"{k} {v['tau']:.2f}" for k, v in report["trained"]["breakdown"]["segment"].items()))
    return result


def _evaluate_decode(held: _Held, on_progress) -> dict:
    """eval.evaluator 'decode' (greedy): the trained draft as a chain and as a tree (eval.tree_topk > 1), the
    untrained as a chain, decoded with the target in this process (acceptance.measure); 'n of N' logged with an
    ETA after each prompt."""
    e, S, log = held.cfg.eval, held.cfg.eval.num_draft_steps, held.log
    runs = {"trained": SpecRun(held.trained, S)}
    if e.tree_topk > 1:
        runs["trained_tree"] = SpecRun(held.trained, S, e.tree_topk, e.tree_num_draft_tokens,
                                       held.subset(e.tree_prompts))
    runs["untrained"] = SpecRun(held.untrained, S, prompt_idx=held.subset(e.untrained_prompts))
    t_measure = time.monotonic()

    def progress(done: int, total: int, name: str) -> None:
        log(f"evaluate: {done} of {total} prompt decodes ({name})"
            + eta_text(time.monotonic() - t_measure, done, total - done))
        if on_progress is not None:
            on_progress(done, total, name)

    report = measure(held.target_runner(), runs, held.prompts, held.cats, e.max_new_tokens, held.eos, e.tie_gap,
                     on_prompt=progress)
    report["evaluator"] = "decode"
    result = _write_report(held, report)
    tree = report.get("trained_tree")
    log(f"eval: tau trained {report['trained']['tau']:.2f} (chain)"
        + (f", {tree['tau']:.2f} (tree k={e.tree_topk}, T={e.tree_num_draft_tokens})" if tree else "")
        + f", untrained {report['untrained']['tau']:.2f}; lossless {report['trained']['lossless']}; simulated "
        + f"tau {report['consistency']['tau_sim_at_steps']:.2f} over "
        + f"{report['consistency']['steps_compared']} steps")
    return result


def _write_report(held: _Held, report: dict) -> dict:
    """`report` (either evaluator's) completed with what both record, the trained draft's sampled replay at the
    declared serving settings where they differ (`at_serving`), written to eval/report.json; the stage's result."""
    cfg, e, S = held.cfg, held.cfg.eval, held.cfg.eval.num_draft_steps
    out = RunLayout(cfg.run_dir).eval
    if len(e.measured_samplings) > 1:
        s2 = e.measured_samplings[1]
        report["at_serving"] = {"sampling": s2.model_dump(mode="json"), **_sampled(
            cfg, held.target_runner(), held.prompts, {"trained": (held.trained, None)}, held.eos, held.log, s2)}
    report.update({"eval_ids": [r["id"] for r in held.rows], "num_draft_steps": S,
                   "max_new_tokens": e.max_new_tokens, "aux_layer_ids": held.trained.shape.aux_layer_ids,
                   "preflight": "passed",
                   "machine_load": machine_load(),            # the report flags speeds of a busy machine
                   "sampling": {**e.sampling.model_dump(mode="json"), "greedy": e.sampling.greedy,
                                "chat_template_kwargs": cfg.generation.chat_template_kwargs},
                   # the TTT simulation is greedy: no comparison with a sampled tau
                   "consistency": tau_consistency(report["trained"]["tau"], held.up, S) if e.sampling.greedy
                   else None})
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return {"report": RunLayout(cfg.run_dir).relative(out / "report.json"),     # relative to the run dir
            "summary": report, "sampling": report["sampling"],
            "serving": e.serving.model_dump(mode="json") if e.serving else None}


ROW = Stage("evaluate", evaluate_key, run_evaluate, upstream=("train", "prompts"), older=evaluate_older_keys,
            outputs=("report.json",), timeout_h=12, tags=("gpu",), progress=("on_progress", "prompt decodes"))
