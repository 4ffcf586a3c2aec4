"""The persistent compile cache of training runs (eagle3_core/training/compile_cache.py): where it lives, that
compiled_training turns it on and restores torch's settings, and that a second compile is served from it."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch._functorch.config as functorch_config
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from eagle3_core.config import TrainConfig
from eagle3_core.training import compile_cache, packing, ttt_attention
from eagle3_core.training.compile_cache import cache_dir_for, persistent_compile_cache
from eagle3_core.training.ttt import SoftCrossEntropyFromLogits


@pytest.fixture
def cache_env(monkeypatch, tmp_path):
    """EAGLE3_COMPILE_CACHE in tmp_path and no TORCHINDUCTOR_CACHE_DIR of the caller's."""
    # torch sets the variable to its default folder once it has looked it up: as in a process that compiled before
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path))
    return tmp_path


def test_the_cache_folder_names_torch_python_and_the_device(cache_env, monkeypatch):
    where = cache_dir_for(torch.device("cpu"))
    assert where.parent == cache_env / "compile"
    assert where.name.startswith(f"torch{torch.__version__}-") and where.name.endswith("-cpu")
    assert f"py{os.sys.version_info.major}.{os.sys.version_info.minor}" in where.name
    monkeypatch.setattr(compile_cache, "device_name", lambda d: "NVIDIA H100 80GB HBM3")
    assert cache_dir_for(torch.device("cpu")).name.endswith("-NVIDIA_H100_80GB_HBM3")
    monkeypatch.delenv(compile_cache.ENV)
    monkeypatch.setenv("EAGLE3_CACHE", str(cache_env / "root"))
    assert cache_dir_for(torch.device("cpu")).parent == cache_env / "root" / "compile"


def test_compiled_training_turns_the_cache_on_and_restores_torchs_settings(cache_env, monkeypatch):
    """Inside compiled_training (compiled kernels, packed rows) torch's cache folder is this run's and AOTAutograd
    caches graphs holding the TTT loss's autograd.Function; both are as before afterwards, also after an error.
    EAGLE3_COMPILE_CACHE=off and a TORCHINDUCTOR_CACHE_DIR of the user's leave torch's settings alone."""
    monkeypatch.setitem(ttt_attention.COMPILE, "everywhere", True)
    cpu, lines = torch.device("cpu"), []
    torch_default = os.environ.get("TORCHINDUCTOR_CACHE_DIR")      # torch sets its default once it looked it up
    cfg = TrainConfig(batch_tokens=48, ttt_length=3, window_context=8, batching="packed")
    assert not functorch_config.autograd_cache_allow_custom_autograd_functions
    with pytest.raises(RuntimeError, match="inside"):
        with packing.compiled_training(cfg, cpu, True, lines.append):
            assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache_dir_for(cpu))
            assert functorch_config.autograd_cache_allow_custom_autograd_functions
            raise RuntimeError("inside")
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == torch_default
    assert not functorch_config.autograd_cache_allow_custom_autograd_functions
    assert any(f"compile cache {cache_dir_for(cpu)} (empty" in line for line in lines), lines
    for env, value in ((compile_cache.ENV, "off"), ("TORCHINDUCTOR_CACHE_DIR", str(cache_env / "mine"))):
        monkeypatch.setenv(env, value)
        with packing.compiled_training(cfg, cpu, True, lines.append):
            assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == (value if env != compile_cache.ENV else torch_default)
            assert not functorch_config.autograd_cache_allow_custom_autograd_functions
        assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == (value if env != compile_cache.ENV else torch_default)
        monkeypatch.delenv(env)


def _loss_and_grad(fn, logits, z, weight):
    x = logits.clone().requires_grad_(True)
    loss = fn(x, z, z.logsumexp(-1), weight)
    loss.backward()
    return loss.detach(), x.grad


