"""The features stage behind its backend interface (eagle3_core.features.backends): a backend of a few lines plugs in
through the table and passes the same resume test as `hf`; every path writes features/manifest.json through the
store's one writer and leaves head.json, so that the next run accepts the store without loading the target; a store
mixing backends is refused unless features.mix_backends."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from eagle3_core.check import check_run
from eagle3_core.config import FeatureConfig, PipelineConfig, TargetConfig
from eagle3_core.config.feature_config import TORCHRUN_BACKENDS
from eagle3_core.contract import manifest as manifest_mod
from eagle3_core.contract.manifest import read_manifest
from eagle3_core.features import backends
from eagle3_core.features import store_run
from eagle3_core.features.backends import BACKENDS, Backend, must_replay, resolved_evaluator
from eagle3_core.features.reader import load_samples
from eagle3_core.pipeline.features_stage import (
    feature_shards,
    feature_status,
    finish_features,
    run_features,
    run_features_shard,
    store_key,
)
from eagle3_core.target.loading import load_target_config
from eagle3_core.target.memory_fit import Fit
from tiny_targets import build
from tokenized_rows import random_rows, write_tokenized

ROOT = Path(__file__).resolve().parent.parent


class EchoExtractor:
    """The test backend's Extractor: features that are a function of the tokens alone (aux: three multiples of
    each token's embedding row, final: the row, target_top1: the token), on a tiny target's config and head."""

    def __init__(self, model, aux_layer_ids):
        self.model, self.aux_layer_ids, self.device = model, aux_layer_ids, torch.device("cpu")
        self.emb = model.get_input_embeddings().weight.detach()
        self.hidden_size = self.emb.shape[1]

    def forward(self, seqs):
        ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, :len(s)] = torch.tensor(s)
        e = self.emb[ids]
        return {"aux": torch.cat([e, 2 * e, 3 * e], -1), "final": e, "target_top1": ids.int(),
                "lengths": torch.tensor([len(s) for s in seqs])}

    def head_weights(self):
        return self.emb, self.emb


def load_echo(cfg, device, log=print):
    from eagle3_core.target.loading import load_target
    model = load_target(cfg.target, device)
    return EchoExtractor(model, backends.aux_ids_of(cfg, model))


ECHO = Backend("echo", False, load_echo, "the tests' echo backend")


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: the tiny target's matmuls are microseconds of work that thread hand-offs slow down tenfold
    on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny Llama target, loaded once here so that the tests' calls do not pay the first load's imports."""
    from eagle3_core.features.extract import HFExtractor
    from eagle3_core.target.loading import load_target
    path = build("llama", tmp_path_factory.mktemp("target") / "llama")
    HFExtractor(load_target(TargetConfig(model=str(path)))).forward([[1, 2, 3]])
    return path


@pytest.fixture
def loads(monkeypatch):
    """The backends table with the echo backend in it; returns the list of backends each load was of."""
    seen = []
    for name, row in [*BACKENDS.items(), ("echo", ECHO)]:
        def counted(cfg, device, log=print, row=row):
            seen.append(row.name)
            return row.load(cfg, device, log)
        monkeypatch.setitem(BACKENDS, name, dataclasses.replace(row, load=counted))
    return seen


def _run_dir(root: Path, target: Path, n: int = 7, **features) -> PipelineConfig:
    # random tokens are not what the random target writes: the on-policy gate (test_history) off
    cfg = PipelineConfig(run_dir=root, target=TargetConfig(model=str(target)),
                         features=FeatureConfig(max_length=64, shard_samples=3, batch_tokens=64,
                                                **{"min_on_policy": 0.0, **features}))
    write_tokenized(root, random_rows(n, lengths=(4, 20)), inputs_key="seven-random-rows")
    return cfg


@pytest.mark.parametrize("backend", ["hf", "echo"])
def test_a_backend_passes_the_stores_resume_test(target, tmp_path, loads, backend):
    """Through run_features with `backend`: every shard extracted once, recorded with its backend; a rerun loads
    nothing and rewrites nothing; a changed shard and a deleted shard are each extracted again alone, to the same
    bytes; the shard plan's status is read without loading the target."""
    cfg = _run_dir(tmp_path / "run", target, backend=backend)
    out = cfg.run_dir / "features"
    first = run_features(cfg, log=lambda s: None)
    assert loads == [backend] and first["complete"] and first["shards_extracted"] == 3 and first["samples"] == 7
    assert {e["backend"] for e in first["shards"]} == {backend} and first["backend"] == backend
    assert read_manifest(out / "head.json") == {"inputs_key": store_key(cfg), "target_id": first["target_id"]}
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert run_features(cfg, log=lambda s: None) == first and loads == [backend]
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == files
    assert feature_status(cfg) == {"shards": [0, 1, 2], "done": [0, 1, 2], "per_shard": True}
    shard = out / "shard_00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    (out / "shard_00002.safetensors").unlink()
    assert feature_status(cfg)["done"] == [0] and loads == [backend]
    lines = []
    again = run_features(cfg, log=lines.append)
    assert again["shards_extracted"] == 2 and any("['shard_00001.safetensors'" in x for x in lines), lines
    assert {n: (out / n).read_bytes() for n in files if n.startswith("shard_")} == \
        {n: b for n, b in files.items() if n.startswith("shard_")}
    assert [s["id"] for s in load_samples(out)] == [f"r{i}" for i in range(7)]


