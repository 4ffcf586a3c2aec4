"""Offline evaluation on the embedded target (chain, tree and a subset run; tau per category; matched baselines),
simulated-vs-measured tau, and the report's Markdown and PNG plots."""
import pytest

from eagle3_core.data.chat import prompt_ids
from eagle3_core.evaluation.acceptance import SpecRun, bootstrap_ci, measure, paired_bootstrap_diff_ci, tau_consistency
from eagle3_core.evaluation.speculate import TargetRunner, greedy_generate
from eagle3_core.pipeline.report import embed_images, markdown, plots_markdown_inline, warnings, write_plots
from test_speculate import PROMPT, RankedDraft, ScriptedDraft

N_NEW = 10


@pytest.fixture(scope="module")
def measured(target_model, tokenizer):
    """Prompt 0 ('code') is the one the scripted draft knows; prompt 1 ('chat') is not: its drafts are wrong."""
    runner = TargetRunner(target_model, [1, 14, 26])
    prompts = [prompt_ids(tokenizer, PROMPT), prompt_ids(tokenizer, [{"role": "user", "content": "Say hi."}])]
    ref = greedy_generate(runner, prompts[0], N_NEW, set())
    draft = RankedDraft(prompts[0] + ref["tokens"], 49152)
    runs = {"trained": SpecRun(draft, 3), "trained_tree": SpecRun(draft, 3, 2, 6),
            "untrained": SpecRun(ScriptedDraft([], 49152, wrong=True), 3, prompt_idx=[1])}
    return measure(runner, runs, prompts, ["code", "chat"], N_NEW, set(), 1e-3)


@pytest.mark.slow
def test_measure_reports_runs_categories_and_matched_baselines(measured):
    rep = measured
    assert rep["baseline"]["prompts"] == 2 and rep["baseline"]["tokens"] == 2 * N_NEW
    for name in ("trained", "trained_tree", "untrained"):
        d = rep[name]
        assert d["lossless"]["mismatch"] == 0
        assert d["target_forward_calls"] == d["prompts"] + d["verify_steps"]
        assert d["tau"] == pytest.approx(d["tokens_from_verify"] / d["verify_steps"])
        assert d["speedup"] == pytest.approx(d["tokens_per_s"] / d["baseline_tokens_per_s"])
        assert d["tau_ci95"][0] <= d["tau"] <= d["tau_ci95"][1]
    tr, tree, un = rep["trained"], rep["trained_tree"], rep["untrained"]
    assert tr["params"] == {"num_steps": 3, "topk": 1, "num_draft_tokens": 4}
    assert tree["params"] == {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}
    # per category: the scripted prompt accepts drafts, the other accepts (almost) none
    assert set(tr["per_category"]) == {"chat", "code"} and tr["per_category"]["code"]["prompts"] == 1
    assert tr["per_category"]["code"]["tau"] > tr["per_category"]["chat"]["tau"]
    assert tree["per_category"]["code"]["tau"] > tr["per_category"]["code"]["tau"]   # rank-2 tokens accepted
    assert un["prompts"] == 1 and un["tau"] == 1.0 and un["accept_per_position"][0] == 0.0
    assert list(un["per_category"]) == ["chat"]
    assert len(tr["accept_per_position"]) == 3 and all(0 <= a <= 1 for a in tree["accept_per_position"])


def _manifest(acc_train, acc_eval=None):
    return {"best": {"epoch": 1, "tau_sim": 9.9}, "history": [
        {"epoch": 0, "train": {"acc": [0.0, 0.0]}, "eval": None},
        {"epoch": 1, "train": {"acc": acc_train}, "eval": {"acc": acc_eval} if acc_eval else None}]}


def test_simulated_vs_measured_tau_and_the_flag():
    c = tau_consistency(1.9, _manifest([0.6, 0.5, 0.5]), 3)            # 1 + .6 + .3 + .15 = 2.05
    assert c["tau_sim_at_steps"] == pytest.approx(2.05) and c["steps_compared"] == 3 and c["metrics_from"] == "train"
    assert not c["flagged"] and c["relative_gap"] == pytest.approx(1.9 / 2.05 - 1)
    c = tau_consistency(1.05, _manifest([0.9, 0.5, 0.5], [0.6, 0.5]), 5)  # eval metrics, 2 steps: 1 + .6 + .3
    assert c["tau_sim_at_steps"] == pytest.approx(1.9) and c["steps_compared"] == 2 and c["metrics_from"] == "eval"
    assert c["flagged"] and "aux layer ids, d2t, chat template" in c["note"]
    with pytest.raises(ValueError, match="best epoch 7"):
        tau_consistency(1.0, {"best": {"epoch": 7}, "history": []}, 3)


