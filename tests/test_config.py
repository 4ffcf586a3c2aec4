"""Layer-id convention, presets, and the draft's shape and RoPE taken from a target config."""
import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from eagle3_core.config import default_aux_layer_ids, preset
from eagle3_core.training.draft_geometry import draft_shape
from eagle3_core.training.draft_model import rope_cos_sin


def test_default_aux_layer_ids():
    assert default_aux_layer_ids(30) == [1, 14, 26]          # SmolLM2-135M
    assert default_aux_layer_ids(32) == [1, 15, 28]          # Llama-3.1-8B
    assert default_aux_layer_ids(61) == [1, 29, 57]          # Kimi-K2.5: SGLang captures inputs of [2, 30, 58]
    assert default_aux_layer_ids(7) == [1, 2, 3]              # the smallest target with three distinct ids
    for L in (4, 6):                                           # L = 6 would give [1, 2, 2]
        with pytest.raises(ValueError, match="at least 7"):
            default_aux_layer_ids(L)


def test_presets_and_unknown_preset():
    demo = preset("demo")
    assert demo.prompts.num_train >= 120 and demo.prompts.num_eval >= 16
    assert demo.eval.max_new_tokens == 128 and demo.generation.temperature == 0.0
    assert demo.server.host == "127.0.0.1" and not demo.target.trust_remote_code
    with pytest.raises(ValueError, match="unknown preset"):
        preset("huge")


def test_llama31_shape_and_rope_match_transformers():
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      num_hidden_layers=32, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                      rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 8192})
    s = draft_shape(cfg, 32000, default_aux_layer_ids(32))
    assert (s.hidden_size, s.head_dim, s.num_key_value_heads, s.draft_vocab_size) == (4096, 128, 8, 32000)
    assert s.max_position_embeddings == 131072 and s.rope_theta == 500000.0
    pos = torch.tensor([[0, 1, 7, 100, 5000, 20000]])
    cos, sin = rope_cos_sin(pos, s.head_dim, s.rope_theta, s.rope_scaling)
    ref_cos, ref_sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, 6, 4096), pos)
    # transformers computes the angles in fp32: position p carries ~p * 6e-8 rad of error, we compute in fp64
    assert torch.allclose(cos, ref_cos, atol=1e-3) and torch.allclose(sin, ref_sin, atol=1e-3)
    assert torch.allclose(cos[:, :4], ref_cos[:, :4], atol=1e-5)
    unscaled, _ = rope_cos_sin(pos, s.head_dim, s.rope_theta, None)
    assert (unscaled - cos).abs().max() > 0.1          # the llama3 scaling is applied, not silently dropped


def test_deployments_build_with_an_inactive_nightly_schedule():
    from deployments.serve import nightly
    from flows.pipeline import eagle3_pipeline
    d = eagle3_pipeline.to_deployment(name="eagle3-pipeline", parameters={"config": preset("demo").model_dump(
        mode="json")}, schedule=nightly("UTC"))
    (sched,) = d.schedules
    assert sched.schedule.cron == "0 2 * * *" and sched.schedule.timezone == "UTC" and sched.active is False
    assert sched.parameters == {"nightly": True}                   # a scheduled run is a night's work
