"""Greedy decoding and chain/tree speculative decoding on the embedded target: the reference computation, the accept
rule, tree construction and verification, forward-call counting and losslessness."""
import pytest
import torch

from eagle3_core.data.chat import prompt_ids
from eagle3_core.evaluation.acceptance import compare_outputs
from eagle3_core.evaluation.draft_tree import DraftTree, greedy_accept, tree_attention_mask
from eagle3_core.evaluation.speculate import (
    TargetRunner,
    commit,
    greedy_generate,
    prefill,
    propose,
    rollback,
    speculative_generate,
    verify,
)

PROMPT = [{"role": "user", "content": "Write a Python function that reverses a string."}]


class ScriptedDraft:
    """Stands in for a draft that proposes known tokens, to test the verify rule exactly; no trained draft is
    perfect (or perfectly wrong) on purpose. Position p (pair f_p, x_{p+1}) proposes script[p + 2]."""

    def __init__(self, script, vocab, wrong=False):
        self.script, self.vocab, self.wrong = script, vocab, wrong
        self.fc = torch.nn.Linear(1, 1)

    def fuse(self, aux):
        return aux[..., :1]

    def draft_to_target(self, ids):
        return ids

    def decode(self, token_ids, hidden, positions, cache):
        new = positions[:, None, :, None].float()                        # [1, 1, T, 1] stands in for k/v
        cache["k"] = torch.cat([cache["k"], new], 2) if "k" in cache else new
        cache["v"] = cache["k"]
        logits = torch.zeros(1, positions.shape[1], self.vocab)
        for i, p in enumerate(positions[0].tolist()):
            tok = self.script[p + 2] if p + 2 < len(self.script) else 0
            logits[0, i, (tok + 1) % self.vocab if self.wrong else tok] = 1.0
        return hidden, logits


class RankedDraft(ScriptedDraft):
    """Stands in for a draft whose second choice is sometimes the right one (a trained draft is not controllable
    like this): at position p the right token script[p + 2] is ranked first when p % 3 == 0 and second otherwise,
    behind a decoy; probabilities ~0.73 / 0.27."""

    def decode(self, token_ids, hidden, positions, cache):
        hidden, logits = super().decode(token_ids, hidden, positions, cache)
        logits.zero_()
        for i, p in enumerate(positions[0].tolist()):
            right = self.script[p + 2] if p + 2 < len(self.script) else 0
            logits[0, i, right] = 30.0 if p % 3 == 0 else 29.0
            logits[0, i, (right + 1) % self.vocab] = 29.0 if p % 3 == 0 else 30.0
        return hidden, logits


def test_tree_mask_and_greedy_accept_by_hand():
    #        0 (root)
    #      1     2          tokens: 1->10, 2->11, 3->12 (child of 1), 4->13 (child of 2), 5->14 (child of 3)
    #      3     4
    #      5
    tree = DraftTree(tokens=[7, 10, 11, 12, 13, 14], parents=[-1, 0, 0, 1, 2, 3], depth=[0, 1, 1, 2, 2, 3],
                     scores=[1.0] * 6)
    m = tree_attention_mask(tree, 2)[0, 0].int().tolist()
    assert m == [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 1, 0, 0, 0],
                 [1, 1, 1, 1, 0, 1, 0, 0], [1, 1, 1, 0, 1, 0, 1, 0], [1, 1, 1, 1, 0, 1, 0, 1]]
    assert greedy_accept(tree, [11, 0, 13, 0, 99, 0]) == ([2, 4], 99)    # second branch, then the bonus
    assert greedy_accept(tree, [10, 12, 0, 14, 0, 55]) == ([1, 3, 5], 55)  # the whole first branch
    assert greedy_accept(tree, [42, 0, 0, 0, 0, 0]) == ([], 42)          # nothing accepted
    assert tree.contains_path([10, 12]) and not tree.contains_path([11, 12])


