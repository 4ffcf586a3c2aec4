"""The pipeline stages as plain functions: each reads its inputs under the run directory, writes its outputs and
finishes by writing a manifest atomically (DESIGN.md 'data contracts'). A stage whose manifest was written for the
same inputs key is not recomputed. Prefect tasks wrap these one to one; they work without Prefect too.

Run layout: prompts/ generations/ tokenized/ features/ vocab/ draft/ eval/, each with manifest.json.
"""
from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file, save_file

from . import prompts as prompts_mod
from .checkpoint import load_draft, save_draft
from .config import PipelineConfig, default_aux_layer_ids
from .data import assistant_content, prompt_ids, tokenize_conversation
from .manifest import cached_manifest, read_manifest, sha256_file, sha256_json, write_manifest

CODE_VERSION = "2"  # bump when a stage's output format or semantics change (2: shard sidecars)
FEATURE_DTYPE = "bf16"  # dtype of stored aux/final hidden states


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
    """Inputs key of the prompts stage: the prompt settings and the content of local source files."""
    files = [s for s in cfg.prompts.sources if s != prompts_mod.HUMAN_EVAL]
    return _key(cfg.prompts, [sha256_file(Path(f)) if Path(f).exists() else f for f in files])


def run_prompts(cfg: PipelineConfig, log=print) -> dict:
    """Load, dedupe and split the prompt sources into prompts/{train,eval}.parquet."""
    out = cfg.run_dir / "prompts"
    key = prompts_key(cfg)
    if (m := cached_manifest(out / "manifest.json", key)):
        return m
    t0 = time.monotonic()
    train, evals, stats = prompts_mod.build_prompts(cfg.prompts)
    out.mkdir(parents=True, exist_ok=True)
    prompts_mod.write_rows(out / "train.parquet", train)
    prompts_mod.write_rows(out / "eval.parquet", evals)
    log(f"prompts: {len(train)} train, {len(evals)} held-out from {cfg.prompts.sources}")
    return write_manifest(out / "manifest.json", {
        "inputs_key": key, "stats": stats, "train_ids": [r["id"] for r in train],
        "eval_ids": [r["id"] for r in evals], "sources": cfg.prompts.sources, "seconds": time.monotonic() - t0})


STAGE_DIRS = {"prompts": "prompts", "generation": "generations", "tokenize": "tokenized", "features": "features",
              "vocab": "vocab", "train": "draft", "evaluate": "eval", "deploy-llama-cpp": "deploy_llama_cpp"}


def inputs_key(cfg: PipelineConfig, stage: str) -> str:
    """The inputs key stage `stage` (a key of STAGE_DIRS) writes into its manifest: a stage whose manifest holds
    it is done. Needs the upstream stages' manifests; raises FileNotFoundError naming a missing one."""
    fns = {"prompts": prompts_key, "generation": generation_key, "tokenize": tokenize_key,
           "features": features_key, "vocab": vocab_key, "train": train_key, "evaluate": evaluate_key,
           "deploy-llama-cpp": deploy_llama_cpp_key}
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
    """Inputs key of the generation stage: sampling settings, the prompts, the target and the server."""
    up = _upstream(cfg.run_dir, "prompts")
    return _key(cfg.generation, up["inputs_key"], _target_key(cfg), cfg.server.kind, cfg.server.url)


