"""The Prefect UI in a real browser (Debian's chromium, headless, driven by Playwright): `make server` serves the
UI on 127.0.0.1 at a port other than Prefect's default (PREFECT_PORT, the Makefile's one place for it) and `make
deploy` serves the deployments; the browser finds the end-to-end deployment of the smallest preset, starts a custom
run with one parameter changed, and watches it complete, seeing the evaluation's progress artifact before the stage
ends and the running stage's progress on the pipeline run's own page; the report artifact's embedded plots load; a
nightly run on the finished run keeps its num_train and its export and says so in its log; a second run (another
run directory, on a machine loaded on purpose) leaves the first run's artifacts in place and its report carries
the load flag; a failed run's log opens with the cause; the first screen of a nightly no-op shows its plan; a run
whose llama-server is killed names the cause once, at the top; a run cancelled during generation ends Cancelled
with its subflows and says so. Screenshots go to test-artifacts/ui/ (failure.png: the page when a check failed). Run
with `make test-ui` (CI: .ci/run); needs the port (EAGLE3_UI_TEST_PORT) free. The server logs every request it answers
503 (SQLite write-lock contention) to its server.log; the test makes its writes through Prefect's client, which retries
them (_client)."""
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.ui

ROOT = Path(__file__).resolve().parents[1]
# not Prefect's default 4200: the UI must find its API through PREFECT_UI_API_URL, which the Makefile sets from it
PORT = int(os.environ.get("EAGLE3_UI_TEST_PORT", "4217"))
UI = f"http://127.0.0.1:{PORT}"
FAILED_REQUESTS: list[str] = []       # the browser's requests answered 400 or more (the UI says 'Something went wrong')
SHOTS = Path(os.environ.get("EAGLE3_TEST_ARTIFACTS", ROOT / "test-artifacts")) / "ui"
CHROMIUM = os.environ.get("EAGLE3_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
# the whole debug_tiny pipeline runs behind the UI: ~4 min on an idle 2-core machine, far longer on a busy one
RUN_TIMEOUT_S = float(os.environ.get("EAGLE3_UI_RUN_TIMEOUT_S", "2400"))
# extra make flags, e.g. "-o .venv/.installed" where the venv was set up by other means
MAKE = ["make", *shlex.split(os.environ.get("EAGLE3_MAKE_FLAGS", ""))]


def _start(target: str, env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen([*MAKE, target], cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_until(ready, proc: subprocess.Popen, log: Path, timeout_s: float, what) -> None:
    """Poll ready() every second until it is true; AssertionError when `proc` exits first, or after timeout_s with
    what() (the state waited on) and the tail of `log`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{proc.args} exited: {log.read_text()[-3000:]}"
        if ready():
            return
        time.sleep(1)
    raise AssertionError(f"{what()} after {timeout_s} s; log {log}: {log.read_text()[-3000:]}")


def _wait_for(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    def answers() -> bool:
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
    _wait_until(answers, proc, log, timeout_s, lambda: f"{url} not ready")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", PORT)) != 0, f"port {PORT} is in use: stop that server first"
    tmp = tmp_path_factory.mktemp("ui")
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect"), "EAGLE3_RUN_ROOT": str(tmp / "runs"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_PORT": str(PORT),
           "PREFECT_API_LOG_RETRYABLE_ERRORS": "true"}     # server.log names each write answered 503 (_client)
    env.pop("PREFECT_API_URL", None)
    server = _start("server", env, tmp / "server.log")
    procs = [server]
    try:
        _wait_for(f"{UI}/api/health", server, tmp / "server.log", 180)
        deploy = _start("deploy", env, tmp / "deploy.log")
        procs.append(deploy)
        _wait_for_served(deploy, tmp / "deploy.log", 300)
        yield tmp
    finally:
        for p in reversed(procs):
            _stop(p)


def _wait_for_served(deploy: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Wait until `make deploy` has registered every deployment and its runner has polled them (status READY, set by
    the first poll, which starts only after the last registration). Before that the registrations race the UI's Run:
    Prefect 3.9's create_flow_run reads the deployment and then inserts the flow run in one DEFERRED SQLite
    transaction (prefect/server/api/deployments.py), which SQLite fails at once with "database is locked" (503,
    which the UI does not retry) when another write commits in between. Measured on a 2-core machine (2026-12-06):
    6 of 61 bare create_flow_run requests answered 503 during the registrations, 0 of 150 after every deployment was
    READY."""
    from deployments.serve import deployment_specs
    expected, found = len(deployment_specs(ROOT / "runs", "UTC")), []

    def all_ready() -> bool:
        found[:] = httpx.post(f"{UI}/api/deployments/filter", json={}, timeout=30).json()
        return len(found) == expected and all(d["status"] == "READY" for d in found)
    _wait_until(all_ready, deploy, log, timeout_s, lambda: f"{expected} deployments not all registered and READY: "
                f"{[(d['name'], d['status']) for d in found]}")


def _property_input(page, label: str):
    """The input of the parameter form field labelled `label` (Prefect's schema form)."""
    lab = page.locator("label", has_text=label).first
    lab.wait_for()
    return lab.locator("xpath=ancestor::div[contains(concat(' ', @class, ' '), ' p-label ')][1]").locator(
        "input").first


def test_ui_runs_the_smallest_preset_with_one_parameter_changed(served):
    from playwright.sync_api import sync_playwright
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        page.on("response", lambda r: r.status >= 400 and FAILED_REQUESTS.append(f"{r.status} {r.request.method} "
                                                                                  f"{r.url}"))
        try:
            page.goto(f"{UI}/deployments", wait_until="networkidle")
            page.get_by_role("link", name="debug-tiny").first.click()         # eagle3-pipeline/debug-tiny
            page.wait_for_url("**/deployment/**")
            page.get_by_role("button", name="Run", exact=True).click()
            page.get_by_text("Custom run").click()
            page.wait_for_url("**/run**")
            run_name = _property_input(page, "Run Name").input_value()
            epochs = _property_input(page, "Epochs (Optional)")
            assert epochs.input_value() == "30"                               # the preset's default
            epochs.fill("3")                                                  # the one changed parameter
            page.screenshot(path=SHOTS / "1-custom-run-form.png")
            page.get_by_role("button", name="Submit").click()
            # the run the form created, found by its name through the API: the deployment page's list of runs
            # refreshes on a timer, which on a loaded machine missed a 60 s wait (CI, 2026-12-04)
            run_url = f"{UI}/runs/flow-run/{_flow_run_id(page, run_name, served / 'server.log')}"
            page.goto(run_url, wait_until="networkidle")
            state = page.locator(".state-badge").first
            deadline, last_reload, eval_progress = time.monotonic() + RUN_TIMEOUT_S, time.monotonic(), None
            parent_progress = None
            while time.monotonic() < deadline and state.inner_text().strip() not in ("Completed", "Failed",
                                                                                     "Crashed", "Cancelled"):
                time.sleep(1)
                if parent_progress is None:       # the running stage's progress, on the pipeline run's own page
                    art = _artifacts("pipeline-progress-debug-tiny")
                    if art and art[0]["data"] is not None and 0 < art[0]["data"] < 100 and \
                            art[0]["description"].startswith("stage "):
                        parent_progress = art[0]["description"]
                        assert art[0]["flow_run_id"] == run_url.rsplit("/", 1)[1], art[0]
                        page.get_by_text("Artifacts", exact=True).first.click()          # the run's tab
                        try:
                            page.get_by_text(re.compile(r"stage \d+ of \d+: ")).first.wait_for()   # its line
                        finally:
                            page.screenshot(path=SHOTS / "3a-pipeline-run-progress.png", full_page=True)
                        page.goto(run_url, wait_until="networkidle")
                if eval_progress is None:         # the evaluation's progress artifact, seen before it reaches 100
                    art = _artifacts("evaluate-progress-debug-tiny")
                    if art and art[0]["data"] is not None and art[0]["data"] < 100:
                        eval_progress = art[0]["data"]
                        page.goto(f"{UI}/artifacts/artifact/{art[0]['latest_id']}", wait_until="networkidle")
                        page.screenshot(path=SHOTS / "3-evaluate-progress.png", full_page=True)
                        page.goto(run_url, wait_until="networkidle")
                if time.monotonic() - last_reload > 5:
                    page.reload(wait_until="networkidle")
                    last_reload = time.monotonic()
                state = page.locator(".state-badge").first
            page.screenshot(path=SHOTS / "2-flow-run.png", full_page=True)
            assert state.inner_text().strip() == "Completed", (SHOTS / "2-flow-run.png")
            assert eval_progress is not None, "no evaluate progress artifact below 100% was seen during the run"
            assert parent_progress is not None, "the pipeline run showed no stage progress while it ran"

            (report,) = _artifacts("eagle3-report-debug-tiny")
            page.goto(f"{UI}/artifacts/artifact/{report['latest_id']}", wait_until="networkidle")   # its content
            page.locator("img").first.wait_for()
            widths = page.eval_on_selector_all("img", "els => els.filter(e => e.src.startsWith('data:image/png'))"
                                                      ".map(e => e.naturalWidth)")
            page.screenshot(path=SHOTS / "4-report-artifact.png", full_page=True)
            assert len(widths) >= 2 and all(w > 0 for w in widths), widths      # the plots render
            keys_before = {a["key"] for a in _artifacts("-debug-tiny-")}

            # the nightly schedule's run on the finished run: same num_train, the export kept, said in its log
            run_dir = served / "runs" / "debug_tiny"
            export = {p.name: p.read_bytes() for p in (run_dir / "draft" / "export").iterdir()}
            night = _run_deployment(run_dir, epochs=3, nightly=True)
            assert night["state"]["type"] == "COMPLETED", night["state"]
            nights = json.loads((run_dir / "nights.json").read_text())["nights"]
            assert [(n["night"], n["num_train"], n["promoted"]) for n in nights] == [(0, 6, True), (1, 6, False)]
            assert {p.name: p.read_bytes() for p in (run_dir / "draft" / "export").iterdir()} == export
            assert {p.name: p.read_bytes() for p in (run_dir / "promoted").iterdir()} == export
            page.goto(f"{UI}/runs/flow-run/{night['id']}", wait_until="networkidle")
            page.get_by_text("continues the finished run").first.wait_for()
            page.screenshot(path=SHOTS / "3b-nightly-on-a-finished-run.png")
            plan = page.get_by_text("plan: skip").first                   # its first screen: what it will do
            plan.wait_for()
            assert plan.bounding_box()["y"] < 1000, plan.bounding_box()
            # one message: the plan, check's summary and the night's lines (not check's 100 facts)
            assert "check: passed" in plan.inner_text() and "continues the finished run" in plan.inner_text()
            assert page.get_by_text("disk_gb_per_1m").count() == 0
            keys_before = {a["key"] for a in _artifacts("-debug-tiny-")}
            (report,) = _artifacts(report["key"])          # the night published this run's report again

            # a second run in another run directory: its artifacts sit beside the first run's
            page.goto("about:blank")        # not a run page that polls and redraws its graph meanwhile, unwatched
            with _loaded_machine():                     # its speeds are measured on a busy machine: flagged
                second = _run_deployment(served / "runs" / "second" / "debug_tiny", epochs=3)
            assert second["state"]["type"] == "COMPLETED", second["state"]
            second_md = (served / "runs" / "second" / "debug_tiny" / "report.md").read_text()
            assert "**Loaded machine**: load average" in second_md and "left out, offline" in second_md
            keys_after = {a["key"] for a in _artifacts("-debug-tiny-")}
            assert keys_before < keys_after and len([k for k in keys_after if k.startswith("eagle3-report-")]) == 2
            assert _artifacts(report["key"])[0]["latest_id"] == report["latest_id"]   # the first report, unchanged
            page.goto(f"{UI}/artifacts", wait_until="networkidle")
            page.screenshot(path=SHOTS / "6-artifacts-of-two-runs.png", full_page=True)

            # a failed run: its log in the UI names the cause
            failed = _run_deployment(served / "runs" / "failed" / "debug_tiny", sources=["no/such/prompts.jsonl"])
            assert failed["state"]["type"] == "FAILED", failed["state"]
            page.goto(f"{UI}/runs/flow-run/{failed['id']}", wait_until="networkidle")
            cause = page.get_by_text("no/such/prompts.jsonl").first
            cause.wait_for()
            page.screenshot(path=SHOTS / "5-failed-run-log.png")
            # among the first lines, on the first screen: the cause and its fix, not under a dump or a traceback
            assert cause.bounding_box()["y"] < 1000, cause.bounding_box()
            assert "give an existing" in cause.inner_text()
            assert page.get_by_text("Traceback").count() == 0
            _killed_server_run(page, served / "runs" / "killed" / "debug_tiny")
            _cancelled_generation(page, served / "runs" / "cancelled" / "debug_tiny")
        except BaseException:
            page.screenshot(path=SHOTS / "failure.png", full_page=True)          # kept for the failed check
            raise
        finally:
            browser.close()
    # the run used the changed parameter: 3 training epochs in the draft's manifest
    draft = json.loads((served / "runs" / "debug_tiny" / "draft" / "manifest.json").read_text())
    assert len(draft["history"]) == 3


def _artifacts(key_part: str) -> list[dict]:
    """The latest artifact of every key containing `key_part` (Prefect's REST API), newest first."""
    r = httpx.post(f"{UI}/api/artifacts/latest/filter", json={"artifacts": {"key": {"like_": key_part}},
                                                             "sort": "UPDATED_DESC"}, timeout=30)
    r.raise_for_status()
    return r.json()


def _flow_run_id(page, name: str, server_log: Path, timeout_s: float = 120) -> str:
    """The id of the flow run named `name` (Prefect's REST API), waited for until the server has it; else an
    AssertionError with the browser's failed requests and the server log's errors (the UI shows only 'Something went
    wrong' when its request fails). It waits through `page`: Playwright's sync API delivers the browser's response
    events (FAILED_REQUESTS) only inside its own calls."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = httpx.post(f"{UI}/api/flow_runs/filter", json={"flow_runs": {"name": {"any_": [name]}}}, timeout=30)
        r.raise_for_status()
        if r.json():
            return r.json()[0]["id"]
        page.wait_for_timeout(1000)
    errors = [line for line in server_log.read_text().splitlines() if re.search(r"error|exception| [45]\d\d ", line,
                                                                                  re.I)]
    raise AssertionError(f"no flow run named {name!r} {timeout_s} s after the form was submitted; the browser's "
                         f"failed requests: {FAILED_REQUESTS[-10:]}; server log {server_log}, its error lines: "
                         f"{errors[-30:]}")


class _loaded_machine:
    """Busy loops, two per CPU, for the block: the 1-minute load average rises above the CPUs."""

    def __enter__(self):
        n = 2 * len(os.sched_getaffinity(0))
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()


def _log_lines(run_ids: list[str], like: str | None = None) -> list[dict]:
    """Log entries (REST API), oldest first, of the flow runs `run_ids` and their task runs, containing `like`: every
    page of them (the API answers at most 200 a call; a run's log passes that, and a cancel's line comes last)."""
    flt, entries = {"logs": {"flow_run_id": {"any_": run_ids}}}, []
    while True:
        r = httpx.post(f"{UI}/api/logs/filter", json={**flt, "sort": "TIMESTAMP_ASC", "limit": 200,
                                                      "offset": len(entries)}, timeout=30)
        r.raise_for_status()
        entries += r.json()
        if len(r.json()) < 200:
            return [e for e in entries if like is None or like in e["message"]]


def _wait_log_line(run_id: str, like: str, timeout_s: float = 30) -> list[dict]:
    """`_log_lines` of one run once `like` is there: a flow process sends its log in batches every few seconds
    (Prefect's APILogWorker), so a line logged in a hook as the run ends reaches the API after its state."""
    deadline = time.monotonic() + timeout_s
    while not (said := _log_lines([run_id], like=like)) and time.monotonic() < deadline:
        time.sleep(1)
    return said


def _subflows(parent: str) -> list[dict]:
    r = httpx.post(f"{UI}/api/flow_runs/filter", json={"flow_runs": {"parent_flow_run_id": {"any_": [parent]}}},
                   timeout=30)
    r.raise_for_status()
    return r.json()


def _server_started(run_dir: Path, run: dict) -> int:
    """The pid of the generation server a run of `run_dir` started (its start-servers log line), waited for."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        subflows = [sub["id"] for sub in _subflows(run["id"]) if sub["name"].endswith("-generation")]
        for e in _log_lines(subflows, like="started: pid") if subflows else []:     # the start-servers task's
            return int(e["message"].split("started: pid ")[1].split(",")[0])
        state = httpx.get(f"{UI}/api/flow_runs/{run['id']}", timeout=30).json()["state"]["type"]
        assert state not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"), f"the run ended first: {state}"
        time.sleep(0.5)
    raise AssertionError(f"no server of {run_dir} started")


def _killed_server_run(page, run_dir: Path) -> None:
    """A run whose llama-server is SIGKILLed as soon as it started: Failed with the cause as its state message, its
    page names the cause once, on its first screen (the parent's log holds it once, with its fix; later lines refer
    to it)."""
    run = _run_deployment(run_dir, wait=False)
    os.kill(_server_started(run_dir, run), signal.SIGKILL)
    run = _wait_run(run)
    assert run["state"]["type"] == "FAILED", run["state"]
    assert "killed by signal 9" in run["state"]["message"]                      # Prefect's state message: the text
    said = _wait_log_line(run["id"], "killed by signal 9")
    assert len(said) == 1 and "Fix the cause" in said[0]["message"], said
    page.goto(f"{UI}/runs/flow-run/{run['id']}", wait_until="networkidle")
    cause = page.get_by_text(re.compile("killed by signal 9")).first
    cause.wait_for()
    page.screenshot(path=SHOTS / "7-killed-server-run.png", full_page=True)
    # once on the page, on its first screen (below the run graph, the plan and the prompts stage's line)
    assert page.get_by_text(re.compile("killed by signal 9")).count() == 1
    assert cause.bounding_box()["y"] < 1000, cause.bounding_box()
    assert page.get_by_text("print_timing").count() == 0 and page.get_by_text("Traceback").count() == 0


def _cancelled_generation(page, run_dir: Path) -> None:
    """A run cancelled (as the UI's Cancel does: state Cancelling) while generation runs: the run and its
    subflows end Cancelled, its log says so."""
    from prefect.states import Cancelling
    run = _run_deployment(run_dir, wait=False)
    _server_started(run_dir, run)
    with _client() as client:
        client.set_flow_run_state(run["id"], Cancelling(), force=True)
    run = _wait_run(run)
    assert run["state"]["type"] == "CANCELLED", run["state"]
    deadline = time.monotonic() + 120
    while (subs := _subflows(run["id"])) and any(s["state"]["type"] not in ("CANCELLED", "COMPLETED", "FAILED",
                                                                             "CRASHED") for s in subs) \
            and time.monotonic() < deadline:
        time.sleep(1)
    ended = {s["name"]: s["state"]["type"] for s in subs}
    assert ended.get("debug_tiny-generation") == "CANCELLED", ended
    assert all(v in ("COMPLETED", "CANCELLED") for v in ended.values()), ended
    assert _wait_log_line(run["id"], "cancelled: "), "the cancelled run's log does not say so"
    page.goto(f"{UI}/runs/flow-run/{run['id']}", wait_until="networkidle")
    page.get_by_text("cancelled: ").first.wait_for()
    page.screenshot(path=SHOTS / "8-cancelled-run.png", full_page=True)


def _client():
    """Prefect's client of the test's server, for every write (creating a run, setting a state): on SQLite the
    server answers a write that loses the race for the database's write lock with 503 Service Unavailable, which
    Prefect's clients retry (prefect/server/api/server.py: is_client_retryable_exception; prefect/client/base.py:
    retry_codes). A bare HTTP call failed the cancel scenario that way (2026-12-06); reads never take the lock."""
    from prefect.client.orchestration import SyncPrefectClient
    return SyncPrefectClient(f"{UI}/api")


def _wait_run(run: dict) -> dict:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        run = httpx.get(f"{UI}/api/flow_runs/{run['id']}", timeout=30).json()
        if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return run
        time.sleep(3)
    raise AssertionError(f"flow run {run['id']} did not end in {RUN_TIMEOUT_S} s")


def _run_deployment(run_dir: Path, epochs: int | None = None, sources: list[str] | None = None,
                    nightly: bool = False, wait: bool = True) -> dict:
    """A run of eagle3-pipeline/debug-tiny through the REST API with run_dir (and epochs / prompt sources)
    changed, as the nightly schedule starts it if `nightly`, waited for until it ends; returns the flow run."""
    dep = httpx.get(f"{UI}/api/deployments/name/eagle3-pipeline/debug-tiny", timeout=30).json()
    config = dep["parameters"]["config"]
    config["run_dir"] = str(run_dir)
    if epochs is not None:
        config["train"]["epochs"] = epochs
    if sources is not None:
        config["prompts"]["sources"] = sources
    with _client() as client:                   # a write: Prefect's client (_client)
        created = client.create_flow_run_from_deployment(
            dep["id"], parameters={"config": config, "refresh": False, "nightly": nightly})
    run = {"id": str(created.id), "name": created.name}
    return _wait_run(run) if wait else run
