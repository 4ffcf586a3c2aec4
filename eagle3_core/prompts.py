"""Prompt data: read the sources of a mix, normalize every row to OpenAI-style messages, reject bad rows with
reasons, dedupe, filter by length, sample per source, split train/eval (DESIGN.md 'prompts').

Row schema: id (str, unique), source (str), messages (list of normalized messages, see prompt_data.formats),
tools (JSON text of the OpenAI tool schemas the row's conversation may call, '' for none; prompt_data.tools),
mode ('prompt': ends before the assistant turn the target regenerates; 'keep': ends with an assistant turn and is
trained as it is), meta (JSON text: row index, format, ...). Held-out (eval) rows are always in prompt form.
"""
from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .config import PromptConfig
from .manifest import sha256_file, write_atomic
from .prompt_data import HUMAN_EVAL, human_eval_path  # noqa: F401  (re-exported: callers import them from here)
from .prompt_data import RowReject, SourceSpec, conversation_text, iter_rows, normalize, source_path, to_prompt
from .prompt_data.formats import ID_FIELDS
from .prompt_data.tools import row_tools


class RejectError(ValueError):
    """A source rejected more rows than `prompts.max_reject_frac` allows."""


def source_specs(cfg: PromptConfig) -> list[SourceSpec]:
    """The sources of `cfg`: its mix, or its plain `sources` list as pooled prompt-mode sources."""
    return list(cfg.mix.sources) if cfg.mix is not None else [SourceSpec(path=s) for s in cfg.sources]


def source_fingerprints(cfg: PromptConfig) -> list:
    """What makes each source's rows what they are: a local file's sha256, or a Hugging Face data set's
    name/config/split/revision/files (plus the sha256 of local data files)."""
    out = []
    for spec in source_specs(cfg):
        path = source_path(spec)
        if path is not None:
            out.append(sha256_file(path) if path.exists() else str(path))
        else:
            files = [spec.data_files] if isinstance(spec.data_files, str) else list(spec.data_files or [])
            out.append([spec.hf, spec.config, spec.split, spec.revision,
                        [sha256_file(Path(f)) if Path(f).exists() else f for f in files]])
    return out


def _dedup_key(messages: list[dict]) -> str:
    """Exact-duplicate key: sha256 of the conversation text with whitespace runs collapsed."""
    return hashlib.sha256(" ".join(conversation_text(messages).split()).encode()).hexdigest()


def load_source(spec: SourceSpec | str, seed: int = 0, rejects: list | None = None) -> list[dict]:
    """Normalized rows of one source (a SourceSpec, or a path / 'human-eval'). Unreadable or unnormalizable rows
    are appended to `rejects` as {source, row, reason}; with `rejects=None` the first one raises ValueError."""
    spec = SourceSpec(path=spec) if isinstance(spec, str) else spec
    label, out, keys = spec.label, [], set()
    for i, item in iter_rows(spec, seed):
        try:
            if isinstance(item, RowReject):
                raise item
            messages, meta = normalize(item, spec)
            tools, tools_from = row_tools(item, messages)
        except RowReject as e:
            where = f"{source_path(spec) or spec.hf} row {i}"
            reason = e.reason if e.reason.startswith(str(source_path(spec))) else f"{where}: {e.reason}"
            if rejects is None:
                raise ValueError(reason) from None
            rejects.append({"source": label, "row": i, "reason": reason})
            continue
        key = item.get(spec.id_field) if spec.id_field else next((item[k] for k in ID_FIELDS if item.get(k)), None)
        key = str(key if key is not None else i)
        if key in keys:                                   # e.g. several trajectories of one task: keep all
            key = f"{key}#{i}"
        keys.add(key)
        if tools_from:
            meta["tools_from"] = tools_from
        out.append({"id": f"{label}/{key}", "source": label, "messages": messages, "mode": spec.mode,
                    "tools": json.dumps(tools) if tools else "", "meta": json.dumps({"row": i, **meta})})
    return out


