"""Deploy an EAGLE-3 draft on llama.cpp: GGUF conversion and a baseline-vs-speculative benchmark.

Layer ids: our drafts (and SGLang) name aux layers by decoder-layer *output*; llama.cpp's converter reads a
top-level `eagle_aux_hidden_state_layer_ids` as layer *inputs* (llama.cpp `convert_hf_to_gguf.py` / `conversion/llama.py`).
The conversion therefore writes output id + 1 at the top level of a copy of the draft directory, explicitly, for
default and custom ids alike.

Acceptance from llama.cpp: each verify step yields its accepted draft tokens plus one, so per request
verify steps = predicted_n - draft_n_accepted and tau = sum(predicted_n) / sum(verify steps) (llama.cpp `tools/server`: `timings.draft_n`, `draft_n_accepted`).

Sampling: llama.cpp drafts greedily (the draft's most probable token) and accepts a drafted token while the target's
own sample equals it (common/speculative.cpp, common/sampling.cpp `common_sampler_sample_and_accept_n`): the
'greedy_draft' rule of evaluation.replay_sampled, the offline tau to set beside its tau at temperature > 0.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from eagle3_core.config.sampling_config import SamplingConfig
from eagle3_core.contract.numbers import eta_text
from eagle3_core.evaluation.acceptance import VERDICTS, bootstrap_ci, compare_outputs
from eagle3_core.serving.client import generate_all
from eagle3_core.serving.launcher import ServerError, llama_server_binary
from eagle3_core.training.capacity import unservable
from eagle3_core.training.checkpoint import shape_from_config

# Near-tie threshold (nats) for llama.cpp's lossless check. Its batched verify and one-token decode run different
# quantized kernels (Q4_1 weights, Q8 activations): the same position's top-2 logprob gap was measured to differ by
# up to 0.34 between them on the embedded target, so differences at gaps below 0.5 are numerical, not a bug.
LLAMA_CPP_TIE_GAP = 0.5


def converter_dir() -> Path:
    """Folder of llama.cpp's convert_hf_to_gguf.py (+ conversion/, gguf-py/) beside the built llama-server."""
    return llama_server_binary().parent.parent


def convert_draft(draft_dir: Path, target_dir: Path, out_file: Path,
                  llama_cpp_layer_ids: list[int] | None = None) -> Path:
    """Convert an SGLang-format EAGLE-3 draft directory to a llama.cpp GGUF draft.

    target_dir: the target's HF directory (config.json + tokenizer), e.g. `target.loading.local_model_dir(...)`.
    llama_cpp_layer_ids: None (the right thing) writes our aux ids (layer outputs) + 1, which llama.cpp reads as
    layer inputs (GGUF `eagle3.target_layers`); anything else is written as given, for convention experiments.
    Raises ServerError with the converter's output tail if it fails, or naming the capacity option llama.cpp does
    not serve (training.capacity.SERVES) before converting.
    """
    cfg = json.loads((Path(draft_dir) / "config.json").read_text())
    shape = shape_from_config(cfg, str(Path(draft_dir) / "config.json"))
    if (why := unservable(shape, ("llama.cpp",))) is not None:
        raise ServerError(f"{draft_dir}: {why}")
    output_ids = shape.aux_layer_ids                                                    # layer outputs
    layer_inputs = llama_cpp_layer_ids if llama_cpp_layer_ids is not None else [i + 1 for i in output_ids]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "draft"
        shutil.copytree(draft_dir, work)
        # llama.cpp reads these as layer inputs: input of layer i+1 == output of layer i
        (work / "config.json").write_text(json.dumps({**cfg, "eagle_aux_hidden_state_layer_ids": layer_inputs},
                                                     indent=2))
        tool = converter_dir()
        env = {**os.environ, "PYTHONPATH": str(tool / "gguf-py") + os.pathsep + os.environ.get("PYTHONPATH", "")}
        out_file.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, str(tool / "convert_hf_to_gguf.py"), str(work), "--target-model-dir",
                               str(target_dir), "--outfile", str(out_file)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ServerError(f"llama.cpp could not convert {draft_dir}: {proc.stderr[-2000:]}")
    return out_file


