"""The report's and run log's number rules, without a browser or a Prefect server: ETAs only once there is a rate,
the load flag (load average and the stage's own earlier rate) kept out of the headline speed-up, each tok/s bar
against the baseline its label names, warnings only with enough held-out prompts, a warm-started draft labelled
so, numbers formatted for people and skipped stages said skipped."""
from __future__ import annotations

import json
import os
import time

import pytest

from eagle3_core.contract.numbers import checkpoint_place, eta_text, human_bytes, machine_load, percent
from eagle3_core.evaluation.plots import run_label, tok_s_annotation
from eagle3_core.evaluation.speedup import load_flag
from eagle3_core.pipeline import report_numbers as nums
from eagle3_core.pipeline.report import markdown, warnings, write_plots
from flows.stage_flows import summary_line


def test_eta_only_once_there_is_a_rate():
    assert eta_text(0.2, 1, 9) == ""                   # the first item in 0.2 s: start-up, not a rate
    assert eta_text(30.0, 0, 9) == ""                  # only cached items so far
    assert eta_text(30.0, 3, 0) == ""                  # nothing left
    assert eta_text(30.0, 3, 1) == ", ETA 10 s"
    assert eta_text(30.0, 1, 3) == ", ETA 1.5 min"
    assert eta_text(3600.0, 1, 3) == ", ETA 3.0 h"


def test_numbers_for_people():
    assert human_bytes(4620.0) == "4.62 kB" and human_bytes(512) == "512 B" and human_bytes(1.5e9) == "1.5 GB"
    assert percent(1.0) == "100.0%" and percent(0.375) == "37.5%"
    assert checkpoint_place(10, 0) == "after epoch 10"         # not 'epoch 11, batch 0' after the last of 10
    assert checkpoint_place(2, 40) == "epoch 3, batch 40" and checkpoint_place(0, 0) == "before the first epoch"
    load = machine_load()
    assert load["cpus"] >= 1 and load["loadavg_1m"] == pytest.approx(os.getloadavg()[0], abs=5)


def test_summary_lines_format_numbers_and_say_skipped():
    m = {"samples": 6, "tokens": 900, "format": "bf16", "bytes_per_token": 4620.0, "seconds": 102.5}
    assert summary_line("features", m) == ("features: done in 102.5 s (samples 6, tokens 900, format bf16, "
                                           "bytes_per_token 4.62 kB/token)")
    assert summary_line("vocab", {"draft_vocab_size": 64, "coverage": 1.0, "seconds": 1.0}) == \
        "vocab: done in 1.0 s (draft_vocab_size 64, coverage 100.0%)"
    line = summary_line("train", {"train_samples": 6, "steps": 10, "seconds": 102.5}, skipped=True)
    assert line == "train: skipped (done before this run) (train_samples 6, steps 10)" and "102.5" not in line


def test_load_flag_by_load_average_and_by_the_stages_earlier_rate():
    assert load_flag({"loadavg_1m": 1.5, "cpus": 2}, 10.0, 9.0) is None                 # quiet, as fast as before
    assert load_flag({"loadavg_1m": 5.2, "cpus": 2}) == "load average 5.2 on 2 CPUs"
    # the case: offline target-only 0.9 tok/s against 10 on a quiet machine earlier
    assert load_flag({"loadavg_1m": 1.0, "cpus": 2}, 0.9, 10.0, "the target alone") == \
        "the target alone measured 0.9 tok/s against 10.0 earlier on this run"
    assert load_flag(None, 6.0, 10.0) is None                                           # within 2x: not flagged


def _eval(prompts: int = 16, base_tps: float = 10.0, load: float = 0.5) -> dict:
    run = lambda tau, tps: {"tau": tau, "tau_ci95": [tau - 0.05, tau + 0.05], "tokens_from_verify": 100,  # noqa: E731
                            "verify_steps": 50, "tokens_per_s": tps, "speedup": tps / base_tps, "prompts": prompts,
                            "accept_per_position": [0.6, 0.4, 0.2], "params": {"num_steps": 3},
                            "lossless": {"equal": prompts, "near_tie": 0, "mismatch": 0}}
    return {"trained": run(1.8, 1.6 * base_tps), "untrained": run(1.0, 0.5 * base_tps), "num_draft_steps": 3,
            "max_new_tokens": 32, "preflight": "passed", "machine_load": {"loadavg_1m": load, "cpus": 2},
            "baseline": {"tokens_per_s": base_tps, "tokens": 100, "target_forward_calls": 100, "prompts": prompts}}


