"""benchmarks/domain_study.py's parts on toy inputs: the per-source subsets a recipe trains on (equal samples, the
mix's halves inside the single-source subsets), tau per prompt category with Spec-Bench's own categories, the mix
against each single source on the same prompts, and the plot from a result file. The study itself runs on a GPU
(docs/studies.md)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from domain_study import arm_recipes, by_category, mix_against_single, ordered, per_category  # noqa: E402
from recipe_tau_time import subset_indices  # noqa: E402

IDS = [f"gsm8k/{i}" if i % 3 else f"bfcl/{i}" for i in range(30)]          # 20 gsm8k, 10 bfcl


def test_each_arm_trains_on_its_own_sources_at_equal_samples():
    recipes = arm_recipes(6, 2, ["math", "function_calling", "mix"])
    picked = {a: [IDS[i] for i in subset_indices(IDS, r)] for a, r in recipes.items()}
    assert {a: len(p) for a, p in picked.items()} == {"math": 6, "function_calling": 6, "mix": 6}
    assert all(s.startswith("gsm8k/") for s in picked["math"])
    assert all(s.startswith("bfcl/") for s in picked["function_calling"])
    mix_g = [s for s in picked["mix"] if s.startswith("gsm8k/")]
    mix_b = [s for s in picked["mix"] if s.startswith("bfcl/")]
    assert len(mix_g) == len(mix_b) == 3
    assert set(mix_g) <= set(picked["math"]) and set(mix_b) <= set(picked["function_calling"])   # nested subsets
    assert recipes["mix"]["train"] == {"epochs": 2} and recipes["mix"]["measure"] == "last"
    with pytest.raises(ValueError, match=r"'bfcl' has 10 train samples, 11 asked"):
        subset_indices(IDS, {"sources": {"bfcl": 11}})
    assert subset_indices(IDS, {"samples": 5}) == subset_indices(IDS, {"samples": 5})
    assert subset_indices(IDS, {}) == list(range(30))
    with pytest.raises(SystemExit, match="choose from"):
        arm_recipes(6, 2, ["math", "poetry"])


ROWS = [{"source": "gsm8k", "meta": "{}"}, {"source": "gsm8k", "meta": "{}"}, {"source": "bfcl", "meta": "{}"},
        {"source": "spec_bench", "meta": json.dumps({"category": "writing"})},
        {"source": "spec_bench", "meta": json.dumps({"category": "qa"})}]


def test_tau_per_category_and_the_mix_against_each_single_source():
    cats = by_category(ROWS)
    assert cats == {"gsm8k": [0, 1], "bfcl": [2], "writing": [3], "spec_bench (all)": [3, 4], "qa": [4]}
    assert ordered(ROWS, cats) == ["bfcl", "gsm8k", "spec_bench (all)", "qa", "writing"]
    math = [[6, 3], [4, 2], [2, 2], [3, 3], [5, 5]]                 # [tokens_from_verify, verify_steps] per prompt
    mix = [[6, 3], [6, 2], [6, 2], [3, 3], [10, 5]]
    pc = per_category(math, cats)
    assert pc["gsm8k"]["tau"] == 10 / 5 and pc["gsm8k"]["prompts"] == 2
    assert pc["spec_bench (all)"]["tau"] == 8 / 8 and tuple(pc["bfcl"]["tau_ci95"]) == (1.0, 1.0)
    diff = mix_against_single({"math": {"per_prompt": math}, "mix": {"per_prompt": mix}}, cats)
    assert list(diff) == ["math"]
    assert diff["math"]["gsm8k"]["tau"] == pytest.approx(12 / 5 - 10 / 5)
    assert diff["math"]["bfcl"]["tau"] == pytest.approx(2.0) and tuple(diff["math"]["bfcl"]["ci95_paired"]) == (2.0, 2.0)
    assert diff["math"]["writing"]["tau"] == 0.0
    assert mix_against_single({"math": {"per_prompt": math}}, cats) == {}


def test_replot_draws_the_result_file(tmp_path):
    cats = ["bfcl", "gsm8k", "spec_bench (all)", "writing"]
    row = {c: {"tau": 1.5, "tau_ci95": [1.4, 1.6], "prompts": 4} for c in cats}
    res = {"samples": 800, "epochs": 6, "device": "NVIDIA H100 80GB HBM3", "date": "2026-12-06", "categories": cats,
           "arms": {a: {"per_category": row} for a in ("math", "function_calling", "mix")}}
    (tmp_path / "r.json").write_text(json.dumps(res))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "domain_study.py"), "--replot",
                          str(tmp_path / "r.json"), "--plot", str(tmp_path / "p.png")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_replay_goes_in_chunks_kept_as_done_and_merges_in_prompt_order(tmp_path):
    """recipe_tau_time.measure_all's replay path: a draft's held-out prompts are replayed in chunks of CHUNK, each
    kept as done; a later call replays only the chunks left, and measured.json is summarize_runs over all of them in
    prompt order (what one replay_measure over every prompt gives)."""
    import random

    from recipe_tau_time import CHUNK, merge_parts, part_path, replay_tasks

    from eagle3_core.evaluation.replay_eval import summarize_runs
    rng = random.Random(0)
    n, d, settings = 2 * CHUNK + 5, str(tmp_path / "draft"), {"eval": {"num_draft_steps": 3}, "eval_ids": ["x"]}
    runs = []
    for _ in range(n):
        acc = [rng.randint(0, 3) for _ in range(rng.randint(1, 6))]
        runs.append({"accepted": acc, "verify_steps": len(acc), "tokens_from_verify": sum(acc) + len(acc)})
    assert replay_tasks([d], n, settings) == [(d, 0, CHUNK), (d, CHUNK, 2 * CHUNK), (d, 2 * CHUNK, n)]
    for a, b in [(0, CHUNK), (2 * CHUNK, n)]:
        part_path(d, a, b).parent.mkdir(parents=True, exist_ok=True)
        part_path(d, a, b).write_text(json.dumps({"settings": settings, "runs": runs[a:b]}))
    assert replay_tasks([d], n, settings) == [(d, CHUNK, 2 * CHUNK)]                 # only the chunk left
    assert len(replay_tasks([d], n, {**settings, "eval_ids": ["y"]})) == 3          # other settings: all again
    part_path(d, CHUNK, 2 * CHUNK).write_text(json.dumps({"settings": settings, "runs": runs[CHUNK:2 * CHUNK]}))
    merge_parts(d, n, settings, 3)
    m = json.loads((tmp_path / "draft" / "measured.json").read_text())
    whole = summarize_runs(runs, 3)
    assert m["settings"] == settings and m["per_prompt"] == whole["per_prompt"] and len(m["per_prompt"]) == n
    assert m["tau"] == whole["tau"] == sum(r["tokens_from_verify"] for r in runs) / sum(len(r["accepted"]) for r in runs)
    assert m["accept_per_position"] == whole["accept_per_position"]
