"""Acceptance under sampling (evaluation.replay_sampled): the replay's coupling against speculative sampling itself
and against closed forms, on a 2-step chain with fixed target and draft distributions over a 4-token vocabulary;
the sampling filters by hand; temperature 0 through the sampled path is the greedy replay on the trained draft.

Statistical bounds: every comparison of counts with a closed form is Pearson's chi-square statistic against the
0.999 quantile of the chi-square distribution with (cells - 1) degrees of freedom (CHI2_999, standard tables), at
fixed seeds: deterministic, and a correct implementation fails it with probability 0.001 over seeds."""
import itertools

import pytest
import torch

from eagle3_core.config.sampling_config import SamplingConfig
from eagle3_core.evaluation.replay_sampled import (
    accept_probability,
    filtered_probs,
    replay_chain_sampled,
    replay_measure_sampled,
)

CHI2_999 = {2: 13.816, 3: 16.266, 15: 37.697}          # chi-square 0.999 quantiles by degrees of freedom
V = 4
# target p(next | previous token) and draft q_j(next | previous token) at chain step j = 1, 2: rows sum to 1
P = torch.tensor([[0.50, 0.30, 0.15, 0.05], [0.10, 0.60, 0.20, 0.10], [0.25, 0.25, 0.25, 0.25],
                  [0.05, 0.15, 0.30, 0.50]])
Q = torch.tensor([[[0.30, 0.50, 0.10, 0.10], [0.20, 0.40, 0.30, 0.10], [0.40, 0.10, 0.40, 0.10],
                   [0.10, 0.10, 0.20, 0.60]],
                  [[0.70, 0.10, 0.10, 0.10], [0.05, 0.30, 0.60, 0.05], [0.25, 0.35, 0.20, 0.20],
                   [0.10, 0.50, 0.10, 0.30]]])
HOT = SamplingConfig(temperature=1.0)                    # the tables are the distributions as they are


class TableDraft:
    """A draft whose distribution at chain step j after token t is Q[j - 1, t]. The replay feeds the draft target
    features (fuse: hidden 0) on the catch-up after a verify step, whose last position predicts step 1, and its own
    output (hidden 1) at later steps; the hidden read tells the step."""

    def __init__(self):
        self.fc = torch.nn.Linear(1, 1)

    def fuse(self, aux):
        return torch.zeros(*aux.shape[:-1], 1)

    def draft_to_target(self, ids):
        return ids

    def decode(self, token_ids, hidden, positions, cache):
        cache["k"] = torch.cat([cache["k"], positions[:, None, :, None].float()], 2) if "k" in cache else \
            positions[:, None, :, None].float()
        cache["v"] = cache["k"]
        steps = (hidden[0, :, 0] > 0.5).long()                          # 0: after target features, 1: own output
        logits = Q[steps, token_ids[0]].log()[None]                     # [1, T, V]
        return torch.ones(1, token_ids.shape[1], 1), logits


def _recordings(n: int, seed: int) -> list[dict]:
    """n trajectories x_1, x_2, x_3 of the target P after the prompt [0] (root x_1 of the first verify step)."""
    g, out = torch.Generator().manual_seed(seed), []
    for i in range(n):
        x, prev = [], 0
        for _ in range(3):
            x.append(int(torch.multinomial(P[prev], 1, generator=g)))
            prev = x[-1]
        p_x = torch.tensor([float(P[a, b]) for a, b in zip([0] + x[:-1], x)])
        out.append({"prompt": [0], "prompt_index": i, "seed": seed, "tokens": x, "p_x": p_x,
                    "aux": torch.zeros(4, 1)})
    return out


