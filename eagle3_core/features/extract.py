"""The extractor interface and its Hugging Face transformers backend: a frozen target's aux hidden states, final
normed hidden state and argmax token for a batch of token sequences.

Legend: B batch, T padded length, H_t target hidden, V target vocab, N_tok real (unpadded) tokens in a batch.
Layer ids follow SGLang's reading (`models/llama.py` `set_eagle3_layers_to_capture`: id i = output of 0-based decoder layer i = HF output_hidden_states[i+1]).

What training needs from the target (ttt.py): the aux layers' outputs at every position (step 0's causal keys see
all of them) and, from the last layer, the final normed hidden state (the lm_head input: soft targets over the draft
vocab) plus the argmax over the full vocab (`target_top1`, for the in-vocab mask and accuracy). So every decoder
layer runs; what is skipped is the [B, T, V] logits tensor: lm_head runs only on real tokens, in chunks, and only
its argmax leaves the GPU.

Speed (benchmarks/extract_throughput.py): sequences are right-padded and no attention mask is passed, so SDPA takes
its causal (flash) path; padding only ever follows a sequence's real tokens, which causal attention never lets them
see. On GPU the outputs are copied to pinned host memory on a side stream (`to_host`) while the next batch runs.
"""
from __future__ import annotations

from typing import ClassVar, Protocol

import torch
from torch.distributed.tensor import DTensor

from eagle3_core.features.store_formats import fp8_rounded
from eagle3_core.features.vocab_split import SplitHead
from eagle3_core.target.family import text_config
from eagle3_core.target.loading import capture, decoder, decoder_layers, default_aux_ids


