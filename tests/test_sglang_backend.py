"""The `sglang` features backend (features/sglang_extract.py, sglang_runner.py, sglang_worker.py; its row in
features.backends, its ranks tp_extract's) on CPU, over the SGLang stand-in of tests/sglang_standin (the pinned
0.5.14's small surface; SGLang itself needs CUDA and its own torch): prefill batches of whole samples split back
into the store's layout, the pinned version's layer-id rule for both of its model-file families, the argmax over
a vocab-parallel lm_head, the one module holding every SGLang import, every name the stand-in mirrors against the
pinned wheel's source, the packages the ranks import, `check`; over 2 gloo ranks under torchrun (slow): leader and
follower writing the store the `hf` backend writes, a SIGKILLed rank and the resumed run. Where SGLang itself
imports on a GPU, its features against `hf` on a small model within the probe's tolerance (skipped elsewhere,
with the reason).

Tolerance against `hf` over the stand-in: the stand-in runs the same transformers modules request by request where
HFExtractor runs a right-padded batch; fp32 differences of a few 1e-6 (measured at most 6.8e-6 on the tiny
Llama), in the bf16 store at most one bf16 step: |a - b| <= 1e-4 + 2^-7 |b| per element (tests/test_tp_extract.py's
bound and reason), the argmax equal everywhere.
"""
import ast
import importlib
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import sglang_names
from eagle3_core.config import FeatureConfig, PipelineConfig, TargetConfig
from eagle3_core.config.feature_config import SGLANG_VERSION
from eagle3_core.features.extract import HFExtractor
from eagle3_core.features.sglang_extract import (
    PLUS_ONE,
    PLUS_ONE_IF_FIRST_IS_1,
    SGLangExtractor,
    capture_argument,
    pack,
    pick_best,
    slice_best,
    unpack,
)
from eagle3_core.target.loading import load_target

ROOT = Path(__file__).resolve().parents[1]
SEQS = [[5, 9, 2, 7, 7, 1], [3], [11, 4, 8, 120, 64, 63, 0, 1, 2]]


def skip_loudly(why: str, capsys) -> None:
    """pytest.skip(why), the reason also printed past pytest's capture (seen without -rs)."""
    with capsys.disabled():
        print(f"\n{__name__}: skipped: {why}")
    pytest.skip(why)


@contextmanager
def standin():
    """sglang (the stand-in) importable in this process for the block; afterwards every sglang module and the
    boundary module are forgotten, so no other test sees an `sglang`."""
    sys.path.insert(0, str(sglang_names.STANDIN))
    try:
        yield importlib.import_module("eagle3_core.features.sglang_runner")
    finally:
        sys.path.remove(str(sglang_names.STANDIN))
        for name in [m for m in sys.modules if m.split(".")[0] == "sglang"] + ["eagle3_core.features.sglang_runner"]:
            sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def runners(tiny_target_dirs):
    """{family: the boundary's Runner over the stand-in, world size 1} for llama and deepseek_v3, and the boundary
    module under 'module'."""
    with standin() as module:
        yield {"module": module, **{f: module.Runner(str(tiny_target_dirs[f]), None, False, 1, 1, 0, 0, None, 0)
                                    for f in ("llama", "deepseek_v3")}}


@pytest.fixture(scope="module")
def hf(tiny_target_dirs):
    return {f: load_target(TargetConfig(model=str(tiny_target_dirs[f])), "cpu") for f in ("llama", "deepseek_v3")}