def _closed_form(rule: str) -> list[float]:
    """P(accepted length = 0, 1, 2) of the first verify step (root x_1 ~ P[0], drafts predict x_2, x_3).
    sampled: a drafted position is accepted with sum_y min(p(y), q(y)) and continues from the accepted y with
    weight min(p(y), q(y)); greedy_draft: accepted when the target's sample is the draft's argmax."""
    dist = torch.zeros(3)
    for r in range(V):
        if rule == "sampled":
            a1 = torch.minimum(P[r], Q[0, r])                           # [V]: accepted at step 1 with token y
            a2 = torch.stack([torch.minimum(P[y], Q[1, y]).sum() for y in range(V)])
        else:
            a1 = torch.zeros(V).index_fill(0, Q[0, r].argmax(), 1.0) * P[r]
            a2 = torch.stack([P[y, Q[1, y].argmax()] for y in range(V)])
        dist += P[0, r] * torch.stack([1 - a1.sum(), (a1 * (1 - a2)).sum(), (a1 * a2).sum()])
    return dist.tolist()


def _chi2(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True))


def _speculative_sampling(root: int, num_steps: int, g: torch.Generator, rule: str) -> tuple[int, list[int]]:
    """One verify step of speculative sampling itself (Leviathan et al. 2023, algorithm 1; Chen et al. 2023,
    algorithm 2), written from the papers: the draft proposes y ~ q ('sampled') or argmax q ('greedy_draft'); the
    target accepts with min(1, p(y)/q(y)) (greedy_draft: when its own sample equals y; else it emits that sample);
    on a rejection the token comes from normalize(max(0, p - q)); after all drafts a bonus from p. Returns
    (accepted drafts, emitted tokens)."""
    prev, emitted = root, []
    for j in range(num_steps):
        p, q = P[prev], Q[j, prev]
        if rule == "greedy_draft":
            x = int(torch.multinomial(p, 1, generator=g))
            emitted.append(x)
            if x != int(q.argmax()):
                return j, emitted
            prev = x
            continue
        y = int(torch.multinomial(q, 1, generator=g))
        if float(torch.rand(1, generator=g)) < min(1.0, float(p[y] / q[y])):
            emitted.append(y)
            prev = y
            continue
        emitted.append(int(torch.multinomial((p - q).clamp(min=0), 1, generator=g)))
        return j, emitted
    emitted.append(int(torch.multinomial(P[prev], 1, generator=g)))
    return num_steps, emitted


@pytest.mark.parametrize("rule", ["sampled", "greedy_draft"])
def test_accepted_lengths_of_the_replay_and_of_speculative_sampling_follow_the_closed_form(rule):
    """2-step chain, 4000 trajectories: the replay's accepted lengths (first verify step) and those of speculative
    sampling run for real both match the closed form (chi-square, 2 degrees of freedom, below the 0.999 quantile);
    the two rules' closed forms differ, and the replay with the ratio inverted (min(1, p/q)) fails the bound."""
    expected = _closed_form(rule)
    assert abs(sum(expected) - 1) < 1e-6
    recs, draft = _recordings(4000, seed=11), TableDraft()
    replay = [0, 0, 0]
    for rec in recs:
        coins = torch.Generator().manual_seed(1000 + rec["prompt_index"])
        replay[replay_chain_sampled(draft, rec, 2, HOT, rule, coins)["accepted"][0]] += 1
    assert _chi2(replay, expected) < CHI2_999[2], (replay, expected)
    g, real = torch.Generator().manual_seed(5), [0, 0, 0]
    for _ in range(4000):
        root = int(torch.multinomial(P[0], 1, generator=g))
        real[_speculative_sampling(root, 2, g, rule)[0]] += 1
    assert _chi2(real, expected) < CHI2_999[2], (real, expected)
    other = _closed_form("greedy_draft" if rule == "sampled" else "sampled")
    assert _chi2(replay, other) > 10 * CHI2_999[2]                     # the test tells the rules apart


