"""The draft's capacity options (a wider MLP, two decoder layers, EAGLE-3.1): each against an independent forward
written the way SGLang 0.5.14 runs it (`models/llama_eagle3.py`: fused residual add + RMSNorm), TTT steps against
the serving-time chain with a KV cache, trained by the real trainer, exported and reloaded strictly, run by the
offline evaluators; and the export refused, naming option and engine, where no deploy engine serves it."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import tiny_draft
from eagle3_core.evaluation.replay_eval import replay_chain
from eagle3_core.target.family import PLUS_ONE
from eagle3_core.training.capacity import ENGINES, SERVES, options_used, serving_engines
from eagle3_core.training.checkpoint import CheckpointError, expected_tensors, export_draft, load_draft, save_draft
from eagle3_core.training.draft_model import rms_norm
from eagle3_core.training.trainer import train
from eagle3_core.training.ttt_attention import ttt_caches
from test_draft_model import assert_serving_chain_equals_ttt, ttt_logits
from train_worker import CFG, samples

OPTIONS = {"wider_mlp": {"intermediate_size": 160}, "two_layers": {"num_hidden_layers": 2},
           "eagle3.1": {"fc_norm": True, "norm_output": True},
           "two_layers+eagle3.1": {"num_hidden_layers": 2, "fc_norm": True, "norm_output": True}}
LAYERED = ("two_layers", "eagle3.1", "two_layers+eagle3.1")


def sglang_forward(d, ids, aux):
    """The draft over one sequence (batch 1, causal) as SGLang's LlamaModel.forward computes it: fc_norm per aux
    chunk, fc, layer 0 on [input_layernorm(embed), hidden_norm(h)], layer i > 0 on hidden_norm(mlp_out + residual),
    logits from norm(mlp_out + residual), the aux state fed back normed with norm_output. Returns (aux, logits)."""
    s, T = d.shape, ids.shape[1]
    eps = s.rms_norm_eps
    if s.fc_norm:
        aux = torch.cat([rms_norm(c, n.weight, eps) for n, c in zip(d.fc_norm, aux.chunk(3, -1))], -1)
    h = aux @ d.fc.weight.T
    cos, sin = d.rope(torch.arange(T)[None])
    residual, mlp_out = None, None
    for i, layer in enumerate([d.midlayer] + d.later_layers()):
        if i == 0:
            residual = h
            x = torch.cat([rms_norm(d.embed_tokens(ids), layer.input_layernorm.weight, eps),
                           rms_norm(h, layer.hidden_norm.weight, eps)], -1)
        else:
            residual = mlp_out + residual
            x = rms_norm(residual, layer.hidden_norm.weight, eps)
        q, k, v = layer.self_attn.project(x, cos, sin)
        rep = s.num_attention_heads // s.num_key_value_heads
        attn = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                              is_causal=True).transpose(1, 2).reshape(1, T, -1)
        residual = residual + attn @ layer.self_attn.o_proj.weight.T
        mlp_out = layer.mlp(rms_norm(residual, layer.post_attention_layernorm.weight, eps))
    out = mlp_out + residual
    normed = rms_norm(out, d.norm.weight, eps)
    return (normed if s.norm_output else out), normed @ d.lm_head.weight.T


@pytest.mark.parametrize("option", OPTIONS)
def test_the_draft_computes_what_sglang_runs(option):
    d = tiny_draft(**OPTIONS[option]).double()
    g = torch.Generator().manual_seed(3)
    aux = torch.randn(1, 10, 96, generator=g, dtype=torch.float64) * 3
    ids = torch.randint(0, 100, (1, 10), generator=g)
    with torch.no_grad():
        want_h, want = sglang_forward(d, ids, aux)
        h, logits = d.decode(ids, d.fuse(aux), torch.arange(10)[None], {})
        plain = tiny_draft().double()                       # the same seed without the option: another function
        assert not torch.allclose(plain.decode(ids, plain.fuse(aux), torch.arange(10)[None], {})[1], logits)
    torch.testing.assert_close(logits, want, atol=1e-10, rtol=0)
    torch.testing.assert_close(h, want_h, atol=1e-10, rtol=0)


@pytest.mark.parametrize("option", LAYERED)
def test_ttt_steps_equal_the_serving_chain_with_every_layers_kv_cache(option):
    """TTT step k at index t computes what the serving-time draft computes at chain step k after prefix 0..t, with
    each later layer's own TTT cache and KV cache (test_draft_model's check, for the options)."""
    d = tiny_draft(**OPTIONS[option]).double()
    g = torch.Generator().manual_seed(2)
    T, K, t = 14, 4, 6
    aux = torch.randn(1, T, 96, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 100, (1, T), generator=g)
    with torch.no_grad():
        ck, cv = ttt_caches()
        train_logits = ttt_logits(d, aux, ids, K, (ck, cv))
        assert len(ck.later) == d.shape.num_hidden_layers - 1
        assert_serving_chain_equals_ttt(d, aux, ids, t, train_logits)


@pytest.mark.parametrize("option", OPTIONS)
def test_each_option_trains_exports_and_reloads_strictly(option, tmp_path):
    d = tiny_draft(**OPTIONS[option])
    before = {k: v.clone() for k, v in d.state_dict().items()}
    lm_head = torch.randn(100, 32, generator=torch.Generator().manual_seed(5))
    summary = train(d, samples(8), [], lm_head, CFG.model_copy(update={"epochs": 2, "checkpoint_every": 100}),
                    tmp_path / "train", log=lambda s: None)
    h = summary["history"]
    assert math.isfinite(sum(h[-1]["train"]["loss"])) and sum(h[-1]["train"]["loss"]) < sum(h[0]["train"]["loss"])
    option_params = [k for k in before if k.startswith(("layers.", "fc_norm.", "midlayer.mlp."))]
    assert option_params and all(not torch.equal(before[k], d.state_dict()[k]) for k in option_params)
    out = export_draft(d, tmp_path / "export", sglang_rule=PLUS_ONE)        # reload probed bit for bit inside
    cfg = json.loads((out / "config.json").read_text())
    s = d.shape
    assert cfg["num_hidden_layers"] == s.num_hidden_layers and cfg["intermediate_size"] == s.intermediate_size
    assert cfg.get("fc_norm", False) == s.fc_norm and cfg.get("norm_output", False) == s.norm_output
    back = load_draft(out)
    assert back.shape == s
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {f"fc_norm.{j}.weight" in names for j in range(3)} == {s.fc_norm}
    if s.num_hidden_layers > 1:                 # SGLang's and vLLM's name of layer 1's input norm, equal
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            assert torch.equal(f.get_tensor("layers.1.input_layernorm.weight"),
                               f.get_tensor("layers.1.hidden_norm.weight"))
        assert back.layers["1"].self_attn.q_proj.weight.shape == (32, 32)      # [nh*hd, H]: no embedding input


def test_an_export_whose_later_layer_norms_differ_is_refused(tmp_path):
    d = tiny_draft(num_hidden_layers=2)
    out = save_draft(d, tmp_path / "export")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    tensors["layers.1.input_layernorm.weight"] = tensors["layers.1.input_layernorm.weight"] + 1
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match="layers.1.input_layernorm.weight differs"):
        load_draft(out)


@pytest.mark.parametrize("option, kw", [("two_layers", {"num_hidden_layers": 2}),
                                        ("eagle3.1", {"fc_norm": True, "norm_output": True})])
def test_the_export_is_refused_naming_the_option_where_no_deploy_engine_serves_it(option, kw, tmp_path):
    d = tiny_draft(**kw)
    with pytest.raises(CheckpointError, match=rf"(?s){option}: llama.cpp does not serve it.*deploy on sglang or vllm"):
        export_draft(d, tmp_path / "export", sglang_rule=PLUS_ONE, engines=("llama.cpp",))
    assert not (tmp_path / "export").exists()
    assert serving_engines(d.shape) == ["sglang", "vllm"]
    export_draft(d, tmp_path / "export", sglang_rule=PLUS_ONE, engines=("sglang", "llama.cpp"))  # SGLang serves it
    plain = tiny_draft()
    assert options_used(plain.shape, recipe_intermediate=64) == [] and serving_engines(plain.shape) == list(ENGINES)
    assert options_used(tiny_draft(intermediate_size=160).shape, recipe_intermediate=64) == ["wider_mlp"]


def test_the_engine_table_names_a_source_for_every_cell():
    assert set(SERVES) == {"wider_mlp", "two_layers", "eagle3.1"}
    for option, row in SERVES.items():
        assert set(row) == set(ENGINES), option
        assert all(isinstance(ok, bool) and len(src) > 30 for ok, src in row.values()), option


def test_the_pinned_sglang_reads_the_exported_flags_and_names():
    """The pinned wheel's `models/llama_eagle3.py` (read as source): the config fields the export writes, and every
    exported tensor name, through its legacy name map and stacked q/k/v and gate/up, is one of its parameters."""
    import ast
    import zipfile

    import sglang_names
    wheel, why = sglang_names.pinned_wheel()
    if wheel is None:
        pytest.skip(f"no registry reachable for the pinned wheel: {why}")
    src = zipfile.ZipFile(wheel).read("sglang/srt/models/llama_eagle3.py").decode()
    for read in ('getattr(config, "fc_norm"', 'getattr(config, "norm_output"', "range(config.num_hidden_layers)"):
        assert read in src, read
    legacy = next(ast.literal_eval(n.value) for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Assign)
                  and getattr(n.targets[0], "id", "") == "legacy_name_map")
    assert legacy["midlayer"] == "layers.0"
    params = {"embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
              *(f"fc_norm.{j}.weight" for j in range(3)),
              *(f"layers.{i}.{p}.weight" for i in range(2) for p in (
                  "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj", "input_layernorm",
                  "hidden_norm", "post_attention_layernorm"))}
    d = tiny_draft(**OPTIONS["two_layers+eagle3.1"])
    for name in expected_tensors(d.shape):
        for old, new in legacy.items():
            name = name.replace(old, new)
        for old, new in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                         (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")):
            name = name.replace(old, new)
        assert name in params, name


def _chain_from_scratch(d, s: list[int], aux, P: int, steps: int) -> list[int]:
    """The draft's chain proposals after root s[P], every step recomputed over the whole sequence without a cache
    (committed pairs (aux_p, s[p+1]) for p < P, then each proposal fed back with the previous output)."""
    toks, hid = s[1:P + 1], d.fuse(aux[:P][None])
    out, lg = d.decode(torch.tensor([toks]), hid, torch.arange(P)[None], {})
    proposals = []
    for j in range(steps):
        proposals.append(int(d.draft_to_target(lg[0, -1].argmax())))
        toks, hid = toks + [proposals[-1]], torch.cat([hid, out[:, -1:]], 1)
        out, lg = d.decode(torch.tensor([toks]), hid, torch.arange(len(toks))[None], {})
    return proposals


@pytest.mark.parametrize("option", LAYERED)
def test_the_replay_evaluator_runs_the_option_as_a_recomputation_without_caches(option):
    """replay_evaluator.replay_chain (KV caches of every layer, the tree builder's per-node copies) accepts per verify
    step exactly what the draft proposes when recomputed from scratch; the recording is made of the draft's own
    chains, each followed by a bonus token, every other chain with its second token changed, so that both whole
    accepted chains and rejections occur."""
    d = tiny_draft(**OPTIONS[option]).double().eval()
    g = torch.Generator().manual_seed(7)
    n, M, steps = 6, 17, 3
    aux = torch.randn(n + M, 96, generator=g, dtype=torch.float64)
    s = torch.randint(0, 100, (n + 1,), generator=g).tolist()              # the prompt and the first root
    with torch.no_grad():
        for block in range(4):
            chain = _chain_from_scratch(d, s, aux, len(s) - 1, steps)
            chain[1] = chain[1] if block % 2 == 0 else (chain[1] + 2) % 100
            s += chain + [int(torch.randint(0, 100, (), generator=g))]
        rec = {"prompt": s[:n], "tokens": s[n:n + M], "aux": aux}
        s = s[:n + M]
        got = replay_chain(d, rec, steps)["accepted"]
        want, P = [], n
        while True:
            prop = _chain_from_scratch(d, s, aux, P, steps)
            a = 0
            while a < steps and (P + a + 1 >= len(s) or prop[a] == s[P + a + 1]):
                a += 1
            want.append(a)
            if P - n + 1 + a + 1 >= M:
                break
            P += a + 1
    assert got == want
    assert max(got) == steps and min(got) < steps


def test_the_llama_cpp_deployment_refuses_a_draft_it_cannot_serve_before_converting(tmp_path):
    from eagle3_core.evaluation.llama_cpp_deploy import convert_draft
    from eagle3_core.serving.launcher import ServerError
    out = save_draft(tiny_draft(num_hidden_layers=2), tmp_path / "export")
    with pytest.raises(ServerError, match=r"two_layers: llama.cpp does not serve it \(llama-cpp-python 0.3.36"):
        convert_draft(out, tmp_path / "no-target", tmp_path / "draft.gguf")
    assert not (tmp_path / "draft.gguf").exists()


def test_a_warm_start_from_a_one_layer_draft_into_two_layers_is_refused_naming_the_weight():
    from eagle3_core.training.warm_start import warm_draft
    with pytest.raises(CheckpointError, match=r"the draft has no layers\.1\.\S+, which this run's capacity options"):
        warm_draft(tiny_draft(), tiny_draft(num_hidden_layers=2))
    init = tiny_draft(seed=1, num_hidden_layers=2)
    fresh, _ = warm_draft(init, tiny_draft(num_hidden_layers=2))
    assert torch.equal(fresh.layers["1"].mlp.up_proj.weight, init.layers["1"].mlp.up_proj.weight)


def test_the_capacity_study_compares_every_arm_with_the_default_on_the_same_prompts_and_draws_it(tmp_path):
    """capacity_domain_study.compare: the paired difference is the arms' tau difference (same prompts), the later
    epochs' seconds leave the first epoch out; plot draws both panels from the result JSON (the --replot path)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from capacity_domain_study import compare, plot
    per = {"default": [[10, 8], [12, 8]], "eagle3.1": [[12, 8], [14, 8]]}
    measured = {a: {"tau": sum(t for t, _ in p) / sum(s for _, s in p), "tau_ci95": [1.0, 2.0], "per_prompt": p,
                    "accept_per_position": [0.5]} for a, p in per.items()}
    trained = {a: {"epochs": [{"seconds": 30.0}, {"seconds": 33.0}, {"seconds": 37.0 + i}], "epoch_tokens": 100,
                   "settings": {"draft": {}}} for i, a in enumerate(per)}
    rows = compare(measured, trained)
    assert rows["eagle3.1"]["minus_default"]["tau"] == pytest.approx(26 / 16 - 22 / 16)
    assert rows["eagle3.1"]["minus_default"]["extra_gpu_seconds"] == pytest.approx(1.0)
    assert rows["default"]["later_epoch_seconds"] == pytest.approx(3.5)
    res = {"arms": rows, "samples": 2, "epochs": 3, "device": "cpu", "date": "2026-12-06"}
    png = plot(res, tmp_path / "capacity.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