def test_shard_tasks_and_finish_leave_the_store_one_call_leaves(target, tmp_path, loads):
    """The flow's path for a per-shard backend (each shard alone, then finish_features) writes the shards, the
    manifest's entries and head.json of the one-call path, and loads the backend once for all shards."""
    one = _run_dir(tmp_path / "one", target, backend="echo")
    by_shard = _run_dir(tmp_path / "by_shard", target, backend="echo")
    whole = run_features(one, log=lambda s: None)
    results = [run_features_shard(by_shard, k, log=lambda s: None) for k in reversed(feature_shards(by_shard))]
    assert [r["extracted"] for r in results] == [True, True, True] and loads == ["echo", "echo"]
    m = finish_features(by_shard, results, log=lambda s: None)
    assert m["inputs_key"] == whole["inputs_key"] and m["shards_extracted"] == 3
    strip = [{k: v for k, v in e.items() if k != "mtime_ns"} for e in whole["shards"]]
    assert [{k: v for k, v in e.items() if k != "mtime_ns"} for e in m["shards"]] == strip
    assert read_manifest(by_shard.run_dir / "features" / "head.json") == read_manifest(one.run_dir / "features" /
                                                                                        "head.json")
    assert finish_features(by_shard, results, log=lambda s: None) == m           # done: returned as written
    assert run_features_shard(by_shard, 0, log=lambda s: None)["extracted"] is False and len(loads) == 2


def test_a_store_mixing_backends_is_refused_unless_the_config_allows_it(target, tmp_path, loads):
    """Shard 0 by the echo backend, then shard 1 by hf: refused naming the shard, both backends and
    features.mix_backends; allowed with mix_backends true, each entry naming its own backend. A finished store of
    one backend stays done under another (the backend is out of the key)."""
    echo = _run_dir(tmp_path / "run", target, backend="echo")
    run_features_shard(echo, 0, log=lambda s: None)
    hf = echo.model_copy(update={"features": echo.features.model_copy(update={"backend": "hf"})})
    with pytest.raises(ValueError, match=r"backend \['echo'\] \(\['shard_00000.*'hf'.*features\.mix_backends"):
        run_features_shard(hf, 1, log=lambda s: None)
    mixed = hf.model_copy(update={"features": hf.features.model_copy(update={"mix_backends": True})})
    run_features_shard(mixed, 1, log=lambda s: None)
    store = read_manifest(echo.run_dir / "features" / "manifest.json")
    assert [e["backend"] for e in store["shards"]] == ["echo", "hf"]
    done = run_features(_run_dir(tmp_path / "other", target, backend="echo"), log=lambda s: None)
    other = done["inputs_key"]
    switched = _run_dir(tmp_path / "other2", target, backend="hf")
    assert run_features(switched, log=lambda s: None)["inputs_key"] == other