def test_the_inverted_ratio_is_not_the_coupling():
    """What a wrong coupling would give: accepting the recorded token with min(1, p(x)/q(x)) (the forward rule
    applied to the target's sample) gives another length distribution, far outside the bound."""
    recs, hits = _recordings(4000, seed=11), [0, 0, 0]
    g = torch.Generator().manual_seed(3)
    for rec in recs:
        x1, x2, x3 = rec["tokens"]
        a = 0
        for j, (prev, x) in enumerate(((x1, x2), (x2, x3))):
            if float(torch.rand(1, generator=g)) < min(1.0, float(P[prev, x] / Q[j, prev, x])):
                a += 1
            else:
                break
        hits[a] += 1
    assert _chi2(hits, _closed_form("sampled")) > 10 * CHI2_999[2]


@pytest.mark.parametrize("rule", ["sampled", "greedy_draft"])
def test_speculative_sampling_emits_the_targets_own_distribution(rule):
    """Losslessness: the first two tokens speculative sampling emits after the root (16 cells) follow the target
    alone, p(z1 | root) p(z2 | z1) (chi-square, 15 degrees of freedom, 0.999 quantile); the replay's emitted tokens
    are the recorded target samples, so this is the distribution it reads."""
    g, counts = torch.Generator().manual_seed(7), [0] * (V * V)
    root = 2
    for _ in range(8000):
        emitted, prev = [], root
        while len(emitted) < 2:
            _, new = _speculative_sampling(prev, 2, g, rule)
            emitted += new
            prev = emitted[-1]
        counts[emitted[0] * V + emitted[1]] += 1
    expected = [float(P[root, a] * P[a, b]) for a, b in itertools.product(range(V), range(V))]
    assert _chi2(counts, expected) < CHI2_999[15], counts


def test_accept_probability_by_hand():
    q = torch.tensor([0.2, 0.5, 0.3])                      # draft ids 0, 1, 2 -> target ids 7, 3, 5
    ids = torch.tensor([7, 3, 5])
    assert accept_probability("sampled", q, ids, 3, 0.25) == 1.0            # q(x) 0.5 >= p(x)
    assert accept_probability("sampled", q, ids, 7, 0.8) == pytest.approx(0.25)
    assert accept_probability("sampled", q, ids, 9, 0.1) == 0.0             # outside the draft vocab
    assert accept_probability("greedy_draft", q, ids, 3, 0.01) == 1.0
    assert accept_probability("greedy_draft", q, ids, 5, 0.99) == 0.0


def test_filtered_probs_by_hand():
    logits = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))
    assert filtered_probs(logits, SamplingConfig()).tolist() == [0, 1, 0, 0]
    assert torch.allclose(filtered_probs(logits, HOT), torch.tensor([0.1, 0.4, 0.2, 0.3]))
    assert torch.allclose(filtered_probs(logits, SamplingConfig(temperature=1, top_k=2)),
                          torch.tensor([0, 4 / 7, 0, 3 / 7]))
    # top_p 0.6: 0.4 (mass before 0) and 0.3 (before: 0.4 <= 0.6) kept, 0.2 (before: 0.7) dropped
    assert torch.allclose(filtered_probs(logits, SamplingConfig(temperature=1, top_p=0.6)),
                          torch.tensor([0, 4 / 7, 0, 3 / 7]))
    # temperature 0.5 squares and renormalizes: 0.01, 0.16, 0.04, 0.09 (sum 0.30); top_p 0.6 keeps 0.16/0.3 = 0.53
    # and 0.09/0.3 = 0.3 (before 0.53); llama.cpp's order reads top_p on the untempered 0.4, 0.3: the same set
    hot = SamplingConfig(temperature=0.5, top_p=0.5)
    assert torch.allclose(filtered_probs(logits, hot), torch.tensor([0, 1.0, 0, 0]))     # 0.533 > 0.5: alone
    assert torch.allclose(filtered_probs(logits, hot, temperature_last=True), torch.tensor([0, 16 / 25, 0, 9 / 25]))


