"""The exported draft's aux ids as each engine serves them: the pinned SGLang wheel's own
`set_eagle3_layers_to_capture` (fetched from the package registry as the stand-in name check does, its source
compiled here; nothing else of SGLang runs) executed on our export's config.json, for the default and custom ids on
Llama- and DeepSeek-family targets (and Kimi-K2.5 through its wrapper), must capture the layers the features stage
extracted; so must vLLM's and llama.cpp's readings of the top-level ids (layer inputs: vLLM
`vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py` get_eagle3_aux_layers_from_config, llama.cpp
`convert_hf_to_gguf.py`). Ids no engine can express are refused by check and by the export, naming the fix."""
import ast
import json
import zipfile
from types import SimpleNamespace
from typing import List, Optional

import pytest
import torch

import sglang_names
from eagle3_core.check import check_run
from eagle3_core.config import DraftConfig, FeatureConfig, GenerationConfig, PipelineConfig, ServerConfig, TargetConfig
from eagle3_core.data.vocab_map import build_vocab_map
from eagle3_core.evaluation.preflight import check_draft
from eagle3_core.features.extract import HFExtractor
from eagle3_core.target.family import (
    PLUS_ONE,
    PLUS_ONE_IF_FIRST_IS_1,
    draft_aux_ids,
    resolve_aux_ids,
    sglang_layers_to_capture,
    sglang_rule,
)
from eagle3_core.target.loading import load_target, load_target_config
from eagle3_core.training.checkpoint import CheckpointError, export_draft, load_draft
from eagle3_core.training.draft_geometry import draft_shape
from eagle3_core.training.setup import build_draft

# the SGLang 0.5.14 model class that serves each tiny target family: (file, class, method's owner class)
SGLANG_MODEL = {"llama": ("sglang/srt/models/llama.py", "LlamaForCausalLM"),
                "deepseek_v3": ("sglang/srt/models/deepseek_v2.py", "DeepseekV2ForCausalLM"),   # V3 subclasses V2
                "kimi_k25": ("sglang/srt/models/deepseek_v2.py", "DeepseekV2ForCausalLM")}      # its language_model
KIMI_WRAPPER = ("sglang/srt/models/kimi_k25.py", "KimiK25ForConditionalGeneration")
METHOD = "set_eagle3_layers_to_capture"


def wheel_method(zf: zipfile.ZipFile, rel: str, cls: str, name: str):
    """Method `name` of class `cls` in the wheel's module `rel`, compiled from the wheel's own source (its
    annotations need only typing's List and Optional)."""
    tree = ast.parse(zf.read(rel).decode())
    owner = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in owner.body if isinstance(n, ast.FunctionDef) and n.name == name)
    ns = {"List": List, "Optional": Optional}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), f"sglang-{sglang_names.PINNED}/{rel}", "exec"), ns)
    return ns[name]


@pytest.fixture(scope="module")
def sglang_capture():
    """family -> f(nested ids or None, L) -> the layers whose input the pinned SGLang captures (its model's
    `model.layers_to_capture` after the wheel's own set_eagle3_layers_to_capture ran on a model of L layers)."""
    wheel, why = sglang_names.pinned_wheel()
    if wheel is None:
        pytest.skip(f"no registry reachable for the pinned wheel: {why}")
    zf = zipfile.ZipFile(wheel)
    runner = zf.read("sglang/srt/model_executor/model_runner.py").decode()
    # model_runner.py hands the draft's nested eagle_config ids to the target model's method
    assert 'eagle_config["eagle_aux_hidden_state_layer_ids"]' in runner.replace("\n", "").replace(" ", "")
    assert f"self.model.{METHOD}(" in runner
    wrapper = wheel_method(zf, *KIMI_WRAPPER, METHOD)

    def capture(fam: str, nested, L: int) -> list[int]:
        model = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True), model=SimpleNamespace(),
                                config=SimpleNamespace(num_hidden_layers=L))
        fn = wheel_method(zf, *SGLANG_MODEL[fam], METHOD)
        if fam == "kimi_k25":
            lm = model
            model.set_eagle3_layers_to_capture = lambda ids: fn(lm, ids)
            wrapper(SimpleNamespace(language_model=model), nested)
        else:
            fn(model, nested)
        assert model.capture_aux_hidden_states is True
        return list(model.model.layers_to_capture)
    return capture


