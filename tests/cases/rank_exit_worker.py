"""A torchrun worker (gloo, CPU) that ends through eagle3_core.distributed.rank_exit.rank_main, for
tests/test_distributed.py. `raise`: the body starts a writer-like non-daemon thread (done after 1 s) and raises
ValueError; `stuck`: the body leaves a non-daemon thread that never ends ('stuck-writer'), joined for 1 s only."""
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from eagle3_core.distributed.rank_exit import rank_main  # noqa: E402


def raising() -> None:
    threading.Thread(target=time.sleep, args=(1.0,), name="slow-writer").start()
    raise ValueError("the body failed while its writer was busy")


def stuck() -> None:
    threading.Thread(target=threading.Event().wait, name="stuck-writer").start()


if __name__ == "__main__":
    rank_main(lambda: dist.init_process_group("gloo"), raising if sys.argv[1] == "raise" else stuck,
              join_timeout_s=1.0)