def test_tau_of_the_sampled_replay_over_prompts_and_seeds():
    """replay_measure_sampled pools seeds per prompt and reports both rules; on the table draft the sampled rule
    accepts more than the greedy-draft rule (closed forms of the first verify step: 1.30 against 0.48 accepted
    drafts)."""
    recs = _recordings(600, seed=1)
    for k, r in enumerate(recs):
        r["prompt_index"], r["seed"] = k % 100, k // 100                  # 100 prompts x 6 seeds
    m = replay_measure_sampled(TableDraft(), recs, 2, HOT)
    assert set(m) == {"sampled", "greedy_draft"}
    for rule, r in m.items():
        assert r["prompts"] == 100 and r["trajectories"] == 600 and len(r["per_prompt"]) == 100
        assert r["tau_ci95"][0] <= r["tau"] <= r["tau_ci95"][1]
        assert sum(p for p, _ in r["per_prompt"]) == 600 * 2             # M - 1 tokens from verify steps each
    assert m["sampled"]["tau"] > m["greedy_draft"]["tau"] + 0.1


@pytest.mark.slow
def test_temperature_0_through_the_sampled_path_is_the_greedy_replay_for_a_scripted_draft(target_model, tokenizer):
    """The embedded target's recordings, a draft that proposes the recorded sequence with about 1 token in 4 wrong
    (test_speculate.ScriptedDraft, reads no features): at temperature 0 both rules of the sampled replay take
    exactly replay_eval.replay_chain's verify steps and acceptances, with rejections and long runs among them."""
    from eagle3_core.evaluation.replay_eval import record_target, replay_chain
    from eagle3_core.evaluation.replay_sampled import record_sampled
    from eagle3_core.evaluation.speculate import TargetRunner
    from eagle3_core.data.chat import prompt_ids
    from test_speculate import ScriptedDraft
    runner = TargetRunner(target_model, [1, 14, 27])
    eos = {tokenizer.eos_token_id}
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": t}])
               for t in ["def add(a, b):", "Explain recursion in one sentence."]]
    greedy = record_target(runner, prompts, 40, eos)
    calls = []
    sampled = record_sampled(runner, prompts, 40, eos, SamplingConfig(), seeds=[0],
                             on_trajectory=lambda *a: calls.append(a))
    assert calls == [(i + 1, 2, len(r["tokens"])) for i, r in enumerate(sampled)]        # the stage's progress
    accepted = []
    for g, r in zip(greedy, sampled):
        assert r["tokens"] == g["tokens"]
        seq = g["prompt"] + g["tokens"]
        script = [(t + 1) % target_model.config.vocab_size if i * 37 % 11 < 3 else t for i, t in enumerate(seq)]
        draft = ScriptedDraft(script, target_model.config.vocab_size)
        for steps in (3, 4):
            ref = replay_chain(draft, g, steps)
            for rule in ("sampled", "greedy_draft"):
                got = replay_chain_sampled(draft, r, steps, SamplingConfig(), rule, torch.Generator().manual_seed(0))
                assert got == ref, (rule, steps)
            accepted += ref["accepted"]
    assert min(accepted) == 0 and max(accepted) >= 3


@pytest.mark.slow
def test_temperature_0_through_the_sampled_path_is_the_greedy_replay_on_the_trained_draft(e2e_memorised):
    """debug_tiny's trained draft on the embedded target: at temperature 0 every seed records the greedy tokens,
    and both rules of the sampled replay take exactly the verify steps of replay_eval's greedy replay (tau and
    per-prompt counts equal). At temperature 0.7 the seeds give other trajectories and tau stays in [1, S + 1]."""
    from eagle3_core.evaluation.replay_eval import record_target, replay_measure
    from eagle3_core.evaluation.replay_sampled import record_sampled
    draft, runner, eos, prompts = e2e_memorised
    greedy = record_target(runner, prompts, 32, eos)
    sampled = record_sampled(runner, prompts, 32, eos, SamplingConfig(), seeds=[0, 1])
    assert [r["tokens"] for r in sampled] == [g["tokens"] for g in greedy for _ in range(2)]
    assert all(r["p_x"].eq(1).all() for r in sampled)
    for steps in (3, 5):
        ref = replay_measure(draft, greedy, steps)
        m = replay_measure_sampled(draft, sampled, steps, SamplingConfig())
        assert ref["tau"] > 1.5                                          # the memorised answers are accepted
        for r in m.values():
            assert r["tau"] == ref["tau"] and r["per_prompt"] == [[2 * p, 2 * s] for p, s in ref["per_prompt"]]
    hot = SamplingConfig(temperature=0.7, top_p=0.95, seed=3)
    recs = record_sampled(runner, prompts[:2], 32, eos, hot, seeds=[3, 4])
    assert recs[0]["tokens"] != recs[1]["tokens"] and all(0 < float(r["p_x"].min()) for r in recs)
    m = replay_measure_sampled(draft, recs, 3, hot)
    assert all(1.0 <= r["tau"] <= 4.0 and r["trajectories"] == 4 and r["prompts"] == 2 for r in m.values())