def _cfg(fam: str, target_dir, ids) -> PipelineConfig:
    return PipelineConfig(target=TargetConfig(model=str(target_dir)), server=ServerConfig(kind="transformers"),
                          features=FeatureConfig(max_length=256, aux_layer_ids=ids),
                          generation=GenerationConfig(max_new_tokens=64), draft=DraftConfig(draft_vocab_size=64))


CASES = [(fam, ids) for fam in ("llama", "deepseek_v3", "kimi_k25")
         for ids in (None, [1, 3, 5], [2, 3, 5], [2, 4, 6], [0, 3, 5])]


@pytest.mark.parametrize(("fam", "ids"), CASES)
def test_every_engine_captures_the_layers_the_features_stage_extracted(fam, ids, tiny_target_dirs, tmp_path,
                                                                       sglang_capture):
    cfg = _cfg(fam, tiny_target_dirs[fam], ids)
    tcfg = load_target_config(cfg.target)
    L = 8
    extracted = resolve_aux_ids(ids, L)                        # what the features stage stores (layer outputs)
    model = load_target(cfg.target)
    d2t, t2d = build_vocab_map(torch.arange(128).flip(0), 64)
    draft = build_draft(draft_shape(tcfg, 64, extracted, overrides=cfg.draft.geometry()),
                        model.get_input_embeddings().weight.detach(), d2t, t2d, seed=0)
    rule = sglang_rule(tcfg)
    assert rule == (PLUS_ONE if fam == "llama" else PLUS_ONE_IF_FIRST_IS_1)
    _, problems = check_run(cfg, target_config=tcfg, memory=(1 << 40, "test"), gpus=None)
    if fam != "llama" and extracted[0] == 0:                  # SGLang's deepseek_v2.py cannot capture layer 0's output
        assert [f for f, _ in problems] == ["features.aux_layer_ids"], problems
        assert "models/deepseek_v2.py" in problems[0][1] and "start the ids at 1 or higher" in problems[0][1]
        with pytest.raises(CheckpointError, match=r"cannot capture layer 0's output.*start the ids at 1"):
            export_draft(draft, tmp_path / "export", sglang_rule=rule)
        return
    assert problems == [], problems
    export = export_draft(draft, tmp_path / "export", sglang_rule=rule)
    saved = json.loads((export / "config.json").read_text())
    served = {"sglang": sglang_capture(fam, saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"], L),
              "vllm": saved["eagle_aux_hidden_state_layer_ids"],          # top level, layer inputs
              "llama.cpp": saved["eagle_aux_hidden_state_layer_ids"]}
    for engine, inputs in served.items():
        assert [i - 1 for i in inputs] == extracted, (engine, inputs)
    # our readers agree with the engines: the reload, check --draft, preflight, and the mirror of SGLang's rule
    assert load_draft(export).shape.aux_layer_ids == extracted
    assert draft_aux_ids(saved, rule, L) == extracted and check_draft(export, tcfg) == []
    nested = saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert sglang_layers_to_capture(nested, rule, L) == served["sglang"]
    # the tensors: the extracted features are the hidden states entering the layers SGLang captures
    seq = [[5, 9, 17, 33, 2, 70, 11]]
    with torch.no_grad():
        hs = model(input_ids=torch.tensor(seq), output_hidden_states=True).hidden_states   # hs[j]: input of layer j
    aux = HFExtractor(model, extracted).forward(seq)["aux"]
    assert torch.equal(aux, torch.cat([hs[j] for j in served["sglang"]], dim=-1))


def test_a_specforge_draft_captured_by_sglang_on_a_deepseek_target_reads_as_the_layers_it_served(sglang_capture):
    """SpecForge passes its draft config's ids raw to SGLang's capture; on a DeepSeek/Kimi target [2, 30, 58] are
    read as layer inputs (outputs [1, 29, 57]), on a Llama target as outputs. A config with only nested ids is read
    the same way by warm start and check (draft_aux_ids)."""
    specforge = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}}
    L = 61
    assert sglang_capture("kimi_k25", [2, 30, 58], L) == [2, 30, 58]
    assert draft_aux_ids(specforge, PLUS_ONE_IF_FIRST_IS_1, L) == [1, 29, 57]
    assert sglang_capture("llama", [2, 30, 58], L) == [3, 31, 59]
    assert draft_aux_ids(specforge, PLUS_ONE, L) == [2, 30, 58]
    # no ids at all: both files capture the inputs of [2, L // 2, L - 3]
    for fam, rule in (("llama", PLUS_ONE), ("kimi_k25", PLUS_ONE_IF_FIRST_IS_1)):
        assert sglang_capture(fam, None, L) == [2, 30, 58] == sglang_layers_to_capture(None, rule, L)
        assert draft_aux_ids({}, rule, L) == [1, 29, 57]


