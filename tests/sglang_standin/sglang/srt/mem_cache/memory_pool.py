"""Stand-in for sglang 0.5.14 `srt/mem_cache/memory_pool.py` (see sglang/__init__.py): request slots, counted."""
from __future__ import annotations


class ReqToTokenPool:
    def __init__(self, size: int, max_context_len: int, device: str, enable_memory_saver: bool = False):
        self.size, self.max_context_len, self.device = size, max_context_len, device
        self.free_slots = list(range(size))

    def alloc(self, reqs) -> list[int]:
        if len(reqs) > len(self.free_slots):
            raise RuntimeError(f"ReqToTokenPool: {len(reqs)} requests, {len(self.free_slots)} free slots")
        taken, self.free_slots = self.free_slots[:len(reqs)], self.free_slots[len(reqs):]
        return taken

    def clear(self):
        self.free_slots = list(range(self.size))
