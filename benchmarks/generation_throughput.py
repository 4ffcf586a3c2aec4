"""Regeneration client benchmark: pipeline throughput against a minimal raw httpx loop, and the client's peak RSS
with many prompts queued.

  python benchmarks/generation_throughput.py            llama-server (embedded model) on 127.0.0.1, here on CPU
  python benchmarks/generation_throughput.py --tiny     small sizes: checks the script runs
  python benchmarks/generation_throughput.py --url http://127.0.0.1:30000 --api openai   a running server (SGLang)

1. Throughput. At each concurrency c, the same GSM8K prompts (tests/data) go through (a) a raw loop: c asyncio
   workers posting the pipeline's own request bodies with one httpx client, nothing else, and (b) the pipeline:
   `regenerate.regenerate` reading the prompts from Parquet, retries armed, answers flushed to Parquet shards. The
   local server gets c slots. Order raw, pipeline, pipeline, raw (drift cancels); each side's output tokens over
   its summed wall time, after a warm-up pass over the same prompts (prompt caches equally warm for every pass).
   Goal: pipeline / raw >= 0.95.
2. Memory. A synthetic prompt file of N rows (GSM8K questions cycled, unique ids) in one Parquet row group, as the
   prompts stage writes it; a fresh process regenerates it (1 new token each, 16 in flight) and reports its peak
   RSS (ru_maxrss) when the first 500 answers are in. Goal: the same for 10K and 100K prompts.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3_core.config import GenerationConfig, ServerConfig
from eagle3_core.data.prompt_set import write_rows
from eagle3_core.generation.regenerate import regenerate
from eagle3_core.serving.client import API_PATHS, TOKEN_ID_APIS, parse_response, request_body

GSM8K = ROOT / "tests" / "data" / "gsm8k" / "train.jsonl"


def questions(n: int) -> list[str]:
    with open(GSM8K) as f:
        out = [json.loads(line)["question"] for _, line in zip(range(n), f)]
    return out


def write_prompts(path: Path, n: int, pool: list[str], unique: bool = False) -> None:
    """n prompt rows cycling through `pool`; `unique`: each text made distinct (no dictionary-encoding shortcut:
    the file grows with n like a real prompt file)."""
    write_rows(path, [{"id": f"synthetic/{i}", "source": "synthetic", "meta": "{}", "messages": [
        {"role": "user", "content": pool[i % len(pool)] + (f" (Variant {i}.)" if unique else "")}]}
        for i in range(n)])


async def raw_loop(url: str, api: str, bodies: list[dict], concurrency: int) -> tuple[int, float]:
    """(output tokens, seconds): the least a client can do at this concurrency."""
    todo, tokens = iter(bodies), 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker() -> None:
            nonlocal tokens
            for body in todo:
                resp = await client.post(f"{url}{API_PATHS[api]}", json=body)
                resp.raise_for_status()
                tokens += parse_response(api, resp.json(), url)["completion_tokens"]
        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tokens, time.monotonic() - t0


def pipeline(url: str, api: str, prompts: Path, n: int, concurrency: int, max_new_tokens: int,
             work: Path, tokenizer) -> tuple[int, float]:
    out = Path(tempfile.mkdtemp(dir=work))
    gen = GenerationConfig(api=api, max_new_tokens=max_new_tokens, concurrency=concurrency, shard_size=n,
                           progress_interval_s=3600)
    t0 = time.monotonic()
    records = asyncio.run(regenerate(prompts, out, [0], "bench", gen, ServerConfig(), [url], tokenizer,
                                     log=lambda *_: None))
    return sum(r["completion_tokens"] for r in records), time.monotonic() - t0


def throughput(url: str | None, api: str, levels: list[int], max_new_tokens: int, work: Path,
               tokenizer=None, min_prompts: int = 16) -> list[dict]:
    """Token-id APIs render prompts with `tokenizer`; the raw loop gets the same ids, computed beforehand."""
    from eagle3_core.data.chat import prompt_ids
    from eagle3_core.serving.launcher import llama_server
    from eagle3_core.target.loading import embedded_gguf_path
    rows = []
    for c in levels:
        n = max(min_prompts, 4 * c)
        qs = questions(n)
        prompts = work / f"prompts_{c}.parquet"
        write_prompts(prompts, n, qs)
        msgs = [[{"role": "user", "content": q}] for q in qs]
        bodies = [request_body(api, m, prompt_ids(tokenizer, m) if api in TOKEN_ID_APIS else None, max_new_tokens,
                               0.0) for m in msgs]
        server = nullcontext(url) if url else llama_server(embedded_gguf_path(), work / f"server_{c}.log",
                                                           parallel=c, ctx_per_slot=512)
        with server as u:
            # warm-up over every prompt: llama-server (like SGLang) caches prompts, so every measured pass below
            # finds the same cache state (the first cold pass took 10x longer here)
            asyncio.run(raw_loop(u, api, bodies, c))
            raw, pipe = [0, 0.0], [0, 0.0]
            for side in ("raw", "pipeline", "pipeline", "raw"):
                tok, sec = (asyncio.run(raw_loop(u, api, bodies, c)) if side == "raw"
                            else pipeline(u, api, prompts, n, c, max_new_tokens, work, tokenizer))
                acc = raw if side == "raw" else pipe
                acc[0] += tok
                acc[1] += sec
        rows.append({"concurrency": c, "prompts": n, "raw_tok_s": raw[0] / raw[1], "pipeline_tok_s": pipe[0] / pipe[1],
                     "ratio": (pipe[0] / pipe[1]) / (raw[0] / raw[1])})
        print(f"  c={c:<3} raw {rows[-1]['raw_tok_s']:7.1f} tok/s   pipeline {rows[-1]['pipeline_tok_s']:7.1f} tok/s"
              f"   ratio {rows[-1]['ratio']:.3f}", flush=True)
    return rows


def _vm_mib(field: str) -> float:
    """VmRSS / VmHWM of this process in MiB (/proc/self/status). Not ru_maxrss: Linux carries the forking parent's
    size over exec into it."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def rss_child(prompts: str, url: str, stop_after: int, out_dir: str) -> None:
    """Runs in a fresh process: regenerate `prompts`, print the peak RSS (MiB) since imports when `stop_after`
    answers are in."""
    class Enough(Exception):
        pass

    base = _vm_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:                    # restart the peak (VmHWM) from here
        f.write("5")
    seen = {}

    def on_progress(snap: dict) -> None:
        if snap["answered"] >= stop_after:
            seen.update(peak=_vm_mib("VmHWM"), answered=snap["answered"])
            raise Enough
    gen = GenerationConfig(max_new_tokens=1, concurrency=16, progress_interval_s=0.2)
    n = __import__("pyarrow.parquet").parquet.ParquetFile(prompts).metadata.num_rows
    shards = list(range(-(-n // gen.shard_size)))
    try:
        asyncio.run(regenerate(Path(prompts), Path(out_dir), shards, "bench", gen, ServerConfig(), [url],
                               log=lambda *_: None, on_progress=on_progress))
    except Enough:
        pass
    print(json.dumps({"base_mib": base, **seen}))


def memory(url: str | None, sizes: list[int], stop_after: int, work: Path) -> list[dict]:
    from eagle3_core.serving.launcher import llama_server
    from eagle3_core.target.loading import embedded_gguf_path
    pool = questions(1000)
    rows = []
    server = nullcontext(url) if url else llama_server(embedded_gguf_path(), work / "server_rss.log", parallel=16,
                                                       ctx_per_slot=512)
    with server as u:
        for n in sizes:
            prompts = work / f"synthetic_{n}.parquet"
            write_prompts(prompts, n, pool, unique=True)
            t0 = time.monotonic()
            res = subprocess.run([sys.executable, __file__, "--rss-child", str(prompts), u, str(stop_after),
                                  tempfile.mkdtemp(dir=work)], capture_output=True, text=True, check=True)
            r = json.loads(res.stdout.strip().splitlines()[-1])
            rows.append({"prompts": n, "file_mib": prompts.stat().st_size / 2**20, **r,
                         "seconds": time.monotonic() - t0})
            print(f"  {n:>7} prompts queued ({rows[-1]['file_mib']:.1f} MiB Parquet): peak RSS {r['peak']:.0f} MiB "
                  f"after {r['answered']} answers (after imports: {r['base_mib']:.0f} MiB)", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="small sizes: check that the script runs")
    p.add_argument("--url", default=None, help="a running server (default: start llama-server here)")
    p.add_argument("--api", default="openai", choices=sorted(API_PATHS))
    p.add_argument("--tokenizer", default=None, help="HF tokenizer (name or folder) for token-id APIs (default: "
                   "the embedded target's)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--levels", type=int, nargs="*", default=None, help="concurrency levels (default 1 4 16)")
    p.add_argument("--sizes", type=int, nargs="*", default=None, help="queued prompts for the memory part "
                   "(default 10000 100000; none: skip it)")
    p.add_argument("--rss-child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rss_child:
        prompts, url, stop_after, out_dir = args.rss_child
        rss_child(prompts, url, int(stop_after), out_dir)
        return
    tokenizer = None
    if args.api in TOKEN_ID_APIS:
        from transformers import AutoTokenizer

        from eagle3_core.config import TargetConfig
        from eagle3_core.target.loading import load_tokenizer
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else load_tokenizer(TargetConfig())
    levels, sizes, stop_after = ([1, 2], [1000, 5000], 50) if args.tiny else ([1, 4, 16], [10_000, 100_000], 500)
    new_tokens, min_prompts = (4, 4) if args.tiny else (args.max_new_tokens, 16)
    levels = levels if args.levels is None else args.levels
    sizes = sizes if args.sizes is None else args.sizes
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print(f"throughput (output tokens/s, {new_tokens} new tokens per prompt, "
              f"greedy, api {args.api}):", flush=True)
        rows = throughput(args.url, args.api, levels, new_tokens, work, tokenizer, min_prompts)
        mem = []
        if sizes:
            print(f"memory (peak RSS of the client process, {stop_after} answers in):", flush=True)
            mem = memory(args.url, sizes, stop_after, work)
    print(json.dumps({"throughput": rows, "memory": mem,
                      "rss_ratio": mem[-1]["peak"] / mem[0]["peak"] if mem else None}, indent=1))


if __name__ == "__main__":
    main()
