"""Stand-in for sglang 0.5.14 `srt/speculative/spec_info.py` (see sglang/__init__.py)."""
from __future__ import annotations

from enum import Enum, auto


class SpeculativeAlgorithm(Enum):
    NONE = auto()
    EAGLE3 = auto()
