"""SGLang deployment benchmark: the same prompts through `/generate` on a baseline server and on an EAGLE3 server.

Both servers get the same `--max-running-requests` and `--cuda-graph-max-bs` (otherwise the
comparison measures scheduling, not speculation). At each concurrency level every prompt is sent once, greedy, with
a fixed `max_new_tokens`:
    output tok/s = sum(meta_info.completion_tokens) / wall seconds of the level
    tau          = sum(meta_info.completion_tokens) / sum(meta_info.spec_verify_ct)     (EAGLE3 server only)
`spec_verify_ct` is what SGLang's tokenizer manager reports per finished request when speculation ran
(sglang 0.5.14 `srt/managers/tokenizer_manager.py::_calculate_spec_decoding_metrics`; its own `spec_accept_length`
is the same ratio per request). /generate applies no chat template: prompts are sent as token ids rendered with the
target's template (`data.chat.prompt_ids`).
A tau below 1.2 is reported as a probable misconfiguration (the reference case: `--speculative-algorithm EAGLE`
instead of `EAGLE3` gave tau ~1.0 with no error), with the checks to make.
"""
from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass

import httpx

from eagle3_core.config.eval_config import check_tree_params
from eagle3_core.config.sampling_config import SamplingConfig
from eagle3_core.serving.launcher import ServerError

MISCONFIGURED_TAU = 1.2
MISCONFIGURATION_CHECKS = [
    "the server runs `--speculative-algorithm EAGLE3` (EAGLE skips the draft's fc layer and d2t without an error)",
    ("the draft's config.json has eagle_config.eagle_aux_hidden_state_layer_ids naming the layers the features "
    "were extracted at as the target's SGLang model file reads them (models/llama.py adds one to each; "
    "models/deepseek_v2.py only when the first is 1; run eagle3_core.evaluation.preflight against the target)"),
    "model.safetensors holds d2t (offsets, target = draft + d2t) built from this target's tokenizer",
    ("prompts use the target's chat template exactly as in training (/generate applies none; a missing or "
    "different template puts the draft out of distribution)"),
]


@dataclass
class SpecArgs:
    """SGLang EAGLE-3 server arguments: S draft steps, top-k per step, T verify tokens (root included)."""
    draft_dir: str
    num_steps: int = 5
    topk: int = 1
    num_draft_tokens: int = 6
    algorithm: str = "EAGLE3"


def server_command(model: str, host: str, port: int, max_running_requests: int, cuda_graph_max_bs: int,
                   spec: SpecArgs | None = None, extra_args: list[str] | None = None,
                   python: str | None = None) -> list[str]:
    """`python -m sglang.launch_server ...` for the baseline (spec None) or the EAGLE3 server, run by `python` (the
    run's sglang_python) or this process's.

    `--cuda-graph-max-bs` is a deprecated alias of `--cuda-graph-max-bs-decode` in sglang 0.5.14 and the only name
    in older releases, so it works with both. Raises ValueError for algorithm other than EAGLE3 or tree parameters
    SGLang would reject (topk 1 needs num_draft_tokens = num_steps + 1), and a None or empty draft directory.
    """
    cmd = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", host, "--port",
           str(port),
           "--max-running-requests", str(max_running_requests), "--cuda-graph-max-bs", str(cuda_graph_max_bs)]
    if spec is not None:
        if spec.algorithm != "EAGLE3":
            raise ValueError(f"speculative algorithm {spec.algorithm!r}: an EAGLE-3 draft must be served with "
                             f"EAGLE3 (EAGLE ignores its fc layer and d2t and accepts almost nothing)")
        if spec.draft_dir is None or not str(spec.draft_dir).strip():
            raise ValueError(f"SpecArgs.draft_dir is {spec.draft_dir!r}: an EAGLE3 server needs the exported draft "
                             f"directory (draft/export of the train stage); without it SGLang would start without "
                             f"a draft model")
        check_tree_params(spec.num_steps, spec.topk, spec.num_draft_tokens)
        cmd += ["--speculative-algorithm", spec.algorithm, "--speculative-draft-model-path", str(spec.draft_dir),
                "--speculative-num-steps", str(spec.num_steps), "--speculative-eagle-topk", str(spec.topk),
                "--speculative-num-draft-tokens", str(spec.num_draft_tokens)]
    return cmd + list(extra_args or [])


