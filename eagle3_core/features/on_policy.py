"""How much of the trained data the target would write itself, measured from the feature store: per source, the
fraction of supervised tokens where the target's argmax (`target_top1`, stored with the features) equals the token
the data holds there.

Legend: T tokens of one sample. Token t (loss_mask[t] = 1, t >= 1) is on-policy when target_top1[t - 1] == ids[t]:
the target, greedy, would have written it after the sample's first t tokens. Greedy regeneration trains ~1.0 (less
only where the serving engine's arithmetic differs from the extractor's, or the context the server saw was not the
one trained: a wrong template shows here); data kept as it is, or written by another model, shows how far it is
from what the target writes (the source's `kept` choice: SourceSpec.kept). Reads only the token ids, loss masks and
argmaxes of the shards (9 bytes a token), not the features.

Sampled regeneration (generation.temperature > 0) writes tokens other than the argmax by design, so the argmax share
falls with the temperature and says nothing of whether the data is the target's. There the measure is the mean
log-probability of the supervised tokens under the target (softmax of lm_head(final), temperature 1), set beside
what the target's own samples at the regeneration temperature average, sum_x p_T(x) log p(x) at the same
positions (p_T: softmax(logits / T); the argmax's log p at T = 0): their difference, `logprob_gap` (nats a token),
is 0 in expectation for text the target sampled at T (above 0 where top-k / top-p cut the tail) and negative for
text it would not write. This reads the final states of the shard and the target's lm_head (head.safetensors).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3_core.features.reader import load_head
from eagle3_core.features.store_formats import FINAL_KEYS, decode_final

# the sampled gate: a source fails when its supervised tokens average this many nats a token less log-probability
# under the target than the target's own samples at the regeneration temperature would (logprob_gap < -this).
# The target's own samples average 0 by construction (more with top-k / top-p). On the embedded target
# (tests/test_on_policy_sampled.py, 4 GSM8K questions, 160 tokens each side) its own answers sampled at 0.7 measured
# +0.08 (argmax share 84%) and human-written answers -1.15 (argmax share 60%); 0.75 lies between, one target only
SAMPLED_GAP_NATS = 0.75


def agreement(ids: torch.Tensor, mask: torch.Tensor, top1: torch.Tensor) -> tuple[int, int]:
    """(supervised tokens after the first, of them on-policy) of one sample: ids, mask, top1 [T]."""
    sup = mask[1:].bool()
    return int(sup.sum()), int(((top1[:-1].long() == ids[1:].long()) & sup).sum())


@torch.no_grad()
def logprob_sums(final: torch.Tensor, lm_head: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                 temperature: float, chunk: int = 512) -> tuple[int, float, float]:
    """(n, sum of log p(x_t), sum of sum_x p_T(x) log p(x)) over the n supervised tokens x_t (t >= 1) of one sample
    (module docstring). final [T, H_t] (the target's final states; position t - 1 predicts token t), lm_head
    [V, H_t], ids and mask [T]; fp32 arithmetic, `chunk` positions at a time."""
    pos = mask[1:].bool().nonzero()[:, 0]                          # position t - 1 of each supervised token t
    got = expected = 0.0
    w = lm_head.float()
    for a in range(0, len(pos), chunk):
        p = pos[a:a + chunk]
        z = final[p].float() @ w.T                                                  # [n, V]
        logp = z.log_softmax(-1)
        got += float(logp.gather(-1, ids[p + 1].long()[:, None]).sum())
        expected += float(logp.max(-1).values.sum() if temperature == 0 else
                          ((z / temperature).softmax(-1) * logp).sum())
    return len(pos), got, expected


def _logprob_of_shard(f, fmt: str, head: torch.Tensor, tok, mask, off, temperature: float) -> list[tuple]:
    """logprob_sums of every sample of one open shard file (store format `fmt`)."""
    keys = set(f.keys())
    final = decode_final(fmt, {k: f.get_tensor(k) for k in FINAL_KEYS if k in keys})        # the aux states unread
    return [logprob_sums(final[off[i]:off[i + 1]], head, tok[off[i]:off[i + 1]], mask[off[i]:off[i + 1]],
                         temperature) for i in range(len(off) - 1)]


def on_policy_by_source(store_dir: Path, source_of: dict[str, str], files: list[str] | None = None,
                        temperature: float | None = None) -> dict[str, dict]:
    """{source: {'supervised', 'on_policy', 'fraction'}} over the samples of the store's shards (`files`: these
    shard files only, e.g. the first for an early check; default every shard of its manifest). source_of: sample
    id -> source name ('?' for an id it lacks). {} for a store without argmaxes (format 'online').
    temperature (the regeneration's; None: not measured): each source also gets 'mean_logprob', 'expected_logprob'
    and 'logprob_gap' (nats a token, module docstring), from the shards' final states and the target's lm_head."""
    store_dir = Path(store_dir)
    manifest_path = store_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    if manifest.get("format") == "online":
        return {}
    files = [s["file"] for s in manifest["shards"]] if files is None else files
    head = load_head(store_dir)[1] if temperature is not None else None
    out: dict[str, dict] = {}
    for file in files:
        with safe_open(str(store_dir / file), "pt") as f:
            if "target_top1" not in f.keys():
                return {}
            ids = json.loads(f.metadata()["ids"])
            tok, mask, top1 = f.get_tensor("input_ids"), f.get_tensor("loss_mask"), f.get_tensor("target_top1")
            off = f.get_tensor("offsets").tolist()
            lp = (_logprob_of_shard(f, manifest.get("format", "bf16"), head, tok, mask, off, temperature)
                  if head is not None else None)
        for i, sid in enumerate(ids):
            n, agree = agreement(tok[off[i]:off[i + 1]], mask[off[i]:off[i + 1]], top1[off[i]:off[i + 1]])
            st = out.setdefault(source_of.get(sid, "?"), {"supervised": 0, "on_policy": 0})
            st["supervised"] += n
            st["on_policy"] += agree
            if lp is not None:
                st["logprob"] = st.get("logprob", 0.0) + lp[i][1]
                st["expected"] = st.get("expected", 0.0) + lp[i][2]
    for st in out.values():
        st["fraction"] = st["on_policy"] / max(st["supervised"], 1)
        if "logprob" in st:
            n = max(st["supervised"], 1)
            st["mean_logprob"], st["expected_logprob"] = st.pop("logprob") / n, st.pop("expected") / n
            st["logprob_gap"] = st["mean_logprob"] - st["expected_logprob"]
    return out


def on_policy_line(per_source: dict[str, dict]) -> str:
    """One log line: per source, the on-policy fraction and its supervised tokens (and the log-probability
    measures where measured)."""
    return "; ".join(f"{s}: {st['fraction']:.1%} of {st['supervised']} supervised tokens are the target's argmax"
                     + (f", mean log p {st['mean_logprob']:.2f} vs {st['expected_logprob']:.2f} for the target's "
                        f"own samples (gap {st['logprob_gap']:+.2f} nats/token)" if "logprob_gap" in st else "")
                     for s, st in sorted(per_source.items()))


def sources_of(rows: list[dict]) -> dict[str, str]:
    """Sample id -> source of tokenized rows ({id, source}; rows written before the `source` column: the id's
    prefix, '{source}/{row id}').
    Remove the id prefix when runs written before 0722f12 are no longer supported: the per-source fractions then
    fail on them (compat.LEGACY_READERS)."""
    return {r["id"]: r.get("source") or r["id"].split("/", 1)[0] for r in rows}


def check_on_policy(per_source: dict[str, dict], limit: float, where: str) -> None:
    """The early gate: raise ValueError naming every source whose on-policy fraction is below `limit`
    (features.min_on_policy; 0: off) and what to do; `where` names what was measured (e.g. the first shard).
    Sampled regenerations (per_source with 'logprob_gap': on_policy_by_source with a temperature) are gated on
    the log-probability gap instead (below -SAMPLED_GAP_NATS), the argmax share falling by design there."""
    if limit > 0 and any("logprob_gap" in st for st in per_source.values()):
        return _check_logprob_gap(per_source, where)
    low = {s: st for s, st in per_source.items() if st["supervised"] and st["fraction"] < limit}
    if low:
        raise ValueError(
            f"features: on {where}, " + "; ".join(f"source {s}: {st['fraction']:.1%} of {st['supervised']} "
                                                f"supervised tokens are the target's argmax" for s, st in low.items())
            + f", below features.min_on_policy {limit:.0%}: the draft would learn text the target does not write "
            f"(data kept as it is from another model, or a context the server did not see: a wrong chat template). "
            f"Set the source's kept to 'regenerate', 'mask' or 'refuse' (prompts.mix), check the template, or "
            f"lower features.min_on_policy; the shards written so far are kept")


def _check_logprob_gap(per_source: dict[str, dict], where: str) -> None:
    """check_on_policy for sampled regenerations: raise ValueError naming every source whose logprob_gap is below
    -SAMPLED_GAP_NATS, and what to do."""
    low = {s: st for s, st in per_source.items() if st["supervised"] and st["logprob_gap"] < -SAMPLED_GAP_NATS}
    if low:
        raise ValueError(
            f"features: on {where}, " + "; ".join(
                f"source {s}: mean log-probability {st['mean_logprob']:.2f} nats/token under the target over "
                f"{st['supervised']} supervised tokens, {-st['logprob_gap']:.2f} below the {st['expected_logprob']:.2f}"
                f" its own samples at the regeneration temperature average" for s, st in low.items())
            + f" (more than {SAMPLED_GAP_NATS} below): the draft would learn text the target does not write (data "
            f"kept as it is from another model, or a context the server did not see: a wrong chat template). Set "
            f"the source's kept to 'regenerate', 'mask' or 'refuse' (prompts.mix), check the template, or set "
            f"features.min_on_policy 0 to turn the gate off; the shards written so far are kept")
