"""requirements.lock (pip constraints: `make setup`, `.ci/run` through `make test`, the README's commands) pins every
package the tests and the demo use, and this install follows it: a test whose expected value is a library's (e.g.
transformers' parallel plans in tests/test_parallel_fit.py) is checked against the pinned release."""
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _name(req: str) -> str:
    """The normalised project name of a requirement string (PEP 503: lower case, runs of -_. as -)."""
    return re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)[1]).lower()


def locked() -> dict[str, str]:
    """{normalised name: version} of requirements.lock."""
    lines = (ROOT / "requirements.lock").read_text().splitlines()
    return {_name(x): x.split("==", 1)[1].strip() for x in lines if x.strip() and not x.startswith("#")}


def test_the_lock_pins_every_dependency_including_transformers_torch_and_prefect():
    import tomllib
    pins = locked()
    assert {"transformers", "torch", "prefect"} <= set(pins)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    assert not [r for r in declared if _name(r) not in pins], "declared but not pinned: run make lock"
    makefile = (ROOT / "Makefile").read_text()
    assert "LOCK := requirements.lock" in makefile and "-c $(VENV)/constraints.txt" in makefile
    for extra in re.findall(r"--no-deps -c \$\(VENV\)/constraints.txt ([\w -]+)", makefile)[0].split():
        assert _name(extra) in pins, extra                   # the packages installed without their dependencies


def test_this_install_has_the_locked_versions():
    """A venv made by `make setup` holds exactly the lock's versions; torch only where it is the lock's CPU build
    (a GPU host installs another with TORCH_SPEC, as the Makefile says)."""
    import torch
    wrong = {}
    for name, want in locked().items():
        if name == "torch" and torch.version.cuda is not None:
            continue
        try:
            have = version(name)
        except PackageNotFoundError:
            have = None
        if have is None or have.split("+")[0] != want:
            wrong[name] = (have, want)
    assert not wrong, f"installed vs requirements.lock: {wrong}; run `make setup` (or `make lock` to move the pins)"


def test_the_pinned_transformers_gives_the_kimi_k25_expert_parallel_figure(request):
    """The exact figure test_parallel_fit asserts within a range for any release, pinned here for the locked one:
    transformers 5.25.0's plans keep 259.16 GB per rank at EP 8 (268.3 GB was seen with another release)."""
    import transformers
    if transformers.__version__ != locked()["transformers"]:
        pytest.fail(f"transformers {transformers.__version__} is not the locked {locked()['transformers']}")
    from test_check import kimi_k25
    from test_parallel_fit import H200, TB, _check
    facts, _ = _check(kimi_k25.__wrapped__(), H200, 8 * TB, backend="hf_tp", tp_size=8, expert_parallel=True)
    assert locked()["transformers"] == "5.25.0" and facts["param_gb_per_rank_bf16"][8] == 259.16
