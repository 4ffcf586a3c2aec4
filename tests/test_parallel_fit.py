"""check's features-backend verdict (target.memory_fit.backend_facts via check_run): parameter bytes per GPU at the
chosen features.tp_size against one GPU's memory, from the config alone; sizes that cannot fit or split heads
unevenly are refused naming features.tp_size. The per-rank counts themselves are compared with what real ranks
hold in tests/test_tp_extract.py."""
from pathlib import Path

import pytest
from pydantic import ValidationError
from transformers import LlamaConfig

from eagle3_core.check import check_run, main, render, target_config_file
from eagle3_core.config import FeatureConfig, GenerationConfig, PipelineConfig, load_config
from eagle3_core.target.memory import (
    meta_model,
    param_bytes_per_rank,
    quantization,
    stored_bytes,
    stored_bytes_per_param,
)
from test_check import TB, kimi_k25  # noqa: F401 (the Kimi-K2.5-sized config fixture)

LLAMA = LlamaConfig(hidden_size=32, num_hidden_layers=8, vocab_size=128, max_position_embeddings=256,
                    num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=False)
H200 = (8, 141 * 10**9)
ROOT = Path(__file__).resolve().parent.parent


def _check(target, gpus, memory=TB, **features):
    """memory: what the in-process stages get (evaluate loads the whole target); not what this test is about. Nor is
    the training row's fit on these GPUs of kilobytes (checkers.train_memory_check: tests/test_train_memory.py)."""
    cfg = PipelineConfig(features=FeatureConfig(max_length=256, aux_layer_ids=[1, 3, 4], **features),
                         generation=GenerationConfig(max_new_tokens=64))       # room for the prompt in 256
    facts, problems = check_run(cfg, target_config=target, memory=(memory, "test"), gpus=gpus)
    return facts["backends"]["features"], [(f, m) for f, m in problems if f != "train.batch_tokens"]


