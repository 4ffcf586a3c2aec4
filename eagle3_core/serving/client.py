"""HTTP requests for regeneration: one request/response format per server API, retries with backoff.

APIs (`GenerationConfig.api`):
- "openai": POST /v1/chat/completions (SGLang, vLLM, llama.cpp). The server applies the chat template; the answer
  comes back as text, with `reasoning_content` (SGLang, llama.cpp; vLLM: `reasoning`) kept apart.
- "sglang": POST /generate with `input_ids` (the prompt rendered with the target's chat template by the caller) and
  `sampling_params.max_new_tokens`; answer `output_ids`, `text`, `meta_info.finish_reason.type` (stop | length |
  abort), `meta_info.completion_tokens` (SGLang 0.5.14: `managers/io_struct.py` GenerateReqInput,
  `managers/tokenizer_manager.py` meta_info, `managers/schedule_batch.py` FINISH_* `to_json`). `/generate` applies
  no chat template, so training sees exactly the prompt and output tokens the target saw and produced.
- "llama.cpp": POST /completion with the prompt as token ids, `n_predict` and `return_tokens`; answer `tokens`,
  `content`, `stop_type` (eos | word | limit), `tokens_predicted` (llama.cpp tools/server, checked on the build in
  use: llama-cpp-python 0.3.36's vendored llama.cpp, `tools/server/server-schema.cpp` return_tokens,
  `server-task.cpp` to_json_non_oaicompat). Lets the token-id path be tested here, on CPU.
- "vllm": POST /v1/completions with the prompt as token ids and `return_token_ids` (vLLM >= 0.10.2,
  `vllm/entrypoints/openai/protocol.py` CompletionRequest); answer `choices[0].token_ids`, `text`,
  `finish_reason` (stop | length), `usage` (CompletionResponseChoice, UsageInfo).

Every request carries a max-new-tokens value (servers default to 128 tokens or to the context limit). Errors:
connection errors, timeouts, 429, 5xx and server-side aborts raise `RetryableError` (retried with exponential
backoff and jitter); other 4xx raise `RequestRejected` with the server's message (retrying cannot help).
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential_jitter,
)

from eagle3_core.serving.launcher import ServerError
from eagle3_core.serving.pool import ServerPool

API_PATHS = {"openai": "/v1/chat/completions", "sglang": "/generate", "llama.cpp": "/completion",
             "vllm": "/v1/completions"}
TOKEN_ID_APIS = ("sglang", "llama.cpp", "vllm")
MAX_BACKOFF_S = 60.0


class RetryableError(Exception):
    """A failed attempt worth retrying. `kind`: timeout | connection | http_429 | http_5xx | bad_body | abort (for
    counting); `server_down`: the server did not answer or said it is unavailable (skip it until /health answers)."""

    def __init__(self, kind: str, reason: str, server_down: bool = False):
        super().__init__(reason)
        self.kind, self.reason, self.server_down = kind, reason, server_down


class RequestRejected(Exception):
    """The server refused the request (4xx other than 429) or answered in a shape this API does not have."""


def request_body(api: str, messages: list[dict] | None, prompt_ids: list[int] | None, max_new_tokens: int,
                 temperature: float, extra: dict | None = None, top_p: float = 1.0, tools: list[dict] | None = None,
                 template_kwargs: dict | None = None, top_k: int = 0, seed: int | None = None) -> dict:
    """JSON body for one request. `messages` for 'openai', `prompt_ids` (int token ids) for the token-id APIs.

    tools (OpenAI tool schemas) and template_kwargs (chat-template arguments, e.g. {'enable_thinking': False})
    go into an 'openai' body as `tools` / `chat_template_kwargs` (SGLang, vLLM and llama-server with --jinja read
    both); the token-id APIs get a prompt already rendered with them (`data.chat.prompt_ids`). top_p < 1 is sent to
    every API (1.0 is each server's default, left out), top_k > 0 too; seed (sampled requests only) as `seed` to
    the OpenAI API, llama-server's /completion and vLLM, not to SGLang's /generate (no seed field checked there)."""
    greedy = temperature == 0.0
    sampled = {**({"top_k": top_k} if top_k > 0 and not greedy else {}),
               **({"seed": seed} if seed is not None and not greedy and api != "sglang" else {})}
    if api == "openai":
        body = {"messages": messages, "max_tokens": max_new_tokens, "temperature": temperature, "stream": False}
        if greedy:
            body["top_k"] = 1  # llama.cpp samples even at temperature 0 unless top_k is 1; others accept it
        if tools:
            body["tools"] = tools
        if template_kwargs:
            body["chat_template_kwargs"] = template_kwargs
        if top_p < 1.0:
            body["top_p"] = top_p
    elif api == "sglang":
        body = {"input_ids": prompt_ids, "stream": False,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature}}
        if top_p < 1.0:
            body["sampling_params"]["top_p"] = top_p
    elif api == "llama.cpp":
        body = {"prompt": prompt_ids, "n_predict": max_new_tokens, "temperature": temperature, "return_tokens": True,
                "stream": False, "cache_prompt": True}
        if greedy:
            body["top_k"] = 1
        if top_p < 1.0:
            body["top_p"] = top_p
    elif api == "vllm":
        body = {"prompt": prompt_ids, "max_tokens": max_new_tokens, "temperature": temperature,
                "return_token_ids": True, "stream": False}
        if top_p < 1.0:
            body["top_p"] = top_p
    else:
        raise ValueError(f"unknown generation.api {api!r}; choose one of {sorted(API_PATHS)}")
    if api == "sglang":
        body["sampling_params"].update(sampled)
    else:
        body.update(sampled)
    return {**body, **(extra or {})}


def parse_response(api: str, data: dict, url: str) -> dict:
    """The answer fields of one response: response, reasoning (str), finish_reason ('stop' | 'length' |
    'tool_calls' | other), prompt_tokens, completion_tokens (int), output_ids (list[int], token-id APIs only), model,
    timings (JSON str), tool_calls (JSON text of the OpenAI `message.tool_calls` list; '' when there are none, and
    always for the token-id APIs: regeneration reads their tool calls and reasoning from the ids by the target's
    marker tokens, generation.turns.parsed_answer).

    Raises RetryableError for an SGLang abort (e.g. the request was retracted), RequestRejected if the body has
    not this API's shape (the message names `url` and the `generation.api` setting)."""
    try:
        if api == "openai":
            choice = data["choices"][0]
            msg = choice.get("message") or {}
            usage = data.get("usage") or {}
            return {"response": msg.get("content") or "",
                    "reasoning": msg.get("reasoning_content") or msg.get("reasoning") or "",
                    "finish_reason": choice.get("finish_reason") or "",
                    "prompt_tokens": int(usage.get("prompt_tokens") or 0),
                    "completion_tokens": int(usage.get("completion_tokens") or 0), "output_ids": [],
                    "model": data.get("model") or "", "timings": json.dumps(data.get("timings") or {}),
                    "logprobs": json.dumps((choice.get("logprobs") or {}).get("content") or []),
                    "tool_calls": json.dumps(msg["tool_calls"]) if msg.get("tool_calls") else ""}
        if api == "sglang":
            meta = data["meta_info"]
            finish = meta.get("finish_reason") or {}
            if finish.get("type") == "abort":
                raise RetryableError("abort", f"{url} aborted the generation: {finish.get('message')}")
            ids = [int(t) for t in data["output_ids"]]
            small = {k: v for k, v in meta.items() if not isinstance(v, (list, dict)) or k == "finish_reason"}
            return {"response": data.get("text") or "", "reasoning": "", "finish_reason": finish.get("type") or "",
                    "prompt_tokens": int(meta.get("prompt_tokens") or 0),
                    "completion_tokens": int(meta.get("completion_tokens") or len(ids)), "output_ids": ids,
                    "model": "", "timings": json.dumps(small), "logprobs": "[]"}
        if api == "llama.cpp":
            ids = [int(t) for t in data["tokens"]]
            stop_type = data.get("stop_type", "")
            finish = {"eos": "stop", "word": "stop", "limit": "length"}.get(stop_type, stop_type)
            return {"response": data.get("content") or "", "reasoning": "", "finish_reason": finish,
                    "prompt_tokens": int(data.get("tokens_evaluated") or 0),
                    "completion_tokens": int(data.get("tokens_predicted") or len(ids)), "output_ids": ids,
                    "model": data.get("model") or "", "timings": json.dumps(data.get("timings") or {}),
                    "logprobs": "[]"}
        if api == "vllm":
            choice, usage = data["choices"][0], data.get("usage") or {}
            ids = [int(t) for t in choice["token_ids"]]              # None before vLLM 0.10.2: rejected below
            return {"response": choice.get("text") or "", "reasoning": "",
                    "finish_reason": choice.get("finish_reason") or "",
                    "prompt_tokens": int(usage.get("prompt_tokens") or 0),
                    "completion_tokens": int(usage.get("completion_tokens") or len(ids)), "output_ids": ids,
                    "model": data.get("model") or "", "timings": "{}", "logprobs": "[]"}
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
        raise RequestRejected(f"{url}{API_PATHS[api]} answered without the fields of the {api!r} API "
                              f"({type(e).__name__}: {e}); check generation.api for this server") from e
    raise ValueError(f"unknown generation.api {api!r}; choose one of {sorted(API_PATHS)}")


async def post_once(client: httpx.AsyncClient, url: str, path: str, body: dict) -> dict:
    """One POST. Raises RetryableError (connection error, timeout, 429, 5xx, unreadable body) or RequestRejected
    (other 4xx, with the server's message)."""
    try:
        resp = await client.post(f"{url}{path}", json=body)
    except httpx.TimeoutException as e:
        raise RetryableError("timeout", f"timeout ({type(e).__name__})",
                             server_down=isinstance(e, httpx.ConnectTimeout)) from e
    except httpx.TransportError as e:
        raise RetryableError("connection", f"connection error ({type(e).__name__}: {e})", server_down=True) from e
    if resp.status_code == 429 or resp.status_code >= 500:
        kind = "http_429" if resp.status_code == 429 else "http_5xx"
        # 502-504: the server (or the gateway's upstream) is unavailable, e.g. SGLang loading: wait for /health
        raise RetryableError(kind, f"HTTP {resp.status_code}: {resp.text[:200]}",
                             server_down=resp.status_code in (502, 503, 504))
    if resp.status_code >= 400:
        raise RequestRejected(f"{url}{path} rejected the request with HTTP {resp.status_code}: {resp.text[:500]}")
    try:
        return resp.json()
    except ValueError as e:
        raise RetryableError("bad_body", f"unreadable response body ({e})") from e


async def request_with_retries(pool: ServerPool, client: httpx.AsyncClient, api: str, body: dict, max_retries: int,
                               backoff_s: float, on_retry=None) -> tuple[dict, str, int]:
    """Send `body` to a server of `pool` until it answers: (parsed answer, server URL, attempts).

    Each attempt goes to the reachable server with the fewest requests in flight; waiting for a reachable server
    does not use up attempts. Waits between attempts: backoff_s * 2**n plus up to backoff_s of jitter, at most 60 s
    (tenacity `wait_exponential_jitter`). `on_retry(error)` gets each failed attempt's RetryableError before its wait.
    Raises RetryableError after max_retries + 1 failed attempts, RequestRejected at once, launcher.ServerStopped /
    ServerExited at once when the server this process started was stopped or died, ServerError from the pool when
    no server has answered for its `down_timeout_s`."""
    path = API_PATHS[api]
    attempts = 0

    def before_sleep(state) -> None:
        if on_retry is not None:
            on_retry(state.outcome.exception())

    async for attempt in AsyncRetrying(retry=retry_if_exception_type(RetryableError),
                                       stop=stop_after_attempt(max_retries + 1),
                                       wait=wait_exponential_jitter(initial=backoff_s, max=MAX_BACKOFF_S,
                                                                    jitter=backoff_s),
                                       before_sleep=before_sleep, reraise=True):
        with attempt:
            attempts += 1
            async with pool.server() as url:
                try:
                    data = parse_response(api, await post_once(client, url, path, body), url)
                except RetryableError as e:
                    pool.failed(url, e.reason, e.server_down)
                    pool.check_exited()         # a server stopped or dead: no retry can help (ServerError)
                    raise
            pool.answered(url)
    return data, url, attempts


async def check_reachable(url: str) -> None:
    """Raise ServerError naming `url` and the fix if nothing answers there."""
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            resp = await client.get(f"{url}/v1/models")
            resp.raise_for_status()
    except httpx.HTTPError as e:
        raise ServerError(f"cannot reach an OpenAI-compatible server at {url} ({type(e).__name__}: {e}); start "
                          f"it or set server.url to a running server") from e


async def generate_all(url: str, prompts: list[dict], max_new_tokens: int, temperature: float, concurrency: int,
                       max_retries: int, timeout_s: float, on_done=None, extra: dict | None = None,
                       template_kwargs: dict | None = None) -> list[dict]:
    """Answer a short in-memory list of prompt rows ({id, messages, tools (JSON text, optional), ...}) through
    /v1/chat/completions, each with its tools and `template_kwargs` (chat_template_kwargs); rows with the answer
    fields of `parse_response`, in input order. For benchmarks and deployment checks; the pipeline's
    regeneration uses `eagle3_core.generation.regenerate` (streaming, shards, resume).

    `on_done(row)` is called as each answer arrives; `extra` adds fields to every request body (e.g.
    {"logprobs": True, "top_logprobs": 2}). Raises ServerError naming the URL and prompt id when a request exhausts
    its retries or is rejected."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client, ServerPool([url]) as pool:
        async def one(row: dict) -> dict:
            async with sem:
                t0 = time.monotonic()
                tools = json.loads(row["tools"]) if row.get("tools") else None
                body = request_body("openai", row["messages"], None, max_new_tokens, temperature, extra,
                                    tools=tools, template_kwargs=template_kwargs)
                try:
                    out, _, _ = await request_with_retries(pool, client, "openai", body, max_retries, 0.5)
                except (RetryableError, RequestRejected) as e:
                    raise ServerError(f"request for prompt {row['id']} to {url} failed ({e}); check the server "
                                      f"and rerun") from e
                result = {**row, **out, "latency_s": time.monotonic() - t0}
                if on_done is not None:
                    on_done(result)
                return result

        return list(await asyncio.gather(*(one(r) for r in prompts)))
