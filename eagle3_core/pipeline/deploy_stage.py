"""Stages `deploy-llama-cpp` and `deploy-sglang`: the exported draft served next to the target, benchmarked
against the same server without it (deploy_llama_cpp/, deploy_sglang/)."""
from __future__ import annotations

from pathlib import Path

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.compat import DEPLOY_SGLANG_FIELDS_V4, EVAL_FIELDS_V4, fields_v4
from eagle3_core.contract.layout import RunLayout
from eagle3_core.contract.numbers import machine_load
from eagle3_core.data import prompt_set as prompts_mod
from eagle3_core.data.chat import prompt_ids
from eagle3_core.evaluation.llama_cpp_deploy import (
    LLAMA_CPP_TIE_GAP,
    convert_draft,
    run_requests,
    run_sampled,
    summarize,
    summarize_sampled,
)
from eagle3_core.evaluation.preflight import preflight
from eagle3_core.evaluation.sglang_bench import SpecArgs, target_server_args
from eagle3_core.evaluation.speedup import speed_disagreement
from eagle3_core.pipeline import run as stage_run
from eagle3_core.pipeline.keys import stage_key, upstream_keys, upstream_manifest
from eagle3_core.pipeline.stage import Stage
from eagle3_core.serving.launcher import llama_server
from eagle3_core.target.loading import gguf_path, load_target_config, load_tokenizer, local_model_dir


def deploy_llama_cpp_key(cfg: PipelineConfig, up: dict | None = None) -> str:
    """Inputs key of the llama.cpp deployment stage: the trained draft and the held-out prompts (`up`: {'train',
    'prompts': their keys}; default: read from their manifests), and the draft steps and tokens per prompt it
    measures with (the server's address and the other eval settings do not change what it measures)."""
    up = upstream_keys(cfg, LLAMA_CPP_ROW) if up is None else up
    e = cfg.eval                        # the sampling settings count only where not greedy alone (keys before them)
    settings = e.measured_samplings
    sampled = ({} if [s.greedy for s in settings] == [True] else
               {"samplings": [s.model_dump(mode="json") for s in settings], "sampled_seeds": e.sampled_seeds})
    return stage_key(up["train"], {"num_draft_steps": e.num_draft_steps, "max_new_tokens": e.max_new_tokens,
                                   **sampled}, up["prompts"])


def deploy_llama_cpp_older_keys(cfg: PipelineConfig, up: dict | None = None) -> tuple[str, ...]:
    """The key a llama.cpp deployment finished before the keys hashed results only holds (every eval setting and
    server.host; none where it measures at a sampled setting: older runs measured greedily only).
    Remove when runs written before f66665b are no longer supported: that deployment then runs again
    (compat.LEGACY_READERS)."""
    if [s.greedy for s in cfg.eval.measured_samplings] != [True]:
        return ()
    up = upstream_keys(cfg, LLAMA_CPP_ROW) if up is None else up
    return (stage_key(up["train"], fields_v4(cfg.eval, EVAL_FIELDS_V4), cfg.server.host, up["prompts"]),)


