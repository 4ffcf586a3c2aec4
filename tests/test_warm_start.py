"""Warm start (train.init_from): the draft's vocab map is kept, or rebuilt with every lm_head row carried by its
target token id; a draft that does not fit the run is refused naming the field."""
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_draft, tiny_shape
from eagle3_core.data.vocab_map import draft_to_target_ids, target_to_draft_ids
from eagle3_core.target.family import PLUS_ONE, PLUS_ONE_IF_FIRST_IS_1
from eagle3_core.training.checkpoint import export_draft
from eagle3_core.training.warm_start import carry_lm_head, init_config, init_source, load_init, warm_draft


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
    export_draft(old, tmp_path / "init", dtype=torch.float32, sglang_rule=PLUS_ONE)
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
    export_draft(tiny_draft(2, **kw), tmp_path / "d", dtype=torch.float32, sglang_rule=PLUS_ONE)
    with pytest.raises(ValueError, match=rf"- {field}: .* set {field} to"):
        load_init(tmp_path / "d", tiny_shape(**want), keep_vocab=True)
    with pytest.raises(FileNotFoundError, match=r"train.init_from .*draft/export"):
        load_init(tmp_path / "nothing", tiny_shape(), keep_vocab=True)


def test_a_draft_naming_only_sglang_ids_is_read_by_the_targets_sglang_rule(tmp_path):
    """A SpecForge draft config names only the nested ids SpecForge passed raw to SGLang's capture: on a
    DeepSeek/Kimi target (models/deepseek_v2.py) [2, 3, 5] were layer inputs, so the draft was trained on outputs
    [1, 2, 4]; on a Llama target (models/llama.py adds one) on outputs [2, 3, 5]. Our own export (top-level ids
    written) reads the same under either rule."""
    import json
    export_draft(tiny_draft(2, aux_layer_ids=[2, 3, 5]), tmp_path / "d", dtype=torch.float32,
                 sglang_rule=PLUS_ONE_IF_FIRST_IS_1)
    for rule in (PLUS_ONE, PLUS_ONE_IF_FIRST_IS_1):
        assert init_config(init_source(tmp_path / "d"), rule=rule).aux_layer_ids == [2, 3, 5]
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 4, 6]
    cfg.pop("eagle_aux_hidden_state_layer_ids")
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 3, 5]                  # as SpecForge writes it
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    src = init_source(tmp_path / "d")
    assert init_config(src, rule=PLUS_ONE_IF_FIRST_IS_1).aux_layer_ids == [1, 2, 4]
    assert init_config(src, rule=PLUS_ONE).aux_layer_ids == [2, 3, 5]
    with pytest.raises(ValueError, match=r"aux_layer_ids = \[2, 3, 5\], the draft .* has \[1, 2, 4\]: set "
                                         r"features.aux_layer_ids to \[1, 2, 4\].*SpecForge's \[2, 30, 58\] are "
                                         r"outputs \[1, 29, 57\]"):
        load_init(tmp_path / "d", tiny_shape(aux_layer_ids=[2, 3, 5]), keep_vocab=True, rule=PLUS_ONE_IF_FIRST_IS_1)
    assert load_init(tmp_path / "d", tiny_shape(aux_layer_ids=[1, 2, 4]), keep_vocab=True,
                     rule=PLUS_ONE_IF_FIRST_IS_1).shape.aux_layer_ids == [1, 2, 4]


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


# --- SpecForge 0.2's drafts: its SGLang export (no embed_tokens) and its training checkpoints (training_state.pt)

def _specforge_config(shape, **kw) -> dict:
    """A draft config.json as SpecForge 0.2 writes it (specforge/export/to_sglang.py: LlamaConfig.save_pretrained
    under transformers 5, then apply_legacy_rope_scaling): rope in rope_parameters plus a top-level rope_theta, no
    target_hidden_size (= hidden_size), no rope_scaling for plain RoPE; `kw` overrides fields."""
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "attention_bias": False,
            "draft_vocab_size": shape.draft_vocab_size, "dtype": "bfloat16",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": shape.aux_layer_ids, "use_aux_hidden_state": True},
            "head_dim": shape.head_dim, "hidden_act": "silu", "hidden_size": shape.hidden_size,
            "intermediate_size": shape.intermediate_size, "max_position_embeddings": shape.max_position_embeddings,
            "num_attention_heads": shape.num_attention_heads, "num_hidden_layers": 1,
            "num_key_value_heads": shape.num_key_value_heads, "rms_norm_eps": shape.rms_norm_eps,
            "rope_parameters": {"rope_theta": shape.rope_theta, "rope_type": "default"},
            "rope_theta": shape.rope_theta, "tie_word_embeddings": False, "vocab_size": shape.vocab_size, **kw}


