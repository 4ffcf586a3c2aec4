"""Stand-in for sglang 0.5.14 `srt/layers/logits_processor.py` (see sglang/__init__.py): the module the model
files hand their final hidden states to; this one keeps only the last token's logits, as upstream's prefill
pruning does (the backend replaces it)."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn


@dataclasses.dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor | None
    hidden_states: torch.Tensor | None = None


class LogitsProcessor(nn.Module):
    def __init__(self, config, skip_all_gather: bool = False, logit_scale: float | None = None):
        super().__init__()
        self.config = config

    def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None,
                hidden_states_before_norm=None):
        last = torch.tensor(logits_metadata.extend_seq_lens_cpu).cumsum(0) - 1
        return LogitsProcessorOutput(next_token_logits=hidden_states[last] @ lm_head.weight.T)
