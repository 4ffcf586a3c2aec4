"""Aux capture against HF's output_hidden_states, the shard store (resume, checksums, SIGKILL during a write) and
the storage formats (bf16, fp8, online) read through one interface."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import written_bytes
from eagle3_core.contract.manifest import sha256_file
from eagle3_core.features.extract import HFExtractor
from eagle3_core.features.store import extract_features
from eagle3_core.features.reader import load_samples


def _rows(tokenizer, n):
    from eagle3_core.data.history import tokenize_conversation
    rows = []
    for i in range(n):
        seq = tokenize_conversation(tokenizer, [{"role": "user", "content": f"Count to {i + 2}."}],
                                    " ".join(str(j) for j in range(1, i + 3)), f"r{i}")
        rows.append({"id": f"r{i}", **seq})
    return rows


def _padded(seqs):
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.tensor(s)
    return ids


def test_aux_layers_are_decoder_layer_outputs_exactly(target_model, tokenizer):
    """Layer id i means the output of decoder layer i = HF output_hidden_states[i + 1] (SGLang `models/llama.py`): equal
    bit for bit in fp32 on the CPU for the same batch; the default ids of the 30-layer target are [1, 14, 26]."""
    ex = HFExtractor(target_model)
    assert ex.aux_layer_ids == [1, 14, 26]
    seqs = [r["input_ids"] for r in _rows(tokenizer, 3)]
    out = ex.forward(seqs)
    with torch.no_grad():
        ref = target_model(_padded(seqs), output_hidden_states=True)
    hs = ref.hidden_states
    for b, s in enumerate(seqs):
        n = len(s)
        expected = torch.cat([hs[i + 1][b, :n] for i in [1, 14, 26]], dim=-1)
        assert out["aux"][b, :n].shape == (n, 3 * 576)
        assert torch.equal(out["aux"][b, :n], expected)
        # the last entry of output_hidden_states is normed: that is what 'final' holds, and top1 is its argmax
        assert torch.equal(out["final"][b, :n], hs[-1][b, :n])
        assert torch.equal(out["target_top1"][b, :n].long(), ref.logits[b, :n].argmax(-1))
    # aux differs from the neighbouring layers (an off-by-one would pass a loose check on a smooth model)
    assert not torch.allclose(out["aux"][0, :, :576], hs[1][0, :out["aux"].shape[1]], atol=1e-3)
    # right padding in a batch does not change a shorter sample's features, up to fp32 rounding of other matmul
    # shapes: measured 1.5e-4 relative (3.9e-3 absolute on the first position's large values, layers 14 and 26;
    # transformers 5.24, torch 2.13 CPU), so a relative tolerance of 1e-3
    alone = HFExtractor(target_model, [1, 14, 26])([seqs[0]])[0]
    assert torch.allclose(alone["aux"], out["aux"][0, :len(seqs[0])], rtol=1e-3, atol=1e-4)


def test_rerun_resumes_and_corrupt_or_missing_shards_are_extracted_again(target_model, tokenizer, tmp_path):
    """C8: a second run extracts nothing and says so; a shard corrupted on disk is detected by its sha256 (on read
    and on the next run) and only it is extracted again; a deleted shard likewise."""
    rows = _rows(tokenizer, 8)
    first = extract_features(target_model, rows, tmp_path, [1, 14, 26], shard_samples=4, batch_tokens=512)
    assert first["shards_extracted"] == 2 and first["samples"] == 8 and first["complete"]
    for s in first["shards"]:
        assert s["sha256"] == sha256_file(tmp_path / s["file"]) and s["tokens"] > 0 and len(s["ids"]) == 4
    assert first["bytes_per_token"] == first["bytes"] / first["tokens"]
    said = []
    second = extract_features(target_model, rows, tmp_path, [1, 14, 26], shard_samples=4, batch_tokens=512,
                              log=said.append)
    assert second["shards_extracted"] == 0
    assert any("nothing to extract" in s for s in said)
    samples = load_samples(tmp_path)
    assert [s["id"] for s in samples] == [r["id"] for r in rows]
    assert samples[3]["input_ids"].tolist() == rows[3]["input_ids"]
    assert samples[3]["aux"].shape == (len(rows[3]["input_ids"]), 1728)
    good = samples[5]["aux"].clone()
    shard = tmp_path / "shard_00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="shard_00001.*corrupt"):
        load_samples(tmp_path)
    said.clear()
    third = extract_features(target_model, rows, tmp_path, [1, 14, 26], shard_samples=4, batch_tokens=512,
                             log=said.append)
    assert third["shards_extracted"] == 1 and any("shard_00001" in s for s in said)
    assert torch.equal(load_samples(tmp_path)[5]["aux"], good)
    (tmp_path / "shard_00000.safetensors").unlink()
    fourth = extract_features(target_model, rows, tmp_path, [1, 14, 26], shard_samples=4, batch_tokens=512)
    assert fourth["shards_extracted"] == 1 and len(load_samples(tmp_path)) == 8


def test_only_shards_extracts_just_those_and_matches_a_full_run(target_model, tokenizer, tmp_path):
    """only_shards (the per-shard Prefect tasks' entry point): each call extracts just its plan indices, keeps the
    other shards' finished files and entries, raises nothing while the store is incomplete, and shard by shard
    ends with the same manifest entries (bytes, sha256, content keys) as one full extraction."""
    rows = _rows(tokenizer, 6)
    full = extract_features(target_model, rows, tmp_path / "full", [1, 14, 26], shard_samples=2, batch_tokens=512)
    out = tmp_path / "by_shard"
    first = extract_features(target_model, rows, out, [1, 14, 26], shard_samples=2, batch_tokens=512,
                             only_shards={2})
    assert [s["file"] for s in first["shards"]] == ["shard_00002.safetensors"] and not first["complete"]
    assert first["shards_extracted"] == 1 and not (out / "shard_00000.safetensors").exists()
    mtime = (out / "shard_00002.safetensors").stat().st_mtime_ns
    second = extract_features(target_model, rows, out, [1, 14, 26], shard_samples=2, batch_tokens=512,
                              only_shards={0})
    assert [s["file"] for s in second["shards"]] == ["shard_00000.safetensors", "shard_00002.safetensors"]
    assert (out / "shard_00002.safetensors").stat().st_mtime_ns == mtime                # left alone
    last = extract_features(target_model, rows, out, [1, 14, 26], shard_samples=2, batch_tokens=512,
                            only_shards={1})
    assert last["complete"] and written_bytes(last["shards"]) == written_bytes(full["shards"])
    again = extract_features(target_model, rows, out, [1, 14, 26], shard_samples=2, batch_tokens=512,
                             only_shards={1})
    assert again["shards_extracted"] == 0
    with pytest.raises(ValueError, match=r"shard indices \[3\] are out of range"):
        extract_features(target_model, rows, out, [1, 14, 26], shard_samples=2, batch_tokens=512, only_shards={3})
    assert [s["id"] for s in load_samples(out)] == [r["id"] for r in rows]


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


def test_formats_bytes_and_values(target_model, target_cfg, tokenizer, tmp_path):
    """fp32 (exact), bf16, fp8 and online stores of the same rows, read through load_samples: values against the
    exact features, bytes per token, online features equal to stored ones for the same (single-sample) batches,
    and keep_dtype reads equal to the widened ones."""
    rows = _rows(tokenizer, 4)
    kw = dict(shard_samples=2, batch_tokens=64)          # budget below every length: one sample per forward
    stores = {}
    for fmt in ("fp32", "bf16", "fp8", "online"):
        m = extract_features(target_model, rows, tmp_path / fmt, None, store_format=fmt,
                             target=target_cfg.model_dump(), **kw)
        assert m["format"] == fmt and m["aux_layer_ids"] == [1, 14, 26]
        stores[fmt] = (m, load_samples(tmp_path / fmt, target_model=target_model))
    bpt = {f: m["bytes_per_token"] for f, (m, _) in stores.items()}
    H = 576
    assert bpt["fp32"] > 16 * H and bpt["bf16"] > 8 * H and bpt["fp8"] > 4 * H
    assert bpt["bf16"] < 8 * H + 60 and bpt["fp8"] < 4 * H + 70 and bpt["online"] < 60
    assert bpt["fp8"] / bpt["bf16"] < 0.51
    exact = stores["fp32"][1]
    for fmt, rel_tol in (("bf16", 2 ** -8), ("fp8", 2 ** -4)):
        for s, e in zip(stores[fmt][1], exact):
            assert s["id"] == e["id"] and torch.equal(s["target_top1"], e["target_top1"])
            for k in ("aux", "final"):
                err = (s[k] - e[k]).abs()
                # per row, the error is within the format's relative step of that row's largest value
                assert (err.amax(-1) <= rel_tol * e[k].abs().amax(-1) + 1e-6).all(), (fmt, k)
            assert not torch.equal(s["aux"], e["aux"])                    # it did quantize
    for s, e in zip(stores["online"][1], exact):
        for k in ("aux", "final", "target_top1"):
            assert torch.equal(s[k], e[k]), k
    # keep_dtype (the trainer's reads): a bf16 store's features as stored, the same values as the widened ones;
    # other formats unchanged (fp8 is scaled: fp32)
    for fmt, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32), ("fp8", torch.float32)):
        for s, w in zip(load_samples(tmp_path / fmt, keep_dtype=True), stores[fmt][1]):
            for k in ("aux", "final"):
                assert s[k].dtype == dt and torch.equal(s[k].float(), w[k]), (fmt, k)
    assert dict(stores["online"][1][0]).keys() == {"id", "input_ids", "loss_mask", "aux", "final", "target_top1"}


KILL_SCRIPT = r"""
import sys, time, torch
from pathlib import Path
from transformers import AutoModelForCausalLM
from eagle3_core.features.store import extract_features
from fault_site.fault_injection import pause_mid_write
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
out = Path(sys.argv[2])
g = torch.Generator().manual_seed(0)
rows = [{"id": f"s{i}", "input_ids": torch.randint(0, 128, (12 + i,), generator=g).tolist(),
         "loss_mask": [0] * 6 + [1] * (6 + i)} for i in range(6)]

def pause(path):
    # signal the test, then hang half-way through writing the second shard until the test SIGKILLs this process
    (out / "KILL_ME").write_text("now")
    time.sleep(120)

if sys.argv[3] != "clean":
    pause_mid_write("shard_00001.safetensors", pause)          # test-only fault injection (tests/fault_site)
m = extract_features(model, rows, out, [1, 3, 4], shard_samples=2, batch_tokens=64, writer_threads=1)
print(m["shards_extracted"])
"""


@pytest.mark.slow
def test_sigkill_during_a_shard_write_leaves_no_bad_shard_in_the_manifest(tmp_path, tiny_target_dirs, spawned):
    tiny_llama_dir = tiny_target_dirs["llama"]
    out = tmp_path / "store"
    script = tmp_path / "extract.py"
    script.write_text(KILL_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), str(Path(__file__).resolve().parent)])}
    proc = spawned(subprocess.Popen([sys.executable, str(script), str(tiny_llama_dir), str(out), "kill"], env=env))
    deadline = time.monotonic() + 120
    while not (out / "KILL_ME").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "extraction subprocess ended early"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["file"] for s in manifest["shards"]] == ["shard_00000.safetensors"] and not manifest["complete"]
    for s in manifest["shards"]:
        assert sha256_file(out / s["file"]) == s["sha256"]
    assert list(out.glob(".shard_00001.safetensors.tmp*"))                 # the half-written file, never listed
    assert not (out / "shard_00001.safetensors").exists()
    with pytest.raises(ValueError, match="incomplete"):
        load_samples(out)
    done = subprocess.run([sys.executable, str(script), str(tiny_llama_dir), str(out), "clean"], env=env,
                          capture_output=True, text=True, check=True)
    assert done.stdout.split()[-1] == "2"                                  # shards 1 and 2; shard 0 kept
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["shards"]) == 3
    assert not list(out.glob(".shard_*"))
    assert [s["id"] for s in load_samples(out)] == [f"s{i}" for i in range(6)]


def test_zero_copy_shard_writer_matches_safetensors_save(tmp_path):
    """write_shard_parts (hand-built header, pieces written as they are) gives a file safetensors reads back to
    the concatenated tensors and metadata, with the sha256 and size it reports; so does the former writer
    (safetensors.torch.save of the concatenated tensors, tests/reference_paths.py)."""
    from safetensors import safe_open

    from eagle3_core.features.shard_writer import write_shard_parts
    from reference_paths import write_shard_concat
    g = torch.Generator().manual_seed(0)
    lengths = (5, 1, 7)
    parts = {"aux": [torch.randn(n, 12, generator=g).bfloat16() for n in lengths],
             "aux_scale": [torch.rand(n, 3, generator=g).to(torch.float8_e4m3fn) for n in lengths],
             "target_top1": [torch.randint(0, 99, (n,), generator=g, dtype=torch.int32) for n in lengths],
             "loss_mask": [torch.tensor([1, 0, 1] * 4 + [0], dtype=torch.int8)],
             "offsets": [torch.tensor([0, 5, 6, 13])]}
    meta = {"ids": json.dumps(["a", "b", "c"])}
    whole = {k: torch.cat(v) for k, v in parts.items()}
    for name, write in (("new", lambda p: write_shard_parts(p, parts, meta)),
                        ("old", lambda p: write_shard_concat(p, parts, meta))):
        path = tmp_path / f"{name}.safetensors"
        sha, n = write(path)
        assert sha == sha256_file(path) and n == path.stat().st_size, name
        with safe_open(str(path), "pt") as f:
            assert f.metadata() == meta
            assert sorted(f.keys()) == sorted(whole)
            for k, t in whole.items():
                got = f.get_tensor(k)
                assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8)), (name, k)
        assert not list(tmp_path.glob(".*.tmp*"))


def _greedy_rows(target_model, tokenizer, n: int, new: int) -> list[dict]:
    """n GSM8K questions (tests/data) answered by the embedded target's own greedy decoding, `new` tokens at most:
    rows {id, input_ids, loss_mask} with the answer supervised."""
    from conftest import SHARED_DATA
    from eagle3_core.data.chat import prompt_ids
    from eagle3_core.evaluation.speculate import TargetRunner, greedy_generate
    runner, rows = TargetRunner(target_model, [0]), []
    lines = (SHARED_DATA / "gsm8k" / "train.jsonl").read_text().splitlines()[:n]
    for i, line in enumerate(lines):
        prompt = prompt_ids(tokenizer, [{"role": "user", "content": json.loads(line)["question"]}])
        answer = greedy_generate(runner, prompt, new, {tokenizer.eos_token_id})["tokens"]
        rows.append({"id": f"g{i}", "input_ids": prompt + answer, "loss_mask": [0] * len(prompt) + [1] * len(answer)})
    return rows


def _teacher_probs(samples, head: torch.Tensor) -> torch.Tensor:
    """The loss's teacher (ttt.teacher_of, draft vocab = the whole target vocab) at every position whose next
    token is supervised (the answer's), as probabilities [P, V] fp64."""
    from eagle3_core.training.ttt import teacher_of

    class Identity:                                       # d2t zeros: draft id i is target id i
        t2d = torch.ones(head.shape[0], dtype=torch.bool)
        d2t = torch.zeros(head.shape[0], dtype=torch.long)

        def draft_to_target(self, ids):
            return ids + self.d2t[ids]
    out = []
    for s in samples:
        batch = {k: s[k][None] for k in ("final", "teacher_logits", "teacher_ids", "tail_shift") if k in s}
        z, lse = teacher_of(batch, head, 0, Identity())
        read = torch.zeros(len(s["input_ids"]), dtype=torch.bool)
        read[:-1] = s["loss_mask"][1:]
        out.append((z[0, :len(read)][read].double() - lse[0, :len(read)][read, None].double()).exp())
    return torch.cat(out)


@pytest.mark.slow                 # ~60 s on 2 idle cores: 384 greedy tokens, 4 stores, [384, 49152] teachers
def test_the_fp8_topk_teacher_agrees_with_the_exact_target_at_least_as_well_as_bf16(target_model, target_cfg,
                                                                                     tokenizer, tmp_path):
    """On the embedded target's own greedy answers (GSM8K questions), the teacher the loss reads from each store
    against the exact one (the fp32 store: the target's own CPU forward): the share of answer positions whose
    argmax differs and the mean total variation. fp8 rounds the final state before lm_head and moves the teacher
    (issue 61: 0.9-2.5% argmax, 1.5-2.6% TV); fp8_topk adds the exact top-32 logits and the tail's exact mass and
    must do at least as well as bf16 on both, for 8 x 32 + 4 bytes a token more than fp8."""
    from eagle3_core.features import store_formats as ff
    from eagle3_core.features.reader import load_head
    rows = _greedy_rows(target_model, tokenizer, n=6, new=64)
    probs, bpt = {}, {}
    for fmt in ("fp32", "bf16", "fp8", "fp8_topk"):
        m = extract_features(target_model, rows, tmp_path / fmt, None, store_format=fmt, shard_samples=3,
                             batch_tokens=4096)
        bpt[fmt] = m["bytes_per_token"]
        probs[fmt] = _teacher_probs(load_samples(tmp_path / fmt), load_head(tmp_path / fmt)[1])
    exact = probs.pop("fp32")
    stats = {f: ((p.argmax(-1) != exact.argmax(-1)).double().mean().item(),
                 (0.5 * (p - exact).abs().sum(-1)).mean().item()) for f, p in probs.items()}
    print({f: f"argmax differs {a:.4%}, TV {tv:.4%}, {bpt[f]:.0f} B/token" for f, (a, tv) in stats.items()},
          f"{len(exact)} answer positions")
    assert len(exact) > 200
    assert stats["fp8_topk"][0] <= stats["bf16"][0] and stats["fp8_topk"][1] <= stats["bf16"][1], stats
    assert stats["fp8"][1] > stats["bf16"][1], stats             # what fp8_topk is for
    H = 576
    assert ff.TEACHER_TOPK == 32 and bpt["fp8_topk"] - bpt["fp8"] == pytest.approx(8 * 32 + 4, abs=2)
    assert bpt["fp8_topk"] == pytest.approx(ff.bytes_per_token("fp8_topk", 576), abs=10)
