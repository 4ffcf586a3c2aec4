"""The held-out prompts of a run, frozen by content: what an earlier prompts run held out and trained on is found
again by what each row asks (content_digest), not by its id or row position, so that a grown run never trains on
its held-out prompts and never holds out a prompt it trained on.

An earlier run is described by its prompts manifest: `eval_ids` / `train_ids` and, since this module, their
`eval_digests` / `train_digests` (content_digest of each row, in the same order). Manifests written before that
carry no digests; `digests_from_files` reads them from the earlier prompts/{eval,train}.parquet instead.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from eagle3_core.data.row_formats import conversation_text


def content_digest(messages: list[dict]) -> str:
    """16 hex digits (64 bits) of the sha256 of what a row asks the target: its conversation before the final
    assistant turn(s), text whitespace-collapsed (the held-out form of a row: a 'keep' row and its prompt form have
    the same digest, and so do two rows that differ only in their kept answer). 64 bits: a collision among a
    million prompts has a chance below 1e-7."""
    end = len(messages)
    while end and messages[end - 1]["role"] == "assistant":
        end -= 1
    text = " ".join(conversation_text(messages[:end]).split())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def eval_set_digest(digests: list[str]) -> str:
    """One digest of a held-out set (its rows' content digests, order ignored): equal sets, equal digests."""
    return hashlib.sha256(" ".join(sorted(digests)).encode()).hexdigest()[:16]


@dataclass
class Reconciled:
    """An earlier run's rows found among today's: `eval_ids` the earlier held-out rows still in the sources with
    the same content (today's ids), `lost` [(earlier id, why)] those that are not, `train_ids` the earlier train
    rows found (in their earlier order), `trained` every id of today whose content was trained on earlier,
    `renamed` how many rows took back their earlier id."""
    eval_ids: list[str] = field(default_factory=list)
    lost: list[tuple[str, str]] = field(default_factory=list)
    train_ids: list[str] = field(default_factory=list)
    trained: set[str] = field(default_factory=set)
    renamed: int = 0


def reconcile(earlier: dict, rows: list[dict]) -> Reconciled:
    """Find the earlier run's rows among today's usable `rows` (dicts with 'id' and 'messages'; their ids may be
    changed in place: a row whose content an earlier row had under an id nobody uses today takes that id back, so
    that names stay stable across a change of id scheme, e.g. row positions to content ids).

    earlier: {eval_ids, train_ids, eval_digests, train_digests}; a digests list may be missing (a manifest from
    before digests were kept): those rows are then matched by id alone. A row matches an earlier one when its id
    holds the same content, or, failing that, when its content is the earlier row's (under another id).
    Remove the missing-digests case when runs written before 735a5a6 are no longer supported
    (compat.LEGACY_READERS)."""
    by_id = {r["id"]: r for r in rows}
    digest = {i: content_digest(r["messages"]) for i, r in by_id.items()}
    by_digest: dict[str, list[str]] = {}
    for i, d in digest.items():
        by_digest.setdefault(d, []).append(i)
    out = Reconciled()

    def match(i: str, d: str | None) -> str | None:
        if d is None or digest.get(i) == d:
            return i if i in by_id else None
        for j in by_digest.get(d, []):
            if i in by_id:
                return j
            row = by_id[i] = by_id.pop(j)                     # the earlier name back on its content
            row["id"], digest[i] = i, digest.pop(j)
            by_digest[d] = [i if x == j else x for x in by_digest[d]]
            out.renamed += 1
            return i
        return None

    for name in ("eval", "train"):
        ids, digs = earlier.get(f"{name}_ids") or [], earlier.get(f"{name}_digests")
        digs = digs if digs is not None and len(digs) == len(ids) else [None] * len(ids)
        for i, d in zip(ids, digs):
            now = match(i, d)
            if name == "train":
                if now is not None:
                    out.train_ids.append(now)
                    out.trained.add(now)
                if d is not None:
                    out.trained.update(by_digest.get(d, []))
            elif now is not None:
                out.eval_ids.append(now)
            else:
                out.lost.append((i, "its content changed" if i in by_id else
                                 "no longer a usable row of the sources (deleted, rejected, filtered or a duplicate)"))
    return out


def choose_held_out(groups: dict[str, list[dict]], num_eval: int, take: dict[str, int], kept: list[str],
                    trained: set[str]) -> list[dict]:
    """The held-out rows: the earlier held-out rows still here (`kept`, at most num_eval), then rows never
    trained on (not in `trained`) from the front of each group's order, `take[g]` per group less the kept rows
    there, and where a group runs short, from the others. Raises ValueError when fewer than num_eval rows were never
    trained on."""
    rows = {r["id"]: r for g in groups.values() for r in g}
    held = [rows[i] for i in kept if i in rows][:num_eval]
    have = {r["id"] for r in held}
    spare = {g: [r for r in v if r["id"] not in have and r["id"] not in trained] for g, v in groups.items()}
    for g, v in groups.items():
        n = max(0, take.get(g, 0) - sum(r["id"] in have for r in v))
        held += spare[g][:n]
        spare[g] = spare[g][n:]
    rest = [r for g in groups for r in spare[g]]
    held += rest[:max(0, num_eval - len(held))]
    if len(held) < num_eval:
        raise ValueError(f"prompts: {num_eval} held-out prompts are needed but only {len(held)} chosen prompts "
                         f"were never trained on by the earlier run ({len(trained)} were): add prompts to the "
                         f"sources or lower prompts.num_eval")
    return held


def digests_from_files(earlier: dict, eval_path: Path, train_path: Path) -> dict:
    """`earlier` with eval_digests / train_digests filled from an earlier run's prompts/eval.parquet and
    train.parquet where the manifest has none (a run from before they were kept). Rows of the file whose ids are
    not the manifest's are ignored; ids the file lacks get no digest (matched by id alone).
    Remove when runs written before 735a5a6 are no longer supported: growing one then matches its prompts by id
    alone (compat.LEGACY_READERS)."""
    out = dict(earlier)
    for name, path in (("eval", eval_path), ("train", train_path)):
        if out.get(f"{name}_digests") is not None or not path.exists():
            continue
        have = {r["id"]: content_digest(json.loads(r["messages"]))
                for r in pq.read_table(path, columns=["id", "messages"]).to_pylist()}
        ids = out.get(f"{name}_ids") or []
        if all(i in have for i in ids):
            out[f"{name}_digests"] = [have[i] for i in ids]
    return out
