"""Run the SGLang deployment benchmark on a GPU host (needs `sglang` installed; the rest of the project is not).

    python -m eagle3_core.evaluation.sglang_deploy --target meta-llama/Llama-3.1-8B-Instruct \\
        --draft runs/llama8b/draft/export --steps 5 --topk 1 --draft-tokens 6 --concurrency 1,8,32 --out bench/

Pre-flight checks the draft against the target, then starts the baseline server, benchmarks it, stops it, starts
the EAGLE3 server with the same --max-running-requests / --cuda-graph-max-bs, benchmarks it, and writes
sglang_bench.json, sglang_bench.md and tok_s_vs_concurrency.png under --out. `--dry-run` prints the two server
commands and the first request without starting anything (works on CPU); `--tiny` uses one prompt per category,
32 new tokens and concurrency 1,2 (a smoke run).
Prompts: the first turn of each Spec-Bench question (category from the file) and HumanEval ('humaneval').
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import subprocess
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from eagle3_core.data.chat import prompt_ids
from eagle3_core.data.prompt_set import load_source
from eagle3_core.data.template_kwargs import check_tokenizer_kwargs
from eagle3_core.evaluation.plots import plot_tok_s_vs_concurrency
from eagle3_core.evaluation.preflight import preflight
from eagle3_core.evaluation.sglang_bench import (
    SpecArgs,
    benchmark_server,
    check_server_info,
    generate_body,
    server_command,
    target_server_args,
    verdict,
)
from eagle3_core.serving.launcher import free_port, launch

_ROOT = Path(__file__).resolve().parents[2]
# Spec-Bench prompts shipped with the repository (tests/data/README.md: source and licence)
DEFAULT_SPEC_BENCH = _ROOT / "tests" / "data" / "spec_bench" / "question.jsonl"


def benchmark_prompts(spec_bench: Path | None, human_eval: bool, per_category: int | None) -> list[dict]:
    """Rows {id, category, messages}: Spec-Bench first turns and HumanEval prompts, at most `per_category` each
    (in file order). Raises FileNotFoundError naming a missing Spec-Bench file."""
    rows = []
    if spec_bench is not None:
        if not Path(spec_bench).exists():
            raise FileNotFoundError(f"Spec-Bench file {spec_bench} not found; pass --spec-bench PATH "
                                    f"(data/spec_bench/question.jsonl) or --no-spec-bench")
        for line in Path(spec_bench).read_text().splitlines():
            if line.strip():
                q = json.loads(line)
                rows.append({"id": f"spec_bench/{q['question_id']}", "category": q["category"],
                             "messages": [{"role": "user", "content": q["turns"][0]}]})
    if human_eval:
        rows += [{**r, "category": "humaneval"} for r in load_source("human-eval")]
    if per_category is not None:
        seen: dict[str, int] = {}
        kept = []
        for r in rows:
            seen[r["category"]] = seen.get(r["category"], 0) + 1
            if seen[r["category"]] <= per_category:
                kept.append(r)
        rows = kept
    return rows


def markdown(result: dict) -> str:
    v, a = result["verdict"], result["args"]
    lines = [f"# SGLang deployment benchmark: {a['target']}", "",
             (f"- draft `{a['draft']}`, EAGLE3 with {a['steps']} steps, topk {a['topk']}, {a['draft_tokens']} draft "
             f"tokens; --max-running-requests {a['max_running_requests']} and --cuda-graph-max-bs "
             f"{a['cuda_graph_max_bs']} on both servers; {result['prompts']} prompts, greedy, "
             f"{a['max_new_tokens']} new tokens"),
             f"- verdict: {v['summary']}", "",
             "| concurrency | baseline tok/s | EAGLE3 tok/s | speedup | tau | break-even tau |",
             "|---|---|---|---|---|---|"]
    for p in v["per_level"]:
        tau = f"{p['tau']:.2f}" if p["tau"] is not None else "-"
        even = f"{p['break_even_tau']:.2f}" if p.get("break_even_tau") is not None else "-"
        lines.append(f"| {p['concurrency']} | {p['baseline_tok_s']:.1f} | {p['eagle3_tok_s']:.1f} | "
                     f"{p['speedup']:.2f}x | {tau} | {even} |")
    cats = result["eagle3"]["levels"][0].get("tau_per_category") if result["eagle3"]["levels"] else None
    if cats:
        lines += ["", "tau per category (first level): " + ", ".join(f"{c} {t:.2f}" for c, t in cats.items())]
    for w in v["warnings"]:
        lines += ["", f"**Warning**: {w}"]
    return "\n".join(lines) + "\n"


def sglang_installed(python: str | None = None) -> bool:
    """True if `sglang` can be imported here, or by the interpreter `python` (the run's sglang_python: asked by
    running it, nothing imported): its launch_server is what the stage starts."""
    if python is None:
        return importlib.util.find_spec("sglang") is not None
    try:
        probe = "import importlib.util as u, sys; sys.exit(u.find_spec('sglang') is None)"
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_benchmark(target: str, spec: SpecArgs, prompts: list[dict], levels: list[int], out: Path,
                  max_new_tokens: int, max_running_requests: int, cuda_graph_max_bs: int,
                  server_args: list[str] | None = None, urls: dict[str, str | None] | None = None,
                  host: str = "127.0.0.1", port: int = 0, startup_timeout_s: float = 1800.0,
                  transport=None, python: str | None = None, sampling=None) -> dict:
    """Benchmark the baseline and the EAGLE3 server on `prompts` ({id, category, input_ids}) at each concurrency
    of `levels`; writes sglang_bench.{json,md} and tok_s_vs_concurrency.png under `out` and returns the result
    (args, prompts, baseline, eagle3, verdict with tau, speed-up and break-even tau per level).

    urls: {'baseline': URL or None, 'eagle3': URL or None}: a given URL is a running server (its /server_info is
    checked against what was asked for); None starts that server here (`server_command` + `server_args`, both
    with the same --max-running-requests and --cuda-graph-max-bs), logged to out/<name>.log and stopped after.
    transport: an httpx transport for the running servers (tests answer through SGLang stand-ins with it).
    sampling: a config.sampling_config.SamplingConfig every request samples at (sglang_bench.generate_body; None:
    greedy).
    Raises ServerError naming the server, ValueError for an EAGLE (not EAGLE3) spec or a missing draft."""
    urls = urls or {}
    out.mkdir(parents=True, exist_ok=True)
    results, warnings = {}, []
    for name, sp in (("baseline", None), ("eagle3", spec)):
        cmd = server_command(target, host, port or free_port(host), max_running_requests, cuda_graph_max_bs, sp,
                             server_args, python)
        if urls.get(name):
            results[name] = asyncio.run(benchmark_server(urls[name].rstrip("/"), prompts, levels, max_new_tokens,
                                                         transport=transport, sampling=sampling))
        else:
            url = f"http://{host}:{cmd[cmd.index('--port') + 1]}"
            with launch(cmd, url, out / f"{name}.log", startup_timeout_s):
                results[name] = asyncio.run(benchmark_server(url, prompts, levels, max_new_tokens,
                                                             sampling=sampling))
        warnings += [f"{name}: {w}" for w in check_server_info(results[name]["server_info"], sp,
                                                                 max_running_requests, cuda_graph_max_bs)]
    v = verdict(results["baseline"]["levels"], results["eagle3"]["levels"])
    v["warnings"] = warnings + v["warnings"]
    result = {"args": {"target": target, "draft": spec.draft_dir, "steps": spec.num_steps, "topk": spec.topk,
                       "draft_tokens": spec.num_draft_tokens, "max_running_requests": max_running_requests,
                       "cuda_graph_max_bs": cuda_graph_max_bs, "max_new_tokens": max_new_tokens,
                       "server_args": list(server_args or []), "urls": urls,
                       "sampling": None if sampling is None else sampling.model_dump(mode="json")},
              "prompts": len(prompts), **results, "verdict": v}
    (out / "sglang_bench.json").write_text(json.dumps(result, indent=2))
    (out / "sglang_bench.md").write_text(markdown(result))
    plot_tok_s_vs_concurrency(v["per_level"], out / "tok_s_vs_concurrency.png")
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Benchmark an EAGLE-3 draft on SGLang against the same server without it.")
    p.add_argument("--target", required=True, help="target model path or hub name (as for sglang --model-path)")
    p.add_argument("--draft", required=True, help="exported draft directory (SGLang format)")
    p.add_argument("--revision", default=None, help="target hub revision (as for the pipeline's target.revision)")
    p.add_argument("--trust-remote-code", action="store_true", help="run the target's own code (e.g. Kimi-K2)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor parallel GPUs per server (Kimi-K2.5: 8)")
    p.add_argument("--ep-size", type=int, default=1, help="expert parallel size (divides --tp-size)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--topk", type=int, default=1)
    p.add_argument("--draft-tokens", type=int, default=6)
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--cuda-graph-max-bs", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--per-category", type=int, default=10, help="prompts per category (None: all)")
    p.add_argument("--spec-bench", default=str(DEFAULT_SPEC_BENCH))
    p.add_argument("--no-spec-bench", action="store_true")
    p.add_argument("--no-human-eval", action="store_true")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--startup-timeout", type=float, default=1800.0)
    p.add_argument("--out", default="sglang_bench")
    p.add_argument("--chat-template-kwargs", default="{}", metavar="JSON",
                   help="chat-template arguments the prompts are rendered with, as the run's "
                        "generation.chat_template_kwargs (e.g. '{\"thinking\": true}'); checked against the template")
    p.add_argument("--tiny", action="store_true", help="1 prompt per category, 32 new tokens, concurrency 1,2")
    p.add_argument("--dry-run", action="store_true", help="print the server commands and first request only")
    return p


def _tokenized_prompts(a: argparse.Namespace) -> list[dict]:
    """The benchmark prompts ({id, category, messages, input_ids}) rendered with the target's chat template, after
    the draft passed pre-flight against the target's config (preflight.preflight raises naming what differs)."""
    preflight(Path(a.draft), AutoConfig.from_pretrained(a.target, trust_remote_code=a.trust_remote_code,
                                                        revision=a.revision))
    tok = AutoTokenizer.from_pretrained(a.target, trust_remote_code=a.trust_remote_code, revision=a.revision)
    kwargs = json.loads(a.chat_template_kwargs) or None
    check_tokenizer_kwargs(tok, kwargs, "--chat-template-kwargs")
    rows = benchmark_prompts(None if a.no_spec_bench else Path(a.spec_bench), not a.no_human_eval, a.per_category)
    return [{**r, "input_ids": prompt_ids(tok, r["messages"], None, kwargs)} for r in rows]


