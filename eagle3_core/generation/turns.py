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
  template renders it (or left untrained: the source's `kept` choice 'mask'); with `kept: 'regenerate'` it is
  answered by the target like a text turn instead (and ends the row there if the target calls a tool, below);
- a regenerated turn that comes back with the very tool calls of the data's turn there (same names, same
  arguments once parsed) goes on with the data's tool results, which answer exactly those calls (their
  `tool_call_id` renamed to the ids the target wrote): a tool-call chain the target writes as the data did is
  regenerated whole;
- a regenerated text turn that comes back with other tool calls (the target chose a tool where the data answered in
  text) ends the row at that turn: the turn is kept, tool calls included, as the row's final trained turn, and the
  data's later turns are dropped (`turns[-1].ended = 'tool_call'`);
- a regenerated tool-call turn of the data (kept choice 'regenerate') that comes back as text or with other calls
  ends the row there too (the data's results answer calls the target did not make);
- a turn cut at max_new_tokens (finish reason 'length') ends the row the same way (`ended = 'length'`): the next
  user turn would answer a text the target never finished.

Token-id APIs: each answer's message (content, reasoning, tool calls) is read from the ids the server returned, by
the target's own marker tokens (`parsed_answer`, data.markers), not from the server's text; the row keeps each
request's prompt ids and output ids (`turn_prompt_ids`, `turn_output_ids`, one entry per request), which the
tokenize stage trains as they are.

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

from eagle3_core.data.markers import parse_answer, same_message


def answer_positions(messages: list[dict], max_turns: int | None, tool_calls: bool = False) -> list[int]:
    """Indices in `messages` (a prompt row: ends with a user or tool turn) of the turns the target answers:
    every assistant turn without tool calls (with them too when `tool_calls`: the source's kept choice
    'regenerate'), then len(messages) (the final answer); the first `max_turns` of them (None: all). An assistant
    turn directly after another assistant turn is not answerable (no new input): it is kept. Raises ValueError if
    the row does not end with a user or tool turn."""
    if not messages or messages[-1].get("role") not in ("user", "tool"):
        raise ValueError(f"turn-by-turn regeneration needs a conversation ending with a user or tool turn, got one "
                         f"ending with {messages[-1].get('role') if messages else 'nothing'}")
    out = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and (tool_calls or not m.get("tool_calls"))
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


def same_calls(answer: dict, data: dict) -> bool:
    """True if the assistant messages `answer` and `data` make the same tool calls (names and parsed arguments, in
    order; markers.same_message)."""
    return bool(data.get("tool_calls")) and same_message({"tool_calls": answer.get("tool_calls")},
                                                         {"tool_calls": data["tool_calls"]}) is None


def parsed_answer(tokenizer, markers, prompt_ids: list[int], output_ids: list[int]) -> dict:
    """The answer fields (response, reasoning, tool_calls as JSON text or '') that a token-id answer's ids spell,
    read by the target's marker tokens (data.markers.parse_answer; the prompt's last token says whether the answer
    starts inside a think block the prompt opened)."""
    opened = markers.think is not None and bool(prompt_ids) and prompt_ids[-1] == markers.think[0]
    msg = parse_answer(tokenizer, markers, output_ids, opened_think=opened)
    return {"response": msg["content"], "reasoning": msg.get("reasoning_content") or "",
            "tool_calls": json.dumps(msg["tool_calls"]) if msg.get("tool_calls") else ""}


Ask = Callable[[list[dict]], Awaitable[tuple[dict, str, int]]]


def _meta(row: dict) -> dict:
    """A row's `meta` (JSON text or a dict) as a dict."""
    meta = row.get("meta")
    return json.loads(meta) if isinstance(meta, str) and meta else meta or {}


def later_user_turns(row: dict) -> list[str]:
    """The user turns a prompt row gives apart from its messages (`meta.later_user_turns`: Spec-Bench's second
    turns), or []."""
    return [str(t) for t in _meta(row).get("later_user_turns") or []]


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
            n = len(answer_positions(r["messages"], None, _meta(r).get("kept") == "regenerate")) + len(later) \
                - (max_turns or 10**9)
            reason = f"generation.max_turns {max_turns} caps the turns answered per row"
        if n > 0:
            st = out.setdefault(r["source"], {"rows": 0, "turns": 0, "reason": reason})
            st["rows"] += 1
            st["turns"] += n
    return out


async def regenerate_row(messages: list[dict], max_turns: int | None, ask: Ask, tool_calls: bool = False, *,
                         later: list[str] = ()) -> dict:
    """Answer the turns of one prompt row in order, then each user turn of `later` (later_user_turns) appended
    after the last answer. `ask(sent_messages)` sends one request and returns (parsed answer, server URL,
    attempts); its errors propagate (the caller records the row as failed). tool_calls: the data's tool-call turns
    are answered too (answer_positions).

    Returns the answer fields of the row's last request (response, reasoning, finish_reason, prompt_tokens,
    output_ids, model, tool_calls, ...) plus: messages (the regenerated conversation, ending with the last answer),
    completion_tokens (summed over the requests), attempts (summed), turn_requests (int), turns (JSON text:
    [{index, finish_reason, prompt_tokens, completion_tokens, attempts, server, ended?}], one per request, in the
    order sent) and turn_prompt_ids / turn_output_ids (each request's `prompt_ids` and `output_ids` as the answers
    carry them; empty lists where they carry none)."""
    messages = list(messages)
    positions = answer_positions(messages, None, tool_calls)
    for text in later:                                      # each later user turn follows the previous answer
        messages += [{"role": "assistant", "content": ""}, {"role": "user", "content": text}]
        positions.append(len(messages))
    positions = positions if max_turns is None else positions[:max_turns]
    prompts, outputs = [], []
    out: list[dict] = []
    turns: list[dict] = []
    cursor, data, attempts_sum, tokens_sum = 0, {}, 0, 0
    renamed: dict[str, str] = {}                         # data tool-call id -> the id the target wrote for it
    for p in positions:
        out += [{**m, "tool_call_id": renamed[m["tool_call_id"]]} if m.get("tool_call_id") in renamed else m
                for m in messages[cursor:p]]
        data, url, attempts = await ask(list(out))
        answer = answer_message(data)
        turn = {"index": len(out), "finish_reason": data.get("finish_reason") or "",
                "prompt_tokens": int(data.get("prompt_tokens") or 0),
                "completion_tokens": int(data.get("completion_tokens") or 0), "attempts": attempts, "server": url}
        out.append(answer)
        turns.append(turn)
        prompts.append(list(data.get("prompt_ids") or []))
        outputs.append(list(data.get("output_ids") or []))
        attempts_sum += attempts
        tokens_sum += turn["completion_tokens"]
        cursor = p + 1
        more = p < len(messages)
        if more and answer.get("tool_calls") and same_calls(answer, messages[p]):
            renamed.update({d["id"]: c["id"] for c, d in zip(answer["tool_calls"], messages[p]["tool_calls"])
                            if d.get("id")})                  # the data's results answer the target's calls
        elif more and (answer.get("tool_calls") or messages[p].get("tool_calls")):
            turn["ended"] = "tool_call"                  # other calls than the data's: its results do not answer them
            break
        if more and turn["finish_reason"] == "length":
            turn["ended"] = "length"
            break
    return {**data, "messages": out, "completion_tokens": tokens_sum, "attempts": attempts_sum,
            "turn_requests": len(turns), "turns": json.dumps(turns), "server": turns[-1]["server"],
            "turn_prompt_ids": prompts, "turn_output_ids": outputs}


def split_final_answer(messages: list[dict], mode: str | None, where: str) -> tuple[list[dict], dict | None]:
    """(messages to send, the kept final assistant turn or None). Raises ValueError naming `where` when there is
    nothing to answer or (mode 'keep') nothing to keep."""
    if not messages:
        raise ValueError(f"{where}: empty conversation")
    prompt, last = (messages[:-1], messages[-1]) if messages[-1].get("role") == "assistant" else (messages, None)
    if mode == "keep":
        if last is None:
            raise ValueError(f"{where}: mode 'keep' but the conversation does not end with an assistant turn")
        return prompt, last
    if not prompt or prompt[-1].get("role") not in ("user", "tool"):
        role = prompt[-1].get("role") if prompt else None
        raise ValueError(f"{where}: nothing to answer (the conversation before the final assistant turn ends with "
                         f"{role!r}, not a user or tool turn)")
    return prompt, None
