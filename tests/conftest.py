"""Shared fixtures: tiny draft shapes, the embedded target loaded once, one Prefect test server per session, and
one end-to-end run of the pipeline (debug_tiny preset) whose trained draft later tests reuse."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
import torch

import time_guard

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# tests never download: a hub lookup fails at once instead of retrying for ~20 s (huggingface_hub's HF_HUB_OFFLINE,
# read when it is first imported, which is after this)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# task retry backoff base (tasks/retry.py), read when the tasks are defined: short in tests
os.environ.setdefault("EAGLE3_RETRY_DELAY_S", "0.2")
# task results and cache records of this session only: with Prefect's default (~/.prefect/storage) a record left by an
# earlier session is read back as a cache hit when pytest hands out the same tmp path again (seen on a reused host:
# "Cached" instead of "Completed", a generation record that is not the one on disk)
if not {"PREFECT_RESULTS_LOCAL_STORAGE_PATH", "PREFECT_LOCAL_STORAGE_PATH"} & set(os.environ):
    os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = tempfile.mkdtemp(prefix="eagle3-tests-results-")

ROOT = Path(__file__).resolve().parents[1]
# real data sets copied into the repository (tests/data/README.md: sources and licences): a plain clone passes
SHARED_DATA = ROOT / "tests" / "data"


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop a process a test started, with everything in its process group when it leads one (servers started with
    start_new_session): SIGTERM, then SIGKILL after `grace_s`."""
    if proc.poll() is not None:
        return
    group = os.getpgid(proc.pid) == proc.pid
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


@pytest.fixture
def spawned():
    """Register a process a test starts (`proc = spawned(Popen(...))`): it is stopped when the test ends, whether
    it passed, failed, errored or was interrupted (Ctrl-C runs fixture finalizers)."""
    procs: list[subprocess.Popen] = []

    def register(proc: subprocess.Popen) -> subprocess.Popen:
        procs.append(proc)
        return proc
    yield register
    for proc in procs:
        stop_process(proc)


