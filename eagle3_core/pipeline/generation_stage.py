"""Stage `generation`: the target's own answers to the train prompts, one shard of generation.shard_size prompts at
a time (generations/shard_NNNNN.parquet with a .json record each), then the quality gate (quality.json)."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import nullcontext
from functools import lru_cache
from pathlib import Path

import torch

from eagle3_core.config import PipelineConfig, TargetConfig
from eagle3_core.config.sampling_config import SamplingConfig
from eagle3_core.contract.layout import RunLayout
from eagle3_core.contract.manifest import busy_seconds, write_manifest
from eagle3_core.contract.shard_plan import append_only_ranges, rows_digest
from eagle3_core.data.markers import stop_ids
from eagle3_core.generation.answer_shard import finished_record, holds_more_rows
from eagle3_core.generation.quality import check_quality, quality_report
from eagle3_core.generation.regenerate import prompt_digests, regenerate
from eagle3_core.generation.servers import generation_servers
from eagle3_core.pipeline import run as stage_run
from eagle3_core.pipeline.keys import stage_key, target_key, upstream_keys, upstream_manifest
from eagle3_core.pipeline.stage import Shards, Stage
from eagle3_core.serving.client import TOKEN_ID_APIS
from eagle3_core.serving.hf_generate import BatchedGenerator
from eagle3_core.target.loading import gguf_path, load_target, load_tokenizer


def _sampling(cfg: PipelineConfig) -> dict:
    g = cfg.generation
    return {"api": g.api_for(cfg.server.kind), "max_new_tokens": g.max_new_tokens, "temperature": g.temperature,
            "server_kind": cfg.server.kind, "top_p": g.top_p, "chat_template_kwargs": g.chat_template_kwargs,
            "turns": g.turns, "max_turns": g.max_turns,
            # top_k and seed (newer than the key) count when sampled and set: greedy answers ignore them
            **{k: getattr(g, k) for k in ("top_k", "seed")
               if not g.greedy and getattr(g, k) != SamplingConfig.model_fields[k].default}}


def generation_key(cfg: PipelineConfig, up: dict | None = None) -> str:
    """Key of the generation stage's answers as a whole: what they depend on (sampling, the prompts stage's key
    (`up`: {'prompts': its key}; default: read from its manifest), the target, the server kind; not concurrency,
    retries or server addresses, so a rerun with other servers resumes). Shard records written before shards named
    their own rows carry it (accepted for the same prompts: _record_ok)."""
    up = upstream_keys(cfg, ROW) if up is None else up
    return stage_key({**_sampling(cfg), "shard_size": cfg.generation.shard_size}, up["prompts"], target_key(cfg))


def generation_shard_key(cfg: PipelineConfig) -> str:
    """Key of one generation shard's answers apart from its rows (sampling, target, server kind): a shard record
    names it and the digest of its rows (shard_plan.rows_digest), so that a shard is reused for the same rows
    whatever else the prompt set holds (a grown run keeps every finished shard)."""
    return stage_key(_sampling(cfg), target_key(cfg))


_TARGET_LOCK = threading.Lock()


def loaded_target(target_json: str, device: str, dtype: torch.dtype | None = None):
    """The target, loaded once per process for all in-process generation shards of a run (fp32; cleared by
    finish_generation). dtype None: load_target's default. The flow's shard tasks are threads of one process: the
    first loads and the others wait for its model (two loads at once failed: transformers' lazy imports and its
    meta-device initialisation are not thread-safe, "Cannot copy out of meta tensor")."""
    with _TARGET_LOCK:
        return _loaded_target(target_json, device, dtype)


@lru_cache(maxsize=1)
def _loaded_target(target_json: str, device: str, dtype: torch.dtype | None):
    return load_target(TargetConfig.model_validate_json(target_json), device, dtype)


@lru_cache(maxsize=4)
def _row_digests(path: Path, size: int, mtime_ns: int) -> tuple[list[str], list[str], list[str]]:
    return prompt_digests(path)


def prompt_rows(cfg: PipelineConfig) -> tuple[list[str], list[str], list[str]]:
    """(ids, prompt digests, modes) of the train prompts, read once per version of the file."""
    path = RunLayout(cfg.run_dir).prompts_train
    st = path.stat()
    return _row_digests(path, st.st_size, st.st_mtime_ns)


def _record(path: Path) -> dict:
    """A shard record ({} if there is none), parsed once per version of the file (a stat per call): the plan reads
    every record, and every shard task asks for the plan."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return {}
    return _parsed_record(path, st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=65536)
def _parsed_record(path: Path, size: int, mtime_ns: int) -> dict:
    return json.loads(path.read_text())


