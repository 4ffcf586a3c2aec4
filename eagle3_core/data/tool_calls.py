"""Tool calls of a row checked before they are trained.

A tool call (OpenAI Chat Completions `message.tool_calls[]`: {"id", "type": "function", "function": {"name",
"arguments"}}) is trained only when
  - its function is one the row's tools declare (the `tools` column: a `tools` field or a Hermes `<tools>` block,
    data/tools.py): the target is never taught to call a function it was not offered;
  - its arguments are one complete JSON object: given as an object, or as the JSON text of one, which is how the
    OpenAI API returns them ("a JSON string", OpenAI API reference, Chat Completions, `tool_calls[].function.
    arguments`) and how SGLang reads them back (python/sglang/srt/entrypoints/openai/serving_chat.py,
    `_apply_jinja_template`: `orjson.loads` of a string `function.arguments`). Text cut off mid-object (an answer
    stopped at max_new_tokens), a list, a number or a string inside are refused.
A row that fails is rejected with the reason (prompts/rejects.jsonl for data rows, tokenized/rejects.jsonl for the
target's own answers), counted per source against prompts.max_reject_frac.

The rows keep their arguments as the data gives them (text or object): how a template wants them (an object for a
template that prints `| tojson`, text for one that concatenates them) is the rendering's business (data/chat.py).
"""
from __future__ import annotations

import difflib
import json

from eagle3_core.data.row_formats import RowReject


class ToolCallError(RowReject):
    """A tool call that cannot be trained; `reason` names the message, the call and what is wrong."""


def parsed_arguments(arguments, where: str) -> dict:
    """The arguments of one tool call as an object: a dict as it is, JSON text parsed. Raises ToolCallError naming
    `where` for text that is not complete JSON, JSON that is not an object, or another type."""
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str):
        raise ToolCallError(f"{where}: arguments are {type(arguments).__name__}, neither a JSON object nor the JSON "
                            f"text of one")
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"{where}: arguments are not complete JSON ({e.msg}: character {e.pos} of "
                            f"{len(arguments)}; cut off?): {arguments[:80]!r}") from None
    if not isinstance(value, dict):
        raise ToolCallError(f"{where}: arguments are a JSON {type(value).__name__}, not an object: "
                            f"{arguments[:80]!r}")
    return value


def check_tool_calls(messages: list[dict], tools: list[dict] | None, extra_calls: list | None = None) -> int:
    """Check every tool call of `messages` (and `extra_calls`, e.g. a final answer's) against the row's `tools`
    (OpenAI tool schemas). Returns the number of calls checked; raises ToolCallError for the first call of an
    undeclared function (naming the nearest declared one) or with arguments that are not one complete JSON
    object (parsed_arguments)."""
    declared = sorted({t["function"]["name"] for t in tools or [] if isinstance(t.get("function"), dict)})
    calls = [(f"message {k}", c) for k, m in enumerate(messages) for c in m.get("tool_calls") or []]
    calls += [("the answer", c) for c in extra_calls or []]
    for j, (where, call) in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ToolCallError(f"{where}: a tool call has no function name")
        if name not in declared:
            near = difflib.get_close_matches(name, declared, n=1)
            raise ToolCallError(
                f"{where}: calls {name!r}, a function the row's tools do not declare "
                + (f"(declared: {declared[:8]}{'; nearest ' + repr(near[0]) if near else ''})" if declared else
                   "(the row declares no tools: give them in a `tools` field or a <tools> block)")
                + "; fix the row or drop it")
        parsed_arguments(fn.get("arguments", {}), f"{where}: the call of {name!r}")
    return len(calls)


def check_generation_tool_calls(row: dict) -> int:
    """check_tool_calls on a generation row (`messages` decoded; `tools` and `tool_calls` as JSON text): the data's
    turns, the target's regenerated turns and its final answer's tool calls. Returns the number checked."""
    tools = json.loads(row["tools"]) if row.get("tools") else None
    answer = json.loads(row["tool_calls"]) if row.get("tool_calls") else []
    return check_tool_calls(row["messages"], tools, answer)
