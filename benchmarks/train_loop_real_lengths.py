"""The trainer's own loop (trainer.train: packed rows, eval, checkpoints) on random features with a real length
distribution: seconds per epoch, real tokens per second, and every graph dynamo compiled (a recompile past the
expected TTT-step graphs fails the run: trainer.compile_guard).

GPU:  python benchmarks/train_loop_real_lengths.py                 SmolLM2-135M-shaped draft (H 576), N 8192, TTT 7
CPU:  python benchmarks/train_loop_real_lengths.py --tiny          small shapes, checks the script runs

Samples: lengths drawn from benchmarks/data/gsm8k_lengths.json, plus --long samples of --long-length tokens (cut
into windows by the packer); loss mask from 30% into each sample; target argmax = argmax of final @ lm_head.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_core.config import TrainConfig  # noqa: E402
from eagle3_core.training.draft_model import DraftShape  # noqa: E402
from eagle3_core.training.trainer import train  # noqa: E402
from eagle3_core.training.setup import build_draft  # noqa: E402

DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float32     # as the feature store hands them over


def samples(n: int, lengths: list[int], H: int, V: int, lm_head: torch.Tensor, g: torch.Generator,
            extra: list[int]) -> list[dict]:
    out = []
    picks = [lengths[int(i)] for i in torch.randint(0, len(lengths), (n,), generator=g)] + extra
    for j, T in enumerate(picks):
        final = torch.randn(T, H, generator=g)
        mask = torch.zeros(T, dtype=torch.bool)
        mask[int(0.3 * T):] = True
        out.append({"id": f"s{j}", "input_ids": torch.randint(0, V, (T,), generator=g), "loss_mask": mask,
                    "aux": torch.randn(T, 3 * H, generator=g).to(DTYPE), "final": final.to(DTYPE),
                    "target_top1": (final @ lm_head.T).argmax(-1)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--samples", type=int, default=None, help="train samples (default 4000; --tiny 40)")
    ap.add_argument("--long", type=int, default=4, help="extra samples of --long-length tokens")
    ap.add_argument("--long-length", type=int, default=None, help="default 3 x batch_tokens")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-tokens", type=int, default=None, help="default 4608 (--tiny 256)")
    ap.add_argument("--lengths", default=str(Path(__file__).with_name("data") / "gsm8k_lengths.json"))
    ap.add_argument("--kernels-only", action="store_true", help="compile only the kernels (flex attention, merge, "
                    "loss) and run the TTT steps eagerly, as before packing.packed_ttt_loss (before/after runs)")
    ap.add_argument("--whole-graph", action="store_true", help="train.graph 'row': the whole TTT loss of a row "
                    "(K steps) one compiled graph (default: train.graph 'auto', per TTT step at these sizes)")
    args = ap.parse_args()
    if args.kernels_only:
        import eagle3_core.training.trainer as trainer_mod
        from eagle3_core.training.ttt import ttt_loss
        trainer_mod.packed_ttt_loss = ttt_loss
    H, N, V, nh, I = (64, 256, 512, 4, 128) if args.tiny else (576, 8192, 49152, 9, 1536)
    bt = args.batch_tokens or (256 if args.tiny else 4608)
    n = args.samples or (40 if args.tiny else 4000)
    g = torch.Generator().manual_seed(0)
    lm_head = torch.randn(V, H, generator=g) * H ** -0.5
    lengths = json.loads(Path(args.lengths).read_text())["lengths"]
    if args.tiny:
        lengths = [max(8, x // 8) for x in lengths]
    long = [args.long_length or 3 * bt] * args.long
    train_s = samples(n, lengths, H, V, lm_head, g, long)
    eval_s = samples(max(4, n // 50), lengths, H, V, lm_head, g, [])
    shape = DraftShape(hidden_size=H, target_hidden_size=H, num_attention_heads=nh, num_key_value_heads=3 if not
                       args.tiny else 2, head_dim=64 if not args.tiny else 16, intermediate_size=I, vocab_size=V,
                       draft_vocab_size=N, aux_layer_ids=[1, 14, 26])
    vocab = torch.randperm(V, generator=g)[:N].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[vocab] = True
    draft = build_draft(shape, torch.randn(V, H, generator=g) * 0.02, vocab - torch.arange(N), t2d, 0)
    cfg = TrainConfig(epochs=args.epochs, lr=3e-4, batch_tokens=bt, ttt_length=7, checkpoint_every=10 ** 6,
                      batching="packed", eval_frac=0.0, graph="row" if args.whole_graph else "auto")
    tokens = sum(len(s["input_ids"]) for s in train_s)
    print(f"{len(train_s)} samples ({tokens:,} tokens, {args.long} of {long[0] if long else 0}), rows of {bt}, "
          f"draft H {H} N {N}, TTT 7, {args.epochs} epochs, device {'cuda' if torch.cuda.is_available() else 'cpu'}",
          flush=True)
    marks = [time.monotonic()]
    with tempfile.TemporaryDirectory() as out:
        summary = train(draft, train_s, eval_s, lm_head, cfg, Path(out), tensorboard=False,
                        on_epoch=lambda e, _: marks.append(time.monotonic()))
    for e in range(1, len(marks)):
        dt = marks[e] - marks[e - 1]
        print(f"epoch {e}: {dt:.1f} s, {summary['history'][e - 1]['tokens'] / dt:,.0f} real tok/s (eval included)")
    stats = torch._dynamo.utils.counters["stats"]
    print(f"dynamo: {stats['unique_graphs']} graphs compiled, frames {dict(torch._dynamo.utils.counters['frames'])}"
          f"{' (kernels only)' if args.kernels_only else ''}")


if __name__ == "__main__":
    main()
