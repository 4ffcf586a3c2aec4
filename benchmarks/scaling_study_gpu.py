"""The scaling study and the SpecForge side by side in one command on a GPU host, without Prefect (how issue 10's
numbers were made; the `scaling-study` flow runs the same functions as tasks).

  python benchmarks/scaling_study_gpu.py --config configs/scaling_gsm8k.json --side-by-side 1024

The data stages run in this process (prompts, regeneration, tokenization, features on the GPU, vocab map; each
cached by its manifest). Then every size of the study is its own process (scaling_study.train_and_measure: training
on the GPU, the offline evaluator on its own share of the CPU threads), so the sizes overlap; the side by side of a
size (benchmarks/specforge_side_by_side.py) starts once that size is done. Last, the trend, table and plot
(scaling_study.finish_study). Logs: RUN_DIR/scaling/logs/. Exits 1 naming the first job that failed.

The team bet (epochs against data, warm start against scratch: studies/team_bet.py), resumable from a committed
results folder, one call doing what fits in --budget-s:

  python benchmarks/scaling_study_gpu.py --config configs/team_bet_gsm8k.json --team-bet benchmarks/data/team_bet \
      --budget-s 540 [--grid e6,e12] [--seeds 2] [--partial] [--profile P] [--out summary.json]

prints the study's cost by plan first (the rates this study measured in RESULTS/rates.json, else --profile of
configs/rates.json; --plan-only stops there), then the data stages, the points not yet in RESULTS, and the answers
so far (JSON on stdout and in --out).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3_core.config import PipelineConfig, load_config  # noqa: E402
from eagle3_core.pipeline.features_stage import run_features  # noqa: E402
from eagle3_core.pipeline.generation_stage import run_generation  # noqa: E402
from eagle3_core.pipeline.prompts_stage import run_prompts  # noqa: E402
from eagle3_core.pipeline.tokenize_stage import run_tokenize  # noqa: E402
from eagle3_core.pipeline.vocab_stage import run_vocab  # noqa: E402
from eagle3_core.studies import scaling_study as study  # noqa: E402


def data_stages(cfg: PipelineConfig) -> None:
    for name, stage in [("prompts", run_prompts), ("generation", run_generation),
                        ("tokenize", run_tokenize), ("features", run_features),
                        ("vocab", run_vocab)]:
        t0 = time.monotonic()
        stage(cfg)
        print(f"== {name}: {time.monotonic() - t0:.0f} s", flush=True)


def run_jobs(cfg: PipelineConfig, config: Path, sizes: list[int], side_by_side: list[int], seed: int) -> None:
    logs = cfg.run_dir / "scaling" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // (len(sizes) + len(side_by_side)))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}

    def start(name: str, argv: list[str]) -> subprocess.Popen:
        with open(logs / f"{name}.log", "wb") as f:
            return subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)

    jobs = {f"n_{n}": start(f"n_{n}", [__file__, "--config", str(config), "--size", str(n), "--seed", str(seed)])
            for n in sizes}
    waiting, t0 = set(side_by_side), time.monotonic()
    while jobs:
        time.sleep(2)
        for name, p in list(jobs.items()):
            if p.poll() is None:
                continue
            del jobs[name]
            print(f"== {name}: exit {p.returncode} after {time.monotonic() - t0:.0f} s", flush=True)
            if p.returncode:
                print((logs / f"{name}.log").read_text()[-4000:])
                for q in jobs.values():
                    q.terminate()
                sys.exit(1)
            if name.startswith("n_") and (n := int(name[2:])) in waiting:
                waiting.discard(n)
                out = cfg.run_dir / "scaling" / f"side_by_side_{n}.json"
                jobs[f"specforge_{n}"] = start(f"specforge_{n}", [
                    str(ROOT / "benchmarks" / "specforge_side_by_side.py"), "--config", str(config), "--samples",
                    str(n), "--seed", str(seed), "--out", str(out)])


def write_answers(cfg: PipelineConfig, a: argparse.Namespace, run: dict, data: dict | None, where: str) -> dict:
    """summary.json in RESULTS (and --out): what ran, what is left, the answers so far; rates.json in RESULTS (plan's
    rates measured by the study, from `data` and the points); the plots into --plot-dir."""
    import json
    from eagle3_core.plan import markdown, plan_run
    from eagle3_core.studies import team_bet_plots as tp
    from eagle3_core.studies import team_bet_run as tr
    from eagle3_core.studies import team_bet_surface as ts
    if data and any(p["phases"] for p in run["done"]):
        (a.team_bet / "rates.json").write_text(json.dumps(ts.study_rates(data, run["done"], where), indent=1) + "\n")
    out = {"ran": run["ran"], "left": run["left"], "unfinished": run["unfinished"], "device": where,
           **tr.answers(cfg, run["done"], data, where, plan_run, markdown)}
    if a.plot_dir:
        out["plots"] = [str(p) for p in tp.plot_all(run["done"], out, a.plot_dir, where.split(",")[0])]
    for path in filter(None, (a.team_bet / "summary.json", a.out)):
        path.write_text(json.dumps(out, indent=1) + "\n")
    return out


def answers_only(cfg: PipelineConfig, a: argparse.Namespace) -> None:
    """--answers-only: the answers and plots of the points committed in RESULTS, on any machine (no GPU)."""
    import json
    from eagle3_core.studies import team_bet_run as tr
    res = a.team_bet
    old = json.loads((res / "summary.json").read_text()) if (res / "summary.json").exists() else {}
    data = json.loads((res / "data.json").read_text()) if (res / "data.json").exists() else None
    run = {"done": tr.committed_points(res), "ran": old.get("ran", []), "left": old.get("left", []),
           "unfinished": old.get("unfinished")}
    out = write_answers(cfg, a, run, data, old.get("device", "unknown device"))
    print(json.dumps({k: v for k, v in out.items() if k != "tenfold_plan"}, indent=1))


def team_bet(cfg: PipelineConfig, a: argparse.Namespace) -> None:
    """The --team-bet call (module docstring): cost, data stages, points within the budget, answers."""
    import json

    from eagle3_core.contract.layout import RunLayout
    from eagle3_core.features.reader import load_samples
    from eagle3_core.plan import DEFAULT_RATES, load_rates, plan_run
    from eagle3_core.studies import team_bet as tb
    from eagle3_core.studies import team_bet_run as tr
    from eagle3_core.studies import team_bet_surface as ts
    t0, res = time.monotonic(), a.team_bet
    res.mkdir(parents=True, exist_ok=True)
    fractions = [float(x) for x in a.fractions.split(",")]
    n_train = cfg.prompts.num_train - int(cfg.prompts.num_train * cfg.train.eval_frac)   # before features exist
    points = tb.study_points(n_train, fractions, [g for g in a.grid.split(",") if g], a.seeds)
    rates = (json.loads((res / "rates.json").read_text()) if (res / "rates.json").exists() else
             load_rates(DEFAULT_RATES, a.profile) if a.profile else None)
    if rates:
        cost = ts.study_plan(cfg, rates, points, n_train, plan_run)
        print(json.dumps({"plan": cost}, indent=1), flush=True)
    else:
        print("== no rates yet (no RESULTS/rates.json, no --profile): the cost is printed after the first point")
    only = [n for n in a.only.split(",") if n] or None
    try:                                                 # a misspelt --only fails before the data stages
        tb.call_order([], only, {tb.point_name(p) for p in points})
    except ValueError as e:
        raise SystemExit(f"--only: {e}") from None
    if a.plan_only:
        return
    data = tr.data_stages(cfg, res)
    measure = tr.replay_measurer(cfg, a.measure_device, a.record_batch)
    n_all = len(load_samples(RunLayout(cfg.run_dir).features, verify=False))
    n_now = n_all - int(n_all * cfg.train.eval_frac)                   # the train split's samples
    points = tb.study_points(n_now, fractions, [g for g in a.grid.split(",") if g], a.seeds)
    left = None if a.budget_s is None else a.budget_s - (time.monotonic() - t0)
    run = tb.run_points(cfg, points, res, cfg.run_dir / "team_bet", measure, budget_s=left, partial=a.partial,
                        only=only)
    where = f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}, {a.config}"
    print(json.dumps(write_answers(cfg, a, run, data, where), indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, type=Path, help="PipelineConfig JSON")
    ap.add_argument("--fractions", default="0.125,0.25,0.5,1", help="sizes as fractions of the training samples")
    ap.add_argument("--side-by-side", default="", help="sizes (sample counts, among the study's) to train with "
                                                      "SpecForge too; 'max' = the largest")
    ap.add_argument("--extrapolate-to", default="", help="sample counts to predict tau at")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", type=int, help=argparse.SUPPRESS)         # worker: one size of the study
    ap.add_argument("--team-bet", type=Path, default=None, metavar="RESULTS",
                    help="run the team bet's points, results per point in RESULTS (committed between calls)")
    ap.add_argument("--grid", default="e6,e12", help="team bet: fixed-epoch recipes beside the plateau rule")
    ap.add_argument("--seeds", type=int, default=2, help="team bet: draft seeds at the largest size")
    ap.add_argument("--budget-s", type=float, default=None, help="team bet: start no point past this many seconds")
    ap.add_argument("--only", default="", help="team bet: the point names (comma-separated) this call may run, "
                                               "in that order; the others wait for another call")
    ap.add_argument("--partial", action="store_true",
                    help="team bet: start a point that may not fit; stop it at the budget, resumable on this machine")
    ap.add_argument("--profile", default=None, help="team bet: rates profile for the cost printed first")
    ap.add_argument("--plan-only", action="store_true", help="team bet: print the cost and stop")
    ap.add_argument("--measure-device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--record-batch", type=int, default=64, help="team bet: prompts per batched replay recording")
    ap.add_argument("--out", type=Path, default=None, help="team bet: also write the answers JSON here")
    ap.add_argument("--plot-dir", type=Path, default=None, help="team bet: write its two PNG plots here")
    ap.add_argument("--answers-only", action="store_true",
                    help="team bet: the answers and plots of the points committed in RESULTS (no GPU, no data)")
    a = ap.parse_args()
    cfg = load_config(a.config)
    if a.team_bet:
        (answers_only if a.answers_only else team_bet)(cfg, a)
        return
    if a.size is not None:
        study.train_and_measure(cfg, a.size, a.seed)
        return
    data_stages(cfg)
    sizes = study.study_sizes(cfg, [float(x) for x in a.fractions.split(",")])
    sbs = [sizes[-1] if x == "max" else int(x) for x in a.side_by_side.split(",") if x]
    if missing := set(sbs) - set(sizes):
        raise SystemExit(f"--side-by-side {sorted(missing)} not among the study's sizes {sizes}")
    print(f"== study sizes {sizes}; side by side at {sbs}", flush=True)
    run_jobs(cfg, a.config, sizes, sbs, a.seed)
    manifests = [study.train_and_measure(cfg, n, a.seed) for n in sizes]   # all cached by now
    res = study.finish_study(cfg, manifests, [int(x) for x in a.extrapolate_to.split(",") if x])
    print(res["markdown"])
    for n in sbs:
        print((cfg.run_dir / "scaling" / "logs" / f"specforge_{n}.log").read_text()[-1500:])


if __name__ == "__main__":
    main()
