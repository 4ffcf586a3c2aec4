"""Progress of one regeneration call: prompts done of the total, output tokens per second, failures, retries,
ETA (a log line and a JSON-able snapshot for the Prefect progress artifact)."""
from __future__ import annotations

import time

from eagle3_core.serving.pool import ServerPool


class Progress:
    """done/total, output tok/s (since the start and over the last interval), failures and retries of one
    regeneration call; `snapshot()` is JSON-able."""

    def __init__(self, total: int):
        self.total, self.t0 = total, time.monotonic()
        self.resumed = self.answered = self.failed = self.retries = self.tokens = 0
        self._last = (self.t0, 0)                                       # (time, tokens) at the last snapshot

    def snapshot(self, pool: ServerPool | None = None) -> dict:
        now = time.monotonic()
        elapsed, (t_last, tok_last) = now - self.t0, self._last
        self._last = (now, self.tokens)
        done = self.resumed + self.answered + self.failed
        rate = (self.answered + self.failed) / elapsed if elapsed > 0 else 0.0
        return {"done": done, "total": self.total, "fraction": done / max(self.total, 1), "answered": self.answered,
                "resumed": self.resumed, "failed": self.failed, "retries": self.retries,
                "output_tokens": self.tokens, "tokens_per_s": self.tokens / elapsed if elapsed > 0 else 0.0,
                "recent_tokens_per_s": (self.tokens - tok_last) / (now - t_last) if now > t_last else 0.0,
                "elapsed_s": elapsed, "eta_s": (self.total - done) / rate if rate > 0 else None,
                "servers": pool.stats() if pool else {}}

    @staticmethod
    def line(s: dict) -> str:
        eta = ""
        if s["eta_s"] is not None:
            eta = f", ETA {s['eta_s'] / 3600:.1f} h" if s["eta_s"] >= 7200 else f", ETA {s['eta_s'] / 60:.1f} min"
        down = [f"{u} for {v['down_s']:.0f} s" for u, v in s["servers"].items() if not v["up"]]
        return (f"generation: {s['done']} of {s['total']} prompts ({s['fraction']:.1%}), "
                f"{s['recent_tokens_per_s']:.0f} output tok/s (mean {s['tokens_per_s']:.0f}), {s['failed']} failed, "
                f"{s['retries']} retries{eta}" + (f"; not answering: {', '.join(down)}" if down else ""))
