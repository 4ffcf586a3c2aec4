"""Every stage key of the shipped configs, pinned byte for byte (tests/data/stage_keys.json, computed by
`stage_keys` below at the commit it names): a finished run of the demo, debug_tiny, configs/e2e_gsm8k.json or a Kimi
config stays done under today's code. Each pinned key (today's formula then, and the older formulas it accepted)
must still be accepted today (the key or an older-key rule: pipeline/table.Stage.older), given the upstream keys
pinned beside it, on a CPU host and on a CUDA host ('auto' batching resolved to padded or packed rows then).
A shipped config whose recipe changes on purpose (the stages it must redo) is repinned with the reason in the
file's `repinned` list."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from eagle3_core.config import load_config, preset
from eagle3_core.pipeline.keys import UPSTREAM
from eagle3_core.pipeline.table import STAGES

ROOT = Path(__file__).resolve().parents[1]
PINNED = ROOT / "tests" / "data" / "stage_keys.json"
CONFIGS = ["demo", "debug_tiny", "configs/e2e_gsm8k.json", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("kimi_k25_*.json"))]
HOSTS = ("cpu", "cuda")          # what torch.cuda.is_available() says where the run was keyed


def config(name: str):
    return preset(name) if name in ("demo", "debug_tiny") else load_config(ROOT / name)


def stage_keys(cfg, up_of=None) -> dict[str, list[str]]:
    """{stage: [its key, *its older keys]} for `cfg`, each stage given its upstream stages' keys: up_of[stage]
    ({upstream: key}) where given, else the keys computed here."""
    out: dict[str, list[str]] = {}
    for name, row in STAGES.items():
        up = (up_of or {}).get(name) or {u: out[u][0] for u in UPSTREAM[name]}
        out[name] = [row.key(cfg, up), *row.older(cfg, up)]
    return out


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("name", CONFIGS)
def test_every_pinned_stage_key_is_still_accepted(name, host, monkeypatch):
    pinned = json.loads(PINNED.read_text())["configs"]
    assert name in pinned, f"{name}: a shipped config without pinned keys: add it to {PINNED}"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: host == "cuda")
    then = pinned[name][host]
    up_of = {s: {u: then[u][0] for u in UPSTREAM[s]} for s in STAGES}
    now = stage_keys(config(name), up_of)
    assert set(now) == set(then), (name, "stages", set(now) ^ set(then))
    for stage, keys in then.items():
        missing = [k for k in keys if k not in now[stage]]
        assert not missing, (name, host, stage, "a run keyed", missing, "would redo its work; accepted now:",
                             now[stage])


def test_a_changed_config_changes_the_keys():
    """The pinned keys are of these settings: the demo with another learning rate is not done."""
    pinned = json.loads(PINNED.read_text())["configs"]["demo"]["cpu"]
    cfg = preset("demo")
    cfg.train.lr = 2e-3
    up_of = {s: {u: pinned[u][0] for u in UPSTREAM[s]} for s in STAGES}
    now = stage_keys(cfg, up_of)
    assert not set(now["train"]) & set(pinned["train"]) and now["vocab"][0] == pinned["vocab"][0]


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:      # once, on the commit named in the file
    import subprocess
    import unittest.mock
    out = {}
    for name in CONFIGS:
        for host in HOSTS:
            with unittest.mock.patch.object(torch.cuda, "is_available", lambda: host == "cuda"):
                out.setdefault(name, {})[host] = stage_keys(config(name))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    PINNED.write_text(json.dumps({"commit": commit, "configs": out}, indent=1) + "\n")
