"""The SGLang-format export: names, shapes, config keys, exact reload, strict errors (C6, C7), and SpecForge's
`LlamaForCausalLMEagle3` as an independent loader."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_draft
from eagle3_core.training.checkpoint import CheckpointError, load_draft, save_draft

# SGLang's EAGLE3 checkpoint names (models/llama_eagle3.py), for H = 32, 4 heads x 8, 2 kv heads, I = 64, V = 100, N = 50, H_t = 32
REFERENCE_SHAPES = {
    "fc.weight": (32, 96), "midlayer.self_attn.q_proj.weight": (32, 64), "midlayer.self_attn.k_proj.weight": (16, 64),
    "midlayer.self_attn.v_proj.weight": (16, 64), "midlayer.self_attn.o_proj.weight": (32, 32),
    "midlayer.mlp.gate_proj.weight": (64, 32), "midlayer.mlp.up_proj.weight": (64, 32),
    "midlayer.mlp.down_proj.weight": (32, 64), "midlayer.input_layernorm.weight": (32,),
    "midlayer.hidden_norm.weight": (32,), "midlayer.post_attention_layernorm.weight": (32,), "norm.weight": (32,),
    "lm_head.weight": (50, 32), "d2t": (50,), "t2d": (100,), "embed_tokens.weight": (100, 32),
}


def _probe(d, seed=0):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, 7, 96, generator=g)
    ids = torch.randint(0, 100, (1, 7), generator=g)
    with torch.no_grad():
        return d.decode(ids, d.fuse(aux), torch.arange(7)[None], {})[1], aux, ids


def test_export_names_shapes_config_and_exact_reload(tmp_path):
    d = tiny_draft()
    out = save_draft(d, tmp_path / "draft")
    tensors = load_file(out / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in tensors.items()} == REFERENCE_SHAPES
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True}
    assert cfg["draft_vocab_size"] == 50 and cfg["vocab_size"] == 100 and cfg["num_hidden_layers"] == 1
    assert cfg["tie_word_embeddings"] is False
    reloaded = load_draft(out)
    assert torch.equal(_probe(d)[0], _probe(reloaded)[0])


def test_tied_target_small_draft_vocab_exports_untied(tmp_path, target_model):
    """C6: SmolLM2 ties its embeddings; the draft (vocab 8192) must say false and reload with no key problems."""
    from eagle3_core.config import default_aux_layer_ids
    from eagle3_core.data.vocab_map import build_vocab_map
    from eagle3_core.training.draft_geometry import draft_shape
    from eagle3_core.training.setup import build_draft
    assert target_model.config.tie_word_embeddings
    shape = draft_shape(target_model.config, 8192, default_aux_layer_ids(30))
    d2t, t2d = build_vocab_map(torch.arange(49152).flip(0), 8192)
    d = build_draft(shape, target_model.model.embed_tokens.weight.detach(), d2t, t2d, seed=0)
    out = save_draft(d, tmp_path / "c6")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["draft_vocab_size"] == 8192
    assert cfg["max_position_embeddings"] >= target_model.config.max_position_embeddings
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    reloaded = load_draft(out)          # strict: raises on any missing or unexpected key
    assert reloaded.lm_head.weight.shape == (8192, 576)
    assert not torch.equal(reloaded.lm_head.weight[:10], reloaded.embed_tokens.weight[:10])


def test_renamed_key_is_an_error_naming_it(tmp_path):
    """C7: a checkpoint with one key renamed must not load with random weights."""
    out = save_draft(tiny_draft(), tmp_path / "draft")
    tensors = load_file(out / "model.safetensors")
    tensors["midlayer.self_attn.qkv.weight"] = tensors.pop("midlayer.self_attn.q_proj.weight")
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"q_proj.*qkv|qkv.*q_proj"):
        load_draft(out)


def test_wrong_shape_is_an_error_naming_the_tensor(tmp_path):
    out = save_draft(tiny_draft(), tmp_path / "draft")
    tensors = load_file(out / "model.safetensors")
    tensors["fc.weight"] = tensors["fc.weight"][:, :64].contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match="fc.weight"):
        load_draft(out)


@pytest.mark.slow
def test_specforge_loads_the_export_and_gives_the_same_logits(tmp_path):
    """An independent loader: SpecForge's LlamaForCausalLMEagle3 (PyPI specforge, installed --no-deps)."""
    from specforge.modeling.draft.llama3_eagle import (
        LlamaForCausalLMEagle3,
        prepare_decoder_attention_mask,
    )
    d = tiny_draft()
    out = save_draft(d, tmp_path / "draft")
    _, info = LlamaForCausalLMEagle3.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # from_pretrained under transformers 5.24 leaves SpecForge's non-persistent rotary caches uninitialised
    # (SpecForge pins 5.8.1), so build the module from the exported config and load the weights strictly
    model = LlamaForCausalLMEagle3(LlamaForCausalLMEagle3.config_class.from_pretrained(str(out))).eval()
    model.load_state_dict(load_file(out / "model.safetensors"), strict=True)
    ours, aux, ids = _probe(d)
    with torch.no_grad():
        hidden = model.project_hidden_states(aux)
        mask = prepare_decoder_attention_mask(torch.ones(1, 7, dtype=torch.bool), (1, 7), hidden, 0)
        h = model.backbone(model.embed_input_ids(ids), hidden, None, mask, torch.arange(7)[None])
        theirs = model.compute_logits(h)
    assert torch.allclose(theirs, ours, atol=1e-5), (theirs - ours).abs().max()


