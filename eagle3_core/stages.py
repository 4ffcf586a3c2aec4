"""The pipeline stages as plain functions: each reads its inputs under the run directory, writes its outputs and
finishes by writing a manifest atomically (DESIGN.md 'data contracts'). A stage whose manifest was written for the
same inputs key is not recomputed. Prefect tasks wrap these one to one; they work without Prefect too.

Run layout: prompts/ generations/ tokenized/ features/ vocab/ draft/ eval/, each with manifest.json.
"""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import contextmanager, nullcontext
from functools import lru_cache
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from jinja2 import TemplateError
from safetensors.torch import load_file, save_file

from . import prompts as prompts_mod
from .checkpoint import EXPORT_DTYPE, clear_training_state, export_draft, load_draft
from .config import PipelineConfig
from .data import prompt_ids
from .manifest import busy_seconds, cached_manifest, read_manifest, sha256_file, sha256_json, write_manifest

CODE_VERSION = "4"  # bump when a stage's output format or semantics change


def _key(*parts) -> str:
    return sha256_json([CODE_VERSION, *[p.model_dump(mode="json") if hasattr(p, "model_dump") else p
                                        for p in parts]])


def _upstream(run_dir: Path, stage: str) -> dict:
    path = run_dir / stage / "manifest.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: run the {stage} stage first")
    return json.loads(path.read_text())


def _target_key(cfg: PipelineConfig) -> dict:
    from .target import gguf_path
    gguf = gguf_path(cfg.target)
    return {"target": cfg.target.model_dump(), "gguf_sha256": _sha256_unchanged_file(gguf) if gguf else None}


@lru_cache(maxsize=16)
def _sha256_cached(path: Path, size: int, mtime_ns: int) -> str:
    return sha256_file(path)


def _sha256_unchanged_file(path: Path) -> str:
    """sha256 of a large file that rarely changes (the target), hashed again only when its size or mtime does."""
    st = path.stat()
    return _sha256_cached(path, st.st_size, st.st_mtime_ns)


def prompts_key(cfg: PipelineConfig) -> str:
    """Inputs key of the prompts stage: the prompt settings, what makes each source's rows what they are
    (prompts.source_fingerprints: local files' sha256, Hugging Face data sets' name/split/revision) and what the
    token budget depends on (the target's template, max_length, max_new_tokens, chat-template arguments)."""
    g = cfg.generation
    return _key(cfg.prompts, prompts_mod.source_fingerprints(cfg.prompts), _target_key(cfg),
                {"max_length": cfg.features.max_length, "max_new_tokens": g.max_new_tokens,
                 "chat_template_kwargs": g.chat_template_kwargs})


def run_prompts(cfg: PipelineConfig, log=print) -> dict:
    """Read, normalize, reject, dedupe, sample and split the prompt sources into prompts/{train,eval}.parquet;
    bad rows go to prompts/rejects.jsonl with source, row and reason. Every train row is then measured with the
    target's chat template and the token budget applied (prompts.over_budget; eagle3_core.budget): the length
    distribution and the policy's counts per source are logged and kept in the manifest (`budget`)."""
    from .budget import apply_budget, budget_line
    from .target import load_tokenizer
    out = cfg.run_dir / "prompts"
    key = prompts_key(cfg)
    if (m := cached_manifest(out / "manifest.json", key)):
        return m
    t0 = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    train, evals, stats = prompts_mod.build_prompts(cfg.prompts, rejects_path=out / "rejects.jsonl")
    train, budget = apply_budget(load_tokenizer(cfg.target), train, cfg.generation.max_new_tokens,
                                 cfg.features.max_length, cfg.prompts.over_budget,
                                 cfg.generation.chat_template_kwargs or None, str(out / "train.parquet"))
    log(budget_line(budget))
    if not train:
        raise ValueError(f"prompts: every train row is over the token budget (prompt + generation.max_new_tokens "
                         f"{cfg.generation.max_new_tokens} > features.max_length {cfg.features.max_length}) and "
                         f"prompts.over_budget is {cfg.prompts.over_budget!r}: raise max_length, lower "
                         f"max_new_tokens or choose 'last_turns' / 'long'")
    stats["train"] = len(train)
    for st in stats["per_source"].values():
        st.pop("train", None)
    for r in train:
        st = stats["per_source"][r["source"]]
        st["train"] = st.get("train", 0) + 1
    prompts_mod.write_rows(out / "train.parquet", train)
    # held-out rows are prompts: a kept conversation's final assistant turn is what the target must produce
    evals = [{**r, "messages": r["messages"][:-1]} if r["messages"] and r["messages"][-1].get("role") == "assistant"
             else r for r in evals]
    prompts_mod.write_rows(out / "eval.parquet", evals)
    kept = sum(r["mode"] == "keep" for r in train)
    log(f"prompts: {len(train)} train ({kept} with responses kept), {len(evals)} held-out, {stats['rejected']} "
        f"rejected, {stats['duplicates_dropped']} duplicates; per source: "
        + ", ".join(f"{k} {v.get('train', 0)}+{v.get('eval', 0)}" for k, v in stats["per_source"].items()))
    specs = prompts_mod.source_specs(cfg.prompts)
    return write_manifest(out / "manifest.json", {
        "inputs_key": key, "stats": stats, "budget": budget, "train_ids": [r["id"] for r in train],
        "eval_ids": [r["id"] for r in evals], "sources": [s.model_dump(exclude_defaults=True) for s in specs],
        "unpinned": [s.label for s in specs if s.hf and not s.revision and s.hf not in ("json", "parquet")],
        "rejects": str(out / "rejects.jsonl"), "seconds": time.monotonic() - t0})


STAGE_DIRS = {"prompts": "prompts", "generation": "generations", "tokenize": "tokenized", "features": "features",
              "vocab": "vocab", "train": "draft", "evaluate": "eval", "deploy-llama-cpp": "deploy_llama_cpp",
              "deploy-sglang": "deploy_sglang"}


def inputs_key(cfg: PipelineConfig, stage: str) -> str:
    """The inputs key stage `stage` (a key of STAGE_DIRS) writes into its manifest: a stage whose manifest holds
    it is done. Needs the upstream stages' manifests; raises FileNotFoundError naming a missing one."""
    fns = {"prompts": prompts_key, "generation": generation_stage_key, "tokenize": tokenize_key,
           "features": features_key, "vocab": vocab_key, "train": train_key, "evaluate": evaluate_key,
           "deploy-llama-cpp": deploy_llama_cpp_key, "deploy-sglang": deploy_sglang_key}
    return fns[stage](cfg)


