"""The scaling study: nested subsets, the log trend against a reference fit, and the flow on the debug_tiny run's
features (two sizes, real training and offline evaluation) with its artifacts read back through the Prefect API."""
import json
import shutil

import numpy as np
import pytest

from eagle3_core.studies.scaling_study import fit_log_trend, nested_subset, predict, subset_sizes
from tasks.artifacts import run_key


def test_subsets_are_nested_prefixes_of_one_permutation():
    sets = [set(nested_subset(1000, n, seed=3)) for n in (125, 250, 500, 1000)]
    assert [len(s) for s in sets] == [125, 250, 500, 1000]
    assert sets[0] < sets[1] < sets[2] < sets[3] == set(range(1000))
    assert nested_subset(1000, 125, seed=4) != nested_subset(1000, 125, seed=3)
    assert subset_sizes(4000, [0.125, 0.25, 0.5, 1.0]) == [500, 1000, 2000, 4000]
    with pytest.raises(ValueError, match="at least 2"):
        subset_sizes(3, [0.1, 0.2])
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        subset_sizes(100, [0.5, 1.5])


def test_log_trend_matches_a_least_squares_fit_and_marks_extrapolation():
    n, tau = [500, 1000, 2000, 4000], [1.71, 1.83, 1.92, 2.06]
    t = fit_log_trend(n, tau)
    slope, intercept = np.polyfit(np.log10(n), tau, 1)
    assert t["slope_per_decade"] == pytest.approx(slope, rel=1e-10)
    assert t["intercept"] == pytest.approx(intercept, rel=1e-10)
    resid = np.array(tau) - (intercept + slope * np.log10(n))
    assert t["r2"] == pytest.approx(1 - (resid ** 2).sum() / ((np.array(tau) - np.mean(tau)) ** 2).sum())
    p = predict(t, 40000, 4000)
    assert p["extrapolated"] and p["tau"] == pytest.approx(intercept + slope * np.log10(40000))
    assert not predict(t, 3000, 4000)["extrapolated"]


@pytest.mark.slow
def test_scaling_study_flow_on_real_features(e2e_run, tmp_path):
    from prefect.client.orchestration import get_client

    from eagle3_core.features.reader import load_samples
    from flows.scaling_study import scaling_study_flow
    cfg, _ = e2e_run
    new = cfg.model_copy(deep=True)
    new.run_dir = tmp_path / "study"
    new.train.epochs = 3
    new.eval.max_new_tokens = 16
    for d in ("prompts", "generations", "tokenized", "features", "vocab"):
        shutil.copytree(cfg.run_dir / d, new.run_dir / d)
    res = scaling_study_flow(new, fractions=[0.5, 1.0], extrapolate_to=[1000])
    sizes = res["sizes"]
    n_all = len(load_samples(new.run_dir / "features"))
    assert [z["samples"] for z in sizes] == subset_sizes(n_all - int(n_all * new.train.eval_frac), [0.5, 1.0])
    for z in sizes:
        m = json.loads((new.run_dir / "scaling" / f"n_{z['samples']}" / "manifest.json").read_text())
        assert m["tau"] == z["tau"] and 1.0 <= z["tau"] <= 1 + new.eval.num_draft_steps
        assert len(z["acc_k"]) == new.train.ttt_length
    assert res["predictions"][0]["extrapolated"]
    assert (new.run_dir / "scaling" / "tau_vs_samples.png").stat().st_size > 1000

    with get_client(sync_client=True) as client:
        art = client.read_artifacts()
        keys = {a.key for a in art}
    assert {run_key(new.run_dir, k) for k in ("scaling-study", "scaling-study-plot", "scaling-study-summary")} <= keys
    # an equal rerun returns every size from its manifest (nothing retrained)
    mtimes = [(new.run_dir / "scaling" / f"n_{z['samples']}" / "manifest.json").stat().st_mtime_ns for z in sizes]
    scaling_study_flow(new, fractions=[0.5, 1.0], extrapolate_to=[1000])
    assert mtimes == [(new.run_dir / "scaling" / f"n_{z['samples']}" / "manifest.json").stat().st_mtime_ns
                      for z in sizes]
