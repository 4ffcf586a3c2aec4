"""The Prefect UI in a real browser (Debian's chromium, headless, driven by Playwright): `make server` serves the
UI on 127.0.0.1:4200 and `make deploy` serves the deployments; the browser finds the end-to-end deployment of the
smallest preset, starts a custom run with one parameter changed, and watches it complete. Screenshots go to
test-artifacts/ui/. Run with `make test-ui` (CI: .ci/run); needs port 4200 free."""
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.ui

ROOT = Path(__file__).resolve().parents[1]
UI = "http://127.0.0.1:4200"
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


def _wait_for(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{proc.args} exited: {log.read_text()[-3000:]}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"{url} not ready after {timeout_s} s; log {log}: {log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", 4200)) != 0, "port 4200 is in use: stop that server first"
    tmp = tmp_path_factory.mktemp("ui")
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect"), "EAGLE3_RUN_ROOT": str(tmp / "runs"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    server = _start("server", env, tmp / "server.log")
    procs = [server]
    try:
        _wait_for(f"{UI}/api/health", server, tmp / "server.log", 180)
        deploy = _start("deploy", env, tmp / "deploy.log")
        procs.append(deploy)
        _wait_for(f"{UI}/api/deployments/name/eagle3-pipeline/debug-tiny", deploy, tmp / "deploy.log", 300)
        yield tmp
    finally:
        for p in reversed(procs):
            _stop(p)


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
            page.wait_for_url("**/deployment/**")
            page.get_by_role("link", name=run_name).first.click()
            page.wait_for_url("**/flow-run/**")
            state = page.locator(".state-badge").first
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while time.monotonic() < deadline and state.inner_text().strip() not in ("Completed", "Failed",
                                                                                     "Crashed", "Cancelled"):
                time.sleep(5)
                page.reload(wait_until="networkidle")
                state = page.locator(".state-badge").first
            page.screenshot(path=SHOTS / "2-flow-run.png", full_page=True)
            assert state.inner_text().strip() == "Completed", (SHOTS / "2-flow-run.png")
        finally:
            browser.close()
    # the run used the changed parameter: 3 training epochs in the draft's manifest
    import json
    draft = json.loads((served / "runs" / "debug_tiny" / "draft" / "manifest.json").read_text())
    assert len(draft["history"]) == 3