def generation_plan(cfg: PipelineConfig) -> list[tuple[int, int, str]]:
    """[(start, stop, rows digest)] of every generation shard: append-only (shard_plan.append_only_ranges), a shard
    whose record was written for exactly its rows keeps them, the rest are cut into generation.shard_size rows.
    Raises FileNotFoundError if the prompts stage has not run.
    Remove the `legacy` key when runs written before 1e5d694 are no longer supported: their shards are then answered
    again (compat.LEGACY_READERS)."""
    upstream_manifest(cfg.run_dir, "prompts")
    ids, digests, _ = prompt_rows(cfg)
    out, key, legacy, S = RunLayout(cfg.run_dir).generations, generation_shard_key(cfg), generation_key(cfg), \
        cfg.generation.shard_size

    def kept(k: int, start: int) -> int | None:
        rec = _record(out / f"shard_{k:05d}.json")
        n = rec.get("prompts") or 0
        if rec.get("inputs_key") == key and rec.get("rows_sha256") == rows_digest(ids[start:start + n],
                                                                                  digests[start:start + n]):
            return n
        return n if rec.get("inputs_key") == legacy and start == k * S else None

    ranges = append_only_ranges(len(ids), S, kept)
    if len(ranges) > 1 and holds_more_rows(out, len(ranges) - 1, ids[ranges[-1][0]:ranges[-1][1]], (key, legacy)):
        ranges.pop()                # a lower num_train ends inside a finished shard: trained on fewer, shard kept
    return [(a, b, rows_digest(ids[a:b], digests[a:b])) for a, b in ranges]


def _record_ok(out: Path, k: int, plan: list[tuple[int, int, str]], key: str, legacy: str) -> dict | None:
    """Shard k's finished record for its planned rows under the shard key `key`, or one written under the stage's
    `legacy` key (generation_key) before records named their rows. Remove `legacy` when runs written before 1e5d694
    are no longer supported (compat.LEGACY_READERS)."""
    return finished_record(out, k, key, plan[k][2]) or finished_record(out, k, legacy)


def generation_records(cfg: PipelineConfig, up: dict | None = None) -> dict:
    """{shards, done, needs_server, records} of the generation stage from one read of the prompt file and the
    records, given the upstream keys `up` (default: read): shard ids, the finished ones, whether an unfinished one
    holds a row to send (not every row 'keep') and {finished shard: its record}."""
    plan, out = generation_plan(cfg), RunLayout(cfg.run_dir).generations
    key, legacy = generation_shard_key(cfg), generation_key(cfg, up)
    records = {k: rec for k in range(len(plan)) if (rec := _record_ok(out, k, plan, key, legacy))}
    modes = prompt_rows(cfg)[2]
    needs = any(m != "keep" for k, (a, b, _) in enumerate(plan) if k not in records for m in modes[a:b])
    return {"shards": list(range(len(plan))), "done": sorted(records), "needs_server": needs, "records": records}


def generation_status(cfg: PipelineConfig) -> dict:
    """{shards, done, needs_server} of the generation stage (generation_records without the records)."""
    return {k: v for k, v in generation_records(cfg).items() if k != "records"}


def _gate_limits(g) -> dict:
    return {"failed": g.max_failed_frac, "empty": g.max_empty_frac, "truncated": g.max_truncated_frac,
            "degenerate": g.max_degenerate_frac}


# the generation settings that change the answers (_sampling, shard_size) or the gate's verdict (_gate_limits); the
# rest say how they are fetched (concurrency, retries, timeouts, flushing, progress) and stay out of the key
GENERATION_HOW_FIELDS = ("concurrency", "max_retries", "retry_backoff_s", "request_timeout_s", "flush_rows",
                         "flush_s", "progress_interval_s", "gate_after")


def generation_stage_key(cfg: PipelineConfig, up: dict | None = None) -> str:
    """Inputs key of the generation stage's manifest: the shards' key (generation_key over `up`) and the quality
    gate's limits."""
    return stage_key(generation_key(cfg, up), _gate_limits(cfg.generation))


def generation_shard_done(cfg: PipelineConfig, shard: int, up: dict | None = None) -> dict | None:
    """Shard `shard`'s record if it is finished for the current inputs (record and file agree, no failed prompt,
    written for the shard's rows), given the upstream keys `up` (default: read)."""
    plan = generation_plan(cfg)
    if not 0 <= shard < len(plan):
        return None
    return _record_ok(RunLayout(cfg.run_dir).generations, shard, plan, generation_shard_key(cfg),
                      generation_key(cfg, up))


