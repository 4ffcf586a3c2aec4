"""Stand-in for sglang 0.5.14 `srt/managers/schedule_batch.py` (see sglang/__init__.py): requests and an extend
batch of them. As upstream, prepare_for_extend takes a request slot each and a KV slot per token (failing when the
pools are short) and leaves the flattened ids on the host in `prefill_input_ids_cpu`."""
from __future__ import annotations

import dataclasses
from array import array

import torch

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode


class Req:
    def __init__(self, rid: str, origin_input_text: str, origin_input_ids, sampling_params):
        self.rid = rid
        self.origin_input_ids = origin_input_ids
        self.sampling_params = sampling_params
        self.full_untruncated_fill_ids = array("q")
        self.fill_len = 0
        self.prefix_indices = torch.empty((0,), dtype=torch.int64)
        self.extend_input_len = 0
        self.logprob_start_len = 0

    def get_fill_ids(self):
        return self.full_untruncated_fill_ids[:self.fill_len]


@dataclasses.dataclass
class ScheduleBatch:
    reqs: list
    req_to_token_pool: object = None
    token_to_kv_pool_allocator: object = None
    tree_cache: object = None
    model_config: object = None
    enable_overlap: bool = False
    spec_algorithm: object = None
    device: str = "cuda"
    forward_mode: ForwardMode = None
    input_ids: torch.Tensor = None
    prefill_input_ids_cpu: torch.Tensor | None = None
    extend_lens: list[int] | None = None
    capture_hidden_mode: CaptureHiddenMode | None = None

    @classmethod
    def init_new(cls, reqs, req_to_token_pool, token_to_kv_pool_allocator, tree_cache, model_config,
                 enable_overlap: bool, spec_algorithm) -> ScheduleBatch:
        return cls(reqs=reqs, req_to_token_pool=req_to_token_pool,
                   token_to_kv_pool_allocator=token_to_kv_pool_allocator, tree_cache=tree_cache,
                   model_config=model_config, enable_overlap=enable_overlap, spec_algorithm=spec_algorithm,
                   device=req_to_token_pool.device)

    def prepare_for_extend(self):
        self.forward_mode = ForwardMode.EXTEND
        ids = [r.get_fill_ids()[len(r.prefix_indices):] for r in self.reqs]
        self.extend_lens = [r.extend_input_len for r in self.reqs]
        assert self.extend_lens == [len(x) for x in ids], (self.extend_lens, [len(x) for x in ids])
        if self.req_to_token_pool.alloc(self.reqs) is None or \
                self.token_to_kv_pool_allocator.alloc(sum(self.extend_lens)) is None:
            raise RuntimeError("prefill out of memory: the batch needs more KV slots than the pool holds")
        self.prefill_input_ids_cpu = torch.tensor([t for x in ids for t in x], dtype=torch.int64)
