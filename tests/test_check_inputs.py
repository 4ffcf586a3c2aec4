"""What `check` compares before a run beyond the target's shape: the generation server's kind against the target,
train.init_from (exists, a draft, EAGLE-3, geometry, vocab, aux ids: warm_start.init_problems), the free disk of
run_dir's file system against the features stage's bytes, and features.expert_parallel on a dense target. Targets are
config objects of the real transformers classes (no weights); drafts are real exports of the tiny draft."""
import json
import shutil

import pytest
import torch
from transformers import LlamaConfig

from conftest import SHARED_DATA, tiny_draft
from eagle3_core.check import check_or_raise, check_run
from eagle3_core.config import (
    DraftConfig,
    FeatureConfig,
    GenerationConfig,
    PipelineConfig,
    PromptConfig,
    ServerConfig,
    TargetConfig,
    TrainConfig,
)
from eagle3_core.config.mix import DataMix, SourceSpec
from eagle3_core.training.checkpoint import save_draft

TB = 1 << 40
TARGET = LlamaConfig(hidden_size=32, num_hidden_layers=8, vocab_size=100, max_position_embeddings=256,
                     num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
HF = TargetConfig(model="org/a-hf-model")                   # a Hugging Face checkpoint (no GGUF)
GSM8K = str(SHARED_DATA / "gsm8k" / "train.jsonl")
KEEP_ONLY = PromptConfig(mix=DataMix(sources=[SourceSpec(path=GSM8K, mode="keep", max_rows=40)]), num_train=8,
                         num_eval=2)


def _problems(cfg, **kw):
    return check_run(cfg, target_config=TARGET, memory=(TB, "test"), **kw)[1]


def _cfg(**kw):
    return PipelineConfig(**{"features": FeatureConfig(max_length=256, aux_layer_ids=[1, 2, 3]),
                             "generation": GenerationConfig(max_new_tokens=64), **kw})


def test_an_hf_target_under_the_default_llama_cpp_server_is_refused_naming_server_kind():
    problems = _problems(_cfg(target=HF))
    assert [f for f, _ in problems] == ["server.kind"]
    assert "'llama.cpp' (the default) serves a GGUF target" in problems[0][1] and "'sglang'" in problems[0][1]
    assert _problems(_cfg(target=HF, server=ServerConfig(kind="transformers"))) == []
    assert _problems(_cfg(target=HF, prompts=KEEP_ONLY)) == []                # no row asks the server anything
    short = FeatureConfig(max_length=200, aux_layer_ids=[1, 2, 3])      # SGLang's context (256) holds every request
    assert [f for f, _ in _problems(_cfg(server=ServerConfig(kind="sglang"), features=short))] == [
        "server.kind"]                                                                      # a GGUF target
    assert [f for f, _ in _problems(_cfg(target=HF, server=ServerConfig(kind="external")))] == ["server.url"]
    assert _problems(_cfg(target=HF, server=ServerConfig(kind="external", url="http://127.0.0.1:30000"))) == []


def test_generation_of_an_hf_target_whose_rows_are_all_kept_finishes_under_the_default_server(
        tiny_target_dirs, tokenizer, tmp_path):
    """Every attempt used to end in AttributeError ('NoneType' object has no attribute 'name') after writing all
    its shards: the manifest named the llama.cpp server's GGUF, which a Hugging Face target does not have."""
    from eagle3_core.pipeline.generation_stage import run_generation
    from eagle3_core.pipeline.prompts_stage import run_prompts
    target = tmp_path / "target"
    shutil.copytree(tiny_target_dirs["llama"], target)
    tokenizer.save_pretrained(target)                       # the real chat template, for the token budget
    cfg = PipelineConfig(run_dir=tmp_path / "run", target=TargetConfig(model=str(target)), prompts=KEEP_ONLY,
                         features=FeatureConfig(max_length=1024))
    run_prompts(cfg, log=lambda *_: None)
    manifest = run_generation(cfg, log=lambda *_: None)
    assert manifest["server"] == "none (every row kept as it is)" and manifest["samples"] == 8


def test_expert_parallel_on_a_dense_target_is_refused_naming_the_field():
    """transformers' own error was 'LlamaForCausalLM has no ep_plan' from inside check."""
    cfg = _cfg(features=FeatureConfig(max_length=256, aux_layer_ids=[1, 2, 3], backend="hf_tp", tp_size=2,
                                      expert_parallel=True))
    problems = _problems(cfg, gpus=(4, 10**9))
    assert [f for f, _ in problems] == ["features.expert_parallel"]
    assert "no routed experts" in problems[0][1] and "set features.expert_parallel to false" in problems[0][1]


def _init(tmp_path, **kw):
    out = tmp_path / "init"
    save_draft(tiny_draft(1, **kw), out)                  # not export_draft: some are wrong on purpose
    return out


def _init_problems(init_from, draft=None, **train):
    cfg = _cfg(train=TrainConfig(init_from=str(init_from), **train),
               draft=draft or DraftConfig(draft_vocab_size=50, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=8, intermediate_size=64))
    facts, problems = check_run(cfg, target_config=TARGET, memory=(TB, "test"))
    return facts.get("init_from"), problems


def test_a_warm_start_draft_that_fits_passes_and_is_described(tmp_path):
    facts, problems = _init_problems(_init(tmp_path))
    assert problems == [] and facts["format"] == "SGLang draft directory" and facts["dir"].endswith("init")


def test_a_missing_init_from_is_refused_before_anything_runs(tmp_path):
    _, problems = _init_problems(tmp_path / "no_such_draft")
    assert [f for f, _ in problems] == ["train.init_from"] and "does not exist" in problems[0][1]
    (tmp_path / "empty").mkdir()
    _, problems = _init_problems(tmp_path / "empty")
    assert [f for f, _ in problems] == ["train.init_from"] and "holds a draft" in problems[0][1]


def test_an_eagle2_warm_start_draft_is_refused_with_what_to_do(tmp_path):
    out = _init(tmp_path)
    conf = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**conf, "architectures": ["LlamaForCausalLMEagle"]}))
    _, problems = _init_problems(out)
    assert [f for f, _ in problems] == ["train.init_from"]
    assert "an EAGLE-2 draft" in problems[0][1] and "unset train.init_from" in problems[0][1]


