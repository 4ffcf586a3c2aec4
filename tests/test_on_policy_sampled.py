"""The on-policy gate for sampled regenerations (features.on_policy, issue 66): at temperature > 0 the target
writes tokens other than its argmax by design, so the gate reads the mean log-probability of the supervised tokens
under the target against what its own samples at that temperature average (logprob_gap). Checked on the embedded
target (real weights): its own answers sampled at 0.7 pass, human-written GSM8K answers to the same questions fail."""
import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import SHARED_DATA
from eagle3_core.config.sampling_config import SamplingConfig
from eagle3_core.data.chat import prompt_ids
from eagle3_core.data.markers import stop_ids
from eagle3_core.evaluation.replay_sampled import sample_trajectory
from eagle3_core.evaluation.speculate import TargetRunner
from eagle3_core.features.on_policy import SAMPLED_GAP_NATS, check_on_policy, logprob_sums, on_policy_by_source


def test_logprob_sums_by_hand():
    """V = 3, lm_head = identity on H = 3: logits are the final states. Token 1 follows position 0, token 2
    position 1 (mask 0, 1, 1)."""
    final = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    ids, mask = torch.tensor([0, 1, 2]), torch.tensor([0, 1, 1])
    logp0, logp1 = final[0].log_softmax(-1), final[1].log_softmax(-1)
    n, got, greedy = logprob_sums(final, torch.eye(3), ids, mask, 0.0)
    assert n == 2 and got == pytest.approx(float(logp0[1] + logp1[2]))
    assert greedy == pytest.approx(float(logp0[0] + logp1[1]))                  # the argmax's log p (ties: first)
    _, _, hot = logprob_sums(final, torch.eye(3), ids, mask, 0.5)
    q0, q1 = (final[0] / 0.5).softmax(-1), (final[1] / 0.5).softmax(-1)
    assert hot == pytest.approx(float((q0 * logp0).sum() + (q1 * logp1).sum()))


def _store(tmp_path, target_model, rows: dict[str, list[tuple[list[int], list[int]]]]):
    """A one-shard bf16 store of (prompt, answer) pairs per source: the target's final states from a forward over
    each sequence (the extractor's `final`), its argmax, the head file and manifest as the features stage writes."""
    ids, mask, top1, final, offs, names = [], [], [], [], [0], []
    for source, pairs in rows.items():
        for k, (p, a) in enumerate(pairs):
            seq = torch.tensor([p + a])
            with torch.no_grad():
                h = target_model(seq, output_hidden_states=True).hidden_states[-1][0]   # after the final norm
            ids.append(seq[0]), mask.append(torch.tensor([0] * len(p) + [1] * len(a), dtype=torch.int8))
            top1.append(target_model.lm_head(h).argmax(-1).int()), final.append(h.bfloat16())
            offs.append(offs[-1] + seq.shape[1]), names.append(f"{source}/{k}")
    T = offs[-1]
    save_file({"input_ids": torch.cat(ids).int(), "loss_mask": torch.cat(mask), "target_top1": torch.cat(top1),
               "offsets": torch.tensor(offs), "final": torch.cat(final), "aux": torch.zeros(T, 3, dtype=torch.bfloat16)},
              str(tmp_path / "shard_00000.safetensors"), metadata={"ids": json.dumps(names)})
    w = target_model.lm_head.weight.detach().float()
    save_file({"embed_tokens": w, "lm_head": w.clone()}, str(tmp_path / "head.safetensors"))
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "bf16", "shards": [
        {"file": "shard_00000.safetensors"}]}))
    return {n: n.split("/")[0] for n in names}


@pytest.mark.slow
def test_the_sampled_gate_passes_the_targets_own_samples_and_refuses_human_text(target_model, tokenizer, tmp_path):
    rows = [json.loads(line) for line in (SHARED_DATA / "gsm8k" / "train.jsonl").read_text().splitlines()[:4]]
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": r["question"]}]) for r in rows]
    runner, hot = TargetRunner(target_model, [1, 2, 3]), SamplingConfig(temperature=0.7)
    own = [(p, sample_trajectory(runner, p, 40, set(stop_ids(tokenizer)), hot, torch.Generator().manual_seed(i)))
           for i, p in enumerate(prompts)]
    human = [(p, tokenizer(r["answer"], add_special_tokens=False)["input_ids"][:40]) for p, r in zip(prompts, rows)]
    source_of = _store(tmp_path, target_model, {"own": own, "human": human})
    per = on_policy_by_source(tmp_path, source_of, temperature=0.7)
    print({s: {k: round(v, 3) for k, v in st.items()} for s, st in per.items()})
    assert abs(per["own"]["logprob_gap"]) < 0.3, per
    assert per["human"]["logprob_gap"] < -SAMPLED_GAP_NATS, per
    with pytest.raises(ValueError, match=r"source human: mean log-probability .* features.min_on_policy 0") as e:
        check_on_policy(per, 0.2, "the first shard")
    assert "source own" not in str(e.value)
    check_on_policy({"own": per["own"]}, 0.2, "the first shard")                  # the target's own samples pass
    check_on_policy(per, 0.0, "the first shard")                                  # 0: the gate is off
    greedy = on_policy_by_source(tmp_path, source_of)                             # the argmax share, as before
    assert "logprob_gap" not in greedy["own"] and greedy["own"]["fraction"] == per["own"]["fraction"]