def _draft_state(draft) -> dict:
    """The draft's state dict as SpecForge's eagle3 strategy persists it (checkpoint_state_filter: SGLang's names,
    the frozen embedding left out) and its exporter writes it (bf16)."""
    return {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).clone() for k, v in draft.state_dict().items()
            if "embed" not in k}


def _fresh_target_embedding(old):
    fresh = _fresh_with_map((torch.arange(50) * 2).tolist())
    with torch.no_grad():
        fresh.embed_tokens.weight.normal_()                    # the target's embedding (setup.build_draft)
    return fresh


def _same_weights_but_embedding(warm, old, fresh):
    for name, t in warm.state_dict().items():
        want = fresh.state_dict()[name] if name == "embed_tokens.weight" else old.state_dict()[name]
        want = want.to(torch.bfloat16).float() if want.is_floating_point() and name != "embed_tokens.weight" else want
        assert torch.equal(t, want), name


def test_a_specforge_sglang_export_without_embed_tokens_warm_starts_with_the_targets_embedding(tmp_path):
    import json

    from safetensors.torch import save_file

    from eagle3_core.training.warm_start import init_problems
    old = tiny_draft(3)
    out = tmp_path / "sf_export"
    out.mkdir()
    save_file(_draft_state(old), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_specforge_config(tiny_shape())))
    assert init_problems(out, tiny_shape(), keep_vocab=True) == []
    fresh = _fresh_target_embedding(old)
    warm, info = warm_draft(load_init(out, tiny_shape(), keep_vocab=True), fresh)
    assert info["vocab"] == "kept" and info["lm_head_rows_carried"] == 50
    _same_weights_but_embedding(warm, old, fresh)
    # a draft whose hidden size is not the target's trains its own embedding: without it, refused naming why
    problems = init_problems(out, tiny_shape(target_hidden_size=48), keep_vocab=True)
    assert [f for f, _ in problems] == ["target.model"] and "another target" in problems[0][1]


def test_a_specforge_training_checkpoint_warm_starts_read_with_weights_only(tmp_path):
    """SpecForge's own CheckpointManager writes `{run_id}-step{N}/training_state.pt` and the `-latest` link; the
    payload is what its controller saves (draft_state_dict, counters, the DDP optimizer state). The draft config
    is missing at first (SpecForge keeps it apart): the error says where to put it."""
    import argparse
    import json

    from specforge.training.checkpoint import CheckpointManager

    from eagle3_core.pipeline.keys import init_key
    from eagle3_core.training.warm_start import init_source, init_vocab_map
    old = tiny_draft(4)
    opt = torch.optim.AdamW([p for p in old.parameters() if p.requires_grad], lr=1e-4)
    payload = {"draft_state_dict": _draft_state(old), "global_step": 10, "epoch": 0, "epoch_batch": 10,
               "epoch_samples": 40, "strategy": "eagle3", "run_id": "r1", "world_size": 1, "dataset_size": 40,
               "batch_size": 1, "accumulation_steps": 1, "num_epochs": 1, "effective_total_steps": 40,
               "tp_size": 1, "sp_ulysses_size": 1, "sp_ring_size": 1, "replicated_optimizer_state": opt.state_dict()}
    out = tmp_path / "sf_out"
    step = Path(CheckpointManager(str(out), "r1").save(payload, 10, rank_state={"optimizer": None, "rng": {}}))
    with pytest.raises(FileNotFoundError, match=r"has no draft config beside it.*copy that file to .*r1-step10/"
                                                r"config.json"):
        load_init(out, tiny_shape(), keep_vocab=True)
    (out / "config.json").write_text(json.dumps(_specforge_config(tiny_shape())))
    for given in (out, step, step / "training_state.pt"):           # the output_dir (its -latest link), the step
        assert init_source(given).weights == step / "training_state.pt"
        fresh = _fresh_target_embedding(old)
        warm, _ = warm_draft(load_init(given, tiny_shape(), keep_vocab=True), fresh)
        _same_weights_but_embedding(warm, old, fresh)
    d2t, t2d = init_vocab_map(out)
    assert torch.equal(d2t, old.d2t) and torch.equal(t2d, old.t2d)
    from eagle3_core.config import preset
    cfg = preset("debug_tiny", run_dir=tmp_path / "run")
    cfg.train.init_from = str(out)
    assert init_key(cfg) == {"dir": str(step), "sha256": __import__("hashlib").sha256(
        (step / "training_state.pt").read_bytes()).hexdigest()}
    # a payload that needs arbitrary unpickling is refused by the safe loader, never executed
    torch.save({**payload, "args": argparse.Namespace(lr=1e-4)}, step / "training_state.pt")
    with pytest.raises(ValueError, match=r"not readable with torch.load\(weights_only=True\).*specforge.export"):
        load_init(step, tiny_shape(), keep_vocab=True)
    torch.save({**payload, "strategy": "dflash"}, step / "training_state.pt")
    with pytest.raises(ValueError, match="- train.init_from: .*a SpecForge 'dflash' checkpoint, not an EAGLE-3"):
        load_init(step, tiny_shape(), keep_vocab=True)


