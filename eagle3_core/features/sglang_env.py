"""The environment the 'sglang' features backend runs in (config's sglang_python): which sglang version and which of
the packages its ranks import it has, read by running that interpreter (nothing imported here), and what `check`
refuses about it (sglang_env_check), and the interpreter its torchrun ranks run with (sglang_python): the two
facts the backend's row names (features.backends). The pinned version is config.feature_config.SGLANG_VERSION."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from eagle3_core.config import PipelineConfig
from eagle3_core.config.feature_config import SGLANG_VERSION

# what eagle3_core itself imports in the ranks of the 'sglang' backend (features/sglang_worker.py and the store it
# writes through), beside SGLang; tests/test_sglang_backend.py checks that the list is complete
SGLANG_WORKER_PACKAGES = ("torch", "safetensors", "pydantic", "pyarrow", "httpx", "tenacity", "huggingface_hub")
_PROBE = ("import importlib.metadata as m, importlib.util as u, json, sys\n"
          "try:\n    v = m.version('sglang')\nexcept m.PackageNotFoundError:\n    v = None\n"
          "print(json.dumps({'version': v, 'missing': [p for p in sys.argv[1:] if u.find_spec(p) is None]}))")


def probe_sglang(python: str | None) -> dict:
    """{python, version (of the sglang distribution there, None if absent), missing (SGLANG_WORKER_PACKAGES it
    lacks), error} of the interpreter `python` (None: this one), read by running it (importlib.metadata: nothing
    is imported; a minute at most). error: why it could not be run (no such file, timeout), else None."""
    python = python or sys.executable
    try:
        done = subprocess.run([python, "-c", _PROBE, *SGLANG_WORKER_PACKAGES], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"python": python, "version": None, "missing": None, "error": f"{type(e).__name__}: {e}"}
    if done.returncode != 0:
        return {"python": python, "version": None, "missing": None, "error": done.stderr.strip()[-300:]}
    return {"python": python, **json.loads(done.stdout.strip().splitlines()[-1]), "error": None}


def sglang_env_problems(env: dict, on_gpu_host: bool) -> list[tuple[str, str]]:
    """Problems of the 'sglang' backend's environment `env` (probe_sglang): another sglang version is refused
    anywhere; no sglang (or an interpreter that does not run), or missing packages, only on a host with GPUs (the
    host that runs the stage; elsewhere, e.g. an offline check on a laptop, they are facts, not refusals)."""
    make = (f"`make sglang-env` makes .venv-sglang (sglang=={SGLANG_VERSION} and "
            f"{', '.join(SGLANG_WORKER_PACKAGES[1:])}); then set sglang_python to .venv-sglang/bin/python")
    if env["version"] is not None and env["version"] != SGLANG_VERSION:
        return [("sglang_python", f"{env['python']} has sglang {env['version']}; the 'sglang' backend is "
                 f"written against sglang=={SGLANG_VERSION} (features/sglang_runner.py lists the internals it "
                 f"uses): install that version there ({env['python']} -m pip install sglang=={SGLANG_VERSION}) "
                 f"or give another environment: {make}")]
    if not on_gpu_host:
        return []
    if env["version"] is None:
        why = env["error"] or "no sglang installed"
        return [("sglang_python", f"{env['python']}: {why}; the 'sglang' backend needs "
                 f"sglang=={SGLANG_VERSION} there: {make}")]
    if env["missing"]:
        return [("sglang_python", f"{env['python']} lacks {env['missing']}, which the ranks import beside "
                 f"SGLang: {env['python']} -m pip install {' '.join(env['missing'])}")]
    return []


def sglang_python(cfg: PipelineConfig) -> dict:
    """run_torchrun's `python` and `env` for the 'sglang' backend's ranks (its row's python): cfg.sglang_python
    with this project first on PYTHONPATH (its eagle3_core, the SGLang environment's packages); {} (this process's
    python) when sglang_python is unset."""
    if not cfg.sglang_python:
        return {}
    root = str(Path(__file__).resolve().parents[2])
    return {"python": cfg.sglang_python,
            "env": {"PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}}


def sglang_env_check(cfg: PipelineConfig, gpus: tuple[int, int] | None,
                     env: dict | None = None) -> tuple[dict, list[tuple[str, str]]]:
    """({'sglang_env': ...}, problems) of the environment the 'sglang' backend's ranks run in (its row's
    python_check, run by check): probe_sglang's answer for cfg.sglang_python (`env`: that answer given instead),
    noted as not refused on a host without GPUs (`gpus` None), and sglang_env_problems."""
    env = probe_sglang(cfg.sglang_python) if env is None else env
    fact = env if gpus or env["version"] else {**env, "note": "not refused here: no GPU on this host, which is not "
                                                              "where the stage runs"}
    return {"sglang_env": fact}, sglang_env_problems(env, bool(gpus))