def target_server_args(tp_size: int = 1, ep_size: int = 1, trust_remote_code: bool = False,
                       revision: str | None = None, extra_args: list[str] | None = None) -> list[str]:
    """The target-side sglang.launch_server arguments both servers share (sglang 0.5.14 `srt/server_args.py`:
    `--tp-size`, `--ep-size`, `--trust-remote-code`, `--revision`). Raises ValueError if ep_size does not divide
    tp_size (SGLang splits the TP ranks into EP groups)."""
    if tp_size % ep_size:
        raise ValueError(f"deploy_sglang.ep_size {ep_size} must divide tp_size {tp_size} (SGLang forms EP groups "
                         f"inside the TP ranks)")
    args = (["--tp-size", str(tp_size)] if tp_size > 1 else []) + (["--ep-size", str(ep_size)] if ep_size > 1
                                                                    else [])
    args += (["--trust-remote-code"] if trust_remote_code else []) + (["--revision", revision] if revision else [])
    return args + list(extra_args or [])


def generate_body(input_ids: list[int], max_new_tokens: int, sampling: SamplingConfig | None = None) -> dict:
    """A /generate request (sglang `GenerateReqInput`: input_ids, sampling_params, stream), greedy unless
    `sampling` samples: then its temperature, top_p, top_k (0: off, left out: SGLang's -1) and seed as
    `sampling_seed` (sglang 0.5.14 `srt/sampling/sampling_params.py` SamplingParams). max_new_tokens is always set
    (SGLang's default is 128)."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    if sampling is not None and not sampling.greedy:
        params.update({"temperature": sampling.temperature, "top_p": sampling.top_p,
                       **({"top_k": sampling.top_k} if sampling.top_k > 0 else {}), "sampling_seed": sampling.seed})
    return {"input_ids": input_ids, "sampling_params": params, "stream": False}


def parse_generate(data: dict, where: str) -> dict:
    """The fields the benchmark uses from a /generate response: completion_tokens, prompt_tokens,
    spec_verify_ct (None when the reply has none: a baseline server, or a request that ran no verify step),
    finish (stop|length), e2e_latency (s).
    Raises ServerError naming `where` for an aborted request or a response without meta_info.completion_tokens."""
    meta = data.get("meta_info") if isinstance(data, dict) else None
    if not isinstance(meta, dict) or "completion_tokens" not in meta:
        raise ServerError(f"{where}: /generate response without meta_info.completion_tokens: {str(data)[:300]}; "
                          f"is this an SGLang server?")
    finish = meta.get("finish_reason") or {}
    if isinstance(finish, dict) and finish.get("type") == "abort":
        raise ServerError(f"{where}: request aborted by the server ({finish.get('message')}, status "
                          f"{finish.get('status_code')}); check the server log")
    verify = meta.get("spec_verify_ct")
    return {"completion_tokens": int(meta["completion_tokens"]), "prompt_tokens": int(meta.get("prompt_tokens", 0)),
            "spec_verify_ct": None if verify is None else int(verify),
            "finish": finish.get("type") if isinstance(finish, dict) else str(finish),
            "e2e_latency": float(meta.get("e2e_latency") or 0.0)}


async def run_level(client: httpx.AsyncClient, url: str, prompts: list[dict], concurrency: int,
                    max_new_tokens: int, sampling: SamplingConfig | None = None) -> dict:
    """Send every prompt ({id, input_ids, category}) once with at most `concurrency` in flight (generate_body at
    `sampling`).
    Returns {concurrency, seconds (wall), rows: [parse_generate + id, category]}. Raises ServerError on HTTP errors."""
    sem = asyncio.Semaphore(concurrency)

    async def one(p: dict) -> dict:
        async with sem:
            try:
                resp = await client.post(f"{url}/generate", json=generate_body(p["input_ids"], max_new_tokens, sampling))
                resp.raise_for_status()
            except httpx.HTTPError as e:
                raise ServerError(f"{url}/generate failed for prompt {p['id']} ({type(e).__name__}: {e})") from e
            return {"id": p["id"], "category": p.get("category", ""),
                    **parse_generate(resp.json(), f"{url} prompt {p['id']}")}

    t0 = time.perf_counter()
    rows = await asyncio.gather(*(one(p) for p in prompts))
    return {"concurrency": concurrency, "seconds": time.perf_counter() - t0, "rows": list(rows)}


def summarize_level(level: dict) -> dict:
    """Output tok/s of one level and, where the server reported verify steps, tau and its per-category values: a
    reply without meta_info.spec_verify_ct counts as zero verify steps (its tokens still count), and the number of
    such replies is kept (`replies_without_verify_steps`)."""
    rows = level["rows"]
    tokens = sum(r["completion_tokens"] for r in rows)
    out = {"concurrency": level["concurrency"], "requests": len(rows), "completion_tokens": tokens,
           "seconds": level["seconds"], "output_tokens_per_s": tokens / level["seconds"],
           "finish_length": sum(r["finish"] == "length" for r in rows)}
    verify = [r["spec_verify_ct"] for r in rows]
    if any(v is not None for v in verify):
        # a reply without it ran no verify step: SGLang adds the spec_* fields only where spec_verify_ct > 0
        # (sglang 0.5.14 srt/managers/tokenizer_manager.py, _calculate_spec_decoding_metrics)
        out["replies_without_verify_steps"] = verify.count(None)
        out["spec_verify_ct"] = sum(v or 0 for v in verify)
        out["tau"] = tokens / max(out["spec_verify_ct"], 1)
        cats: dict[str, list] = {}
        for r in rows:
            cats.setdefault(r["category"], []).append(r)
        out["tau_per_category"] = {c: sum(r["completion_tokens"] for r in rs)
                                   / max(sum(r["spec_verify_ct"] or 0 for r in rs), 1)
                                   for c, rs in sorted(cats.items())}
    return out


def verdict(baseline: list[dict], eagle3: list[dict]) -> dict:
    """Compare summarized levels concurrency by concurrency. Returns {per_level: [{concurrency, baseline_tok_s,
    eagle3_tok_s, speedup, tau, break_even_tau}], tau (over all levels), summary (one sentence), warnings: [...]}.
    break_even_tau = tau / speedup: the tau at which that level's EAGLE3 server would match the baseline."""
    base = {b["concurrency"]: b for b in baseline}
    per_level, warnings = [], []
    for e in eagle3:
        b = base.get(e["concurrency"])
        if b is None:
            continue
        speedup = e["output_tokens_per_s"] / b["output_tokens_per_s"]
        tau_e = e.get("tau")
        # speed-up = tau * t_base / t_step (one verify step costs t_step, one plain decode step t_base); with the
        # step cost independent of how many drafts are accepted, the tau at which EAGLE3 breaks even is t_step /
        # t_base = tau / speed-up (the speed-up model of eagle3_core/evaluation/speedup.py, from SGLang's own numbers)
        per_level.append({"concurrency": e["concurrency"], "baseline_tok_s": b["output_tokens_per_s"],
                          "eagle3_tok_s": e["output_tokens_per_s"], "speedup": speedup, "tau": tau_e,
                          "break_even_tau": None if tau_e is None else tau_e / speedup})
    if any("tau" not in e for e in eagle3):
        warnings.append("the EAGLE3 server reported no meta_info.spec_verify_ct: it is not running speculative "
                        "decoding; check --speculative-algorithm EAGLE3 and --speculative-draft-model-path")
        tau = None
    else:
        tau = sum(e["completion_tokens"] for e in eagle3) / max(sum(e["spec_verify_ct"] for e in eagle3), 1)
        if tau < MISCONFIGURED_TAU:
            warnings.append(f"tau {tau:.2f} < {MISCONFIGURED_TAU}: probable misconfiguration, not a weak draft. "
                            "Check: " + "; ".join(MISCONFIGURATION_CHECKS))
    faster = [p["concurrency"] for p in per_level if p["speedup"] > 1.0]
    slower = [p["concurrency"] for p in per_level if p["speedup"] <= 1.0]
    parts = [f"{p['speedup']:.2f}x at concurrency {p['concurrency']}" for p in per_level]
    if faster and not slower:
        summary = "EAGLE3 is faster at every concurrency: " + ", ".join(parts)
    elif slower and not faster:
        summary = "EAGLE3 is slower at every concurrency: " + ", ".join(parts)
    else:
        summary = (f"EAGLE3 is faster at concurrency {faster}, slower at {slower}: " + ", ".join(parts))
    return {"per_level": per_level, "tau": tau, "summary": summary, "warnings": warnings}


