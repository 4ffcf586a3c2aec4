"""Row formats -> one normalized conversation schema (OpenAI chat messages).

A normalized message is {"role": "system"|"user"|"assistant"|"tool", "content": str} plus, where the source has
them, "reasoning_content" (str: reasoning given apart from the answer; reasoning written inline as a <think> block
stays in "content"), "tool_calls" ([{"id", "type": "function", "function": {"name", "arguments"}}], OpenAI
Chat Completions) and "tool_call_id"/"name" on tool results. Inline tool-call markup inside assistant text
(Hermes `<tool_call>`, SWE-agent command blocks, `<function=...>` XML) is kept verbatim: it is what the model
wrote.

Formats, the rows of ROW_FORMATS in the order format 'auto' tries them on the row's fields:
  openai          `messages`: [{role, content, tool_calls?, reasoning_content?}] (ultrachat_200k,
                  Mixture-of-Thoughts, DeepSWE Kimi-K2 trajectories)
  sharegpt        `conversations`: [{from, value}] (ShareGPT, OpenThoughts-114k, Hermes function calling)
  swe_agent       `trajectory`: [{role: system|user|ai, text, system_prompt}] (nebius/SWE-agent-trajectories)
  spec_bench      `turns`: [user turn, ...]; only the first turn is a prompt (later turns need the target's own
                  earlier answers: kept in meta.later_user_turns, answered under generation.turns 'all')
  bfcl            Berkeley Function Calling Leaderboard (PyPI `bfcl-eval`, `bfcl_eval/data/BFCL_v4_*.json`):
                  `question`: [[turn messages], ...] and `function`: the tool schemas (data.tools reads them); the
                  first turn is the prompt, later turns counted in meta.later_turns
  alpaca          `instruction` (+ `input`) -> user, `output` -> assistant
  prompt_response a prompt field (prompt/question/problem/query) and optional response and reasoning fields
                  (HumanEval `prompt`, GSM8K `question`/`answer`, problem/thinking/solution sets)
Mode 'prompt' cuts the conversation before its final assistant turn (the target regenerates it); mode 'keep' needs
a conversation that ends with an assistant turn.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

ROLES = {"system": "system", "developer": "system",
         "user": "user", "human": "user",
         "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "model": "assistant", "ai": "assistant",
         "tool": "tool", "function": "tool", "observation": "tool", "ipython": "tool", "tool_response": "tool"}
ID_FIELDS = ("task_id", "id", "question_id", "prompt_id", "instance_id")
PROMPT_FIELDS = ("prompt", "question", "problem", "query")
RESPONSE_FIELDS = ("response", "completion", "answer", "solution", "output")
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
LIST_FIELDS = {"messages": "openai", "conversations": "sharegpt", "trajectory": "swe_agent"}   # field: its format


class RowReject(ValueError):
    """A row that cannot be read or normalized; `reason` says why and what to do. Collected, not raised past the
    prompts stage unless a source's reject fraction passes `prompts.max_reject_frac`."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _list_format(row: dict, spec) -> str | None:
    """openai, sharegpt or swe_agent by the field holding the row's message list (the source's `messages_field`, else
    the first of LIST_FIELDS holding a list; a `messages` or named list of {from, value} is sharegpt), or None."""
    if spec.messages_field:
        field, fmt = spec.messages_field, "openai"
    else:
        field = next((k for k in LIST_FIELDS if isinstance(row.get(k), list)), None)
        if field is None:
            return None
        fmt = LIST_FIELDS[field]
    return "sharegpt" if fmt == "openai" and _looks_sharegpt(row.get(field)) else fmt


def _looks_sharegpt(msgs) -> bool:
    return isinstance(msgs, list) and bool(msgs) and isinstance(msgs[0], dict) and "from" in msgs[0]


def _listed(row: dict, spec, fmt: str) -> tuple[list[dict], dict]:
    """openai, sharegpt, swe_agent: the message list (a list, or JSON text of one) read message by message."""
    field = spec.messages_field or next((k for k in LIST_FIELDS if isinstance(row.get(k), (list, str))), "messages")
    raw = row.get(field)
    if isinstance(raw, str):                          # some sets store the list as JSON text
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raise RowReject(f"field {field!r} is text that is not a JSON message list") from None
    if not isinstance(raw, list):
        raise RowReject(f"field {field!r} is missing or not a list")
    return [_message(m, k, fmt) for k, m in enumerate(raw)], {}


