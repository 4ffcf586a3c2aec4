"""One prompt row answered for regeneration (eagle3_core.generation.regenerate): its conversation parsed and
tokenized, a kept row stored whole, otherwise the final turn (or, with `generation.turns = 'all'`, every turn) asked
of a server or the in-process engine, and the answer or the failure stored in its shard."""
from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx

from eagle3_core.config import GenerationConfig
from eagle3_core.data.chat import prompt_ids
from eagle3_core.generation.answer_shard import AnswerShardWriter
from eagle3_core.generation.progress import Progress
from eagle3_core.generation.quality import EarlyGate
from eagle3_core.generation.turns import later_user_turns, parsed_answer, regenerate_row, split_final_answer
from eagle3_core.serving.client import (
    TOKEN_ID_APIS,
    RequestRejected,
    RetryableError,
    request_body,
    request_with_retries,
)
from eagle3_core.serving.launcher import ServerError
from eagle3_core.serving.pool import ServerPool


@dataclass(frozen=True)
class Regeneration:
    """What every row of one regenerate call shares. gen: its `api` resolved ('auto' -> the server kind's);
    token_ids: prompts go as token ids (a token-id API or the engine); markers: data.markers.target_markers of the
    tokenizer (token-id APIs only, else None); tokenize_thread: one thread, as HF tokenizers are not safe to share."""
    prompts_path: Path
    gen: GenerationConfig
    token_ids: bool
    tokenizer: object | None
    markers: object | None
    engine: object | None
    tokenize_thread: ThreadPoolExecutor
    gate: EarlyGate
    progress: Progress


@dataclass
class _RowRequest:
    """A row being answered: `sent` the conversation up to its final assistant turn, `ids` its prompt ids ([] for a
    text API); last_ids: the prompt ids of the latest request (a later turn's in turns 'all')."""
    row: dict
    where: str
    sent: list[dict]
    ids: list[int]
    tools: list | None
    kwargs: dict | None
    client: httpx.AsyncClient
    pool: ServerPool | None
    on_retry: object
    last_ids: list[int] = field(default_factory=list)


async def _tokenize(run: Regeneration, *args):
    return await asyncio.get_running_loop().run_in_executor(run.tokenize_thread, *args)


def _on_retry(run: Regeneration, w: AnswerShardWriter, error: RetryableError) -> None:
    w.retry(error)
    run.progress.retries += 1


def _gate_row(row_id: str, data: dict) -> dict:
    return {"id": row_id, "response": data["response"], "reasoning": data["reasoning"],
            "finish_reason": data["finish_reason"]}


async def _server_answer(run: Regeneration, req: _RowRequest, msgs: list[dict], turn_ids: list[int]):
    """(data, url, attempts) of one server request for `msgs`; a token-id API's output ids read back as a message
    (turns.parsed_answer). Raises ServerError when there is no server, RequestRejected for ids outside the target's
    vocabulary (another model is served)."""
    gen, tokenizer = run.gen, run.tokenizer
    if req.pool is None:
        raise ServerError(f"{req.where} needs an answer but no server URL was given")
    body = request_body(gen.api, msgs, turn_ids, gen.max_new_tokens, gen.temperature, top_p=gen.top_p,
                        tools=req.tools, template_kwargs=req.kwargs, top_k=gen.top_k, seed=gen.seed)
    data, url, attempts = await request_with_retries(req.pool, req.client, gen.api, body, gen.max_retries,
                                                     gen.retry_backoff_s, req.on_retry)
    data.pop("logprobs", None)
    if gen.api in TOKEN_ID_APIS:
        if bad := [t for t in data["output_ids"] if not 0 <= t < len(tokenizer)]:
            raise RequestRejected(f"{req.where}: {url} returned token ids outside the target's vocabulary "
                                  f"({len(tokenizer)} tokens), e.g. {bad[:5]}: the server serves another "
                                  f"model than target.model; point server.url at a server of the target")
        data.update(await _tokenize(run, parsed_answer, tokenizer, run.markers, turn_ids, data["output_ids"]))
    return data, url, attempts


