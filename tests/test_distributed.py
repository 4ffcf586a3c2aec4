"""Data-parallel training under a real torchrun (gloo, 2 CPU processes), through the one trainer.train: the same
weights as one process on the same global batch, resume of a 2-process run, the train stage's torchrun entry point
(run_train on every rank), and the launcher streaming lines and leaving no process behind."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import assert_ranks_left_cleanly, tiny_draft
from eagle3_core.distributed.launch import TorchrunError, run_torchrun
from eagle3_core.training.checkpoint import load_latest_training_state
from eagle3_core.training.trainer import train
from train_worker import CFG, samples

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


@pytest.mark.slow
def test_two_processes_equal_one_process_with_the_same_global_batch(ddp_full, tmp_path):
    out, lines = ddp_full
    ref = tmp_path / "one"
    lm_head = torch.randn(100, 32, generator=torch.Generator().manual_seed(5))
    torch.set_num_threads(1)
    summary = train(tiny_draft(), samples(), samples(4, seed=1), lm_head, CFG.model_copy(update={"grad_accum": 2}),
                    ref, log=lambda s: None)
    a, b = _model(ref), _model(out)
    assert a["step"] == b["step"] == summary["steps"] == 6
    assert a["resume"] == b["resume"]                       # same resume key: the checkpoints are interchangeable
    for name, t in a["model"].items():
        assert torch.allclose(t, b["model"][name], rtol=1e-4, atol=1e-6), name
    moved = sum((t - tiny_draft().state_dict()[n]).abs().sum() for n, t in a["model"].items() if t.is_floating_point())
    assert moved > 1.0                                      # training changed the weights: the comparison means something
    ha, hb = summary["history"], json.loads(b["history"])
    for ea, eb in zip(ha, hb, strict=True):
        assert ea["tokens"] == eb["tokens"] and ea["train"]["acc"] == pytest.approx(eb["train"]["acc"])
        assert ea["eval"]["tau_sim"] == pytest.approx(eb["eval"]["tau_sim"])
        assert ea["train"]["loss"] == pytest.approx(eb["train"]["loss"], rel=1e-4)
    assert any(line.startswith("train: epoch 3 of 3: loss") and "2 ranks" in line for line in lines)   # rank 0 logs
    assert_ranks_left_cleanly(lines, 2)


@pytest.mark.slow
def test_two_process_run_resumes_from_its_checkpoint(ddp_full, tmp_path):
    """Stopped after 3 of 6 optimizer steps (in the second epoch: a mid-epoch checkpoint), started again: the same weights and
    optimizer state as the uninterrupted 2-process run, bit for bit (same ranks, same reduction order)."""
    full, _ = ddp_full
    _torchrun(["train", str(tmp_path), "3"])
    state = _model(tmp_path)
    assert (state["step"], state["epoch"], state["batch"]) == (3, 1, 2)
    lines = _torchrun(["train", str(tmp_path)])
    assert any("resumed from step_000000003.pt (epoch 2, batch 2, step 3) on 2 ranks" in x for x in lines)   # from 1
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


RANK_EXIT_CASE = str(Path(__file__).parent / "cases" / "rank_exit_worker.py")


def test_a_failing_rank_joins_its_threads_and_destroys_its_group_before_it_exits():
    """rank_exit.rank_main's error path: the body raised while a writer thread was busy; the rank prints the error
    with its [rank0] prefix (what root_cause reads), joins the thread, destroys its group and exits 1."""
    lines = []
    with pytest.raises(TorchrunError, match=r"^rank 0: ValueError: the body failed while its writer was busy"):
        run_torchrun([RANK_EXIT_CASE, "raise"], 1, on_line=lines.append, env=ENV, grace_s=5)
    assert_ranks_left_cleanly(lines, 1, code=1)


def test_a_thread_left_running_fails_the_rank_and_is_named():
    """A non-daemon thread still alive after the join timeout: named in the rank's last lines, exit code 1 (the
    process still ends: os._exit, no wait on that thread)."""
    lines = []
    with pytest.raises(TorchrunError):
        run_torchrun([RANK_EXIT_CASE, "stuck"], 1, on_line=lines.append, env=ENV, grace_s=5)
    assert any("threads still alive at exit after 1 s: stuck-writer" in x for x in lines), lines[-10:]
    assert any(x.endswith("rank 0/1 exit 1: process group destroyed, live threads: stuck-writer") for x in lines)


LIVE_THREADS_CHECK = """
import threading
from eagle3_core.distributed.rank_exit import exit_report, join_threads, live_threads
release = threading.Event()
busy = threading.Thread(target=release.wait, name="shard-writer_0")
quiet = threading.Thread(target=release.wait, name="daemonic", daemon=True)
busy.start()
quiet.start()
try:
    assert [t.name for t in live_threads()] == ["shard-writer_0"], live_threads()
    assert exit_report(0, 1, 0) == "rank 0/1 exit 0: process group destroyed, live threads: shard-writer_0"
    assert [t.name for t in join_threads(0.2)] == ["shard-writer_0"]          # bounded: still alive
