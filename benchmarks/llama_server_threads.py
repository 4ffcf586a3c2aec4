"""How many decode threads should llama-server get on a small machine? The embedded target (SmolLM2-135M GGUF) on
llama-server with each `-t` given, alone and beside a second llama-server decoding at the same time (what a second
`make test` or `make demo` on the same machine does to the first).

  python benchmarks/llama_server_threads.py [--threads 1 2] [--slots 1 4] [--new-tokens 64] [--repeats 3]

Each measurement: `slots` concurrent /completion requests of `--new-tokens` greedy tokens (a GSM8K question from
tests/data as the prompt, ignore_eos), output tokens over wall time. Contended: the same server and request while a
second server with the same `-t` decodes the same load in a loop. Prints tok/s as median (min-max) of --repeats and
each `-t`'s ratio to the first, alone and contended. The launcher's default is `llama_server_threads()` (CPUs less
one)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3_core.serving.launcher import llama_server, llama_server_threads  # noqa: E402
from eagle3_core.target.loading import embedded_gguf_path  # noqa: E402

PROMPT = json.loads((ROOT / "tests/data/gsm8k/train.jsonl").read_text().splitlines()[0])["question"]


def decode(url: str, slots: int, new_tokens: int) -> float:
    """Output tokens per second of `slots` concurrent greedy requests of `new_tokens` each."""
    body = {"prompt": PROMPT, "n_predict": new_tokens, "temperature": 0.0, "ignore_eos": True, "cache_prompt": False}
    with httpx.Client(timeout=600) as client, ThreadPoolExecutor(slots) as pool:
        t0 = time.perf_counter()
        outs = list(pool.map(lambda _: client.post(f"{url}/completion", json=body).json(), range(slots)))
        wall = time.perf_counter() - t0
    return sum(o["tokens_predicted"] for o in outs) / wall


def stats(xs: list[float]) -> str:
    return f"{statistics.median(xs):7.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    p.add_argument("--slots", type=int, nargs="*", default=[1, 4])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    print(f"launcher default: -t {llama_server_threads()}", flush=True)
    rows: dict[tuple[str, int, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for t in a.threads:
            for slots in a.slots:
                with ExitStack() as stack:
                    url, other = (stack.enter_context(llama_server(
                        embedded_gguf_path(), Path(tmp) / f"server_{t}_{slots}_{k}.log", parallel=slots,
                        extra_args=["-t", str(t)])) for k in range(2))
                    decode(url, slots, 8)                                            # warm-up
                    rows["alone", t, slots] = [decode(url, slots, a.new_tokens) for _ in range(a.repeats)]
                    stop = threading.Event()

                    def load() -> None:
                        while not stop.is_set():
                            decode(other, slots, a.new_tokens)
                    loader = threading.Thread(target=load)
                    loader.start()
                    try:
                        time.sleep(1.0)
                        rows["contended", t, slots] = [decode(url, slots, a.new_tokens) for _ in range(a.repeats)]
                    finally:
                        stop.set()
                        loader.join()
                for how in ("alone", "contended"):
                    print(f"-t {t} slots {slots} {how:9s} tok/s {stats(rows[how, t, slots])}", flush=True)
    base = a.threads[0]
    for t in a.threads[1:]:
        for slots in a.slots:
            for how in ("alone", "contended"):
                r = statistics.median(rows[how, t, slots]) / statistics.median(rows[how, base, slots])
                print(f"ratio -t {t} / -t {base}, slots {slots}, {how}: {r:.2f}x")


if __name__ == "__main__":
    main()
