"""Stand-in for sglang 0.5.14 `srt/mem_cache/radix_cache.py` (see sglang/__init__.py): a prefix cache that never
matches (the backend caches nothing)."""
from __future__ import annotations


class RadixCache:
    def __init__(self, params):
        self.disable = params.disable
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
