"""The training loop on a tiny draft: loss goes down, a SIGKILLed run resumes to the same bits, NaN stops cleanly,
checkpoints are pruned to the newest K."""
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_draft
from eagle3_core.training.checkpoint import load_latest_training_state
from eagle3_core.training.trainer import train
from train_worker import CFG, samples

WORKER = Path(__file__).with_name("train_worker.py")


def _run_worker(out_dir: Path, pause_at_step: int | None = None) -> str:
    """Run tests/train_worker.py; with pause_at_step, SIGKILL it once it has written that step's checkpoint.
    Returns its output."""
    args = [sys.executable, str(WORKER), str(out_dir)] + ([str(pause_at_step)] if pause_at_step else [])
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.strip() == "PAUSED":
                os.kill(proc.pid, signal.SIGKILL)
                break
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines)
    if pause_at_step:
        assert rc == -signal.SIGKILL, out
    else:
        assert rc == 0, out
    return out


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_equals_uninterrupted_run_bit_for_bit(tmp_path):
    """Acceptance: a real process killed with SIGKILL mid-epoch (after step 4's checkpoint: epoch 2, batch 1 of
    3; epochs count from 1 in logs) and restarted ends with the same weights and optimizer state, bit for bit, as a run never interrupted."""
    _run_worker(tmp_path / "full")
    killed = _run_worker(tmp_path / "killed", pause_at_step=4)
    assert "train: checkpoint step 4 (epoch 2, batch 1)" in killed and "epoch 2 of" not in killed
    state, path = load_latest_training_state(tmp_path / "killed", log=lambda s: None)
    assert path.name == "step_000000004.pt" and (state["epoch"], state["batch"]) == (1, 1)
    resumed = _run_worker(tmp_path / "killed")
    assert "resumed from step_000000004.pt (epoch 2, batch 1, step 4)" in resumed
    a, _ = load_latest_training_state(tmp_path / "full", log=lambda s: None)
    b, _ = load_latest_training_state(tmp_path / "killed", log=lambda s: None)
    assert a["step"] == b["step"] == 9
    for name, t in a["model"].items():
        assert torch.equal(t, b["model"][name]), name
    for pid, st in a["optimizer"]["state"].items():
        for key, t in st.items():
            assert torch.equal(t, b["optimizer"]["state"][pid][key]), (pid, key)
    for ha, hb in zip(json.loads(a["history"]), json.loads(b["history"]), strict=True):   # all but wall time
        assert ha["train"] == hb["train"] and ha["eval"] == hb["eval"] and ha["tokens"] == hb["tokens"]
    for d in ("last", "best"):
        fa, fb = load_file(tmp_path / "full" / d / "model.safetensors"), load_file(tmp_path / "killed" / d /
                                                                                   "model.safetensors")
        assert all(torch.equal(fa[k], fb[k]) for k in fa), d
    # keep_checkpoints = 2: only the newest two remain
    assert sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir()) == [
        "step_000000008.pt", "step_000000009.pt"]


def test_loss_goes_down_and_best_is_chosen_by_eval_tau(tmp_path):
    lm_head = torch.randn(100, 32, generator=torch.Generator().manual_seed(5))
    data = samples()
    cfg = CFG.model_copy(update={"checkpoint_every": 100})
    summary = train(tiny_draft(), data, samples(4, seed=1), lm_head, cfg, tmp_path, log=lambda s: None)
    h = summary["history"]
    assert sum(h[-1]["train"]["loss"]) < sum(h[0]["train"]["loss"])
    taus = [r["eval"]["tau_sim"] for r in h]
    assert summary["best"] == {"tau_sim": max(taus), "epoch": taus.index(max(taus)) + 1}     # counted from 1
    assert [r["epoch"] for r in h] == list(range(1, cfg.epochs + 1))
    assert len(h[0]["train"]["acc"]) == cfg.ttt_length and len(h[0]["eval"]["cond_acc"]) == cfg.ttt_length


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    """Two micro-batches of 4 accumulated equal one batch of 8 when every sample has the same supervised count
    (each micro-batch loss is a mean over its positions)."""
    lm_head = torch.randn(100, 32, generator=torch.Generator().manual_seed(5))
    data = samples(8)
    base = {"epochs": 1, "lr": 1e-3, "ttt_length": 2, "warmup_frac": 0.0, "device": "cpu", "grad_clip": 1e9}
    one, two = tiny_draft().double(), tiny_draft().double()
    for s in data:
        s["aux"], s["final"] = s["aux"].double(), s["final"].double()
    train(one, data, [], lm_head.double(), CFG.model_copy(update={**base, "batch_tokens": 160}), tmp_path / "1",
          log=lambda s: None)
    train(two, data, [], lm_head.double(), CFG.model_copy(update={**base, "batch_tokens": 80, "grad_accum": 2}),
          tmp_path / "2", log=lambda s: None)
    for (name, p), q in zip(one.state_dict().items(), two.state_dict().values()):
        assert torch.allclose(p, q, atol=1e-12), name


