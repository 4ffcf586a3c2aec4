"""Recordings for the replay evaluator without a whole target in one process: the target's greedy outputs on the
held-out prompts from the serving engine, and the aux hidden states over prompt + output from the run's features
backend (whatever it is: 'hf', 'hf_tp', ...), in a features store of its own under eval/replay/ (written by
pipeline/evaluate_stage.py's replay_recordings: the features stage is a pipeline stage).

Legend: n prompt tokens, M generated tokens, H_t target hidden.
Why the replay is the measurement: replay_eval's module docstring (greedy verification is lossless, so the
committed tokens of any chain run are the target's greedy tokens). Breakdowns follow the recorded tokens: a verify
step is counted in the category of its prompt, the length bucket of its context (tokens committed so far, prompt
included) and the segment (reasoning, tool_call, answer) of its root token, by the target's own marker tokens.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

from eagle3_core.contract.layout import RunLayout
from eagle3_core.data.markers import THINK, TOOL_FORMATS, stop_ids
from eagle3_core.evaluation.acceptance import bootstrap_ci
from eagle3_core.evaluation.speculate import stop_greedy
from eagle3_core.serving import launcher  # sglang_server read per call: tests replace it there
from eagle3_core.serving.client import API_PATHS, TOKEN_ID_APIS, parse_response, post_once, request_body
from eagle3_core.serving.hf_generate import BatchedGenerator
from eagle3_core.target.loading import load_target, load_tokenizer

LENGTH_BUCKETS = (512, 2048, 8192, 32768)       # context tokens at a verify step: <= 512, <= 2048, ..., longer
# (open, close) marker spellings of reasoning and tool-call spans: data.markers' THINK (and the <|think|> spelling),
# and each TOOL_FORMATS row's section and call markers
SEGMENT_MARKERS = {"reasoning": (THINK, ("<|think|>", "<|/think|>")),
                   "tool_call": tuple(pair for f in TOOL_FORMATS.values() for pair in ((f[0], f[1]), (f[2], f[4]))
                                      if pair[0])}


def greedy_outputs(cfg, prompts: list[list[int]], eos_ids: set[int], log=print) -> list[list[int]]:
    """The target's greedy continuation (temperature 0, at most eval.max_new_tokens, cut at EOS by
    speculate.stop_greedy) of every prompt (token ids), from the run's serving engine: server.kind 'transformers'
    in process (hf_generate.BatchedGenerator), 'sglang' through `/generate` of an SGLang server started here for
    the recording as the generation stage starts it (the run's sglang_python; log eval/replay_server.log), any
    other kind through the token-id API of server.url / server.urls (SGLang `/generate`, llama.cpp `/completion`:
    generation.api). eos_ids: every id the target stops on (data.markers.stop_ids). The stop token an answer ended
    on is kept, as the decoding evaluator keeps it (with_stop_token). Raises ValueError when the kind serves no
    token API here (no URL given), naming the field."""
    max_new = cfg.eval.max_new_tokens
    if cfg.server.kind == "sglang":
        s, log_path = cfg.server, RunLayout(cfg.run_dir).eval / "replay_server.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with launcher.sglang_server(cfg.target.model, log_path, s.host, s.port, cfg.target.revision,
                                    cfg.target.trust_remote_code, s.startup_timeout_s, s.extra_args,
                                    cfg.sglang_python) as url:
            answers = asyncio.run(_token_api(url, "sglang", prompts, max_new, cfg.generation.concurrency,
                                             cfg.generation.request_timeout_s))
    elif cfg.server.kind == "transformers":
        model, tok = load_target(cfg.target), load_tokenizer(cfg.target)
        gen = BatchedGenerator(model, tok, cfg.generation.concurrency, max_new,
                               stop_ids=stop_ids(tok, model.generation_config.eos_token_id))
        answers = asyncio.run(_gather(gen.complete, prompts))
    else:
        urls = cfg.server.urls or ([cfg.server.url] if cfg.server.url else [])
        api = cfg.generation.api_for(cfg.server.kind)
        if not urls or api not in TOKEN_ID_APIS:
            raise ValueError(f"eval.evaluator 'replay' records the target's greedy outputs through a token-id API: "
                             f"set server.url (a running server of the target) and generation.api 'sglang' or "
                             f"'llama.cpp' (got server.kind {cfg.server.kind!r}, api {api!r}), or eval.evaluator "
                             f"'decode'")
        answers = asyncio.run(_token_api(urls[0], api, prompts, max_new, cfg.generation.concurrency,
                                         cfg.generation.request_timeout_s))
    cut = [with_stop_token(a, eos_ids, max_new) for a in answers]
    log(f"evaluate: recorded the target's greedy outputs on {len(prompts)} held-out prompts "
        f"({sum(map(len, cut))} tokens, {sum(bool(g) and g[-1] in eos_ids for g in cut)} ended on a stop id, "
        f"server.kind {cfg.server.kind!r})")
    return cut


def with_stop_token(answer: dict, eos_ids: set[int], max_new: int) -> list[int]:
    """The greedy tokens of one answer ({output_ids, finish_reason, stop_id?}) as speculate.greedy_generate
    decodes them: cut after the first stop id or max_new tokens, and ending with the stop id the answer stopped on
    where the engine left it out of its output ids (HF generate's answers here and llama.cpp's `tokens` omit it,
    SGLang's `output_ids` hold it): `stop_id` when the engine says which (BatchedGenerator; SGLang's
    finish_reason.matched), else the smallest stop id (llama.cpp reports only `stop_type: eos`; a target with one
    stop id, the embedded one, is exact). Without it the last verify step of every EOS-ended answer would be
    lost."""
    g = []
    for t in answer["output_ids"]:
        g.append(int(t))
        if stop_greedy(g, eos_ids, max_new):
            return g
    if answer.get("finish_reason") == "stop" and eos_ids and len(g) < max_new:
        stop = answer.get("stop_id")
        g.append(int(stop) if stop is not None and int(stop) in eos_ids else min(eos_ids))
    return g


async def _gather(complete, prompts):
    return await asyncio.gather(*(complete(p) for p in prompts))


async def _token_api(url: str, api: str, prompts, max_new: int, concurrency: int, timeout_s: float):
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        async def one(p):
            async with sem:
                data = await post_once(client, url, API_PATHS[api], request_body(api, None, p, max_new, 0.0))
                answer = parse_response(api, data, url)
                matched = ((data.get("meta_info") or {}).get("finish_reason") or {}).get("matched")
                return {**answer, "stop_id": matched if isinstance(matched, int) else None}
        return await asyncio.gather(*(one(p) for p in prompts))


def marker_ids(tokenizer) -> dict[str, tuple[set[int], set[int]]]:
    """{segment: (open ids, close ids)} of SEGMENT_MARKERS that are single tokens of `tokenizer`."""
    vocab = tokenizer.get_vocab()
    return {seg: ({vocab[o] for o, _ in pairs if o in vocab}, {vocab[c] for _, c in pairs if c in vocab})
            for seg, pairs in SEGMENT_MARKERS.items()}


def segments(seq: list[int], markers: dict[str, tuple[set[int], set[int]]]) -> list[str]:
    """The segment of every position of `seq`: 'reasoning' or 'tool_call' from an open marker through its close
    marker, 'answer' elsewhere."""
    out, current = [], "answer"
    for t in seq:
        for seg, (opens, closes) in markers.items():
            if t in opens:
                current = seg
        out.append(current)
        if any(t in closes for _, closes in markers.values()):
            current = "answer"
    return out


def bucket(context: int) -> str:
    """The LENGTH_BUCKETS label of a context length in tokens."""
    for b in LENGTH_BUCKETS:
        if context <= b:
            return f"<={b}"
    return f">{LENGTH_BUCKETS[-1]}"


def breakdown(runs: list[dict], recordings: list[dict], categories: list[str], markers) -> dict:
    """tau (committed tokens per verify step, with bootstrap_ci over prompts) by 'category', 'length' and
    'segment' from replay_chain results that carry `roots` (the root position of each verify step)."""
    groups: dict[tuple[str, str], list[list[int]]] = {}
    for k, (run, rec, cat) in enumerate(zip(runs, recordings, categories, strict=True)):
        seq = rec["prompt"] + rec["tokens"]
        segs = segments(seq, markers)
        for a, root in zip(run["accepted"], run["roots"], strict=True):
            for key in (("category", cat), ("length", bucket(root + 1)), ("segment", segs[root])):
                per = groups.setdefault(key, {})
                produced, steps = per.get(k, (0, 0))
                per[k] = (produced + a + 1, steps + 1)
    out: dict[str, dict] = {"category": {}, "length": {}, "segment": {}}
    for (kind, name), per in sorted(groups.items()):
        produced, steps = [v[0] for v in per.values()], [v[1] for v in per.values()]
        out[kind][name] = {"tau": sum(produced) / sum(steps), "tau_ci95": bootstrap_ci(produced, steps),
                           "verify_steps": sum(steps), "prompts": len(per)}
    return out


def write_recording_summary(path: Path, recordings: list[dict]) -> None:
    """eval/replay/recording.json: what the replay measured against (prompt and output lengths)."""
    path.write_text(json.dumps({"prompts": len(recordings),
                                "prompt_tokens": [len(r["prompt"]) for r in recordings],
                                "output_tokens": [len(r["tokens"]) for r in recordings]}))
