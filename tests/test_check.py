"""`check CONFIG [--draft DIR]`: what it prints for a Kimi-K2.5-sized target (config only, no weights) and each
refusal, with the field it names. Drafts are real exports of the tiny draft (conftest.tiny_draft), edited the way a
wrong checkpoint would look."""
import json

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, Kimi_K25Config, LlamaConfig

from conftest import tiny_draft
from eagle3_core.check import check_run, main
from eagle3_core.config import DraftConfig, FeatureConfig, GenerationConfig, PipelineConfig
from eagle3_core.training.checkpoint import save_draft

TB = 1 << 40                                    # memory given to the fit check where the test is not about it


@pytest.fixture(scope="module")
def kimi_k25():
    """A Kimi-K2.5-sized config, built from published dimensions (no download):
    - text model (`kimi_k2`, read as DeepseekV3Config): hidden 7168, 61 layers, 64 heads, 64 KV heads, intermediate
      18432, vocab 163840, rope_theta 50000, yarn {factor 64, beta_fast 1, beta_slow 1, mscale 1, mscale_all_dim 1,
      original_max_position_embeddings 4096}: moonshotai/Kimi-K2-Instruct-0905 config (ParagEkbote/hf-model-
      inspector `model_inspection_report.md`); 61 layers and hidden 7168 also docs/reference_case.md;
    - MLA and MoE: q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head_dim 128, moe_intermediate
      2048, 384 routed experts, 8 per token, 1 shared, first_k_dense_replace 1: the Kimi-K2.5-family `text_config`
      quoted in a public test (find_string '"model_type": "kimi_k25"');
    - context 262144 = 64 x 4096 (the yarn factor over the original context; Helicone `kimi-k2/models.ts`
      contextLength 262_144); rms_norm_eps 1e-6 (SpecForge configs/kimi-k25-eagle3.json copies it).
    The wrapper: transformers' Kimi_K25Config with the text model under text_config."""
    yarn = {"rope_type": "yarn", "factor": 64.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "rope_theta": 50000.0}
    text = DeepseekV3Config(hidden_size=7168, num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64,
                            intermediate_size=18432, vocab_size=163840, max_position_embeddings=262144,
                            rms_norm_eps=1e-6, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                            qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=2048, n_routed_experts=384,
                            num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                            topk_group=1, rope_parameters=yarn, tie_word_embeddings=False)
    return Kimi_K25Config(text_config=text.to_dict())


def test_kimi_k25_sized_target_passes_check_with_the_family_recipe(kimi_k25):
    cfg = PipelineConfig(features=FeatureConfig(max_length=2048))
    facts, problems = check_run(cfg, target_config=kimi_k25, memory=(8 * TB, "a host that holds it"))
    assert problems == []
    assert facts["config_class"] == "Kimi_K25Config" and facts["family"] == "mla" and facts["layers"] == 61
    # SpecForge configs/kimi-k25-eagle3.json geometry; positions = the target's context (AQ-MedAI's 262144)
    assert facts["draft_geometry"] == {"num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 128,
                                       "intermediate_size": 18432, "rope_theta": 1e6, "rope_scaling": None,
                                       "max_position_embeddings": 262144}
    ids = facts["aux_layer_ids"]
    assert ids["ours (layer outputs)"] == [1, 29, 57]
    assert ids["sglang"]["captures_inputs_of"] == [2, 30, 58]             # SpecForge's [2, 30, 58] reading
    assert ids["vllm"]["value"] == ids["llama.cpp"]["value"] == [2, 30, 58]
    assert facts["rope"]["target"]["type"] == "yarn" and facts["rope"]["draft"]["type"] == "default"
    assert facts["vocab"] == {"V": 163840, "N": 32000}
    assert facts["disk_bytes_per_token"]["bf16"] == 8 * 7168 + 9            # ~57 KB/token: 21504-dim aux + final