def test_tree_follows_sglang_topk_selection(target_model, tokenizer):
    """k=2, S=3: candidates 2 + 4 + 4 in SGLang's order; T-1 = 5 best scores form the tree (checked by hand)."""
    runner = TargetRunner(target_model, [1, 14, 26])
    p = prompt_ids(tokenizer, PROMPT)[:12]
    script = list(range(100, 100 + 12 + 8))
    state = prefill(runner, RankedDraft(script, 49152), p)               # root at position 11: right is rank 2
    tree = propose(RankedDraft(script, 49152), state, 3, topk=2, num_draft_tokens=6)
    # depth 1 (pos 11): decoy 114 (.73), right 113 (.27); depth 2 (pos 12, right first): 114 (.73), 115 (.27)
    # scores: d1 [.73, .27]; d2 [.53, .20, .20, .07]; d3 (pos 13, right second): children of the two best d2
    hi, lo = torch.tensor([30.0, 29.0]).softmax(-1).tolist()
    assert tree.tokens[1:3] == [114, 113] and tree.parents[1:3] == [0, 0]
    assert tree.depth == [0, 1, 1, 2, 2, 3]
    assert tree.tokens[3:5] == [114, 115] and tree.parents[3:5] == [1, 1]   # the tie .20/.20: lower index wins
    assert tree.tokens[5] == 116 and tree.parents[5] == 3                  # decoy (right 115 + 1) after the best d2
    assert tree.scores[5] == pytest.approx(hi * hi * hi, rel=1e-5) and tree.scores[2] == pytest.approx(lo)
    with pytest.raises(ValueError, match="chain"):
        propose(RankedDraft(script, 49152), state, 3, topk=1, num_draft_tokens=6)
    with pytest.raises(ValueError, match=r"\[2, 11\]"):
        propose(RankedDraft(script, 49152), state, 3, topk=2, num_draft_tokens=12)


def test_tree_is_lossless_and_accepts_at_least_the_chain_from_identical_states(target_model, tokenizer):
    """At every verify step both the chain and the tree are verified from the same state; where the tree contains
    the chain's path the tree must accept at least as much. The output must equal target-only greedy decoding."""
    runner = TargetRunner(target_model, [1, 14, 26])
    p = prompt_ids(tokenizer, PROMPT)
    n_new = 20
    ref = greedy_generate(runner, p, n_new, set())
    draft = RankedDraft(p + ref["tokens"], 49152)
    state = prefill(runner, draft, p)
    contained, longer, steps = 0, 0, 0
    while len(state.tokens) < n_new:
        chain = propose(draft, state, 3)
        tree = propose(draft, state, 3, topk=2, num_draft_tokens=6)
        c_path, _, _ = verify(runner, state, chain)
        rollback(state)
        t_path, bonus, aux = verify(runner, state, tree)
        if tree.contains_path(chain.tokens[1:]):
            contained += 1
            assert len(t_path) >= len(c_path), (steps, chain, tree)
            longer += len(t_path) > len(c_path)
        state.tokens += commit(draft, state, tree, t_path, bonus, aux)
        steps += 1
    assert contained == steps and longer > 0        # the chain's path is always in this tree; rank-2 hits count
    assert compare_outputs(state.tokens[:n_new], ref["tokens"], ref["gaps"], 1e-3) == "equal"
    assert state.cache.get_seq_length() == state.n_ctx == len(p) + len(state.tokens) - 1


def test_tree_generate_is_lossless_and_counts_forwards(target_model, tokenizer):
    runner = TargetRunner(target_model, [1, 14, 26])
    p = prompt_ids(tokenizer, PROMPT)
    ref = greedy_generate(runner, p, 12, set())
    draft = RankedDraft(p + ref["tokens"], 49152)
    chain = speculative_generate(runner, draft, p, 12, set(), 3)
    tree = speculative_generate(runner, draft, p, 12, set(), 3, topk=2, num_draft_tokens=6)
    for run in (chain, tree):
        assert compare_outputs(run["tokens"], ref["tokens"], ref["gaps"], 1e-3) == "equal"
        assert run["forward_calls"] == 1 + run["verify_steps"] and run["tokens_from_verify"] == 11
    assert tree["verify_steps"] < chain["verify_steps"]                  # rank-2 tokens are accepted in the tree