def build_prompts(cfg: PromptConfig, rejects_path: Path | None = None) -> tuple[list[dict], list[dict], dict]:
    """(train rows, eval rows, stats). Per source: read, reject bad rows, filter by length, drop exact duplicates
    (first occurrence in source order wins); then sample counts / weights / the pool (see prompt_data.mix),
    shuffle with `cfg.seed` and split off `num_eval` held-out rows (converted to prompt form).

    Writes every reject to `rejects_path` (JSONL: source, row, reason); if the stage fails, to
    `failed_rejects_path(rejects_path)` instead, so that a finished run's rejects stay as they are. Raises
    RejectError naming the worst source if one rejects more than `cfg.max_reject_frac` of its rows, and
    ValueError if a source has fewer rows left than it must give.
    """
    specs, total = source_specs(cfg), cfg.num_train + cfg.num_eval
    if cfg.mix is not None:
        cfg.mix.check_total(total)
    rejects: list[dict] = []
    seen: set[str] = set()
    avail: dict[str, list[dict]] = {}
    per: dict[str, dict] = {}
    for spec in specs:
        n_rej = len(rejects)
        rows = load_source(spec, cfg.seed, rejects)
        st = per[spec.label] = {"origin": spec.path or spec.hf, "mode": spec.mode, "read": len(rows) + len(rejects)
                                - n_rej, "rejected": len(rejects) - n_rej, "length_filtered": 0, "duplicates": 0}
        kept = avail[spec.label] = []
        for r in rows:
            n = len(conversation_text(r["messages"]))
            if n < spec.min_chars or (spec.max_chars is not None and n > spec.max_chars):
                st["length_filtered"] += 1
                continue
            key = _dedup_key(r["messages"])
            if key in seen:
                st["duplicates"] += 1
                continue
            seen.add(key)
            kept.append(r)
        st["available"] = len(kept)
    try:
        check_reject_limit(per, rejects, cfg.max_reject_frac, failed_rejects_path(rejects_path))
        chosen = _sample(specs, avail, per, total, cfg.seed)
    except ValueError:
        write_rejects(rejects_path, rejects, failed=True)
        raise
    write_rejects(rejects_path, rejects, failed=False)
    eval_rows = [{**r, "messages": to_prompt(r["messages"]), "mode": "prompt"} for r in chosen[:cfg.num_eval]]
    train_rows = chosen[cfg.num_eval:total]
    for name, rows in (("eval", eval_rows), ("train", train_rows)):
        for r in rows:
            per[r["source"]][name] = per[r["source"]].get(name, 0) + 1
    stats = {"mix": cfg.mix.name if cfg.mix else "sources", "unique": sum(len(v) for v in avail.values()),
             "duplicates_dropped": sum(s["duplicates"] for s in per.values()), "rejected": len(rejects),
             "train": len(train_rows), "eval": len(eval_rows), "per_source": per}
    return train_rows, eval_rows, stats


def failed_rejects_path(path: Path | None) -> Path | None:
    """Where a failed attempt writes its rejects: `rejects.failed.jsonl` beside `rejects.jsonl`."""
    return None if path is None else path.with_name(path.name.replace(".jsonl", ".failed.jsonl"))


def write_rejects(path: Path | None, rejects: list[dict], failed: bool) -> None:
    """Write `rejects` (JSONL, one object per rejected row) atomically: to `path` when the stage succeeded (and
    remove an earlier failed attempt's file), else to `failed_rejects_path(path)`, leaving `path` (a finished
    run's) byte-identical. `path=None` writes nothing."""
    if path is None:
        return
    data = "".join(json.dumps(r) + "\n" for r in rejects).encode()
    if failed:
        write_atomic(failed_rejects_path(path), data)
    else:
        write_atomic(path, data)
        failed_rejects_path(path).unlink(missing_ok=True)


