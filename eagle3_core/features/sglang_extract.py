"""The `sglang` features backend, the part that needs no SGLang: prefill batches of whole samples and their split
back into the store's padded layout, the layer-id rule of SGLang's `set_eagle3_layers_to_capture`, the argmax
over a vocab-parallel lm_head, and the Extractor the feature store drives (features.extract.Extractor). The
SGLang calls are in features/sglang_runner.py (one module, its internals listed there); the backend's `load`
(features.backends' row 'sglang') in features/sglang_worker.py, its torchrun ranks tp_extract's.

Legend: B samples in a batch, T_b tokens of sample b, N = sum_b T_b tokens of one prefill batch, T = max_b T_b,
H_t target hidden, V target vocab, W ranks (tensor-parallel size), L target decoder layers.

A prefill batch is SGLang's extend batch of B requests, one per whole sample (no prefix cache, no chunked
prefill): its tokens are the samples' tokens back to back, [N], and every per-token output of the model comes in
that order (sglang 0.5.14 `managers/schedule_batch.py` `ScheduleBatch.prepare_for_extend` flattens the requests'
fill ids in order). `unpack` turns such [N, ...] rows into the right-padded [B, T, ...] the store encodes.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from eagle3_core.target.family import PLUS_ONE, PLUS_ONE_IF_FIRST_IS_1, sglang_ids

# ---- the layer-id rule ----------------------------------------------------------------------------------------
# Our aux layer ids are layer outputs (target.family.resolve_aux_ids); SGLang captures the *input* of each layer in
# its model's `layers_to_capture`, so id i needs layer i + 1 there. What `set_eagle3_layers_to_capture(ids)` puts
# there depends on the model file (target.family PLUS_ONE, PLUS_ONE_IF_FIRST_IS_1: the export writes the draft's
# ids by the same rule); the argument that captures the outputs of `ids` is target.family.sglang_ids.
capture_argument = sglang_ids
# SGLang model classes (and their subclasses) with the second rule
FIRST_IS_ONE_CLASSES = ("DeepseekV2ForCausalLM", "Glm4MoeLiteForCausalLM")


def capture_rule(model) -> str:
    """The layer-id rule of SGLang model `model` (an nn.Module of sglang.srt.models, or a wrapper whose
    `language_model` is one, as KimiK25ForConditionalGeneration): PLUS_ONE_IF_FIRST_IS_1 for the classes of
    FIRST_IS_ONE_CLASSES and their subclasses, PLUS_ONE otherwise."""
    for m in (model, getattr(model, "language_model", None)):
        if m is not None and any(c.__name__ in FIRST_IS_ONE_CLASSES for c in type(m).__mro__):
            return PLUS_ONE_IF_FIRST_IS_1
    return PLUS_ONE


# ---- prefill batches ------------------------------------------------------------------------------------------

def unpack(flat: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[N, ...] rows of a prefill batch (samples back to back, `lengths` = T_b) as right-padded [B, T, ...] (zeros
    after each sample's T_b rows), on flat's device and dtype. Raises ValueError if N != sum(lengths)."""
    if flat.shape[0] != sum(lengths):
        raise ValueError(f"a prefill batch of {sum(lengths)} tokens came back with {flat.shape[0]} rows")
    B, T = len(lengths), max(lengths)
    out = flat.new_zeros((B, T, *flat.shape[1:]))
    start = 0
    for b, n in enumerate(lengths):
        out[b, :n] = flat[start:start + n]
        start += n
    return out