def stage_done(cfg: PipelineConfig, stage: str) -> bool:
    """True if stage `stage` has a manifest for its current inputs under cfg.run_dir."""
    return cached_manifest(cfg.run_dir / STAGE_DIRS[stage] / "manifest.json", inputs_key(cfg, stage)) is not None


def invalidate_stage(cfg: PipelineConfig, stage: str) -> None:
    """Forget that stage `stage` is done under cfg.run_dir (its manifest and its shards' sidecars), so that its
    next run recomputes everything. Data files stay until they are overwritten."""
    out = cfg.run_dir / STAGE_DIRS[stage]
    for path in [out / "manifest.json", out / "head.json", *out.glob("shard_*.json")]:
        path.unlink(missing_ok=True)


def generation_key(cfg: PipelineConfig) -> str:
    """Key of the generation shards: what the answers depend on (sampling, the prompts, the target, the server kind;
    not concurrency, retries or server addresses, so a rerun with other servers resumes)."""
    g = cfg.generation
    return _key({"api": g.api, "max_new_tokens": g.max_new_tokens, "temperature": g.temperature,
                 "shard_size": g.shard_size, "server_kind": cfg.server.kind, "top_p": g.top_p,
                 "chat_template_kwargs": g.chat_template_kwargs, "turns": g.turns, "max_turns": g.max_turns},
                _upstream(cfg.run_dir, "prompts")["inputs_key"], _target_key(cfg))


def _gate_limits(g) -> dict:
    return {"failed": g.max_failed_frac, "empty": g.max_empty_frac, "truncated": g.max_truncated_frac,
            "degenerate": g.max_degenerate_frac}


def generation_stage_key(cfg: PipelineConfig) -> str:
    """Inputs key of the generation stage's manifest: the shards' key and the quality gate's limits."""
    return _key(generation_key(cfg), _gate_limits(cfg.generation))


def generation_shard_done(cfg: PipelineConfig, shard: int) -> dict | None:
    """Shard `shard`'s record if it is finished for the current inputs (record and file agree, no failed prompt)."""
    from .regenerate import finished_record
    return finished_record(cfg.run_dir / "generations", shard, generation_key(cfg))


def generation_shard_needs_server(cfg: PipelineConfig, shard: int) -> bool:
    """True if shard `shard` holds prompt rows to regenerate (rows in mode 'keep' are never sent)."""
    S = cfg.generation.shard_size
    rows = pq.read_table(cfg.run_dir / "prompts" / "train.parquet", columns=["mode"]).column("mode").to_pylist()
    return any(m != "keep" for m in rows[shard * S:(shard + 1) * S])


def _server_desc(cfg: PipelineConfig) -> str:
    from .target import gguf_path
    if cfg.server.kind == "llama.cpp":
        return f"llama.cpp llama-server ({gguf_path(cfg.target).name})"
    if cfg.server.kind == "sglang":
        return f"SGLang ({cfg.target.model})"
    if cfg.server.kind == "transformers":
        return f"transformers in-process ({cfg.target.model})"
    return ", ".join(cfg.server.base_urls())


@contextmanager
def generation_servers(cfg: PipelineConfig):
    """Base URLs to generate with. Kinds 'llama.cpp' and 'sglang' start the server here, on `server.host` (default
    127.0.0.1), logging to generations/server.attempt-N.log (one log per start, earlier attempts kept), watched
    while the block runs (a server that exits fails the stage at once: launcher.exit_error), and stop it when the
    block ends, on failure, Ctrl-C, SIGTERM (a cancelled flow run) and, through PDEATHSIG, when this process is
    killed. Kind 'external' yields `server.url` / `server.urls`; kind 'transformers' yields no URL (the stage
    generates in process). Raises ValueError for a config that cannot work, ServerError if a server does not
    start."""
    from .serving.launcher import llama_server, next_attempt_log, sglang_server
    from .target import gguf_path
    s, log_path = cfg.server, next_attempt_log(cfg.run_dir / "generations", "server")
    if s.kind == "llama.cpp":
        gguf = gguf_path(cfg.target)
        if gguf is None:
            raise ValueError("server.kind 'llama.cpp' needs a GGUF target; use server.kind 'sglang' (or 'external' "
                             "with server.url) for a Hugging Face target")
        with llama_server(gguf, log_path, s.host, s.port, s.parallel, s.ctx_per_slot, s.startup_timeout_s,
                          s.extra_args) as url:
            yield [url]
    elif s.kind == "sglang":
        with sglang_server(cfg.target.model, log_path, s.host, s.port, cfg.target.revision,
                           cfg.target.trust_remote_code, s.startup_timeout_s, s.extra_args) as url:
            yield [url]
    elif s.kind == "transformers":
        yield []
    else:
        if not s.base_urls():
            raise ValueError("server.kind 'external' needs server.url or server.urls (e.g. http://127.0.0.1:30000)")
        yield s.base_urls()


def generation_shards(cfg: PipelineConfig) -> list[int]:
    """Indices of this run's generation shards (`generation.shard_size` train prompts each), finished or not:
    `run_generation_shard` returns a finished shard's record at once. Deletes shards past the last one (left by a
    larger prompt set). Raises FileNotFoundError if the prompts stage has not run."""
    from .regenerate import num_shards, remove_shards_from
    _upstream(cfg.run_dir, "prompts")
    n = num_shards(cfg.run_dir / "prompts" / "train.parquet", cfg.generation.shard_size)
    out = cfg.run_dir / "generations"
    out.mkdir(parents=True, exist_ok=True)
    remove_shards_from(out, n)
    return list(range(n))


def _regenerate(cfg: PipelineConfig, shards: list[int], urls: list[str], key: str, log, on_progress) -> list[dict]:
    from .regenerate import regenerate
    from .serving.client import TOKEN_ID_APIS
    from .target import load_tokenizer
    in_process = cfg.server.kind == "transformers"
    tok = load_tokenizer(cfg.target) if cfg.generation.api in TOKEN_ID_APIS or in_process else None
    engine = _generation_engine(cfg, tok, log) if in_process else None
    try:
        return asyncio.run(regenerate(cfg.run_dir / "prompts" / "train.parquet", cfg.run_dir / "generations",
                                      shards, key, cfg.generation, cfg.server, urls, tok, log, on_progress, engine))
    finally:
        if engine is not None:
            engine.close()


def _generation_engine(cfg: PipelineConfig, tok, log):
    """server.kind 'transformers': the target in this process (fp32; CUDA when available), batches of
    generation.concurrency rows."""
    from .serving.hf_generate import BatchedGenerator
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = cfg.generation
    log(f"generation: target in this process on {device} (transformers, batches of {g.concurrency})")
    # loaded once per process: the flow's shard tasks (threads of one process) share it; finish_generation frees it
    return BatchedGenerator(_loaded_target(cfg.target.model_dump_json(), device, torch.float32), tok, g.concurrency,
                            g.max_new_tokens, g.temperature)


