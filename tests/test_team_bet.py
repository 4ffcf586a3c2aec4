"""The team bet's study (studies/team_bet.py, team_bet_surface.py): the surface fit recovers known coefficients,
points come in the order of their value, a committed point is not rerun, the warm arm's GPU-seconds include its
quarter's, the budget stops cleanly, and plan's cost of 10x data is plan_run's arithmetic."""
import json
import math
import time

import pytest

from eagle3_core.config import preset
from eagle3_core.plan import markdown, plan_run
from eagle3_core.studies import team_bet as tb
from eagle3_core.studies import team_bet_surface as ts

TRUE = {"a": 0.4, "b": 0.35, "c": 0.9, "d": -0.12}


def synthetic(noise: float = 0.0) -> list[dict]:
    pts, k = [], 0
    for n in (900, 1800, 3700, 7400):
        for e in (4, 8, 16, 24):
            k += 1
            tau = ts.surface_tau(TRUE, n, e) + noise * math.sin(7.3 * k)      # deterministic "noise"
            pts.append({"samples": n, "epochs": e, "tau": tau, "recipe": "plateau" if e == 16 else f"e{e}"})
    return pts


def test_surface_recovers_known_coefficients_and_predicts_tenfold():
    fit = ts.fit_surface(synthetic())
    for k, v in TRUE.items():
        assert fit[k] == pytest.approx(v, abs=1e-9)
    assert fit["r2"] == pytest.approx(1.0) and fit["rmse"] < 1e-9
    noisy = ts.fit_surface(synthetic(noise=0.01))
    assert all(abs(noisy[k] - v) < 0.08 for k, v in TRUE.items()) and 0.9 < noisy["r2"] < 1.0
    t = ts.tenfold(fit, synthetic())
    assert t["samples_10x"] == 74000 and t["epochs"] == 16        # the largest size's plateau point's epochs
    assert t["gain"] == pytest.approx(TRUE["b"] + TRUE["d"] * math.log10(16))
    assert t["slope_data_per_decade"] == pytest.approx(t["gain"])
    with pytest.raises(ValueError, match="2 epoch counts"):
        ts.fit_surface([{"samples": n, "epochs": 6, "tau": 2.0} for n in (100, 200, 400, 800)])


def test_points_ordered_by_value_and_named():
    pts = tb.study_points(7409, [0.125, 0.25, 0.5, 1.0], ["e6", "e24"], seeds=2)
    names = [tb.point_name(p) for p in pts]
    assert names[:4] == ["n7409-plateau-s0", "warm-n1852to7409-plateau-s0", "n7409-e6-s0", "n7409-e24-s0"]
    assert names[4:7] == ["n3704-plateau-s0", "n3704-e6-s0", "n3704-e24-s0"]
    assert names[-1] == "n7409-plateau-s1" and len(names) == len(set(names)) == 4 + 3 * 3 + 1
    with pytest.raises(ValueError, match="'plateau'.*'eN'"):
        tb.study_points(100, [0.5, 1.0], ["six"])


@pytest.fixture
def cfg(tmp_path):
    c = preset("demo", tmp_path / "run")
    (c.run_dir / "prompts").mkdir(parents=True)
    (c.run_dir / "prompts" / "manifest.json").write_text(json.dumps({"eval_ids": ["q1", "q2"],
                                                                     "train_ids": ["t1"]}))
    return c


class FakeTrainer:
    """Stands in for train_subset (a real training run is the GPU session's): 0.01 s per sample-epoch on a
    simulated clock that starts with the object (`now`, run_points' clock); Unfinished when a phase would end
    after the deadline. A phase it finished before (its `out`) comes back at no cost, as train_subset resumes a
    finished run."""
    def __init__(self, rate: float = 0.01):
        self.calls, self.start, self.spent, self.rate, self.finished = [], time.monotonic(), 0.0, rate, {}

    def now(self) -> float:
        return self.start + self.spent

    def __call__(self, cfg, n, recipe, seed, out, init_from, log, deadline):
        self.calls.append((n, recipe, seed, init_from))
        if out in self.finished:
            return self.finished[out]
        epochs = tb.recipe_epochs(recipe) or 10
        cost = self.rate * n * epochs
        if deadline is not None and self.start + self.spent + cost > deadline:
            raise tb.Unfinished(f"{out}: would pass the deadline")
        self.spent += cost
        self.finished[out] = {"export": str(out / "export"), "seconds": cost, "epochs": epochs, "best_epoch": epochs,
                              "stopping": None, "epoch_tokens": 100 * n}
        return self.finished[out]