class Extractor(Protocol):
    """What the feature store needs from a backend (HF transformers here; SGLang's model runner for targets that
    do not fit one host would be a second implementation)."""
    aux_layer_ids: list[int]
    hidden_size: int
    device: torch.device

    def forward(self, seqs: list[list[int]]) -> dict:
        """Device tensors for right-padded `seqs`: aux [B, T, 3H_t], final [B, T, H_t] (model dtype),
        target_top1 int32 [B, T] (0 on padding), lengths int64 [B] (CPU)."""

    def head_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input embedding [V, H_t], lm_head [V, H_t]) weights, whole, model dtype (the same tensor twice when
        tied)."""


class HFExtractor:
    """A frozen HF decoder-only causal LM (Llama, Qwen3, DeepSeek-V3, ... any with `get_decoder()` returning a
    module with `.layers` and `.norm`) as an Extractor.

    aux_layer_ids: None -> default_aux_ids(model.config). compile: torch.compile the layers' attention, MLP and
    norm sub-modules (fuses RMSNorm, RoPE and SiLU*up into few kernels; the decoder layers themselves stay eager so
    the capture hooks stay outside compiled code). lm_head_chunk: tokens per lm_head matmul for the argmax (bounds
    the [chunk, V] logits). split_head: this rank's vocabulary slice of lm_head (features.vocab_split; the
    argmax and head_weights then gather over the ranks, every rank calling forward together); teacher: with
    split_head, forward also returns fp8_topk's 'teacher' (store_formats.exact_top's tuple, gathered over the
    slices). Raises ValueError on an aux id out of range.
    """

    def __init__(self, model, aux_layer_ids: list[int] | None = None, compile: bool = False,
                 lm_head_chunk: int = 4096, split_head: SplitHead | None = None, teacher: bool = False):
        self.model = model
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_ids(model.config)
        layers = decoder_layers(model)
        for i in self.aux_layer_ids:
            if not 0 <= i < len(layers):
                raise ValueError(f"aux layer id {i} out of range for a target with {len(layers)} layers")
        self.hidden_size = text_config(model.config).hidden_size
        self.device = next(model.parameters()).device
        self.base = decoder(model)
        self.lm_head = model.get_output_embeddings()
        self.lm_head_chunk = lm_head_chunk
        self.split_head, self.teacher = split_head, bool(teacher and split_head)
        if compile:
            for layer in layers:
                for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
                    sub = getattr(layer, name, None)
                    if sub is not None:
                        sub.compile()

    @torch.no_grad()
    def forward(self, seqs: list[list[int]]) -> dict:
        B, T = len(seqs), max(len(s) for s in seqs)
        lengths = torch.tensor([len(s) for s in seqs])
        ids = torch.zeros(B, T, dtype=torch.long)                          # right padding with id 0
        for b, s in enumerate(seqs):
            ids[b, :len(s)] = torch.as_tensor(s)
        ids = ids.to(self.device, non_blocking=True)
        with capture(self.model, self.aux_layer_ids) as store:
            # no attention mask: SDPA's causal path; padded positions come after every real one
            final = self.base(input_ids=ids, use_cache=False).last_hidden_state   # [B, T, H_t], normed
        aux = torch.cat(store["aux"], dim=-1)                                # [B, T, 3H_t]
        # lm_head on real tokens only; indices built on the CPU so that no step waits for the GPU
        real = (torch.arange(T)[None, :] < lengths[:, None]).flatten().nonzero().squeeze(1)   # [N_tok]
        real = real.to(self.device, non_blocking=True)
        rows = final.reshape(B * T, -1).index_select(0, real)               # [N_tok, H_t]
        top1 = torch.zeros(B * T, dtype=torch.int32, device=self.device)
        for a in range(0, rows.shape[0], self.lm_head_chunk):
            chunk = self._top1(rows[a:a + self.lm_head_chunk])                # [chunk]
            top1.index_copy_(0, real[a:a + self.lm_head_chunk], chunk.to(torch.int32))
        out = {"aux": aux, "final": final, "target_top1": top1.view(B, T), "lengths": lengths}
        if self.teacher:
            out["teacher"] = self.split_head.exact_top(final, fp8_rounded(final))
        return out

    def _top1(self, rows: torch.Tensor) -> torch.Tensor:
        """The argmax over the target vocab of rows [c, H_t]: from [c, V] logits, or gathered from the split."""
        if self.split_head is not None:
            return self.split_head.top1(rows)
        return self.lm_head(rows).argmax(-1)

    def head_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input embedding [V, H_t], lm_head [V, H_t]) weights, detached, on the model's device, model dtype.
        Whole even for a tensor-parallel target: a sharded weight (a DTensor, target.loading.load_target with
        tp_size > 1) is gathered with `full_tensor()`, a collective, so every rank must call this in the same
        order."""
        def whole(w):
            w = w.detach()
            return w.full_tensor() if isinstance(w, DTensor) else w
        emb = self.model.get_input_embeddings().weight
        lm = self.model.get_output_embeddings().weight
        if self.split_head is not None:
            return whole(emb), self.split_head.whole()
        return whole(emb), (whole(lm) if lm is not emb else whole(emb))

    def __call__(self, seqs: list[list[int]]) -> list[dict]:
        """Per sample CPU tensors {'aux' [T, 3H_t], 'final' [T, H_t], 'target_top1' int32 [T]} (model dtype)."""
        out = self.forward(seqs)
        return [{"aux": out["aux"][b, :n].cpu(), "final": out["final"][b, :n].cpu(),
                 "target_top1": out["target_top1"][b, :n].cpu()} for b, n in enumerate(out["lengths"].tolist())]


class HostCopy:
    """Device tensors copied to pinned host memory on a side stream; `wait()` returns them (CPU tensors pass
    through). The caller's next kernels overlap the copy; the copy waits for the kernels that produced them."""

    _streams: ClassVar[dict] = {}                                       # one copy stream per device

    def __init__(self, tensors: dict[str, torch.Tensor]):
        dev = next(iter(tensors.values())).device
        self.event = None
        if dev.type != "cuda":
            self.tensors = tensors
            return
        stream = HostCopy._streams.setdefault(dev, torch.cuda.Stream(dev))
        stream.wait_stream(torch.cuda.current_stream(dev))
        self.tensors = {}
        with torch.cuda.stream(stream):
            for k, t in tensors.items():
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                t.record_stream(stream)                                      # keep t alive until copied
                self.tensors[k] = host
            self.event = torch.cuda.Event()
            self.event.record(stream)

    def wait(self) -> dict[str, torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.tensors