def run_generation_shard(cfg: PipelineConfig, shard: int, log=print, urls: list[str] | None = None,
                         on_progress=None) -> dict:
    """Regenerate the answers of one shard (generations/shard_{shard:05d}.parquet); returns its record (counts,
    failures with reasons, retries, finish reasons, quality counts: small and JSON-able).

    Idempotent: a finished shard (record for the same inputs, matching sha256, no failures) is returned untouched;
    otherwise only its unanswered prompts are sent. `urls`: running servers (e.g. from `generation_servers`, to
    keep one server across shards); None starts the configured server for this shard alone. `on_progress`: see
    `regenerate.regenerate`. Raises ValueError for a shard index out of range, ServerError when no server answers.
    """
    from .regenerate import finished_record, num_shards
    out, key = cfg.run_dir / "generations", generation_key(cfg)
    if (rec := finished_record(out, shard, key)):
        log(f"generation: shard {shard} already finished ({rec['answered']} answers)")
        return rec
    n = num_shards(cfg.run_dir / "prompts" / "train.parquet", cfg.generation.shard_size)
    if not 0 <= shard < n:
        raise ValueError(f"generation shard {shard} out of range: this run has shards 0..{n - 1}")
    if urls is None and not generation_shard_needs_server(cfg, shard):
        urls = []                                                     # every row kept as it is: no server
    if urls is None:
        with generation_servers(cfg) as started:
            return _regenerate(cfg, [shard], started, key, log, on_progress)[0]
    return _regenerate(cfg, [shard], urls, key, log, on_progress)[0]


def finish_generation(cfg: PipelineConfig, shard_manifests: list[dict], seconds: float | None = None) -> dict:
    """Check every shard against its record on disk, run the quality gate and write generations/manifest.json
    (and quality.json). `shard_manifests`: the records `run_generation_shard` returned (each must match the
    record on disk); `seconds`: the stage's wall time (default: the time any shard ran, manifest.busy_seconds: the
    shard tasks run side by side, and their sum overstated the demo's 174 s as 726 s).

    Raises RuntimeError naming a shard that has not finished, ValueError for a record that does not match the
    disk, QualityGateError (with counts, examples and the fix) when too many answers failed, are empty, truncated
    or degenerate."""
    from .generation_quality import check_quality, quality_report
    from .regenerate import num_shards, shard_name
    from .serving.client import TOKEN_ID_APIS
    _loaded_target.cache_clear()
    out, key, g = cfg.run_dir / "generations", generation_key(cfg), cfg.generation
    stage_key = generation_stage_key(cfg)
    if (m := cached_manifest(out / "manifest.json", stage_key)):
        return m
    records = []
    for k in range(num_shards(cfg.run_dir / "prompts" / "train.parquet", g.shard_size)):
        path = out / f"shard_{k:05d}.json"
        rec = json.loads(path.read_text()) if path.exists() else {}
        if rec.get("inputs_key") != key or sha256_file(out / shard_name(k)) != rec.get("sha256"):
            raise RuntimeError(f"generation shard {k} has not finished for these inputs ({path}): run "
                               f"run_generation_shard(cfg, {k}) (or the generation stage) again")
        records.append(rec)
    for m in shard_manifests:
        if m["sha256"] != records[m["shard"]]["sha256"]:
            raise ValueError(f"the record given for generation shard {m['shard']} is not the one on disk: pass "
                             f"the records of this run's run_generation_shard calls")
    report = quality_report(records, _gate_limits(g))
    write_manifest(out / "quality.json", report)
    check_quality(report, str(out))
    finish, kinds = {}, {}
    for r in records:
        for d, acc in ((r["finish_reasons"], finish), (r["retry_kinds"], kinds)):
            for k, v in d.items():
                acc[k] = acc.get(k, 0) + v
    return write_manifest(out / "manifest.json", {
        "inputs_key": stage_key, "shards_key": key, "samples": report["answered"], "prompts": report["prompts"],
        "completion_tokens": sum(r["completion_tokens"] for r in records), "finish_reasons": finish,
        "failed": report["counts"]["failed"], "failures": [f for r in records for f in r["failures"]][:100],
        "retries": sum(r["retries"] for r in records), "retry_kinds": kinds, "quality": report,
        "sampling": {"temperature": g.temperature, "top_p": g.top_p, "max_new_tokens": g.max_new_tokens,
                     "greedy": g.temperature == 0.0, "chat_template_kwargs": g.chat_template_kwargs},
        "turns": {"mode": g.turns, "max_turns": g.max_turns, **_request_counts(records)},
        "api": g.api, "token_ids": "from the server (prompt_ids, output_ids)" if g.api in TOKEN_ID_APIS else None,
        "server": _server_desc(cfg), "shards": [r["file"] for r in records],
        "seconds": seconds if seconds is not None else busy_seconds(records)})


def _request_counts(records: list[dict]) -> dict:
    """Requests sent over all shards and rows per number of requests ({'1': rows, '3': rows, ...}; kept rows: 0)."""
    hist: dict[str, int] = {}
    for r in records:
        for n, c in (r.get("requests_per_row") or {}).items():
            hist[n] = hist.get(n, 0) + c
    return {"requests": sum(int(n) * c for n, c in hist.items()), "rows_by_requests": dict(sorted(hist.items()))}


def run_generation(cfg: PipelineConfig, log=print, on_progress=None) -> dict:
    """Regenerate answers for the train prompts: all shards in one pass (no idle server slots between shards),
    then the quality gate (`finish_generation`). Starts and stops the server for kinds 'llama.cpp' / 'sglang'.

    Resumable at any point: finished shards are kept untouched, answered prompts are not sent again. Returns the
    stage manifest; raises like `finish_generation` and ServerError when no server answers.
    """
    from .regenerate import finished_record
    out = cfg.run_dir / "generations"
    key = generation_key(cfg)
    if (m := cached_manifest(out / "manifest.json", generation_stage_key(cfg))):
        return m
    t0 = time.monotonic()
    shards = generation_shards(cfg)
    todo = [k for k in shards if finished_record(out, k, key) is None]
    log(f"generation: {len(shards) - len(todo)} of {len(shards)} shards already finished")
    if todo:
        # no server when every pending row is kept as it is
        needed = any(generation_shard_needs_server(cfg, k) for k in todo)
        with generation_servers(cfg) if needed else nullcontext([]) as urls:
            _regenerate(cfg, todo, urls, key, log, on_progress)
    return finish_generation(cfg, [], seconds=time.monotonic() - t0)