def measure(export):
    return {"tau": 2.0 + 0.1 * ("warm" in export), "tau_ci95": [1.9, 2.2], "accept_per_position": [0.5],
            "per_prompt": [(20 + 2 * ("warm" in export), 10), (30, 14)]}


def test_committed_points_are_not_rerun_and_warm_seconds_include_the_quarter(cfg, tmp_path):
    pts = tb.study_points(400, [0.5, 1.0], ["e4"], seeds=1)
    results, trainer = tmp_path / "team_bet", FakeTrainer()
    first = tb.run_points(cfg, pts, results, tmp_path / "work", measure, train_fn=trainer, log=lambda s: None)
    assert first["left"] == [] and sorted(p.name for p in results.iterdir()) == sorted(
        f"{tb.point_name(p)}.json" for p in pts)
    warm = json.loads((results / "warm-n100to400-plateau-s0.json").read_text())
    assert [ph["phase"] for ph in warm["phases"]] == ["quarter", "warm"]
    assert warm["seconds"] == pytest.approx(0.01 * 100 * 10 + 0.01 * 400 * 10)    # quarter + its growth to all
    assert (100, "plateau", 0, None) in trainer.calls
    assert any(c[3] and c[3].endswith("quarter/export") for c in trainer.calls)   # warm start from the quarter
    again = FakeTrainer()
    second = tb.run_points(cfg, pts, results, tmp_path / "work", measure, train_fn=again, log=lambda s: None)
    assert again.calls == [] and second["ran"] == [] and len(second["done"]) == len(pts)
    cfg.eval.max_new_tokens += 1                                                  # other settings: measured again
    third = tb.run_points(cfg, pts[:1], results, tmp_path / "work", measure, train_fn=again, log=lambda s: None)
    assert third["ran"] == ["n400-plateau-s0"] and len(again.calls) == 1
    rows = ts.warm_against_scratch(second["done"])
    assert len(rows) == 1 and rows[0]["warm_minus_scratch"] == pytest.approx(0.1)
    assert rows[0]["warm_seconds"] == pytest.approx(50.0) and rows[0]["scratch_seconds"] == pytest.approx(40.0)
    assert rows[0]["warm_steady_seconds"] is None                     # the fake trainer times no epoch
    # paired: resamples of the two prompts give warm - scratch 0.2 (prompt 1 twice), 2/24 or 0 (prompt 2 twice)
    assert rows[0]["ci95_paired"] == pytest.approx([0.0, 0.2])