def test_kimi_k25_does_not_fit_in_process_on_one_small_machine(kimi_k25):
    """~1T parameters: the in-process features/evaluate stages are refused, naming target.model, in seconds."""
    _, problems = check_run(PipelineConfig(), target_config=kimi_k25, memory=(128 << 30, "128 GiB RAM"))
    assert [f for f, _ in problems] == ["target.model"] and "do not fit" in problems[0][1]


TARGET = LlamaConfig(hidden_size=32, num_hidden_layers=8, vocab_size=100, max_position_embeddings=256,
                     num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)


def _cfg(**kw):
    # 64 new tokens: a 256-token sample keeps room for the prompt (the token budget check)
    return PipelineConfig(features=FeatureConfig(max_length=256, **kw.pop("features", {})),
                          generation=GenerationConfig(max_new_tokens=64), **kw)


def _fields(cfg, draft=None, target=TARGET):
    return [f for f, _ in check_run(cfg, draft, target_config=target, memory=(TB, "test"))[1]]


@pytest.mark.parametrize("ids, why", [([3, 1, 2], "not ascending"), ([1, 1, 3], "repeats")])
def test_unsorted_and_duplicate_aux_ids_are_refused_at_config_time(ids, why, tmp_path):
    with pytest.raises(ValidationError, match=f"features.aux_layer_ids.*{why}"):
        FeatureConfig(aux_layer_ids=ids)
    path = tmp_path / "run.json"                                # the CLI names the field too
    path.write_text(json.dumps({"features": {"aux_layer_ids": ids}}))
    assert main([str(path)]) == 1


@pytest.mark.parametrize("ids", [[1, 3, 7], [1, 3, 8], [-1, 3, 5]])
def test_out_of_range_aux_ids_incl_the_last_layer_are_refused(ids):
    _, problems = check_run(_cfg(features={"aux_layer_ids": ids}), target_config=TARGET, memory=(TB, "test"))
    assert [f for f, _ in problems] == ["features.aux_layer_ids"]
    assert "[0, 6]" in problems[0][1]


def test_unsupported_rope_and_short_positions_are_refused():
    yarn = LlamaConfig(**{**TARGET.to_dict(), "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                                   "original_max_position_embeddings": 64,
                                                                   "rope_theta": 10000.0}})
    assert _fields(_cfg(), target=yarn) == ["draft.rope_scaling"]
    assert _fields(_cfg(draft=DraftConfig(rope_scaling="none")), target=yarn) == []
    assert _fields(_cfg(draft=DraftConfig(max_position_embeddings=128))) == ["draft.max_position_embeddings"]


def test_a_fitting_draft_passes_and_an_eagle2_draft_is_refused(tmp_path):
    d = save_draft(tiny_draft(), tmp_path / "draft")
    cfg = _cfg(features={"aux_layer_ids": [1, 2, 3]})
    assert _fields(cfg, d) == []
    conf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**conf, "architectures": ["LlamaForCausalLMEagle"]}))
    t = load_file(str(d / "model.safetensors"))
    del t["fc.weight"]
    save_file(t, str(d / "model.safetensors"))
    assert _fields(cfg, d) == ["architectures"]


def _draft_with_map(tmp_path, t2d_ids, d2t, N=50):
    """An export of the tiny draft whose t2d marks `t2d_ids` and whose d2t is `d2t` as given."""
    from conftest import tiny_shape
    from eagle3_core.training.draft_model import Eagle3Draft
    draft = tiny_draft() if N == 50 else Eagle3Draft(tiny_shape(draft_vocab_size=N))
    with torch.no_grad():
        draft.t2d.zero_()
        draft.t2d[t2d_ids] = True
        draft.d2t.copy_(d2t)
    return save_draft(draft, tmp_path / "draft")


EVEN = torch.arange(0, 100, 2)                       # the tiny draft's vocab: draft id i -> target id 2i