def run_deploy_llama_cpp(cfg: PipelineConfig, log=print) -> dict:
    """Deploy the exported draft on llama.cpp (GGUF conversion, `--spec-type draft-eagle3`) and benchmark it
    against the same server without a draft on the held-out prompts (with their tools and
    generation.chat_template_kwargs), one stream, at each of eval.measured_samplings (greedy: one request per
    prompt, the lossless check against the baseline's tokens; sampled: eval.sampled_seeds requests per prompt with
    llama.cpp's own sampling fields, llama_cpp_deploy.sampling_fields) (deploy_llama_cpp/). The summary holds the
    first setting's numbers and `by_sampling`, one entry per setting. Skipped (manifest says why) when the target
    is not a GGUF file llama.cpp can serve."""
    out = RunLayout(cfg.run_dir).deploy_llama_cpp
    up = upstream_manifest(cfg.run_dir, "train")

    def body() -> dict:
        gguf = gguf_path(cfg.target)
        if gguf is None:
            log("deploy: target is not GGUF; llama.cpp deployment skipped (use the SGLang benchmark)")
            return {"skipped": "target is not GGUF"}
        draft_gguf = convert_draft(RunLayout(cfg.run_dir).stored(up["export_dir"]), Path(local_model_dir(cfg.target)),
                                   out / "draft.gguf")
        rows = prompts_mod.read_rows(RunLayout(cfg.run_dir).prompts_eval)
        S, n_new = cfg.eval.num_draft_steps, cfg.eval.max_new_tokens
        kwargs = cfg.generation.chat_template_kwargs or None     # the server renders each row with them, its tools
        common = dict(host=cfg.server.host, parallel=1, ctx_per_slot=cfg.server.ctx_per_slot * 2,
                      startup_timeout_s=cfg.server.startup_timeout_s)
        settings = cfg.eval.measured_samplings
        with llama_server(gguf, out / "baseline.log", **common) as url:
            base = [_llama_cpp_rows(url, rows, n_new, s, cfg.eval.sampled_seeds, log, "no draft", kwargs)
                    for s in settings]
        spec_args = ["-md", str(draft_gguf), "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(S),
                     "--spec-draft-n-min", str(S)]
        with llama_server(gguf, out / "eagle3.log", extra_args=spec_args, **common) as url:
            spec = [_llama_cpp_rows(url, rows, n_new, s, cfg.eval.sampled_seeds, log, "EAGLE-3 draft", kwargs)
                    for s in settings]
        by_sampling = [{"sampling": s.model_dump(mode="json"),
                        **(summarize(b, p, LLAMA_CPP_TIE_GAP) if s.greedy else summarize_sampled(b, p))}
                       for s, b, p in zip(settings, base, spec, strict=True)]
        summary = {**by_sampling[0], "by_sampling": by_sampling, "num_draft_steps": S, "max_new_tokens": n_new,
                   "tie_gap": LLAMA_CPP_TIE_GAP, "draft_gguf": str(draft_gguf),
                   "server_args": spec_args[2:],                                 # without the local -md path
                   "machine_load": machine_load()}                  # the report flags speeds of a busy machine
        summary["warnings"] = generation_speed_warnings(cfg, summary)
        for w in summary["warnings"]:
            log(f"deploy: warning: {w}")
        for b in by_sampling:
            log(f"deploy: llama.cpp at temperature {b['sampling']['temperature']:g}: tau {b['tau']:.2f}, "
                f"{b['tokens_per_s']:.1f} tok/s with the draft vs {b['baseline_tokens_per_s']:.1f} without "
                f"({b['speedup']:.2f}x); lossless {b['lossless']}")
        return {"summary": summary}

    return stage_run.run(stage_run.decision(cfg, LLAMA_CPP_ROW), body, log=log)


def _llama_cpp_rows(url: str, rows: list[dict], n_new: int, s, n_seeds: int, log, label: str,
                    kwargs: dict | None) -> list[dict]:
    """llama_cpp_deploy.run_requests greedy (`s` greedy), else run_sampled at `s` over seeds s.seed ..
    s.seed + n_seeds - 1."""
    if s.greedy:
        return run_requests(url, rows, n_new, log, label, kwargs)
    return run_sampled(url, rows, n_new, s, list(range(s.seed, s.seed + n_seeds)), log,
                       f"{label}, temperature {s.temperature:g}", kwargs)


def generation_speed_warnings(cfg: PipelineConfig, summary: dict) -> list[str]:
    """The llama.cpp benchmark's one-stream rates against what the same llama-server produced in the generation
    stage (evaluation.speedup.speed_disagreement); [] when generation ran on another server kind or generated
    nothing."""
    gen = upstream_manifest(cfg.run_dir, "generation")
    if cfg.server.kind != "llama.cpp" or not gen.get("completion_tokens") or not gen.get("seconds"):
        return []
    rate = gen["completion_tokens"] / gen["seconds"]
    found = [speed_disagreement(summary[k], rate, cfg.server.parallel, what)
             for k, what in (("baseline_tokens_per_s", "the baseline (no draft)"),
                             ("tokens_per_s", "the EAGLE-3 server"))]
    return [w for w in found if w]