def test_budget_runs_what_fits_then_stops_cleanly(cfg, tmp_path):
    pts = tb.study_points(400, [0.5, 1.0], ["e4"], seeds=1)
    names = [tb.point_name(p) for p in pts]
    assert names == ["n400-plateau-s0", "warm-n100to400-plateau-s0", "n400-e4-s0", "n200-plateau-s0", "n200-e4-s0"]

    def call(budget_s: float, out: str, partial: bool = False) -> dict:
        trainer = FakeTrainer()
        return tb.run_points(cfg, pts, tmp_path / out, tmp_path / f"{out}-work", measure, budget_s=budget_s,
                             default_s=1.0, partial=partial, train_fn=trainer, clock=trainer.now,
                             log=lambda s: None)
    # the first point runs on the default estimate (1 s) and takes 40 s; the estimates from its rate (0.01 s per
    # sample-epoch, 10 epochs for a plateau point): warm arm (100 + 400) x 10 = 50 s, n400-e4 16 s, n200-plateau
    # 20 s, n200-e4 8 s. In 45 s nothing after the first fits: all are left, in order
    res = call(45.0, "r")
    assert res["ran"] == names[:1] and res["left"] == names[1:] and res["unfinished"] is None
    assert tb.estimate_seconds(pts[1], res["done"], 1.0) == pytest.approx(50.0)
    # partial: the warm arm starts anyway and stops at the deadline (its quarter's 10 s after the first's 40 s)
    res = call(45.0, "r2", partial=True)
    assert res["ran"] == names[:1] and res["unfinished"] == names[1] and res["left"] == names[1:]
    assert not (tmp_path / "r2" / f"{names[1]}.json").exists()
    # in 70 s a point that does not fit is passed over for later ones that do: 40 + 16 + 8 = 64 s
    res = call(70.0, "r3")
    assert res["ran"] == [names[0], names[2], names[4]] and res["left"] == [names[1], names[3]]
    assert [d["name"] for d in res["done"]] == res["ran"] and res["unfinished"] is None
    # the next call reads those back and runs what is left; results listed in the points' order
    res = call(None, "r3")
    assert res["ran"] == [names[1], names[3]] and res["left"] == [] and [d["name"] for d in res["done"]] == names
    # partial after the pass: the most valuable point left gets the last 6 s of the 70
    res = call(70.0, "r4", partial=True)
    assert res["ran"] == [names[0], names[2], names[4]] and res["unfinished"] == names[1]
    assert res["left"] == [names[1], names[3]]


def test_only_runs_the_named_points_in_that_order_and_leaves_the_rest(cfg, tmp_path):
    pts = tb.study_points(400, [0.5, 1.0], ["e4"], seeds=1)
    trainer = FakeTrainer()
    res = tb.run_points(cfg, pts, tmp_path / "r", tmp_path / "w", measure, only=["n200-e4-s0", "n400-e4-s0"],
                        train_fn=trainer, clock=trainer.now, log=lambda s: None)
    assert res["ran"] == ["n200-e4-s0", "n400-e4-s0"] and [c[:2] for c in trainer.calls] == [(200, "e4"), (400, "e4")]
    assert res["left"] == ["n400-plateau-s0", "warm-n100to400-plateau-s0", "n200-plateau-s0"]
    again = FakeTrainer()                    # done points are read back whatever `only` names; the others run
    res = tb.run_points(cfg, pts, tmp_path / "r", tmp_path / "w", measure, only=["n400-e4-s0", "n200-plateau-s0"],
                        train_fn=again, clock=again.now, log=lambda s: None)
    assert res["ran"] == ["n200-plateau-s0"] and len(res["done"]) == 3 and len(res["left"]) == 2
    # partial goes on in order past a point that finishes: estimates at a slow call's rate (0.05 s per
    # sample-epoch: warm arm 250 s, n400-e4 80 s) fit neither in 70 s; at 0.01 the warm arm takes 10 + 40 s, then
    # n400-e4 16 s (done at 66 s); in 60 s n400-e4 is the one stopped
    slow = FakeTrainer(rate=0.05)
    for budget_s, out, unfinished in ((70.0, "p", None), (60.0, "q", "n400-e4-s0")):
        tb.run_points(cfg, pts, tmp_path / out, tmp_path / f"{out}-w", measure, only=["n400-plateau-s0"],
                      train_fn=slow, log=lambda s: None)
        fast = FakeTrainer()
        res = tb.run_points(cfg, pts, tmp_path / out, tmp_path / f"{out}-w", measure, budget_s=budget_s,
                            partial=True, only=["warm-n100to400-plateau-s0", "n400-e4-s0"], train_fn=fast,
                            clock=fast.now, log=lambda s: None)
        assert res["ran"][0] == "warm-n100to400-plateau-s0" and res["unfinished"] == unfinished
        assert ("n400-e4-s0" in res["ran"]) == (unfinished is None)
    with pytest.raises(ValueError, match=r"\['n5-e4-s0'\].*n200-e4-s0"):
        tb.run_points(cfg, pts, tmp_path / "r", tmp_path / "w", measure, only=["n5-e4-s0"], train_fn=again)