@pytest.mark.slow
def test_the_evaluate_stage_measures_tau_at_the_evaluation_temperature(e2e_run, tmp_path):
    """eval.sampling at temperature 0.7 on a copy of the end-to-end run: the stage samples 2 trajectories per
    held-out prompt with the target in process, replays both drafts under both accept rules, writes the settings
    to its manifest, and the report names the temperature, both rules' taus and the declared serving settings'
    mismatch (serving at 1.0)."""
    import json
    import shutil

    from eagle3_core.contract.layout import RunLayout
    from eagle3_core.pipeline.evaluate_stage import run_evaluate
    from eagle3_core.pipeline.report import collect, markdown, write_plots
    cfg, _ = e2e_run
    run_dir = tmp_path / "run"
    shutil.copytree(cfg.run_dir, run_dir, ignore=shutil.ignore_patterns("eval"))
    hot = cfg.eval.model_copy(update={"sampling": SamplingConfig(temperature=0.7, top_p=0.95, seed=5),
                                      "sampled_seeds": 2, "max_new_tokens": 24,
                                      "serving": SamplingConfig(temperature=1.0, top_p=0.95)})
    lines = []
    out = run_evaluate(cfg.model_copy(update={"run_dir": run_dir, "eval": hot}), log=lines.append)
    assert out["report"] == "eval/report.json"                  # relative to the run directory
    report = json.loads(RunLayout(run_dir).stored(out["report"]).read_text())
    n = len(report["eval_ids"])
    assert report["evaluator"] == "replay_sampled" and report["recording"]["seeds"] == [5, 6]
    assert report["sampling"]["temperature"] == 0.7 and report["consistency"] is None
    for name in ("trained", "untrained"):
        rules = report[name]["rules"]
        assert set(rules) == {"sampled", "greedy_draft"} and report[name]["tau"] == rules["sampled"]["tau"]
        assert all(1.0 <= r["tau"] <= cfg.eval.num_draft_steps + 1 for r in rules.values())
    assert report["trained"]["prompts"] == n and report["trained"]["trajectories"] == 2 * n
    assert any("sampled replay at temperature 0.7" in line for line in lines)
    progress = [line for line in lines if "trajectories sampled at temperature 0.7" in line]
    assert [p.split(" of ")[0] for p in progress] == [f"evaluate: {i}" for i in range(1, 2 * n + 1)]
    manifest = json.loads((RunLayout(run_dir).eval / "manifest.json").read_text())
    assert manifest["serving"] == {"temperature": 1.0, "top_p": 0.95, "top_k": 0, "seed": 0}
    r = collect(run_dir)
    r["plots"] = write_plots(r, run_dir)
    md = markdown(r)
    assert "## Acceptance length (offline, temperature 0.7," in md and "Evaluator: sampled replay" in md
    t = report["trained"]["rules"]
    assert f"| trained | chain S={cfg.eval.num_draft_steps} | {n} | {t['sampled']['tau']:.2f} |" in md
    assert "| serving (declared) | 1 | 0.95 | off |" in md
    assert "evaluation and the declared serving settings differ (temperature)" in md
