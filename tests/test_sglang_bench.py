"""The SGLang deployment benchmark's requests, response handling, tau arithmetic, verdict and misconfiguration
warning.

No SGLang server can run here (it needs CUDA), so /generate and /server_info are answered in-process through
httpx.MockTransport by `SGLangStandIn`, whose responses carry exactly the fields SGLang builds. Source: the
sglang==0.5.14 wheel (`pip download --no-deps sglang==0.5.14`), read, not run:
- `srt/managers/io_struct.py::GenerateReqInput`: request fields `text`/`input_ids`, `sampling_params`, `stream`;
- `srt/managers/tokenizer_manager.py::_handle_batch_output`: the response `{"text", "output_ids", "meta_info"}` with
  meta_info `id, finish_reason, prompt_tokens, weight_version, num_retractions, reasoning_tokens,
  completion_tokens, cached_tokens`, and `e2e_latency` once finished;
- same file, `_calculate_spec_decoding_metrics` (only when the server runs a speculative algorithm and
  spec_verify_ct > 0): `spec_accept_rate = correct / (verify_ct * (num_draft_tokens - 1))`,
  `spec_accept_length = completion_tokens / verify_ct`, `spec_num_correct_drafts`, `spec_num_proposed_drafts`,
  `spec_verify_ct`, aliases `spec_accepted_drafts`, `spec_proposed_drafts`, and `spec_correct_drafts_histogram`
  (alias `spec_accept_histogram`);
- `srt/managers/schedule_batch.py`: finish reasons `{"type": "length", "length": n}`, `{"type": "stop",
  "matched": id}`, `{"type": "abort", "message", "status_code", "err_type"}`;
- `srt/entrypoints/http_server.py::server_info`: `dataclasses.asdict(server_args)` + `version`; ServerArgs fields
  `speculative_algorithm`, `speculative_num_steps`, `speculative_eagle_topk`, `speculative_num_draft_tokens`,
  `max_running_requests`, `cuda_graph_max_bs_decode` (`--cuda-graph-max-bs` is its deprecated alias).
"""
import asyncio
import json

import httpx
import pytest

from conftest import SHARED_DATA
from eagle3_core.evaluation.sglang_bench import (
    SpecArgs,
    benchmark_server,
    check_server_info,
    parse_generate,
    server_command,
    verdict,
)
from eagle3_core.evaluation.sglang_deploy import benchmark_prompts, markdown
from eagle3_core.serving.launcher import ServerError

GENERATE_REQ_FIELDS = {"text", "input_ids", "input_embeds", "image_data", "sampling_params", "rid", "return_logprob",
                       "logprob_start_len", "top_logprobs_num", "stream", "lora_path", "return_hidden_states"}
# sglang 0.5.14 `srt/sampling/sampling_params.py` SamplingParams.__init__'s arguments, and its checks of the ones
# the benchmark sends (`verify`: top_k -1 or at least 1, top_p in (0, 1], temperature >= 0)
SAMPLING_PARAMS_FIELDS = {"max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
                          "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
                          "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
                          "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
                          "logit_bias", "sampling_seed"}


def check_sampling_params(sp: dict) -> None:
    """Refuse what sglang 0.5.14's SamplingParams would refuse (an unknown argument or a value `verify` rejects)."""
    assert set(sp) <= SAMPLING_PARAMS_FIELDS, set(sp) - SAMPLING_PARAMS_FIELDS
    assert sp.get("top_k", -1) == -1 or sp["top_k"] >= 1, sp
    assert 0 < sp.get("top_p", 1.0) <= 1 and sp.get("temperature", 1.0) >= 0, sp


def sglang_response(rid, completion_tokens, prompt_tokens, finish, spec=None):
    """A /generate response as sglang 0.5.14 builds it (module docstring). spec: (verify_ct, correct, T) or None."""
    meta = {"id": rid, "finish_reason": finish, "prompt_tokens": prompt_tokens, "weight_version": "default",
            "num_retractions": 0, "reasoning_tokens": 0, "completion_tokens": completion_tokens, "cached_tokens": 0,
            "e2e_latency": 0.01}
    if spec is not None and spec[0] > 0:
        verify_ct, correct, T = spec
        proposed = verify_ct * (T - 1)
        meta.update({"spec_accept_rate": correct / proposed, "spec_accept_length": completion_tokens / verify_ct,
                     "spec_num_correct_drafts": correct, "spec_num_proposed_drafts": proposed,
                     "spec_verify_ct": verify_ct, "spec_accepted_drafts": correct, "spec_proposed_drafts": proposed,
                     "spec_correct_drafts_histogram": [verify_ct - correct, correct],
                     "spec_accept_histogram": [verify_ct - correct, correct]})
    return {"text": "x" * completion_tokens, "output_ids": list(range(completion_tokens)), "meta_info": meta}