def test_measurement_time_counts_in_the_estimate_and_is_left_room_before_the_deadline(cfg, tmp_path):
    """A measurement of 5 s (on the simulated clock): recorded per point, added to every estimate after it, and
    kept free at the budget's end, so a point whose training fits but whose measurement would not is not started
    and a partial point's training stops 5 s early (a call killed mid-measurement lost a trained point)."""
    pts = tb.study_points(400, [0.5, 1.0], ["e4"], seeds=1)
    trainer = FakeTrainer()

    def slow_measure(export):
        trainer.spent += 5.0
        return measure(export)
    res = tb.run_points(cfg, pts, tmp_path / "r", tmp_path / "w", slow_measure, budget_s=66.0, default_s=1.0,
                        partial=True, train_fn=trainer, clock=trainer.now, log=lambda s: None)
    # n400-plateau 40 s + 5; n400-e4 16 + 5 = 66 fits exactly; n200-e4 8 + 5 would not (it would without the 5 s)
    assert res["ran"] == ["n400-plateau-s0", "n400-e4-s0"] and res["done"][0]["measure_seconds"] == 5.0
    assert tb.estimate_seconds(pts[4], res["done"], 1.0) == pytest.approx(8.0 + 5.0)
    # partial: the warm arm starts with 0 s left before the 5 s kept for measuring: its quarter cannot run
    assert res["unfinished"] == "warm-n100to400-plateau-s0" and trainer.calls[-1][0] == 100
    assert trainer.now() - trainer.start == pytest.approx(66.0)


def test_a_partial_point_trains_to_the_budgets_end_and_the_next_call_measures_it(cfg, tmp_path):
    """--partial's last point trains through the seconds kept for measuring (on the H100, 160 s of each 560 s call
    went unused); one whose training ends too late to measure is left unfinished, and the next call on the machine
    measures it without training it again."""
    pts = tb.study_points(400, [0.5, 1.0], ["e4"], seeds=1)
    trainer = FakeTrainer()

    def slow_measure(export):
        trainer.spent += 5.0
        return measure(export)
    kw = dict(only=["n400-plateau-s0", "n400-e4-s0"], train_fn=trainer, clock=trainer.now, log=lambda s: None)
    # n400-plateau 40 s + 5; n400-e4 (16 + 5 s) does not fit in 62 s, starts anyway, and trains to 61 s (a stop 5 s
    # before the end, at 57 s, would not let it); at 61 s there is no room for its 5 s measurement
    res = tb.run_points(cfg, pts, tmp_path / "r", tmp_path / "w", slow_measure, budget_s=62.0, default_s=1.0,
                        partial=True, **kw)
    assert res["ran"] == ["n400-plateau-s0"] and res["unfinished"] == "n400-e4-s0"
    assert trainer.calls[-1][:2] == (400, "e4") and trainer.now() - trainer.start == pytest.approx(61.0)
    assert not (tmp_path / "r" / "n400-e4-s0.json").exists()
    res = tb.run_points(cfg, pts, tmp_path / "r", tmp_path / "w", slow_measure, budget_s=62.0, partial=True, **kw)
    assert res["ran"] == ["n400-e4-s0"] and res["unfinished"] is None
    assert trainer.now() - trainer.start == pytest.approx(66.0)                     # its measurement alone
    saved = json.loads((tmp_path / "r" / "n400-e4-s0.json").read_text())
    assert saved["seconds"] == pytest.approx(16.0) and saved["measure_seconds"] == 5.0