def test_greedy_matches_transformers_generate(target_model, tokenizer):
    p = prompt_ids(tokenizer, PROMPT)
    ours = greedy_generate(TargetRunner(target_model, [1, 14, 26]), p, 24, set())
    with torch.no_grad():
        ref = target_model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
    assert ours["tokens"] == ref[0, len(p):].tolist()
    assert ours["forward_calls"] == 24


@pytest.mark.slow
def test_accept_rule_tau_and_forward_counts(target_model, tokenizer):
    runner = TargetRunner(target_model, [1, 14, 26])
    p = prompt_ids(tokenizer, PROMPT)
    ref = greedy_generate(runner, p, 24, set())
    script = p + ref["tokens"]
    S = 3
    perfect = speculative_generate(runner, ScriptedDraft(script, 49152), p, 24, set(), S)
    assert perfect["tokens"] == ref["tokens"]
    assert perfect["accepted"] == [S] * perfect["verify_steps"]
    assert perfect["verify_steps"] == 6                      # 23 tokens after the prefill's, 4 per verify step
    assert perfect["tokens_from_verify"] == 23
    assert perfect["forward_calls"] == 1 + perfect["verify_steps"]
    wrong = speculative_generate(runner, ScriptedDraft(script, 49152, wrong=True), p, 24, set(), S)
    assert wrong["tokens"] == ref["tokens"]                  # lossless when everything is rejected
    assert wrong["accepted"] == [0] * 23 and wrong["forward_calls"] == 24


def test_near_tie_rule():
    assert compare_outputs([1, 2, 3], [1, 2, 3], [1.0] * 3, 1e-3) == "equal"
    assert compare_outputs([1, 2, 4], [1, 2, 3], [1.0, 1.0, 5e-4], 1e-3) == "near_tie"
    assert compare_outputs([1, 2, 4], [1, 2, 3], [1.0, 1.0, 0.5], 1e-3) == "mismatch"
    assert compare_outputs([1, 2], [1, 2, 3], [1.0] * 3, 1e-3) == "mismatch"


@pytest.mark.slow
def test_trained_draft_is_lossless_and_counts_its_verify_steps(e2e_run, target_model, tokenizer):
    from eagle3_core.training.checkpoint import load_draft
    _, summary = e2e_run
    draft = load_draft(summary["draft_dir"])
    runner = TargetRunner(target_model, draft.shape.aux_layer_ids)
    eos = {tokenizer.eos_token_id}
    for text in ["def add(a, b):", "Explain recursion in one sentence."]:
        p = prompt_ids(tokenizer, [{"role": "user", "content": text}])
        ref = greedy_generate(runner, p, 40, eos)
        calls = runner.forward_calls
        spec = speculative_generate(runner, draft, p, 40, eos, 4)
        assert runner.forward_calls - calls == spec["forward_calls"] == 1 + spec["verify_steps"]
        assert compare_outputs(spec["tokens"], ref["tokens"], ref["gaps"], 1e-3) in ("equal", "near_tie")
        tree = speculative_generate(runner, draft, p, 40, eos, 4, topk=3, num_draft_tokens=8)
        assert compare_outputs(tree["tokens"], ref["tokens"], ref["gaps"], 1e-3) in ("equal", "near_tie")


@pytest.mark.slow
def test_trained_draft_tree_accepts_at_least_the_chain_from_identical_states(e2e_run, target_model, tokenizer):
    from eagle3_core.training.checkpoint import load_draft
    _, summary = e2e_run
    draft = load_draft(summary["draft_dir"])
    runner = TargetRunner(target_model, draft.shape.aux_layer_ids)
    p = prompt_ids(tokenizer, [{"role": "user", "content": "def add(a, b):"}])
    state, contained = prefill(runner, draft, p), 0
    while len(state.tokens) < 24:
        chain, tree = propose(draft, state, 3), propose(draft, state, 3, topk=3, num_draft_tokens=8)
        c_path, _, _ = verify(runner, state, chain)
        rollback(state)
        t_path, bonus, aux = verify(runner, state, tree)
        if tree.contains_path(chain.tokens[1:]):
            contained += 1
            assert len(t_path) >= len(c_path)
        state.tokens += commit(draft, state, tree, t_path, bonus, aux)
    assert contained > 0