def generation_shard_needs_server(cfg: PipelineConfig, shard: int) -> bool:
    """True if shard `shard` holds prompt rows to regenerate (rows in mode 'keep' are never sent)."""
    a, b, _ = generation_plan(cfg)[shard]
    return any(m != "keep" for m in prompt_rows(cfg)[2][a:b])


def _server_desc(cfg: PipelineConfig) -> str:
    """What answered the prompts, for the manifest: none when every row is kept as it is (no request was sent,
    whatever server.kind says: a Hugging Face target under the default kind 'llama.cpp' has no GGUF to name)."""
    if all(m == "keep" for m in prompt_rows(cfg)[2]):
        return "none (every row kept as it is)"
    if cfg.server.kind == "llama.cpp":
        return f"llama.cpp llama-server ({gguf_path(cfg.target).name})"
    if cfg.server.kind == "sglang":
        return f"SGLang ({cfg.target.model})"
    if cfg.server.kind == "transformers":
        return f"transformers in-process ({cfg.target.model})"
    return ", ".join(cfg.server.base_urls())


def generation_shards(cfg: PipelineConfig, log=print) -> list[int]:
    """Indices of this run's generation shards (generation_plan), finished or not: `run_generation_shard` returns a
    finished shard's record at once. Shards on disk past the last one (left by a larger prompt set: a night with a
    lower prompts.num_train) are kept, never deleted, and used again when the set grows back; `log` says how many.
    Raises FileNotFoundError if the prompts stage has not run."""
    plan, out = generation_plan(cfg), RunLayout(cfg.run_dir).generations
    n = len(plan)
    out.mkdir(parents=True, exist_ok=True)
    if past := sorted(k for f in out.glob("shard_*.parquet") if (k := int(f.stem.split("_")[1])) >= n):
        log(f"generation: this run has {n} shard(s); {len(past)} more on disk (shards {past[0]}..{past[-1]}, of a "
            f"larger prompt set) kept unused, not deleted: they count again when prompts.num_train grows back")
    ids, keys = prompt_rows(cfg)[0], (generation_shard_key(cfg), generation_key(cfg))
    if n == 1 and holds_more_rows(out, 0, ids[plan[0][0]:plan[0][1]], keys):
        log(f"generation: prompts.num_train ends inside shard 0, which holds more answers: it is rewritten for its "
            f"first {plan[0][1]} rows from its own answers (none sent again) and a copy of it kept in "
            f"generations/held/, whose answers count again when prompts.num_train grows back")
    return list(range(n))


def _regenerate(cfg: PipelineConfig, shards: list[int], urls: list[str], log, on_progress) -> list[dict]:
    plan = generation_plan(cfg)
    ranges = {k: (plan[k][0], plan[k][1]) for k in shards}
    in_process = cfg.server.kind == "transformers"
    tok = load_tokenizer(cfg.target) if cfg.generation.api_for(cfg.server.kind) in TOKEN_ID_APIS or in_process \
        else None
    engine = _generation_engine(cfg, tok, log) if in_process else None
    try:
        return asyncio.run(regenerate(RunLayout(cfg.run_dir).prompts_train, RunLayout(cfg.run_dir).generations,
                                      ranges, generation_shard_key(cfg), cfg.generation, cfg.server, urls, tok, log,
                                      on_progress, engine, rows_sha256={k: plan[k][2] for k in shards}))
    finally:
        if engine is not None:
            engine.close()


