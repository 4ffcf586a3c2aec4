"""The pipeline stages as plain functions: each reads its inputs under the run directory, writes its outputs and
finishes by writing a manifest atomically (DESIGN.md 'data contracts'). A stage whose manifest was written for the
same inputs key is not recomputed. Prefect tasks wrap these one to one; they work without Prefect too.

Run layout: prompts/ generations/ tokenized/ features/ vocab/ draft/ eval/, each with manifest.json.
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file, save_file

from . import prompts as prompts_mod
from .checkpoint import clear_training_state, load_draft, save_draft
from .config import PipelineConfig, default_aux_layer_ids
from .data import assistant_content, prompt_ids, tokenize_chat
from .manifest import cached_manifest, sha256_file, sha256_json, write_manifest

CODE_VERSION = "2"  # bump when a stage's output format or semantics change


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
    return {"target": cfg.target.model_dump(), "gguf_sha256": sha256_file(gguf) if gguf else None}


def run_prompts(cfg: PipelineConfig, log=print) -> dict:
    """Read, normalize, reject, dedupe, sample and split the prompt sources into prompts/{train,eval}.parquet;
    bad rows go to prompts/rejects.jsonl with source, row and reason."""
    out = cfg.run_dir / "prompts"
    key = _key(cfg.prompts, prompts_mod.source_fingerprints(cfg.prompts))
    if (m := cached_manifest(out / "manifest.json", key)):
        return m
    t0 = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    train, evals, stats = prompts_mod.build_prompts(cfg.prompts, rejects_path=out / "rejects.jsonl")
    prompts_mod.write_rows(out / "train.parquet", train)
    prompts_mod.write_rows(out / "eval.parquet", evals)
    kept = sum(r["mode"] == "keep" for r in train)
    log(f"prompts: {len(train)} train ({kept} with responses kept), {len(evals)} held-out, {stats['rejected']} "
        f"rejected, {stats['duplicates_dropped']} duplicates; per source: "
        + ", ".join(f"{k} {v.get('train', 0)}+{v.get('eval', 0)}" for k, v in stats["per_source"].items()))
    specs = prompts_mod.source_specs(cfg.prompts)
    return write_manifest(out / "manifest.json", {
        "inputs_key": key, "stats": stats, "train_ids": [r["id"] for r in train],
        "eval_ids": [r["id"] for r in evals], "sources": [s.model_dump(exclude_defaults=True) for s in specs],
        "unpinned": [s.label for s in specs if s.hf and not s.revision and s.hf not in ("json", "parquet")],
        "rejects": str(out / "rejects.jsonl"), "seconds": time.monotonic() - t0})


def run_generation(cfg: PipelineConfig, log=print, shard_size: int = 32) -> dict:
    """Regenerate responses for the train prompts with the target behind an OpenAI-compatible server: the final
    assistant turn, given the turns before it. Rows in mode 'keep' are not sent (finish_reason 'kept').

    kind 'llama.cpp': starts llama-server on the target's GGUF for this stage only (stopped on success, failure
    or cancel). Resumable: finished shards (generations/shard_*.parquet) are kept and skipped on rerun.
    """
    from .serving.client import check_reachable, generate_all
    from .serving.launcher import llama_server
    from .target import gguf_path

    out = cfg.run_dir / "generations"
    up = _upstream(cfg.run_dir, "prompts")
    key = _key(cfg.generation, up["inputs_key"], _target_key(cfg), cfg.server.kind, cfg.server.url)
    if (m := cached_manifest(out / "manifest.json", key)):
        return m
    t0 = time.monotonic()
    rows = prompts_mod.read_rows(cfg.run_dir / "prompts" / "train.parquet")
    out.mkdir(parents=True, exist_ok=True)
    if (out / "inputs_key").exists() and (out / "inputs_key").read_text() != key:
        for stale in out.glob("shard_*.parquet"):                      # shards of other inputs: regenerate
            stale.unlink()
    (out / "inputs_key").write_text(key)
    shards = [(i, rows[i:i + shard_size]) for i in range(0, len(rows), shard_size)]

    def shard_path(i: int) -> Path:                                        # i: index of the shard's first row
        return out / f"shard_{i // shard_size:05d}.parquet"

    def kept(r: dict) -> dict:                                             # responses kept as they are
        return {**r, "response": "", "reasoning": "", "finish_reason": "kept", "completion_tokens": 0, "model": "",
                "timings": "{}", "logprobs": "[]", "latency_s": 0.0}

    for i, part in shards:
        if not shard_path(i).exists() and all(r.get("mode") == "keep" for r in part):
            prompts_mod.write_rows(shard_path(i), [kept(r) for r in part])
    todo = [(i, part) for i, part in shards if not shard_path(i).exists()]
    g = cfg.generation

    def generate(url: str) -> None:
        """All pending prompts in one pass (no idle slots between shards); a shard is written once complete."""
        asyncio.run(check_reachable(url))
        shard_of = {r["id"]: i for i, part in todo for r in part}
        done = {i: {r["id"]: kept(r) for r in part if r.get("mode") == "keep"} for i, part in todo}
        parts = dict(todo)
        t1, n_tok = time.monotonic(), [0, 0]

        def on_done(row: dict) -> None:
            i = shard_of[row["id"]]
            done[i][row["id"]] = row
            n_tok[0] += row["completion_tokens"]
            n_tok[1] += 1
            if len(done[i]) == len(parts[i]):
                prompts_mod.write_rows(shard_path(i), [done[i][r["id"]] for r in parts[i]])
                log(f"generation: {n_tok[1]}/{sum(len(p) for p in parts.values())} prompts this run, "
                    f"{n_tok[0] / (time.monotonic() - t1):.0f} tok/s")

        send = [r for _, part in todo for r in part if r.get("mode") != "keep"]
        asyncio.run(generate_all(url, send, g.max_new_tokens, g.temperature, g.concurrency, g.max_retries,
                                 g.request_timeout_s, on_done=on_done))

    server = cfg.server
    if todo and server.kind == "llama.cpp":
        gguf = gguf_path(cfg.target)
        if gguf is None:
            raise ValueError("server.kind 'llama.cpp' needs a GGUF target; use server.kind 'external' with "
                             "server.url for an SGLang server")
        with llama_server(gguf, out / "server.log", server.host, server.port, server.parallel,
                          server.ctx_per_slot, server.startup_timeout_s) as url:
            generate(url)
        server_desc = f"llama.cpp llama-server ({gguf.name})"
    elif todo:
        if not server.url:
            raise ValueError("server.kind 'external' needs server.url (e.g. http://127.0.0.1:30000)")
        generate(server.url.rstrip("/"))
        server_desc = server.url
    else:
        server_desc = "(all shards were already done)"
    done_rows = [r for i, _ in shards for r in prompts_mod.read_rows(shard_path(i))]
    finish = {}
    for r in done_rows:
        finish[r["finish_reason"]] = finish.get(r["finish_reason"], 0) + 1
    return write_manifest(out / "manifest.json", {
        "inputs_key": key, "samples": len(done_rows), "completion_tokens": sum(r["completion_tokens"]
                                                                              for r in done_rows),
        "finish_reasons": finish, "sampling": {"temperature": g.temperature, "max_new_tokens": g.max_new_tokens,
                                               "greedy": g.temperature == 0.0},
        "server": server_desc, "shards": [shard_path(i).name for i, _ in shards],
        "seconds": time.monotonic() - t0})


def run_tokenize(cfg: PipelineConfig, log=print) -> dict:
    """Tokenize each conversation with the target's chat template; loss mask over assistant tokens: the
    regenerated final turn of prompt rows, every assistant turn of rows kept as they are (data.tokenize_chat).
    Samples longer than features.max_length are cut or dropped (prompts.overlong), counted in the manifest."""
    from .target import load_tokenizer
    out = cfg.run_dir / "tokenized"
    up = _upstream(cfg.run_dir, "generations")
    key = _key(up["inputs_key"], cfg.features.max_length, cfg.prompts.overlong, _target_key(cfg))
    if (m := cached_manifest(out / "manifest.json", key)):
        return m
    t0 = time.monotonic()
    tok = load_tokenizer(cfg.target)
    rows, n_cut, dropped = [], 0, []
    for shard in up["shards"]:
        for r in prompts_mod.read_rows(cfg.run_dir / "generations" / shard):
            if r.get("mode") == "keep":
                msgs, train, truncated = r["messages"], "all", False
            else:
                answer = {"role": "assistant", "content": assistant_content(r["response"], r["reasoning"])}
                msgs, train, truncated = r["messages"] + [answer], "last", r["finish_reason"] == "length"
            seq = tokenize_chat(tok, msgs, r["id"], train=train, truncated=truncated,
                                max_length=cfg.features.max_length, overlong=cfg.prompts.overlong)
            if seq is None:
                dropped.append(r["id"])
                continue
            n_cut += seq["cut"]
            rows.append({"id": r["id"], "input_ids": seq["input_ids"], "loss_mask": seq["loss_mask"]})
    if not rows:
        raise ValueError(f"tokenize: every sample is longer than features.max_length {cfg.features.max_length} "
                         f"and prompts.overlong is 'drop'; raise max_length or use 'truncate'")
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out / "train.parquet")
    n_tok, n_loss = sum(len(r["input_ids"]) for r in rows), sum(sum(r["loss_mask"]) for r in rows)
    log(f"tokenize: {len(rows)} samples, {n_tok} tokens, {n_loss} in the loss mask; over max_length "
        f"{cfg.features.max_length}: {n_cut} cut, {len(dropped)} dropped")
    return write_manifest(out / "manifest.json", {
        "inputs_key": key, "samples": len(rows), "tokens": n_tok, "loss_tokens": n_loss,
        "overlong": {"policy": cfg.prompts.overlong, "max_length": cfg.features.max_length, "cut": n_cut,
                     "dropped": len(dropped), "dropped_ids": dropped[:100]},
        "token_source": "re-tokenized with the target's chat template (the OpenAI API returns text, not ids)",
        "seconds": time.monotonic() - t0})


def _aux_ids(cfg: PipelineConfig, num_layers: int) -> list[int]:
    return cfg.features.aux_layer_ids or default_aux_layer_ids(num_layers)


def run_features(cfg: PipelineConfig, log=print) -> dict:
    """Aux hidden states of the target at the aux layer ids, sharded safetensors (features/)."""
    from .features import bad_shards, extract_features
    from .target import load_target
    out = cfg.run_dir / "features"
    up = _upstream(cfg.run_dir, "tokenized")
    key = _key(up["inputs_key"], cfg.features, _target_key(cfg))
    if (m := cached_manifest(out / "manifest.json", key)):
        if not (bad := bad_shards(out, m["shards"])):            # data on disk is the source of truth
            return m
        log(f"features: shard(s) {bad} missing or failing their sha256; extracting them again")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_target(cfg.target, device)
    ids = _aux_ids(cfg, model.config.num_hidden_layers)
    rows = pq.read_table(cfg.run_dir / "tokenized" / "train.parquet").to_pylist()
    f = cfg.features
    manifest = extract_features(model, rows, out, ids, f.shard_samples, f.batch_tokens, store_format=f.format,
                                log=log, target=cfg.target.model_dump(), writer_threads=f.writer_threads)
    log(f"features: {manifest['samples']} samples, {manifest['tokens']} tokens, aux layers {ids}, "
        f"format {f.format}, {manifest['bytes_per_token']:.0f} bytes/token")
    return write_manifest(out / "manifest.json", {**manifest, "inputs_key": key})


def run_vocab(cfg: PipelineConfig, log=print) -> dict:
    """Draft vocab map from loss-masked token counts (vocab/vocab_map.safetensors: d2t, t2d, counts)."""
    from transformers import AutoConfig

    from .target import local_model_dir
    from .vocab_map import build_vocab_map, count_tokens
    out = cfg.run_dir / "vocab"
    up = _upstream(cfg.run_dir, "tokenized")
    key = _key(up["inputs_key"], cfg.draft.draft_vocab_size)
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
    """Inputs key of the training stage: features, vocab map, train and draft settings (any number of GPUs)."""
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
        clear_training_state(out)                             # state of other inputs: never resume from it
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


def _category(row: dict) -> str:
    """Prompt category for tau per category: meta['category'] (Spec-Bench rows) or the row's source."""
    meta = json.loads(row.get("meta") or "{}")
    return str(meta.get("category") or row.get("source") or "all")