def _spec_bench(row: dict, spec) -> tuple[list[dict], dict]:
    turns = row.get("turns") or []
    msgs = [{"role": "user", "content": _text(turns[0], 0)}] if turns else []
    meta = {"later_turns": max(len(turns) - 1, 0),
            "later_user_turns": [_text(t, k) for k, t in enumerate(turns[1:], 1)]}
    if isinstance(row.get("category"), str):          # the evaluators' tau per category (evaluate_stage.category)
        meta["category"] = row["category"]
    return msgs, meta


def _bfcl(row: dict, spec) -> tuple[list[dict], dict]:
    turns = row.get("question") or []
    if not (turns and isinstance(turns[0], list)):
        raise RowReject("field 'question' is not a list of turns (each a list of messages), as BFCL's are")
    return [_message(m, k, "openai") for k, m in enumerate(turns[0])], {"later_turns": len(turns) - 1}


def _alpaca(row: dict, spec) -> tuple[list[dict], dict]:
    extra = row.get("input") or ""
    msgs = [{"role": "user", "content": (row.get("instruction") or "") + ("\n\n" + extra if extra else "")}]
    if row.get("output"):
        msgs.append({"role": "assistant", "content": _text(row["output"], 1)})
    return msgs, {}


def _prompt_response(row: dict, spec) -> tuple[list[dict], dict]:
    prompt_key = spec.prompt_field or next((k for k in PROMPT_FIELDS if isinstance(row.get(k), str)), None)
    response_key = spec.response_field or next((k for k in RESPONSE_FIELDS if row.get(k)), None)
    reasoning_key = spec.reasoning_field or next((k for k in REASONING_FIELDS if row.get(k)), None)
    if prompt_key is None or not isinstance(row.get(prompt_key), str):
        raise RowReject(f"prompt field {prompt_key!r} is missing or not text")
    msgs = [{"role": "user", "content": row[prompt_key]}]
    if response_key and row.get(response_key):
        answer = {"role": "assistant", "content": _text(row[response_key], 1)}
        if reasoning_key and row.get(reasoning_key):
            answer["reasoning_content"] = _text(row[reasoning_key], 1)
        msgs.append(answer)
    return msgs, {}


@dataclass(frozen=True)
class RowFormat:
    """One prompt-source format: `detect(row, spec) -> bool`, whether format 'auto' reads the row in it (tried in
    ROW_FORMATS' order, the first that holds wins); `normalize(row, spec) -> (messages, meta)`, the row's
    conversation before the system field and the mode's cut, and the format's own meta (later turns)."""
    name: str
    detect: Callable[[dict, Any], bool]
    normalize: Callable[[dict, Any], tuple[list[dict], dict]]


# the formats in detection order (the message-list formats first: a source's messages_field makes its rows one of
# them); a new format is a row here (config.mix.FORMATS names them: tests/test_name_copies.py checks the two agree)
ROW_FORMATS = {f.name: f for f in (
    RowFormat("openai", lambda row, spec: _list_format(row, spec) == "openai", partial(_listed, fmt="openai")),
    RowFormat("sharegpt", lambda row, spec: _list_format(row, spec) == "sharegpt", partial(_listed, fmt="sharegpt")),
    RowFormat("swe_agent", lambda row, spec: _list_format(row, spec) == "swe_agent",
              partial(_listed, fmt="swe_agent")),
    RowFormat("spec_bench", lambda row, spec: isinstance(row.get("turns"), list), _spec_bench),
    RowFormat("bfcl", lambda row, spec: isinstance(row.get("question"), list) and isinstance(row.get("function"), list),
              _bfcl),
    RowFormat("alpaca", lambda row, spec: isinstance(row.get("instruction"), str), _alpaca),
    RowFormat("prompt_response",
              lambda row, spec: bool(spec.prompt_field) or any(isinstance(row.get(k), str) for k in PROMPT_FIELDS),
              _prompt_response),
)}


def detect_format(row: dict, spec) -> str:
    """The format of `row`: the source's `format`, or under 'auto' the first ROW_FORMATS row whose detector holds.
    Raises RowReject naming the fields looked for when none does."""
    if spec.format != "auto":
        return spec.format
    fmt = next((f.name for f in ROW_FORMATS.values() if f.detect(row, spec)), None)
    if fmt is None:
        raise RowReject(f"no conversation or prompt field; expected one of messages, conversations, trajectory, "
                        f"turns, instruction, {', '.join(PROMPT_FIELDS)} (found {sorted(row)}); set the source's "
                        f"`format` and field names")
    return fmt