def test_the_warm_arms_quarter_is_measured_as_its_point_not_trained_twice(cfg, tmp_path):
    """With a quarter size among the points, the warm arm's quarter (that size, plateau, seed 0, from scratch) is
    the n100-plateau-s0 point's training: measured and saved as it, its seconds the quarter's, never trained again
    (a ~108 s point of the H100 study)."""
    pts = tb.study_points(400, [0.25, 0.5, 1.0], ["e4"], seeds=1)
    trainer = FakeTrainer()
    res = tb.run_points(cfg, pts, tmp_path / "r", tmp_path / "w", measure, train_fn=trainer, clock=trainer.now,
                        log=lambda s: None)
    assert res["left"] == [] and sorted(res["ran"]) == sorted(tb.point_name(p) for p in pts)
    assert [c for c in trainer.calls if c[:2] == (100, "plateau")] == [(100, "plateau", 0, None)]   # the quarter
    quarter = json.loads((tmp_path / "r" / "n100-plateau-s0.json").read_text())
    warm = json.loads((tmp_path / "r" / "warm-n100to400-plateau-s0.json").read_text())
    assert quarter["seconds"] == warm["phases"][0]["seconds"] == pytest.approx(10.0)
    assert quarter["phases"][0]["export"].endswith("warm-n100to400-plateau-s0/quarter/export")
    assert quarter["settings"] == tb.point_settings(cfg, quarter["point"]) and quarter["tau"] == 2.1
    again = tb.run_points(cfg, pts, tmp_path / "r", tmp_path / "w", measure, train_fn=FakeTrainer(),
                          log=lambda s: None)
    assert again["ran"] == [] and len(again["done"]) == len(pts)
    # room for both measurements (5 s each) before the budget's end: with the first point's 5 s on record, the warm
    # arm (estimate 50 + 5 s) starts in 58 s but must stop training at 48 s; its 10 + 40 s of training end at 50
    trainer = FakeTrainer()

    def slow_measure(export):
        trainer.spent += 5.0
        return measure(export)
    tb.run_points(cfg, pts[:1], tmp_path / "b", tmp_path / "wb", slow_measure, train_fn=trainer, clock=trainer.now,
                  log=lambda s: None)
    trainer = FakeTrainer()
    res = tb.run_points(cfg, pts, tmp_path / "b", tmp_path / "wb2", slow_measure, budget_s=58.0, train_fn=trainer,
                        clock=trainer.now, log=lambda s: None)
    assert res["unfinished"] == "warm-n100to400-plateau-s0"               # started, stopped at 48 s (1x: done at 50)
    assert not {"warm-n100to400-plateau-s0", "n100-plateau-s0"} & set(res["ran"])
    assert [c[0] for c in trainer.calls[:2]] == [100, 400] and trainer.calls[1][3].endswith("quarter/export")


def test_trainer_calls_run_the_epochs_that_fit_before_the_deadline(tmp_path):
    assert tb._epochs_that_fit(None, None, tmp_path, 0.0) is None                  # no deadline: one call, all
    now = time.monotonic()
    assert tb._epochs_that_fit(now + 100, None, tmp_path, 0.0) == 1                # the first call times an epoch
    assert tb._epochs_that_fit(now + 100, 30.0, tmp_path, 0.0) == 3
    with pytest.raises(tb.Unfinished, match="deadline"):
        tb._epochs_that_fit(now + 100, 120.0, tmp_path, 50.0)


def test_steady_seconds_without_compiles():
    # two calls (first epochs 0 and 3, compile in each): those count at the median of the others, 2.0
    assert tb.steady_seconds([10.0, 2.0, 2.5, 9.0, 2.0], [0, 3]) == pytest.approx(2.0 + 2.5 + 2.0 + 2 * 2.0)
    assert tb.steady_seconds([10.0, 9.0], [0, 1]) is None
    hist = [{"epoch_seconds": x, "call_first": i in (0, 3)} for i, x in enumerate([10.0, 2.0, 2.5, 9.0, 2.0])]
    assert tb.epoch_timing(hist) == {"epoch_seconds": [10.0, 2.0, 2.5, 9.0, 2.0], "call_firsts": [0, 3],
                                     "steady_seconds": pytest.approx(10.5)}
    old = [{"seconds": 10.0}, {"seconds": 12.0}]                      # a history written before 44a2f29
    assert tb.epoch_timing(old) == {"epoch_seconds": None, "call_firsts": None, "steady_seconds": None}


