"""Every target family end to end on CPU with tiny random-weight instances of the real configuration classes
(tests/tiny_targets.py: Llama, Qwen3, DeepSeek-V3 with MLA/MoE/yarn, Kimi-K2.5's wrapper, Qwen3-MoE, GPT-OSS):
exact aux capture, features, vocab map, a few TTT steps, the bf16 export, pre-flight, `check` and reload; the
export loads in SpecForge and meets vLLM's loader rules."""
import json

import pytest
import torch
from safetensors.torch import load_file

from eagle3_core.check import check_run
from eagle3_core.config import (
    DraftConfig,
    FeatureConfig,
    GenerationConfig,
    PipelineConfig,
    ServerConfig,
    TargetConfig,
    TrainConfig,
)
from eagle3_core.data.vocab_map import build_vocab_map, count_tokens
from eagle3_core.evaluation.preflight import check_draft
from eagle3_core.features.extract import HFExtractor
from eagle3_core.features.store import extract_features
from eagle3_core.features.reader import load_head, load_samples
from eagle3_core.target.family import family, sglang_rule
from eagle3_core.target.loading import load_target, load_target_config
from eagle3_core.training.checkpoint import export_draft, load_draft, logits_probe
from eagle3_core.training.draft_geometry import draft_shape
from eagle3_core.training.trainer import train
from eagle3_core.training.setup import build_draft

FAMILIES = ["llama", "qwen3", "deepseek_v3", "kimi_k25", "qwen3_moe", "gpt_oss"]
# GPT-OSS ships yarn rope, which the draft does not run: the user says so (check refuses the default, see below)
DRAFT = {"gpt_oss": DraftConfig(draft_vocab_size=64, rope_scaling="none")}


def _rows(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"id": f"s{i}", "input_ids": torch.randint(0, 128, (10 + 2 * i,), generator=g).tolist(),
             "loss_mask": [0] * 5 + [1] * (5 + 2 * i)} for i in range(n)]


def _run_config(family_name, target_dir, tmp_path):
    return PipelineConfig(run_dir=tmp_path / "run", target=TargetConfig(model=str(target_dir)),
                          server=ServerConfig(kind="transformers"), features=FeatureConfig(max_length=256),
                          generation=GenerationConfig(max_new_tokens=64),
                          draft=DRAFT.get(family_name, DraftConfig(draft_vocab_size=64)))