@pytest.mark.parametrize(("fam", "trained_on"), [("deepseek_v3", [1, 2, 4]), ("llama", [2, 3, 5])])
def test_check_draft_reads_a_specforge_draft_as_sglang_served_it(fam, trained_on, tiny_target_dirs, tmp_path):
    """`check --draft` on a draft naming only SGLang's nested ids [2, 3, 5] (SpecForge's config): on a DeepSeek
    target they were layer inputs (outputs [1, 2, 4]), on a Llama target outputs. check asks for the ids the
    draft was trained on; preflight finds nothing wrong with the ids."""
    cfg = _cfg(fam, tiny_target_dirs[fam], trained_on)
    tcfg = load_target_config(cfg.target)
    model = load_target(cfg.target)
    d2t, t2d = build_vocab_map(torch.arange(128).flip(0), 64)
    draft = build_draft(draft_shape(tcfg, 64, trained_on, overrides=cfg.draft.geometry()),
                        model.get_input_embeddings().weight.detach(), d2t, t2d, seed=0)
    export = export_draft(draft, tmp_path / "d", sglang_rule=sglang_rule(tcfg))
    conf = json.loads((export / "config.json").read_text())
    conf.pop("eagle_aux_hidden_state_layer_ids")
    conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 3, 5]
    (export / "config.json").write_text(json.dumps(conf))
    assert check_draft(export, tcfg) == []
    facts, problems = check_run(cfg, export, target_config=tcfg, memory=(1 << 40, "test"), gpus=None)
    assert problems == [] and facts["draft"]["aux_ids"] == trained_on, problems
    other = _cfg(fam, tiny_target_dirs[fam], [1, 3, 5])
    _, problems = check_run(other, export, target_config=tcfg, memory=(1 << 40, "test"), gpus=None)
    assert [f for f, _ in problems] == ["features.aux_layer_ids"]
    assert f"set features.aux_layer_ids to {trained_on}" in problems[0][1]


def test_an_export_written_before_the_per_file_rule_is_flagged_on_a_deepseek_target(tiny_target_dirs, tmp_path,
                                                                                     sglang_capture):
    """Exports made before this rule wrote the nested ids as they are on every target: on DeepSeek/Kimi, ids not
    starting at 1 are then served one layer off (the wheel's own function says so), and preflight names it."""
    cfg = _cfg("deepseek_v3", tiny_target_dirs["deepseek_v3"], [2, 3, 5])
    tcfg = load_target_config(cfg.target)
    model = load_target(cfg.target)
    d2t, t2d = build_vocab_map(torch.arange(128).flip(0), 64)
    draft = build_draft(draft_shape(tcfg, 64, [2, 3, 5], overrides=cfg.draft.geometry()),
                        model.get_input_embeddings().weight.detach(), d2t, t2d, seed=0)
    old = export_draft(draft, tmp_path / "old", sglang_rule=PLUS_ONE)           # what the old export wrote
    saved = json.loads((old / "config.json").read_text())
    assert saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 5]
    assert [i - 1 for i in sglang_capture("deepseek_v3", [2, 3, 5], 8)] == [1, 2, 4]     # one layer off
    problems = check_draft(old, tcfg)
    assert [f for f, _ in problems] == ["eagle_aux_hidden_state_layer_ids"], problems
    assert "captures the outputs of [1, 2, 4] for nested ids [2, 3, 5]" in problems[0][1]
    assert "re-export the draft with this project for this target" in problems[0][1]