def test_prefill_batches_of_whole_samples_split_back_into_the_store_layout(runners, hf):
    lengths = [len(s) for s in SEQS]
    flat = torch.arange(sum(lengths) * 2, dtype=torch.float32).view(-1, 2)
    padded = unpack(flat, lengths)
    assert padded.shape == (3, 9, 2) and torch.equal(pack(padded, lengths), flat)
    assert torch.equal(padded[1, 0], flat[6]) and not padded[1, 1:].any()         # sample 1: one row, zeros after
    with pytest.raises(ValueError, match="16 tokens came back with 15 rows"):
        unpack(flat[:15], lengths)
    runners["llama"].set_aux_layers([1, 3, 4])
    raw = runners["llama"].prefill(SEQS)
    assert raw["aux"].shape == (16, 96) and raw["final"].shape == (16, 32) and raw["target_top1"].shape == (16,)
    ours = SGLangExtractor(runners["llama"], [1, 3, 4], 32, {}, "cpu").forward(SEQS)
    ref = HFExtractor(hf["llama"], [1, 3, 4]).forward(SEQS)
    assert ours["lengths"].tolist() == lengths
    for k in ("aux", "final"):
        torch.testing.assert_close(pack(ours[k], lengths), pack(ref[k], lengths), atol=2e-5, rtol=1e-5)
        assert not ours[k][1, 1:].any()
    assert torch.equal(ours["target_top1"], ref["target_top1"])                  # 0 on padding in both


@pytest.mark.parametrize(("fam", "ids", "passed"), [
    ("llama", [1, 3, 4], [1, 3, 4]), ("llama", [2, 3, 5], [2, 3, 5]),
    ("deepseek_v3", [1, 3, 4], [1, 3, 4]), ("deepseek_v3", [2, 3, 5], [3, 4, 6])])
def test_the_pinned_layer_id_rule_captures_the_outputs_of_the_aux_ids(runners, hf, fam, ids, passed):
    """sglang 0.5.14: models/llama.py adds one to every id; models/deepseek_v2.py (DeepSeek-V3, Kimi-K2.5) only
    when the first id is 1. Either way the store holds the outputs of `ids`, the layers HFExtractor captures."""
    rule = PLUS_ONE if fam == "llama" else PLUS_ONE_IF_FIRST_IS_1
    assert capture_argument(ids, rule) == passed
    r = runners[fam]
    assert r.set_aux_layers(ids) == [i + 1 for i in ids]
    ours = r.prefill(SEQS)["aux"]
    ref = pack(HFExtractor(hf[fam], ids).forward(SEQS)["aux"], [len(s) for s in SEQS])
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-5)


def test_the_layer_id_rule_refuses_what_it_cannot_express_and_a_changed_rule(runners, monkeypatch):
    with pytest.raises(ValueError, match="features.aux_layer_ids = \\[0, 3, 4\\].*deepseek_v2.py"):
        capture_argument([0, 3, 4], PLUS_ONE_IF_FIRST_IS_1)
    assert capture_argument([0, 3, 4], PLUS_ONE) == [0, 3, 4]
    # a release whose Llama file took the DeepSeek rule: the read-back catches it
    from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM
    from sglang.srt.models.llama import LlamaForCausalLM
    monkeypatch.setattr(LlamaForCausalLM, "_layer_inputs", DeepseekV2ForCausalLM._layer_inputs)
    with pytest.raises(RuntimeError, match=r"captures the inputs of layers \[2, 3, 5\], not \[3, 4, 6\].*0.5.14"):
        runners["llama"].set_aux_layers([2, 3, 5])


def test_the_argmax_over_vocab_slices_is_the_whole_vocab_argmax(runners):
    """Two ranks' slices as SGLang pads them (vocab 100 to 128: [0, 64) and [64, 100) + 28 zero rows cut off),
    a tie across the slices (row 70 = row 10: the lower id wins, as torch.argmax), and the capturing logits
    processor on the stand-in's padded lm_head, where every real logit is negative and a zero padding row would
    win if it were not cut."""
    g = torch.Generator().manual_seed(0)
    lm, hidden = torch.nn.functional.normalize(torch.randn(100, 16, generator=g), dim=-1), torch.randn(40, 16,
                                                                                                     generator=g)
    lm[70] = lm[10]
    hidden[:5] = lm[10]                                    # unit rows: these tokens' best rows are 10 and 70 alone
    slices = [(lm[:64], 0), (lm[64:100], 64)]
    bests = [slice_best(hidden, w, start, chunk=7) for w, start in slices]
    got = pick_best(torch.stack([b[0] for b in bests]), torch.stack([b[1] for b in bests]))
    assert got.dtype == torch.int32 and torch.equal(got, (hidden @ lm.T).argmax(-1).int())
    assert got[:5].tolist() == [10] * 5
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
    head = ParallelLMHead(100, 16)
    head.weight_loader(head.weight, -lm.abs())                          # every real logit below 0 for h >= 0
    assert head.weight.shape == (128, 16) and not head.weight[100:].any()
    h = hidden.abs()
    out = runners["module"].CapturingLogits(chunk=16)(None, h, head, None, [h, h, h])
    assert torch.equal(out.target_top1, (h @ -lm.abs().T).argmax(-1).int()) and int(out.target_top1.max()) < 100