def test_llama_bytes_per_rank_by_hand():
    """embed + lm_head (vocab-sharded) + 8 x (q, k, v, o, gate, up, down: sharded; 2 norms whole) + final norm."""
    per_layer = (32 * 32 + 2 * 16 * 32 + 32 * 32 + 3 * 64 * 32) // 2 + 2 * 32
    assert param_bytes_per_rank(meta_model(LLAMA), 2) == 2 * (2 * 128 * 32 // 2 + 8 * per_layer + 32)
    assert param_bytes_per_rank(meta_model(LLAMA), 1) == 2 * 82464


def test_check_names_the_backend_and_size_a_target_needs():
    small, big = (4, 100_000), (4, 10**9)             # GPUs of 100 KB hold half the tiny Llama; of 1 GB all of it
    facts, problems = _check(LLAMA, big)
    assert problems == [] and facts["needs"] == "hf (the whole target fits one GPU)" and facts["chosen"] == "hf"
    facts, problems = _check(LLAMA, small)
    assert facts["needs"].startswith("hf_tp with tp_size >= 2") and problems == []   # backend hf: in-process check
    _, problems = _check(LLAMA, small, backend="hf_tp", tp_size=2)
    assert problems == []
    _, problems = _check(LLAMA, (4, 50_000), backend="hf_tp", tp_size=2)
    assert [f for f, _ in problems] == ["features.tp_size"] and "exceed 85% of one GPU" in problems[0][1]
    _, problems = _check(LLAMA, big, backend="hf_tp", tp_size=4)       # 2 KV heads cannot be split over 4 ranks
    assert [f for f, _ in problems] == ["features.tp_size"] and "num_key_value_heads = 2" in problems[0][1]


def test_kimi_k25_needs_32_h200s_in_bf16(kimi_k25):  # noqa: F811
    """~1.03T parameters = ~2.05 TB bf16: 8 H200s at expert parallel hold ~260 GB each (1/8 of the ~2.03 TB of
    routed experts plus what the plan keeps whole: which those are is transformers' plan, and it moves between
    versions: 268.3 GB and 259.2 GB were seen with two releases; tests/test_lock.py pins the locked release's
    figure), refused; 32 fit."""
    facts, problems = _check(kimi_k25, H200, 8 * TB, backend="hf_tp", tp_size=8, expert_parallel=True)
    # the whole model: the installed transformers' own count of its parameters (bf16), ~1.03T parameters
    whole = sum(p.numel() for p in meta_model(kimi_k25).parameters()) * 2 / 1e9
    assert facts["param_gb_per_rank_bf16"][1] == round(whole, 2) and 2040 < whole < 2060
    assert facts["needs"].startswith("hf_tp with tp_size >= 32")
    per_rank = facts["param_gb_per_rank_bf16"][8]
    assert 2030 / 8 < per_rank < 2051 / 8 + 30, per_rank      # experts split 8 ways, at most ~30 GB kept whole
    assert [f for f, _ in problems] == ["features.tp_size"] and f"{per_rank:.1f} GB" in problems[0][1]
    facts, problems = _check(kimi_k25, H200, 8 * TB, backend="hf_tp", tp_size=32, expert_parallel=True)
    assert problems == [] and "nnodes" in facts["hosts"]


def test_parallel_size_without_the_parallel_backend_is_refused():
    with pytest.raises(ValidationError, match="need features.backend 'hf_tp'"):
        FeatureConfig(tp_size=2)


KIMI_OFFLINE = ROOT / "tests" / "data" / "kimi_k25" / "config.json"
REFERENCE = ROOT / "configs" / "kimi_k25_agentic_100k.json"


def test_the_offline_kimi_k25_checkpoint_is_counted_as_stored():
    """Routed experts INT4 with a bf16 scale per 32 weights (0.5625 B a parameter): 60 MoE layers x 384 experts x
    3 matrices x 7168 x 2048; everything else (attention, shared experts, dense layer 0, embeddings, lm_head, the
    vision tower) bf16 as the ignore list says: ~595 GB in all, against ~2.05 TB in bf16."""
    tcfg = target_config_file(KIMI_OFFLINE)
    q = quantization(tcfg)
    model = meta_model(tcfg)
    stored = stored_bytes(model, q)
    experts = 60 * 384 * 3 * 7168 * 2048
    assert stored["routed_experts"] == experts * (4 / 8 + 2 / 32) and stored["experts_quantized"]
    rest = sum(p.numel() for p in model.parameters()) - experts
    assert stored["total"] == stored["routed_experts"] + 2 * rest
    assert 590e9 < stored["total"] < 600e9
    assert stored_bytes(model, None)["total"] == 2 * (rest + experts)
    assert stored_bytes_per_param("model.language_model.layers.3.self_attn.q_a_proj", "Linear", q) == 2  # ignored
    assert stored_bytes_per_param("model.language_model.layers.3.mlp.experts.7.down_proj", "Linear", q) == 0.5625


def _reference(**features):
    cfg = load_config(REFERENCE)
    if features:
        cfg = cfg.model_copy(update={"features": cfg.features.model_copy(update=features)})
    return check_run(cfg, target_config=target_config_file(KIMI_OFFLINE), memory=(128 << 30, "a 128 GiB head node"),
                     gpus=H200)


def test_the_reference_config_fits_8_h200s_with_int4_experts():
    """features.backend 'ep_int4' at tp_size 8: 1/8 of 570.8 GB of INT4 experts + the bf16 rest whole + one layer's
    experts dequantized; evaluation by replay, so no stage loads the whole target (the head node's 128 GiB)."""
    facts, problems = _reference()
    assert problems == [], problems
    feats = facts["backends"]["features"]
    experts_gb = 570.76 / 8                                   # plus the split layers' 1/8, the rest whole, a buffer
    assert experts_gb < feats["gb_per_gpu"] < experts_gb + 20 and feats["gb_per_gpu"] < 0.85 * 141, feats
    assert feats["gb_per_gpu"] == feats["gb_per_rank_ep_int4"][8]
    assert feats["checkpoint_gb"]["quantization"].startswith("int4 group 32")
    assert facts["backends"]["evaluate"]["evaluator"] == "replay"
    assert f"gb_per_gpu: {feats['gb_per_gpu']}" in render(facts)             # printed by check


def test_bf16_experts_on_8_h200s_are_refused_naming_ep_int4():
    """'hf_tp' makes transformers dequantize the experts to bf16 at load: ~260 GB per GPU at EP 8."""
    facts, problems = _reference(backend="hf_tp", expert_parallel=True)
    assert [f for f, _ in problems] == ["features.backend"], problems
    assert "exceed 85% of one GPU" in problems[0][1] and "needs ep_int4 with tp_size >= 8" in problems[0][1]
    assert facts["backends"]["features"]["gb_per_gpu"] > 2029 / 8


def test_ep_int4_refusals_name_the_field(kimi_k25):  # noqa: F811
    cfg = PipelineConfig(features=FeatureConfig(max_length=2048, backend="ep_int4", tp_size=8))
    _, problems = check_run(cfg, target_config=kimi_k25, memory=(8 * TB, "test"), gpus=H200)   # bf16 experts
    assert ("features.backend" in [f for f, _ in problems] and
            "use 'hf_tp'" in dict(problems)["features.backend"]), problems
    _, problems = _reference(tp_size=5)
    assert [f for f, _ in problems] == ["features.tp_size"] and "divide the 384 routed experts" in problems[0][1]


def test_check_cli_passes_the_reference_config_offline(capsys):
    assert main([str(REFERENCE), "--target-config", str(KIMI_OFFLINE)]) == 0
    out = capsys.readouterr().out
    assert "evaluator: replay" in out and "check: passed" in out


def _variant(tmp_path, **weights):
    """The offline Kimi-K2.5 config.json with its experts' config group changed as `weights` says (a checkpoint
    quantized another way than the published one)."""
    import json
    conf = json.loads(KIMI_OFFLINE.read_text())
    conf["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"].update(weights)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(conf))
    return target_config_file(path)


@pytest.mark.parametrize(("weights", "named"), [
    ({"symmetric": False}, "weights.symmetric = False (needs True)"),
    ({"group_size": 128}, "weights.group_size = 128 (needs 32)"),
    ({"num_bits": 8}, "weights.num_bits = 8 (needs 4)")])