def test_draft_hidden_other_than_target_hidden_trains_its_embedding_and_round_trips(tmp_path):
    """H = 48 != H_t = 32: fc maps 3*H_t -> H, the draft's own embedding [V, H] is trainable and exported, the
    teacher stays in H_t; TTT runs and the export reloads to the same logits."""
    from eagle3_core.training.ttt import ttt_loss
    d = tiny_draft(hidden_size=48, intermediate_size=96)
    assert d.embed_tokens.weight.requires_grad and d.fc.weight.shape == (48, 96)
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 100, (1, 9), generator=g), "loss_mask": torch.ones(1, 9, dtype=torch.bool),
             "target_top1": torch.randint(0, 100, (1, 9), generator=g), "aux": torch.randn(1, 9, 96, generator=g),
             "final": torch.randn(1, 9, 32, generator=g)}
    loss, _ = ttt_loss(d, batch, torch.randn(50, 32, generator=g), 3)
    loss.backward()
    assert d.embed_tokens.weight.grad.abs().sum() > 0
    out = save_draft(d, tmp_path / "draft")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["target_hidden_size"]) == (48, 32)
    assert torch.equal(_probe(d)[0], _probe(load_draft(out))[0])


def test_training_checkpoints_leave_out_the_frozen_target_embedding_and_load_older_ones(tmp_path):
    """trained_state drops embed_tokens where it is the target's (frozen), keeps it where the draft trains its own
    (H != H_t); load_trained_state takes both kinds of checkpoint and refuses one that lacks a trained tensor."""
    from eagle3_core.training.checkpoint import load_trained_state, trained_state
    draft = tiny_draft(seed=1)
    state = trained_state(draft)
    assert "embed_tokens.weight" not in state
    assert set(state) == set(draft.state_dict()) - {"embed_tokens.weight"} and {"d2t", "t2d"} <= set(state)
    fresh = tiny_draft(seed=2)
    with torch.no_grad():
        fresh.embed_tokens.weight.copy_(draft.embed_tokens.weight)       # the run rebuilds it from the store
    load_trained_state(fresh, state, tmp_path / "step.pt")
    assert all(torch.equal(t, draft.state_dict()[k]) for k, t in fresh.state_dict().items())
    older = tiny_draft(seed=3)
    load_trained_state(older, draft.state_dict(), tmp_path / "step.pt")   # written before: holds the embedding
    assert all(torch.equal(t, draft.state_dict()[k]) for k, t in older.state_dict().items())
    with pytest.raises(CheckpointError, match=r"step\.pt.*'fc\.weight'"):
        load_trained_state(tiny_draft(), {k: v for k, v in state.items() if k != "fc.weight"}, tmp_path / "step.pt")
    wide = tiny_draft(hidden_size=48)                                   # H != H_t: the draft's own embedding
    assert "embed_tokens.weight" in trained_state(wide)
