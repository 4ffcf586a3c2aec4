"""Tiny random-weight targets of the real configuration classes, built here (no downloads): Llama, Qwen3 (explicit
head_dim, q/k norms), DeepSeek-V3 (MLA attention, routed + shared experts, first layer dense, yarn rope), Kimi-K2.5
(transformers' `Kimi_K25Config`: a vision-language wrapper with the DeepSeek-V3 text model under `text_config`),
Qwen3-MoE and GPT-OSS (sinks, sliding-window layers, yarn rope). 8 decoder layers each, so the default aux ids are
[1, 3, 4]."""
from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
              max_position_embeddings=256, tie_word_embeddings=False)
FAMILIES = ("llama", "qwen3", "deepseek_v3", "kimi_k25", "qwen3_moe", "gpt_oss")
# the targets' yarn rope, at tiny scale: 4x over 64 original positions (DeepSeek-V3/Kimi-K2 ship factor 40/64 over 4096)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}


def _deepseek_v3():
    from transformers import DeepseekV3Config
    return DeepseekV3Config(**COMMON, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4,
                            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                            topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
                            v_head_dim=8, rope_parameters=dict(YARN))


def config(family: str):
    from transformers import GptOssConfig, Kimi_K25Config, LlamaConfig, Qwen3Config, Qwen3MoeConfig
    if family == "llama":
        return LlamaConfig(**COMMON, num_key_value_heads=2)
    if family == "qwen3":
        return Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=16)     # nh * hd = 64 != hidden 32
    if family == "deepseek_v3":
        return _deepseek_v3()
    if family == "kimi_k25":
        vision = dict(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                      pos_emb_height=4, pos_emb_width=4, pos_emb_time=2)
        return Kimi_K25Config(text_config=_deepseek_v3().to_dict(), vision_config=vision, projection_hidden_size=16,
                              tie_word_embeddings=False)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**COMMON, num_key_value_heads=2, head_dim=16, moe_intermediate_size=16, num_experts=4,
                              num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0])
    if family == "gpt_oss":
        return GptOssConfig(**COMMON, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                            sliding_window=8)                                 # default rope: GPT-OSS's yarn
    raise ValueError(family)


def build(family: str, out: Path, seed: int = 0) -> Path:
    """Save a random-weight target of `family` (fp32, safetensors) to `out`; returns `out`."""
    from eagle3_core.target.loading import auto_model_class
    cfg = config(family)
    torch.manual_seed(seed)
    model = auto_model_class(cfg, family).from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():                 # HF's std 0.02 init makes every layer near-identity: widen it
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(out)
    return out
