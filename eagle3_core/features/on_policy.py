"""How much of the trained data the target would write itself, measured from the feature store: per source, the
fraction of supervised tokens where the target's argmax (`target_top1`, stored with the features) equals the token
the data holds there.

Legend: T tokens of one sample. Token t (loss_mask[t] = 1, t >= 1) is on-policy when target_top1[t - 1] == ids[t]:
the target, greedy, would have written it after the sample's first t tokens. Greedy regeneration trains ~1.0 (less
only where the serving engine's arithmetic differs from the extractor's, or the context the server saw was not the
one trained: a wrong template shows here); data kept as it is, or written by another model, shows how far it is
from what the target writes (the source's `kept` choice: SourceSpec.kept). Reads only the token ids, loss masks and
argmaxes of the shards (9 bytes a token), not the features.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


def agreement(ids: torch.Tensor, mask: torch.Tensor, top1: torch.Tensor) -> tuple[int, int]:
    """(supervised tokens after the first, of them on-policy) of one sample: ids, mask, top1 [T]."""
    sup = mask[1:].bool()
    return int(sup.sum()), int(((top1[:-1].long() == ids[1:].long()) & sup).sum())


def on_policy_by_source(store_dir: Path, source_of: dict[str, str], files: list[str] | None = None) -> dict[str, dict]:
    """{source: {'supervised', 'on_policy', 'fraction'}} over the samples of the store's shards (`files`: these
    shard files only, e.g. the first for an early check; default every shard of its manifest). source_of: sample
    id -> source name ('?' for an id it lacks). {} for a store without argmaxes (format 'online')."""
    store_dir = Path(store_dir)
    if files is None:
        manifest = json.loads((store_dir / "manifest.json").read_text())
        if manifest.get("format") == "online":
            return {}
        files = [s["file"] for s in manifest["shards"]]
    out: dict[str, dict] = {}
    for file in files:
        with safe_open(str(store_dir / file), "pt") as f:
            if "target_top1" not in f.keys():
                return {}
            ids = json.loads(f.metadata()["ids"])
            tok, mask, top1 = f.get_tensor("input_ids"), f.get_tensor("loss_mask"), f.get_tensor("target_top1")
            off = f.get_tensor("offsets").tolist()
        for i, sid in enumerate(ids):
            n, agree = agreement(tok[off[i]:off[i + 1]], mask[off[i]:off[i + 1]], top1[off[i]:off[i + 1]])
            st = out.setdefault(source_of.get(sid, "?"), {"supervised": 0, "on_policy": 0})
            st["supervised"] += n
            st["on_policy"] += agree
    for st in out.values():
        st["fraction"] = st["on_policy"] / max(st["supervised"], 1)
    return out


def on_policy_line(per_source: dict[str, dict]) -> str:
    """One log line: per source, the on-policy fraction and its supervised tokens."""
    return "; ".join(f"{s}: {st['fraction']:.1%} of {st['supervised']} supervised tokens are the target's argmax"
                     for s, st in sorted(per_source.items()))


def sources_of(rows: list[dict]) -> dict[str, str]:
    """Sample id -> source of tokenized rows ({id, source}; rows written before the `source` column: the id's
    prefix, '{source}/{row id}')."""
    return {r["id"]: r.get("source") or r["id"].split("/", 1)[0] for r in rows}


def check_on_policy(per_source: dict[str, dict], limit: float, where: str) -> None:
    """The early gate: raise ValueError naming every source whose on-policy fraction is below `limit`
    (features.min_on_policy) and what to do; `where` names what was measured (e.g. the first shard)."""
    low = {s: st for s, st in per_source.items() if st["supervised"] and st["fraction"] < limit}
    if low:
        raise ValueError(
            f"features: on {where}, " + "; ".join(f"source {s}: {st['fraction']:.1%} of {st['supervised']} "
                                                f"supervised tokens are the target's argmax" for s, st in low.items())
            + f", below features.min_on_policy {limit:.0%}: the draft would learn text the target does not write "
            f"(data kept as it is from another model, or a context the server did not see: a wrong chat template). "
            f"Set the source's kept to 'regenerate', 'mask' or 'refuse' (prompts.mix), check the template, or "
            f"lower features.min_on_policy; the shards written so far are kept")