def _report(tmp_path, ev: dict, llama_cpp: dict | None = None, init_from=None, earlier=None) -> dict:
    r = {"run_dir": str(tmp_path), "draft_dir": "d", "train_prompts": 6, "eval_prompts": 2, "samples": 6,
         "tokens": 100, "loss_tokens": 50, "server": "llama.cpp", "feature_bytes_per_token": 4620.0,
         "aux_layer_ids": [1, 2, 3], "draft_vocab_size": 64, "vocab_coverage": 1.0, "init_from": init_from,
         "best_epoch": {"epoch": 1, "tau_sim": 2.0}, "stage_seconds": {"train": "skipped", "evaluate": 3.0},
         "eval": ev, "llama_cpp": llama_cpp}
    r["speed"] = nums.speed_checks(r, earlier)
    return r


LLAMA = {"tau": 1.7, "tau_ci95": [1.6, 1.8], "tokens": 100, "tokens_per_s": 48.0, "baseline_tokens_per_s": 33.8,
         "speedup": 48.0 / 33.8, "num_draft_steps": 3, "acceptance_rate": 0.4, "draft_n_accepted": 4, "draft_n": 10,
         "lossless": {"equal": 16, "near_tie": 0, "mismatch": 0}, "machine_load": {"loadavg_1m": 0.3, "cpus": 2}}


def test_a_loaded_machines_speeds_are_flagged_and_left_out_of_the_headline(tmp_path):
    quiet = _report(tmp_path, _eval(), dict(LLAMA))
    assert quiet["speed"] == {"flags": {}, "reference": {"offline": 10.0, "llama_cpp": 33.8}}
    md = markdown(quiet)
    assert "- speed-up of the trained draft: 1.60x offline (chain, one stream); 1.42x on llama.cpp" in md
    assert "Loaded machine" not in md and "(loaded)" not in md
    # the next night: offline 0.9 tok/s against 10 before; llama.cpp measured under a load average of 5.1
    busy = _report(tmp_path, _eval(base_tps=0.9), {**LLAMA, "machine_load": {"loadavg_1m": 5.1, "cpus": 2}},
                   earlier=quiet["speed"])
    assert busy["speed"]["flags"] == {
        "offline": "the target alone (offline) measured 0.9 tok/s against 10.0 earlier on this run",
        "llama_cpp": "load average 5.1 on 2 CPUs"}
    assert busy["speed"]["reference"] == quiet["speed"]["reference"]        # a loaded rate never becomes the reference
    md = markdown(busy)
    head = next(line for line in md.splitlines() if line.startswith("- speed-up"))
    assert "x offline" not in head and "x on llama.cpp" not in head          # no ratio of a loaded machine
    assert head.count("left out") == 2 and "load average 5.1 on 2 CPUs" in head
    assert "1.60x (loaded)" in md and "**Loaded machine**: the target alone (offline) measured 0.9" in md
    assert "**Loaded machine**: load average 5.1 on 2 CPUs: this speed-up is not the engine's." in md


def test_each_tok_s_bar_against_the_baseline_its_label_names(tmp_path):
    r = _report(tmp_path, _eval(base_tps=0.94), dict(LLAMA))
    bars = {b["label"]: b for b in nums.speed_bars(r, run_label)}
    lc = bars["llama.cpp, EAGLE-3"]
    assert lc["baseline"] == "llama.cpp, no draft" and lc["ratio"] == pytest.approx(48.0 / 33.8)
    assert tok_s_annotation(lc) == " 48 (1.42x vs llama.cpp, no draft)"       # not 51x against the offline target
    assert tok_s_annotation(bars["llama.cpp, no draft"]) == " 33.8 (baseline)"
    tr = bars["trained, chain (S=3)"]
    assert tr["baseline"] == "target only (offline)" and tr["ratio"] == pytest.approx(1.6)
    r["plots"] = write_plots(r, tmp_path)
    assert (tmp_path / r["plots"]["tokens_per_s"]).read_bytes()[:4] == b"\x89PNG"


def test_warnings_only_with_enough_prompts(tmp_path):
    ev = _eval(prompts=2)
    ev["trained"].update(tau=1.1, tau_ci95=[1.05, 1.15])                       # would warn 'below 1.2'
    lc = {**LLAMA, "tau_ci95": [1.6, 1.8]}                                      # disjoint: would warn 'check d2t'
    assert warnings(ev, lc) == []
    md = markdown(_report(tmp_path, ev, lc))
    assert "check the aux layer ids" not in md and "No warnings: 2 held-out prompts are too few" in md
    ev8 = _eval(prompts=8)
    ev8["trained"].update(tau=1.1, tau_ci95=[1.05, 1.15])
    assert len(warnings(ev8, lc)) == 2