finally:
    release.set()
assert join_threads(5.0) == [] and live_threads() == []
assert exit_report(0, 1, 0) == "rank 0/1 exit 0: process group destroyed, live threads: none"
print("ok")
"""


def test_live_threads_names_the_non_daemon_threads_a_normal_exit_would_wait_for():
    """In a fresh interpreter, as a rank is: this test process holds other tests' idle pool workers (non-daemon
    ThreadPoolExecutor threads), which a rank never has and which no join ends."""
    done = subprocess.run([sys.executable, "-c", LIVE_THREADS_CHECK], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


TORCHRUN_LOGS = Path(__file__).parent / "data" / "torchrun"


def test_the_first_failing_ranks_own_error_is_named_not_the_peers_gloo_error():
    """torchrun's whole output (tests/data/torchrun, torch 2.13): rank 1 fails, rank 0 then reports gloo's
    'Connection closed by peer' (what the hf_tp features task used to show); root_cause names rank 1's error, from
    torchrun's 'Root Cause' summary, and without it from the first rank error that is not a peer's loss."""
    from eagle3_core.distributed.launch import root_cause
    raised = (TORCHRUN_LOGS / "rank1_raised.log").read_text().splitlines()
    assert root_cause(raised) == "rank 1: ValueError: the real cause: shard 3 is bad"
    cut = [x for x in raised[:next(i for i, x in enumerate(raised) if x.startswith("Root Cause"))]]
    assert root_cause(cut) == "rank 1: ValueError: the real cause: shard 3 is bad"
    rank0_only = [x for x in cut if not x.startswith("[rank1]")]
    assert root_cause(rank0_only).startswith("rank 0: RuntimeError: [") and "Connection closed by peer" in \
        root_cause(rank0_only)                                         # nothing better to say
    killed = (TORCHRUN_LOGS / "rank1_killed.log").read_text().splitlines()
    assert root_cause(killed).startswith("rank 1 was killed by SIGKILL (the kernel's out-of-memory killer")
    assert root_cause(["about to fail"]) is None


@pytest.mark.slow
def test_a_failed_torchrun_leads_with_the_failing_ranks_error(tmp_path):
    from conftest import ROOT
    with pytest.raises(TorchrunError) as err:
        run_torchrun([str(ROOT / "tests" / "cases" / "failing_rank.py")], 2, on_line=lambda _: None, env=ENV,
                     grace_s=5, log_path=tmp_path / "torchrun.log")
    first, second = str(err.value).splitlines()[:2]
    assert first == "rank 1: ValueError: the real cause: shard 3 is bad"
    assert second.startswith(f"torchrun exited with code 1 (every line in {tmp_path / 'torchrun.log'})")


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


@pytest.mark.slow
def test_train_stage_under_torchrun_equals_the_one_process_stage(tmp_path):
    """`python -m eagle3_core.pipeline.train_ddp --config run.json` is run_train on every rank: 2 ranks
    x grad_accum 1 train the same draft (float tolerance) as the one-process stage with grad_accum 2, after the
    same steps, and export it; rank 0 alone writes the manifest (world_size 2); a corrupt shard stops every rank."""
    import shutil

    from safetensors.torch import load_file

    from conftest import ROOT
    from eagle3_core.contract.manifest import read_manifest
    from eagle3_core.pipeline.features_stage import run_features
    from eagle3_core.pipeline.train_stage import run_train
    from eagle3_core.pipeline.vocab_stage import run_vocab
    from tiny_targets import build
    from tokenized_rows import random_rows, tiny_train_run, write_tokenized
    one = tiny_train_run(tmp_path / "one", build("llama", tmp_path / "t"), eval_frac=0.25, grad_accum=2,
                         checkpoint_every=2)
    write_tokenized(one.run_dir, random_rows(16, lengths=(8, 30), prompt_part=3), inputs_key="sixteen-random-rows")
    torch.set_num_threads(1)                                 # the workers' kernels (OMP_NUM_THREADS=1)
    run_features(one, log=lambda s: None)
    run_vocab(one, log=lambda s: None)
    two = one.model_copy(update={"run_dir": tmp_path / "two",
                                 "train": one.train.model_copy(update={"grad_accum": 1})})
    for stage in ("tokenized", "features", "vocab"):
        shutil.copytree(one.run_dir / stage, two.run_dir / stage)
    m1 = run_train(one, log=lambda s: None)
    config = tmp_path / "two.json"
    config.write_text(two.model_dump_json())
    lines = []
    run_torchrun(["-m", "eagle3_core.pipeline.train_ddp", "--config", str(config)], 2, on_line=lines.append,
                 env={**ENV, "PYTHONPATH": str(ROOT)}, grace_s=5, cwd=ROOT)
    m2 = read_manifest(two.run_dir / "draft" / "manifest.json")
    assert (m1["world_size"], m2["world_size"]) == (1, 2) and m1["steps"] == m2["steps"] >= 4
    assert m1["best"]["epoch"] == m2["best"]["epoch"] and m2["train_samples"] == 12
    assert m1["history"][0]["train"]["loss"] != m1["history"][1]["train"]["loss"]     # it trained
    assert m1["export_dtype"] == m2["export_dtype"]
    assert all((r / m["export_dir"]).is_dir() for r, m in ((one.run_dir, m1), (two.run_dir, m2)))
    a, b = (load_file(r / "draft" / "best" / "model.safetensors") for r in (one.run_dir, two.run_dir))   # fp32
    for name, t in a.items():
        assert torch.allclose(t, b[name], rtol=1e-4, atol=1e-6), name
    assert sum(1 for x in lines if x.startswith("train: best epoch")) == 1       # rank 0 logs, once
    assert_ranks_left_cleanly(lines, 2)
    # a corrupt shard: each rank hashes half of them, and both stop with the count
    shutil.rmtree(two.run_dir / "draft")
    shard = sorted((two.run_dir / "features").glob("shard_*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-10] + bytes(10))
    failed = []
    with pytest.raises(TorchrunError, match=r"1 feature shard\(s\) corrupt or missing"):
        run_torchrun(["-m", "eagle3_core.pipeline.train_ddp", "--config", str(config)], 2, on_line=failed.append,
                     env={**ENV, "PYTHONPATH": str(ROOT)}, grace_s=5, cwd=ROOT)
    # the error path too: the first rank to fail left its group destroyed and no thread behind (torchrun may stop
    # the other one before it gets that far)
    assert any(re.search(r"rank [01]/2 exit 1: process group destroyed, live threads: none$", x) for x in failed), \
        failed[-20:]


def test_data_parallel_is_the_identity_on_one_process_and_slices_groups_on_many():
    """DataParallel() (no process group) changes nothing and runs no collective; rank r of W takes micro-batches
    [r*G, (r+1)*G) of a step's group, padded with None to G (zero-weight) when the epoch's last group is short."""
    from torch import nn

    from eagle3_core.distributed.data_parallel import DataParallel
    one, group = DataParallel.from_process_group(), [[0], [1], [2]]
    assert (one.rank, one.world, one.is_main) == (0, 1, True)
    assert one.micro_batches(group, 3) == group and one.micro_batches(group[:1], 3) == [[0]]   # no pads
    t, stats, module = torch.ones(3), {"n": torch.ones(2)}, nn.Linear(2, 2)
    assert one.sum(t) is t and one.sum_stats(stats, 2) is stats and one.sum_stats(None, 2) is None
    assert one.wrap(module, torch.device("cpu")) is module and one.shard([1, 2, 3]) == [1, 2, 3]
    assert one.sum_int(7) == 7 and one.all_true(False) is False
    with one.sync_gradients(module, last=False):                   # a plain module: nothing to skip
        pass
    short = [[0], [1], [2]]                                         # W = 2, G = 2: 3 of 4 batches left
    assert DataParallel(0, 2).micro_batches(short, 2) == [[0], [1]]
    assert DataParallel(1, 2).micro_batches(short, 2) == [[2], None]
    assert DataParallel(1, 2).shard([0, 1, 2, 3, 4]) == [1, 3] and not DataParallel(1, 2).is_main


@pytest.mark.slow
def test_the_train_flow_on_two_gpus_runs_the_ddp_task(prefect_server, tmp_path, monkeypatch):
    """train_flow(gpus=2), the flow a user starts from the UI: its train stage is one torchrun task of 2 ranks
    (tasks.distributed.train_ddp_task, world size 2 in the manifest, torchrun's lines in draft/torchrun.log); a
    second call finds the stage done on every rank and trains nothing: the same manifest, no new epoch logged."""
    from conftest import ROOT
    from eagle3_core.pipeline.features_stage import run_features
    from eagle3_core.pipeline.vocab_stage import run_vocab
    from flows.stage_flows import train_flow
    from tiny_targets import build
    from tokenized_rows import random_rows, tiny_train_run, write_tokenized
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    cfg = tiny_train_run(tmp_path / "run", build("llama", tmp_path / "t"), eval_frac=0.25)
    write_tokenized(cfg.run_dir, random_rows(16, lengths=(8, 30), prompt_part=3), inputs_key="sixteen-random-rows")
    run_features(cfg, log=lambda s: None)
    run_vocab(cfg, log=lambda s: None)
    m = train_flow(cfg, gpus=2)
    assert m["world_size"] == 2 and m["train_samples"] == 12 and (cfg.run_dir / m["export_dir"]).is_dir()
    log = (cfg.run_dir / "draft" / "torchrun.log").read_text()
    assert "train: best epoch" in log
    before = log.count("train: best epoch")
    assert train_flow(cfg, gpus=2) == m
    assert (cfg.run_dir / "draft" / "torchrun.log").read_text().count("train: best epoch") == before
