"""A torchrun worker for tests/test_vocab_split.py: lm_head split over the vocabulary (features.vocab_split) on
every rank (gloo, CPU); rank 0 saves what the split gave, with its inputs, to --out (torch.save).

- 'random': final [N, H] and a head [V, H] of odd V (uneven slices), the same on every rank (seeded): the split's
  argmax (bf16, as the target's lm_head runs) and fp8_topk teacher (features.store_formats.exact_top's tuple);
- 'target': the ep_int4 load of the INT4 target at --model (experts and heads split too), an HFExtractor with the
  split head and the teacher on (features.backends.split_extractor's): forward's target_top1, teacher and final,
  and head_weights' gathered lm_head.

    torchrun --nproc-per-node 2 tests/vocab_split_worker.py --model DIR --out FILE"""
import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_core.config import TargetConfig  # noqa: E402
from eagle3_core.distributed.rank_exit import rank_main  # noqa: E402
from eagle3_core.features.extract import HFExtractor  # noqa: E402
from eagle3_core.features.store_formats import fp8_rounded  # noqa: E402
from eagle3_core.features.vocab_split import SplitHead, split_lm_head  # noqa: E402
from eagle3_core.target.ep_loading import load_int4_target  # noqa: E402

SEQS = [[(7 * i + 3) % 128 for i in range(12)], [(5 * i + 1) % 128 for i in range(9)]]   # B 2, ragged
V, H, N = 131, 16, 40                                        # 'random': 131 rows split 66 + 65


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rank_main(lambda: dist.init_process_group("gloo"), lambda: _run(a))


def _random() -> dict:
    g = torch.Generator().manual_seed(0)
    final, head = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    split = SplitHead(head.bfloat16())
    top1 = split.top1(final.bfloat16())
    split_fp32 = SplitHead(head)
    return {"final": final, "head": head, "top1": top1, "teacher": split_fp32.exact_top(final, fp8_rounded(final)),
            "slice": (split.start, split.stop)}


def _target(model_dir: str) -> dict:
    model = load_int4_target(TargetConfig(model=model_dir), "cpu", dist.get_rank(), dist.get_world_size())
    ext = HFExtractor(model, [0, 1], split_head=split_lm_head(model), teacher=True)
    out = ext.forward(SEQS)
    held = model.get_output_embeddings().weight.shape[0]
    return {**{k: out[k] for k in ("final", "target_top1", "teacher", "lengths")}, "lm": ext.head_weights()[1],
            "held_rows": held, "slice": (ext.split_head.start, ext.split_head.stop)}


def _run(a) -> None:
    got = {"random": _random(), "target": _target(a.model)}
    slices = [None] * dist.get_world_size()
    dist.all_gather_object(slices, (got["random"]["slice"], got["target"]["slice"]))
    if dist.get_rank() == 0:
        torch.save({**got, "slices": slices}, a.out)


if __name__ == "__main__":
    main()