async def _ask(run: Regeneration, req: _RowRequest, msgs: list[dict]) -> tuple[dict, str, int]:
    """One request for the conversation `msgs`; the answer goes through the early gate."""
    run.gate.check()
    turn_ids = req.ids
    if run.token_ids and msgs is not req.sent:     # a later turn: its own prompt, with the target's answers
        turn_ids = await _tokenize(run, prompt_ids, run.tokenizer, msgs, req.tools, req.kwargs)
    req.last_ids = turn_ids
    if run.engine is not None:
        data, url, attempts = await run.engine.complete(turn_ids), run.engine.name, 1
    else:
        data, url, attempts = await _server_answer(run, req, msgs, turn_ids)
    data["prompt_ids"] = turn_ids
    if run.gen.turns == "all":                     # each turn is an answer (final mode: once it is stored)
        run.gate.add(_gate_row(req.row["id"], data))
    return data, url, attempts


async def _ask_turns(run: Regeneration, req: _RowRequest, w: AnswerShardWriter):
    """(data, url, attempts) of the row's final turn, or of every turn (turns 'all'); None once a rejected request
    or exhausted retries were recorded as the row's failure."""
    row, gen = req.row, run.gen
    try:
        if gen.turns == "all":
            data = await regenerate_row(req.sent, gen.max_turns, partial(_ask, run, req),
                                        json.loads(row.get("meta") or "{}").get("kept") == "regenerate",
                                        later=later_user_turns(row))
            data["messages"] = json.dumps(data["messages"])
            return data, data.pop("server"), data.pop("attempts")
        return await _ask(run, req, req.sent)
    except RequestRejected as e:
        w.fail(row["id"], str(e))
        run.gate.fail(row["id"], str(e))
    except RetryableError as e:
        w.fail(row["id"], f"gave up after {gen.max_retries + 1} attempts: {e.reason}")
        run.gate.fail(row["id"], e.reason)
    run.progress.failed += 1
    return None


async def _split_and_tokenize(run: Regeneration, w: AnswerShardWriter, row: dict, where: str, tools, kwargs):
    """(messages, sent, kept, ids) of a row (turns.split_final_answer); None once a bad row (ValueError, also
    data.chat.MaskError) was recorded as failed: never retried."""
    try:
        messages = row["messages"] if isinstance(row["messages"], list) else json.loads(row["messages"])
        sent, kept = split_final_answer(messages, row.get("mode"), where)
        ids = []
        if run.token_ids:                           # one thread: HF tokenizers are not safe to share
            ids = await _tokenize(run, prompt_ids, run.tokenizer, sent, tools, kwargs)
    except ValueError as e:
        w.fail(row["id"], f"bad prompt row: {e}")
        run.progress.failed += 1
        return None
    return messages, sent, kept, ids


async def answer_row(run: Regeneration, w: AnswerShardWriter, index: int, row: dict, client: httpx.AsyncClient,
                     pool: ServerPool | None) -> None:
    """Answer prompt row `index` of run.prompts_path into shard writer `w` (or record its failure, with the reason);
    a kept row (mode 'keep') is stored whole, finish_reason 'kept', no request."""
    t0 = time.monotonic()
    where = f"{run.prompts_path} row {index} (id {row['id']})"
    tools = json.loads(row["tools"]) if row.get("tools") else None
    kwargs = run.gen.chat_template_kwargs or None
    if (parsed := await _split_and_tokenize(run, w, row, where, tools, kwargs)) is None:
        return
    messages, sent, kept, ids = parsed
    base = {**row, "messages": json.dumps(sent), "index": index, "prompt_ids": ids}
    if kept is not None:
        # the whole conversation as it is (earlier turns, final turn with its tool calls): every turn is trained
        w.add({**base, "messages": json.dumps(messages), "response": kept.get("content") or "",
               "finish_reason": "kept", "attempts": 0,
               "reasoning": kept.get("reasoning_content") or kept.get("reasoning") or "", "api": "kept"})
        run.progress.answered += 1
        return
    req = _RowRequest(row, where, sent, ids, tools, kwargs, client, pool, partial(_on_retry, run, w), ids)
    if (answered := await _ask_turns(run, req, w)) is None:
        return
    data, url, attempts = answered
    w.add({**base, **data, "prompt_ids": req.last_ids, "server": url,
           "api": run.engine.name if run.engine is not None else run.gen.api, "attempts": attempts,
           "latency_s": time.monotonic() - t0})
    run.progress.answered += 1
    run.progress.tokens += data["completion_tokens"]
    if run.gen.turns != "all":
        run.gate.add(_gate_row(row["id"], data))
