"""Warm start (train.init_from): the draft's vocab map is kept, or rebuilt with every lm_head row carried by its
target token id; a draft that does not fit the run is refused naming the field."""
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_draft, tiny_shape
from eagle3_core.data.vocab_map import draft_to_target_ids, target_to_draft_ids
from eagle3_core.training.checkpoint import export_draft
from eagle3_core.training.warm_start import carry_lm_head, load_init, warm_draft


def rows_by_token_mismatch(old, new) -> list[int]:
    """Target tokens in both vocabularies whose lm_head row in `new` is not the row `old` had for that token."""
    old_of = target_to_draft_ids(old.t2d)
    bad = []
    for j, t in enumerate(draft_to_target_ids(new.d2t).tolist()):
        if old_of[t] >= 0 and not torch.equal(new.lm_head.weight[j], old.lm_head.weight[old_of[t]]):
            bad.append(t)
    return bad


def _fresh_with_map(targets: list[int], seed: int = 5):
    from eagle3_core.training.draft_model import Eagle3Draft
    fresh = Eagle3Draft(tiny_shape())
    fresh.init_weights(seed)
    with torch.no_grad():
        ids = torch.tensor(sorted(targets))
        fresh.d2t.copy_(ids - torch.arange(len(ids)))
        fresh.t2d.zero_()
        fresh.t2d[ids] = True
    return fresh


def test_a_rebuilt_map_carries_every_lm_head_row_by_target_token():
    old = tiny_draft(0)                                        # draft id i scores target token 2i
    fresh = _fresh_with_map(list(range(25)) + list(range(60, 85)))   # 26 even tokens shared, at other positions
    init_rows = fresh.lm_head.weight.detach().clone()
    warm, info = warm_draft(old, fresh)
    assert info == {"lm_head_rows_carried": 26, "lm_head_rows": 50, "vocab": "rebuilt"}
    assert rows_by_token_mismatch(old, warm) == []
    new_targets = draft_to_target_ids(warm.d2t)
    fresh_rows = [j for j, t in enumerate(new_targets.tolist()) if t % 2]     # odd tokens: not in the old vocab
    assert torch.equal(warm.lm_head.weight[fresh_rows], init_rows[fresh_rows])
    assert torch.equal(warm.fc.weight, old.fc.weight)
    assert torch.equal(warm.midlayer.mlp.down_proj.weight, old.midlayer.mlp.down_proj.weight)
    # the deliberate mistake: a positional carry scores other tokens, and the check above catches it
    positional = _fresh_with_map(list(range(25)) + list(range(60, 85)))
    with torch.no_grad():
        positional.lm_head.weight.copy_(old.lm_head.weight)
    # every shared token but 0 and 70, the two whose new position j happens to be the old one (t == 2j)
    assert len(rows_by_token_mismatch(old, positional)) == 24
    head, n = carry_lm_head(old.lm_head.weight, old.t2d, old.d2t, torch.zeros(50, 32))
    assert n == 50 and torch.equal(head, old.lm_head.weight)      # the same map: every row where it was


def test_a_kept_map_gives_the_same_draft(tmp_path):
    old = tiny_draft(1)
    export_draft(old, tmp_path / "init", dtype=torch.float32)
    init = load_init(tmp_path / "init", tiny_shape(), keep_vocab=True)
    fresh = _fresh_with_map((torch.arange(50) * 2).tolist())
    with torch.no_grad():
        fresh.embed_tokens.weight.copy_(old.embed_tokens.weight)   # the target's embedding, as fresh_draft does
    warm, info = warm_draft(init, fresh)
    assert info["vocab"] == "kept" and info["lm_head_rows_carried"] == 50
    assert all(torch.equal(a, b) for a, b in zip(warm.state_dict().values(), old.state_dict().values()))


@pytest.mark.parametrize("field,kw,want", [
    ("draft.intermediate_size", {"intermediate_size": 96}, {}),
    ("features.aux_layer_ids", {}, {"aux_layer_ids": [0, 1, 2]}),
    ("draft.draft_vocab_size", {}, {"draft_vocab_size": 40}),
])
def test_a_draft_that_does_not_fit_is_refused_naming_the_field(tmp_path, field, kw, want):
    export_draft(tiny_draft(2, **kw), tmp_path / "d", dtype=torch.float32)
    with pytest.raises(ValueError, match=rf"- {field}: .* set {field} to"):
        load_init(tmp_path / "d", tiny_shape(**want), keep_vocab=True)
    with pytest.raises(FileNotFoundError, match=r"train.init_from .*draft/export"):
        load_init(tmp_path / "nothing", tiny_shape(), keep_vocab=True)


@pytest.mark.slow
def test_warm_start_stages_keep_or_rebuild_the_map(e2e_run, tmp_path):
    """On the end-to-end run's data: a second run warm-started from the first keeps its d2t/t2d (vocab stage) and
    trains; with a rebuilt, smaller map every shared token's lm_head row is the exported draft's; a geometry that
    differs is refused naming the field."""
    from eagle3_core.pipeline.train_stage import fresh_draft, run_train
    from eagle3_core.pipeline.vocab_stage import run_vocab
    cfg0, _ = e2e_run
    for stage in ("prompts", "generations", "tokenized", "features"):
        shutil.copytree(cfg0.run_dir / stage, tmp_path / "run" / stage)
    cfg = cfg0.model_copy(deep=True)
    cfg.run_dir = tmp_path / "run"
    cfg.train.init_from, cfg.train.epochs = str(cfg0.run_dir), 1
    export = load_file(str(cfg0.run_dir / "draft" / "export" / "model.safetensors"))
    lines = []
    run_vocab(cfg, log=lines.append)
    vocab = load_file(str(cfg.run_dir / "vocab" / "vocab_map.safetensors"))
    assert torch.equal(vocab["d2t"], export["d2t"]) and torch.equal(vocab["t2d"], export["t2d"])
    assert any("kept the map of the warm-start draft" in line for line in lines)
    m = run_train(cfg, log=lines.append)
    assert m["steps"] > 0 and any("vocab map kept, 1024 of 1024 lm_head rows carried" in line for line in lines)

    cfg.train.init_vocab, cfg.draft.draft_vocab_size = "rebuild", 512
    run_vocab(cfg, log=lines.append)
    draft, _ = fresh_draft(cfg, log=lines.append)
    old_of = target_to_draft_ids(export["t2d"])
    new_targets = draft_to_target_ids(draft.d2t)
    shared = [(j, int(old_of[t])) for j, t in enumerate(new_targets.tolist()) if old_of[t] >= 0]
    assert len(shared) > 400                                   # the 512 most frequent tokens: mostly in the old 1024
    assert all(torch.equal(draft.lm_head.weight[j], export["lm_head.weight"][o].float()) for j, o in shared)

    cfg.draft.intermediate_size = 999
    with pytest.raises(ValueError, match=r"- draft.intermediate_size: the run builds intermediate_size = 999"):
        fresh_draft(cfg)