def test_tenfold_plan_is_plan_runs_arithmetic(cfg):
    data = {"generation_tok_s": 3500.0, "output_tokens_per_sample": 190.0, "tokens_per_sample": 280.0,
            "extraction_tok_s": 40000.0, "hidden_size": 576}
    points = [{"phases": [{"epoch_tokens": 1000, "epochs": 10, "seconds": s}]} for s in (1.0, 2.0)]
    assert ts.study_rates(data, points, "test")["train_tok_s_per_gpu"]["value"] == pytest.approx(20000 / 3.0)
    # pooled over tokens, each phase at its steady seconds where it has them (4 s with a compile, 2 s without)
    points.append({"phases": [{"epoch_tokens": 3000, "epochs": 10, "seconds": 4.0, "steady_seconds": 2.0}]})
    rates = ts.study_rates(data, points, "test")
    assert rates["train_tok_s_per_gpu"]["value"] == pytest.approx(50000 / 5.0)
    p = ts.tenfold_plan(cfg, rates, 74090, 16, plan_run)
    train = next(r for r in p["stages"] if r["stage"] == "train")
    assert train["hours"] == pytest.approx(16 * 74090 * 280 / 10000 / 3600)
    gen = next(r for r in p["stages"] if r["stage"] == "generation")
    assert gen["hours"] == pytest.approx(74090 * 190 / 3500 / 3600)
    assert p["total_hours"] >= train["hours"] + gen["hours"] and "74090" in markdown(p["plan"])


def test_study_plan_counts_every_point_and_the_warm_arms_quarter(cfg):
    rates = ts.study_rates({"generation_tok_s": 3500.0, "output_tokens_per_sample": 190.0, "tokens_per_sample": 280.0,
                            "extraction_tok_s": 40000.0, "hidden_size": 576},
                           [{"phases": [{"epoch_tokens": 1000, "epochs": 10, "seconds": 2.0}]}], "test")
    pts = tb.study_points(400, [0.5, 1.0], ["e4"], seeds=1)
    plan = ts.study_plan(cfg, rates, pts, 400, plan_run)
    rows = {r["name"]: r for r in plan["points"]}
    assert rows["n400-e4-s0"]["hours"] == pytest.approx(4 * 400 * 280 / 5000 / 3600)
    E = rows["n400-plateau-s0"]["epochs"]                 # plan's expected epochs for the rule at this size
    assert rows["warm-n100to400-plateau-s0"]["hours"] > rows["n400-plateau-s0"]["hours"] == pytest.approx(
        E * 400 * 280 / 5000 / 3600)
    assert plan["total_hours"] == pytest.approx(plan["data_hours"] + sum(r["hours"] for r in plan["points"]))
    quarter = {r["name"]: r for r in ts.study_plan(cfg, rates, tb.study_points(400, [0.25, 1.0], ["e4"], 1), 400,
                                                   plan_run)["points"]}
    assert quarter["n100-plateau-s0"]["hours"] == 0.0 and quarter["n100-e4-s0"]["hours"] > 0   # the warm arm trains it
    assert quarter["warm-n100to400-plateau-s0"]["hours"] == pytest.approx(rows["warm-n100to400-plateau-s0"]["hours"])