def tokenize_key(cfg: PipelineConfig) -> str:
    """Inputs key of the tokenize stage: the generations, the max length and overlong policy, and the target (its
    chat template)."""
    return _key(_upstream(cfg.run_dir, "generations")["inputs_key"], cfg.features.max_length, cfg.prompts.overlong,
                _target_key(cfg))


def run_tokenize(cfg: PipelineConfig, log=print) -> dict:
    """Tokenize each conversation with the target's chat template (tools and generation.chat_template_kwargs as the
    requests had them); loss mask over assistant tokens: the regenerated final turn of prompt rows (the server's own
    ids where a token-id API returned them), every regenerated turn of turn-by-turn rows, every assistant turn of
    rows kept as they are (tokenize_rows.row_samples). Samples longer than features.max_length are cut or dropped
    (prompts.overlong), counted in the manifest, with the token source and a sample check of the server's ids."""
    from .target import load_tokenizer
    from .tokenize_rows import check_server_ids, row_samples
    out = cfg.run_dir / "tokenized"
    up = _upstream(cfg.run_dir, "generations")
    key = tokenize_key(cfg)
    if (m := cached_manifest(out / "manifest.json", key)):
        return m
    t0 = time.monotonic()
    tok = load_tokenizer(cfg.target)
    kwargs = cfg.generation.chat_template_kwargs or None
    rows, n_cut, dropped, rejects, per, sources, id_rows = [], 0, [], [], {}, {}, []
    for shard in up["shards"]:
        for index, r in enumerate(prompts_mod.read_rows(cfg.run_dir / "generations" / shard)):
            st = per.setdefault(r.get("source") or "?", {"read": 0, "rejected": 0})
            st["read"] += 1
            try:
                samples, source = row_samples(tok, r, cfg.features.max_length, cfg.prompts.overlong, kwargs)
            except (ValueError, TemplateError) as e:    # MaskError, or the template refusing this conversation
                st["rejected"] += 1
                rejects.append({"source": r.get("source") or "?", "file": f"generations/{shard}", "row": index,
                                "id": r["id"], "reason": f"{type(e).__name__}: {e}"})
                continue
            sources[source] = sources.get(source, 0) + 1
            if source == "server" and len(id_rows) < 16:
                id_rows.append(r)
            if not samples:
                dropped.append(r["id"])
                continue
            n_cut += sum(s["cut"] for s in samples)
            rows += [{"id": s["id"], "input_ids": s["input_ids"], "loss_mask": s["loss_mask"]} for s in samples]
    prompts_mod.finish_rejects(out / "rejects.jsonl", rejects, per, cfg.prompts.max_reject_frac)
    if not rows:
        raise ValueError(f"tokenize: every sample is longer than features.max_length {cfg.features.max_length} "
                         f"and prompts.overlong is 'drop'; raise max_length or use 'truncate'")
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out / "train.parquet")
    n_tok, n_loss = sum(len(r["input_ids"]) for r in rows), sum(sum(r["loss_mask"]) for r in rows)
    check = check_server_ids(tok, id_rows, kwargs)
    log(f"tokenize: {len(rows)} samples, {n_tok} tokens, {n_loss} in the loss mask; over max_length "
        f"{cfg.features.max_length}: {n_cut} cut, {len(dropped)} dropped; {len(rejects)} rejected "
        f"({out / 'rejects.jsonl'}); token source: {sources}"
        + (f"; server ids equal to the re-tokenized text in {check['equal']} of {check['checked']} checked rows"
           if check["checked"] else ""))
    return write_manifest(out / "manifest.json", {
        "inputs_key": key, "samples": len(rows), "tokens": n_tok, "loss_tokens": n_loss,
        "overlong": {"policy": cfg.prompts.overlong, "max_length": cfg.features.max_length, "cut": n_cut,
                     "dropped": len(dropped), "dropped_ids": dropped[:100]},
        "rejected": len(rejects), "rejected_per_source": {k: v["rejected"] for k, v in per.items()},
        "rejects": str(out / "rejects.jsonl"),
        "token_source": ("the server's own ids (prompt_ids + output_ids) for final-turn rows of a token-id API; "
                         "the others re-tokenized with the target's chat template" if sources.get("server") else
                         "re-tokenized with the target's chat template (the OpenAI API returns text, not ids)"),
        "token_sources": sources, "server_ids_check": check,
        "seconds": time.monotonic() - t0})


def _aux_ids(cfg: PipelineConfig, num_layers: int) -> list[int]:
    """features.aux_layer_ids resolved and checked for an L-layer target (target_family.resolve_aux_ids)."""
    from .target_family import resolve_aux_ids
    return resolve_aux_ids(cfg.features.aux_layer_ids, num_layers)


def _target_config(cfg: PipelineConfig):
    """The target's config as every stage reads it (revision, trust_remote_code; no weights)."""
    from .target import load_target_config
    return load_target_config(cfg.target)


def run_features(cfg: PipelineConfig, log=print) -> dict:
    """Aux hidden states of the target at the aux layer ids, sharded safetensors (features/), all shards in one
    call (the Prefect flow runs them one task per shard instead: run_features_shard, finish_features). Backend
    'hf_tp' (a target sharded over features.tp_size GPUs): one torchrun for all shards (tp_extract.run_features_tp)."""
    if cfg.features.backend == "hf_tp":
        from .distributed.tp_extract import run_features_tp
        return run_features_tp(cfg, log)
    from .features import bad_shards, extract_features
    from .target import load_target
    from .target_family import num_layers
    out = cfg.run_dir / "features"
    key = features_key(cfg)
    if (m := cached_manifest(out / "manifest.json", key)):
        if not (bad := bad_shards(out, m["shards"])):            # data on disk is the source of truth
            return m
        log(f"features: shard(s) {bad} missing or failing their sha256; extracting them again")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_target(cfg.target, device)
    ids = _aux_ids(cfg, num_layers(model.config))
    f = cfg.features
    manifest = extract_features(model, _tokenized_rows(cfg), out, ids, f.shard_samples, f.batch_tokens,
                                store_format=f.format, log=log, target=cfg.target.model_dump(),
                                writer_threads=f.writer_threads)
    _mark_store(cfg, manifest)
    log(f"features: {manifest['samples']} samples, {manifest['tokens']} tokens, aux layers {ids}, "
        f"format {f.format}, {manifest['bytes_per_token']:.0f} bytes/token")
    return write_manifest(out / "manifest.json", {**manifest, "inputs_key": key})