def _sglang_imports(path: Path) -> list[tuple[str, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sglang":
            out += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.split(".")[0] == "sglang"]
    return out


def test_every_sglang_import_is_in_one_module_and_the_stand_in_provides_it():
    where = {p.relative_to(ROOT).as_posix() for p in (ROOT / "eagle3_core").rglob("*.py") if _sglang_imports(p)}
    assert where == {"eagle3_core/features/sglang_runner.py"}
    src = sglang_names.standin_source()
    for module, name in _sglang_imports(ROOT / "eagle3_core/features/sglang_runner.py"):
        rel = src.module_file(module)
        assert rel is not None and name in src.top_names(rel), f"the stand-in lacks {module}.{name}"
    # the documented list of internals names each module imported
    doc = importlib.util.find_spec("eagle3_core.features.sglang_runner").loader.get_source(
        "eagle3_core.features.sglang_runner").split('"""')[1]
    for module, name in _sglang_imports(ROOT / "eagle3_core/features/sglang_runner.py"):
        assert module.removeprefix("sglang.srt.").replace(".", "/") + ".py" in doc and name in doc, (module, name)


# set by another object upstream, invisible to the source walk: (file, attribute) -> where, checked in the wheel
REGISTERED = {("sglang/srt/layers/vocab_parallel_embedding.py", "weight"):
              ("sglang/srt/layers/quantization/unquant.py", 'layer.register_parameter("weight", weight)')}


def test_every_name_the_stand_in_mirrors_exists_in_the_pinned_wheel(capsys):
    """Modules, classes, functions, constants, methods with their parameters, attributes: sglang_names.missing
    over the wheel of sglang==0.5.14 (fetched once into ~/.cache/eagle3-pipeline/wheels; skipped, with the reason,
    where no registry answers)."""
    assert sglang_names.PINNED == SGLANG_VERSION
    wheel, why = sglang_names.pinned_wheel()
    if wheel is None:
        skip_loudly(f"the sglang=={SGLANG_VERSION} wheel could not be fetched: {why}", capsys)
    up = sglang_names.wheel_source(wheel)
    names = sglang_names.mirrored()
    assert len(names) > 40 and sum(c is not None for *_, c in names) >= 25      # modules, classes, ...
    problems = sglang_names.missing(up, names)
    for (rel, attr), (file, line) in REGISTERED.items():
        problems = [p for p in problems if p != f"{rel}: VocabParallelEmbedding.{attr} is never set upstream"
                    and p != f"{rel}: ParallelLMHead.{attr} is never set upstream"]
        assert line in up.read(file), (file, line)
    assert problems == []
    # and the check has teeth: a name that is not upstream is reported
    fake = sglang_names.ClassNames(methods={"forward": ["input_ids", "no_such_param"]}, attributes={"nope"})
    assert sglang_names.missing(up, [("sglang/srt/models/llama.py", "LlamaForCausalLM", fake),
                                     ("sglang/srt/no_such.py", None, None)]) == [
        "sglang/srt/models/llama.py: LlamaForCausalLM.forward has no parameter(s) ['no_such_param']",
        "sglang/srt/models/llama.py: LlamaForCausalLM.nope is never set upstream",
        "sglang/srt/no_such.py: no such module"]


def _third_party_imports(module: str, functions: tuple[str, ...] | None = (), seen: set | None = None) -> set[str]:
    """The top-level non-stdlib packages importing eagle3_core module `module` pulls in: its module-level imports
    (also inside module-level if/try and class bodies), the imports inside `functions` (None: inside every
    function), followed through every eagle3_core module reached (module level) and the packages' __init__ files."""
    seen = set() if seen is None else seen
    if module in seen:
        return set()
    seen.add(module)
    base = ROOT / module.replace(".", "/")
    path = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
    out = set()
    parts = module.split(".")
    for i in range(1, len(parts)):                                       # the packages above it
        out |= _third_party_imports(".".join(parts[:i]), (), seen)

    def scan(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if functions is None or child.name in functions:
                    scan(child)
                continue
            names = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module and child.module != "__future__":
                names = [child.module] + [f"{child.module}.{a.name}" for a in child.names]
            for name in names:
                top, target = name.split(".")[0], ROOT / name.replace(".", "/")
                if top == "eagle3_core":
                    if target.with_suffix(".py").exists() or (target / "__init__.py").exists():
                        out.update(_third_party_imports(name, (), seen))
                elif top not in sys.stdlib_module_names:
                    out.add(top)
            scan(child)
    scan(ast.parse(path.read_text()))
    return out


def test_the_ranks_import_only_the_packages_check_looks_for_beside_sglang():
    """What eagle3_core itself imports in a rank of the SGLang environment (tp_extract and the backend table, with
    their functions' own imports, sglang_worker's load, the modules they reach, and the checkpoint head's reading)
    is within features.sglang_env.SGLANG_WORKER_PACKAGES, the list check probes that environment for. Notably no transformers
    (there, SGLang's pin, not ours)."""
    from eagle3_core.features.sglang_env import SGLANG_WORKER_PACKAGES
    seen = _third_party_imports("eagle3_core.features.sglang_worker", None)
    seen |= _third_party_imports("eagle3_core.features.tp_extract", ("run_worker",))
    seen |= _third_party_imports("eagle3_core.features.backends", ("selected_backend", "_load_sglang"))
    seen |= _third_party_imports("eagle3_core.features.specforge_import", ("_hub_file", "head_tensors", "_keys",
                                                                         "_read_head"))
    seen -= {"sglang"}
    assert seen <= set(SGLANG_WORKER_PACKAGES) and "transformers" not in seen, seen
    assert {"torch", "safetensors", "pydantic", "pyarrow", "huggingface_hub", "tenacity"} <= seen, seen
    # `make sglang-env` installs them (torch comes with SGLang's pin)
    make = (ROOT / "Makefile").read_text().split("sglang-env:")[1].split("\n\n")[0]
    assert all(p in make for p in SGLANG_WORKER_PACKAGES[1:]), make
    # the walk sees what it should: transformers at module level (speculate), httpx through a chain of modules
    assert "transformers" in _third_party_imports("eagle3_core.evaluation.speculate", ())
    assert "httpx" in _third_party_imports("eagle3_core.data.samples", ())


# ---- check ---------------------------------------------------------------------------------------------------

def _fake_env(tmp_path: Path, version: str | None) -> dict:
    """probe_sglang of this python with a sglang distribution of `version` on its path (dist-info only), or none."""
    from eagle3_core.features.sglang_env import probe_sglang
    site = tmp_path / f"site-{version}"
    if version:
        info = site / f"sglang-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    script = tmp_path / f"python-{version}"
    script.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    script.chmod(0o755)
    return probe_sglang(str(script))


H200 = (8, 143_771_058_176)


@pytest.fixture(scope="module")
def kimi():
    """Kimi-K2.5's config.json (tests/data/kimi_k25), its meta model built once (target.memory keeps it)."""
    from eagle3_core.check import target_config_file
    from eagle3_core.target.memory import meta_model
    config = target_config_file(ROOT / "tests/data/kimi_k25/config.json")
    meta_model(config, True)
    meta_model(config, False)
    return config


def test_check_counts_sglang_per_gpu_and_refuses_a_missing_or_other_version(tmp_path, kimi):
    from eagle3_core.check import check_run
    from eagle3_core.features.sglang_env import sglang_env_problems

    def cfg(**f):
        return PipelineConfig(features=FeatureConfig(**{"max_length": 2048, "batch_tokens": 16384, "backend": "sglang",
                                                        "tp_size": 8, "mem_fraction_static": 0.85, **f}))
    ok, other, none = (_fake_env(tmp_path, v) for v in (SGLANG_VERSION, "0.5.13", None))
    assert ok["version"] == SGLANG_VERSION and ok["missing"] == [] and other["version"] == "0.5.13"
    assert none["version"] is None and none["error"] is None
    facts, problems = check_run(cfg(), target_config=kimi, gpus=H200, sglang_env=ok)
    feats = facts["backends"]["features"]
    # INT4 experts 570.76 GB / 8 + SGLang's split layers / 8 + the rest whole; MLA latent KV of 16384 tokens
    assert (feats["gb_per_gpu"], feats["kv_gb_per_batch"]) == (77.12, 1.15) and problems == []
    assert "SGLang's own ModelRunner in 8 torchrun ranks" in feats["runs"] and feats["sglang_env"] == ok
    assert facts["backends"]["evaluate"]["evaluator"] == "replay"
    _, problems = check_run(cfg(mem_fraction_static=0.5), target_config=kimi, gpus=H200, sglang_env=other)
    by_field = dict(problems)
    assert sorted(by_field) == ["features.tp_size", "sglang_python"]
    assert "77.1 GB of weights and 1.2 GB of KV cache" in by_field["features.tp_size"]
    assert "exceed mem_fraction_static 0.5" in by_field["features.tp_size"]
    assert "has sglang 0.5.13" in by_field["sglang_python"]
    assert f"sglang=={SGLANG_VERSION}" in by_field["sglang_python"]
    # another version: refused anywhere; none, or packages the ranks import missing: on the GPU host only
    assert sglang_env_problems(other, on_gpu_host=False) and not sglang_env_problems(none, on_gpu_host=False)
    refused = sglang_env_problems(none, on_gpu_host=True)
    assert "no sglang installed" in refused[0][1] and "make sglang-env" in refused[0][1]
    lacking = sglang_env_problems({**ok, "missing": ["tenacity"]}, on_gpu_host=True)
    assert "lacks ['tenacity']" in lacking[0][1] and "-m pip install tenacity" in lacking[0][1]
    gone = sglang_env_problems({**none, "error": "FileNotFoundError: no such file"}, on_gpu_host=True)
    assert "FileNotFoundError" in gone[0][1]


def test_the_sglang_environment_also_runs_the_servers_of_generation_and_deployment(tmp_path, monkeypatch):
    """sglang_python starts generation's SGLang server (server.kind 'sglang') and deploy-sglang's two servers, and
    deploy-sglang asks that interpreter, not this one, whether SGLang is there."""
    from eagle3_core.evaluation.sglang_bench import server_command
    from eagle3_core.evaluation.sglang_deploy import sglang_installed
    from eagle3_core.pipeline.deploy_stage import deploy_sglang_skip
    from eagle3_core.pipeline.generation_stage import generation_servers
    from eagle3_core.serving import launcher
    site = tmp_path / "site"
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("")
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    assert sglang_installed(str(python)) and not sglang_installed(str(tmp_path / "none"))
    assert server_command("m", "127.0.0.1", 1, 8, 8, python=str(python))[0] == str(python)
    cfg = PipelineConfig(run_dir=tmp_path / "run", target=TargetConfig(model="org/model"),
                         sglang_python=str(python)).model_copy(update={"server": PipelineConfig().server.model_copy(
                             update={"kind": "sglang"})})
    started = []

    def launch(argv, *a, **k):
        started.append(argv)
        raise RuntimeError("not started in this test")
    monkeypatch.setattr(launcher, "launch", launch)
    with pytest.raises(RuntimeError, match="not started"), generation_servers(cfg):
        pass
    assert started[0][:3] == [str(python), "-m", "sglang.launch_server"]
    assert "SGLang is not installed" not in (deploy_sglang_skip(cfg) or "")
    assert "SGLang is not installed" in deploy_sglang_skip(cfg.model_copy(update={"sglang_python": str(tmp_path)}))
    # the replay evaluator records greedy outputs through /generate of a server it starts the same way
    from contextlib import contextmanager as cm

    from eagle3_core.evaluation import replay_record
    calls = []

    @cm
    def server(model, log_path, *args):
        calls.append((model, log_path.name, args[-1]))
        yield "http://127.0.0.1:1"

    async def token_api(url, api, prompts, *rest):
        calls.append((url, api))
        return [{"output_ids": [7, 8, 2, 9], "finish_reason": "stop", "stop_id": 2} for _ in prompts]
    monkeypatch.setattr(launcher, "sglang_server", server)
    monkeypatch.setattr(replay_record, "_token_api", token_api)
    assert replay_record.greedy_outputs(cfg, [[1, 2], [3]], {2}) == [[7, 8, 2], [7, 8, 2]]
    assert calls == [("org/model", "replay_server.log", str(python)), ("http://127.0.0.1:1", "sglang")]


def test_the_smoke_preset_passes_check_offline(capsys, kimi):
    """configs/kimi_k25_smoke.json with only the target's config.json, on this machine (no GPU, no SGLang):
    `check --target-config` passes and names the backend."""
    from eagle3_core.check import main
    rc = main([str(ROOT / "configs/kimi_k25_smoke.json"), "--target-config",
               str(ROOT / "tests/data/kimi_k25/config.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "check: passed" in out
    assert "chosen: sglang" in out and "gb_per_gpu: 77.12" in out and "not refused here" in out


# ---- 2 gloo ranks under torchrun ------------------------------------------------------------------------------

def _cfg(root: Path, target: Path, rows: list[dict], **features) -> PipelineConfig:
    from feature_stores import features_run
    return features_run(root, target, rows, **features)


@pytest.fixture(scope="module")
def stores(tiny_target_dirs, tmp_path_factory):
    """(hf cfg, sglang cfg, the sglang run's log lines): 5 rows in 3 shards of 2, tiny Llama; the sglang backend on
    2 gloo ranks over the stand-in (its python: this one, the stand-in on PYTHONPATH)."""
    from feature_stores import run_one_thread
    from tokenized_rows import random_rows

    from eagle3_core.pipeline.features_stage import run_features
    root = tmp_path_factory.mktemp("sglang")
    one = _cfg(root / "hf", tiny_target_dirs["llama"], random_rows(5))
    run_one_thread(one)
    two = _cfg(root / "sglang", tiny_target_dirs["llama"], random_rows(5), backend="sglang", tp_size=2).model_copy(
        update={"sglang_python": sys.executable})
    lines = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(sglang_names.STANDIN))
        run_features(two, log=lines.append)
    return one, two, lines


@pytest.mark.slow
def test_two_gloo_ranks_lead_and_follow_and_store_the_hf_features(stores):
    from feature_stores import assert_same_samples

    from eagle3_core.contract.manifest import read_manifest
    from eagle3_core.features.reader import load_head
    from eagle3_core.features.store import bad_shards
    from conftest import assert_ranks_left_cleanly
    one, two, lines = stores
    d1, d2 = one.run_dir / "features", two.run_dir / "features"
    m1, m2 = read_manifest(d1 / "manifest.json"), read_manifest(d2 / "manifest.json")
    assert m2["complete"] and m2["backend"] == "sglang" and m2["tp_size"] == 2 and not bad_shards(d2, m2["shards"])
    assert [(s["file"], s["ids"], s["tokens"]) for s in m1["shards"]] == [(s["file"], s["ids"], s["tokens"])
                                                                         for s in m2["shards"]]
    assert m2["aux_layer_ids"] == m1["aux_layer_ids"] == [1, 3, 4]
    assert any("rank 1/2 ran 3 forwards" in x for x in lines), lines[-20:]
    assert any("aux layers [1, 3, 4] = inputs of layers [2, 4, 5]" in x for x in lines), lines[-20:]
    assert_ranks_left_cleanly(lines, 2)
    for a, b in zip(load_head(d1), load_head(d2), strict=True):                  # read from the checkpoint
        assert torch.equal(a, b)
    assert_same_samples(d1, d2, "sglang", bit_identical=None)      # target_top1: the all-gathered argmax


@pytest.mark.slow
def test_a_killed_sglang_rank_leaves_only_intact_shards_and_a_rerun_finishes(stores, tmp_path, monkeypatch):
    """Rank 1 SIGKILLed at its 3rd forward while rank 0 writes: the run fails, every shard the manifest lists
    passes its sha256, and the normal rerun extracts only the rest."""
    from feature_stores import kill_a_rank_then_rerun
    from tokenized_rows import random_rows

    from eagle3_core.features.store_run import foreign_python
    _, ref, _ = stores
    rows = random_rows(8)
    for i, r in enumerate(rows):
        r["id"] = f"k{i}"
    cfg = _cfg(tmp_path / "run", ref.target.model, rows, backend="sglang", tp_size=2).model_copy(
        update={"sglang_python": sys.executable})
    monkeypatch.setenv("PYTHONPATH", str(sglang_names.STANDIN))
    kill_a_rank_then_rerun(cfg, "sglang", **foreign_python(cfg))


# ---- SGLang itself ---------------------------------------------------------------------------------------------

def _real_sglang() -> str | None:
    """Why SGLang itself cannot run here (None: it can)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or str(sglang_names.STANDIN) in str(spec.origin):
        return f"sglang=={SGLANG_VERSION} is not installed in this environment"
    from importlib.metadata import version
    if version("sglang") != SGLANG_VERSION:
        return f"sglang {version('sglang')} is installed, not the pinned {SGLANG_VERSION}"
    if not torch.cuda.is_available():
        return "SGLang's kernels need a CUDA GPU; none here"
    return None


@pytest.mark.slow
def test_sglang_itself_matches_hf_on_a_small_model_within_the_probe_tolerance(tiny_target_dirs, tmp_path, capsys):
    """Where SGLang imports (its own environment on a GPU host: run this file with that python): a small random
    Llama (head_dim 64, which SGLang's attention kernels take; the tiny test targets' 8 is not) extracted by
    `sglang` (one rank) and by `hf`, compared by the features probe against its written TOLERANCE."""
    why = _real_sglang()
    if why is not None:
        skip_loudly(why, capsys)
    from tokenized_rows import random_rows
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3_core.features_probe import probe, render
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                                         num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512, tie_word_embeddings=False))
    with torch.no_grad():
        for w in model.parameters():
            if w.dim() == 2:
                w.normal_(0, 0.05)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "small_llama")
    cfg = _cfg(tmp_path / "run", tmp_path / "small_llama", random_rows(5), backend="sglang", tp_size=1)
    report = probe(cfg, ["sglang", "hf"], 5, log=print)
    print(render(report))
    assert report["ok"], render(report)


def test_check_refuses_the_text_api_for_a_thinking_kimi_and_the_shipped_configs_use_token_ids(capsys, tmp_path):
    """`check` probes one turn with reasoning and one cut-off turn through the target's chat template (the K2.5-style
    template, thinking on by default) before any generation: the old `generation.api: openai` of the Kimi configs is
    refused naming generation.api and the fix (K2.5 renders the last answer's reasoning as `<think></think>`, so
    every answer would be refused at tokenize after the whole generation); the shipped configs, on SGLang's token-id
    API, pass; with `thinking: false` the text API passes too (the target then writes no reasoning)."""
    import json

    from eagle3_core.check import main
    template = str(ROOT / "tests/data/chat_templates/Kimi-K2.5-style.jinja")
    target = str(ROOT / "tests/data/kimi_k25/config.json")
    for name in ("kimi_k25_smoke.json", "kimi_k25_agentic_100k.json"):
        data = json.loads((ROOT / "configs" / name).read_text())
        assert data["generation"]["api"] == "sglang"
        if name == "kimi_k25_smoke.json":
            assert main([str(ROOT / "configs" / name), "--target-config", target, "--chat-template", template]) == 0
            assert "check: passed" in capsys.readouterr().out
        data["generation"]["api"] = "openai"
        old = tmp_path / name
        old.write_text(json.dumps(data))
        assert main([str(old), "--target-config", target, "--chat-template", template]) != 0
        captured = capsys.readouterr()
        out = captured.out + captured.err
        assert "generation.api" in out and "drops its reasoning" in out and "Set generation.api 'sglang'" in out
    data["generation"]["chat_template_kwargs"] = {"thinking": False}
    old.write_text(json.dumps(data))
    main([str(old), "--target-config", target, "--chat-template", template])
    captured = capsys.readouterr()
    assert "generation.api" not in captured.out + captured.err