def leftover_children() -> list[psutil.Process]:
    """Live descendants of this pytest process (zombies waiting for their reaper do not count)."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


def assert_ranks_left_cleanly(lines: list[str], world: int, code: int = 0) -> None:
    """Every rank 0..world-1 of a torchrun whose output is `lines` ended through rank_exit.rank_main with exit code
    `code`, its process group destroyed and no live non-daemon thread but its main one (the line each rank prints
    just before os._exit: rank_exit.exit_report)."""
    for r in range(world):
        want = f"rank {r}/{world} exit {code}: process group destroyed, live threads: none"
        assert any(x.endswith(want) for x in lines), (want, [x for x in lines if " exit " in x] or lines[-20:])


def _sigterm_as_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum} (SIGTERM)")


def pytest_configure(config):
    """SIGTERM (a CI runner's stop, `kill`, `timeout`) ends pytest as Ctrl-C does: KeyboardInterrupt, so fixture
    finalizers stop the servers and workers and pytest exits 2 (interrupted). Python's default SIGTERM action ends
    the process at once with no finalizer; inside a flow run Prefect raises TerminationSignal instead and then
    re-sends the signal to the handler installed before it (prefect/utilities/engine capture_sigterm), this one."""
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)


# `make test-fast` runs every test not marked slow or ui: an unmarked test must stay quick. The budget is for 2 cores;
# on a machine that other jobs keep busy it grows by how busy they kept it during the test (time_guard.budget_s).
FAST_TEST_S = float(os.environ.get("EAGLE3_FAST_TEST_S", "10"))


# session fixtures that run the pipeline end to end (minutes): a test that asks for one is slow whatever it does
SLOW_FIXTURES = ("e2e_run",)


def pytest_collection_modifyitems(config, items):
    """Mark `slow` every test that uses a SLOW_FIXTURES fixture (directly or through another fixture), so that
    `make test-fast` never starts the end-to-end run."""
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in SLOW_FIXTURES):
            item.add_marker(pytest.mark.slow)


_CALL_SAMPLES = pytest.StashKey[list]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Read the machine's and this process's CPU counters around the test's call (time_guard.Sample)."""
    item.stash[_CALL_SAMPLES] = [time_guard.Sample.now()]
    yield
    item.stash[_CALL_SAMPLES].append(time_guard.Sample.now())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Fail an unmarked test whose call phase ran past FAST_TEST_S scaled by how busy other processes kept the
    machine during it (time_guard.budget_s; fixtures are not counted: a session fixture is paid once): mark it
    `slow`, or make it quicker."""
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.passed or item.get_closest_marker("slow") or item.get_closest_marker("ui"):
        return
    before, after = item.stash.get(_CALL_SAMPLES, [None, None])
    budget = (FAST_TEST_S if before is None else
              time_guard.budget_s(FAST_TEST_S, before, after, call.duration, os.getloadavg()[0], os.cpu_count() or 1))
    if call.duration > budget:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {call.duration:.1f} s, over the {budget:.0f} s an unmarked test may "
                           f"take (conftest.FAST_TEST_S, scaled by how busy the machine was): mark it "
                           f"@pytest.mark.slow or make it quicker")


# the reference case's rehearsal (issue budget: 8 min on the CI machine's 2 cores): its tests' time, fixtures included
# (a session fixture's build counts where it is first used), said just above pytest's last line
REHEARSAL = "tests/test_reference_rehearsal"
_rehearsal_s: list[float] = []


def pytest_runtest_logreport(report):
    if report.nodeid.startswith(REHEARSAL):
        _rehearsal_s.append(report.duration)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _rehearsal_s:
        terminalreporter.write_line(f"reference rehearsal ({REHEARSAL}*.py): {sum(_rehearsal_s):.0f} s of setup, "
                                    f"call and teardown on {os.cpu_count()} cores, load average "
                                    f"{os.getloadavg()[0]:.1f} (budget: 480 s on 2 quiet cores)")


def pytest_sessionfinish(session, exitstatus):
    """Backstop, also after Ctrl-C: a server or worker a test started and did not stop (a bug in that test) is
    stopped here and named, so that no llama-server or torchrun outlives pytest. Session fixtures (the Prefect
    harness) are torn down before this hook runs."""
    left = leftover_children()
    for child in left:
        try:
            sys.stderr.write(f"\nconftest: stopping leftover process {child.pid}: {' '.join(child.cmdline())[:200]}\n")
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(left, timeout=10)
    for child in alive:
        child.kill()


def written_bytes(entries: list[dict]) -> list[dict]:
    """Shard records without their mtime_ns: what two runs that wrote the same bytes agree on (the mtime says when
    each file was written)."""
    return [{k: v for k, v in e.items() if k != "mtime_ns"} for e in entries]


def tiny_shape(**kw):
    from eagle3_core.training.draft_model import DraftShape
    base = dict(hidden_size=32, target_hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=64, vocab_size=100, draft_vocab_size=50, rms_norm_eps=1e-6, rope_theta=10000.0,
                max_position_embeddings=256, aux_layer_ids=[1, 2, 3])
    base.update(kw)
    return DraftShape(**base)


def random_ttt_samples(g: torch.Generator, spans, aux: int = 96, final: int = 32, vocab: int = 100) -> list[dict]:
    """Training samples of random features for TTT tests, one per (T, first supervised position) in `spans`:
    input_ids and target_top1 [T] int64 below `vocab`, loss_mask [T] bool (True from `first` on), aux [T, aux] and
    final [T, final] fp64."""
    samples = []
    for T, first in spans:
        mask = torch.zeros(T, dtype=torch.bool)
        mask[first:] = True
        samples.append({"input_ids": torch.randint(0, vocab, (T,), generator=g), "loss_mask": mask,
                        "aux": torch.randn(T, aux, generator=g, dtype=torch.float64),
                        "final": torch.randn(T, final, generator=g, dtype=torch.float64),
                        "target_top1": torch.randint(0, vocab, (T,), generator=g)})
    return samples


def tiny_draft(seed: int = 0, **kw):
    from eagle3_core.training.draft_model import Eagle3Draft
    torch.manual_seed(seed)
    d = Eagle3Draft(tiny_shape(**kw))
    d.init_weights(seed)
    with torch.no_grad():
        d.embed_tokens.weight.normal_()
        # random non-trivial weights everywhere so that tests see every term
        for p in d.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
        d.d2t.copy_(torch.arange(0, 100, 2) - torch.arange(50))       # draft id i -> target id 2i
        d.t2d.zero_()
        d.t2d[::2] = True
    return d


@pytest.fixture(scope="session")
def target_cfg():
    from eagle3_core.config import TargetConfig
    return TargetConfig()


@pytest.fixture(scope="session")
def tokenizer(target_cfg):
    from eagle3_core.target.loading import load_tokenizer
    return load_tokenizer(target_cfg)


@pytest.fixture(scope="session")
def target_model(target_cfg):
    from eagle3_core.target.loading import load_target
    return load_target(target_cfg)


@pytest.fixture(scope="session")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def e2e_run(prefect_server, tmp_path_factory):
    """The end-to-end flow on a handful of prompts, with the real llama.cpp server, under the Prefect harness."""
    from eagle3_core.config import preset
    from flows.pipeline import eagle3_pipeline
    cfg = preset("debug_tiny", tmp_path_factory.mktemp("run") / "debug_tiny")
    summary = eagle3_pipeline(cfg)
    return cfg, summary


@pytest.fixture(scope="session")
def e2e_memorised(e2e_run, target_model, tokenizer):
    """debug_tiny's trained draft with what the replay tests feed it: (draft, TargetRunner over the draft's aux
    layers, eos ids, token ids of the first 3 training prompts: memorised, so their answers are accepted at length)."""
    from eagle3_core.contract.layout import RunLayout
    from eagle3_core.data.chat import prompt_ids
    from eagle3_core.data.prompt_set import read_rows
    from eagle3_core.evaluation.speculate import TargetRunner
    from eagle3_core.training.checkpoint import load_draft
    cfg, summary = e2e_run
    draft = load_draft(summary["draft_dir"]).eval()
    rows = read_rows(RunLayout(cfg.run_dir).prompts_train)[:3]
    return (draft, TargetRunner(target_model, draft.shape.aux_layer_ids), {tokenizer.eos_token_id},
            [prompt_ids(tokenizer, r["messages"]) for r in rows])


@pytest.fixture(scope="session")
def tiny_target_dirs(tmp_path_factory):
    """{family: directory} of tiny random-weight targets of every family in tiny_targets.FAMILIES."""
    from tiny_targets import FAMILIES, build
    root = tmp_path_factory.mktemp("tiny_targets")
    return {f: build(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="session")
def kimi_rehearsal_target(tmp_path_factory):
    """The reference rehearsal's target (tests/kimi_rehearsal.py), built once per session: a tiny Kimi-K2.5
    (Kimi_K25Config, MLA, routed experts packed INT4) with the K2.5-style template and Kimi's two end tokens."""
    from kimi_rehearsal import build_target
    return build_target(tmp_path_factory.mktemp("kimi_rehearsal") / "target")
