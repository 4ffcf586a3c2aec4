"""Tiny random-weight DeepSeek-V3 and Kimi-K2.5 targets whose routed experts are stored as Kimi-K2.5's published
checkpoint stores them: compressed-tensors `pack-quantized` INT4, symmetric, group size 32 along the input
dimension (per expert matrix `weight_packed` int32 [N, K/8] holding 8 nibbles, `weight_scale` bf16 [N, K/32],
`weight_shape` int64 [2]); everything else bf16 as saved by transformers. Packed with compressed-tensors' own
`PackedQuantizationCompressor` (vllm-project/compressed-tensors, compressors/pack_quantized/base.py), so the
fixture is what that library writes, not a copy of its layout.

Checkpoint keys are the published checkpoints' (DeepSeek-V3: `model.layers.N...`; Kimi-K2.5:
`language_model.model.layers.N...`, `language_model.lm_head.weight`), and config.json carries a
`quantization_config` of the published form (quant_method compressed-tensors, format pack-quantized, one group of
4-bit group-32 symmetric weights, attention, shared experts, dense MLPs, router and lm_head left unquantized), so
transformers' own loader reads it (and dequantizes the experts to the model dtype at load: the reference)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

GROUP = 32
# the published checkpoints' quantization_config, reduced to the fields compressed-tensors reads
QUANT_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": GROUP, "dynamic": False, "observer": "minmax"}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj$",
               "re:.*mlp\\.gate$", "re:.*vision_tower.*", "re:.*mm_projector.*"],
    "kv_cache_scheme": None,
}
EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")


def text_config(layers: int = 3, experts: int = 4, **kw):
    """DeepseekV3Config at tiny scale with dims the INT4 groups divide: hidden 64, expert width 32 (every expert
    matrix's input dimension a multiple of 32), 4 heads of MLA, first layer dense. kw: other fields on top (a
    tokenizer's vocab_size, a longer max_position_embeddings)."""
    from transformers import DeepseekV3Config

    from tiny_targets import YARN
    fields = {"vocab_size": 128, "max_position_embeddings": 256, **kw}
    return DeepseekV3Config(**fields, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
                            moe_intermediate_size=32, n_routed_experts=experts,
                            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                            topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
                            v_head_dim=8, rope_parameters=dict(YARN))


def config(family: str, layers: int = 3, **kw):
    if family == "deepseek_v3":
        return text_config(layers, **kw)
    if family == "kimi_k25":
        from transformers import Kimi_K25Config
        vision = dict(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                      pos_emb_height=4, pos_emb_width=4, pos_emb_time=2)
        return Kimi_K25Config(text_config=text_config(layers, **kw).to_dict(), vision_config=vision,
                              projection_hidden_size=16, tie_word_embeddings=False)
    raise ValueError(family)


def quant_scheme():
    """compressed-tensors' QuantizationScheme of QUANT_CONFIG's group_0 (4-bit symmetric groups of 32)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    return QuantizationScheme(targets=["Linear"],
                              weights=QuantizationArgs(**QUANT_CONFIG["config_groups"]["group_0"]["weights"]))


def pack_expert(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """weight [N, K] -> {weight_packed, weight_scale, weight_shape} by compressed-tensors' pack-quantized
    compressor; scale = max |w| / 7 per group of 32 inputs, bf16."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    scheme = quant_scheme()
    w = w.to(torch.bfloat16)
    scale = (w.float().view(w.shape[0], -1, GROUP).abs().amax(-1) / 7).clamp_min(1e-4).to(torch.bfloat16)
    out = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    return {k: v.contiguous() for k, v in out.items()}


def build_int4(family: str, out: Path, layers: int = 3, seed: int = 0, bf16_twin: Path | None = None,
               **kw) -> Path:
    """Save a random-weight target of `family` ('deepseek_v3' or 'kimi_k25') with INT4-packed routed experts to
    `out` (model.safetensors, config.json); returns `out`. bf16_twin: also save there the same target with every
    expert stored as its bf16 dequantization (compressed-tensors' `decompress`), no quantization_config: what the
    in-process `hf` backend reads in the model dtype. kw: text_config fields on top (vocab_size, ...)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    scheme = quant_scheme()
    from eagle3_core.target.loading import auto_model_class
    cfg = config(family, layers, **kw)
    torch.manual_seed(seed)
    model = auto_model_class(cfg, family).from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():                 # HF's std 0.02 init makes every layer near-identity: widen it
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    model.to(torch.bfloat16).save_pretrained(out)
    state = load_file(out / "model.safetensors")
    packed, twin = {}, {}
    for k, v in state.items():
        # transformers 5.25 saves Kimi-K2.5's text layers as `blocks`; the published checkpoint names them `layers`
        k = k.replace("language_model.model.blocks.", "language_model.model.layers.")
        if EXPERT.search(k):
            stem = k[: -len(".weight")]
            p = pack_expert(v)
            packed.update({f"{stem}.{name}": t for name, t in p.items()})
            twin[k] = PackedQuantizationCompressor.decompress(p, scheme)["weight"].contiguous()
        else:
            packed[k] = twin[k] = v
    save_file(packed, out / "model.safetensors", metadata={"format": "pt"})
    if bf16_twin is not None:
        bf16_twin.mkdir(parents=True, exist_ok=True)
        save_file(twin, bf16_twin / "model.safetensors", metadata={"format": "pt"})
        (bf16_twin / "config.json").write_text((out / "config.json").read_text())
    conf = json.loads((out / "config.json").read_text())
    conf["quantization_config"] = QUANT_CONFIG
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    return out
