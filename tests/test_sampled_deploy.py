"""Tau at the evaluation's sampling settings on the engines: llama-server's request fields (tools/server/README.md
of the pinned llama.cpp: its defaults top_k 40, top_p 0.95, min_p 0.05 would filter a sampled request further),
tau over prompts and seeds from llama.cpp's timings, the settings measured (eval.sampling, then the declared
serving settings), and the report's table of tau by temperature beside the offline rules. The real llama-server
at a sampled setting: tests/test_llama_cpp.py."""
import pytest

from eagle3_core.config import EvalConfig
from eagle3_core.config.sampling_config import SamplingConfig
from eagle3_core.evaluation.acceptance import bootstrap_ci
from eagle3_core.evaluation.llama_cpp_deploy import sampling_fields, summarize_sampled
from eagle3_core.evaluation.sampling_compare import tau_by_temperature, tau_by_temperature_markdown

T07 = SamplingConfig(temperature=0.7, top_p=0.9, top_k=0, seed=5)


def test_llama_cpp_request_fields_switch_off_its_default_filters():
    assert sampling_fields(SamplingConfig()) == {"temperature": 0.0, "top_k": 1}
    assert sampling_fields(T07) == {"temperature": 0.7, "top_k": 0, "top_p": 0.9, "min_p": 0.0, "seed": 5}
    assert sampling_fields(T07, seed=7)["seed"] == 7


def _row(pid, seed, predicted, accepted, drafted, tps):
    return {"id": pid, "seed": seed, "predicted_n": predicted, "draft_n_accepted": accepted, "draft_n": drafted,
            "tokens_per_s": tps}


def test_sampled_llama_cpp_tau_pools_each_prompts_seeds():
    spec = [_row("a", 0, 30, 20, 27, 60.0), _row("b", 0, 12, 2, 12, 30.0),
            _row("a", 1, 20, 10, 24, 50.0), _row("b", 1, 16, 4, 15, 40.0)]
    base = [_row(r["id"], r["seed"], r["predicted_n"], 0, 0, 25.0) for r in spec]
    s = summarize_sampled(base, spec)
    # verify steps = predicted - accepted: a 10 + 10, b 10 + 12; tokens a 50, b 28
    assert s["tau"] == pytest.approx(78 / 42) and s["verify_steps"] == 42 and s["prompts"] == 2
    assert s["tau_ci95"] == bootstrap_ci([50, 28], [20, 22])               # over prompts, seeds pooled per prompt
    assert s["acceptance_rate"] == pytest.approx(36 / 78) and s["requests"] == 4
    assert s["tokens_per_s"] == pytest.approx(78 / (30 / 60 + 12 / 30 + 20 / 50 + 16 / 40))
    assert s["speedup"] == pytest.approx(s["tokens_per_s"] / 25.0)
    assert "not checked" in s["lossless"]


def test_the_settings_measured_are_the_evaluations_then_the_declared_serving_ones():
    assert EvalConfig().measured_samplings == [SamplingConfig()]
    e = EvalConfig(serving=SamplingConfig(temperature=0.7))
    assert [s.temperature for s in e.measured_samplings] == [0.0, 0.7]
    assert EvalConfig(sampling=T07, serving=T07).measured_samplings == [T07]          # the same: measured once


def test_the_report_sets_llama_cpp_beside_the_offline_rules_per_temperature():
    ci = [1.5, 2.5]
    ev = {"sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0}, "trained": {"tau": 2.0, "tau_ci95": ci},
          "at_serving": {"sampling": T07.model_dump(), "trained": {"tau": 1.8, "tau_ci95": ci, "rules": {
              "sampled": {"tau": 1.8, "tau_ci95": [1.6, 2.0]}, "greedy_draft": {"tau": 1.6, "tau_ci95": [1.4, 1.8]}}}}}
    lc = {"tau": 1.9, "tau_ci95": [1.7, 2.1], "by_sampling": [
        {"sampling": SamplingConfig().model_dump(), "tau": 1.9, "tau_ci95": [1.7, 2.1]},
        {"sampling": T07.model_dump(), "tau": 1.5, "tau_ci95": [1.3, 1.7]}]}
    rows = tau_by_temperature(ev, lc)
    assert rows[0] == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "greedy_draft": (2.0, ci), "sampled": None,
                       "llama_cpp": (1.9, [1.7, 2.1])}
    assert rows[1]["greedy_draft"] == (1.6, [1.4, 1.8]) and rows[1]["sampled"] == (1.8, [1.6, 2.0])
    assert rows[1]["llama_cpp"] == (1.5, [1.3, 1.7]) and rows[1]["top_p"] == 0.9
    md = "\n".join(tau_by_temperature_markdown(ev, lc))
    assert "| 0.7 | 0.9 | off | 1.60 (1.40-1.80) | 1.80 (1.60-2.00) | 1.50 (1.30-1.70) |" in md
    assert "| 0 | 1 | off | 2.00 (1.50-2.50) | - | 1.90 (1.70-2.10) |" in md
    old_lc = {"tau": 1.9, "tau_ci95": [1.7, 2.1]}                      # a deployment before by_sampling: greedy
    assert tau_by_temperature(ev, old_lc)[1]["llama_cpp"] is None
    assert tau_by_temperature(ev, old_lc)[0]["llama_cpp"] == (1.9, [1.7, 2.1])
    assert tau_by_temperature_markdown({"trained": {"tau": 2.0, "tau_ci95": ci}}, old_lc) == []   # greedy only
