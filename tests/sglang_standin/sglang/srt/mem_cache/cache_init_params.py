"""Stand-in for sglang 0.5.14 `srt/mem_cache/cache_init_params.py` (see sglang/__init__.py)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CacheInitParams:
    disable: bool
    req_to_token_pool: object
    token_to_kv_pool_allocator: object
    page_size: int