def run_evaluate(cfg: PipelineConfig, log=print) -> dict:
    """Pre-flight check of the exported draft against the target, then offline tau on the held-out prompts: the
    trained draft as a chain and as an SGLang-style tree, an untrained draft as a chain; simulated vs measured tau
    (eval/report.json). Raises PreflightError listing every mismatch between the draft and the target."""
    from transformers import AutoConfig

    from .evaluate import SpecRun, measure, tau_consistency
    from .preflight import preflight
    from .speculate import TargetRunner
    from .target import load_target, load_tokenizer, local_model_dir
    out = cfg.run_dir / "eval"
    up = _upstream(cfg.run_dir, "draft")
    key = _key(up["inputs_key"], cfg.eval, _upstream(cfg.run_dir, "prompts")["inputs_key"])
    if (m := cached_manifest(out / "manifest.json", key)):
        return m
    t0 = time.monotonic()
    preflight(Path(up["export_dir"]), AutoConfig.from_pretrained(local_model_dir(cfg.target)))
    tok = load_tokenizer(cfg.target)
    model = load_target(cfg.target)
    rows = prompts_mod.read_rows(cfg.run_dir / "prompts" / "eval.parquet")
    prompts = [prompt_ids(tok, r["messages"]) for r in rows]
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
    report = measure(TargetRunner(model, ids), runs, prompts, [_category(r) for r in rows], e.max_new_tokens, eos,
                     e.tie_gap)
    report.update({"eval_ids": [r["id"] for r in rows], "num_draft_steps": S, "max_new_tokens": e.max_new_tokens,
                   "aux_layer_ids": ids, "preflight": "passed",
                   "consistency": tau_consistency(report["trained"]["tau"], up, S)})
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    tree = report.get("trained_tree")
    log(f"eval: tau trained {report['trained']['tau']:.2f} (chain)"
        + (f", {tree['tau']:.2f} (tree k={e.tree_topk}, T={e.tree_num_draft_tokens})" if tree else "")
        + f", untrained {report['untrained']['tau']:.2f}; lossless {report['trained']['lossless']}; "
        + report["consistency"]["note"])
    return write_manifest(out / "manifest.json", {"inputs_key": key, "report": str(out / "report.json"),
                                                  "summary": report, "seconds": time.monotonic() - t0})


def run_deploy_llama_cpp(cfg: PipelineConfig, log=print) -> dict:
    """Deploy the exported draft on llama.cpp (GGUF conversion, `--spec-type draft-eagle3`) and benchmark it
    against the same server without a draft on the held-out prompts, greedy, one stream (deploy_llama_cpp/).
    Skipped (manifest says why) when the target is not a GGUF file llama.cpp can serve."""
    from .serving.launcher import llama_server
    from .serving.llama_cpp import LLAMA_CPP_TIE_GAP, convert_draft, run_requests, summarize
    from .target import gguf_path, local_model_dir
    out = cfg.run_dir / "deploy_llama_cpp"
    up = _upstream(cfg.run_dir, "draft")
    key = _key(up["inputs_key"], cfg.eval, cfg.server.host, _upstream(cfg.run_dir, "prompts")["inputs_key"])
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
