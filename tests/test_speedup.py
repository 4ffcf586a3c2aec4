"""The speedup model against hand-computed cases (eagle3_core/evaluation/speedup.py)."""
import pytest

from eagle3_core.evaluation.speedup import expected_tau, model_from_measurement, speedup_model


def test_expected_tau_is_one_plus_the_sum_of_cumulative_acceptance():
    # 1 + 0.8 + 0.8*0.7 + 0.8*0.7*0.6 + 0.8*0.7*0.6*0.5 + 0.8*0.7*0.6*0.5*0.4 = 1 + 0.8 + 0.56 + 0.336 + 0.168 + 0.0672
    assert expected_tau([0.8, 0.7, 0.6, 0.5, 0.4]) == pytest.approx(2.9312, abs=1e-12)
    assert expected_tau([0.8, 0.7, 0.6, 0.5, 0.4], num_steps=2) == pytest.approx(2.36, abs=1e-12)
    assert expected_tau([0.0, 1.0]) == 1.0
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        expected_tau([1.2])
    with pytest.raises(ValueError, match="num_steps 3"):
        expected_tau([0.5, 0.5], num_steps=3)


def test_speedup_model_hand_computed_case():
    # target step 11 ms (90.9 tok/s); 5 draft steps of 1 ms; verify 12.1 ms: cycle 17.1 ms
    m = speedup_model(t_target_s=0.011, t_draft_s=0.005, t_verify_s=0.0121, tau=2.9312)
    assert m["cycle_s"] == pytest.approx(0.0171)
    assert m["baseline_tokens_per_s"] == pytest.approx(90.909090909, rel=1e-9)
    assert m["spec_tokens_per_s"] == pytest.approx(2.9312 / 0.0171, rel=1e-12)      # 171.415...
    assert m["speedup"] == pytest.approx(2.9312 * 0.011 / 0.0171, rel=1e-12)        # 1.8856
    assert m["break_even_tau"] == pytest.approx(0.0171 / 0.011, rel=1e-12)          # 1.5545
    # at the break-even tau the draft buys nothing
    assert speedup_model(0.011, 0.005, 0.0121, m["break_even_tau"])["speedup"] == pytest.approx(1.0)


def test_reference_case_numbers_give_its_break_even():
    """REFERENCE section 0: 90.0 tok/s baseline, tau ~2.1 gave 82.3 tok/s. The cycle time that implies
    (2.1 / 82.3 s) makes the break-even tau 2.1 * 90.0 / 82.3 = 2.30 (the team estimated ~2.5)."""
    cycle = 2.1 / 82.3
    m = speedup_model(1 / 90.0, 0.0, cycle, 2.1)
    assert m["spec_tokens_per_s"] == pytest.approx(82.3)
    assert m["break_even_tau"] == pytest.approx(2.1 * 90.0 / 82.3)
    assert m["speedup"] == pytest.approx(82.3 / 90.0)


def test_model_from_an_offline_measurement():
    baseline = {"decode_s": 2.0, "decode_steps": 100}                     # 20 ms per target step
    run = {"verify_steps": 50, "tau": 2.5, "accept_per_position": [0.9, 0.5, 0.2],
           "timing": {"draft_s": 0.5, "verify_s": 1.1, "other_s": 0.1, "prefill_s": 0.3},
           "tokens_per_s": 70.0, "baseline_tokens_per_s": 48.0, "speedup": 70.0 / 48.0}
    m = model_from_measurement(run, baseline)
    assert (m["t_target_s"], m["t_draft_s"], m["t_verify_s"], m["t_other_s"]) == pytest.approx((0.02, 0.01, 0.022,
                                                                                                0.002))
    assert m["spec_tokens_per_s"] == pytest.approx(2.5 / 0.034)
    assert m["break_even_tau"] == pytest.approx(0.034 / 0.02)
    assert m["tau_expected"] == pytest.approx(1 + 0.9 + 0.45 + 0.09)
    assert m["measured_speedup"] == pytest.approx(70.0 / 48.0)
    with pytest.raises(ValueError, match="tau"):
        speedup_model(0.02, 0.01, 0.02, 0.9)


def test_a_one_stream_speed_far_below_the_same_servers_generation_rate_is_flagged():
    from eagle3_core.evaluation.speedup import speed_disagreement
    # the case seen in the UI: 24 tok/s over 8 slots during generation, then 0.64 tok/s on one stream
    w = speed_disagreement(0.64, 24.0, 8, "the baseline (no draft)")
    assert w is not None and "0.64 tok/s" in w and "3.0 tok/s per slot" in w and "busy" in w
    assert speed_disagreement(1.6, 24.0, 8, "x") is None          # within the factor 2 of one slot's share
    assert speed_disagreement(40.0, 24.0, 8, "x") is None         # one stream faster than a slot: expected
    assert speed_disagreement(0.1, 0.0, 8, "x") is None           # nothing generated: nothing to compare

