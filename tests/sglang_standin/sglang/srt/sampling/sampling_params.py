"""Stand-in for sglang 0.5.14 `srt/sampling/sampling_params.py` (see sglang/__init__.py)."""
from __future__ import annotations


class SamplingParams:
    def __init__(self, max_new_tokens: int = 128, temperature: float = 1.0, top_k: int = -1):
        self.max_new_tokens, self.temperature, self.top_k = max_new_tokens, temperature, top_k