@pytest.mark.parametrize("family_name", FAMILIES)
def test_family_features_vocab_train_export_preflight_check_reload(family_name, tiny_target_dirs, tmp_path):
    cfg = _run_config(family_name, tiny_target_dirs[family_name], tmp_path)
    model = load_target(cfg.target)
    tcfg = load_target_config(cfg.target)
    assert family(tcfg) == ("mla" if family_name in ("deepseek_v3", "kimi_k25") else "llama")
    ex = HFExtractor(model)
    assert ex.aux_layer_ids == [1, 3, 4]                                    # defaults of an 8-layer text model
    rows = _rows()
    # exact capture on this family too: aux = output_hidden_states[i + 1], same batch
    seqs = [r["input_ids"] for r in rows[:3]]
    out = ex.forward(seqs)
    ids = torch.zeros(3, max(map(len, seqs)), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.tensor(s)
    with torch.no_grad():
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    assert torch.equal(out["aux"], torch.cat([hs[i + 1] for i in [1, 3, 4]], dim=-1))
    assert torch.equal(out["final"], hs[-1])

    manifest = extract_features(model, rows, tmp_path / "features", None, shard_samples=4, batch_tokens=64)
    assert manifest["complete"] and manifest["aux_layer_ids"] == [1, 3, 4] and manifest["hidden_size"] == 32
    samples = load_samples(tmp_path / "features")
    assert samples[2]["aux"].shape == (14, 96) and samples[2]["final"].shape == (14, 32)

    shape = draft_shape(tcfg, cfg.draft.draft_vocab_size, manifest["aux_layer_ids"], overrides=cfg.draft.geometry())
    assert (shape.target_hidden_size, shape.vocab_size, shape.draft_vocab_size) == (32, 128, 64)
    if family(tcfg) == "mla":           # the MLA recipe: v_head_dim heads, no GQA, plain RoPE 1e6, >= 131072 pos
        assert (shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim) == (4, 4, 8)
        assert (shape.rope_theta, shape.rope_scaling, shape.max_position_embeddings) == (1e6, None, 131072)
    counts = count_tokens([s["input_ids"] for s in samples], [s["loss_mask"] for s in samples], 128)
    d2t, t2d = build_vocab_map(counts, 64)
    emb, lm = load_head(tmp_path / "features")
    draft = build_draft(shape, emb, d2t, t2d, seed=0)
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    tcfg_train = TrainConfig(epochs=3, lr=1e-3, batch_tokens=64, ttt_length=2, eval_frac=0.0, warmup_frac=0.0)
    summary = train(draft, samples, [], lm, tcfg_train, tmp_path / "draft", log=lambda s: None)
    assert summary["steps"] >= 3
    loss = summary["history"][-1]["train"]["loss"]
    assert all(torch.isfinite(torch.tensor(loss))) and loss[0] > 0
    assert not torch.equal(draft.fc.weight, before["fc.weight"])             # the steps changed the weights
    assert torch.equal(draft.embed_tokens.weight, before["embed_tokens.weight"])   # frozen target embedding

    export = export_draft(draft, tmp_path / "export", sglang_rule=sglang_rule(tcfg))   # bf16, probed bit for bit
    saved = json.loads((export / "config.json").read_text())
    assert saved["torch_dtype"] == "bfloat16" and load_file(export / "model.safetensors")["fc.weight"].dtype == \
        torch.bfloat16
    assert saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert saved["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]                # vLLM / llama.cpp: layer inputs
    assert check_draft(export, tcfg) == []
    facts, problems = check_run(cfg, export, target_config=tcfg)
    assert problems == [] and facts["family"] == family(tcfg)
    reloaded = load_draft(export)
    assert logits_probe(draft.to(torch.bfloat16), reloaded)


def test_gpt_oss_default_geometry_is_refused_before_anything_runs(tiny_target_dirs, tmp_path):
    """GPT-OSS's yarn rope copied into the draft would fail at the first training step: check names the field."""
    cfg = PipelineConfig(target=TargetConfig(model=str(tiny_target_dirs["gpt_oss"])),
                         server=ServerConfig(kind="transformers"),
                         features=FeatureConfig(max_length=256), generation=GenerationConfig(max_new_tokens=64),
                         draft=DraftConfig(draft_vocab_size=64))
    _, problems = check_run(cfg)
    assert [f for f, _ in problems] == ["draft.rope_scaling"]
    assert "'yarn'" in problems[0][1] and "'none'" in problems[0][1]


def _vllm_param_names(weight_names: list[str]) -> set[str]:
    """The parameters vLLM's EAGLE-3 Llama draft fills from a checkpoint's names, following its loader rules as
    read in vllm-project/vllm `vllm/model_executor/models/llama_eagle3.py` (commit 00bd1493, 2026):
    `Eagle3LlamaForCausalLM.load_weights` skips names containing 't2d', renames 'd2t' to 'draft_id_to_target_id',
    prefixes every other name but lm_head with 'model.'; `LlamaModel.load_weights` maps 'midlayer.' to 'layers.0.'
    and stacks q/k/v_proj into qkv_proj and gate/up_proj into gate_up_proj. Written from the source, not copied."""
    out = set()
    for name in weight_names:
        if "t2d" in name:
            continue
        if "d2t" in name:
            out.add(name.replace("d2t", "draft_id_to_target_id"))
            continue
        name = name if "lm_head" in name else "model." + name
        name = name.replace("midlayer.", "layers.0.")
        for shard, stacked in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                               (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")):
            name = name.replace(shard, stacked)
        out.add(name)
    return out


# vLLM's module tree of Eagle3LlamaForCausalLM with one layer and use_aux_hidden_state (same file)
VLLM_PARAMS = {"model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight",
               "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
               "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight",
               "model.layers.0.post_attention_layernorm.weight", "model.layers.0.hidden_norm.weight",
               "model.fc.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id"}


@pytest.mark.parametrize("family_name", ["llama", "kimi_k25"])
def test_export_loads_in_specforge_and_meets_vllm_loader_rules(family_name, tiny_target_dirs, tmp_path):
    """SpecForge's LlamaForCausalLMEagle3 (PyPI specforge 0.2.0, --no-deps) loads the bf16 export with no
    missing, unexpected or mismatched keys; vLLM would fill every parameter (names above), find the architecture
    it registers (`LlamaForCausalLMEagle3`), draft_vocab_size, target_hidden_size, and the top-level ids it reads
    (`vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py` `get_eagle3_aux_layers_from_config`, as layer inputs:
    its models append the residual stream before layer idx)."""
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    cfg = _run_config(family_name, tiny_target_dirs[family_name], tmp_path)
    tcfg = load_target_config(cfg.target)
    model = load_target(cfg.target)
    shape = draft_shape(tcfg, 64, [1, 3, 4], overrides=cfg.draft.geometry())
    d2t, t2d = build_vocab_map(torch.arange(128).flip(0), 64)
    draft = build_draft(shape, model.get_input_embeddings().weight.detach(), d2t, t2d, seed=0)
    export = export_draft(draft, tmp_path / "export", sglang_rule=sglang_rule(tcfg))
    _, info = LlamaForCausalLMEagle3.from_pretrained(str(export), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    names = list(load_file(export / "model.safetensors"))
    assert _vllm_param_names(names) == VLLM_PARAMS
    saved = json.loads((export / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLMEagle3"] and saved["num_hidden_layers"] == 1
    assert saved["draft_vocab_size"] == 64 and saved["target_hidden_size"] == 32
    assert saved["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in [1, 3, 4]]