def test_draft_positions_that_differ_fit_under_plain_rope_only(tmp_path):
    """SpecForge's Kimi-K2.5 draft config has 131072 positions, the run's draft 262144 (the target's context):
    under plain RoPE no weight depends on them and the warm start loads (llama3's scaling reads its own
    original_max_position_embeddings: the same); a rope scaling that reads them (yarn here) refuses."""
    import json

    from eagle3_core.training.warm_start import init_problems
    export_draft(tiny_draft(5, max_position_embeddings=128), tmp_path / "d", dtype=torch.float32,
                 sglang_rule=PLUS_ONE)
    assert init_problems(tmp_path / "d", tiny_shape(max_position_embeddings=256), keep_vocab=True) == []
    assert load_init(tmp_path / "d", tiny_shape(max_position_embeddings=256), keep_vocab=True).shape \
        .max_position_embeddings == 128
    llama3 = {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    export_draft(tiny_draft(5, max_position_embeddings=128, rope_scaling=llama3), tmp_path / "l",
                 dtype=torch.float32, sglang_rule=PLUS_ONE)
    assert init_problems(tmp_path / "l", tiny_shape(max_position_embeddings=256, rope_scaling=llama3),
                         keep_vocab=True) == []
    yarn = {"rope_type": "yarn", "factor": 2.0}
    shutil.copytree(tmp_path / "d", tmp_path / "y")
    (tmp_path / "y" / "config.json").write_text(json.dumps(_specforge_config(
        tiny_shape(max_position_embeddings=128), rope_parameters={"rope_theta": 10000.0, **yarn})))
    problems = init_problems(tmp_path / "y", tiny_shape(max_position_embeddings=256, rope_scaling=yarn),
                             keep_vocab=True)
    assert [f for f, _ in problems] == ["draft.max_position_embeddings"]
    assert "set draft.max_position_embeddings to 128" in problems[0][1]


@pytest.mark.slow
def test_specforge_s_own_exporter_output_warm_starts(tmp_path):
    """SpecForge 0.2's exporter (specforge.export.to_sglang, installed --no-deps) on a checkpoint its
    CheckpointManager wrote: the SGLang directory it writes (no embed_tokens, its config as transformers 5 saves it)
    warm-starts to the checkpoint's weights."""
    import json

    from specforge.export.to_sglang import export_to_sglang
    from specforge.training.checkpoint import CheckpointManager
    old = tiny_draft(6)
    config = tmp_path / "draft_config.json"
    config.write_text(json.dumps({k: v for k, v in _specforge_config(tiny_shape()).items() if k != "dtype"}))
    step = CheckpointManager(str(tmp_path / "out"), "r1").save(
        {"draft_state_dict": _draft_state(old), "strategy": "eagle3", "global_step": 1}, 1)
    out = export_to_sglang(step, str(config), str(tmp_path / "sglang"))
    fresh = _fresh_target_embedding(old)
    warm, _ = warm_draft(load_init(out, tiny_shape(), keep_vocab=True), fresh)
    _same_weights_but_embedding(warm, old, fresh)