def _generation_engine(cfg: PipelineConfig, tok, log):
    """server.kind 'transformers': the target in this process (fp32; CUDA when available), batches of
    generation.concurrency rows."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = cfg.generation
    log(f"generation: target in this process on {device} (transformers, batches of {g.concurrency})")
    # loaded once per process: the flow's shard tasks (threads of one process) share it; finish_generation frees it
    model = loaded_target(cfg.target.model_dump_json(), device, torch.float32)
    return BatchedGenerator(model, tok, g.concurrency, g.max_new_tokens, g.temperature,
                            stop_ids=stop_ids(tok, model.generation_config.eos_token_id))


def run_generation_shard(cfg: PipelineConfig, shard: int, log=print, urls: list[str] | None = None,
                         on_progress=None) -> dict:
    """Regenerate the answers of one shard (generations/shard_{shard:05d}.parquet); returns its record (counts,
    failures with reasons, retries, finish reasons, quality counts: small and JSON-able).

    Idempotent: a finished shard (record for the same inputs, file intact by manifest.file_intact, no failures)
    is returned untouched; otherwise only its unanswered prompts are sent. `urls`: running servers (e.g. from
    `generation_servers`, to keep one server across shards); None starts the configured server for this shard alone.
    `on_progress`: see `regenerate.regenerate`. Raises ValueError for a shard index out of range, ServerError when no
    server answers.
    """
    n = len(generation_plan(cfg))
    if not 0 <= shard < n:
        raise ValueError(f"generation shard {shard} out of range: this run has shards 0..{n - 1}")
    if (rec := stage_run.decision(cfg, ROW, shard).record):          # the shard task's one done decision
        log(f"generation: shard {shard} already finished ({rec['answered']} answers)")
        return rec
    if urls is None and not generation_shard_needs_server(cfg, shard):
        urls = []                                                     # every row kept as it is: no server
    if urls is None:
        with generation_servers(cfg) as started:
            return _regenerate(cfg, [shard], started, log, on_progress)[0]
    return _regenerate(cfg, [shard], urls, log, on_progress)[0]


def finish_generation(cfg: PipelineConfig, shard_manifests: list[dict], seconds: float | None = None) -> dict:
    """Check every shard against its record on disk, run the quality gate and write generations/manifest.json
    (and quality.json). `shard_manifests`: the records `run_generation_shard` returned (each must match the
    record on disk); `seconds`: the stage's wall time (default: the time any shard ran, manifest.busy_seconds: the
    shard tasks run side by side, and their sum overstated the demo's 368 s as 726 s).

    Raises RuntimeError naming a shard that has not finished, ValueError for a record that does not match the
    disk, QualityGateError (with counts, examples and the fix) when too many answers failed, are empty, truncated
    or degenerate."""
    _loaded_target.cache_clear()
    out, key, g = RunLayout(cfg.run_dir).generations, generation_shard_key(cfg), cfg.generation
    plan, legacy = generation_plan(cfg), generation_key(cfg)

    def body() -> dict:
        records = []
        for k in range(len(plan)):
            rec = _record_ok(out, k, plan, key, legacy)
            if rec is None:
                raise RuntimeError(f"generation shard {k} has not finished for these inputs ({out}/shard_{k:05d}"
                                   f".json): run run_generation_shard(cfg, {k}) (or the generation stage) again")
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
        return {
            "shards_key": key, "samples": report["answered"], "prompts": report["prompts"],
            "completion_tokens": sum(r["completion_tokens"] for r in records), "finish_reasons": finish,
            "failed": report["counts"]["failed"], "failures": [f for r in records for f in r["failures"]][:100],
            "retries": sum(r["retries"] for r in records), "retry_kinds": kinds, "quality": report,
            "sampling": {"temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k, "seed": g.seed,
                         "max_new_tokens": g.max_new_tokens,
                         "greedy": g.temperature == 0.0, "chat_template_kwargs": g.chat_template_kwargs},
            "turns": {"mode": g.turns, "max_turns": g.max_turns, **_request_counts(records)},
            "api": g.api_for(cfg.server.kind), "token_ids": "from the server (prompt_ids, output_ids)"
            if g.api_for(cfg.server.kind) in TOKEN_ID_APIS else None,
            "server": _server_desc(cfg), "shards": [r["file"] for r in records],
            "seconds": seconds if seconds is not None else busy_seconds(records)}

    return stage_run.run(stage_run.decision(cfg, ROW), body)


def generation_intact(cfg: PipelineConfig):
    """The generation stage's intact check (run.decide): every shard of the plan has its record and file."""
    out, key, legacy = RunLayout(cfg.run_dir).generations, generation_shard_key(cfg), generation_key(cfg)
    plan = generation_plan(cfg)
    return lambda manifest: [f"shard_{k:05d}.parquet" for k in range(len(plan))
                             if _record_ok(out, k, plan, key, legacy) is None]


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

    Resumable at any point: finished shards are kept untouched, answered prompts are not sent again. A finished
    stage whose shard is missing or changed (e.g. moved aside by `verify --quarantine`) redoes that shard alone, as
    the Prefect flow's shard tasks do. Returns the stage manifest; raises like `finish_generation` and ServerError
    when no server answers.
    """
    t0 = time.monotonic()
    shards = generation_shards(cfg, log)
    status = generation_status(cfg)
    todo = [k for k in shards if k not in status["done"]]
    log(f"generation: {len(shards) - len(todo)} of {len(shards)} shards already finished")
    if todo:
        # no server when every pending row is kept as it is
        with generation_servers(cfg) if status["needs_server"] else nullcontext([]) as urls:
            _regenerate(cfg, todo, urls, log, on_progress)
    return finish_generation(cfg, [], seconds=time.monotonic() - t0)


ROW = Stage("generation", generation_stage_key, run_generation, upstream=("prompts",), intact=generation_intact,
            summary=("samples", "completion_tokens", "server"), timeout_h=1, shards=Shards(
                run_generation_shard, finish_generation, generation_records, generation_shard_done, "generation-shard",
                "finish-generation", tags=("server",)))