def test_report_markdown_and_plots(measured, tmp_path):
    ev = {**measured, "num_draft_steps": 3, "max_new_tokens": N_NEW, "preflight": "passed",
          "consistency": tau_consistency(measured["trained"]["tau"], _manifest([0.6, 0.5, 0.5]), 3)}
    r = {"run_dir": str(tmp_path), "draft_dir": "d", "train_prompts": 6, "eval_prompts": 2, "samples": 6,
         "tokens": 100, "loss_tokens": 50, "server": "llama.cpp", "feature_bytes_per_token": 4608.0,
         "aux_layer_ids": [1, 14, 26], "draft_vocab_size": 1024, "vocab_coverage": 1.0,
         "best_epoch": {"epoch": 1, "tau_sim": 2.0}, "stage_seconds": {"eval": 1.0}, "eval": ev, "llama_cpp": None}
    r["plots"] = write_plots(r, tmp_path)
    assert set(r["plots"]) == {"acceptance_per_position", "tau", "tokens_per_s"}
    for rel in r["plots"].values():
        png = (tmp_path / rel).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    md = markdown(r)
    assert "| trained_tree | tree k=2, T=6 | 2 |" in md and "| untrained | chain S=3 | 1 |" in md
    assert "| code |" in md and "| chat |" in md and "vs simulated 2.05 over 3 draft steps" in md
    assert "![tau](plots/tau.png)" in md
    assert plots_markdown_inline(r["plots"], tmp_path).count("data:image/png;base64,") == 3
    # the deployment's own warnings (a one-stream speed the generation stage contradicts) reach the report
    r["llama_cpp"] = {"tau": 1.4, "tau_ci95": [1.3, 1.5], "tokens": 10, "tokens_per_s": 0.9, "speedup": 1.41,
                      "baseline_tokens_per_s": 0.64, "num_draft_steps": 3, "acceptance_rate": 0.2,
                      "draft_n_accepted": 2, "draft_n": 10, "lossless": {"equal": 2, "near_tie": 0, "mismatch": 0},
                      "warnings": ["the baseline (no draft) measured 0.64 tok/s on one stream"]}
    assert "**Warning**: the baseline (no draft) measured 0.64 tok/s on one stream." in markdown(r)


def test_paired_bootstrap_difference_of_tau():
    """Same prompts, paired resampling: equal drafts give exactly 0; a draft better by 0.5 tau on every prompt gives
    exactly 0.5 however prompts are drawn; with prompts of very different difficulty the paired interval is far
    narrower than the two drafts' own intervals; different prompt counts are refused."""
    steps = [10, 40, 7, 25, 60, 12, 33, 18]
    a = [(2 * s, s) for s in steps]
    assert paired_bootstrap_diff_ci(a, a) == (0.0, 0.0)
    b = [(s + s / 2, s) for s in steps]                                    # tau 1.5 on every prompt
    assert paired_bootstrap_diff_ci(a, b) == pytest.approx((0.5, 0.5))
    hard = [(s + (s if i % 2 else s // 5), s) for i, s in enumerate(steps)]   # tau 2 or 1.2 by prompt
    worse = [(t - 1, s) for t, s in hard]
    lo, hi = paired_bootstrap_diff_ci(hard, worse)
    ci_a, ci_b = bootstrap_ci(*zip(*hard)), bootstrap_ci(*zip(*worse))
    assert 0 < lo <= hi and hi - lo < 0.5 * min(ci_a[1] - ci_a[0], ci_b[1] - ci_b[0])
    with pytest.raises(ValueError, match="same prompts: 8 vs 7"):
        paired_bootstrap_diff_ci(a, a[:7])


def test_warnings_only_where_an_interval_excludes_agreement():
    """The smoke run's case: 2 held-out prompts, wide intervals that hold the simulated tau and the engine's tau:
    no warning. Intervals that exclude agreement: one warning each, naming the numbers."""
    note = "measured tau 1.30 vs simulated 1.90 over 3 draft steps (-32%; simulated on held-out samples): check"
    ev = {"trained": {"tau": 1.3, "tau_ci95": [1.1, 1.95]},
          "consistency": {"flagged": True, "tau_sim_at_steps": 1.9, "note": note, "metrics_from": "eval"}}
    lc = {"tau": 1.6, "tau_ci95": [1.2, 2.0]}
    assert warnings(ev, lc) == []
    ev["trained"]["tau_ci95"] = [1.12, 1.18]                 # narrow: excludes 1.9, lies below 1.2
    lc["tau_ci95"] = [1.4, 1.8]                              # disjoint from the offline interval
    assert warnings(ev, lc) == [
        f"{note} (the simulated tau lies outside the measured tau's 95% interval 1.12-1.18)",
        "the engine's tau 1.60 (95% interval 1.40-1.80) and the offline tau 1.30 (1.12-1.18) disagree: check the "
        "aux layer ids and d2t of the exported draft",
        "tau 1.30 (95% interval 1.12-1.18) is below 1.2, which usually means a misconfiguration (aux layer ids, "
        "d2t, chat template), not a weak draft"]
    ev["consistency"]["metrics_from"] = "train"               # simulated on training samples: overfitting
    assert len(warnings(ev, None)) == 1
    ev["consistency"].update(metrics_from="eval", flagged=False)   # tau_consistency's own gap test passed
    assert len(warnings(ev, None)) == 1


def test_embed_images_inlines_the_run_dirs_pngs_only(tmp_path):
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "tau.png").write_bytes(b"\x89PNG\r\n\x1a\nxyz")
    md = "a ![tau](plots/tau.png) b ![web](https://example.org/x.png) ![gone](plots/none.png)"
    assert embed_images(md, tmp_path) == ("a ![tau](data:image/png;base64,iVBORw0KGgp4eXo=) b "
                                          "![web](https://example.org/x.png) ![gone](plots/none.png)")
