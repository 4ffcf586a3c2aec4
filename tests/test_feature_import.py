"""Feature import: files in SpecForge's offline layout, written here from our own features and read back by
SpecForge 0.2.0's installed reader, import into our shard store; a TTT step on the imported shards gives the loss
it gives on the native ones; bad files are refused naming the file and the field, with nothing written."""
import pytest
import torch

from eagle3_core.features.specforge_import import FeatureImportError, imported_extractor
from eagle3_core.features.store import extract_features
from eagle3_core.features.reader import load_samples
from eagle3_core.target.loading import default_aux_ids
from test_features import _rows

AUX = [1, 14, 26]


def _head(target_model):
    """(config, embedding, lm_head) as imported_extractor takes them."""
    return (target_model.config, target_model.get_input_embeddings().weight.detach(),
            target_model.get_output_embeddings().weight.detach())


def _write_specforge(samples, out, change=None):
    """One rows_0-2000/data_{i}.ckpt per sample, as SpecForge's prepare_hidden_states.py lays them out."""
    (out / "rows_0-2000").mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(samples):
        d = {"input_ids": s["input_ids"].clone(), "loss_mask": s["loss_mask"].long(),
             "hidden_state": s["final"][None].clone(), "aux_hidden_state": s["aux"][None].clone()}
        if change:
            change(i, d)
        torch.save(d, out / "rows_0-2000" / f"data_{i}.ckpt")
    return out


def _loss(samples, target_model, draft_seed=0):
    from eagle3_core.data.vocab_map import build_vocab_map, count_tokens, draft_to_target_ids
    from eagle3_core.training.draft_geometry import draft_shape
    from eagle3_core.training.setup import build_draft
    from eagle3_core.training.ttt import collate, ttt_loss
    V = target_model.config.vocab_size
    d2t, t2d = build_vocab_map(count_tokens([s["input_ids"] for s in samples],
                                            [s["loss_mask"] for s in samples], V), 256)
    emb = target_model.get_input_embeddings().weight.detach().float()
    draft = build_draft(draft_shape(target_model.config, 256, AUX), emb, d2t, t2d, draft_seed)
    loss, _ = ttt_loss(draft, collate([dict(s) for s in samples]),
                       emb[draft_to_target_ids(d2t)], ttt_length=3)
    return float(loss)


def test_specforge_files_import_to_shards_that_train_like_native_ones(target_model, tokenizer, tmp_path):
    from specforge.data.preprocessing import OfflineEagle3Dataset, list_local_files
    rows = _rows(tokenizer, 5)
    assert default_aux_ids(target_model.config) == AUX
    extract_features(target_model, rows, tmp_path / "native", AUX, shard_samples=2, batch_tokens=512,
                     store_format="fp32")
    native = load_samples(tmp_path / "native")
    src = _write_specforge(native, tmp_path / "specforge")
    # SpecForge's own reader sees what we wrote: its hidden_state is our aux, its target our final state
    theirs = OfflineEagle3Dataset(list_local_files(str(src)), max_len=4096)
    for i, s in enumerate(native):
        item = theirs[i]
        assert torch.equal(item["hidden_state"][0], s["aux"]) and torch.equal(item["target"][0], s["final"])
        assert torch.equal(item["input_ids"][0], s["input_ids"])

    extractor = imported_extractor(src, rows, *_head(target_model), AUX, "tokenized rows of this test")
    store = extract_features(extractor, rows, tmp_path / "imported", AUX, shard_samples=2, batch_tokens=512,
                             store_format="fp32")
    assert store["complete"] and store["samples"] == 5 and len(store["shards"]) == 3
    imported = load_samples(tmp_path / "imported")
    for a, b in zip(native, imported):
        assert a["id"] == b["id"] and torch.equal(a["aux"], b["aux"]) and torch.equal(a["final"], b["final"])
        assert torch.equal(a["target_top1"], b["target_top1"]) and torch.equal(a["loss_mask"], b["loss_mask"])
    assert abs(_loss(native, target_model) - _loss(imported, target_model)) <= 1e-5
    # same target, same samples: the same content keys, so the two stores are interchangeable shard by shard
    native_keys = [e["content_key"] for e in load_manifest(tmp_path / "native")["shards"]]
    assert [e["content_key"] for e in store["shards"]] == native_keys