def test_a_mixed_store_is_refused_by_check_and_before_any_rank_starts(target, tmp_path, loads, monkeypatch):
    """Shard 0 by the echo backend, the rest then asked of 'hf_tp' (a torchrun backend whose every rank loads
    the target): check refuses it naming features.backend, the shard and features.mix_backends, and run_features
    refuses it before torchrun starts or anything loads; per shard, before the target loads. Nothing left to
    extract, or mix_backends true: no refusal."""
    from eagle3_core.check import check_run
    from eagle3_core.features import store_run
    from eagle3_core.target.loading import load_target_config
    echo = _run_dir(tmp_path / "run", target, backend="echo")
    run_features_shard(echo, 0, log=lambda s: None)
    launched = []
    monkeypatch.setattr(store_run, "run_torchrun", lambda *a, **k: launched.append(a))
    tp = echo.model_copy(update={"features": echo.features.model_copy(update={"backend": "hf_tp", "tp_size": 2})})
    tcfg = load_target_config(tp.target)
    _, problems = check_run(tp, target_config=tcfg, memory=(1 << 40, "test"), gpus=None)
    mixed = [m for f, m in problems if f == "features.backend"]
    assert len(mixed) == 1 and "holds shards of backend ['echo'] (['shard_00000.safetensors'])" in mixed[0] and \
        "extracts with 'hf_tp'" in mixed[0] and "features.mix_backends true" in mixed[0], problems
    loads.clear()
    with pytest.raises(ValueError, match=r"backend \['echo'\] .*'hf_tp'.*features\.mix_backends"):
        run_features(tp, log=lambda s: None)
    assert launched == [] and loads == []
    hf = echo.model_copy(update={"features": echo.features.model_copy(update={"backend": "hf"})})
    with pytest.raises(ValueError, match=r"backend \['echo'\]"):
        run_features_shard(hf, 2, log=lambda s: None)
    assert loads == []                                                        # refused before the target loaded
    allowed = tp.model_copy(update={"features": tp.features.model_copy(update={"mix_backends": True})})
    _, problems = check_run(allowed, target_config=tcfg, memory=(1 << 40, "test"), gpus=None)
    assert "features.backend" not in [f for f, _ in problems], problems
    for k in (1, 2):                                                          # the store finished by echo
        run_features_shard(echo, k, log=lambda s: None)
    _, problems = check_run(tp, target_config=tcfg, memory=(1 << 40, "test"), gpus=None)
    assert "features.backend" not in [f for f, _ in problems], problems


def _calls(path: Path, names: tuple[str, ...]) -> list[tuple[str, ast.Call]]:
    """(enclosing function, call) of every call of a function named in `names` in the module at `path`."""
    tree, out = ast.parse(path.read_text()), []

    def visit(node, where):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            if isinstance(child, ast.Call):
                f = child.func
                if (f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)) in names:
                    out.append((where, child))
            visit(child, inner)
    visit(tree, "<module>")
    return out


def test_the_features_stage_has_one_manifest_writer(target, tmp_path, monkeypatch):
    """Over the code: in the store, its backends, workers and the stage, the only file writes of a manifest are
    store.write_record's (and the workers' part records, parts/rank_N.json); every stage_run.run of the stage writes
    through write_record. At run time: every write of features/manifest.json and head.json, on the one-call and the
    per-shard paths, comes from write_record."""
    modules = [*sorted((ROOT / "eagle3_core" / "features").glob("*.py")),
               ROOT / "eagle3_core" / "pipeline" / "features_stage.py", ROOT / "tasks" / "distributed.py"]
    writes = [(p.name, where, ast.unparse(c.args[0]) if c.args else "") for p in modules
              for where, c in _calls(p, ("write_manifest", "write_atomic"))]
    assert {(m, w) for m, w, arg in writes if arg != "part_path"} == {("store.py", "write_record")}, writes
    assert [a for m, _, a in writes if m == "extract_workers.py"] == ["part_path"]
    stage = _calls(ROOT / "eagle3_core" / "pipeline" / "features_stage.py", ("run",))
    assert len(stage) == 2 and all({k.arg: ast.unparse(k.value) for k in c.keywords}.get("write") == "write_record"
                                   for _, c in stage)

    import inspect
    writers, real = [], manifest_mod.write_atomic

    def spy(path, data):
        if Path(path).parent.name == "features" and Path(path).name in ("manifest.json", "head.json"):
            writers.append(inspect.stack()[2].function)
        return real(path, data)
    monkeypatch.setattr(manifest_mod, "write_atomic", spy)
    cfg = _run_dir(tmp_path / "run", target)
    run_features(cfg, log=lambda s: None)
    per_shard = _run_dir(tmp_path / "per_shard", target)
    finish_features(per_shard, [run_features_shard(per_shard, k, log=lambda s: None) for k in range(3)],
                    log=lambda s: None)
    assert writers and set(writers) == {"write_record"}, writers


def _checked(cfg: PipelineConfig, gpus) -> tuple[dict, list[tuple[str, str]]]:
    """check_run's facts of the features and evaluate backends, and its problems of a features.* field."""
    facts, problems = check_run(cfg, target_config=load_target_config(cfg.target), memory=(1 << 40, "test"),
                                gpus=gpus)
    return facts["backends"], [(f, m) for f, m in problems if f.startswith("features.")]


