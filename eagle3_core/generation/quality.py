"""The quality gate between regeneration and the expensive hidden-state extraction.

Counts, per shard and then over all shards: prompts without an answer (failed), empty answers, answers cut at
max_new_tokens (finish reason 'length') and degenerate answers (ending in a runaway repetition), each with a few
examples. The stage fails with that report when a fraction passes its limit in `GenerationConfig`.
"""
from __future__ import annotations

EXAMPLES = 5


class QualityGateError(RuntimeError):
    """Regenerated answers failed the quality gate; the message gives counts, limits, examples and the fix."""


def is_degenerate(text: str, window: int = 400, min_repeats: int = 4, min_chars: int = 64) -> bool:
    """True if the last `window` characters of `text` repeat one block of at most window/min_repeats characters
    over and over (e.g. '1. 1. 1. ...', a sentence looping until max_new_tokens). Texts shorter than `min_chars`
    are never degenerate."""
    tail = text[-window:]
    if len(tail) < min_chars:
        return False
    # the tail is p-periodic iff it equals itself shifted by p characters
    return any(tail[p:] == tail[:-p] for p in range(1, len(tail) // min_repeats + 1))


def answer_flags(response: str, reasoning: str, finish_reason: str) -> list[str]:
    """Which of 'empty', 'truncated', 'degenerate' one answer is."""
    text = (reasoning or "") + (response or "")
    flags = []
    if not text.strip():
        flags.append("empty")
    if finish_reason == "length":
        flags.append("truncated")
    if is_degenerate(text):
        flags.append("degenerate")
    return flags


def shard_quality(rows: list[dict]) -> dict:
    """Counts of empty / truncated / degenerate answers in `rows` (id, response, reasoning, finish_reason) and up
    to 5 examples each ({id, tail}: the answer's last 120 characters)."""
    counts = {"empty": 0, "truncated": 0, "degenerate": 0}
    examples: dict[str, list[dict]] = {k: [] for k in counts}
    for r in rows:
        for flag in answer_flags(r["response"], r["reasoning"], r["finish_reason"]):
            counts[flag] += 1
            if len(examples[flag]) < EXAMPLES:
                examples[flag].append({"id": r["id"], "tail": ((r["reasoning"] or "") + r["response"])[-120:]})
    return {**counts, "examples": examples}


def quality_report(records: list[dict], limits: dict[str, float]) -> dict:
    """Totals over shard records (`answer_shard.AnswerShardWriter.finalize`) against `limits` ({failed, empty,
    truncated, degenerate}: largest allowed fraction; failed counts against all prompts, the others against answers).
    Returns {prompts, answered, counts, fractions, limits, over (names past their limit), examples}."""
    prompts = sum(r["prompts"] for r in records)
    answered = sum(r["answered"] for r in records)
    counts = {"failed": prompts - answered}
    examples = {"failed": [f for r in records for f in r["failures"]][:EXAMPLES]}
    for k in ("empty", "truncated", "degenerate"):
        counts[k] = sum(r["quality"][k] for r in records)
        examples[k] = [e for r in records for e in r["quality"]["examples"][k]][:EXAMPLES]
    fractions = {k: counts[k] / max(prompts if k == "failed" else answered, 1) for k in counts}
    over = [k for k in counts if fractions[k] > limits[k]]
    return {"prompts": prompts, "answered": answered, "counts": counts, "fractions": fractions, "limits": limits,
            "over": over, "examples": examples}


FIXES = {"failed": "read the reasons, fix the servers or prompts, and rerun (only unanswered prompts are sent again)",
         "empty": "check the chat template and the server's reasoning parser",
         "truncated": "raise generation.max_new_tokens",
         "degenerate": "use a temperature above 0 or a repetition penalty"}


def check_quality(report: dict, where: str) -> None:
    """Raise QualityGateError naming `where`, each count past its limit, examples and the fix."""
    if not report["over"]:
        return
    lines = [f"generation quality gate failed for {where}:"]
    for k in report["over"]:
        base = "prompts" if k == "failed" else "answers"
        total = report["prompts"] if k == "failed" else report["answered"]
        lines.append(f"  {k}: {report['counts'][k]} of {total} {base} ({report['fractions'][k]:.1%}, limit "
                     f"{report['limits'][k]:.1%}, generation.max_{k}_frac); e.g. {report['examples'][k][:3]}; "
                     f"fix: {FIXES[k]}")
    lines.append("the answers are kept: with other limits a rerun only repeats this check (other sampling "
                 "settings regenerate them); failed prompts are sent again on every rerun")
    raise QualityGateError("\n".join(lines))


class EarlyGate:
    """The quality gate on the first `n` answers of a generation call, so that a degenerate start (a wrong chat
    template, a broken reasoning parser, greedy loops) fails within minutes, not after every shard is done.

    `add(row)` takes each answer ({id, response, reasoning, finish_reason}) as it arrives, `fail(id, reason)` each
    prompt that got none; when the n-th outcome arrives the counts are checked against `limits` (as
    `quality_report` does over shards) and QualityGateError is raised, with examples, if one is past its limit.
    Afterwards `check()` raises the same error (callers send no new request), or passes if the gate passed. Later
    answers are left to the final gate. Counts are of requests: in turn-by-turn mode each turn is one answer."""

    def __init__(self, n: int, limits: dict[str, float], where: str):
        self.n, self.limits, self.where = n, limits, where
        self.rows: list[dict] = []
        self.failures: list[dict] = []
        self.error: QualityGateError | None = None
        self.done = False

    def add(self, row: dict) -> None:
        if not self.done:
            self.rows.append(row)
            self._maybe_check()

    def fail(self, row_id: str, reason: str) -> None:
        if not self.done:
            self.failures.append({"id": row_id, "reason": reason[:300]})
            self._maybe_check()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def _maybe_check(self) -> None:
        if len(self.rows) + len(self.failures) < self.n:
            return
        self.done = True
        record = {"prompts": self.n, "answered": len(self.rows), "failures": self.failures,
                  "quality": shard_quality(self.rows)}
        report = quality_report([record], self.limits)
        try:
            check_quality(report, f"{self.where} (early gate: the first {self.n} answers, generation.gate_after)")
        except QualityGateError as e:
            self.error = e
            raise


def gate_limits(gen) -> dict[str, float]:
    """The gate's limits of a GenerationConfig: {failed, empty, truncated, degenerate} -> largest fraction."""
    return {"failed": gen.max_failed_frac, "empty": gen.max_empty_frac, "truncated": gen.max_truncated_frac,
            "degenerate": gen.max_degenerate_frac}
