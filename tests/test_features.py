"""Aux capture against HF's output_hidden_states, the shard store's resume (C8) and corruption check."""
import pytest
import torch

from eagle3_core.features import extract_batch, extract_features, load_samples


def _rows(tokenizer, n):
    from eagle3_core.data import tokenize_conversation
    rows = []
    for i in range(n):
        seq = tokenize_conversation(tokenizer, [{"role": "user", "content": f"Count to {i + 2}."}],
                                    " ".join(str(j) for j in range(1, i + 3)), f"r{i}")
        rows.append({"id": f"r{i}", **seq})
    return rows


def test_aux_layers_are_decoder_layer_outputs(target_model, tokenizer):
    """Layer id i means the output of decoder layer i = HF output_hidden_states[i + 1] (REFERENCE.md 1)."""
    ids = [1, 14, 26]
    seqs = [r["input_ids"] for r in _rows(tokenizer, 2)]
    feats = extract_batch(target_model, ids, seqs)
    with torch.no_grad():
        ref = target_model(torch.tensor([seqs[1]]), output_hidden_states=True)
    hs = ref.hidden_states
    expected = torch.cat([hs[i + 1][0] for i in ids], dim=-1)
    assert feats[1]["aux"].shape == (len(seqs[1]), 3 * 576)
    assert torch.allclose(feats[1]["aux"], expected, atol=1e-4)
    # the last entry of output_hidden_states is normed: that is what 'final' holds, and top1 is its argmax
    assert torch.allclose(feats[1]["final"], hs[-1][0], atol=1e-4)
    assert torch.equal(feats[1]["target_top1"].long(), ref.logits[0].argmax(-1))
    # right padding in a batch does not change a shorter sample's features
    alone = extract_batch(target_model, ids, [seqs[0]])[0]
    assert torch.allclose(alone["aux"], feats[0]["aux"], atol=1e-4)


def test_rerun_with_everything_done_does_nothing_and_says_so(target_model, tokenizer, tmp_path):
    """C8: run extraction twice on 8 rows; the second run extracts nothing and says so."""
    rows = _rows(tokenizer, 8)
    first = extract_features(target_model, rows, tmp_path, [1, 14, 26], shard_samples=4, batch_tokens=512)
    assert first["shards_extracted"] == 2 and first["samples"] == 8
    said = []
    second = extract_features(target_model, rows, tmp_path, [1, 14, 26], shard_samples=4, batch_tokens=512,
                              log=said.append)
    assert second["shards_extracted"] == 0
    assert any("nothing to extract" in s for s in said)
    samples = load_samples(tmp_path)
    assert [s["id"] for s in samples] == [r["id"] for r in rows]
    assert samples[3]["input_ids"].tolist() == rows[3]["input_ids"]
    assert samples[3]["aux"].shape == (len(rows[3]["input_ids"]), 1728)
    # a corrupted shard is detected on read and re-extracted on the next run
    shard = tmp_path / "shard_00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="shard_00001.*corrupt"):
        load_samples(tmp_path)
    third = extract_features(target_model, rows, tmp_path, [1, 14, 26], shard_samples=4, batch_tokens=512)
    assert third["shards_extracted"] == 1
    assert len(load_samples(tmp_path)) == 8


def test_shards_of_other_samples_or_layers_are_not_reused(target_model, tokenizer, tmp_path):
    rows = _rows(tokenizer, 4)
    extract_features(target_model, rows, tmp_path, [1, 14, 26], shard_samples=4, batch_tokens=512)
    other = extract_features(target_model, rows, tmp_path, [2, 14, 26], shard_samples=4, batch_tokens=512)
    assert other["shards_extracted"] == 1                                   # other layers: recomputed
    changed = [dict(r) for r in rows]
    changed[0]["input_ids"] = changed[0]["input_ids"][:-1]
    changed[0]["loss_mask"] = changed[0]["loss_mask"][:-1]
    again = extract_features(target_model, changed, tmp_path, [2, 14, 26], shard_samples=4, batch_tokens=512)
    assert again["shards_extracted"] == 1                                   # other tokens: recomputed
    assert load_samples(tmp_path)[0]["input_ids"].tolist() == changed[0]["input_ids"]