def check_reject_limit(per: dict, rejects: list[dict], max_frac: float, rejects_path: Path | None) -> None:
    """Raise RejectError naming the source with the largest rejected fraction if it is above `max_frac`.

    per: {source: {"read": rows read, "rejected": rows rejected, ...}}; rejects: [{"source", "reason", ...}];
    rejects_path: named in the message (where the user finds every reject)."""
    if not per:
        return
    frac = {name: s["rejected"] / max(s["read"], 1) for name, s in per.items()}
    worst = max(frac, key=frac.get)
    if frac[worst] > max_frac:
        first = next(r["reason"] for r in rejects if r["source"] == worst)
        raise RejectError(f"source {worst!r} rejected {per[worst]['rejected']} of {per[worst]['read']} rows "
                          f"({frac[worst]:.0%}), above prompts.max_reject_frac {max_frac:.0%}; first: {first}. "
                          f"All rejects: {rejects_path or '(not written)'}")


def finish_rejects(path: Path, rejects: list[dict], per: dict, max_frac: float) -> None:
    """A later stage's rejects (e.g. tokenize's): within the limit, written to `path`; above it, written to
    `failed_rejects_path(path)` and RejectError raised naming the worst source (check_reject_limit)."""
    try:
        check_reject_limit(per, rejects, max_frac, failed_rejects_path(path))
    except RejectError:
        write_rejects(path, rejects, failed=True)
        raise
    write_rejects(path, rejects, failed=False)


def _sample(specs: list[SourceSpec], avail: dict, per: dict, total: int, seed: int) -> list[dict]:
    counted = [s for s in specs if s.count is not None]
    weighted = [s for s in specs if s.weight is not None]
    pooled = [s for s in specs if s.count is None and s.weight is None]
    rest = total - sum(s.count for s in counted)
    want = {s.label: s.count for s in counted}
    if weighted:                                          # largest-remainder split of `rest` by weight
        w = sum(s.weight for s in weighted)
        exact = {s.label: rest * s.weight / w for s in weighted}
        want.update({k: int(v) for k, v in exact.items()})
        for k in sorted(exact, key=lambda k: exact[k] - int(exact[k]), reverse=True)[:rest - sum(
                int(v) for v in exact.values())]:
            want[k] += 1
    chosen = []
    for s in counted + weighted:
        rows = avail[s.label]
        if len(rows) < want[s.label]:
            st = per[s.label]
            raise ValueError(f"source {s.label!r} has {len(rows)} rows left ({st['read']} read, {st['rejected']} "
                             f"rejected, {st['length_filtered']} outside the length limits, {st['duplicates']} "
                             f"duplicates) but must give {want[s.label]}; lower its count or raise max_rows")
        chosen += random.Random(f"{seed}:{s.label}").sample(rows, want[s.label])
        per[s.label]["selected"] = want[s.label]
    pool = [r for s in pooled for r in avail[s.label]]
    if pooled and len(pool) < rest:
        raise ValueError(f"sources {[s.path or s.hf for s in pooled]} give {len(pool)} unique prompts; "
                         f"num_train + num_eval = {total}")
    if not counted and not weighted:                      # the plain sources list: one shuffle, eval first
        random.Random(seed).shuffle(pool)
        chosen = pool[:total]
    else:
        chosen += random.Random(seed).sample(pool, rest) if pooled else []
        random.Random(seed).shuffle(chosen)
    for s in pooled:
        per[s.label]["selected"] = sum(r["source"] == s.label for r in chosen)
    return chosen


def write_rows(path: Path, rows: list[dict]) -> None:
    """Write prompt/generation rows to Parquet; nested `messages` kept as a JSON string column."""
    table = pa.Table.from_pylist([{**r, "messages": json.dumps(r["messages"])} for r in rows])
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)


def read_rows(path: Path) -> list[dict]:
    return [{**r, "messages": json.loads(r["messages"])} for r in pq.read_table(path).to_pylist()]