def deploy_sglang_key(cfg: PipelineConfig, up: dict | None = None) -> str:
    """Inputs key of the SGLang deployment stage: the trained draft (`up`: {'train': its key}; default: read from
    its manifest), the target, the draft steps it serves with (deploy_sglang.num_steps, else eval.num_draft_steps)
    and the stage's own settings but the server start timeout; eval.sampling where it samples (greedy: the key
    before it existed)."""
    up = upstream_keys(cfg, SGLANG_ROW) if up is None else up
    d, s = cfg.deploy_sglang, cfg.eval.sampling
    return stage_key(up["train"], cfg.target, d.num_steps or cfg.eval.num_draft_steps,
                     d.model_dump(mode="json", exclude={"startup_timeout_s", "num_steps"}),
                     *([] if s.greedy else [s.model_dump(mode="json")]))


def deploy_sglang_older_keys(cfg: PipelineConfig, up: dict | None = None) -> tuple[str, ...]:
    """The key an SGLang deployment finished before the keys hashed results only holds (eval.num_draft_steps and
    every deploy_sglang setting; none at a sampled eval.sampling).
    Remove when runs written before f66665b are no longer supported: that deployment then runs again
    (compat.LEGACY_READERS)."""
    if not cfg.eval.sampling.greedy:
        return ()
    up = upstream_keys(cfg, SGLANG_ROW) if up is None else up
    return (stage_key(up["train"], cfg.target, cfg.eval.num_draft_steps,
                      fields_v4(cfg.deploy_sglang, DEPLOY_SGLANG_FIELDS_V4)),)


def deploy_sglang_skip(cfg: PipelineConfig) -> str | None:
    """Why the SGLang deployment stage does not run here (None: it runs). 'auto' skips GGUF targets (llama.cpp
    serves those), and a machine without SGLang unless both servers are given by URL; 'on' raises RuntimeError
    where 'auto' would skip for a missing SGLang; 'off' always skips."""
    from eagle3_core.evaluation.sglang_deploy import sglang_installed  # slow import (~0.5 s), deploy-sglang only
    d = cfg.deploy_sglang
    if d.enabled == "off":
        return "deploy_sglang.enabled is 'off'"
    if d.enabled == "auto" and gguf_path(cfg.target) is not None:
        return "the target is a GGUF file: the llama.cpp deployment stage serves it (SGLang serves HF checkpoints)"
    if not (d.baseline_url and d.eagle3_url) and not sglang_installed(cfg.sglang_python):
        why = ("SGLang is not installed here (it needs CUDA: on a GPU host `pip install -e '.[sglang]'`), and "
               "deploy_sglang.baseline_url / eagle3_url do not name running servers")
        if d.enabled == "on":
            raise RuntimeError(f"deploy-sglang: {why}; install SGLang or give both URLs (deploy_sglang.enabled "
                               f"is 'on')")
        return why
    return None


def deploy_sglang_prompts(cfg: PipelineConfig, tok, rows: list[dict]) -> list[dict]:
    """The SGLang benchmark's rows ({id, category, messages}) with `input_ids`: rendered by the target's chat template
    with generation.chat_template_kwargs (the thinking mode the draft was trained in) and the generation prompt, as
    /generate takes them (it applies no template)."""
    kwargs = cfg.generation.chat_template_kwargs or None
    return [{**r, "input_ids": prompt_ids(tok, r["messages"], None, kwargs)} for r in rows]