@pytest.mark.parametrize("t2d_ids, d2t, kind", [
    (EVEN, torch.zeros(50, dtype=torch.long), "all zeros"),
    # the 50 lowest ids, written as absolute ids: d2t = arange(N)
    (torch.arange(50), torch.arange(50), "absolute target ids"),
    # t2d's ids at most V - N (0..48 and 50) as absolute ids: draft + d2t = 2i, then 99, in [0, V) and distinct
    (torch.cat([torch.arange(49), torch.tensor([50])]), torch.cat([torch.arange(49), torch.tensor([50])]),
     "absolute target ids"),
])
def test_d2t_contradicted_by_its_t2d_is_refused(t2d_ids, d2t, kind, tmp_path):
    """Each d2t stays in range and names distinct ids, so only the file's own t2d shows it wrong."""
    d = _draft_with_map(tmp_path, t2d_ids, d2t)
    _, problems = check_run(_cfg(features={"aux_layer_ids": [1, 2, 3]}), d, target_config=TARGET,
                            memory=(TB, "test"))
    assert [f for f, _ in problems] == ["d2t"], problems
    assert "contradicts the file's own t2d" in problems[0][1] and kind in problems[0][1]


def test_all_zero_d2t_is_legal_when_the_draft_vocab_is_the_target_vocab(tmp_path):
    d = _draft_with_map(tmp_path, torch.arange(100), torch.zeros(100, dtype=torch.long), N=100)
    assert _fields(_cfg(features={"aux_layer_ids": [1, 2, 3]}), d) == []


def test_cli_prints_the_facts_and_passes(tmp_path, capsys, tiny_target_dirs):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"target": {"model": str(tiny_target_dirs["kimi_k25"])},
                                "server": {"kind": "transformers"},
                                "features": {"max_length": 256}, "generation": {"max_new_tokens": 64},
                                "draft": {"draft_vocab_size": 64}}))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "family: mla" in out and "Kimi_K25Config" in out and "check: passed" in out


def test_a_missing_prompt_file_is_refused_naming_the_source_and_the_fix(tmp_path):
    cfg = _cfg(prompts={"sources": ["human-eval", str(tmp_path / "gone.jsonl")]})
    _, problems = check_run(cfg, target_config=TARGET, memory=(TB, "test"))
    assert [f for f, _ in problems] == [f"prompts source 1 ({tmp_path / 'gone.jsonl'})"]
    assert "does not exist: give an existing .jsonl, .json or .parquet path" in problems[0][1]
    (tmp_path / "gone.jsonl").write_text('{"prompt": "hi"}\n')
    assert _fields(cfg) == []


def test_a_training_row_too_long_for_the_gpu_is_refused_with_the_length_that_fits(kimi_k25):
    """training.train_memory on the Kimi-K2.5 draft: 32K-token rows do not fit an 80 GB H100 (measured: out of
    memory), 16K do (measured 73.3 GiB); the fix names the longest row that fits; without a GPU it is not checked."""
    from eagle3_core.config import TrainConfig

    def run(batch_tokens: int, gpus):
        cfg = PipelineConfig(features=FeatureConfig(max_length=2048), train=TrainConfig(batch_tokens=batch_tokens))
        facts, problems = check_run(cfg, target_config=kimi_k25, memory=(8 * TB, "a host that holds it"), gpus=gpus)
        return facts["train_memory"], [m for f, m in problems if f == "train.batch_tokens"]
    h100 = (8, int(79.18 * 2 ** 30))
    fact, refused = run(32768, h100)
    assert fact["gpu_gib"] == 79.2 and fact["peak_gib_estimate"] > 100 and len(refused) == 1
    assert "32,768 tokens" in refused[0] and "set train.batch_tokens to 18," in refused[0]
    fact, refused = run(16384, h100)
    assert refused == [] and 70 < fact["peak_gib_estimate"] < 76
    fact, refused = run(32768, None)
    assert refused == [] and "not checked" in fact["gpu"]
