"""Stand-in for sglang 0.5.14 `srt/model_executor/forward_batch_info.py` (see sglang/__init__.py): an extend
batch's token ids, positions and per-request lengths, samples back to back."""
from __future__ import annotations

import dataclasses
from enum import IntEnum, auto

import torch


class ForwardMode(IntEnum):
    EXTEND = auto()
    DECODE = auto()

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND


class CaptureHiddenMode(IntEnum):
    NULL = 0
    LAST = 1
    FULL = 2


@dataclasses.dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor                      # [N] int64, the requests' tokens back to back
    positions: torch.Tensor                      # [N] int64, 0.. within each request
    seq_lens: torch.Tensor                       # [B]
    extend_seq_lens_cpu: list[int]
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL

    @classmethod
    def init_new(cls, batch, model_runner) -> ForwardBatch:
        # upstream consumes the batch's one-shot capture_hidden_mode and resets it
        mode, batch.capture_hidden_mode = batch.capture_hidden_mode, None
        ids = batch.input_ids if batch.input_ids is not None else batch.prefill_input_ids_cpu
        lens = list(batch.extend_lens)
        positions = torch.cat([torch.arange(n) for n in lens]).to(ids.device)
        return cls(forward_mode=batch.forward_mode, batch_size=len(lens), input_ids=ids, positions=positions,
                   seq_lens=torch.tensor(lens), extend_seq_lens_cpu=lens,
                   capture_hidden_mode=mode if mode is not None else CaptureHiddenMode.NULL)