def test_a_backend_of_a_few_lines_becomes_a_features_backend_by_one_row(target, tmp_path, monkeypatch):
    """The echo backend (this file: an Extractor class and its load) added to BACKENDS by its one row, nothing else
    patched: check says what runs it, weighs its memory model (the default, the whole target's, as for 'hf') and
    passes; the shard plan runs it per shard, the features stage extracts with it and records it, and the evaluator
    decodes. A torchrun variant of it, also one row (its own launcher, python, memory model, replay): check reports
    its memory model's facts and overrun, the flow gets one task, torchrun is asked to run its launcher with its
    python, and the evaluator replays."""
    monkeypatch.setitem(BACKENDS, "echo", ECHO)
    cfg = _run_dir(tmp_path / "run", target, backend="echo")
    gpus = (1, 10**9)
    backends_facts, problems = _checked(cfg, gpus)
    feats, hf_feats = backends_facts["features"], _checked(cfg.model_copy(update={"features": cfg.features.model_copy(
        update={"backend": "hf"})}), gpus)[0]["features"]
    assert problems == [] and feats["runs"] == "the tests' echo backend" and feats["chosen"] == "echo"
    assert {k: v for k, v in feats.items() if k not in ("runs", "chosen")} == \
        {k: v for k, v in hf_feats.items() if k not in ("runs", "chosen")} and "gb_per_gpu" in feats
    assert backends_facts["evaluate"]["evaluator"] == "decode" == resolved_evaluator("auto", "echo")
    assert feature_status(cfg) == {"shards": [0, 1, 2], "done": [], "per_shard": True}
    assert store_run.foreign_python(cfg) == {}
    first = run_features(cfg, log=lambda s: None)
    assert first["backend"] == "echo" and {e["backend"] for e in first["shards"]} == {"echo"}
    aux = load_samples(cfg.run_dir / "features")[0]["aux"].float()             # echo's [e, 2e, 3e]
    H = aux.shape[-1] // 3
    assert torch.equal(aux[..., H:2 * H], 2 * aux[..., :H])              # e and 3e each rounded to bf16
    assert torch.allclose(aux[..., 2 * H:], 3 * aux[..., :H], rtol=2 ** -7, atol=0)

    echo_tp = Backend("echo_tp", True, load_echo, "{w} echo ranks", launcher="echo_ranks",
                      python=lambda c: {"python": "/opt/echo/bin/python"}, replay=True,
                      memory=lambda m: Fit(10**9 * m.f.tp_size, [], {"echo_ranks": m.f.tp_size}, "features.tp_size"))
    monkeypatch.setitem(BACKENDS, "echo_tp", echo_tp)
    tp = _run_dir(tmp_path / "tp", target, backend="echo_tp", tp_size=2)
    backends_facts, problems = _checked(tp, (2, 10**9))
    feats = backends_facts["features"]
    assert (feats["runs"], feats["echo_ranks"], feats["gb_per_gpu"]) == ("2 echo ranks", 2, 2.0)
    assert [f for f, _ in problems] == ["features.tp_size"] and "exceed 85% of one GPU" in problems[0][1], problems
    assert backends_facts["evaluate"]["evaluator"] == "replay" and must_replay("echo_tp") and not must_replay("echo")
    assert feature_status(tp)["per_shard"] is False
    launched = []
    monkeypatch.setattr(store_run, "run_torchrun", lambda args, n, **kw: launched.append((args[:2], n, kw["python"])))
    with pytest.raises(RuntimeError, match="does not list every shard after the torchrun"):
        run_features(tp, log=lambda s: None)                   # nothing ran: no manifest
    assert launched == [(["-m", "echo_ranks"], 2, "/opt/echo/bin/python")]
    with pytest.raises(ValueError, match="extracts all shards in one torchrun"):
        run_features_shard(tp, 0, log=lambda s: None)


def test_the_configs_copies_of_backend_names_match_the_table():
    """config cannot import the table (its layer is below features): its list of the torchrun backends is the
    table's torchrun rows, and features.backend's description names every row (the import aside), tp_size's every
    torchrun row."""
    assert TORCHRUN_BACKENDS == tuple(n for n, row in BACKENDS.items() if row.torchrun)
    fields = FeatureConfig.model_fields
    assert all(f"'{n}'" in fields["backend"].description for n in BACKENDS if n != backends.IMPORT)
    assert all(f"'{n}'" in fields["tp_size"].description for n in TORCHRUN_BACKENDS)
    with pytest.raises(ValueError, match="need features.backend 'hf_tp', 'ep_int4' or 'sglang' "):
        FeatureConfig(tp_size=2)


def test_an_unknown_backend_is_named(tmp_path, target):
    cfg = _run_dir(tmp_path / "run", target, backend="vllm")
    with pytest.raises(ValueError, match=r"features\.backend 'vllm' is not a features backend.*'hf', 'hf_tp'"):
        run_features(cfg, log=lambda s: None)
    assert backends.backend_name(cfg) == "vllm"