def test_non_finite_loss_names_the_step_and_saves_nothing_corrupt(tmp_path):
    data = samples()
    data[3]["aux"][0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"epoch 1, step \d+, batch \d+ \(samples .*s3") as err:
        train(tiny_draft(), data, [], torch.randn(100, 32), CFG, tmp_path, log=lambda s: None)
    failed_step = int(re.search(r"step (\d+)", str(err.value)).group(1))
    assert not (tmp_path / "last").exists()
    for path in (tmp_path / "checkpoints").glob("*"):        # only checkpoints of the steps before, all finite
        state = torch.load(path, weights_only=True)
        assert path.name.startswith("step_") and state["step"] <= failed_step
        assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())


def test_checkpoint_for_other_data_is_refused(tmp_path):
    lm_head = torch.randn(100, 32)
    train(tiny_draft(), samples(), [], lm_head, CFG.model_copy(update={"epochs": 1}), tmp_path, log=lambda s: None)
    with pytest.raises(ValueError, match=r"written with the train samples \(ids and lengths"):
        train(tiny_draft(), samples(8), [], lm_head, CFG, tmp_path, log=lambda s: None)


def test_a_resume_under_another_resolved_batching_is_refused_naming_it(tmp_path):
    """The checkpoint's resume key (checkpoint.resume_key) holds the batching as it resolved: 'auto' on the CPU
    is padded batches, so a resume with packed rows (other batches from the same position) is refused naming
    train.batching and both values, and so is another W*G; a setting outside the resume key (keep_checkpoints)
    resumes."""
    lm_head = torch.randn(100, 32)
    auto = CFG.model_copy(update={"batching": "auto"})                  # device 'cpu': padded
    train(tiny_draft(), samples(), [], lm_head, auto, tmp_path, log=lambda s: None, stop_after_steps=2)
    with pytest.raises(ValueError, match=r"train\.batching \(resolved.*\) = 'padded', this run has 'packed'"):
        train(tiny_draft(), samples(), [], lm_head, CFG.model_copy(update={"batching": "packed"}), tmp_path,
              log=lambda s: None)
    with pytest.raises(ValueError, match=r"train\.grad_accum x the world size = 1, this run has 2"):
        train(tiny_draft(), samples(), [], lm_head, auto.model_copy(update={"grad_accum": 2}), tmp_path,
              log=lambda s: None)
    lines = []
    train(tiny_draft(), samples(), [], lm_head, auto.model_copy(update={"keep_checkpoints": 5}), tmp_path,
          log=lines.append, stop_after_steps=1)
    assert any("resumed from step_000000002.pt" in x for x in lines), lines


def test_a_checkpoint_written_before_resume_keys_resumes_by_its_fingerprint(tmp_path):
    """Checkpoints of earlier versions hold the `data` fingerprint (compat.checkpoint_fingerprint_v4) instead of
    a resume key: the same data and batches resume, other data is refused."""
    from eagle3_core.contract.compat import checkpoint_fingerprint_v4
    lm_head = torch.randn(100, 32)
    train(tiny_draft(), samples(), [], lm_head, CFG, tmp_path, log=lambda s: None, stop_after_steps=2)
    path = tmp_path / "checkpoints" / "step_000000002.pt"
    state = torch.load(path, weights_only=True)
    del state["resume"]
    state["data"] = checkpoint_fingerprint_v4(samples(), CFG, 1, False)
    torch.save(state, path)
    with pytest.raises(ValueError, match="step_000000002.pt was written for other training data or batching"):
        train(tiny_draft(), samples(8), [], lm_head, CFG, tmp_path, log=lambda s: None)
    lines = []
    train(tiny_draft(), samples(), [], lm_head, CFG, tmp_path, log=lines.append, stop_after_steps=1)
    assert any("resumed from step_000000002.pt" in x for x in lines), lines


def _functions_with_an_epoch_loop(path: Path) -> list[str]:
    """Names of the functions of `path` holding a loop over epochs (`for epoch ...`, `for ... in ...epochs...`)."""
    import ast
    found = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and any(
                isinstance(loop, ast.For) and ("epoch" in ast.unparse(loop.target) or "epochs" in
                                               ast.unparse(loop.iter)) for loop in ast.walk(fn)):
            found.append(fn.name)
    return found


