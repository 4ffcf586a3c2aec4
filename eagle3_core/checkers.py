"""The checkers of `check.check_run`, each (facts, problems) of one part of a run: its prompt sources, the target's
layers and aux ids, the draft's geometry and context, the chat template's arguments, disk per token, the features
and evaluate backends, a draft directory, the server, the warm start and the free disk. Facts are JSON-able;
problems are (field, message) pairs naming the fix. Legend: L target decoder layers, H_t target hidden, V target
vocab, N draft vocab."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3_core.config import PipelineConfig
from eagle3_core.data.budget import budget_problems
from eagle3_core.data.prompt_set import source_specs
from eagle3_core.data.readers import missing_source_files
from eagle3_core.data.template_kwargs import kwarg_problem
from eagle3_core.data.text_probe import target_template, text_api_problems
from eagle3_core.evaluation.preflight import check_draft
from eagle3_core.features.backends import (
    BACKENDS,
    IMPORT,
    backend_name,
    loads_whole_target,
    memory_facts,
    resolved_evaluator,
)
from eagle3_core.features.store_formats import FORMATS, bytes_per_token, features_bytes
from eagle3_core.generation.servers import server_problems
from eagle3_core.pipeline.features_stage import mixed_backend_problems
from eagle3_core.target.family import (
    draft_aux_ids,
    engine_readings,
    family,
    num_layers,
    resolve_aux_ids,
    rope_type,
    sglang_rule,
    target_rope,
    text_config,
    value,
)
from eagle3_core.target.loading import load_target_config
from eagle3_core.target.memory import gpu_memory
from eagle3_core.training.draft_geometry import draft_geometry, draft_shape, geometry_problems
from eagle3_core.training.train_memory import row_fit
from eagle3_core.training.warm_start import init_from_check

EVALUATE_RUNS = {"decode": "HF transformers in process: the target verifies each draft step (speculate)",
                 "replay": "the target's greedy outputs on the held-out prompts, recorded once with their aux "
                           "states by the features backend; the draft replayed against them (replay_eval)"}
DETECT = "detect"                                  # check_run(gpus=DETECT): this host's GPUs
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
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        one = torch.cuda.get_device_properties(0).total_memory
        return one, f"one of {n} GPU(s), {one / 2**30:.0f} GiB"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total, f"no GPU; {total / 2**30:.0f} GiB RAM"


@dataclass(frozen=True)
class RunToCheck:
    """What the checkers read: check_run's arguments (config_given: a target_config was passed) and the target's
    transformers config tcfg, its text config t, L, H_t; the aux layer ids resolved (ids) with each engine's
    reading (aux_readings), both None where features.aux_layer_ids do not resolve (aux_error says why)."""
    cfg: PipelineConfig
    tcfg: object
    t: object
    L: int
    H_t: int
    ids: list[int] | None
    aux_readings: dict | None
    aux_error: str | None
    draft_dir: Path | None
    config_given: bool
    memory: tuple[int, str] | None
    gpus: object
    disk: object
    chat_template: object
    sglang_env: object


def run_to_check(cfg: PipelineConfig, draft_dir, target_config, memory, gpus, disk, chat_template,
                 sglang_env) -> RunToCheck:
    """check_run's arguments with the target's config read (target.loading.load_target_config where
    target_config is None, no weights) and the aux layer ids resolved."""
    tcfg = target_config if target_config is not None else load_target_config(cfg.target)
    t = text_config(tcfg)
    L = num_layers(tcfg)
    try:
        ids = resolve_aux_ids(cfg.features.aux_layer_ids, L)
        readings, aux_error = {"ours (layer outputs)": ids, **engine_readings(ids, sglang_rule(t))}, None
    except ValueError as e:
        ids, readings, aux_error = None, None, str(e)
    return RunToCheck(cfg, tcfg, t, L, value(t, "hidden_size"), ids, readings, aux_error, draft_dir,
                      target_config is not None, memory, gpus, disk, chat_template, sglang_env)


def sources_check(run: RunToCheck) -> tuple[dict, list[tuple[str, str]]]:
    """Prompt source files that do not exist (data.readers.missing_source_files)."""
    return {}, missing_source_files(source_specs(run.cfg.prompts))


def target_check(run: RunToCheck) -> tuple[dict, list[tuple[str, str]]]:
    """The target's config classes, family, layers and hidden size; its aux layer ids in our reading and each
    engine's (target.family.engine_readings), or why they do not resolve."""
    t = run.t
    facts = {"target": run.cfg.target.model, "config_class": type(run.tcfg).__name__,
             "text_config_class": type(t).__name__, "family": family(t), "layers": run.L, "hidden_size": run.H_t}
    if run.aux_readings is None:
        return facts, [("features.aux_layer_ids", run.aux_error)]
    facts["aux_layer_ids"] = run.aux_readings
    return facts, []