# the feature settings that change what the store holds; batch_tokens (how samples are batched into forwards),
# writer_threads, backend, tp_size and expert_parallel (how the same forwards are computed and written) do not
FEATURE_RESULT_FIELDS = ("aux_layer_ids", "max_length", "shard_samples", "format")


def features_key(cfg: PipelineConfig) -> str:
    """Inputs key of the features stage: the tokenized data, the feature settings that change the stored result
    (FEATURE_RESULT_FIELDS) and the target."""
    return _key(_upstream(cfg.run_dir, "tokenized")["inputs_key"],
                cfg.features.model_dump(mode="json", include=set(FEATURE_RESULT_FIELDS)), _target_key(cfg))


def feature_shards(cfg: PipelineConfig) -> list[int]:
    """Shard ids of the features stage: shard i holds tokenized samples [i*S, (i+1)*S), S = features.shard_samples
    (the plan of features.extract_features)."""
    n = _upstream(cfg.run_dir, "tokenized")["samples"]
    return list(range(-(-n // cfg.features.shard_samples)))


def _tokenized_rows(cfg: PipelineConfig) -> list[dict]:
    return pq.read_table(cfg.run_dir / "tokenized" / "train.parquet").to_pylist()


@lru_cache(maxsize=1)
def _loaded_target(target_json: str, device: str, dtype: torch.dtype | None = None):
    """The target, loaded once per process for all feature shards (or in-process generation shards, fp32) of a run
    (cleared by finish_features and finish_generation). dtype None: load_target's default."""
    from .config import TargetConfig
    from .target import load_target
    return load_target(TargetConfig.model_validate_json(target_json), device, dtype)


def _mark_store(cfg: PipelineConfig, store: dict) -> None:
    """features/head.json: the stage inputs key and the target id (features._write_head) the store in features/
    was last written for, so that feature_shard_done can check a shard without loading the target."""
    write_manifest(cfg.run_dir / "features" / "head.json",
                   {"inputs_key": features_key(cfg), "target_id": store["target_id"]})


def _feature_shard_entry(cfg: PipelineConfig, shard: int, rows: list[dict] | None = None) -> dict | None:
    """The store manifest's entry of feature shard `shard` if it is complete on disk for the current inputs:
    listed with the content key of its samples, layers, format and target, and its bytes match its sha256."""
    from .features import bad_shards, content_key
    out = cfg.run_dir / "features"
    head, store = read_manifest(out / "head.json"), read_manifest(out / "manifest.json")
    if (head is None or store is None or head.get("inputs_key") != features_key(cfg)
            or head.get("target_id") != store.get("target_id")):
        return None
    name = f"shard_{shard:05d}.safetensors"
    entry = next((e for e in store.get("shards", []) if e["file"] == name), None)
    if entry is None:
        return None
    S = cfg.features.shard_samples
    part = (rows if rows is not None else _tokenized_rows(cfg))[shard * S:(shard + 1) * S]
    if entry.get("content_key") != content_key(part, store["aux_layer_ids"], store["format"], store["target_id"]):
        return None
    return None if bad_shards(out, [entry]) else entry


def feature_shard_done(cfg: PipelineConfig, shard: int) -> bool:
    """True if feature shard `shard` is complete on disk for the current inputs (content key and sha256 match)."""
    return _feature_shard_entry(cfg, shard) is not None


def run_features_shard(cfg: PipelineConfig, shard: int, log=print) -> dict:
    """Aux hidden states of one shard of tokenized samples (features/shard_{shard:05d}.safetensors, listed in
    features/manifest.json with its sha256 and content key) via features.extract_features(only_shards={shard}).
    Idempotent: a shard complete for the same inputs and samples is not recomputed, and the target is loaded (once
    per process) only when one is not. Shards must run one after another (each rewrites the store manifest).
    Returns the shard's manifest entry {shard, file, sha256, bytes, samples, tokens, ids, content_key, extracted,
    inputs_key, seconds}. Raises ValueError for a shard id out of range, or for features.backend 'hf_tp' (its
    ranks extract all shards in one torchrun: run_features)."""
    from .features import extract_features
    if cfg.features.backend != "hf":
        raise ValueError(f"features.backend {cfg.features.backend!r} extracts all shards in one torchrun "
                         f"(stages.run_features / tasks.distributed.features_tp_task), not one shard per task")
    from .target_family import num_layers
    want = feature_shards(cfg)
    if shard not in want:
        raise ValueError(f"feature shard {shard} is out of range: {cfg.run_dir}/tokenized has {len(want)} shards "
                         f"of {cfg.features.shard_samples} samples")
    out, key, t0 = cfg.run_dir / "features", features_key(cfg), time.monotonic()
    rows = _tokenized_rows(cfg)
    entry = _feature_shard_entry(cfg, shard, rows)
    extracted = entry is None
    if extracted:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = _loaded_target(cfg.target.model_dump_json(), device)
        f = cfg.features
        store = extract_features(model, rows, out, _aux_ids(cfg, num_layers(model.config)), f.shard_samples,
                                 f.batch_tokens, store_format=f.format, log=log, target=cfg.target.model_dump(),
                                 writer_threads=f.writer_threads, only_shards={shard})
        _mark_store(cfg, store)
        entry = next(e for e in store["shards"] if e["file"] == f"shard_{shard:05d}.safetensors")
        log(f"features: shard {shard}: {entry['samples']} samples, {entry['tokens']} tokens in "
            f"{time.monotonic() - t0:.1f} s")
    return {**entry, "shard": shard, "inputs_key": key, "extracted": extracted, "seconds": time.monotonic() - t0}


def finish_features(cfg: PipelineConfig, shard_manifests: list[dict], log=print) -> dict:
    """The features stage's manifest (the store manifest plus inputs_key, as run_features writes it) once every
    shard of feature_shards has a manifest for the current inputs (any order) and is intact on disk; frees the
    target loaded for the shards. Raises ValueError naming the shards that are missing, stale or corrupt (rerun
    them with run_features_shard)."""
    _loaded_target.cache_clear()
    key, want, out = features_key(cfg), feature_shards(cfg), cfg.run_dir / "features"
    by_id = {m["shard"]: m for m in shard_manifests if m.get("inputs_key") == key}
    rows = _tokenized_rows(cfg)
    # data on disk is the source of truth: each shard must be listed and intact for the current inputs
    if (missing := [i for i in want if i not in by_id or _feature_shard_entry(cfg, i, rows) is None]):
        raise ValueError(f"feature shards {missing} of {out} are missing, stale or corrupt: run them "
                         f"(run_features_shard) before finish_features")
    store = read_manifest(out / "manifest.json")
    if not store.get("complete"):
        raise ValueError(f"{out}/manifest.json does not list every shard: run the missing ones (run_features_shard)")
    ran = [by_id[i] for i in want if by_id[i].get("extracted")]
    seconds = sum(by_id[i]["seconds"] for i in want)
    ran_s = sum(m["seconds"] for m in ran)
    manifest = {**store, "shards_extracted": len(ran), "seconds": seconds,
                "tokens_per_s": sum(m["tokens"] for m in ran) / ran_s if ran and ran_s > 0 else None}
    log(f"features: {manifest['samples']} samples, {manifest['tokens']} tokens, aux layers "
        f"{manifest['aux_layer_ids']}, format {manifest['format']}, {manifest['bytes_per_token']:.0f} bytes/token")
    return write_manifest(out / "manifest.json", {**manifest, "inputs_key": key})


def vocab_key(cfg: PipelineConfig) -> str:
    """Inputs key of the vocab stage: the tokenized data and the draft vocab size."""
    return _key(_upstream(cfg.run_dir, "tokenized")["inputs_key"], cfg.draft.draft_vocab_size)


def run_vocab(cfg: PipelineConfig, log=print) -> dict:
    """Draft vocab map from loss-masked token counts (vocab/vocab_map.safetensors: d2t, t2d, counts)."""
    from .target_family import text_config
    from .vocab_map import build_vocab_map, count_tokens
    out = cfg.run_dir / "vocab"
    key = vocab_key(cfg)
    if (m := cached_manifest(out / "manifest.json", key)):
        return m
    t0 = time.monotonic()
    V = text_config(_target_config(cfg)).vocab_size
    rows = pq.read_table(cfg.run_dir / "tokenized" / "train.parquet").to_pylist()
    counts = count_tokens([torch.tensor(r["input_ids"]) for r in rows], [torch.tensor(r["loss_mask"]) for r in rows],
                          V)
    N = min(cfg.draft.draft_vocab_size, V)
    d2t, t2d = build_vocab_map(counts, N)
    out.mkdir(parents=True, exist_ok=True)
    save_file({"d2t": d2t, "t2d": t2d, "counts": counts}, str(out / "vocab_map.safetensors"))
    seen = int((counts > 0).sum())
    coverage = float(counts[t2d].sum() / counts.sum().clamp(min=1))
    log(f"vocab: draft vocab {N} of {V}; {seen} distinct tokens seen; the map covers {coverage:.1%} of them")
    return write_manifest(out / "manifest.json", {"inputs_key": key, "draft_vocab_size": N, "vocab_size": V,
                                                  "distinct_seen": seen, "coverage": coverage,
                                                  "seconds": time.monotonic() - t0})


def _draft_shape(cfg: PipelineConfig):
    """The draft's shape: target config (composite configs unwrapped), family recipe, cfg.draft's geometry."""
    from .target_family import draft_shape, num_layers
    tcfg = _target_config(cfg)
    return draft_shape(tcfg, cfg.draft.draft_vocab_size, _aux_ids(cfg, num_layers(tcfg)),
                       overrides=cfg.draft.geometry())


def _fresh_draft(cfg: PipelineConfig):
    from .features import load_head
    from .trainer import build_draft
    vocab = load_file(str(cfg.run_dir / "vocab" / "vocab_map.safetensors"))
    emb, lm = load_head(cfg.run_dir / "features")
    return build_draft(_draft_shape(cfg), emb, vocab["d2t"], vocab["t2d"], cfg.draft.seed), lm


def train_split(cfg: PipelineConfig, dp=None) -> tuple[list, list]:
    """(train, held-out) samples of cfg.run_dir/features: the first int(n * train.eval_frac) are held out. Every
    shard's sha256 is checked first, 1/W of them on each rank of `dp` (a DataParallel; default one process).
    Raises ValueError on every rank, naming the bad shards this rank found, if any rank found one."""
    from .distributed.data_parallel import DataParallel
    from .features import bad_shards, load_samples
    dp, store = dp or DataParallel(), cfg.run_dir / "features"
    shards = (read_manifest(store / "manifest.json") or {}).get("shards", [])   # none: load_samples says so
    bad = bad_shards(store, dp.shard(shards))
    if n_bad := dp.sum_int(len(bad)):
        raise ValueError(f"{n_bad} feature shard(s) corrupt or missing (sha256 mismatch), here "
                         f"{[str(store / b) for b in bad]}; rerun the features stage: it extracts exactly those "
                         "shards again")
    samples = load_samples(store, verify=False)
    n_eval = int(len(samples) * cfg.train.eval_frac)
    return samples[n_eval:], samples[:n_eval]


def claim_training_dir(out: Path, key: str) -> None:
    """Make `out` the training directory of inputs `key`: training state written for other inputs is deleted
    (never resumed from); state of the same inputs stays, so training resumes."""
    out.mkdir(parents=True, exist_ok=True)
    if (out / "inputs_key").exists() and (out / "inputs_key").read_text() != key:
        clear_training_state(out)
    (out / "inputs_key").write_text(key)


def train_key(cfg: PipelineConfig) -> str:
    """Inputs key of the training stage: features, vocab map, train and draft settings (any number of GPUs)."""
    return _key(_upstream(cfg.run_dir, "features")["inputs_key"], _upstream(cfg.run_dir, "vocab")["inputs_key"],
                cfg.train, cfg.draft)


def run_train(cfg: PipelineConfig, log=print, on_epoch=None) -> dict:
    """Train the draft with TTT (draft/), then export the best epoch as an SGLang-loadable directory
    (draft/export), validated by reloading it strictly and comparing logits exactly. The same on every rank of an
    initialised process group (torchrun: distributed/train_ddp.py): each rank trains its share (trainer.train),
    rank 0 alone exports and writes the manifest (its `world_size` says how many ranks trained). Logs 'epoch e of
    E' with an ETA; on_epoch(epochs_done, epochs) after each epoch (rank 0)."""
    from .distributed.data_parallel import DataParallel
    from .trainer import train
    dp = DataParallel.from_process_group()
    out = cfg.run_dir / "draft"
    key = train_key(cfg)
    if (m := cached_manifest(out / "manifest.json", key)):
        return m
    t0 = time.monotonic()
    train_s, eval_s = train_split(cfg, dp)
    draft, lm_head = _fresh_draft(cfg)
    if dp.is_main:
        claim_training_dir(out, key)
    dp.barrier()                                   # no rank resumes from state of other inputs
    summary = train(draft, train_s, eval_s, lm_head, cfg.train, out, log=log, on_epoch=on_epoch)
    manifest = None
    if dp.is_main:
        export = export_draft(load_draft(out / "best"), out / "export")      # bf16, probed bit for bit
        log(f"train: best epoch {summary['best']['epoch']} (tau_sim {summary['best']['tau_sim']:.2f}); "
            f"exported to {export}")
        manifest = write_manifest(out / "manifest.json", {
            "inputs_key": key, "export_dir": str(export), "export_dtype": str(EXPORT_DTYPE).removeprefix("torch."),
            "best": summary["best"], "steps": summary["steps"],
            "history": summary["history"], "train_samples": len(train_s), "eval_samples": len(eval_s),
            "world_size": dp.world, "seconds": time.monotonic() - t0})
    dp.barrier()                                   # the manifest exists when any rank returns
    return manifest or read_manifest(out / "manifest.json")


def evaluate_key(cfg: PipelineConfig) -> str:
    """Inputs key of the evaluate stage: the trained draft, the eval settings and the held-out prompts."""
    return _key(_upstream(cfg.run_dir, "draft")["inputs_key"], cfg.eval,
                _upstream(cfg.run_dir, "prompts")["inputs_key"])


def _category(row: dict) -> str:
    """Prompt category for tau per category: meta['category'] (Spec-Bench rows) or the row's source."""
    meta = json.loads(row.get("meta") or "{}")
    return str(meta.get("category") or row.get("source") or "all")


def run_evaluate(cfg: PipelineConfig, log=print, on_progress=None) -> dict:
    """Pre-flight check of the exported draft against the target, then offline tau on the held-out prompts: the
    trained draft as a chain and as an SGLang-style tree, an untrained draft as a chain; simulated vs measured tau
    (eval/report.json). Logs 'n of N' decoded prompts with an ETA after each; on_progress(done, total, run name)
    too. Raises PreflightError listing every mismatch between the draft and the target."""
    from .evaluate import SpecRun, measure, tau_consistency
    from .preflight import preflight
    from .speculate import TargetRunner
    from .target import load_target, load_tokenizer
    out = cfg.run_dir / "eval"
    up = _upstream(cfg.run_dir, "draft")
    key = evaluate_key(cfg)
    if (m := cached_manifest(out / "manifest.json", key)):
        return m
    t0 = time.monotonic()
    preflight(Path(up["export_dir"]), _target_config(cfg))
    tok = load_tokenizer(cfg.target)
    model = load_target(cfg.target)
    rows = prompts_mod.read_rows(cfg.run_dir / "prompts" / "eval.parquet")
    kwargs = cfg.generation.chat_template_kwargs or None              # the thinking mode the draft was trained in
    prompts = [prompt_ids(tok, r["messages"], json.loads(r["tools"]) if r.get("tools") else None, kwargs)
               for r in rows]
    trained = load_draft(Path(up["export_dir"]))
    untrained, _ = _fresh_draft(cfg)
    ids = trained.shape.aux_layer_ids
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    e, S = cfg.eval, cfg.eval.num_draft_steps

    def subset(n: int | None) -> list[int] | None:                         # the first n held-out prompts
        return None if n is None else list(range(min(n, len(prompts))))

    runs = {"trained": SpecRun(trained, S)}
    if e.tree_topk > 1:
        runs["trained_tree"] = SpecRun(trained, S, e.tree_topk, e.tree_num_draft_tokens, subset(e.tree_prompts))
    runs["untrained"] = SpecRun(untrained, S, prompt_idx=subset(e.untrained_prompts))
    t_measure = time.monotonic()

    def progress(done: int, total: int, name: str) -> None:
        eta = (time.monotonic() - t_measure) / done * (total - done)
        log(f"evaluate: {done} of {total} prompt decodes ({name})" + (f", ETA {eta / 60:.1f} min" if eta else ""))
        if on_progress is not None:
            on_progress(done, total, name)

    report = measure(TargetRunner(model, ids), runs, prompts, [_category(r) for r in rows], e.max_new_tokens, eos,
                     e.tie_gap, on_prompt=progress)
    report.update({"eval_ids": [r["id"] for r in rows], "num_draft_steps": S, "max_new_tokens": e.max_new_tokens,
                   "aux_layer_ids": ids, "preflight": "passed",
                   "sampling": {"temperature": 0.0, "top_p": 1.0, "greedy": True,
                                "chat_template_kwargs": cfg.generation.chat_template_kwargs},
                   "consistency": tau_consistency(report["trained"]["tau"], up, S)})
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    tree = report.get("trained_tree")
    log(f"eval: tau trained {report['trained']['tau']:.2f} (chain)"
        + (f", {tree['tau']:.2f} (tree k={e.tree_topk}, T={e.tree_num_draft_tokens})" if tree else "")
        + f", untrained {report['untrained']['tau']:.2f}; lossless {report['trained']['lossless']}; simulated "
        + f"tau {report['consistency']['tau_sim_at_steps']:.2f} over {report['consistency']['steps_compared']} steps")
    return write_manifest(out / "manifest.json", {"inputs_key": key, "report": str(out / "report.json"),
                                                  "summary": report, "sampling": report["sampling"],
                                                  "seconds": time.monotonic() - t0})


def deploy_llama_cpp_key(cfg: PipelineConfig) -> str:
    """Inputs key of the llama.cpp deployment stage: the trained draft, eval settings, host, held-out prompts."""
    return _key(_upstream(cfg.run_dir, "draft")["inputs_key"], cfg.eval, cfg.server.host,
                _upstream(cfg.run_dir, "prompts")["inputs_key"])


def run_deploy_llama_cpp(cfg: PipelineConfig, log=print) -> dict:
    """Deploy the exported draft on llama.cpp (GGUF conversion, `--spec-type draft-eagle3`) and benchmark it
    against the same server without a draft on the held-out prompts, greedy, one stream (deploy_llama_cpp/).
    Skipped (manifest says why) when the target is not a GGUF file llama.cpp can serve."""
    from .serving.launcher import llama_server
    from .serving.llama_cpp import (
        LLAMA_CPP_TIE_GAP,
        convert_draft,
        run_requests,
        summarize,
    )
    from .target import gguf_path, local_model_dir
    out = cfg.run_dir / "deploy_llama_cpp"
    up = _upstream(cfg.run_dir, "draft")
    key = deploy_llama_cpp_key(cfg)
    if (m := cached_manifest(out / "manifest.json", key)):
        return m
    t0 = time.monotonic()
    gguf = gguf_path(cfg.target)
    if gguf is None:
        log("deploy: target is not GGUF; llama.cpp deployment skipped (use the SGLang benchmark)")
        return write_manifest(out / "manifest.json", {"inputs_key": key, "skipped": "target is not GGUF",
                                                      "seconds": time.monotonic() - t0})
    draft_gguf = convert_draft(Path(up["export_dir"]), Path(local_model_dir(cfg.target)), out / "draft.gguf")
    rows = prompts_mod.read_rows(cfg.run_dir / "prompts" / "eval.parquet")
    S, n_new = cfg.eval.num_draft_steps, cfg.eval.max_new_tokens
    common = dict(host=cfg.server.host, parallel=1, ctx_per_slot=cfg.server.ctx_per_slot * 2,
                  startup_timeout_s=cfg.server.startup_timeout_s)
    with llama_server(gguf, out / "baseline.log", **common) as url:
        base = run_requests(url, rows, n_new, log, "no draft")
    spec_args = ["-md", str(draft_gguf), "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(S),
                 "--spec-draft-n-min", str(S)]
    with llama_server(gguf, out / "eagle3.log", extra_args=spec_args, **common) as url:
        spec = run_requests(url, rows, n_new, log, "EAGLE-3 draft")
    summary = {**summarize(base, spec, LLAMA_CPP_TIE_GAP), "num_draft_steps": S, "max_new_tokens": n_new,
               "tie_gap": LLAMA_CPP_TIE_GAP, "draft_gguf": str(draft_gguf),
               "server_args": spec_args[2:]}                                 # without the local -md path
    log(f"deploy: llama.cpp tau {summary['tau']:.2f}, {summary['tokens_per_s']:.1f} tok/s with the draft vs "
        f"{summary['baseline_tokens_per_s']:.1f} without ({summary['speedup']:.2f}x); lossless {summary['lossless']}")
    return write_manifest(out / "manifest.json", {"inputs_key": key, "summary": summary,
                                                  "seconds": time.monotonic() - t0})


def deploy_sglang_key(cfg: PipelineConfig) -> str:
    """Inputs key of the SGLang deployment stage: the trained draft, the target, the stage's own settings."""
    return _key(_upstream(cfg.run_dir, "draft")["inputs_key"], cfg.target, cfg.eval.num_draft_steps,
                cfg.deploy_sglang)


def deploy_sglang_skip(cfg: PipelineConfig) -> str | None:
    """Why the SGLang deployment stage does not run here (None: it runs). 'auto' skips GGUF targets (llama.cpp
    serves those), and a machine without SGLang unless both servers are given by URL; 'on' raises RuntimeError
    where 'auto' would skip for a missing SGLang; 'off' always skips."""
    from .serving.sglang_deploy import sglang_installed
    from .target import gguf_path
    d = cfg.deploy_sglang
    if d.enabled == "off":
        return "deploy_sglang.enabled is 'off'"
    if d.enabled == "auto" and gguf_path(cfg.target) is not None:
        return "the target is a GGUF file: the llama.cpp deployment stage serves it (SGLang serves HF checkpoints)"
    if not (d.baseline_url and d.eagle3_url) and not sglang_installed():
        why = ("SGLang is not installed here (it needs CUDA: on a GPU host `pip install -e '.[sglang]'`), and "
               "deploy_sglang.baseline_url / eagle3_url do not name running servers")
        if d.enabled == "on":
            raise RuntimeError(f"deploy-sglang: {why}; install SGLang or give both URLs (deploy_sglang.enabled "
                               f"is 'on')")
        return why
    return None


def run_deploy_sglang(cfg: PipelineConfig, log=print) -> dict:
    """Phase 6 on SGLang (deploy_sglang/): pre-flight of the exported draft against the target, then the same
    Spec-Bench and HumanEval prompts through /generate on the baseline and the EAGLE3 server at each concurrency:
    output tok/s, tau = sum(completion_tokens) / sum(spec_verify_ct), speed-up and break-even tau per level
    (serving.sglang_deploy.run_benchmark). Skipped (no manifest, so a later run on a GPU host does the work) where
    deploy_sglang_skip says why: a skip the config decides (GGUF target, 'off') writes a manifest saying so; one
    this machine decides (no SGLang) writes none, so that a later run on a GPU host does the work, and returns
    {'skipped': reason}."""
    from .target import gguf_path
    out = cfg.run_dir / STAGE_DIRS["deploy-sglang"]
    key = deploy_sglang_key(cfg)
    if (m := cached_manifest(out / "manifest.json", key)):
        return m
    if (why := deploy_sglang_skip(cfg)) is not None:
        log(f"deploy-sglang: skipped: {why}")
        if cfg.deploy_sglang.enabled == "off" or gguf_path(cfg.target) is not None:   # the config decides: done
            return write_manifest(out / "manifest.json", {"inputs_key": key, "skipped": why, "seconds": 0.0})
        return {"skipped": why}                                   # this machine decides: a GPU host will run it
    from .preflight import preflight
    from .serving.sglang_bench import SpecArgs, target_server_args
    from .serving.sglang_deploy import DEFAULT_SPEC_BENCH, benchmark_prompts, run_benchmark
    from .target import load_target_config, load_tokenizer
    t0 = time.monotonic()
    d, up = cfg.deploy_sglang, _upstream(cfg.run_dir, "draft")
    steps = d.num_steps or cfg.eval.num_draft_steps
    spec = SpecArgs(up["export_dir"], steps, d.topk, d.num_draft_tokens or steps + 1)
    preflight(Path(up["export_dir"]), load_target_config(cfg.target))
    tok = load_tokenizer(cfg.target)
    rows = benchmark_prompts(DEFAULT_SPEC_BENCH, True, d.per_category)
    prompts = [{**r, "input_ids": prompt_ids(tok, r["messages"])} for r in rows]
    server_args = target_server_args(d.tp_size, d.ep_size, cfg.target.trust_remote_code, cfg.target.revision,
                                     d.extra_args)
    log(f"deploy-sglang: {len(prompts)} prompts at concurrency {d.concurrency} on the baseline and the EAGLE3 "
        f"server ({'running at ' + d.eagle3_url if d.eagle3_url else 'started here'}; {' '.join(server_args)})")
    result = run_benchmark(cfg.target.model, spec, prompts, d.concurrency, out, d.max_new_tokens,
                           d.max_running_requests, d.cuda_graph_max_bs, server_args,
                           {"baseline": d.baseline_url, "eagle3": d.eagle3_url}, host=cfg.server.host,
                           startup_timeout_s=d.startup_timeout_s)
    v = result["verdict"]
    log(f"deploy-sglang: tau {v['tau'] if v['tau'] is None else round(v['tau'], 2)}; {v['summary']}")
    for w in v["warnings"]:
        log(f"deploy-sglang: WARNING {w}")
    return write_manifest(out / "manifest.json", {"inputs_key": key, "verdict": v, "prompts": len(prompts),
                                                  "report": str(out / "sglang_bench.md"),
                                                  "seconds": time.monotonic() - t0})
