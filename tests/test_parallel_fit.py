"""check's features-backend verdict (parallel_fit.backend_facts via check_run): parameter bytes per GPU at the
chosen features.tp_size against one GPU's memory, from the config alone; sizes that cannot fit or split heads
unevenly are refused naming features.tp_size. The per-rank counts themselves are compared with what real ranks
hold in tests/test_tp_extract.py."""
import pytest
from pydantic import ValidationError
from transformers import LlamaConfig

from eagle3_core.check import check_run
from eagle3_core.config import FeatureConfig, PipelineConfig
from eagle3_core.target.memory import meta_model, param_bytes_per_rank
from test_check import TB, kimi_k25  # noqa: F401 (the Kimi-K2.5-sized config fixture)

LLAMA = LlamaConfig(hidden_size=32, num_hidden_layers=8, vocab_size=128, max_position_embeddings=256,
                    num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=False)
H200 = (8, 141 * 10**9)


def _check(target, gpus, memory=TB, **features):
    """memory: what the in-process stages get (evaluate loads the whole target); not what this test is about."""
    cfg = PipelineConfig(features=FeatureConfig(max_length=256, aux_layer_ids=[1, 3, 4], **features))
    facts, problems = check_run(cfg, target_config=target, memory=(memory, "test"), gpus=gpus)
    return facts["backends"]["features"], problems


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
    versions: 268.3 GB and 259.2 GB were seen with two releases), refused; 32 fit."""
    facts, problems = _check(kimi_k25, H200, 8 * TB, backend="hf_tp", tp_size=8, expert_parallel=True)
    assert facts["param_gb_per_rank_bf16"][1] == pytest.approx(2051, rel=1e-3)
    assert facts["needs"].startswith("hf_tp with tp_size >= 32")
    per_rank = facts["param_gb_per_rank_bf16"][8]
    assert 2030 / 8 < per_rank < 2051 / 8 + 30, per_rank      # experts split 8 ways, at most ~30 GB kept whole
    assert [f for f, _ in problems] == ["features.tp_size"] and f"{per_rank:.1f} GB" in problems[0][1]
    facts, problems = _check(kimi_k25, H200, 8 * TB, backend="hf_tp", tp_size=32, expert_parallel=True)
    assert problems == [] and "nnodes" in facts["hosts"]


def test_parallel_size_without_the_parallel_backend_is_refused():
    with pytest.raises(ValidationError, match="need features.backend 'hf_tp'"):
        FeatureConfig(tp_size=2)


def test_kimi_k25_fits_one_node_of_h200s_with_int4_experts(kimi_k25):  # noqa: F811
    """features.backend 'ep_int4' at 8 ranks: 1/8 of the routed-expert parameters at 0.5625 bytes (the published
    checkpoint's 570.76 GB of experts / 8 = 71.3 GB), 1/8 of MLA and the dense/shared MLPs, the rest (embeddings,
    lm_head, routers, norms) whole, plus one dequantized layer (83.1 GB in all with transformers 5.25): fits an
    H200, no problem reported."""
    facts, problems = _check(kimi_k25, H200, 8 * TB, backend="ep_int4", tp_size=8)
    assert problems == [], problems
    gb = facts["int4_gb_per_rank"]
    assert 570.76 / 8 < gb < 570.76 / 8 + 20, gb                 # experts plus at most ~20 GB of the rest
    assert gb < 0.85 * 141 and gb < facts["param_gb_per_rank_bf16"][8] / 2.5
