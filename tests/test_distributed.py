"""Data-parallel training under a real torchrun (gloo, 2 CPU processes): the same weights as one process on the
same global batch, resume of a 2-process run, and the launcher streaming lines and leaving no process behind."""
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_draft
from train_worker import CFG, samples

from eagle3_core.checkpoint import load_latest_training_state
from eagle3_core.distributed.launch import TorchrunError, run_torchrun
from eagle3_core.trainer import train

WORKER = str(Path(__file__).with_name("ddp_worker.py"))
ENV = {"OMP_NUM_THREADS": "1"}


def _torchrun(args, lines=None):
    lines = [] if lines is None else lines
    run_torchrun([WORKER, *args], 2, on_line=lines.append, env=ENV, grace_s=5)
    return lines


def _model(out_dir):
    state, _ = load_latest_training_state(out_dir, log=lambda s: None)
    return state


@pytest.fixture(scope="module")
def ddp_full(tmp_path_factory):
    """An uninterrupted 2-process run (3 epochs of 3 batches: 2 steps per epoch, the second one padded on rank 1)."""
    out = tmp_path_factory.mktemp("ddp_full")
    lines = _torchrun(["train", str(out)])
    return out, lines


def test_two_processes_equal_one_process_with_the_same_global_batch(ddp_full, tmp_path):
    out, lines = ddp_full
    ref = tmp_path / "one"
    lm_head = torch.randn(100, 32, generator=torch.Generator().manual_seed(5))
    torch.set_num_threads(1)
    summary = train(tiny_draft(), samples(), samples(4, seed=1), lm_head, CFG.model_copy(update={"grad_accum": 2}),
                    ref, log=lambda s: None)
    a, b = _model(ref), _model(out)
    assert a["step"] == b["step"] == summary["steps"] == 6
    assert a["data"] == b["data"]                           # same fingerprint: the checkpoints are interchangeable
    for name, t in a["model"].items():
        assert torch.allclose(t, b["model"][name], rtol=1e-4, atol=1e-6), name
    moved = sum((t - tiny_draft().state_dict()[n]).abs().sum() for n, t in a["model"].items() if t.is_floating_point())
    assert moved > 1.0                                      # training changed the weights: the comparison means something
    ha, hb = summary["history"], json.loads(b["history"])
    for ea, eb in zip(ha, hb, strict=True):
        assert ea["tokens"] == eb["tokens"] and ea["train"]["acc"] == pytest.approx(eb["train"]["acc"])
        assert ea["eval"]["tau_sim"] == pytest.approx(eb["eval"]["tau_sim"])
        assert ea["train"]["loss"] == pytest.approx(eb["train"]["loss"], rel=1e-4)
    assert any(line.startswith("train: epoch 2 loss") and "2 ranks" in line for line in lines)   # rank 0 logs


def test_two_process_run_resumes_from_its_checkpoint(ddp_full, tmp_path):
    """Stopped after 3 of 6 optimizer steps (epoch 1, mid-epoch checkpoint), started again: the same weights and
    optimizer state as the uninterrupted 2-process run, bit for bit (same ranks, same reduction order)."""
    full, _ = ddp_full
    _torchrun(["train", str(tmp_path), "3"])
    state = _model(tmp_path)
    assert (state["step"], state["epoch"], state["batch"]) == (3, 1, 2)
    lines = _torchrun(["train", str(tmp_path)])
    assert any("resumed from step_000000003.pt (epoch 1, batch 2, step 3) on 2 ranks" in x for x in lines)
    a, b = _model(full), _model(tmp_path)
    assert b["step"] == 6
    for name, t in a["model"].items():
        assert torch.equal(t, b["model"][name]), name
    for pid, st in a["optimizer"]["state"].items():
        for k, t in st.items():
            assert torch.equal(t, b["optimizer"]["state"][pid][k]), (pid, k)
    assert json.loads(a["history"])[-1]["train"] == json.loads(b["history"])[-1]["train"]


def test_failed_torchrun_raises_with_its_output(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nprint('about to fail', flush=True)\nsys.exit(3)\n")
    lines = []
    with pytest.raises(TorchrunError, match="about to fail"):
        run_torchrun([str(bad)], 1, on_line=lines.append, env=ENV, grace_s=5)
    assert "about to fail" in lines and sys.executable


def test_worker_lines_stay_whole_when_ranks_share_a_pipe():
    """Two unbuffered processes on one pipe, 3,000 lines each through emit_line: every line arrives whole. (print()
    writes the newline apart; two ranks' 'ready' lines once arrived as 'rank 0 pid P readyrank 1 pid Q ready' and
    the cancellation test waited 600 s for a second line.)"""
    import os
    import re
    import subprocess

    from conftest import ROOT
    code = ("import sys\nfrom eagle3_core.distributed.launch import emit_line\n"
            "for i in range(3000):\n    emit_line(f'rank {sys.argv[1]} line {i} ready')")
    r, w = os.pipe()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(k)], stdout=w, env=env) for k in (0, 1)]
    os.close(w)
    with os.fdopen(r) as f:
        lines = f.read().splitlines()
    assert [p.wait() for p in procs] == [0, 0]
    assert len(lines) == 6000 and all(re.fullmatch(r"rank [01] line \d+ ready", x) for x in lines)
