"""`python -m eagle3_core.check CONFIG [--draft DIR]`: everything about a run that can be known from its config and
the target's config files (no weights), checked before anything expensive runs; the first step of every flow run.

Legend: L target decoder layers, H_t target hidden, V target vocab, N draft vocab.

It prints the resolved target family, the aux layer ids in each engine's reading (target_family.engine_readings), the
draft geometry and rope, vocab sizes, context lengths, disk per feature format and the backend of the features and
evaluate stages (which path, and why), and refuses, naming the field and the fix, what would fail later: unsorted,
repeated or out-of-range aux ids (L-1 included), a rope the draft cannot run, draft positions below the target's
context, a target too large for a stage that loads it whole in this process (features 'hf', evaluate 'decode'), a
features backend and size whose bytes per GPU (target/memory.py: the checkpoint's bytes as stored, its
quantization_config read, and transformers' own plans on a meta-device model) do not fit one GPU, or that split
attention heads or routed experts unevenly, expert parallelism on a target without experts, a server kind that
cannot serve the target (generation.servers.server_problems), a train.init_from that is missing or does not fit
(training.warm_start.init_from_check), less free disk on run_dir's file system than the features stage writes
(disk_check; in check_or_raise and the CLI), a token budget prompt-mode rows cannot fit (generation.max_new_tokens
against features.max_length, the regenerating server's context against both: data.budget.budget_problems),
generation.chat_template_kwargs the target's chat template does not read or reads as another type
(data.template_kwargs; offline with `--chat-template FILE`); with `--draft DIR` (a warm start or a deployment)
also the draft's architecture (EAGLE-2 refused), fc, d2t/t2d and ids (preflight.check_draft); aux ids SGLang
cannot serve (target.family.sglang_ids), 'ep_int4' on experts quantized otherwise (memory.ep_int4_scheme_problems),
a feature store another backend began (features_stage.mixed_backend_problems).
CONFIG: a JSON file holding a PipelineConfig, or a preset name. `--gpus 8x141GB`: the node's GPUs, not this host's.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eagle3_core.config import PipelineConfig, config_or_preset
from eagle3_core.config.eval_config import resolved_evaluator
from eagle3_core.data.budget import budget_problems
from eagle3_core.data.prompt_set import source_specs
from eagle3_core.data.readers import missing_source_files
from eagle3_core.data.template_kwargs import chat_template_file, kwarg_problem
from eagle3_core.data.text_probe import target_template, text_api_problems
from eagle3_core.features.backends import BACKENDS, backend_name
from eagle3_core.features.sglang_env import probe_sglang, sglang_env_problems
from eagle3_core.features.store_formats import FORMATS, bytes_per_token, features_bytes
from eagle3_core.target.family import (
    engine_readings,
    family,
    num_layers,
    draft_aux_ids,
    resolve_aux_ids,
    rope_type,
    sglang_rule,
    target_rope,
    text_config,
    value,
)
from eagle3_core.target.loading import target_config_file
from eagle3_core.training.draft_geometry import draft_geometry, geometry_problems

EVALUATE_RUNS = {"decode": "HF transformers in process: the target verifies each draft step (speculate)",
                 "replay": "the target's greedy outputs on the held-out prompts, recorded once with their aux "
                           "states by the features backend; the draft replayed against them (replay_eval)"}
DETECT = "detect"                                  # check_run(gpus=DETECT): this host's GPUs
class CheckError(ValueError):
    """The run would fail later; `problems` lists (field, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("check refused the run:\n" + "\n".join(f"- {f}: {m}" for f, m in problems))

    def __repr__(self) -> str:            # Prefect logs a failure as its repr: keep the lines readable
        return f"CheckError: {self}"

    # the refusal names the config's fault and its fix: a traceback would point at this code, not at the fault
    traceback_helps = False


def estimate_params(t) -> int:
    """Rough parameter count of a (text) config from its dimensions: embeddings, attention, dense and expert MLPs.
    An estimate for the fit check (routers, norms and MLA's low-rank factors are left out or approximated)."""
    H, L, V = value(t, "hidden_size"), value(t, "num_hidden_layers"), value(t, "vocab_size")
    nh = value(t, "num_attention_heads")
    hd = value(t, "v_head_dim") or value(t, "head_dim") or H // nh
    nkv = value(t, "num_key_value_heads") or nh
    attn = H * nh * hd * 2 + H * nkv * hd * 2                            # q, o + k, v (MLA: about its size)
    dense = 3 * H * value(t, "intermediate_size", 0)
    experts = value(t, "n_routed_experts") or value(t, "num_local_experts") or value(t, "num_experts") or 0
    moe_i = value(t, "moe_intermediate_size") or value(t, "intermediate_size", 0)
    moe = 3 * H * moe_i * (experts + (value(t, "n_shared_experts") or 0))
    n_dense = value(t, "first_k_dense_replace", 0) if experts else L
    tied = value(t, "tie_word_embeddings", False)
    return V * H * (1 if tied else 2) + L * attn + n_dense * dense + (L - n_dense) * moe


def machine_memory_bytes() -> tuple[int, str]:
    """(bytes, description) the in-process stages can hold the target in: one GPU's memory (load_target puts the
    whole target on `cuda`, i.e. cuda:0), or the system RAM when there is no GPU."""
    import os

    import torch
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        one = torch.cuda.get_device_properties(0).total_memory
        return one, f"one of {n} GPU(s), {one / 2**30:.0f} GiB"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total, f"no GPU; {total / 2**30:.0f} GiB RAM"


def check_run(cfg: PipelineConfig, draft_dir: Path | None = None, target_config=None,
              memory: tuple[int, str] | None = None, gpus=DETECT, disk=None, chat_template=DETECT,
              sglang_env=DETECT) -> tuple[dict, list[tuple[str, str]]]:
    """(facts, problems) of a run. target_config: the target's transformers config (default: read with
    target.loading.load_target_config, no weights); memory: (bytes, description) for the in-process fit check (default:
    machine_memory_bytes()); gpus: (count, bytes per GPU) for the features backend's per-GPU check
    (target.memory.backend_facts; default: this host's, None: no GPU); disk: None (not checked), DETECT (run_dir's
    file system) or (free bytes, description) for disk_check; chat_template: the target's chat template (text)
    that generation.chat_template_kwargs are checked against (data.template_kwargs; default: the target's
    tokenizer's where the target's config is read from it, not checked where `target_config` is given; None: not
    checked); sglang_env: probe_sglang's answer for sglang_python (default: probed here, with backend 'sglang'
    only). Also checks the generation server against the target (server_problems) and train.init_from
    (init_from_check). Facts are JSON-able; problems are (field, message) pairs, empty when the run fits."""
    from eagle3_core.evaluation.preflight import check_draft
    from eagle3_core.pipeline.features_stage import mixed_backend_problems
    from eagle3_core.generation.servers import server_problems
    from eagle3_core.target.loading import load_target_config
    from eagle3_core.target.memory import backend_facts, gpu_memory
    tcfg = target_config if target_config is not None else load_target_config(cfg.target)
    t = text_config(tcfg)
    problems: list[tuple[str, str]] = missing_source_files(source_specs(cfg.prompts))
    L, H_t, V = num_layers(tcfg), value(t, "hidden_size"), value(t, "vocab_size")
    facts: dict = {"target": cfg.target.model, "config_class": type(tcfg).__name__,
                   "text_config_class": type(t).__name__, "family": family(t), "layers": L, "hidden_size": H_t}
    try:
        ids = resolve_aux_ids(cfg.features.aux_layer_ids, L)
        facts["aux_layer_ids"] = {"ours (layer outputs)": ids, **engine_readings(ids, sglang_rule(t))}
    except ValueError as e:
        ids = None
        problems.append(("features.aux_layer_ids", str(e)))
    geom = draft_geometry(t, cfg.draft.geometry())
    problems += geometry_problems(geom, t)
    theta, scaling = target_rope(t)
    facts["draft_geometry"] = geom
    facts["rope"] = {"target": {"theta": theta, "type": rope_type(scaling), "scaling": scaling},
                     "draft": {"theta": geom["rope_theta"], "type": rope_type(geom["rope_scaling"])}}
    facts["vocab"] = {"V": V, "N": min(cfg.draft.draft_vocab_size, V)}
    ctx = value(t, "max_position_embeddings")
    facts["context"] = {"target": ctx, "draft": geom["max_position_embeddings"],
                        "features.max_length": cfg.features.max_length}
    if ctx is not None and cfg.features.max_length > ctx:
        problems.append(("features.max_length", f"{cfg.features.max_length} exceeds the target's context {ctx}; "
                                                f"set it to {ctx} or less"))
    facts["token_budget"], budget = budget_problems(cfg, ctx)
    problems += budget
    kwargs = cfg.generation.chat_template_kwargs
    text_api = cfg.server.kind != "transformers" and cfg.generation.api_for(cfg.server.kind) == "openai"
    if chat_template is DETECT:
        chat_template = (None if target_config is not None or not (kwargs or text_api)
                         else target_template(cfg.target))
    if text_api and chat_template is not None:
        problems += text_api_problems(chat_template, kwargs)
    facts["chat_template_kwargs"] = ({"kwargs": kwargs, "checked against": "the target's chat template"}
                                     if chat_template is not None else
                                     {"kwargs": kwargs, "checked against": "no chat template here: the prompts "
                                                                           "stage checks them"} if kwargs else "none")
    if chat_template is not None:
        field = "generation.chat_template_kwargs"
        problems += [(field, str(p).removeprefix(field + ": ")) for k, v in kwargs.items()
                     if (p := kwarg_problem(chat_template, k, v)) is not None]
    facts["disk_bytes_per_token"] = {f: bytes_per_token(f, H_t) for f in FORMATS}
    facts["disk_gb_per_1m_tokens"] = {f: round(b * 1e6 / 1e9, 2) for f, b in facts["disk_bytes_per_token"].items()}
    need = 2 * estimate_params(t)                                          # bf16 weights
    have, where = memory if memory is not None else machine_memory_bytes()
    fit_cfg, ep_problems = expert_parallel_check(cfg, t)
    problems += ep_problems
    gpus = gpu_memory() if gpus is DETECT else gpus
    feats, fit_problems = backend_facts(fit_cfg, tcfg, gpus)
    f = cfg.features
    if backend_name(cfg) in BACKENDS:
        feats["runs"] = BACKENDS[backend_name(cfg)].runs.format(w=f.tp_size)
    else:
        problems.append(("features.backend", f"{f.backend!r} is not a features backend; choose one of "
                                             f"{[n for n in BACKENDS if n != 'specforge_import']}"))
    if f.backend == "sglang":
        env = probe_sglang(cfg.sglang_python) if sglang_env is DETECT else sglang_env
        feats["sglang_env"] = env if gpus or env["version"] else {**env, "note": "not refused here: no GPU on this "
                                                                  "host, which is not where the stage runs"}
        problems += sglang_env_problems(env, bool(gpus))
    evaluator = resolved_evaluator(cfg.eval.evaluator, f.backend)
    facts["backends"] = {"features": feats,
                         "evaluate": {"evaluator": evaluator, "runs": EVALUATE_RUNS[evaluator],
                                      "why": ("eval.evaluator " + repr(cfg.eval.evaluator) if cfg.eval.evaluator
                                              != "auto" else f"auto: features.backend {f.backend!r}" +
                                              (" is sharded" if evaluator == "replay" else " holds the whole "
                                               "target in one process"))},
                         "target_weights_gb_bf16_estimate": round(need / 1e9, 1), "machine": where}
    problems += fit_problems
    whole = [name for name, loads in (("features (HFExtractor)", f.backend == "hf"),
                                      ("evaluate (decode)", evaluator == "decode")) if loads]
    if need > have and whole:
        hint = (f"; features: {feats['needs']}" if "needs" in feats and f.backend == "hf" else "")
        fix = ("; or set eval.evaluator 'replay' (the target's recorded greedy outputs, no whole target)"
               if evaluator == "decode" else "")
        problems.append(("target.model", f"~{need / 1e9:.0f} GB of bf16 weights (estimated from the config) do "
                         f"not fit this machine ({where}): the {' and '.join(whole)} stage(s) load the whole "
                         f"target in this process; run them on a host whose GPUs hold the target{hint}{fix}"))
    if draft_dir is not None:
        problems += check_draft(Path(draft_dir), tcfg)
        import json
        dcfg = json.loads((Path(draft_dir) / "config.json").read_text()) if (Path(draft_dir) / "config.json").exists() \
            else {}
        draft_ids = draft_aux_ids(dcfg, sglang_rule(t), L) if dcfg else None   # layer outputs, as engines read it
        facts["draft"] = {"dir": str(draft_dir), "architectures": dcfg.get("architectures"), "aux_ids": draft_ids}
        if ids is not None and draft_ids is not None and draft_ids != ids:
            problems.append(("features.aux_layer_ids", f"resolves to {ids} but the draft {draft_dir} was trained "
                             f"on {draft_ids}: a warm start must extract the same layers; set "
                             f"features.aux_layer_ids to {draft_ids}"))
    problems += server_problems(cfg)
    problems += mixed_backend_problems(cfg)
    if cfg.train.init_from is not None:
        from eagle3_core.training.warm_start import init_from_check
        facts["init_from"], more = init_from_check(cfg, tcfg, ids)
        problems += more
    if disk is not None:
        facts["disk"], more = disk_check(cfg, H_t, disk)
        problems += more
    return facts, problems


def expert_parallel_check(cfg: PipelineConfig, t) -> tuple[PipelineConfig, list[tuple[str, str]]]:
    """(the config the fit check counts with, problems): features.expert_parallel on a target without routed
    experts (its text config `t` names none) is refused naming the field, and counted as tensor parallel
    (transformers' plans would raise 'has no ep_plan')."""
    f = cfg.features
    experts = value(t, "n_routed_experts") or value(t, "num_local_experts") or value(t, "num_experts") or 0
    if not f.expert_parallel or experts:
        return cfg, []
    plain = cfg.model_copy(update={"features": f.model_copy(update={"expert_parallel": False})})
    return plain, [("features.expert_parallel", f"the target ({type(t).__name__}) has no routed experts: "
                    f"expert parallelism has nothing to split; set features.expert_parallel to false (hf_tp then "
                    f"splits its layers by tensor parallelism)")]


def disk_check(cfg: PipelineConfig, H_t: int, disk) -> tuple[dict, list[tuple[str, str]]]:
    """(facts, problems): the features stage's disk (plan's figure: num_train x tokens per sample x the format's
    bytes per token, feature_formats.bytes_per_token) against the free space of run_dir's file system, less what
    features/ already holds. Tokens per sample: the tokenize stage's mean where it ran, else the prompts' mean
    prompt plus generation.max_new_tokens, else features.max_length (at most); at most max_length. disk: DETECT
    (shutil.disk_usage of run_dir, or the nearest folder above it that exists) or (free bytes, description)."""
    import json
    import shutil
    run, f = Path(cfg.run_dir), cfg.features
    tok = run / "tokenized" / "manifest.json"
    prm = run / "prompts" / "manifest.json"
    T, source = f.max_length, "features.max_length (a sample stores at most that many tokens)"
    if tok.exists() and (m := json.loads(tok.read_text())).get("samples"):
        T, source = min(T, round(m["tokens"] / m["samples"])), "the tokenize stage's mean"
    elif prm.exists() and (b := json.loads(prm.read_text()).get("budget")):
        means = [(st["tokens"]["mean"], st["tokens"]["rows"]) for st in b.get("per_source", {}).values()
                 if st.get("tokens", {}).get("rows")]
        if means:
            mean = sum(m * n for m, n in means) / sum(n for _, n in means)
            T = min(T, round(mean + cfg.generation.max_new_tokens))
            source = "the prompts' mean prompt + generation.max_new_tokens"
    need = features_bytes(f.format, cfg.prompts.num_train, T, H_t)
    held = sum(p.stat().st_size for p in (run / "features").glob("shard_*.safetensors"))
    if disk is DETECT:
        where = next(p for p in [run, *run.absolute().parents] if p.exists())
        disk = (shutil.disk_usage(where).free, str(where))
    free, where = disk
    facts = {"features_gb": round(need / 1e9, 2), "tokens_per_sample": T, "from": source,
             "already_written_gb": round(held / 1e9, 2), "free_gb": round(free / 1e9, 2), "where": where}
    if need - held > free:
        fit = [(g, features_bytes(g, cfg.prompts.num_train, T, H_t)) for g in FORMATS if g not in (f.format, "fp32")]
        fit = ", ".join(f"{g!r} ({b / 1e9:.1f} GB)" for g, b in fit if b <= free) or "none"
        return facts, [("run_dir", f"the features stage stores ~{need / 1e9:.1f} GB (prompts.num_train "
                        f"{cfg.prompts.num_train} x {T} tokens, {source}, x {bytes_per_token(f.format, H_t)} B/token "
                        f"in features.format {f.format!r}; {held / 1e9:.1f} GB written) and {where} has "
                        f"{free / 1e9:.1f} GB free; the features.format values that fit: {fit}. Free space, put "
                        f"run_dir on a larger file system, set one of those formats ('online' stores nothing but "
                        f"runs the target every epoch: python -m eagle3_core.plan CONFIG --disk SIZE prints each "
                        f"one's hours), or lower features.max_length or prompts.num_train")]
    return facts, []


def render(facts: dict) -> str:
    """The facts as indented text lines."""
    lines = []

    def walk(d: dict, depth: int) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                lines.append("  " * depth + f"{k}:")
                walk(v, depth + 1)
            else:
                lines.append("  " * depth + f"{k}: {v}")
    walk(facts, 0)
    return "\n".join(lines)


def check_or_raise(cfg: PipelineConfig, draft_dir: Path | None = None, log=print, facts_on_refusal: bool = True,
                   **kw) -> dict:
    """check_run (with the disk of run_dir's file system unless `disk` says otherwise), logging the facts; raises
    CheckError listing every problem with its fix (after logging the facts only if `facts_on_refusal`: a flow
    run's log then opens with the cause). Returns the facts."""
    facts, problems = check_run(cfg, draft_dir, **{"disk": DETECT, **kw})
    if problems and not facts_on_refusal:
        raise CheckError(problems)
    log("check:\n" + render(facts))
    if problems:
        raise CheckError(problems)
    return facts


def parse_gpus(text: str) -> tuple[int, int] | None:
    """`--gpus`: 'NxSIZE' (8x141GB, 8x80GiB; a bare SIZE is GB) -> (N GPUs, bytes per GPU), 'none' -> None. Raises
    ValueError naming the flag and the form."""
    import re
    m = re.fullmatch(r"\s*(\d+)\s*[x*]\s*(\d+(?:\.\d+)?)\s*(GB|G|GiB|)\s*", text, re.IGNORECASE)
    if text.strip().lower() != "none" and (not m or int(m[1]) < 1):
        raise ValueError(f"--gpus {text!r}: give the node's GPUs as NxSIZE, e.g. 8x141GB (8 H200s) or 8x80GiB, "
                         f"or 'none'")
    return (int(m[1]), int(float(m[2]) * (2**30 if m[3].lower() == "gib" else 10**9))) if m else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Check a run's config against its target (no weights read).")
    p.add_argument("config", help="JSON file with a PipelineConfig, or a preset name (demo, debug_tiny)")
    p.add_argument("--draft", default=None, help="a draft directory to check too (warm start or deployment)")
    p.add_argument("--target-config", default=None, metavar="CONFIG_JSON",
                   help="the target's config.json, read instead of target.model's: check a run offline with only "
                        "that file downloaded (the free disk of run_dir is then not checked)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="the target's chat template (a .jinja file, or a tokenizer_config.json holding "
                        "'chat_template'): generation.chat_template_kwargs are checked against it offline")
    p.add_argument("--gpus", default=None, metavar="NxSIZE",
                   help="the GPUs of the node the run will use (e.g. 8x141GB), instead of this host's: the "
                        "features backend's and the in-process stages' fit are checked against them")
    a = p.parse_args(argv)
    try:
        cfg = config_or_preset(a.config)
        # --target-config: a check made away from the run's host (offline), whose disk says nothing about it
        kw = {"target_config": target_config_file(a.target_config), "disk": None} if a.target_config else {}
        if a.chat_template:
            kw["chat_template"] = chat_template_file(a.chat_template)
        if a.gpus is not None:
            kw["gpus"] = parse_gpus(a.gpus)
            if kw["gpus"]:                        # the in-process stages hold the target on one of them
                kw["memory"] = (kw["gpus"][1], f"one of {kw['gpus'][0]} GPU(s) of {kw['gpus'][1] / 1e9:.0f} GB "
                                               f"(--gpus)")
        check_or_raise(cfg, a.draft, **kw)
    except ValueError as e:                       # CheckError, or a config that does not validate
        print(str(e), file=sys.stderr)
        return 1
    except OSError as e:                          # the target's config is neither local nor reachable
        print(f"check: cannot read the config of target {cfg.target.model!r}: {str(e).splitlines()[0]}\n"
              f"Offline, download only its config.json (`hf download {cfg.target.model} config.json`) and pass "
              f"--target-config PATH", file=sys.stderr)
        return 2
    print("check: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
