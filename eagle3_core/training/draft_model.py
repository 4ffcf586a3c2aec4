"""The EAGLE-3 draft model for Llama-style targets (EAGLE-3 paper arXiv 2503.01840 section 3; SGLang `llama_eagle3.py`).

Legend: B batch, T sequence, H draft hidden, H_t target hidden, nh/nkv query/kv heads, hd head dim,
I intermediate, V target vocab, N draft vocab, K training-time-test (TTT) steps.

One draft step at position t takes the embedding of token x_{t+1} and a hidden state (the target's fused aux
features g at step 0, the draft's own previous output after) and predicts x_{t+2}:
    x = cat([input_layernorm(embed(tok)), hidden_norm(h)])    [B, T, 2H], embedding first
    a = h + o_proj(attn(q,k,v(x)))                             residual is the hidden input
    out = a + mlp(post_attention_layernorm(a))                 fed to the next step (pre-norm)
    logits = lm_head(norm(out))                                [B, T, N]

Capacity options (DraftShape; which engines serve them: eagle3_core.training.capacity):
- num_hidden_layers L > 1: layers 1..L-1 (`layers.{i}`) take the stream `out` alone (H inputs, no embedding) as
  pre-norm Llama layers whose input norm is `hidden_norm` (SGLang 0.5.14 `models/llama_eagle3.py`: layer i > 0 runs
  hidden_norm(hidden, residual)), each with its own KV cache;
- fc_norm (EAGLE-3.1, arXiv 2605.09992): one RMSNorm per aux chunk [H_t] before fc (`fc_norm.{j}`);
- norm_output (EAGLE-3.1): the hidden state fed to the next step is norm(out), not out (SGLang `norm_output`).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from eagle3_core.training.ttt_attention import (IMPLEMENTATIONS, acc_dtype, cached_attention, later_caches,
                                                ttt_attention)


@dataclass
class DraftShape:
    """Shapes of the draft (from a target config: eagle3_core.training.draft_geometry.draft_shape)."""
    hidden_size: int                 # H
    target_hidden_size: int          # H_t (aux features are 3*H_t wide)
    num_attention_heads: int         # nh
    num_key_value_heads: int         # nkv
    head_dim: int                    # hd
    intermediate_size: int           # I
    vocab_size: int                  # V, target vocab
    draft_vocab_size: int            # N
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    aux_layer_ids: list[int] = field(default_factory=list)
    num_hidden_layers: int = 1       # L decoder layers (layer 0 the EAGLE-3 midlayer)
    fc_norm: bool = False            # EAGLE-3.1: RMSNorm per aux chunk before fc
    norm_output: bool = False        # EAGLE-3.1: the normed hidden state fed back

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama RMSNorm: normalise in fp32, cast back to x's dtype, times weight (result in the promoted dtype)."""
    xf = x.to(acc_dtype(x.dtype))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, scaling: dict | None):
    """cos, sin [*positions.shape, hd] for integer `positions`. Supports default and Llama-3 ('llama3') scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        # Llama-3.1 frequency rescaling (transformers `_compute_llama3_parameters`)
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(f"rope scaling {scaling} is not supported by the draft yet")
    freqs = positions.to(torch.float64)[..., None] * inv_freq           # [..., hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)                              # [..., hd]
    return emb.cos().float(), emb.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, hd]; cos/sin [B, T, hd]. Rotate-half convention of HF Llama."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DraftAttention(nn.Module):
    """Attention over a TTT cache: causal over step-0 keys, plus the diagonal key of each later step
    (EAGLE-3 paper section 3.2; SpecForge `specforge/core/eagle3.py`). With one cached step and a prefix cache it is ordinary causal attention."""

    def __init__(self, s: DraftShape, in_features: int | None = None):
        super().__init__()
        self.s = s
        d_in = in_features or 2 * s.hidden_size           # 2H for layer 0 [embedding, hidden], H for later layers
        self.q_proj = nn.Linear(d_in, s.num_attention_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(d_in, s.num_key_value_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(d_in, s.num_key_value_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_attention_heads * s.head_dim, s.hidden_size, bias=False)
        self.impl = "eager"                  # TTT attention implementation (Eagle3Draft.set_attention)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: dict | None = None):
        """x [B, T, 2H] (H for a later layer) -> q [B, nh, T, hd], k/v [B, nkv, T, hd] with RoPE applied to q and k.
        w: optional {'q', 'k', 'v'} weights to use instead of the parameters (Eagle3Draft.step_weights)."""
        B, T, _ = x.shape
        s = self.s
        wq, wk, wv = (w["q"], w["k"], w["v"]) if w else (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
        q = F.linear(x, wq).view(B, T, s.num_attention_heads, s.head_dim).transpose(1, 2)
        k = F.linear(x, wk).view(B, T, s.num_key_value_heads, s.head_dim).transpose(1, 2)
        v = F.linear(x, wv).view(B, T, s.num_key_value_heads, s.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def ttt_attend(self, q, keys: list, values: list, doc: torch.Tensor | None = None,
                   block_mask=None) -> torch.Tensor:
        """TTT attention at step k = len(keys) - 1 by `self.impl` (eagle3_core.training.ttt_attention states the rule).

        q [B, nh, Tq, hd]; keys/values: k+1 tensors, entry 0 [B, nkv, T, hd] from step 0 (causal), entries j>=1
        [B, nkv, Tq, hd] from step j (only the same index); query i is index T - Tq + i; doc: optional [B, T]
        document ids of a packed row (causal within a document); block_mask: optional flex BlockMask of `doc`
        (ttt_attention.document_block_mask). Returns [B, Tq, nh*hd].
        """
        B, nh, Tq, hd = q.shape
        # merged impls on CUDA: the diagonal merge runs as one compiled graph (ttt_attention_merged)
        out = ttt_attention(q, keys, values, self.impl, True, doc, block_mask)  # [B, nh, Tq, hd]
        return out.transpose(1, 2).reshape(B, Tq, nh * hd)


class DraftMLP(nn.Module):
    def __init__(self, s: DraftShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x, w: dict | None = None):
        """w: optional {'gate', 'up', 'down'} weights to use instead of the parameters."""
        if w is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return F.linear(F.silu(F.linear(x, w["gate"])) * F.linear(x, w["up"]), w["down"])


class DraftDecoderLayer(nn.Module):
    """The one EAGLE-3 decoder layer ('midlayer'): q/k/v take 2H inputs [embedding, hidden]."""

    def __init__(self, s: DraftShape):
        super().__init__()
        self.self_attn = DraftAttention(s)
        self.mlp = DraftMLP(s)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)


class DraftLaterLayer(nn.Module):
    """Decoder layer i >= 1 of a multi-layer draft: a pre-norm Llama layer on the stream (H inputs), its input norm
    named `hidden_norm` as SGLang names it (the export adds vLLM's name, checkpoint.engine_copies)."""

    def __init__(self, s: DraftShape):
        super().__init__()
        self.self_attn = DraftAttention(s, s.hidden_size)
        self.mlp = DraftMLP(s)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def qkv(self, x, positions, rope=None, rope_fn=None):
        """x [B, T, H] the stream -> q, k, v of this layer (RoPE'd)."""
        cos, sin = rope if rope is not None else rope_fn(positions)
        return self.self_attn.project(self.hidden_norm(x), cos, sin)

    def finish(self, x, attn):
        """x [B, T, H] the stream (the residual), attn [B, T, nh*hd] -> the stream after this layer."""
        a = x + self.self_attn.o_proj(attn)
        return a + self.mlp(self.post_attention_layernorm(a))


class Eagle3Draft(nn.Module):
    """EAGLE-3 draft. Parameter names are SGLang's checkpoint names (`models/llama_eagle3.py` `load_weights`).

    Buffers: d2t int64 [N] offsets (target_id = draft_id + d2t[draft_id]); t2d bool [V].
    embed_tokens [V, H] is the target's embedding, frozen, when H == H_t; with H != H_t the draft trains its own
    (SGLang then keeps the draft's embedding instead of sharing the target's: SGLang `speculative/eagle_worker.py`).
    """

    def __init__(self, s: DraftShape):
        super().__init__()
        self.shape = s
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.embed_tokens.weight.requires_grad_(s.hidden_size != s.target_hidden_size)
        self.fc = nn.Linear(3 * s.target_hidden_size, s.hidden_size, bias=False)
        if s.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(s.target_hidden_size, s.rms_norm_eps) for _ in range(3))
        self.midlayer = DraftDecoderLayer(s)
        if s.num_hidden_layers > 1:        # names layers.1 .. layers.{L-1}, as the engines load them
            self.layers = nn.ModuleDict({str(i): DraftLaterLayer(s) for i in range(1, s.num_hidden_layers)})
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, s.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(s.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(s.vocab_size, dtype=torch.bool))

    def set_attention(self, impl: str) -> Eagle3Draft:
        """Choose the TTT attention implementation (eagle3_core.training.ttt_attention.IMPLEMENTATIONS); same results,
        different speed and memory. Raises ValueError for an unknown name."""
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"unknown TTT attention {impl!r}; choose one of {IMPLEMENTATIONS}")
        for layer in self.later_layers():
            layer.self_attn.impl = impl
        self.midlayer.self_attn.impl = impl
        return self

    def later_layers(self) -> list:
        """Decoder layers 1..L-1 in order (empty for the one-layer EAGLE-3 draft)."""
        return list(self.layers.values()) if self.shape.num_hidden_layers > 1 else []

    def init_weights(self, seed: int) -> None:
        """Deterministic init of the trainable weights (normal std 0.02, norms 1); keeps a frozen embed_tokens,
        d2t and t2d."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)

    # matmul weights of a TTT step: step_weights() key -> parameter path
    STEP_WEIGHTS: ClassVar[dict] = {"q": "midlayer.self_attn.q_proj.weight", "k": "midlayer.self_attn.k_proj.weight",
                    "v": "midlayer.self_attn.v_proj.weight", "o": "midlayer.self_attn.o_proj.weight",
                    "gate": "midlayer.mlp.gate_proj.weight", "up": "midlayer.mlp.up_proj.weight",
                    "down": "midlayer.mlp.down_proj.weight", "lm_head": "lm_head.weight"}

    def step_weights(self, dtype: torch.dtype) -> dict:
        """The matmul weights of a TTT step cast to `dtype` once (differentiable casts), for all K steps of a
        batch: autocast would do the same cast, but a compiled step would redo it (and cast the weight gradient
        back to fp32) at every step. The gradients of the K uses add up in `dtype` and reach the fp32 parameters
        through one cast, as under eager autocast (its cast cache). Norm weights and the embedding are not cast."""
        params = dict(self.named_parameters())
        return {k: params[name].to(dtype) for k, name in self.STEP_WEIGHTS.items()}

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B, T, 3*H_t] target aux hidden states -> g [B, T, H]; with fc_norm each H_t chunk normed first."""
        if self.shape.fc_norm:
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, aux.chunk(3, dim=-1))], dim=-1)
        return self.fc(aux)

    def rope(self, positions: torch.Tensor):
        s = self.shape
        return rope_cos_sin(positions, s.head_dim, s.rope_theta, s.rope_scaling)

    def step(self, token_ids, hidden, positions, cache_k: list, cache_v: list, rope=None, weights: dict | None = None,
             doc: torch.Tensor | None = None, block_mask=None):
        """One draft step with a TTT cache (training): appends this step's k/v to the cache lists.

        token_ids [B, Tq] int64 target ids; hidden [B, Tq, H]; positions [B, Tq] int64 RoPE positions; Tq may be
        shorter than step 0's T at later steps (see DraftAttention.ttt_attend). rope: optional (cos, sin)
        [B, Tq, hd] of `positions`, computed once per batch by the caller; weights: optional step_weights();
        doc: optional [B, T] document ids of a packed row (eagle3_core.training.packing), block_mask its flex BlockMask.
        Returns (out [B, Tq, H] pre-norm hidden for the next step, logits [B, Tq, N]).
        """
        if weights is None:
            q, k, v = self.attention_inputs(token_ids, hidden, positions, rope)
        else:
            q, k, v = self.attention_inputs(token_ids, hidden, positions, rope, weights)
        cache_k.append(k)
        cache_v.append(v)
        attn = self.midlayer.self_attn.ttt_attend(q, cache_k, cache_v, doc, block_mask)
        if not self.later_layers():
            if weights is None:
                return self.attention_outputs(hidden, attn)
            return self.attention_outputs(hidden, attn, weights)
        out = self.layer0_out(hidden, attn, weights)
        for i, layer in enumerate(self.later_layers()):        # their caches ride on cache_k/cache_v's 'later' list
            caches = later_caches(cache_k, cache_v, i)
            q, k, v = layer.qkv(out, positions, rope, self.rope)
            caches[0].append(k)
            caches[1].append(v)
            out = layer.finish(out, layer.self_attn.ttt_attend(q, caches[0], caches[1], doc, block_mask))
        return self.head(out, weights)

    def attention_inputs(self, token_ids, hidden, positions, rope=None, weights: dict | None = None):
        """token_ids [B, T], hidden [B, T, H], positions [B, T] -> q [B, nh, T, hd], k/v [B, nkv, T, hd] (RoPE'd).
        The dense part before attention (one graph for every step: what trainer.compile_for_training compiles).
        rope: optional (cos, sin) of `positions`; weights: optional step_weights() (the inputs of the q/k/v
        matmuls are then cast to their dtype here, as autocast would)."""
        layer = self.midlayer
        e = layer.input_layernorm(self.embed_tokens(token_ids))
        x = torch.cat([e, layer.hidden_norm(hidden)], dim=-1)               # [B, T, 2H], embedding first
        cos, sin = rope if rope is not None else self.rope(positions)
        if weights is not None:
            x = x.to(weights["q"].dtype)
        return layer.self_attn.project(x, cos, sin, weights)

    def attention_outputs(self, hidden, attn, weights: dict | None = None):
        """hidden [B, T, H] (the residual), attn [B, T, nh*hd] -> (out [B, T, H] pre-norm, logits [B, T, N]).
        weights: optional step_weights()."""
        return self.head(self.layer0_out(hidden, attn, weights), weights)

    def layer0_out(self, hidden, attn, weights: dict | None = None):
        """hidden [B, T, H] (the residual), attn [B, T, nh*hd] -> out [B, T, H], the stream after layer 0."""
        layer = self.midlayer
        if weights is None:
            a = hidden + layer.self_attn.o_proj(attn)
            return a + layer.mlp(layer.post_attention_layernorm(a))
        dt = weights["o"].dtype
        a = hidden + F.linear(attn.to(dt), weights["o"])
        return a + layer.mlp(layer.post_attention_layernorm(a).to(dt), weights)

    def head(self, out, weights: dict | None = None):
        """out [B, T, H] the stream after the last layer -> (hidden fed to the next step [B, T, H]: norm(out) with
        norm_output, else out; logits [B, T, N] = lm_head(norm(out)))."""
        normed = self.norm(out)
        logits = self.lm_head(normed) if weights is None else F.linear(normed.to(weights["lm_head"].dtype),
                                                                       weights["lm_head"])
        return (normed if self.shape.norm_output else out), logits

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocab ids to target ids through the d2t offsets."""
        return draft_ids + self.d2t[draft_ids]

    def decode(self, token_ids, hidden, positions, cache: dict):
        """Inference step with a plain KV cache (batch 1), as a serving engine runs the draft.

        token_ids [1, T]; hidden [1, T, H]; positions [1, T]. `cache` holds 'k', 'v' [1, nkv, P, hd] for the P
        earlier positions (absent when empty) and is extended in place; the T new queries attend causally among
        themselves and to all P cached keys. Returns (out [1, T, H], logits [1, T, N]).
        """
        attn = cached_attention(*self.attention_inputs(token_ids, hidden, positions), cache, "")
        out = self.layer0_out(hidden, attn)
        for i, layer in enumerate(self.later_layers(), start=1):     # layer i's cache: 'k{i}', 'v{i}'
            out = layer.finish(out, cached_attention(*layer.qkv(out, positions, None, self.rope), cache, str(i)))
        return self.head(out)

