"""The reference case rehearsed (docs/reference_case.md, "What the rehearsal proves"): the shipped Kimi-K2.5 configs
read as shipped, with only the declared sizes and locations of tests/rehearsal_configs.py overridden, through the
stages they name. This module: `check` and `plan` of the three configs (the team's config refused by check and
planned to the team's own figures)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from eagle3_core.check import check_run, target_config_file
from eagle3_core.config import load_config
from eagle3_core.features.store_formats import bytes_per_token
from eagle3_core.plan import load_rates, main as plan_main, plan_run
from rehearsal_configs import DECLARED, config_path, overridden_fields, rehearsal_config, shipped

RATES = ROOT / "configs" / "rates.json"
KIMI_CONFIG = ROOT / "tests" / "data" / "kimi_k25" / "config.json"
NODE = dict(memory=(128 << 30, "head node"), gpus=(8, 141 << 30))          # one node of 8 x H200


def _pinned_sglang() -> dict:
    """probe_sglang's answer for an interpreter holding the pinned sglang and every package its ranks import."""
    from eagle3_core.config.feature_config import SGLANG_VERSION
    return {"python": ".venv-sglang/bin/python", "version": SGLANG_VERSION, "missing": [], "error": None}


def _stage(p, name):
    return next(r for r in p["stages"] if r["stage"] == name)


def test_only_declared_fields_are_overridden_and_anything_else_is_refused(tmp_path):
    cfg = rehearsal_config("kimi_k25_smoke", {"run_dir": str(tmp_path), "prompts.num_train": 77},
                           sources={"ultrachat-200k": {"count": 1, "hf": "json", "data_files": "x.jsonl"}})
    assert cfg.prompts.num_train == 77 and cfg.run_dir == tmp_path
    assert cfg.features.format == "fp8" and cfg.generation.api == "sglang"        # the rest as shipped
    changed = overridden_fields("kimi_k25_smoke", cfg.model_dump(mode="json", exclude_unset=True))
    assert changed == {"run_dir", "prompts.num_train", "prompts.mix.sources.*.count",
                       "prompts.mix.sources.*.hf", "prompts.mix.sources.*.data_files"} and changed <= DECLARED
    with pytest.raises(AssertionError, match="features.format is neither a size nor a location"):
        rehearsal_config("kimi_k25_smoke", {"features.format": "bf16"})
    with pytest.raises(AssertionError, match="source field mode is not declared"):
        rehearsal_config("kimi_k25_smoke", {}, sources={"ultrachat-200k": {"mode": "keep"}})
    assert shipped("kimi_k25_smoke")["features"]["format"] == "fp8"


@pytest.mark.slow          # builds Kimi-K2.5's 61-layer meta model twice (in-process and per-GPU fit): 41 s at load 20
def test_check_passes_the_two_run_configs_on_one_node_and_refuses_the_teams_naming_the_field():
    """As shipped, offline from Kimi-K2.5's config.json on one node of 8 x 141 GB: the agentic and smoke configs
    pass; the team's (max length 2,048, 2,048 new tokens) is refused: no room for a prompt in a sample."""
    kimi = target_config_file(KIMI_CONFIG)
    for name in ("kimi_k25_agentic_100k", "kimi_k25_smoke"):
        facts, problems = check_run(load_config(config_path(name)), target_config=kimi, **NODE,
                                    sglang_env=_pinned_sglang())
        assert problems == [], (name, problems)
        assert facts["token_budget"]["room_for_the_prompt"] > 0
    facts, problems = check_run(load_config(config_path("kimi_k25_team_10k_to_100k")), target_config=kimi, **NODE,
                                sglang_env=_pinned_sglang())
    assert [f for f, _ in problems] == ["generation.max_new_tokens"], problems
    assert "2048 leaves no room for a prompt in features.max_length 2048" in problems[0][1]
    assert facts["token_budget"]["room_for_the_prompt"] == 0