def engine_aux_hidden_states(target_gguf: Path, draft_gguf: Path, tokens: list[int]) -> tuple[list[int], torch.Tensor]:
    """The target hidden states llama.cpp's EAGLE-3 decoder would feed `draft_gguf` for a prefill of `tokens`.

    Runs `llama-eagle3-layer-probe` (scripts/llama_layer_probe/probe.cpp, built beside llama-server), which makes
    the calls of llama.cpp's common/speculative.cpp: the draft's `eagle3.target_layers`, extraction of those
    target layers' inputs, one decode. Returns (llama.cpp's layer ids, float32 tensor [n_ids, len(tokens), H_t]).
    Raises ServerError if the probe is missing or fails.
    """
    probe = llama_server_binary().parent / "llama-eagle3-layer-probe"
    if not probe.exists():
        raise ServerError(f"{probe} not found: run `make setup` (or scripts/build_llama_server.sh)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "aux.bin"
        proc = subprocess.run([str(probe), str(target_gguf), str(draft_gguf), str(out), *map(str, tokens)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise ServerError(f"layer probe failed ({proc.returncode}): {proc.stderr[-2000:]}")
        raw = out.read_bytes()
    n_ids, n_tok, n_embd = np.frombuffer(raw, dtype=np.int32, count=3)
    ids = np.frombuffer(raw, dtype=np.int32, count=n_ids, offset=12).tolist()
    rows = np.frombuffer(raw, dtype=np.float32, offset=12 + 4 * n_ids).reshape(n_ids, n_tok, n_embd)
    return ids, torch.from_numpy(rows.copy())


def _tokens_and_gaps(logprobs_json: str) -> tuple[list[int], list[float]]:
    """Generated token ids and, per token, the gap between the two most likely tokens' log-probabilities
    (= their logit gap; for the near-tie rule of evaluation.acceptance)."""
    ids, gaps = [], []
    for tok in json.loads(logprobs_json):
        ids.append(int(tok["id"]))
        top = sorted((t["logprob"] for t in tok.get("top_logprobs", [])), reverse=True)
        gaps.append(top[0] - top[1] if len(top) > 1 else math.inf)
    return ids, gaps


def sampling_fields(s: SamplingConfig, seed: int | None = None) -> dict:
    """llama-server request fields that sample as `s` does (tools/server/README.md of the pinned llama.cpp, the
    /completion options its OpenAI endpoint also reads): greedy: temperature 0 and top_k 1 (it samples at
    temperature 0 otherwise); sampled: temperature, top_k (0: the whole vocabulary), top_p, min_p 0 (its defaults,
    top_k 40, top_p 0.95 and min_p 0.05, would cut the distribution further) and seed (default `s.seed`).
    llama.cpp's default sampler chain applies top-k and top-p before temperature (SamplingConfig)."""
    if s.greedy:
        return {"temperature": 0.0, "top_k": 1}
    return {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": 0.0,
            "seed": s.seed if seed is None else seed}


def run_requests(url: str, prompts: list[dict], max_new_tokens: int, log=None, label: str = "",
                 template_kwargs: dict | None = None, sampling: dict | None = None) -> list[dict]:
    """Answers one request at a time (single-stream speed), with llama.cpp timings and top-2 logprobs; greedy
    unless `sampling` (sampling_fields) says otherwise. Each request carries its row's tools and `template_kwargs`
    (the run's generation.chat_template_kwargs): the server (--jinja) renders the prompt as regeneration did.
    log: called with 'deploy: <label>: n of N prompts, ETA ...' after each answer."""
    t0, done = time.monotonic(), []
    sampling = sampling or sampling_fields(SamplingConfig())                     # greedy

    def on_done(row: dict) -> None:
        done.append(row["id"])
        n, N = len(done), len(prompts)
        eta = eta_text(time.monotonic() - t0, n, N - n)
        if log is not None:
            log(f"deploy: {label}: {n} of {N} prompts{eta}")
    rows = asyncio.run(generate_all(url, prompts, max_new_tokens, sampling["temperature"], 1, 2, 600,
                                    on_done=on_done, extra={"logprobs": True, "top_logprobs": 2, **sampling},
                                    template_kwargs=template_kwargs))
    for r in rows:
        t = json.loads(r["timings"])
        r["predicted_n"] = int(t.get("predicted_n", r["completion_tokens"]))
        r["draft_n"] = int(t.get("draft_n", 0))
        r["draft_n_accepted"] = int(t.get("draft_n_accepted", 0))
        r["tokens_per_s"] = float(t.get("predicted_per_second", 0.0))
        r["token_ids"], r["gaps"] = _tokens_and_gaps(r["logprobs"])
    return rows


def run_sampled(url: str, prompts: list[dict], max_new_tokens: int, s: SamplingConfig, seeds: list[int], log=None,
                label: str = "", template_kwargs: dict | None = None) -> list[dict]:
    """run_requests at `s` once per seed of `seeds` (each request carries its seed): rows with `seed` added,
    seed-major."""
    return [{**r, "seed": seed} for seed in seeds
            for r in run_requests(url, prompts, max_new_tokens, log, f"{label}, seed {seed}", template_kwargs,
                                  sampling_fields(s, seed))]


def _speed(base: list[dict], spec: list[dict]) -> dict:
    """One-stream tok/s with and without the draft and their ratio, from llama.cpp's timings."""
    base_tps = sum(r["predicted_n"] for r in base) / sum(r["predicted_n"] / r["tokens_per_s"] for r in base)
    spec_tps = sum(r["predicted_n"] for r in spec) / sum(r["predicted_n"] / r["tokens_per_s"] for r in spec)
    return {"baseline_tokens_per_s": base_tps, "tokens_per_s": spec_tps, "speedup": spec_tps / base_tps}


def summarize_sampled(base: list[dict], spec: list[dict]) -> dict:
    """summarize's numbers for sampled requests (run_sampled: several seeds per prompt): tau with its 95% bootstrap
    interval over prompts (each prompt's seeds together, as replay_sampled's), acceptance, tok/s. No token-equality
    check: at temperature > 0 the server with a draft draws other samples than the one without (lossless is a
    property of the distribution: replay_sampled's tests)."""
    per: dict[str, list[int]] = {}
    for r in spec:
        tot = per.setdefault(r["id"], [0, 0])
        tot[0], tot[1] = tot[0] + r["predicted_n"], tot[1] + r["predicted_n"] - r["draft_n_accepted"]
    tokens, steps = [v[0] for v in per.values()], [v[1] for v in per.values()]
    drafted, accepted = sum(r["draft_n"] for r in spec), sum(r["draft_n_accepted"] for r in spec)
    return {"tau": sum(tokens) / max(sum(steps), 1), "tau_ci95": bootstrap_ci(tokens, steps),
            "prompts": len(per), "requests": len(spec), "tokens": sum(tokens), "verify_steps": sum(steps),
            "draft_n": drafted, "draft_n_accepted": accepted, "acceptance_rate": accepted / max(drafted, 1),
            **_speed(base, spec), "lossless": "not checked by token equality at temperature > 0"}


def summarize(base: list[dict], spec: list[dict], tie_gap: float) -> dict:
    """tau, acceptance, tok/s and the lossless verdicts of llama.cpp's speculative run against its baseline."""
    tokens = [r["predicted_n"] for r in spec]
    steps = [r["predicted_n"] - r["draft_n_accepted"] for r in spec]
    verdicts = [compare_outputs(s["token_ids"], b["token_ids"], b["gaps"], tie_gap) for b, s in zip(base, spec)]
    drafted = sum(r["draft_n"] for r in spec)
    accepted = sum(r["draft_n_accepted"] for r in spec)
    return {"tau": sum(tokens) / max(sum(steps), 1), "tau_ci95": bootstrap_ci(tokens, steps),
            "tokens": sum(tokens), "verify_steps": sum(steps), "draft_n": drafted,
            "draft_n_accepted": accepted, "acceptance_rate": accepted / max(drafted, 1),
            **_speed(base, spec),
            "lossless": {v: verdicts.count(v) for v in VERDICTS}}