def load_manifest(d):
    import json
    return json.loads((d / "manifest.json").read_text())


def test_bad_files_are_refused_naming_the_file_and_field(target_model, tokenizer, tmp_path):
    rows = _rows(tokenizer, 3)
    extract_features(target_model, rows, tmp_path / "native", AUX, shard_samples=2, batch_tokens=512,
                     store_format="fp32")
    native = load_samples(tmp_path / "native")

    def narrow(i, d):
        if i == 1:
            d["aux_hidden_state"] = d["aux_hidden_state"][..., :-576]

    def retokenized(i, d):
        if i == 2:
            d["input_ids"][3] += 1

    def other_mask(i, d):
        if i == 0:
            d["loss_mask"][:] = 1

    def overflowed(i, d):
        if i == 1:
            d["hidden_state"][0, 2, 5] = float("nan")

    cases = [(overflowed, r"data_1\.ckpt: hidden_state holds non-finite values \(NaN or inf\) at 1 of \d+ "
                          r"positions \(first: \[2\]\)"),
             (narrow, r"data_1\.ckpt: aux_hidden_state is 1152 wide but three aux layers of the target, "
                      r"3 x H_t = 1728"),
             (retokenized, r"data_2\.ckpt: input_ids \(\d+ tokens\) match no sample of our tokenization .*"
                           r"first difference at position 3"),
             (other_mask, r"data_0\.ckpt: loss_mask \(\d+ tokens\) differs from ours for sample 'r0'")]
    for change, message in cases:
        src = _write_specforge(native, tmp_path / change.__name__, change)
        with pytest.raises(FeatureImportError, match=message):
            imported_extractor(src, rows, *_head(target_model), AUX, "tokenized")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FeatureImportError, match=r"no \*\.ckpt"):
        imported_extractor(tmp_path / "empty", rows, *_head(target_model), AUX, "tokenized")
    src = _write_specforge(native[:2], tmp_path / "short")
    with pytest.raises(FeatureImportError, match=r"1 of 3 tokenized samples have no file .*'r2'"):
        imported_extractor(src, rows, *_head(target_model), AUX, "tokenized")


def test_the_import_cli_fills_a_runs_feature_store(e2e_run, tmp_path):
    """`python -m eagle3_core.feature_import CONFIG DIR` on a run whose tokenize stage ran: the features stage is
    done with the imported shards (same content keys as the shards the end-to-end run extracted), and a second
    call imports nothing."""
    import shutil

    from eagle3_core.feature_import import main
    from eagle3_core.pipeline.table import stage_done
    cfg0, _ = e2e_run
    for stage in ("prompts", "generations", "tokenized"):
        shutil.copytree(cfg0.run_dir / stage, tmp_path / "run" / stage)
    cfg = cfg0.model_copy(deep=True)
    cfg.run_dir = tmp_path / "run"
    (tmp_path / "config.json").write_text(cfg.model_dump_json())
    src = _write_specforge(load_samples(cfg0.run_dir / "features"), tmp_path / "specforge")
    assert main([str(tmp_path / "config.json"), str(src)]) == 0
    cfg.features.import_from = str(src)
    assert stage_done(cfg, "features")
    theirs, ours = load_manifest(cfg0.run_dir / "features"), load_manifest(cfg.run_dir / "features")
    assert [e["content_key"] for e in ours["shards"]] == [e["content_key"] for e in theirs["shards"]]
    before = (cfg.run_dir / "features" / "manifest.json").read_bytes()
    assert main([str(tmp_path / "config.json"), str(src)]) == 0
    assert (cfg.run_dir / "features" / "manifest.json").read_bytes() == before


