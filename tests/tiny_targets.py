"""Tiny random-weight targets of three families, built from configs here (no downloads): Llama, Qwen3 (explicit
head_dim, q/k norms) and a DeepSeek-V3-style MoE (MLA attention, routed + shared experts, first layer dense).
8 layers each, so the default aux ids are [1, 3, 4]."""
from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
              max_position_embeddings=256, tie_word_embeddings=False)


def config(family: str):
    from transformers import DeepseekV3Config, LlamaConfig, Qwen3Config
    if family == "llama":
        return LlamaConfig(**COMMON, num_key_value_heads=2)
    if family == "qwen3":
        return Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=16)     # nh * hd = 64 != hidden 32
    if family == "deepseek_v3":
        return DeepseekV3Config(**COMMON, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4,
                                num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                                topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
                                qk_rope_head_dim=8, v_head_dim=8)
    raise ValueError(family)


def build(family: str, out: Path, seed: int = 0) -> Path:
    """Save a random-weight target of `family` (fp32, safetensors) to `out`; returns `out`."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(family), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():                 # HF's std 0.02 init makes every layer near-identity: widen it
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(out)
    return out