@pytest.mark.slow
def test_points_train_and_replay_on_real_features(e2e_run, tmp_path):
    """The real trainer and replay evaluator on debug_tiny's features: two sizes x two epoch counts and the warm
    arm; results written per point, read back without training, the surface fitted from them."""
    import shutil

    from eagle3_core.studies import team_bet_run as tr
    cfg0, _ = e2e_run
    cfg = cfg0.model_copy(deep=True)
    cfg.run_dir = tmp_path / "run"
    for d in ("prompts", "generations", "tokenized", "features", "vocab"):
        shutil.copytree(cfg0.run_dir / d, cfg.run_dir / d)
    pts = [{"samples": 6, "recipe": "e2", "seed": 0}, {"samples": 6, "recipe": "e2", "seed": 0, "warm_from": 3},
           {"samples": 6, "recipe": "e1", "seed": 0}, {"samples": 3, "recipe": "e2", "seed": 0},
           {"samples": 3, "recipe": "e1", "seed": 0}]
    lines = []
    measure = tr.replay_measurer(cfg, "cpu", batch=2, log=lines.append)
    res = tb.run_points(cfg, pts, tmp_path / "results", tmp_path / "work", measure, log=lines.append)
    # the warm arm's quarter (3 samples, e2, seed 0) is the point n3-e2-s0: measured right after it, not trained
    assert res["ran"] == [tb.point_name(p) for p in (pts[0], pts[1], pts[3], pts[2], pts[4])] and res["left"] == []
    assert not (tmp_path / "work" / "n3-e2-s0").exists()
    warm = next(p for p in res["done"] if p["point"].get("warm_from"))
    assert [(ph["phase"], ph["samples"], ph["epochs"]) for ph in warm["phases"]] == [("quarter", 3, 2), ("warm", 6, 2)]
    assert warm["seconds"] == pytest.approx(sum(ph["seconds"] for ph in warm["phases"]))
    for ph in (ph for p in res["done"] for ph in p["phases"]):          # one trainer call per phase: no deadline
        assert len(ph["epoch_seconds"]) == ph["epochs"] and ph["call_firsts"] == [0]
        assert 0 < sum(ph["epoch_seconds"]) <= ph["seconds"]
        assert (ph["steady_seconds"] is None) == (ph["epochs"] == 1)
    assert warm["steady_seconds"] == pytest.approx(sum(ph["steady_seconds"] for ph in warm["phases"]))
    assert any("warm start from" in s and "quarter" in s for s in lines)
    for p in res["done"]:
        assert 1.0 <= p["tau"] <= 1 + cfg.eval.num_draft_steps and p["tau_ci95"][0] <= p["tau"] <= p["tau_ci95"][1]
        assert len(p["per_prompt"]) == cfg.prompts.num_eval
        assert p["device"] == "CPU"
    again = tb.run_points(cfg, pts, tmp_path / "results", tmp_path / "work", measure,
                          train_fn=lambda *a: pytest.fail("a committed point was trained again"), log=lines.append)
    assert again["ran"] == [] and [p["tau"] for p in again["done"]] == [p["tau"] for p in res["done"]]
    out = tr.answers(cfg, again["done"], None, "test")
    assert out["surface"]["points"] == 4 and out["tenfold"]["samples_10x"] == 60
    assert len(out["warm_against_scratch"]) == 1


def restored_run(cfg0, tmp_path):
    """(a copy of the end-to-end run's config in tmp_path/run with its prompts, tmp_path/results holding its
    generations as a committed results folder does)."""
    import shutil
    cfg = cfg0.model_copy(deep=True)
    cfg.run_dir = tmp_path / "run"
    shutil.copytree(cfg0.run_dir / "prompts", cfg.run_dir / "prompts")
    shutil.copytree(cfg0.run_dir / "generations", tmp_path / "results" / "generations")
    return cfg, tmp_path / "results"


@pytest.mark.slow
def test_team_bet_flow_restores_generations_and_reads_committed_points(e2e_run, tmp_path):
    """The flow on debug_tiny's data: the committed generations are restored (the generation stage sends nothing),
    a committed point is read back, and a budget too small for any other point leaves them all, in order."""
    from flows.scaling_study import team_bet_flow
    cfg0, _ = e2e_run
    cfg, results = restored_run(cfg0, tmp_path)
    (results / "generations" / "manifest.json").unlink(missing_ok=True)
    from eagle3_core.features.reader import load_samples
    n = len(load_samples(cfg0.run_dir / "features", verify=False))
    pts = tb.study_points(n - int(n * cfg.train.eval_frac), [0.5, 1.0], ["e1"], seeds=1)
    first = {"settings": tb.point_settings(cfg, pts[0]), "point": pts[0], "name": tb.point_name(pts[0]),
             "samples": pts[0]["samples"], "epochs": 3, "seconds": 1.5, "phases": [], "tau": 1.8, "tau_ci95": [1.5, 2.1],
             "accept_per_position": [0.5], "per_prompt": [(9, 5), (9, 5)]}
    (results / f"{first['name']}.json").write_text(json.dumps(first))
    out = team_bet_flow(cfg, str(results), fractions=[0.5, 1.0], grid=["e1"], seeds=1, budget_s=0.001)
    gen = json.loads((cfg.run_dir / "generations" / "manifest.json").read_text())
    assert gen["completion_tokens"] > 0
    kept = sorted((results / "generations").glob("shard_*"))
    assert kept and [p.name for p in kept] == sorted(p.name for p in (cfg.run_dir / "generations").glob("shard_*"))
    for p in kept:                                    # restored, never rewritten: the stage sent nothing
        assert (cfg.run_dir / "generations" / p.name).stat().st_mtime_ns == p.stat().st_mtime_ns
    assert out["ran"] == [] and out["left"] == [tb.point_name(p) for p in pts[1:]]
    assert [p["tau"] for p in out["points"]] == [1.8] and "not_yet" in out["surface"]
    assert json.loads((results / "summary.json").read_text())["left"] == out["left"]


