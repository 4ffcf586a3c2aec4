"""Stand-in for sglang 0.5.14 `srt/layers/vocab_parallel_embedding.py` (see sglang/__init__.py): each of the
tensor-parallel ranks (here: the torch.distributed world) holds a contiguous slice of the vocab padded to a
multiple of 64 (of 64 x ranks where that does not split evenly), split evenly; rows past the real vocab are zero
padding."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    return ((vocab_size + pad_to - 1) // pad_to) * pad_to


@dataclasses.dataclass
class VocabParallelEmbeddingShardIndices:
    padded_org_vocab_start_index: int
    padded_org_vocab_end_index: int
    org_vocab_start_index: int
    org_vocab_end_index: int


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, params_dtype=None, org_num_embeddings=None,
                 padding_size: int = DEFAULT_VOCAB_PADDING_SIZE, prefix: str = ""):
        super().__init__()
        self._tp_rank = dist.get_rank() if dist.is_initialized() else 0
        self.tp_size = dist.get_world_size() if dist.is_initialized() else 1
        self.org_vocab_size = org_num_embeddings or num_embeddings
        if pad_vocab_size(self.org_vocab_size, padding_size) % self.tp_size:       # as upstream's CPU branch
            padding_size *= self.tp_size
        self.padding_size = padding_size
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size)
        per = self.num_embeddings_padded // self.tp_size
        start, end = self._tp_rank * per, (self._tp_rank + 1) * per
        self.shard_indices = VocabParallelEmbeddingShardIndices(
            start, end, min(start, self.org_vocab_size), min(end, self.org_vocab_size))
        self.weight = nn.Parameter(torch.zeros(per, embedding_dim, dtype=params_dtype), requires_grad=False)

    def weight_loader(self, param, loaded_weight: torch.Tensor):
        s = self.shard_indices
        param.data.zero_()
        param.data[:s.org_vocab_end_index - s.org_vocab_start_index] = \
            loaded_weight[s.org_vocab_start_index:s.org_vocab_end_index]


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, bias: bool = False, params_dtype=None,
                 org_num_embeddings=None, padding_size: int = DEFAULT_VOCAB_PADDING_SIZE, prefix: str = ""):
        super().__init__(num_embeddings, embedding_dim, params_dtype=params_dtype,
                         org_num_embeddings=org_num_embeddings, padding_size=padding_size, prefix=prefix)