def test_one_function_holds_the_epoch_loop_for_one_and_many_ranks():
    """Issue 19: one training loop for 1..N ranks. trainer.train is the only function in eagle3_core with an epoch
    loop (the data-parallel parts are in distributed/data_parallel.py, the torchrun entry calls the train stage), and
    nothing imports a private name of the training modules."""
    import ast
    root = Path(__file__).resolve().parents[1]
    pkg = root / "eagle3_core"
    loops = {f"{p.relative_to(pkg)}:{name}" for p in pkg.rglob("*.py") for name in _functions_with_an_epoch_loop(p)}
    assert loops == {"training/trainer.py:train"}, loops
    assert not (pkg / "distributed" / "ddp_trainer.py").exists()
    training = {"trainer", "data_parallel", "train_ddp"}
    for p in [*pkg.rglob("*.py"), *(root / "tests").glob("*.py"), *(root / "benchmarks").glob("*.py")]:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").rsplit(".", 1)[-1] in training:
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{p.relative_to(root)} imports private {private} from {node.module}"


def test_a_non_finite_loss_names_the_shard_file_whose_features_hold_nan(tiny_target_dirs, tmp_path):
    """A store written by the tiny Llama target (features.store), one sample's aux states made NaN in its shard (the
    record updated, as a writer that stored NaN would have left it): training stops naming that sample and its
    shard file, with advice to re-extract it (not the learning rate). Finite features (the draft's weights blown up
    instead): the advice is train.lr."""
    from safetensors.torch import save_file

    from eagle3_core.config import TargetConfig
    from eagle3_core.contract.manifest import file_stamp, sha256_file
    from eagle3_core.features.extract import HFExtractor
    from eagle3_core.features.reader import load_head, load_samples
    from eagle3_core.features.store import extract_features
    from eagle3_core.target.loading import load_target
    from eagle3_core.training.draft_model import Eagle3Draft
    from conftest import tiny_shape
    model = load_target(TargetConfig(model=str(tiny_target_dirs["llama"])))
    g = torch.Generator().manual_seed(0)
    rows = [{"id": f"r{i}", "input_ids": torch.randint(0, 128, (12,), generator=g).tolist(),
             "loss_mask": [0] * 4 + [1] * 8} for i in range(6)]
    store = tmp_path / "features"
    extract_features(HFExtractor(model, [1, 3, 4]), rows, store, [1, 3, 4], shard_samples=2, batch_tokens=64,
                     log=lambda *_: None)
    draft = Eagle3Draft(tiny_shape(vocab_size=128, aux_layer_ids=[1, 3, 4]))
    draft.init_weights(0)
    lm_head = load_head(store)[1]
    diverged = Eagle3Draft(draft.shape)
    diverged.load_state_dict(draft.state_dict())
    with torch.no_grad():
        diverged.fc.weight[0, 0] = float("inf")                         # what a runaway learning rate leaves
    with pytest.raises(FloatingPointError, match=r"the batch's features are finite \(.*features/shard_0000\d\."
                                                 r"safetensors.*\): the training diverged; lower train.lr \(now "):
        train(diverged, load_samples(store), [], lm_head, CFG, tmp_path / "a", log=lambda s: None)
    victim = store / "shard_00001.safetensors"
    tensors = load_file(str(victim))
    from safetensors import safe_open
    with safe_open(str(victim), "pt") as f:
        meta = f.metadata()
    key = next(k for k in tensors if k not in ("input_ids", "loss_mask", "offsets") and tensors[k].is_floating_point())
    tensors[key][0] = float("nan")                                         # the first sample of shard 1: r2
    save_file(tensors, str(victim), metadata=meta)
    manifest = json.loads((store / "manifest.json").read_text())
    entry = next(e for e in manifest["shards"] if e["file"] == victim.name)
    entry.update({"sha256": sha256_file(victim), **file_stamp(victim)})
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FloatingPointError) as err:
        train(draft, load_samples(store), [], lm_head, CFG, tmp_path / "b", log=lambda s: None)
    msg = str(err.value)
    assert "the features of sample(s) ['r2'] hold NaN or inf, in " + str(victim) in msg
    assert "Delete that shard file and rerun the features stage" in msg and "train.lr" not in msg


