"""Greedy decoding and chain speculative decoding on the embedded target: the reference computation, the accept
rule, forward-call counting and losslessness."""
import torch

from eagle3_core.data import prompt_ids
from eagle3_core.evaluate import compare_outputs
from eagle3_core.speculate import TargetRunner, greedy_generate, speculative_generate

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


def test_greedy_matches_transformers_generate(target_model, tokenizer):
    p = prompt_ids(tokenizer, PROMPT)
    ours = greedy_generate(TargetRunner(target_model, [1, 14, 26]), p, 24, set())
    with torch.no_grad():
        ref = target_model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
    assert ours["tokens"] == ref[0, len(p):].tolist()
    assert ours["forward_calls"] == 24


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


def test_trained_draft_is_lossless_and_counts_its_verify_steps(e2e_run, target_model, tokenizer):
    from eagle3_core.checkpoint import load_draft
    cfg, summary = e2e_run
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