def check_server_info(info: dict, spec: SpecArgs | None, max_running_requests: int, cuda_graph_max_bs: int) -> list:
    """Warnings where a server's /server_info (SGLang ServerArgs fields) differs from what was asked for."""
    warnings = []
    algo = info.get("speculative_algorithm")
    want = spec.algorithm if spec else None
    if (algo or None) != want:
        warnings.append(f"server reports speculative_algorithm {algo!r}, expected {want!r}")
    if info.get("max_running_requests") not in (None, max_running_requests):
        warnings.append(f"server reports max_running_requests {info['max_running_requests']}, asked for "
                        f"{max_running_requests}")
    graph_bs = info.get("cuda_graph_max_bs_decode", info.get("cuda_graph_max_bs"))
    if graph_bs not in (None, cuda_graph_max_bs):
        warnings.append(f"server reports cuda_graph_max_bs {graph_bs}, asked for {cuda_graph_max_bs}")
    if spec:
        for key, val in (("speculative_num_steps", spec.num_steps), ("speculative_eagle_topk", spec.topk),
                         ("speculative_num_draft_tokens", spec.num_draft_tokens)):
            if info.get(key) not in (None, val):
                warnings.append(f"server reports {key} {info[key]}, asked for {val}")
    return warnings


async def benchmark_server(url: str, prompts: list[dict], concurrencies: list[int], max_new_tokens: int,
                           timeout_s: float = 600.0, transport: httpx.AsyncBaseTransport | None = None,
                           sampling: SamplingConfig | None = None) -> dict:
    """/server_info, one warm-up request, then every concurrency level, every request at `sampling` (None:
    greedy). Returns {server_info, levels (summarized)}."""
    async with httpx.AsyncClient(timeout=timeout_s, transport=transport) as client:
        info_resp = await client.get(f"{url}/server_info")
        info = info_resp.json() if info_resp.status_code == 200 else {}
        await run_level(client, url, prompts[:1], 1, min(max_new_tokens, 16), sampling)      # warm-up, not counted
        levels = [summarize_level(await run_level(client, url, prompts, c, max_new_tokens, sampling))
                  for c in concurrencies]
    return {"server_info": {k: info.get(k) for k in ("version", "model_path", "speculative_algorithm",
                                                       "speculative_num_steps", "speculative_eagle_topk",
                                                       "speculative_num_draft_tokens", "max_running_requests",
                                                       "cuda_graph_max_bs", "cuda_graph_max_bs_decode")},
            "levels": levels}
