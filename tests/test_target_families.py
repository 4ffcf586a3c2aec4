"""Extraction and one training step on tiny random-weight targets of three families (Llama, Qwen3, DeepSeek-V3-style
MoE), aux ids and draft shapes from each config."""
import pytest
import torch

from eagle3_core.config import TargetConfig, TrainConfig
from eagle3_core.draft_model import DraftShape
from eagle3_core.extract import HFExtractor
from eagle3_core.features import extract_features, load_head, load_samples
from eagle3_core.target import load_target
from eagle3_core.trainer import build_draft, train
from eagle3_core.vocab_map import build_vocab_map, count_tokens


def _rows(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"id": f"s{i}", "input_ids": torch.randint(0, 128, (10 + 2 * i,), generator=g).tolist(),
             "loss_mask": [0] * 5 + [1] * (5 + 2 * i)} for i in range(n)]


@pytest.mark.parametrize("family", ["llama", "qwen3", "deepseek_v3"])
def test_extract_and_train_one_step(family, tiny_target_dirs, tmp_path):
    model = load_target(TargetConfig(model=str(tiny_target_dirs[family])))
    ex = HFExtractor(model)
    assert ex.aux_layer_ids == [1, 3, 4]                                    # defaults of an 8-layer config
    rows = _rows()
    # exact capture on this family too: aux = output_hidden_states[i + 1], same batch
    seqs = [r["input_ids"] for r in rows[:3]]
    out = ex.forward(seqs)
    ids = torch.zeros(3, max(map(len, seqs)), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.tensor(s)
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    assert torch.equal(out["aux"], torch.cat([hs[i + 1] for i in [1, 3, 4]], dim=-1))
    assert torch.equal(out["final"], hs[-1])

    manifest = extract_features(model, rows, tmp_path / "features", None, shard_samples=4, batch_tokens=64)
    assert manifest["complete"] and manifest["aux_layer_ids"] == [1, 3, 4] and manifest["hidden_size"] == 32
    samples = load_samples(tmp_path / "features")
    assert samples[2]["aux"].shape == (14, 96) and samples[2]["final"].shape == (14, 32)

    shape = DraftShape.from_target_config(model.config, 64, manifest["aux_layer_ids"])
    assert (shape.target_hidden_size, shape.vocab_size, shape.draft_vocab_size) == (32, 128, 64)
    counts = count_tokens([s["input_ids"] for s in samples], [s["loss_mask"] for s in samples], 128)
    d2t, t2d = build_vocab_map(counts, 64)
    emb, lm = load_head(tmp_path / "features")
    draft = build_draft(shape, emb, d2t, t2d, seed=0)
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    cfg = TrainConfig(epochs=1, lr=1e-3, batch_tokens=4096, ttt_length=2, eval_frac=0.0, warmup_frac=0.0)
    summary = train(draft, samples, [], lm, cfg, tmp_path / "draft", log=lambda s: None)
    assert summary["steps"] == 1                                             # all samples in one batch
    loss = summary["history"][0]["train"]["loss"]
    assert all(torch.isfinite(torch.tensor(loss))) and loss[0] > 0
    assert not torch.equal(draft.fc.weight, before["fc.weight"])             # the step changed the weights
    assert torch.equal(draft.embed_tokens.weight, before["embed_tokens.weight"])   # frozen target embedding
