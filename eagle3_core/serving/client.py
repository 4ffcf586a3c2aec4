"""Async regeneration client for OpenAI-compatible `/v1/chat/completions` (llama.cpp, SGLang, vLLM).

Bounded concurrency (one semaphore), retries with exponential backoff and jitter on connection errors, timeouts,
429 and 5xx (tenacity); other 4xx fail at once with the server's message. `max_tokens` is always sent (servers
default to 128 tokens or to the context limit). Reasoning content and finish reasons are kept.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from .launcher import ServerError


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, (httpx.TransportError, httpx.TimeoutException)):
        return True
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code == 429 or exc.response.status_code >= 500
    return False


async def _complete(client: httpx.AsyncClient, url: str, messages: list[dict], max_new_tokens: int,
                    temperature: float, max_retries: int, extra: dict | None = None) -> dict:
    body = {"messages": messages, "max_tokens": max_new_tokens, "temperature": temperature, "stream": False,
            **(extra or {})}
    if temperature == 0.0:
        body["top_k"] = 1  # llama.cpp samples even at temperature 0 unless top_k is 1; others ignore it
    async for attempt in AsyncRetrying(retry=retry_if_exception(_transient), stop=stop_after_attempt(max_retries + 1),
                                       wait=wait_exponential_jitter(initial=0.5, max=30), reraise=True):
        with attempt:
            resp = await client.post(f"{url}/v1/chat/completions", json=body)
            if resp.status_code >= 400 and not (resp.status_code == 429 or resp.status_code >= 500):
                raise ServerError(f"{url} rejected a request with {resp.status_code}: {resp.text[:500]}")
            resp.raise_for_status()
    data = resp.json()
    choice = data["choices"][0]
    msg = choice.get("message") or {}
    return {"response": msg.get("content") or "", "reasoning": msg.get("reasoning_content") or "",
            "finish_reason": choice.get("finish_reason") or "",
            "completion_tokens": int((data.get("usage") or {}).get("completion_tokens") or 0),
            "model": data.get("model") or "",
            # llama.cpp: predicted_n, predicted_per_second, draft_n, draft_n_accepted (JSON text: servers differ)
            "timings": json.dumps(data.get("timings") or {}),
            "logprobs": json.dumps((choice.get("logprobs") or {}).get("content") or [])}


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
                       max_retries: int, timeout_s: float, on_done=None, extra: dict | None = None) -> list[dict]:
    """Answer every prompt row ({id, messages, ...}); returns rows with response fields, in input order.
    `on_done(row)` is called as each answer arrives (e.g. to write shards as they complete); `extra` adds fields
    to every request body (e.g. {"logprobs": True, "top_logprobs": 2}).

    Raises ServerError naming the URL and prompt id when a request exhausts its retries or is rejected.
    """
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        async def one(row: dict) -> dict:
            async with sem:
                t0 = time.monotonic()
                try:
                    out = await _complete(client, url, row["messages"], max_new_tokens, temperature, max_retries,
                                          extra)
                except httpx.HTTPError as e:
                    raise ServerError(f"request for prompt {row['id']} to {url} failed after {max_retries} retries "
                                      f"({type(e).__name__}: {e}); check the server and rerun: finished shards "
                                      f"are kept") from e
                result = {**row, **out, "latency_s": time.monotonic() - t0}
                if on_done is not None:
                    on_done(result)
                return result

        return list(await asyncio.gather(*(one(r) for r in prompts)))