@pytest.mark.slow
def test_the_data_rates_are_those_of_the_work_not_of_a_call_that_found_it_done(e2e_run, tmp_path):
    """data_stages twice on restored generations: the generation rate is the shard records' completion tokens over
    their busy seconds and the extraction rate the features manifest's, both calls alike (the second finds every
    stage done; it used to divide the answers by its own ~0 s of generation: 6.4 million tok/s on an H100)."""
    from eagle3_core.contract.manifest import busy_seconds
    from eagle3_core.studies import team_bet_run as tr
    cfg, results = restored_run(e2e_run[0], tmp_path)
    records = [json.loads(p.read_text()) for p in sorted((results / "generations").glob("shard_*.json"))]
    want = sum(r["completion_tokens"] for r in records) / busy_seconds(records)
    first = tr.data_stages(cfg, results, log=lambda *_: None)
    feats = json.loads((cfg.run_dir / "features" / "manifest.json").read_text())
    assert first["generation_tok_s"] == pytest.approx(want)
    assert first["extraction_tok_s"] == pytest.approx(feats["tokens_per_s"]) and first["extraction_tok_s"] > 0
    again = tr.data_stages(cfg, results, log=lambda *_: None)
    assert again == first == json.loads((results / "data.json").read_text())


def test_committed_points_and_both_plots_from_them(tmp_path):
    """committed_points reads every <point>.json (not data, rates or summary) by samples; plot_all draws the two PNGs
    from them and their answers (surface lines, the tenfold marker, the warm arm joined to its quarter)."""
    from matplotlib.image import imread

    from eagle3_core.studies import team_bet_plots as tp
    from eagle3_core.studies import team_bet_run as tr
    for p in synthetic():
        n, r = p["samples"], p["recipe"]
        point = {"samples": n, "recipe": r, "seed": 0}
        (tmp_path / f"{tb.point_name(point)}.json").write_text(json.dumps({
            "name": tb.point_name(point), "point": point, "samples": n, "epochs": p["epochs"], "tau": p["tau"],
            "tau_ci95": [p["tau"] - 0.1, p["tau"] + 0.1], "seconds": 0.01 * n * p["epochs"], "phases": [],
            "per_prompt": [[10, 5], [12, 6]]}))
    warm = {"samples": 7400, "recipe": "plateau", "seed": 0, "warm_from": 1800}
    (tmp_path / "warm.json").write_text(json.dumps({"name": "warm", "point": warm, "samples": 7400, "epochs": 16,
                                                    "tau": 2.9, "tau_ci95": [2.8, 3.0], "seconds": 1500.0,
                                                    "phases": [], "per_prompt": [[10, 4], [12, 6]]}))
    for other in ("data", "rates", "summary"):
        (tmp_path / f"{other}.json").write_text(json.dumps({"tau": 1.0, "left": []}))
    done = tr.committed_points(tmp_path)
    assert len(done) == 17 and [p["samples"] for p in done] == sorted(p["samples"] for p in done)
    out = tr.answers(None, done, None, "test")
    assert out["surface"]["points"] == 16 and out["surface"]["b"] == pytest.approx(TRUE["b"])
    assert out["warm_against_scratch"][0]["scratch_tau"] == pytest.approx(ts.surface_tau(TRUE, 7400, 16))
    paths = tp.plot_all(done, out, tmp_path / "plots", "test device")
    assert [p.name for p in paths] == list(tp.NAMES.values())
    for p in paths:
        assert imread(p).shape[:2] == (462, 770)            # figsize 7 x 4.2 inches at plots.save_figure's 110 dpi
