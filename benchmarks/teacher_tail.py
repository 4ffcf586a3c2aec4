"""How much of the target's distribution lies outside its top-k logits, and the teacher's total variation (TV)
from the exact softmax per way of storing it, on the embedded target's own greedy answers (CPU, fp32).

  python benchmarks/teacher_tail.py [--questions 6] [--new-tokens 64]

The embedded target answers the first GSM8K questions of tests/data greedily; at every answer position (the loss
reads the teacher there) the exact softmax p of the fp32 final state is compared with: bf16 and fp8 final states
(store_formats), the top-k logits alone (softmax over them), the exact top-k logits put over the fp8 ones, and
fp8_topk's teacher (exact top-k, the rest at their exact mass in proportion to the fp8 logits). Prints the mean tail
mass and each TV per k; the numbers in docs/benchmarks.md ("The loss's teacher per store format").
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eagle3_core.config import TargetConfig  # noqa: E402
from eagle3_core.data.chat import prompt_ids  # noqa: E402
from eagle3_core.evaluation.speculate import TargetRunner, greedy_generate  # noqa: E402
from eagle3_core.features import store_formats as ff  # noqa: E402
from eagle3_core.features.extract import HFExtractor  # noqa: E402
from eagle3_core.target.loading import load_target, load_tokenizer  # noqa: E402

GSM8K = Path(__file__).resolve().parents[1] / "tests" / "data" / "gsm8k" / "train.jsonl"


def answer_logits(questions: int, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(exact, bf16, fp8) logits [P, V] fp64 at the P answer positions of the target's greedy answers."""
    cfg = TargetConfig()
    model, tok = load_target(cfg), load_tokenizer(cfg)
    runner, ex = TargetRunner(model, [0]), HFExtractor(model, None)
    head = model.get_output_embeddings().weight.detach().double()
    out = ([], [], [])
    for line in GSM8K.read_text().splitlines()[:questions]:
        prompt = prompt_ids(tok, [{"role": "user", "content": json.loads(line)["question"]}])
        seq = prompt + greedy_generate(runner, prompt, new_tokens, {tok.eos_token_id})["tokens"]
        o = ex([seq])[0]
        read = slice(len(prompt) - 1, len(seq) - 1)                      # positions predicting answer tokens
        fp8 = ff.decode("fp8", ff.encode("fp8", o["aux"], o["final"], o["target_top1"]))["final"]
        for acc, f in zip(out, (o["final"].float(), o["final"].bfloat16().float(), fp8)):
            acc.append(f[read].double() @ head.T)
    return tuple(torch.cat(x) for x in out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args()
    z, zb, z8 = answer_logits(a.questions, a.new_tokens)
    p, q8 = z.softmax(-1), z8.softmax(-1)

    def tv(q):
        return (0.5 * (q - p).abs().sum(-1)).mean().item()
    print(f"{len(p)} answer positions; TV from the exact teacher: bf16 {tv(zb.softmax(-1)):.4%}, fp8 {tv(q8):.4%}")
    print("| k | tail mass | top-k alone | top-k over fp8 | fp8_topk |\n|---|---|---|---|---|")
    for k in (32, 64, 128, 256, 512, 1024):
        v, i = z.topk(k, -1)
        top = torch.zeros_like(p, dtype=torch.bool).scatter(-1, i, True)
        tail = p.masked_fill(top, 0).sum(-1, keepdim=True)
        alone = torch.zeros_like(p).scatter(-1, i, v.softmax(-1))
        over = z8.scatter(-1, i, v).softmax(-1)
        rest = q8.masked_fill(top, 0)
        hybrid = torch.where(top, p, rest * tail / rest.sum(-1, keepdim=True))
        print(f"| {k} | {tail.mean().item():.4%} | {tv(alone):.4%} | {tv(over):.4%} | {tv(hybrid):.4%} |")


if __name__ == "__main__":
    main()