def test_ep_int4_refuses_the_int4_variants_it_does_not_implement(tmp_path, weights, named):
    """'ep_int4' reads only 4-bit symmetric group-32 pack-quantized experts: an asymmetric checkpoint's
    weight_zero_point would be ignored, group-128 and 8-bit ones would fail inside torchrun naming a shape. check
    refuses each naming the quantization_config field and what works; 'hf_tp' (bf16 at load) is not refused for
    the scheme, and plan's `needs` no longer offers 'ep_int4'."""
    cfg = load_config(REFERENCE)
    facts, problems = check_run(cfg, target_config=_variant(tmp_path, **weights),
                                memory=(128 << 30, "a 128 GiB head node"), gpus=H200)
    assert [f for f, _ in problems] == ["features.backend"], problems
    msg = problems[0][1]
    assert f"quantization_config.config_groups.group_0.{named}" in msg and "use 'hf_tp'" in msg, msg
    assert "gb_per_rank_ep_int4" not in facts["backends"]["features"]
    assert "ep_int4" not in facts["backends"]["features"]["needs"]
    assert facts["backends"]["features"]["needs"].startswith("hf_tp with tp_size >= 32")
    hf_tp = cfg.model_copy(update={"features": cfg.features.model_copy(update={"backend": "hf_tp", "tp_size": 32,
                                                                               "expert_parallel": True})})
    _, problems = check_run(hf_tp, target_config=_variant(tmp_path, **weights), memory=(TB, "test"), gpus=H200)
    assert problems == [], problems


def test_the_ep_int4_loader_refuses_an_asymmetric_checkpoint_before_reading_a_weight(tmp_path):
    """The same rule where the ranks load (target.ep_loading.load_int4_target), for a run that skipped check: a
    tiny INT4 DeepSeek-V3 whose config says asymmetric is refused naming config.json and the field."""
    import json

    from eagle3_core.config import TargetConfig
    from eagle3_core.target.ep_loading import load_int4_target
    from int4_targets import build_int4
    out = build_int4("deepseek_v3", tmp_path / "t", layers=2)
    conf = json.loads((out / "config.json").read_text())
    conf["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = False
    (out / "config.json").write_text(json.dumps(conf))
    (out / "model.safetensors").write_bytes(b"not read")                  # proof that no weight is read first
    with pytest.raises(ValueError, match=r"config.json: 'ep_int4' implements only .*weights.symmetric = False "
                                         r"\(needs True\).*use 'hf_tp'"):
        load_int4_target(TargetConfig(model=str(out)), "cpu")


def test_check_gpus_names_the_node_offline_and_refuses_hf_tp_on_the_int4_kimi_config(tmp_path, capsys):
    """With no GPU here, `check` alone cannot know the node: hf_tp at ~259 GB per GPU passes. `--gpus 8x141GB`
    (8 H200s) checks the fit against them: refused with the arithmetic and the backend that fits; the reference
    config's ep_int4 passes on the same node with its per-GPU figure printed."""
    import json
    conf = json.loads(REFERENCE.read_text())
    conf["features"].update(backend="hf_tp", expert_parallel=True, tp_size=8)
    path = tmp_path / "hf_tp.json"
    path.write_text(json.dumps(conf))
    offline = [str(path), "--target-config", str(KIMI_OFFLINE)]
    assert main([*offline, "--gpus", "none"]) == 0                          # no GPU: only the layout is reported
    capsys.readouterr()
    assert main([*offline, "--gpus", "8x141GB"]) == 1
    out, err = capsys.readouterr()
    assert "gpus: 8 x 141 GB" in out and "weights_budget_gb_per_gpu: 119.8 (85% of 141 GB)" in out
    gb = float(next(line for line in out.splitlines() if line.strip().startswith("gb_per_gpu:")).split(":")[1])
    assert 2029 / 8 < gb < 2029 / 8 + 10                                    # the bf16 experts' 1/8 and the rest
    import re
    m = re.search(r"- features.backend: ([\d.]+) GB of weights per GPU with backend 'hf_tp' at tp_size 8 exceed "
                  r"85% of one GPU \(141 GB\); needs ep_int4 with tp_size >= 8 \(([\d.]+) GB per GPU", err)
    assert m and abs(float(m[1]) - gb) < 0.06 and float(m[2]) < 0.85 * 141, err
    assert main([str(REFERENCE), "--target-config", str(KIMI_OFFLINE), "--gpus", "8x141GB"]) == 0
    out = capsys.readouterr().out
    assert "gpus: 8 x 141 GB" in out and "check: passed" in out
    assert main([str(REFERENCE), "--target-config", str(KIMI_OFFLINE), "--gpus", "8 H200"]) == 1
    assert "--gpus '8 H200': give the node's GPUs as NxSIZE" in capsys.readouterr().err


def test_parse_gpus_units():
    from eagle3_core.check import parse_gpus
    assert parse_gpus("8x141GB") == (8, 141 * 10**9) and parse_gpus("4x80GiB") == (4, 80 * 2**30)
    assert parse_gpus("2x24") == (2, 24 * 10**9) and parse_gpus("none") is None