def generation_shards(cfg: PipelineConfig) -> list[int]:
    """Shard ids of the generation stage: shard i holds train prompts [i*S, (i+1)*S), S = generation.shard_size."""
    n = len(_upstream(cfg.run_dir, "prompts")["train_ids"])
    return list(range(-(-n // cfg.generation.shard_size)))


def _generation_shard_path(cfg: PipelineConfig, shard: int) -> Path:
    return cfg.run_dir / "generations" / f"shard_{shard:05d}.parquet"


def generation_shard_done(cfg: PipelineConfig, shard: int) -> dict | None:
    """The shard's manifest if its parquet file is complete for the current inputs (key and sha256 match)."""
    path = _generation_shard_path(cfg, shard)
    side = read_manifest(path.with_suffix(".json"))
    if side is None or side.get("inputs_key") != generation_key(cfg) or not path.exists():
        return None
    return side if sha256_file(path) == side["sha256"] else None


def _server_desc(cfg: PipelineConfig) -> str:
    from .target import gguf_path
    if cfg.server.kind == "llama.cpp":
        gguf = gguf_path(cfg.target)
        return f"llama.cpp llama-server ({gguf.name if gguf else '?'})"
    return str(cfg.server.url)


@contextmanager
def generation_server(cfg: PipelineConfig):
    """Yields the base URL of the server that answers the generation requests. kind 'llama.cpp': starts
    llama-server on the target's GGUF for the duration of the block (stopped on success, failure or cancel);
    kind 'external': server.url. Raises ValueError for a config that names no usable server."""
    from .serving.launcher import llama_server
    from .target import gguf_path
    server = cfg.server
    if server.kind == "llama.cpp":
        gguf = gguf_path(cfg.target)
        if gguf is None:
            raise ValueError("server.kind 'llama.cpp' needs a GGUF target; use server.kind 'external' with "
                             "server.url for an SGLang server")
        with llama_server(gguf, cfg.run_dir / "generations" / "server.log", server.host, server.port,
                          server.parallel, server.ctx_per_slot, server.startup_timeout_s) as url:
            yield url
    else:
        if not server.url:
            raise ValueError("server.kind 'external' needs server.url (e.g. http://127.0.0.1:30000)")
        yield server.url.rstrip("/")


def run_generation_shard(cfg: PipelineConfig, shard: int, log=print, url: str | None = None) -> dict:
    """Regenerate the responses of one shard of train prompts (generations/shard_{shard:05d}.parquet, with a
    sidecar .json holding its sha256 and inputs key). Idempotent: a complete shard is not regenerated.

    url: base URL of a running server (the flow starts one around all shards); None starts one (llama.cpp) or
    uses server.url (external) for this shard alone. Returns the shard manifest {shard, file, sha256, inputs_key,
    samples, completion_tokens, finish_reasons, seconds}. Raises ValueError for a shard id out of range,
    ServerError naming the URL when the server cannot be reached or a request exhausts its retries.
    """
    from .serving.client import check_reachable, generate_all
    if (m := generation_shard_done(cfg, shard)):
        return m
    if url is None:
        with generation_server(cfg) as started:
            return run_generation_shard(cfg, shard, log, started)
    key, S, g = generation_key(cfg), cfg.generation.shard_size, cfg.generation
    rows = prompts_mod.read_rows(cfg.run_dir / "prompts" / "train.parquet")[shard * S:(shard + 1) * S]
    if not rows:
        raise ValueError(f"generation shard {shard} is out of range: {cfg.run_dir}/prompts/train.parquet has "
                         f"{len(generation_shards(cfg))} shards of {S} prompts")
    t0 = time.monotonic()
    asyncio.run(check_reachable(url))
    done = asyncio.run(generate_all(url, rows, g.max_new_tokens, g.temperature, g.concurrency, g.max_retries,
                                    g.request_timeout_s))
    path = _generation_shard_path(cfg, shard)
    prompts_mod.write_rows(path, done)
    finish: dict[str, int] = {}
    for r in done:
        finish[r["finish_reason"]] = finish.get(r["finish_reason"], 0) + 1
    n_tok, seconds = sum(r["completion_tokens"] for r in done), time.monotonic() - t0
    log(f"generation: shard {shard}: {len(done)} prompts, {n_tok} tokens, {n_tok / seconds:.0f} tok/s")
    return write_manifest(path.with_suffix(".json"), {
        "shard": shard, "file": path.name, "sha256": sha256_file(path), "inputs_key": key, "samples": len(done),
        "completion_tokens": n_tok, "finish_reasons": finish, "seconds": seconds})


def finish_generation(cfg: PipelineConfig, shard_manifests: list[dict]) -> dict:
    """The generation stage's manifest from its shards' manifests (one per id of generation_shards, any order).
    Raises ValueError naming the shards that are missing or were written for other inputs."""
    key, want = generation_key(cfg), generation_shards(cfg)
    by_id = {m["shard"]: m for m in shard_manifests if m.get("inputs_key") == key}
    if (missing := [i for i in want if i not in by_id]):
        raise ValueError(f"generation shards {missing} of {cfg.run_dir}/generations are missing or stale: "
                         f"run them (run_generation_shard) before finish_generation")
    shards = [by_id[i] for i in want]
    finish: dict[str, int] = {}
    for m in shards:
        for reason, n in m["finish_reasons"].items():
            finish[reason] = finish.get(reason, 0) + n
    g = cfg.generation
    return write_manifest(cfg.run_dir / "generations" / "manifest.json", {
        "inputs_key": key, "samples": sum(m["samples"] for m in shards),
        "completion_tokens": sum(m["completion_tokens"] for m in shards), "finish_reasons": finish,
        "sampling": {"temperature": g.temperature, "max_new_tokens": g.max_new_tokens,
                     "greedy": g.temperature == 0.0},
        "server": _server_desc(cfg), "shards": [m["file"] for m in shards],
        "seconds": sum(m["seconds"] for m in shards)})


def run_generation(cfg: PipelineConfig, log=print) -> dict:
    """Regenerate responses for the train prompts with the target behind an OpenAI-compatible server: plan the
    shards, run the unfinished ones against one server (two at a time, so that no slot idles at a shard's tail),
    write the stage manifest. Resumable: complete shards are kept and skipped on rerun."""
    if (m := cached_manifest(cfg.run_dir / "generations" / "manifest.json", generation_key(cfg))):
        return m
    shards = generation_shards(cfg)
    done = {i: m for i in shards if (m := generation_shard_done(cfg, i))}
    todo = [i for i in shards if i not in done]
    if todo:
        with generation_server(cfg) as url, ThreadPoolExecutor(2) as pool:
            done.update(zip(todo, pool.map(lambda i: run_generation_shard(cfg, i, log, url), todo)))
    return finish_generation(cfg, list(done.values()))


def tokenize_key(cfg: PipelineConfig) -> str:
    """Inputs key of the tokenize stage: the generations, the max length and the target (its chat template)."""
    return _key(_upstream(cfg.run_dir, "generations")["inputs_key"], cfg.features.max_length, _target_key(cfg))


def run_tokenize(cfg: PipelineConfig, log=print) -> dict:
    """Tokenize prompt + regenerated response with the target's chat template; assistant-only loss mask."""
    from .target import load_tokenizer
    out = cfg.run_dir / "tokenized"
    up = _upstream(cfg.run_dir, "generations")
    key = tokenize_key(cfg)
    if (m := cached_manifest(out / "manifest.json", key)):
        return m
    t0 = time.monotonic()
    tok = load_tokenizer(cfg.target)
    rows = []
    for shard in up["shards"]:
        for r in prompts_mod.read_rows(cfg.run_dir / "generations" / shard):
            seq = tokenize_conversation(tok, r["messages"], assistant_content(r["response"], r["reasoning"]),
                                        r["id"], truncated=r["finish_reason"] == "length",
                                        max_length=cfg.features.max_length)
            rows.append({"id": r["id"], **seq})
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out / "train.parquet")
    n_tok, n_loss = sum(len(r["input_ids"]) for r in rows), sum(sum(r["loss_mask"]) for r in rows)
    log(f"tokenize: {len(rows)} samples, {n_tok} tokens, {n_loss} in the loss mask")
    return write_manifest(out / "manifest.json", {
        "inputs_key": key, "samples": len(rows), "tokens": n_tok, "loss_tokens": n_loss,
        "token_source": "re-tokenized with the target's chat template (the OpenAI API returns text, not ids)",
        "seconds": time.monotonic() - t0})


def _aux_ids(cfg: PipelineConfig, num_layers: int) -> list[int]:
    return cfg.features.aux_layer_ids or default_aux_layer_ids(num_layers)


def features_key(cfg: PipelineConfig) -> str:
    """Inputs key of the features stage: the tokenized data, the feature settings and the target."""
    return _key(_upstream(cfg.run_dir, "tokenized")["inputs_key"], cfg.features, _target_key(cfg))


def feature_shards(cfg: PipelineConfig) -> list[int]:
    """Shard ids of the features stage: shard i holds tokenized samples [i*S, (i+1)*S), S = features.shard_samples."""
    n = _upstream(cfg.run_dir, "tokenized")["samples"]
    return list(range(-(-n // cfg.features.shard_samples)))


def _num_layers(cfg: PipelineConfig) -> int:
    from transformers import AutoConfig

    from .target import local_model_dir
    return AutoConfig.from_pretrained(local_model_dir(cfg.target)).num_hidden_layers


@lru_cache(maxsize=1)
def _loaded_target(target_json: str, device: str):
    """The target, loaded once per process for all feature shards of a run (cleared by finish_features)."""
    from .config import TargetConfig
    from .target import load_target
    return load_target(TargetConfig.model_validate_json(target_json), device)


def _feature_shard_plan(cfg: PipelineConfig, shard: int) -> tuple[list[dict], str, str]:
    """(tokenized rows, file stem, content key) of feature shard `shard`. Raises ValueError if out of range."""
    S = cfg.features.shard_samples
    rows = pq.read_table(cfg.run_dir / "tokenized" / "train.parquet").to_pylist()[shard * S:(shard + 1) * S]
    if not rows:
        raise ValueError(f"feature shard {shard} is out of range: {cfg.run_dir}/tokenized has "
                         f"{len(feature_shards(cfg))} shards of {S} samples")
    return rows, f"shard_{shard:05d}", _feature_content_key(cfg, shard, [r["id"] for r in rows])


def _feature_content_key(cfg: PipelineConfig, shard: int, sample_ids: list[str]) -> str:
    # a shard is valid only for the same stage inputs (data, settings, target) and the same samples
    return sha256_json([features_key(cfg), shard, sample_ids])


def feature_shard_done(cfg: PipelineConfig, shard: int) -> bool:
    """True if feature shard `shard` is complete on disk for the current inputs (content key and sha256 match)."""
    from .features import shard_done
    S = cfg.features.shard_samples
    ids = pq.read_table(cfg.run_dir / "tokenized" / "train.parquet", columns=["id"]).column("id").to_pylist()
    content_key = _feature_content_key(cfg, shard, ids[shard * S:(shard + 1) * S])
    return shard_done(cfg.run_dir / "features", f"shard_{shard:05d}", content_key)


def run_features_shard(cfg: PipelineConfig, shard: int, log=print) -> dict:
    """Aux hidden states of one shard of tokenized samples (features/shard_{shard:05d}.safetensors + sidecar
    .json with its sha256). Idempotent: a shard complete for the same inputs and samples is not recomputed, and
    the target is loaded (once per process) only when one is not. Returns the shard's manifest entry {shard, file,
    sha256, samples, tokens, bytes, ids, extracted, inputs_key}. Raises ValueError for a shard id out of range."""
    from .features import extract_shard, shard_done, write_head
    out, key = cfg.run_dir / "features", features_key(cfg)
    rows, name, content_key = _feature_shard_plan(cfg, shard)
    ids = _aux_ids(cfg, _num_layers(cfg))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    head_ok = (out / "head.safetensors").exists() and read_manifest(out / "head.json") == {"inputs_key": key}
    model = None
    if not head_ok or not shard_done(out, name, content_key):
        model = _loaded_target(cfg.target.model_dump_json(), device)
    if not head_ok:
        write_head(model, out)
        write_manifest(out / "head.json", {"inputs_key": key})
    t0 = time.monotonic()
    entry = extract_shard(model, rows, out, name, ids, cfg.features.batch_tokens, content_key, FEATURE_DTYPE,
                          device)
    seconds = time.monotonic() - t0
    if entry["extracted"]:
        log(f"features: shard {shard}: {entry['samples']} samples, {entry['tokens']} tokens in {seconds:.1f} s")
    return {**entry, "shard": shard, "inputs_key": key, "seconds": seconds}


def finish_features(cfg: PipelineConfig, shard_manifests: list[dict], log=print) -> dict:
    """The features stage's manifest from its shards' entries (one per id of feature_shards, any order); frees
    the target loaded for the shards. Raises ValueError naming the shards that are missing or stale."""
    from .features import store_manifest
    _loaded_target.cache_clear()
    key, want = features_key(cfg), feature_shards(cfg)
    by_id = {m["shard"]: m for m in shard_manifests if m.get("inputs_key") == key}
    if (missing := [i for i in want if i not in by_id]):
        raise ValueError(f"feature shards {missing} of {cfg.run_dir}/features are missing or stale: run them "
                         f"(run_features_shard) before finish_features")
    shards = [{k: v for k, v in by_id[i].items() if k not in ("shard", "inputs_key", "seconds")} for i in want]
    ids = _aux_ids(cfg, _num_layers(cfg))
    manifest = store_manifest(shards, ids, FEATURE_DTYPE, sum(by_id[i]["seconds"] for i in want))
    log(f"features: {manifest['samples']} samples, {manifest['tokens']} tokens, aux layers {ids}, "
        f"{manifest['bytes_per_token']:.0f} bytes/token")
    return write_manifest(cfg.run_dir / "features" / "manifest.json", {**manifest, "inputs_key": key})


def run_features(cfg: PipelineConfig, log=print) -> dict:
    """Aux hidden states of the target at the aux layer ids, sharded safetensors (features/): plan, shards, finish."""
    if (m := cached_manifest(cfg.run_dir / "features" / "manifest.json", features_key(cfg))):
        return m
    return finish_features(cfg, [run_features_shard(cfg, i, log) for i in feature_shards(cfg)], log)


def vocab_key(cfg: PipelineConfig) -> str:
    """Inputs key of the vocab stage: the tokenized data and the draft vocab size."""
    return _key(_upstream(cfg.run_dir, "tokenized")["inputs_key"], cfg.draft.draft_vocab_size)


def run_vocab(cfg: PipelineConfig, log=print) -> dict:
    """Draft vocab map from loss-masked token counts (vocab/vocab_map.safetensors: d2t, t2d, counts)."""
    from transformers import AutoConfig

    from .target import local_model_dir
    from .vocab_map import build_vocab_map, count_tokens
    out = cfg.run_dir / "vocab"
    key = vocab_key(cfg)
    if (m := cached_manifest(out / "manifest.json", key)):
        return m
    t0 = time.monotonic()
    V = AutoConfig.from_pretrained(local_model_dir(cfg.target)).vocab_size
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
    from transformers import AutoConfig

    from .draft_model import DraftShape
    from .target import local_model_dir
    tcfg = AutoConfig.from_pretrained(local_model_dir(cfg.target))
    return DraftShape.from_target_config(tcfg, cfg.draft.draft_vocab_size, _aux_ids(cfg, tcfg.num_hidden_layers))


def _fresh_draft(cfg: PipelineConfig):
    from .features import load_head
    from .trainer import build_draft
    vocab = load_file(str(cfg.run_dir / "vocab" / "vocab_map.safetensors"))
    emb, lm = load_head(cfg.run_dir / "features")
    return build_draft(_draft_shape(cfg), emb, vocab["d2t"], vocab["t2d"], cfg.draft.seed), lm


def train_key(cfg: PipelineConfig) -> str:
    """Inputs key of the train stage: features, vocab map, training and draft settings."""
    return _key(_upstream(cfg.run_dir, "features")["inputs_key"], _upstream(cfg.run_dir, "vocab")["inputs_key"],
                cfg.train, cfg.draft)


def run_train(cfg: PipelineConfig, log=print) -> dict:
    """Train the draft with TTT (draft/), then export the best epoch as an SGLang-loadable directory
    (draft/export), validated by reloading it strictly and comparing logits exactly."""
    from .features import load_samples
    from .trainer import train
    out = cfg.run_dir / "draft"
    key = train_key(cfg)
    if (m := cached_manifest(out / "manifest.json", key)):
        return m
    t0 = time.monotonic()
    samples = load_samples(cfg.run_dir / "features")
    n_eval = int(len(samples) * cfg.train.eval_frac)
    train_s, eval_s = samples[n_eval:], samples[:n_eval]
    draft, lm_head = _fresh_draft(cfg)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "inputs_key").exists() and (out / "inputs_key").read_text() != key:
        (out / "training_state.pt").unlink(missing_ok=True)   # state of other inputs: never resume from it
    (out / "inputs_key").write_text(key)
    summary = train(draft, train_s, eval_s, lm_head, cfg.train, out, log=log)
    best = load_draft(out / "best")
    export = save_draft(best, out / "export")
    reloaded = load_draft(export)
    check = _logits_probe(best, reloaded)
    if not check:
        raise RuntimeError(f"export {export} does not reproduce the trained draft's logits")
    log(f"train: best epoch {summary['best']['epoch']} (tau_sim {summary['best']['tau_sim']:.2f}); "
        f"exported to {export}")
    return write_manifest(out / "manifest.json", {
        "inputs_key": key, "export_dir": str(export), "best": summary["best"], "steps": summary["steps"],
        "history": summary["history"], "train_samples": len(train_s), "eval_samples": len(eval_s),
        "seconds": time.monotonic() - t0})


@torch.no_grad()
def _logits_probe(a, b) -> bool:
    """True if drafts a and b give bit-identical step-0 logits on a fixed random input."""
    g = torch.Generator().manual_seed(0)
    T = 8
    aux = torch.randn(1, T, 3 * a.shape.target_hidden_size, generator=g)
    ids = torch.randint(0, a.shape.vocab_size, (1, T), generator=g)
    pos = torch.arange(T)[None]
    la = a.decode(ids, a.fuse(aux), pos, {})[1]
    lb = b.decode(ids, b.fuse(aux), pos, {})[1]
    return torch.equal(la, lb)


def evaluate_key(cfg: PipelineConfig) -> str:
    """Inputs key of the evaluate stage: the trained draft, the eval settings and the held-out prompts."""
    return _key(_upstream(cfg.run_dir, "draft")["inputs_key"], cfg.eval,
                _upstream(cfg.run_dir, "prompts")["inputs_key"])


def run_evaluate(cfg: PipelineConfig, log=print) -> dict:
    """Offline tau of the trained draft and of an untrained draft on the held-out prompts (eval/report.json)."""
    from .evaluate import measure
    from .speculate import TargetRunner
    from .target import load_target, load_tokenizer
    out = cfg.run_dir / "eval"
    up = _upstream(cfg.run_dir, "draft")
    key = evaluate_key(cfg)
    if (m := cached_manifest(out / "manifest.json", key)):
        return m
    t0 = time.monotonic()
    tok = load_tokenizer(cfg.target)
    model = load_target(cfg.target)
    rows = prompts_mod.read_rows(cfg.run_dir / "prompts" / "eval.parquet")
    prompts = [prompt_ids(tok, r["messages"]) for r in rows]
    trained = load_draft(Path(up["export_dir"]))
    untrained, _ = _fresh_draft(cfg)
    ids = trained.shape.aux_layer_ids
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    report = measure(TargetRunner(model, ids), {"trained": trained, "untrained": untrained}, prompts,
                     cfg.eval.max_new_tokens, eos, cfg.eval.num_draft_steps, cfg.eval.tie_gap)
    report.update({"eval_ids": [r["id"] for r in rows], "num_draft_steps": cfg.eval.num_draft_steps,
                   "max_new_tokens": cfg.eval.max_new_tokens, "aux_layer_ids": ids})
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    log(f"eval: tau trained {report['trained']['tau']:.2f}, untrained {report['untrained']['tau']:.2f}, "
        f"lossless {report['trained']['lossless']}")
    return write_manifest(out / "manifest.json", {"inputs_key": key, "report": str(out / "report.json"),
                                                  "summary": report, "seconds": time.monotonic() - t0})


def deploy_llama_cpp_key(cfg: PipelineConfig) -> str:
    """Inputs key of the llama.cpp deployment stage: the trained draft, eval settings, host, held-out prompts."""
    return _key(_upstream(cfg.run_dir, "draft")["inputs_key"], cfg.eval, cfg.server.host,
                _upstream(cfg.run_dir, "prompts")["inputs_key"])


def run_deploy_llama_cpp(cfg: PipelineConfig, log=print) -> dict:
    """Deploy the exported draft on llama.cpp (GGUF conversion, `--spec-type draft-eagle3`) and benchmark it
    against the same server without a draft on the held-out prompts, greedy, one stream (deploy_llama_cpp/).
    Skipped (manifest says why) when the target is not a GGUF file llama.cpp can serve."""
    from .serving.launcher import llama_server
    from .serving.llama_cpp import LLAMA_CPP_TIE_GAP, convert_draft, run_requests, summarize
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
        base = run_requests(url, rows, n_new)
    spec_args = ["-md", str(draft_gguf), "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(S),
                 "--spec-draft-n-min", str(S)]
    with llama_server(gguf, out / "eagle3.log", extra_args=spec_args, **common) as url:
        spec = run_requests(url, rows, n_new)
    summary = {**summarize(base, spec, LLAMA_CPP_TIE_GAP), "num_draft_steps": S, "max_new_tokens": n_new,
               "tie_gap": LLAMA_CPP_TIE_GAP, "draft_gguf": str(draft_gguf),
               "server_args": spec_args[2:]}                                 # without the local -md path
    log(f"deploy: llama.cpp tau {summary['tau']:.2f}, {summary['tokens_per_s']:.1f} tok/s with the draft vs "
        f"{summary['baseline_tokens_per_s']:.1f} without ({summary['speedup']:.2f}x); lossless {summary['lossless']}")
    return write_manifest(out / "manifest.json", {"inputs_key": key, "summary": summary,
                                                  "seconds": time.monotonic() - t0})