def _print_dry_run(a: argparse.Namespace, spec: SpecArgs, prompts: list[dict], port: int, extra: list[str]) -> None:
    """--dry-run: the two server commands and the first request, nothing started."""
    cmds = {"baseline": server_command(a.target, a.host, port, a.max_running_requests, a.cuda_graph_max_bs,
                                       extra_args=extra),
            "eagle3": server_command(a.target, a.host, port, a.max_running_requests, a.cuda_graph_max_bs, spec,
                                     extra)}
    for name, cmd in cmds.items():
        print(f"{name}: {' '.join(cmd)}")
    print(f"{len(prompts)} prompts; first request: POST http://{a.host}:{port}/generate "
          f"{json.dumps(generate_body(prompts[0]['input_ids'], a.max_new_tokens))[:300]}")


def main(argv: list[str] | None = None) -> dict | None:
    """The command line (module docstring); returns the benchmark's result, None for --dry-run."""
    a = _parser().parse_args(argv)
    if a.tiny:
        a.per_category, a.max_new_tokens, a.concurrency = 1, 32, "1,2"
    levels = [int(c) for c in a.concurrency.split(",")]
    spec = SpecArgs(a.draft, a.steps, a.topk, a.draft_tokens)
    prompts = _tokenized_prompts(a)
    port = a.port or free_port(a.host)
    extra = target_server_args(a.tp_size, a.ep_size, a.trust_remote_code, a.revision)
    if a.dry_run:
        _print_dry_run(a, spec, prompts, port, extra)
        return None
    result = run_benchmark(a.target, spec, prompts, levels, Path(a.out), a.max_new_tokens, a.max_running_requests,
                           a.cuda_graph_max_bs, extra, host=a.host, port=port, startup_timeout_s=a.startup_timeout)
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
