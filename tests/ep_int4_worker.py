"""A torchrun worker for tests/test_int4_experts.py: every rank loads its share of an INT4 target
(target.ep_loading.load_int4_target, gloo, CPU), runs the same decoder forward, and rank 0 saves the final hidden
state and the aux layers' outputs to --out (torch.save).

    torchrun --nproc-per-node 2 tests/ep_int4_worker.py --model DIR --out FILE [--whole-attention]"""
import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_core.config import TargetConfig  # noqa: E402
from eagle3_core.distributed.rank_exit import rank_main  # noqa: E402
from eagle3_core.target.ep_loading import load_int4_target  # noqa: E402
from eagle3_core.target.loading import capture, decoder  # noqa: E402

IDS = torch.arange(2 * 12).view(2, 12) * 7 % 128             # the same [2, 12] token ids on every rank


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--whole-attention", action="store_true")
    a = ap.parse_args()
    rank_main(lambda: dist.init_process_group("gloo"), lambda: _forward(a))


def _forward(a) -> None:
    model = load_int4_target(TargetConfig(model=a.model), "cpu", dist.get_rank(), dist.get_world_size(),
                             shard_attention=not a.whole_attention)
    with torch.no_grad(), capture(model, [0, 1]) as store:
        final = decoder(model)(input_ids=IDS).last_hidden_state
    if dist.get_rank() == 0:
        torch.save({"final": final, "aux": store["aux"]}, a.out)


if __name__ == "__main__":
    main()