def normalize(row, spec) -> tuple[list[dict], dict]:
    """(messages, meta) of one raw row under `spec` (a SourceSpec): the normalized conversation, cut for the
    source's mode. Raises RowReject with the reason (empty conversation, unknown role, conversation ending in a
    user turn in mode 'keep', ...)."""
    if not isinstance(row, dict):
        raise RowReject(f"expected an object, got {type(row).__name__}")
    fmt = detect_format(row, spec)
    msgs, own = ROW_FORMATS[fmt].normalize(row, spec)
    meta = {"format": fmt, **own}
    system_key = spec.system_field or ("system" if isinstance(row.get("system"), str) else None)
    if system_key and row.get(system_key) and not (msgs and msgs[0]["role"] == "system"):
        msgs.insert(0, {"role": "system", "content": _text(row[system_key], -1)})
    msgs = [m for m in msgs if not (m["role"] == "system" and not m["content"].strip())]
    return _cut_for_mode(_check(msgs), spec.mode), meta


def _message(m, k: int, fmt: str) -> dict:
    if not isinstance(m, dict):
        raise RowReject(f"message {k} is {type(m).__name__}, not an object")
    speaker = m.get("from", m.get("role")) if fmt == "sharegpt" else m.get("role", m.get("from"))
    role = ROLES.get(speaker.lower() if isinstance(speaker, str) else speaker)
    if role is None:
        raise RowReject(f"message {k} has unknown role {speaker!r}; known: {sorted(ROLES)}")
    if fmt == "sharegpt":
        content = m.get("value", m.get("content"))
    elif fmt == "swe_agent":
        content = m.get("text") or (m.get("system_prompt") if role == "system" else None)
    else:
        content = m.get("content")
    out = {"role": role, "content": _text(content, k)}
    reasoning = next((m[key] for key in REASONING_FIELDS if m.get(key)), None)
    if reasoning:
        out["reasoning_content"] = _text(reasoning, k)
    if m.get("tool_calls"):
        out["tool_calls"] = [_tool_call(c, k) for c in m["tool_calls"]]
    for key in ("tool_call_id", "name"):
        if role == "tool" and m.get(key):
            out[key] = str(m[key])
    return out


def _text(content, k: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):                    # OpenAI content parts
        parts = [p.get("text", "") if isinstance(p, dict) else p for p in content]
        if all(isinstance(p, str) for p in parts):
            return "".join(parts)
    raise RowReject(f"message {k}: content is {type(content).__name__}, not text")


def _tool_call(c, k: int) -> dict:
    fn = c.get("function", c) if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RowReject(f"message {k}: a tool call has no function name")
    args = fn.get("arguments", {})
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if c.get("id"):
        out["id"] = str(c["id"])
    return out


def _check(msgs: list[dict]) -> list[dict]:
    if not msgs:
        raise RowReject("empty conversation")
    for k, m in enumerate(msgs):
        if not m["content"].strip() and not m.get("tool_calls") and not m.get("reasoning_content"):
            raise RowReject(f"message {k} ({m['role']}) is empty")
    if not any(m["role"] == "user" for m in msgs):
        raise RowReject("conversation has no user turn")
    first = next(k for k, m in enumerate(msgs) if m["role"] != "system")
    if msgs[first]["role"] != "user":
        # ShareGPT dumps often open with the bot's greeting: no chat template can render a turn with no prompt
        raise RowReject(f"conversation starts with a {msgs[first]['role']} turn (message {first}), not a user "
                        f"turn; remove the leading turn from the data, or drop the row")
    return msgs


def _cut_for_mode(msgs: list[dict], mode: str) -> list[dict]:
    if mode == "keep":
        if msgs[-1]["role"] != "assistant":
            raise RowReject(f"conversation ends in a {msgs[-1]['role']} turn, so there is no response to keep; use "
                            f"mode 'prompt' to have the target answer it")
        return msgs
    return to_prompt(msgs)


def to_prompt(msgs: list[dict]) -> list[dict]:
    """The conversation before its final assistant turn (what the target is asked to answer). Raises RowReject
    if nothing but assistant turns would be left."""
    end = len(msgs)
    while end and msgs[end - 1]["role"] == "assistant":
        end -= 1
    if end == 0 or not any(m["role"] == "user" for m in msgs[:end]):
        raise RowReject("no user turn before the final assistant turn")
    return msgs[:end]


def conversation_text(msgs: list[dict]) -> str:
    """All text of a conversation (roles, reasoning, tool calls): what length filters measure and dedup hashes."""
    parts = []
    for m in msgs:
        parts += [m["role"], m.get("reasoning_content", ""), m["content"]]
        if m.get("tool_calls"):
            parts.append(json.dumps(m["tool_calls"], sort_keys=True))
    return "\n".join(parts)