def test_training_reads_an_fp8_topk_store_and_its_teacher(tiny_target_dirs, tmp_path):
    """The tiny Llama target's rows stored as fp8 and as fp8_topk: training runs on both through load_samples
    (keep_dtype, as the train stage reads) and the batch feed; the same fp8 aux and final states give a different
    first loss only through fp8_topk's exact teacher."""
    from eagle3_core.config import TargetConfig
    from eagle3_core.features.extract import HFExtractor
    from eagle3_core.features.reader import load_head, load_samples
    from eagle3_core.features.store import extract_features
    from eagle3_core.target.loading import load_target
    from eagle3_core.training.draft_model import Eagle3Draft
    from conftest import tiny_shape
    model = load_target(TargetConfig(model=str(tiny_target_dirs["llama"])))
    g = torch.Generator().manual_seed(0)
    rows = [{"id": f"r{i}", "input_ids": torch.randint(0, 128, (12,), generator=g).tolist(),
             "loss_mask": [0] * 4 + [1] * 8} for i in range(6)]
    losses = {}
    for fmt in ("fp8", "fp8_topk"):
        store = tmp_path / fmt
        extract_features(HFExtractor(model, [1, 3, 4]), rows, store, [1, 3, 4], shard_samples=2, batch_tokens=64,
                         store_format=fmt, log=lambda *_: None)
        draft = Eagle3Draft(tiny_shape(vocab_size=128, draft_vocab_size=128, aux_layer_ids=[1, 3, 4]))
        draft.init_weights(0)
        with torch.no_grad():                        # the whole vocab: every target argmax supervised
            draft.d2t.zero_()
            draft.t2d.fill_(True)
        steps = []
        train(draft, load_samples(store, keep_dtype=True), [], load_head(store)[1], CFG, tmp_path / f"out_{fmt}",
              log=lambda s: None, stop_after_steps=1, on_step=lambda step, loss: steps.append(loss),
              tensorboard=False)
        losses[fmt] = steps[0]
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values()) and losses["fp8"] > 0
    assert losses["fp8_topk"] != pytest.approx(losses["fp8"], rel=1e-6), losses


def test_a_non_finite_loss_in_a_later_micro_batch_is_named_and_the_weights_stay(tmp_path):
    """The loss's finiteness is read once per optimizer step, with the gradient norm (not between each forward and
    its backward): with 2 micro-batches per step, a NaN in the second one's features still names that batch and
    its sample, and the draft's weights are those of the steps before it (no optimizer step took the NaN)."""
    data = samples()
    cfg = CFG.model_copy(update={"grad_accum": 2, "checkpoint_every": 1})
    from eagle3_core.training.batch_feed import epoch_batches
    second = epoch_batches(data, cfg, 0)[1]                   # the second micro-batch of the first step
    data[second[0]]["aux"][0, 0] = float("nan")
    draft = tiny_draft()
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    with pytest.raises(FloatingPointError, match=rf"epoch 1, step 0, batch 1 \(samples \['{data[second[0]]['id']}'"):
        train(draft, data, [], torch.randn(100, 32, generator=torch.Generator().manual_seed(1)), cfg,
              tmp_path / "nan", log=lambda s: None)
    assert all(torch.equal(v, before[k]) for k, v in draft.state_dict().items())
    assert not (tmp_path / "nan" / "checkpoints").exists() or not any((tmp_path / "nan" / "checkpoints").iterdir())


def test_the_training_loop_reads_the_device_once_per_optimizer_step(tmp_path, monkeypatch):
    """trainer.train's own code (training.trainer and its step, training.optimizer_step) turns tensors into host
    values (a device synchronisation on a GPU) once per optimizer step, however many micro-batches it accumulates:
    the G token counts it reads are host tensors of the batch feed, and the rest (gradient norm, mean loss, each
    micro-batch's finiteness) is one read."""
    import sys as _sys
    from eagle3_core.training import optimizer_step as step_mod
    from eagle3_core.training import trainer as trainer_mod
    reads, loop_files = [], {trainer_mod.__file__, step_mod.__file__}
    for name in ("__bool__", "__int__", "__float__", "item", "tolist"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if _sys._getframe(1).f_code.co_filename in loop_files:
                reads.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    cfg = CFG.model_copy(update={"grad_accum": 2, "checkpoint_every": 100})
    out = train(tiny_draft(), samples(), [], torch.randn(100, 32), cfg, tmp_path, log=lambda s: None,
                stop_after_steps=2, tensorboard=False)
    from eagle3_core.training.batch_feed import epoch_batches
    micro_batches = len(epoch_batches(samples(), cfg, 0))          # 3: the epoch's second step has one
    assert out["steps"] == 2 and micro_batches == 3
    assert sorted(reads) == sorted(["__int__"] * micro_batches + ["tolist"] * 2), reads
