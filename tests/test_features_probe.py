"""`python -m eagle3_core.features_probe`: two features backends on the same samples, compared per aux layer, on
the final state and the argmax, against the written TOLERANCE. On CPU with tiny targets: the comparison's
measures on stores that agree, that differ by a layer and that come from another target; the command end to end
with `hf` against `hf_tp` on 2 gloo ranks (slow)."""
from pathlib import Path

import pytest

from eagle3_core.config import TargetConfig
from eagle3_core.features.extract import HFExtractor
from eagle3_core.features.store import extract_features
from eagle3_core.features_probe import TOLERANCE, compare, main, render
from eagle3_core.target.loading import load_target
from feature_stores import features_run
from tokenized_rows import random_rows


class Relabelled:
    """An Extractor storing `inner`'s aux states under other layer ids (what a layer-id mistake writes)."""

    def __init__(self, inner: HFExtractor, ids: list[int]):
        self.inner, self.aux_layer_ids = inner, ids
        self.model, self.hidden_size, self.device = inner.model, inner.hidden_size, inner.device

    def forward(self, seqs):
        return self.inner.forward(seqs)

    def head_weights(self):
        return self.inner.head_weights()


@pytest.fixture(scope="module")
def stores(tiny_target_dirs, tmp_path_factory):
    """{name: store dir} of the same 5 rows: 'a' and 'b' the tiny Llama (two extractions), 'other' a Llama of
    other random weights (another seed), 'shifted' the tiny Llama with each aux id one layer up ([2, 4, 5]
    written under the ids [1, 3, 4]: what a layer-id mistake stores)."""
    from tiny_targets import build
    root = tmp_path_factory.mktemp("probe")
    llama = load_target(TargetConfig(model=str(tiny_target_dirs["llama"])), "cpu")
    other = load_target(TargetConfig(model=str(build("llama", root / "other_target", seed=1))), "cpu")
    rows = random_rows(5)
    out = {}
    for name, model, ids in (("a", llama, [1, 3, 4]), ("b", llama, [1, 3, 4]), ("other", other, [1, 3, 4]),
                             ("shifted", llama, [2, 4, 5])):
        extract_features(Relabelled(HFExtractor(model, ids), [1, 3, 4]), rows, root / name, None, 2, 64,
                         log=lambda s: None)
        out[name] = root / name
    return out


def test_the_comparison_measures_each_layer_against_the_tolerance(stores):
    same = compare(stores["a"], stores["b"])
    assert same["ok"] and same["tokens"] == sum(len(r["input_ids"]) for r in random_rows(5))
    assert [x["layer"] for x in same["aux"]] == [1, 3, 4] and all(x["rel"] == 0 for x in same["aux"])
    assert same["final"]["rel"] == 0 and same["argmax_agree"] == 1.0
    # a layer-id mistake: every aux layer far beyond the tolerance, the final state and argmax untouched
    shifted = compare(stores["shifted"], stores["a"])
    assert not shifted["ok"] and min(x["rel"] for x in shifted["aux"]) > 20 * TOLERANCE["aux_rel"]
    assert shifted["final"]["rel"] == 0 and shifted["argmax_agree"] == 1.0
    other = compare(stores["other"], stores["a"])
    assert not other["ok"] and other["final"]["rel"] > 0.5 and other["argmax_agree"] < 0.5
    text = render({**shifted, "backends": ["x", "y"], "samples": 5, "tokens_per_s": {"x": 1000.0, "y": None},
                   "seconds": {"x": 1.0, "y": 2.0}})
    assert "aux layer   1: rel" in text and "(<= 0.02)" in text and "DIFFERENT" in text
    assert "1,000 tok/s extracting" in text and "rate not recorded" in text


def test_the_probe_extracts_afresh_so_a_tp_size_change_really_shards(tiny_target_dirs, tmp_path, monkeypatch):
    """The features stage's key leaves out tp_size (how, not what, is computed), so a probe reusing its store
    compared the old one-rank store after a tp_size change. Every probe extracts afresh and reports the ranks:
    torchrun is started again with the new size. Here torchrun is a stand-in that records its process count and
    extracts in this process (the real 2-rank run: the slow test below)."""
    import pyarrow.parquet as pq

    from eagle3_core.config import PipelineConfig
    from eagle3_core.contract.layout import RunLayout
    from eagle3_core.features_probe import probe
    from eagle3_core.features import store_run
    started = []

    def torchrun(args, nproc, **kw):
        started.append(nproc)
        conf = PipelineConfig.model_validate_json(Path(args[args.index("--config") + 1]).read_text())
        f = conf.features
        rows = pq.read_table(RunLayout(conf.run_dir).tokenized_train).to_pylist()
        extract_features(load_target(conf.target, "cpu"), rows, RunLayout(conf.run_dir).features,
                         f.aux_layer_ids, f.shard_samples, f.batch_tokens, log=lambda s: None, backend="hf_tp",
                         store_key=args[args.index("--store-key") + 1])
    monkeypatch.setattr(store_run, "run_torchrun", torchrun)
    cfg = features_run(tmp_path / "run", tiny_target_dirs["llama"], random_rows(6), backend="hf_tp", tp_size=1)
    first = probe(cfg, ["hf", "hf_tp"], 4, log=lambda s: None)
    assert started == [1] and first["ranks"] == {"hf": 1, "hf_tp": 1} and first["ok"]
    two = cfg.model_copy(update={"features": cfg.features.model_copy(update={"tp_size": 2})})
    second = probe(two, ["hf", "hf_tp"], 4, log=lambda s: None)
    assert started == [1, 2] and second["ranks"] == {"hf": 1, "hf_tp": 2} and second["ok"]
    assert "hf_tp" in render(second) and "2 rank(s)" in render(second)


@pytest.mark.slow
def test_the_probe_command_compares_hf_with_hf_tp_on_cpu(tiny_target_dirs, tmp_path, capsys):
    """The command on a run whose tokenize stage ran: `hf` in this process, `hf_tp` over 2 gloo ranks; they agree
    within the tolerance (sharded sums differ by a few 1e-6: tests/test_tp_extract.py), exit code 0; run first
    with tp_size 1, then 2: the second really shards (the report names 2 ranks for hf_tp)."""
    cfg = features_run(tmp_path / "run", tiny_target_dirs["llama"], random_rows(6), backend="hf_tp", tp_size=1)
    config = tmp_path / "run.json"
    config.write_text(cfg.model_dump_json())
    assert main([str(config), "--backends", "hf,hf_tp", "--samples", "4"]) == 0        # one rank first
    assert "hf_tp" in (out := capsys.readouterr().out) and out.count("1 rank(s)") == 2
    cfg = cfg.model_copy(update={"features": cfg.features.model_copy(update={"tp_size": 2})})
    config.write_text(cfg.model_dump_json())
    assert main([str(config), "--backends", "hf,hf_tp", "--samples", "4"]) == 0        # then sharded over two
    out = capsys.readouterr().out
    assert "features probe: hf against hf_tp, 4 samples" in out and "EQUAL within the tolerance" in out
    assert out.count("tok/s extracting") == 2 and "argmax agree : 100.00%" in out and "2 rank(s)" in out
    for layer in (1, 3, 4):
        assert f"aux layer   {layer}: rel" in out
    assert (tmp_path / "run" / "features_probe" / "hf_tp" / "features" / "manifest.json").exists()
    assert main([str(config), "--backends", "hf,hf"]) == 2                          # two different ones
    assert "two different backends" in capsys.readouterr().err