def pack(padded: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The inverse of unpack: [B, T, ...] right-padded rows to [sum T_b, ...] (samples back to back)."""
    return torch.cat([padded[b, :n] for b, n in enumerate(lengths)])


# ---- argmax over a vocab-parallel lm_head ---------------------------------------------------------------------

@torch.no_grad()
def slice_best(hidden: torch.Tensor, weight: torch.Tensor, start: int, chunk: int = 4096) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
    """(max fp32 [N], its vocab id int64 [N]) of hidden [N, H_t] @ weight.T over one vocab slice: `weight` [n, H_t]
    holds lm_head rows [start, start + n). Logits in the model dtype, [chunk, n] at a time (as HFExtractor computes
    them); torch's max gives the first id of a tie."""
    N = hidden.shape[0]
    best = torch.empty(N, dtype=torch.float32, device=hidden.device)
    idx = torch.empty(N, dtype=torch.int64, device=hidden.device)
    for a in range(0, N, chunk):
        value, i = (hidden[a:a + chunk] @ weight.T).max(-1)
        best[a:a + chunk] = value.float()
        idx[a:a + chunk] = i + start
    return best, idx


def pick_best(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int32 [N]: for each token the id of the first slice holding the largest value, from the W slices' (max
    [W, N], id [W, N]) in vocab order: the argmax over the whole vocab, ties to the lowest id as torch.argmax."""
    return ids.gather(0, values.argmax(0)[None]).squeeze(0).to(torch.int32)


def sharded_argmax(hidden: torch.Tensor, weight: torch.Tensor, start: int, group=None,
                   chunk: int = 4096) -> torch.Tensor:
    """The argmax over the whole vocab of hidden @ lm_head.T where this rank holds lm_head rows [start, start +
    n) as `weight` [n, H_t] (SGLang's ParallelLMHead: each tensor-parallel rank a contiguous vocab slice, in rank
    order, padding rows already cut off). hidden: [N, H_t], the same on every rank. Returns int32 [N] on hidden's
    device. Each rank takes its slice's best (slice_best), the ranks all-gather them (2 x N numbers each, no
    [N, V] logits) and pick_best chooses: a collective over `group` (default: the world) when it has more than
    one rank."""
    best, idx = slice_best(hidden, weight, start, chunk)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return idx.to(torch.int32)
    values, ids = [torch.empty_like(best) for _ in range(world)], [torch.empty_like(idx) for _ in range(world)]
    dist.all_gather(values, best, group=group)
    dist.all_gather(ids, idx, group=group)
    return pick_best(torch.stack(values), torch.stack(ids))


# ---- the Extractor -------------------------------------------------------------------------------------------

class TargetView:
    """What the feature store and the torchrun worker read of the target behind an SGLang runner (in place of a
    transformers model): `config.to_dict()` (the target's config: write_head's target id), parameters() and
    buffers() (this rank's share as SGLang holds it: tp_extract's log of the bytes held)."""

    def __init__(self, module: torch.nn.Module, config: dict):
        self.module = module
        self.config = SimpleNamespace(to_dict=lambda: dict(config))

    def parameters(self):
        return self.module.parameters()

    def buffers(self):
        return self.module.buffers()


class SGLangExtractor:
    """An Extractor (features.extract.Extractor) over one rank's SGLang runner: `runner.prefill(seqs)` returns the
    prefill batch's device tensors {aux [N, 3H_t], final [N, H_t], target_top1 int32 [N]} (features/sglang_runner.py;
    a collective: every rank calls it with the same seqs, tp_extract.Leader sees to that).

    config: the target's config as a dict (what write_head's target id is computed from); `.model` is a
    TargetView of runner.model with it. head: a callable returning (embedding [V, H_t], lm_head [V, H_t]) read
    from the checkpoint (specforge_import.head_tensors), or None on a follower rank, whose head_weights returns
    (None, None) (only the leader writes head.safetensors)."""

    def __init__(self, runner, aux_layer_ids: list[int], hidden_size: int, config: dict, device, head=None):
        self.runner, self.aux_layer_ids, self.hidden_size = runner, list(aux_layer_ids), hidden_size
        self.device = torch.device(device)
        self.model = TargetView(runner.model, config)
        self.head = head

    @torch.no_grad()
    def forward(self, seqs: list[list[int]]) -> dict:
        """As HFExtractor.forward: aux [B, T, 3H_t], final [B, T, H_t], target_top1 int32 [B, T] (0 on padding) on
        the device, lengths int64 [B] (CPU)."""
        lengths = [len(s) for s in seqs]
        out = self.runner.prefill(seqs)
        return {k: unpack(out[k], lengths) for k in ("aux", "final", "target_top1")} | {
            "lengths": torch.tensor(lengths)}

    def head_weights(self):
        return self.head() if self.head is not None else (None, None)

    def __call__(self, seqs: list[list[int]]) -> list[dict]:
        """Per sample CPU tensors {'aux' [T, 3H_t], 'final' [T, H_t], 'target_top1' int32 [T]}."""
        out = self.forward(seqs)
        return [{k: out[k][b, :n].cpu() for k in ("aux", "final", "target_top1")}
                for b, n in enumerate(out["lengths"].tolist())]