def run_deploy_sglang(cfg: PipelineConfig, log=print) -> dict:
    """Phase 6 on SGLang (deploy_sglang/): pre-flight of the exported draft against the target, then the same
    Spec-Bench and HumanEval prompts (deploy_sglang_prompts) through /generate on the baseline and the EAGLE3
    server at each concurrency: output tok/s, tau = sum(completion_tokens) / sum(spec_verify_ct), speed-up and
    break-even tau per level (evaluation.sglang_deploy.run_benchmark). Skipped where deploy_sglang_skip says why:
    a skip the config decides (GGUF target, 'off') writes a manifest saying so; one this machine decides (no
    SGLang) writes none, so that a later run on a GPU host does the work, and returns {'skipped': reason}."""
    out = RunLayout(cfg.run_dir).deploy_sglang
    d = stage_run.decision(cfg, SGLANG_ROW)
    if d.manifest is not None:
        return d.manifest
    if (why := deploy_sglang_skip(cfg)) is not None:
        log(f"deploy-sglang: skipped: {why}")
        if cfg.deploy_sglang.enabled == "off" or gguf_path(cfg.target) is not None:   # the config decides: done
            return stage_run.run(d, lambda: {"skipped": why, "seconds": 0.0}, outputs=())
        return {"skipped": why}                                   # this machine decides: a GPU host will run it

    def body() -> dict:
        from eagle3_core.evaluation.sglang_deploy import (  # slow import (~0.5 s), deploy-sglang only
            DEFAULT_SPEC_BENCH,
            benchmark_prompts,
            run_benchmark,
        )
        d, up = cfg.deploy_sglang, upstream_manifest(cfg.run_dir, "train")
        steps = d.num_steps or cfg.eval.num_draft_steps
        export = RunLayout(cfg.run_dir).stored(up["export_dir"])
        spec = SpecArgs(str(export), steps, d.topk, d.num_draft_tokens or steps + 1)
        preflight(export, load_target_config(cfg.target))
        tok = load_tokenizer(cfg.target)
        prompts = deploy_sglang_prompts(cfg, tok, benchmark_prompts(DEFAULT_SPEC_BENCH, True, d.per_category))
        server_args = target_server_args(d.tp_size, d.ep_size, cfg.target.trust_remote_code, cfg.target.revision,
                                         d.extra_args)
        log(f"deploy-sglang: {len(prompts)} prompts at concurrency {d.concurrency} on the baseline and the EAGLE3 "
            f"server ({'running at ' + d.eagle3_url if d.eagle3_url else 'started here'}; {' '.join(server_args)})")
        result = run_benchmark(cfg.target.model, spec, prompts, d.concurrency, out, d.max_new_tokens,
                               d.max_running_requests, d.cuda_graph_max_bs, server_args,
                               {"baseline": d.baseline_url, "eagle3": d.eagle3_url}, host=cfg.server.host,
                               startup_timeout_s=d.startup_timeout_s, python=cfg.sglang_python,
                               sampling=cfg.eval.sampling)
        v = result["verdict"]
        log(f"deploy-sglang: tau {v['tau'] if v['tau'] is None else round(v['tau'], 2)}; {v['summary']}")
        for w in v["warnings"]:
            log(f"deploy-sglang: WARNING {w}")
        return {"verdict": v, "prompts": len(prompts),
                "report": RunLayout(cfg.run_dir).relative(out / "sglang_bench.md")}     # relative to the run dir

    return stage_run.run(d, body, log=log)


LLAMA_CPP_ROW = Stage("deploy-llama-cpp", deploy_llama_cpp_key, run_deploy_llama_cpp, upstream=("train", "prompts"),
                      older=deploy_llama_cpp_older_keys, outputs=("draft.gguf",),
                      summary=("tokens_per_s", "baseline_tokens_per_s", "speedup"), timeout_h=12, tags=("server",))
SGLANG_ROW = Stage("deploy-sglang", deploy_sglang_key, run_deploy_sglang, upstream=("train",),
                   older=deploy_sglang_older_keys, outputs=("sglang_bench.md",), summary=("skipped",), timeout_h=24,
                   tags=("server",), in_report=False)