def test_plan_reproduces_the_teams_figures_from_their_rates_and_their_mean_sample_length():
    """The team's config with its own rates (profile reference_kimi_k25) on one node of 8 GPUs:
    - generation 94,248 regenerated samples (99,000 less the 4,752 kept Kimi trajectories) x 2,000 tokens at
      2,300 tok/s = 22.8 h (the team: 200M tokens, ~24 h);
    - extraction 99,000 samples at 1.48 samples/s = 18.6 h (the team: 18.8 h for 100K);
    - disk: the store holds 57,353 B a token in bf16 (8 x 7,168 + 9: store_formats.bytes_per_token), so 2,000
      tokens a sample are 114.7 MB and 99,000 samples 11.36 TB. The team gave ~92 GB per 1K samples, i.e. 92 MB a
      sample = 0.802 of 114.7 MB: at 57,353 B a token that is 92e6 / 57,353 = 1,604 tokens a sample, the mean
      length their 9.2 TB implies (samples shorter than max length). Planned at that mean length the store holds
      99,000 x 1,604 x 57,353 B = 9.107 TB: the team's 9.2 TB for 100K samples is 9.11 TB for the 99,000 trained.
    So the 11.36 TB is the same store at 2,000 tokens a sample, not a disagreement on bytes a token."""
    cfg = load_config(config_path("kimi_k25_team_10k_to_100k"))
    bf16 = cfg.model_copy(update={"features": cfg.features.model_copy(update={"format": "bf16"})})
    rates = load_rates(RATES, "reference_kimi_k25")
    p = plan_run(bf16, rates, gpus=8)
    assert round(_stage(p, "generation")["hours"], 1) == 22.8
    assert round(_stage(p, "features")["hours"], 1) == 18.6
    per_token = bytes_per_token("bf16", 7168)
    assert per_token == 57353 and p["disk_bytes"] == 99000 * 2000 * per_token
    assert round(p["disk_bytes"] / 1e12, 2) == 11.36
    team_bytes = rates["feature_bytes_per_sample"]["value"]
    assert team_bytes == 92e6 and round(team_bytes / (2000 * per_token), 3) == 0.802
    mean_len = round(team_bytes / per_token)
    assert mean_len == 1604
    at_mean = {**rates, "tokens_per_sample": {**rates["tokens_per_sample"], "value": mean_len}}
    q = plan_run(bf16, at_mean, gpus=8)
    assert q["disk_bytes"] == 99000 * 1604 * per_token and round(q["disk_bytes"] / 1e12, 1) == 9.1
    assert round(100000 * team_bytes / 1e12, 1) == 9.2
    # generation and extraction do not depend on the length here (the team's rates are per answer and per
    # sample); training, per token, scales with it
    for stage in ("generation", "features"):
        assert _stage(q, stage)["hours"] == _stage(p, stage)["hours"]
    assert _stage(q, "train")["hours"] == pytest.approx(_stage(p, "train")["hours"] * 1604 / 2000)


def _plan_cli(*args: str) -> str:
    """What `python -m eagle3_core.plan` (README's command line) prints, run as a user runs it."""
    done = subprocess.run([sys.executable, "-m", "eagle3_core.plan", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _with_format(out: str, fmt: str) -> str:
    """The plan table `out` prints for features.format `fmt` (the config's own format first, then the others)."""
    head = f"features {fmt}: "
    start = out.index(head)
    return out[start:out.index("| total", start)]          # "| total |" or "| total (without ...) |"


def test_plan_on_the_command_line_prints_the_teams_hours_and_their_9_1_tb_at_their_mean_length(tmp_path, capsys):
    """The team's config planned by plan's command line (one node of 8 GPUs, the team's profile, 11 TB free):
    22.77 h of generation, 18.58 h of extraction, 11.36 TB of bf16 features at their 2,000 tokens a sample (which
    do not fit 11 TB); and, run as a user runs it (`python -m eagle3_core.plan`), with the profile's
    tokens_per_sample at 1,604, the mean length their ~92 MB a sample implies (the reconciliation above), 9.11 TB:
    the team's 9.1 TB, the hours of generation and extraction unchanged."""
    team = str(config_path("kimi_k25_team_10k_to_100k"))
    args = [team, "--profile", "reference_kimi_k25", "--gpus", "8", "--disk", "11TB"]
    assert plan_main(args) == 0
    out = capsys.readouterr().out
    assert "99000 samples (94248 regenerated), 2000 tokens and 2000 answer tokens per sample" in out
    assert "| generation | 22.77 |" in out and "| features | 18.58 |" in out
    assert "| features | 18.58 | 148.6 | 11.36 TB |" in _with_format(out, "bf16")
    assert "| bf16 | 11.36 TB | no |" in out
    rates = json.loads(RATES.read_text())
    rates["profiles"]["reference_kimi_k25"]["rates"]["tokens_per_sample"]["value"] = 1604
    (tmp_path / "rates.json").write_text(json.dumps(rates))
    at_mean = _plan_cli(*args, "--rates", str(tmp_path / "rates.json"))
    assert "99000 samples (94248 regenerated), 1604 tokens and 2000 answer tokens per sample" in at_mean
    bf16 = _with_format(at_mean, "bf16")
    assert "| features | 18.58 | 148.6 | 9.11 TB |" in bf16 and "| generation | 22.77 |" in bf16
    assert "| bf16 | 9.11 TB | yes |" in at_mean