def geometry_check(run: RunToCheck) -> tuple[dict, list[tuple[str, str]]]:
    """The draft's geometry and rope against the target's (training.draft_geometry.geometry_problems), V and N,
    the context lengths (features.max_length at most the target's) and the token budget
    (data.budget.budget_problems)."""
    cfg, t, problems = run.cfg, run.t, []
    geom = draft_geometry(t, cfg.draft.geometry())
    problems += geometry_problems(geom, t)
    theta, scaling = target_rope(t)
    V = value(t, "vocab_size")
    facts = {"draft_geometry": geom,
             "rope": {"target": {"theta": theta, "type": rope_type(scaling), "scaling": scaling},
                      "draft": {"theta": geom["rope_theta"], "type": rope_type(geom["rope_scaling"])}},
             "vocab": {"V": V, "N": min(cfg.draft.draft_vocab_size, V)}}
    ctx = value(t, "max_position_embeddings")
    facts["context"] = {"target": ctx, "draft": geom["max_position_embeddings"],
                        "features.max_length": cfg.features.max_length}
    if ctx is not None and cfg.features.max_length > ctx:
        problems.append(("features.max_length", f"{cfg.features.max_length} exceeds the target's context {ctx}; "
                                                f"set it to {ctx} or less"))
    facts["token_budget"], budget = budget_problems(cfg, ctx)
    problems += budget
    return facts, problems


def chat_template_check(run: RunToCheck) -> tuple[dict, list[tuple[str, str]]]:
    """generation.chat_template_kwargs against what the chat template reads (data.template_kwargs), and whether a
    text API can train what the target writes (data.text_probe.text_api_problems). The template: check_run's
    chat_template; by default the target's tokenizer's where kwargs are set or a text API regenerates, none where a
    target_config was given."""
    cfg, chat_template, problems = run.cfg, run.chat_template, []
    kwargs = cfg.generation.chat_template_kwargs
    text_api = cfg.server.kind != "transformers" and cfg.generation.api_for(cfg.server.kind) == "openai"
    if chat_template is DETECT:
        chat_template = (None if run.config_given or not (kwargs or text_api)
                         else target_template(cfg.target))
    if text_api and chat_template is not None:
        problems += text_api_problems(chat_template, kwargs)
    facts = {"chat_template_kwargs": ({"kwargs": kwargs, "checked against": "the target's chat template"}
                                      if chat_template is not None else
                                      {"kwargs": kwargs, "checked against": "no chat template here: the prompts "
                                                                            "stage checks them"} if kwargs else "none")}
    if chat_template is not None:
        field = "generation.chat_template_kwargs"
        problems += [(field, str(p).removeprefix(field + ": ")) for k, v in kwargs.items()
                     if (p := kwarg_problem(chat_template, k, v)) is not None]
    return facts, problems


def disk_rate_check(run: RunToCheck) -> tuple[dict, list[tuple[str, str]]]:
    """Disk bytes per token of each feature format (features.store_formats.bytes_per_token), and GB per 1M tokens."""
    per_token = {f: bytes_per_token(f, run.H_t) for f in FORMATS}
    return {"disk_bytes_per_token": per_token,
            "disk_gb_per_1m_tokens": {f: round(b * 1e6 / 1e9, 2) for f, b in per_token.items()}}, []


def backends_check(run: RunToCheck) -> tuple[dict, list[tuple[str, str]]]:
    """The features backend (features_backend), the evaluate stage's evaluator and why, and whether the stages that
    load the whole target in this process (features 'hf', evaluate 'decode') fit `memory` (default:
    machine_memory_bytes)."""
    cfg, f = run.cfg, run.cfg.features
    need = 2 * estimate_params(run.t)                                      # bf16 weights
    have, where = run.memory if run.memory is not None else machine_memory_bytes()
    feats, problems, fit_problems = features_backend(run)
    evaluator = resolved_evaluator(cfg.eval.evaluator, f.backend)
    facts = {"backends": {"features": feats,
                          "evaluate": {"evaluator": evaluator, "runs": EVALUATE_RUNS[evaluator],
                                       "why": ("eval.evaluator " + repr(cfg.eval.evaluator) if cfg.eval.evaluator
                                               != "auto" else f"auto: features.backend {f.backend!r}" +
                                               (" is sharded" if evaluator == "replay" else " holds the whole "
                                                "target in one process"))},
                          "target_weights_gb_bf16_estimate": round(need / 1e9, 1), "machine": where}}
    problems += fit_problems
    whole = [name for name, loads in (("features (HFExtractor)", loads_whole_target(f.backend)),
                                      ("evaluate (decode)", evaluator == "decode")) if loads]
    if need > have and whole:
        hint = (f"; features: {feats['needs']}" if "needs" in feats and loads_whole_target(f.backend) else "")
        fix = ("; or set eval.evaluator 'replay' (the target's recorded greedy outputs, no whole target)"
               if evaluator == "decode" else "")
        problems.append(("target.model", f"~{need / 1e9:.0f} GB of bf16 weights (estimated from the config) do "
                         f"not fit this machine ({where}): the {' and '.join(whole)} stage(s) load the whole "
                         f"target in this process; run them on a host whose GPUs hold the target{hint}{fix}"))
    return facts, problems


