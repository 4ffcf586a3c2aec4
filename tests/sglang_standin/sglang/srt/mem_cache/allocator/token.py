"""Stand-in for sglang 0.5.14 `srt/mem_cache/allocator/token.py` (see sglang/__init__.py): KV slots, counted; a
batch beyond them fails as SGLang's allocation would."""
from __future__ import annotations


class TokenToKVPoolAllocator:
    def __init__(self, size: int, dtype=None, device: str = "cpu", kvcache=None, need_sort: bool = False):
        self.size, self.dtype, self.device = size, dtype, device
        self.clear()

    def available_size(self) -> int:
        return self.size - self._used

    def alloc(self, need_size: int):
        if need_size > self.available_size():
            return None
        self._used += need_size
        return list(range(self._used - need_size, self._used))

    def clear(self):
        self._used = 0