def test_a_warm_started_draft_is_not_called_untrained(tmp_path):
    fresh = markdown(_report(tmp_path, _eval()))
    assert "| untrained | chain S=3 |" in fresh
    warm = markdown(_report(tmp_path, _eval(), init_from="runs/x/promoted"))
    assert "| warm start, before training | chain S=3 |" in warm and "untrained" not in warm


def test_stage_times_by_stage_name_and_skipped(tmp_path):
    manifests = {}
    for d in ("prompts", "draft", "eval"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "manifest.json").write_text(json.dumps({"seconds": 102.54}))
        manifests[d] = {"seconds": 102.54}
    old = time.time() - 3600
    os.utime(tmp_path / "draft" / "manifest.json", (old, old))
    since = time.time() - 60
    assert nums.stage_times(tmp_path, manifests, since) == {"prompts": 102.5, "train": "skipped", "evaluate": 102.5}
    assert nums.stage_times(tmp_path, manifests, None)["train"] == 102.5
    md = markdown(_report(tmp_path, _eval()))
    assert "| train | evaluate | total |" in md and "| skipped | 3.0 | 3.0 |" in md


def test_every_form_field_has_a_description_and_runs_are_tagged_at_creation(tmp_path):
    """The deployment form (Prefect's schema of the flow's parameters): nightly, refresh, config and every field
    of every config model described; a deployment's runs carry run:<run dir name> and stage:<stage> from their
    creation (deployment tags), not only once they start."""
    from prefect.utilities.callables import parameter_schema

    from deployments.serve import creation_tags, deployment_specs
    from flows.pipeline import eagle3_pipeline
    from flows.stage_flows import deploy_sglang_flow, train_flow
    for fl in (eagle3_pipeline, train_flow, deploy_sglang_flow):
        schema = parameter_schema(fl.fn).model_dump()
        undescribed = [k for k, v in schema["properties"].items() if not v.get("description")]
        undescribed += [f"{d}.{f}" for d, sch in schema.get("definitions", {}).items()
                        for f, p in sch.get("properties", {}).items() if not p.get("description")]
        assert undescribed == [], (fl.name, undescribed)
    nightly = parameter_schema(eagle3_pipeline.fn).model_dump()["properties"]["nightly"]["description"]
    assert "nightly schedule" in nightly and "promoted only if tau is" in nightly
    tags = {sp["name"]: creation_tags(sp) for sp in deployment_specs(tmp_path / "runs", "UTC")}
    assert tags["debug-tiny"] == ["eagle3", "run:debug_tiny", "stage:pipeline"]
    assert tags["train"] == ["eagle3", "run:demo", "stage:train"]


def test_checks_log_line_is_a_summary_and_its_facts_an_artifact(tmp_path):
    """The run log's first screen gets one line of check's ~100 lines of facts (the rest: the check artifact)."""
    from eagle3_core.check import check_or_raise, render
    from eagle3_core.config import preset
    from tasks.report import check_summary
    facts = check_or_raise(preset("debug_tiny", tmp_path / "run"), log=lambda text: None)
    line = check_summary(facts)
    assert line.startswith("check: passed: target embedded (llama, 30 layers, hidden 576); aux layers [1, 14, 26]; "
                           "draft vocab 1024 of 49152; features need ")
    assert "\n" not in line and len(render(facts).splitlines()) > 50


def test_the_run_logs_first_message_is_the_plan_with_checks_line_and_the_nights(tmp_path, monkeypatch):
    """plan_stages_task logs one message: the plan first, then check's summary and the night's lines (one log
    entry on the run page, above the stages' lines); a finished stage is listed skipped, later ones to run."""
    from types import SimpleNamespace

    import tasks.report
    from eagle3_core.config import preset
    from eagle3_core.contract.layout import STAGE_DIRS
    from tasks.report import plan_stages_task
    logged = []
    monkeypatch.setattr(tasks.report, "get_run_logger",
                        lambda: SimpleNamespace(info=lambda fmt, *args: logged.append(fmt % args)))
    cfg = preset("debug_tiny", tmp_path / "run")
    said = ["check: passed: target embedded", "night 0: 6 train prompts"]
    assert plan_stages_task.fn(cfg, False, said) == {"skip": [], "run": list(STAGE_DIRS)}
    assert logged == ["plan: run every stage (none done for these inputs)\ncheck: passed: target embedded\n"
                      "night 0: 6 train prompts"]
    monkeypatch.setattr(tasks.report, "stage_done", lambda config, stage: stage == "prompts")
    assert plan_stages_task.fn(cfg, False, said[:1])["skip"] == ["prompts"]
    assert logged[-1] == (f"plan: skip prompts (done for these inputs); run {', '.join(list(STAGE_DIRS)[1:])}\n"
                          "check: passed: target embedded")