class SGLangStandIn:
    """Answers like an SGLang server: `plan` maps the first input id of a prompt to (completion_tokens,
    verify_ct); verify_ct None = a baseline server. Records request bodies and the most requests in flight."""

    def __init__(self, plan, algorithm=None, T=6, max_running_requests=32, graph_bs=32):
        self.plan, self.algorithm, self.T = plan, algorithm, T
        self.info = {"version": "0.5.14", "model_path": "target", "speculative_algorithm": algorithm,
                     "speculative_num_steps": T - 1 if algorithm else None,
                     "speculative_eagle_topk": 1 if algorithm else None,
                     "speculative_num_draft_tokens": T if algorithm else None,
                     "max_running_requests": max_running_requests, "cuda_graph_max_bs_decode": graph_bs}
        self.bodies, self.in_flight, self.max_in_flight = [], 0, 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info":
            return httpx.Response(200, json=self.info)
        assert request.url.path == "/generate" and request.method == "POST"
        body = json.loads(request.content)
        assert set(body) <= GENERATE_REQ_FIELDS, set(body) - GENERATE_REQ_FIELDS
        check_sampling_params(body["sampling_params"])
        self.bodies.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        n_new, verify_ct = self.plan[body["input_ids"][0]]
        n_new = min(n_new, body["sampling_params"]["max_new_tokens"])
        finish = ({"type": "length", "length": n_new} if n_new == body["sampling_params"]["max_new_tokens"]
                  else {"type": "stop", "matched": 2})
        spec = (min(verify_ct, n_new), max(n_new - verify_ct, 0), self.T) if self.algorithm else None
        return httpx.Response(200, json=sglang_response(f"r{len(self.bodies)}", n_new, len(body["input_ids"]),
                                                        finish, spec))


PROMPTS = [{"id": f"p{i}", "category": cat, "input_ids": [i, 7, 7]}
           for i, cat in enumerate(["coding", "coding", "math", "math"])]
# prompt first id -> (completion tokens, verify steps)
PLAN = {0: (60, 20), 1: (40, 20), 2: (64, 32), 3: (30, 30)}


def _bench(server, concurrencies=(1, 2), max_new=64):
    return asyncio.run(benchmark_server("http://sglang", PROMPTS, list(concurrencies), max_new,
                                        transport=httpx.MockTransport(server)))


def test_requests_are_greedy_generate_bodies_with_token_ids_and_concurrency_is_held():
    server = SGLangStandIn(PLAN, "EAGLE3")
    _bench(server, concurrencies=(2,))
    first = server.bodies[1]                                          # bodies[0] is the warm-up
    assert first == {"input_ids": [0, 7, 7], "sampling_params": {"max_new_tokens": 64, "temperature": 0.0},
                     "stream": False}
    assert server.bodies[0]["sampling_params"]["max_new_tokens"] == 16
    assert server.max_in_flight == 2 and len(server.bodies) == 1 + len(PROMPTS)


def test_tau_is_completion_tokens_over_verify_steps_overall_and_per_category():
    result = _bench(SGLangStandIn(PLAN, "EAGLE3"))
    for level in result["levels"]:
        assert level["completion_tokens"] == 60 + 40 + 64 + 30
        assert level["spec_verify_ct"] == 20 + 20 + 32 + 30
        assert level["tau"] == pytest.approx(194 / 102)
        assert level["tau_per_category"] == {"coding": pytest.approx(100 / 40), "math": pytest.approx(94 / 62)}
        assert level["output_tokens_per_s"] == pytest.approx(194 / level["seconds"])
        assert level["finish_length"] == 1                            # prompt 2 hit max_new_tokens
    assert result["server_info"]["speculative_algorithm"] == "EAGLE3"


def test_baseline_has_no_tau_and_verdict_compares_levels():
    base = _bench(SGLangStandIn(PLAN))
    spec = _bench(SGLangStandIn(PLAN, "EAGLE3"))
    assert all("tau" not in lv for lv in base["levels"])
    v = verdict(base["levels"], spec["levels"])
    assert [p["concurrency"] for p in v["per_level"]] == [1, 2]
    for p, b, e in zip(v["per_level"], base["levels"], spec["levels"]):
        assert p["speedup"] == pytest.approx(e["output_tokens_per_s"] / b["output_tokens_per_s"])
    assert v["tau"] == pytest.approx(2 * 194 / (2 * 102)) and v["warnings"] == []


def test_verdict_names_where_it_is_faster_and_slower():
    def level(c, tok_s, tau=None):
        lv = {"concurrency": c, "output_tokens_per_s": tok_s, "completion_tokens": 300, "spec_verify_ct": 100}
        return {**lv, "tau": tau} if tau else lv
    v = verdict([level(1, 90.0), level(32, 900.0)], [level(1, 180.0, 3.0), level(32, 810.0, 3.0)])
    assert v["summary"] == "EAGLE3 is faster at concurrency [1], slower at [32]: 2.00x at concurrency 1, 0.90x at " \
                           "concurrency 32"
    v = verdict([level(1, 90.0)], [level(1, 82.3, 2.1)])                # the reference case
    assert v["summary"].startswith("EAGLE3 is slower at every concurrency: 0.91x")


