"""A half-trained tiny run (tiny Llama target, 12 tokenized rows, the features, vocab and train stages run for real):
a setting that cannot change the draft (train.keep_checkpoints) keeps the checkpoints and resumes from them; a field
in a key redoes its stage and the stages below it, none above."""
from __future__ import annotations

import pytest
import torch

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.manifest import write_manifest
from eagle3_core.pipeline.features_stage import run_features
from eagle3_core.pipeline.table import inputs_key, stage_done
from eagle3_core.pipeline.train_stage import run_train
from eagle3_core.pipeline.vocab_stage import run_vocab
from eagle3_core.training import trainer
from tiny_targets import build
from tokenized_rows import random_rows, tiny_train_run, write_tokenized

DIRS = {"tokenize": "tokenized", "features": "features", "vocab": "vocab", "train": "draft", "evaluate": "eval"}


def _manifests(cfg) -> dict[str, str]:
    return {s: (cfg.run_dir / d / "manifest.json").read_text() for s, d in DIRS.items()}


def _with(cfg: PipelineConfig, section: str, **fields) -> PipelineConfig:
    return cfg.model_copy(update={section: getattr(cfg, section).model_copy(update=fields)})


@pytest.fixture
def half_trained(tmp_path, monkeypatch):
    """A run whose train stage died after 2 of its optimizer steps (checkpoints step 1 and 2 on disk)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = tiny_train_run(tmp_path / "run", build("llama", tmp_path / "t"), eval_frac=0.0, checkpoint_every=1,
                         keep_checkpoints=3)
    write_tokenized(cfg.run_dir, random_rows(12, lengths=(8, 24), prompt_part=3), inputs_key="twelve-random-rows")
    write_manifest(cfg.run_dir / "prompts" / "manifest.json", {"inputs_key": "the prompts"})
    run_features(cfg, log=lambda s: None)
    run_vocab(cfg, log=lambda s: None)
    real = trainer.train

    def killed(*args, **kwargs):
        real(*args, **{**kwargs, "stop_after_steps": 2})
        raise RuntimeError("the train stage's process died")
    monkeypatch.setattr(trainer, "train", killed)
    with pytest.raises(RuntimeError, match="died"):
        run_train(cfg, log=lambda s: None)
    monkeypatch.setattr(trainer, "train", real)
    yield cfg
    torch.set_num_threads(threads)


def test_keep_checkpoints_resumes_and_a_key_field_redoes_its_stage_and_those_below(half_trained):
    cfg = half_trained
    ckpts = cfg.run_dir / "draft" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*.pt")) == ["step_000000001.pt", "step_000000002.pt"]
    assert not stage_done(cfg, "train")

    kept = _with(cfg, "train", keep_checkpoints=1, checkpoint_every=5)        # not in the train key
    assert inputs_key(kept, "train") == inputs_key(cfg, "train")
    lines = []
    done = run_train(kept, log=lines.append)
    assert any("resumed from step_000000002.pt (epoch 1, batch 2, step 2)" in x for x in lines), lines
    assert done["steps"] > 2 and stage_done(kept, "train") and stage_done(cfg, "train")
    write_manifest(cfg.run_dir / "eval" / "manifest.json", {"inputs_key": inputs_key(kept, "evaluate")})
    before = _manifests(kept)

    lr = _with(kept, "train", lr=1e-3)                                        # in the train key
    assert [stage_done(lr, s) for s in ("features", "vocab", "train")] == [True, True, False]
    lines = []
    for run in (run_features, run_vocab, run_train):
        run(lr, log=lines.append)
    assert not any("resumed" in x for x in lines), lines                     # other inputs: trained afresh
    after = _manifests(lr)
    assert {s for s in DIRS if after[s] != before[s]} == {"train"}
    assert not stage_done(lr, "evaluate")                                     # below train: redone next

    layers = _with(lr, "features", aux_layer_ids=[1, 2, 5])                   # in the features key
    assert [stage_done(layers, s) for s in ("features", "vocab")] == [False, True]
    for run in (run_features, run_vocab, run_train):
        run(layers, log=lambda s: None)
    final = _manifests(layers)
    assert {s for s in DIRS if final[s] != after[s]} == {"features", "train"}
    assert all(stage_done(layers, s) for s in ("features", "vocab", "train")) and not stage_done(layers, "evaluate")