def train_memory_check(run: RunToCheck) -> tuple[dict, list[tuple[str, str]]]:
    """Whether one packed row of train.batch_tokens tokens fits one training GPU (`gpus`, default this host's):
    training.train_memory.row_fit; not checked where the draft geometry fails (geometry_check names that)."""
    cfg = run.cfg
    try:
        shape = draft_shape(run.tcfg, cfg.draft.draft_vocab_size, run.ids or [], overrides=cfg.draft.geometry(),
                            capacity=cfg.draft.capacity())
    except ValueError:
        return {}, []
    fact, problems = row_fit(shape, cfg.train, gpu_memory() if run.gpus is DETECT else run.gpus)
    return {"train_memory": fact}, problems


def features_backend(run: RunToCheck) -> tuple[dict, list[tuple[str, str]], list[tuple[str, str]]]:
    """(facts, problems, fit problems) of the features backend, all read from its row (features.backends.BACKENDS):
    its bytes per GPU on `gpus` (default: this host's) and fit (its memory model: backends.memory_facts), what runs
    it (`runs`), expert parallelism (expert_parallel_check) and the environment its ranks run in (`python_check`:
    for 'sglang' the SGLang environment of sglang_python; run.sglang_env, where given, is that probe's answer)."""
    cfg, f, problems = run.cfg, run.cfg.features, []
    fit_cfg, ep_problems = expert_parallel_check(cfg, run.t)
    problems += ep_problems
    gpus = gpu_memory() if run.gpus is DETECT else run.gpus
    feats, fit_problems = memory_facts(fit_cfg, run.tcfg, gpus)
    if backend_name(cfg) in BACKENDS:
        feats["runs"] = BACKENDS[backend_name(cfg)].runs.format(w=f.tp_size)
    else:
        problems.append(("features.backend", f"{f.backend!r} is not a features backend; choose one of "
                                             f"{[n for n in BACKENDS if n != IMPORT]}"))
    if (row := BACKENDS.get(f.backend)) is not None and row.python_check is not None:
        env_facts, env_problems = row.python_check(cfg, gpus, None if run.sglang_env is DETECT else run.sglang_env)
        feats.update(env_facts)
        problems += env_problems
    return feats, problems, fit_problems


def draft_dir_check(run: RunToCheck) -> tuple[dict, list[tuple[str, str]]]:
    """With a draft directory (a warm start or a deployment): evaluation.preflight.check_draft against the target,
    and the draft's aux ids as engines read them against the run's."""
    if run.draft_dir is None:
        return {}, []
    draft_dir, problems = run.draft_dir, []
    problems += check_draft(Path(draft_dir), run.tcfg)
    dcfg = json.loads((Path(draft_dir) / "config.json").read_text()) if (Path(draft_dir) / "config.json").exists() \
        else {}
    draft_ids = draft_aux_ids(dcfg, sglang_rule(run.t), run.L) if dcfg else None   # layer outputs, as engines read it
    facts = {"draft": {"dir": str(draft_dir), "architectures": dcfg.get("architectures"), "aux_ids": draft_ids}}
    if run.ids is not None and draft_ids is not None and draft_ids != run.ids:
        problems.append(("features.aux_layer_ids", f"resolves to {run.ids} but the draft {draft_dir} was trained "
                         f"on {draft_ids}: a warm start must extract the same layers; set "
                         f"features.aux_layer_ids to {draft_ids}"))
    return facts, problems


def server_check(run: RunToCheck) -> tuple[dict, list[tuple[str, str]]]:
    """The generation server against the target (generation.servers.server_problems), and a feature store another
    backend began (pipeline.features_stage.mixed_backend_problems)."""
    problems = []
    problems += server_problems(run.cfg)
    problems += mixed_backend_problems(run.cfg)
    return {}, problems


def warm_start_check(run: RunToCheck) -> tuple[dict, list[tuple[str, str]]]:
    """train.init_from, where set: missing, or not fitting (training.warm_start.init_from_check)."""
    if run.cfg.train.init_from is None:
        return {}, []
    fact, problems = init_from_check(run.cfg, run.tcfg, run.ids)
    return {"init_from": fact}, problems


def disk_space_check(run: RunToCheck) -> tuple[dict, list[tuple[str, str]]]:
    """The features stage's disk against the free space (disk_check), where check_run's `disk` is not None."""
    if run.disk is None:
        return {}, []
    fact, problems = disk_check(run.cfg, run.H_t, run.disk)
    return {"disk": fact}, problems


# in the order they report
CHECKERS = (sources_check, target_check, geometry_check, chat_template_check, disk_rate_check, backends_check,
            train_memory_check, draft_dir_check, server_check, warm_start_check, disk_space_check)


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