def test_tau_near_one_is_flagged_as_misconfiguration_with_the_checks():
    # the reference case: --speculative-algorithm EAGLE on an EAGLE-3 draft: every verify step yields one token
    plan = {k: (n, n) for k, (n, _) in PLAN.items()}
    base, spec = _bench(SGLangStandIn(PLAN)), _bench(SGLangStandIn(plan, "EAGLE"))
    v = verdict(base["levels"], spec["levels"])
    assert v["tau"] == pytest.approx(1.0)
    (w,) = v["warnings"]
    assert "probable misconfiguration" in w and "EAGLE3" in w and "aux_hidden_state_layer_ids" in w
    assert "d2t" in w and "chat template" in w
    info_warnings = check_server_info(spec["server_info"], SpecArgs("draft", 5, 1, 6), 32, 32)
    assert info_warnings == ["server reports speculative_algorithm 'EAGLE', expected 'EAGLE3'"]


def test_eagle3_server_without_verify_counts_is_reported():
    base = _bench(SGLangStandIn(PLAN))
    v = verdict(base["levels"], base["levels"])                        # "EAGLE3" results from a plain server
    assert v["tau"] is None and "not running speculative decoding" in v["warnings"][0]


def test_pinned_server_arguments_are_checked():
    info = SGLangStandIn(PLAN, "EAGLE3", max_running_requests=48, graph_bs=16).info
    ws = check_server_info(info, SpecArgs("draft", 5, 1, 6), 32, 32)
    assert ws == ["server reports max_running_requests 48, asked for 32",
                  "server reports cuda_graph_max_bs 16, asked for 32"]


def test_aborted_and_malformed_responses_raise_naming_the_request():
    abort = sglang_response("r1", 0, 3, {"type": "abort", "message": "Input length exceeds the context",
                                         "status_code": 400, "err_type": "BadRequestError"})
    with pytest.raises(ServerError, match="prompt p9: request aborted by the server .Input length exceeds"):
        parse_generate(abort, "prompt p9")
    with pytest.raises(ServerError, match="without meta_info.completion_tokens"):
        parse_generate({"choices": []}, "prompt p9")
    ok = parse_generate(sglang_response("r2", 5, 3, {"type": "stop", "matched": 2}), "p")
    assert ok == {"completion_tokens": 5, "prompt_tokens": 3, "spec_verify_ct": None, "finish": "stop",
                  "e2e_latency": 0.01}


def test_server_commands_pin_the_same_limits_and_refuse_eagle():
    base = server_command("m", "127.0.0.1", 30000, 32, 16)
    spec = server_command("m", "127.0.0.1", 30000, 32, 16, SpecArgs("d", 5, 1, 6))
    assert spec[:len(base)] == base
    assert base[base.index("--max-running-requests") + 1] == "32" and base[base.index("--cuda-graph-max-bs") + 1] == "16"
    assert spec[len(base):] == ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d",
                                "--speculative-num-steps", "5", "--speculative-eagle-topk", "1",
                                "--speculative-num-draft-tokens", "6"]
    with pytest.raises(ValueError, match="must be served with EAGLE3"):
        server_command("m", "127.0.0.1", 1, 8, 8, SpecArgs("d", algorithm="EAGLE"))
    with pytest.raises(ValueError, match="num_steps \\+ 1 = 6"):
        server_command("m", "127.0.0.1", 1, 8, 8, SpecArgs("d", 5, 1, 8))


def test_benchmark_prompts_from_spec_bench_and_human_eval():
    rows = benchmark_prompts(SHARED_DATA / "spec_bench" / "question.jsonl", True, 2)
    cats = {}
    for r in rows:
        cats[r["category"]] = cats.get(r["category"], 0) + 1
    assert len(cats) == 14 and set(cats.values()) == {2}               # MT-bench's 8 + 5 Spec-Bench + humaneval
    assert rows[0]["messages"][0]["content"].startswith("Compose an engaging travel blog post")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        benchmark_prompts(SHARED_DATA / "missing.jsonl", False, None)


def test_markdown_report_shows_levels_and_warning():
    spec = _bench(SGLangStandIn({k: (n, n) for k, (n, _) in PLAN.items()}, "EAGLE3"))
    v = verdict(_bench(SGLangStandIn(PLAN))["levels"], spec["levels"])
    md = markdown({"args": {"target": "t", "draft": "d", "steps": 5, "topk": 1, "draft_tokens": 6,
                            "max_running_requests": 32, "cuda_graph_max_bs": 32, "max_new_tokens": 64},
                   "prompts": 4, "eagle3": spec, "verdict": v})
    assert "| 1 |" in md and "| 2 |" in md and "**Warning**: tau 1.00 < 1.2" in md
