"""Turn-by-turn regeneration (`generation.turns = 'all'`): every user turn of a prompt row answered by the target
after the target's own earlier answers, as multi-turn regeneration is defined in docs/architecture.md ('Defaults for
regeneration').

A prompt row holds the conversation up to its final user (or tool) turn, with the data's earlier assistant turns.
`answer_positions` picks the turns the target writes: every assistant text turn of the data and the final answer,
at most `generation.max_turns`. The requests of one row go one after another, in conversation order: request j
sends the conversation up to position j with the target's answers 0..j-1 in place of the data's, and the row's tool
schemas (`tools`). The row stored (one generation row per prompt row) is the regenerated conversation, ending with
the target's last answer; its `turns` column lists each request (message index, finish reason, tokens, attempts).

Tool calls (tool results cannot be re-run against a call the data did not make):
- a data assistant turn with `tool_calls` is kept as it is, with the tool results after it, and is trained as the
  template renders it (`train='all'`): it is not regenerated;
- a regenerated text turn that comes back with tool calls (the target chose a tool where the data answered in
  text) ends the row at that turn: the turn is kept, tool calls included, as the row's final trained turn, and the
  data's later turns are dropped (`turns[-1].ended = 'tool_call'`);
- a turn cut at max_new_tokens (finish reason 'length') ends the row the same way (`ended = 'length'`): the next
  user turn would answer a text the target never finished.

User turns given apart: a Spec-Bench row (MT-bench's two-turn questions) holds only its first turn as the prompt;
its later user turns, which need the target's own earlier answers, are in `meta.later_user_turns`
(data.row_formats). Turn by turn they are answered in order after the row's last answer, each appended as a user
message; the tool-call and length rules above end the row the same way. `unanswered_turns` says, per source, which
user turns a run will not answer and why (logged by the prompts stage).

Resume: a row is written once all its requests are answered, so a rerun resends the requests of unfinished rows
only (resumable per row; at most one row per request slot repeats its earlier requests).
"""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable


def answer_positions(messages: list[dict], max_turns: int | None) -> list[int]:
    """Indices in `messages` (a prompt row: ends with a user or tool turn) of the turns the target answers:
    every assistant turn without tool calls, then len(messages) (the final answer); the first `max_turns` of
    them (None: all). An assistant turn directly after another assistant turn is not answerable (no new input):
    it is kept. Raises ValueError if the row does not end with a user or tool turn."""
    if not messages or messages[-1].get("role") not in ("user", "tool"):
        raise ValueError(f"turn-by-turn regeneration needs a conversation ending with a user or tool turn, got one "
                         f"ending with {messages[-1].get('role') if messages else 'nothing'}")
    out = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and not m.get("tool_calls")
           and i > 0 and messages[i - 1].get("role") in ("user", "tool")]
    out.append(len(messages))
    return out if max_turns is None else out[:max_turns]


def answer_message(data: dict) -> dict:
    """The assistant message of one parsed answer (`serving.client.parse_response`): content, reasoning given
    apart as `reasoning_content`, the OpenAI `tool_calls` list when there is one."""
    msg = {"role": "assistant", "content": data.get("response") or ""}
    if data.get("reasoning"):
        msg["reasoning_content"] = data["reasoning"]
    if data.get("tool_calls"):
        msg["tool_calls"] = json.loads(data["tool_calls"]) if isinstance(data["tool_calls"], str) \
            else data["tool_calls"]
    return msg


Ask = Callable[[list[dict]], Awaitable[tuple[dict, str, int]]]


def later_user_turns(row: dict) -> list[str]:
    """The user turns a prompt row gives apart from its messages (`meta.later_user_turns`: Spec-Bench's second
    turns), or []."""
    meta = row.get("meta")
    meta = json.loads(meta) if isinstance(meta, str) and meta else meta or {}
    return [str(t) for t in meta.get("later_user_turns") or []]


def unanswered_turns(rows: list[dict], turns: str, max_turns: int | None) -> dict[str, dict]:
    """{source: {rows, turns, reason}} of the user turns of prompt rows (`messages` decoded) that regeneration in
    mode `turns` ('final' | 'all') with `max_turns` will not answer: under 'final', the later user turns given
    apart (later_user_turns); under 'all', turns past max_turns. Sources with none are left out."""
    out: dict[str, dict] = {}
    for r in rows:
        if r.get("mode") == "keep":
            continue
        later = later_user_turns(r)
        if turns == "final":
            n = len(later)
            reason = ("generation.turns is 'final': only the first turn is a prompt; set generation.turns 'all' to "
                      "answer the later turns after the target's own answers")
        else:
            n = len(answer_positions(r["messages"], None)) + len(later) - (max_turns or 10**9)
            reason = f"generation.max_turns {max_turns} caps the turns answered per row"
        if n > 0:
            st = out.setdefault(r["source"], {"rows": 0, "turns": 0, "reason": reason})
            st["rows"] += 1
            st["turns"] += n
    return out


async def regenerate_row(messages: list[dict], max_turns: int | None, ask: Ask, *, later: list[str] = ()) -> dict:
    """Answer the turns of one prompt row in order, then each user turn of `later` (later_user_turns) appended
    after the last answer. `ask(sent_messages)` sends one request and returns (parsed answer, server URL,
    attempts); its errors propagate (the caller records the row as failed).

    Returns the answer fields of the row's last request (response, reasoning, finish_reason, prompt_tokens,
    output_ids, model, tool_calls, ...) plus: messages (the regenerated conversation, ending with the last answer),
    completion_tokens (summed over the requests), attempts (summed), turn_requests (int) and turns (JSON text:
    [{index, finish_reason, prompt_tokens, completion_tokens, attempts, server, ended?}], one per request, in the
    order sent)."""
    messages = list(messages)
    positions = answer_positions(messages, None)
    for text in later:                                      # each later user turn follows the previous answer
        messages += [{"role": "assistant", "content": ""}, {"role": "user", "content": text}]
        positions.append(len(messages))
    positions = positions if max_turns is None else positions[:max_turns]
    out: list[dict] = []
    turns: list[dict] = []
    cursor, data, attempts_sum, tokens_sum = 0, {}, 0, 0
    for p in positions:
        out += messages[cursor:p]
        data, url, attempts = await ask(list(out))
        answer = answer_message(data)
        turn = {"index": len(out), "finish_reason": data.get("finish_reason") or "",
                "prompt_tokens": int(data.get("prompt_tokens") or 0),
                "completion_tokens": int(data.get("completion_tokens") or 0), "attempts": attempts, "server": url}
        out.append(answer)
        turns.append(turn)
        attempts_sum += attempts
        tokens_sum += turn["completion_tokens"]
        cursor = p + 1
        more = p < len(messages)
        if more and answer.get("tool_calls"):
            turn["ended"] = "tool_call"
            break
        if more and turn["finish_reason"] == "length":
            turn["ended"] = "length"
            break
    return {**data, "messages": out, "completion_tokens": tokens_sum, "attempts": attempts_sum,
            "turn_requests": len(turns), "turns": json.dumps(turns), "server": turns[-1]["server"]}