def test_a_warm_start_draft_of_another_geometry_vocab_or_layers_names_the_field_and_a_fix(tmp_path):
    _, problems = _init_problems(_init(tmp_path, intermediate_size=96))
    assert [f for f, _ in problems] == ["draft.intermediate_size"]
    assert "set draft.intermediate_size to 96" in problems[0][1]
    shutil.rmtree(tmp_path / "init")
    _, problems = _init_problems(_init(tmp_path, aux_layer_ids=[1, 3, 4]))
    assert [f for f, _ in problems] == ["features.aux_layer_ids"]
    assert "set features.aux_layer_ids to [1, 3, 4]" in problems[0][1]
    shutil.rmtree(tmp_path / "init")
    _, problems = _init_problems(_init(tmp_path, vocab_size=96))
    assert [f for f, _ in problems] == ["target.model"]
    assert "trained for another target" in problems[0][1] and "set target.model" not in problems[0][1]
    shutil.rmtree(tmp_path / "init")
    _, problems = _init_problems(_init(tmp_path), draft=DraftConfig(draft_vocab_size=40, num_attention_heads=4,
                                                                    num_key_value_heads=2, head_dim=8,
                                                                    intermediate_size=64))
    assert [f for f, _ in problems] == ["draft.draft_vocab_size"] and "'rebuild'" in problems[0][1]
    assert _init_problems(tmp_path / "init", draft=DraftConfig(draft_vocab_size=40, num_attention_heads=4,
                                                              num_key_value_heads=2, head_dim=8,
                                                              intermediate_size=64), init_vocab="rebuild")[1] == []


def test_a_kept_vocab_map_that_contradicts_itself_is_refused_naming_init_vocab(tmp_path):
    from safetensors.torch import load_file, save_file
    out = _init(tmp_path)
    t = load_file(str(out / "model.safetensors"))
    t["d2t"] = torch.zeros(50, dtype=torch.long)                 # t2d marks even ids; zeros name 0..49
    save_file(t, str(out / "model.safetensors"))
    _, problems = _init_problems(out)
    assert [f for f, _ in problems] == ["train.init_vocab"] and "'rebuild'" in problems[0][1]


def test_free_disk_below_the_features_stage_s_bytes_is_refused_naming_the_fix(tmp_path):
    """plan's formula: num_train x tokens per sample x the format's bytes per token (here H_t 32: 8 x 32 + 9 B in
    bf16), at most max_length tokens until the tokenize stage measured them; what features/ holds counts as done."""
    cfg = _cfg(run_dir=tmp_path / "run", prompts=PromptConfig(num_train=1000, num_eval=16))
    need = 1000 * 256 * (8 * 32 + 9)
    assert _problems(cfg, disk=(need + 1, "test disk")) == []
    problems = _problems(cfg, disk=(need - 1, "test disk"))
    assert [f for f, _ in problems] == ["run_dir"]
    assert "~0.1 GB" in problems[0][1] and "test disk" in problems[0][1]
    assert "the features.format values that fit: 'fp8' (0.0 GB), 'online' (0.0 GB)." in problems[0][1]
    fp8 = 1000 * 256 * (4 * 32 + 17)                             # store_formats.features_bytes, plan's rule too
    problems = _problems(cfg, disk=(fp8 - 1, "test disk"))
    assert "the features.format values that fit: 'online' (0.0 GB)." in problems[0][1]
    assert "python -m eagle3_core.plan CONFIG --disk SIZE" in problems[0][1]
    tok = cfg.run_dir / "tokenized"
    tok.mkdir(parents=True)
    (tok / "manifest.json").write_text(json.dumps({"samples": 10, "tokens": 1000}))    # 100 tokens per sample
    facts, problems = check_run(cfg, target_config=TARGET, memory=(TB, "test"), disk=(need // 2, "test disk"))
    assert problems == [] and facts["disk"]["tokens_per_sample"] == 100
    assert facts["disk"]["from"] == "the tokenize stage's mean"
    # check_or_raise (every flow run's first step) looks at run_dir's own file system
    facts = check_or_raise(cfg, target_config=TARGET, memory=(TB, "test"), log=lambda *_: None)
    assert facts["disk"]["free_gb"] == round(shutil.disk_usage(cfg.run_dir).free / 1e9, 2)