def test_the_import_reads_exactly_the_embedding_and_lm_head(tiny_target_dirs, monkeypatch):
    """Counted on the tiny fixture's safetensors: one get_tensor per head tensor (two untied, one tied), nothing
    else of the target, equal to the weights a full load gives."""
    import safetensors
    from transformers import AutoConfig

    from eagle3_core.features import specforge_import
    from eagle3_core.target.loading import auto_model_class
    reads = []
    real_open = safetensors.safe_open

    class Counting:
        def __init__(self, *a, **kw):
            self.f = real_open(*a, **kw)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            reads.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(specforge_import, "safe_open", Counting)
    for family, d in tiny_target_dirs.items():
        reads.clear()
        embed, lm, names = specforge_import.head_tensors(d)
        full = auto_model_class(AutoConfig.from_pretrained(d), str(d)).from_pretrained(d)
        tied = full.get_output_embeddings().weight.data_ptr() == full.get_input_embeddings().weight.data_ptr()
        assert sorted(reads) == names and len(reads) == (1 if tied else 2), (family, reads)
        assert torch.equal(embed, full.get_input_embeddings().weight.detach().to(embed.dtype)), family
        assert torch.equal(lm, full.get_output_embeddings().weight.detach().to(lm.dtype)), family


def test_an_import_needs_explicit_aux_ids():
    from pydantic import ValidationError

    from eagle3_core.config import FeatureConfig
    with pytest.raises(ValidationError, match="import_from 'x' needs explicit features.aux_layer_ids"):
        FeatureConfig(import_from="x")
    assert FeatureConfig(import_from="x", aux_layer_ids=[1, 3, 5]).aux_layer_ids == [1, 3, 5]


@pytest.mark.slow
def test_an_import_under_hf_tp_runs_no_target(e2e_run, tmp_path):
    """features.backend 'hf_tp' with import_from: the stage imports (no torchrun, no target forward), with the
    content keys of the end-to-end run's extracted shards."""
    import shutil

    from eagle3_core.pipeline.features_stage import run_features
    cfg0, _ = e2e_run
    for stage in ("prompts", "generations", "tokenized"):
        shutil.copytree(cfg0.run_dir / stage, tmp_path / "run" / stage)
    src = _write_specforge(load_samples(cfg0.run_dir / "features"), tmp_path / "specforge")
    ids = load_manifest(cfg0.run_dir / "features")["aux_layer_ids"]
    cfg = cfg0.model_copy(update={"run_dir": tmp_path / "run", "features": cfg0.features.model_copy(update={
        "backend": "hf_tp", "tp_size": 2, "import_from": str(src), "aux_layer_ids": ids})})
    lines = []
    m = run_features(cfg, log=lines.append)
    theirs = load_manifest(cfg0.run_dir / "features")
    assert [e["content_key"] for e in m["shards"]] == [e["content_key"] for e in theirs["shards"]]
    assert not (cfg.run_dir / "features" / "torchrun.log").exists()
    assert any("read ['model.embed_tokens.weight']" in line for line in lines), lines


def test_the_spot_check_refuses_aux_states_of_other_layers(target_model, tokenizer, tmp_path):
    """Files extracted at layers [1, 14, 26] pass against the target at those layers (difference ~0) and are
    refused, naming features.aux_layer_ids, when the run says [2, 10, 20]."""
    from eagle3_core.features.specforge_import import aux_spot_check
    rows = _rows(tokenizer, 2)
    extract_features(target_model, rows, tmp_path / "native", AUX, shard_samples=2, batch_tokens=512,
                     store_format="fp32")
    src = _write_specforge(load_samples(tmp_path / "native"), tmp_path / "specforge")
    assert aux_spot_check(imported_extractor(src, rows, *_head(target_model), AUX, "t"), target_model, rows[0]) < 1e-3
    other = imported_extractor(src, rows, *_head(target_model), [2, 10, 20], "t")
    with pytest.raises(FeatureImportError, match=r"data_0\.ckpt: its aux states differ .* set features\.aux_layer_ids"):
        aux_spot_check(other, target_model, rows[0])