class _DoubledBackward(torch.autograd.Function):
    """SoftCrossEntropyFromLogits's forward with twice its gradient: another backward, the same forward."""

    @staticmethod
    def forward(ctx, logits, z, z_lse, weight):
        ctx.save_for_backward(logits, z, z_lse, weight)
        return ttt_loss_forward(logits, z, z_lse, weight)

    @staticmethod
    def backward(ctx, grad):
        logits, z, z_lse, weight = ctx.saved_tensors
        g = (logits.softmax(-1) - (z - z_lse[..., None]).exp()) * (weight * grad)[..., None]
        return 2 * g, None, None, None


def ttt_loss_forward(logits, z, z_lse, weight):
    return ((logits.logsumexp(-1) - ((z - z_lse[..., None]).exp() * logits).sum(-1)) * weight).sum()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor on CPU needs a C++ compiler")
def test_a_second_compile_of_the_loss_is_served_from_the_cache_and_a_changed_backward_is_not(cache_env):
    """The TTT loss's autograd.Function compiled by inductor (on CPU here; on CUDA the same caches hold Triton
    kernels) inside persistent_compile_cache: the first compile fills the cache, a second one after dynamo's reset
    (what a later run does) hits both the AOTAutograd and the FX graph cache with the same loss and gradient, and
    a Function with the same forward but another backward misses (its gradient is its own)."""
    g = torch.Generator().manual_seed(0)
    logits, z = torch.randn(6, 40, generator=g), torch.randn(6, 40, generator=g)
    weight = torch.rand(6, generator=g)
    counters = torch._dynamo.utils.counters
    results = []
    with persistent_compile_cache(torch.device("cpu"), log=lambda s: None) as where:
        for fn in (SoftCrossEntropyFromLogits.apply, SoftCrossEntropyFromLogits.apply, _DoubledBackward.apply):
            torch._dynamo.reset()
            counters.clear()
            results.append(_loss_and_grad(torch.compile(fn, backend="inductor", dynamic=False), logits, z, weight)
                           + (dict(counters["aot_autograd"]), dict(counters["inductor"])))
    assert any(where.iterdir())
    (l0, g0, aot0, ind0), (l1, g1, aot1, ind1), (l2, g2, aot2, _) = results
    assert aot0.get("autograd_cache_saved", 0) >= 1 and ind0.get("fxgraph_cache_miss", 0) >= 1, (aot0, ind0)
    assert aot1.get("autograd_cache_hit", 0) >= 1 and not aot1.get("autograd_cache_miss"), aot1
    assert torch.equal(l0, l1) and torch.equal(g0, g1)
    assert aot2.get("autograd_cache_miss", 0) >= 1 and not aot2.get("autograd_cache_hit"), aot2
    assert torch.allclose(l2, l0) and torch.allclose(g2, 2 * g0, atol=1e-6)


@pytest.mark.slow
def test_the_step_profile_script_runs_on_cpu(tmp_path):
    """benchmarks/train_step_profile.py --tiny (the GPU command's smoke run): interleaved rounds with a ratio per
    round, a profile whose kernel shares add up to at most 1 with the three phases, and a cold and a warm compile
    in fresh processes on one cache folder, all in the JSON it writes."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "p.json"
    env = {**os.environ, "PYTHONPATH": str(root)}
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "train_step_profile.py"), "--tiny", "--ours",
                          "step", "--specforge", "sdpa", "--iters", "1", "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    v = res["pairs"]["variants"]
    assert v["ours:step"]["runs"] == 3 and v["specforge:sdpa"]["runs"] == 3, v
    r = res["pairs"]["ratios"]["ours:step / specforge:sdpa"]
    per = [row["ours:step"] / row["specforge:sdpa"] for row in res["pairs"]["rounds"]]
    assert r["per_round"] == per and r["min"] <= r["median"] <= r["max"]
    for p in res["profile"].values():
        assert p["top"] and sum(k["share"] for k in p["top"]) <= 1 + 1e-9 and set(p["phases_ms"]) == {
            "forward", "backward", "optimizer"}
    assert all("first_step_s" in res["compile"][k] for k in ("cold", "warm")), res["compile"]
    assert res["compile"]["cold"]["log"][-1].startswith(f"train: compile cache {res['compile']['cache_folder']}")
