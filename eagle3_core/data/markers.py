"""The target's own marker tokens: reasoning (<think> ... </think>), tool calls, end of turn; an answer's token ids
read back into the assistant message they spell (content, reasoning, tool calls).

Legend: O answer (output) token ids of one turn.

Why: the draft learns the tokens the target writes. A regenerated turn is kept as the ids the server returned, and
the next turn's history needs the same answer as a message for the chat template; the spans are found by the
target's marker tokens in the ids, not by a server's parser (which renumbers tool-call ids and re-serialises
arguments). Tool-call formats, by the chat templates that write them (tests/data/templates, with their sources):
  hermes    <tool_call>{"name": N, "arguments": A}</tool_call>        Qwen3, Qwen2.5, Hermes-2/3 (NousResearch)
  kimi      <|tool_calls_section_begin|><|tool_call_begin|>functions.N:I<|tool_call_argument_begin|>A
            <|tool_call_end|> ... <|tool_calls_section_end|>           Kimi-K2, K2-Thinking, K2.5 (moonshotai)
  deepseek  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>N<｜tool▁sep｜>A<｜tool▁call▁end｜> ... <｜tool▁calls▁end｜>
                                                                        DeepSeek-V3.1 (deepseek-ai)
A format counts when its markers appear in the template's source and are single tokens of the tokenizer (so they
are found in the ids); a template naming no known format leaves tool calls in the content text.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from eagle3_core.data.chat import end_of_turn

THINK = ("<think>", "</think>")
# format -> (section open, section close, call open, name/arguments separator, call close); '' where absent
TOOL_FORMATS = {
    "kimi": ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
             "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
    "deepseek": ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                 "<｜tool▁call▁end｜>"),
    "hermes": ("", "", "<tool_call>", "", "</tool_call>"),
}
# a template that prints tool-call arguments with `| tojson` whatever their type (Qwen2.5) would quote a JSON text:
# it gets the arguments as an object; one that tests `arguments is string` (Qwen3, Kimi) or concatenates them as
# text (DeepSeek-V3.1) gets the text the target wrote
ARGUMENTS_TOJSON = re.compile(r"arguments(?:'\])?\s*\|\s*tojson")


def single_token(tokenizer, text: str) -> int | None:
    """The id of `text` if the tokenizer encodes it as exactly one token, else None."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 else None


def template_source(tokenizer) -> str:
    """The tokenizer's chat template as text ('' if none; a dict of named templates joined)."""
    t = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(t.values()) if isinstance(t, dict) else t


@dataclass
class TargetMarkers:
    """Marker token ids of one target (None where the template or tokenizer has none).

    think: (open id, close id); tool_format: a TOOL_FORMATS name; tool_ids: its marker ids in TOOL_FORMATS order
    (None for a marker the format lacks, all None when the markers are not single tokens: the fallback reads them in
    the decoded text); think_text: the template writes <think> blocks but they are not single tokens (text fallback);
    eot: the end-of-turn id (chat.end_of_turn); texts: marker text -> id of every single-token marker and stop id;
    arguments_as_object: the template prints tool-call arguments with `tojson` and never tests for text;
    stops: every id the target stops on (stop_ids: the template's end of turn, the tokenizer's EOS, the generation
    config's EOS list), sorted; () reads as (eot,)."""
    think: tuple[int, int] | None
    tool_format: str | None
    tool_ids: tuple[int | None, ...] = ()
    eot: int | None = None
    texts: dict[str, int] = field(default_factory=dict)
    think_text: bool = False
    arguments_as_object: bool = False
    stops: tuple[int, ...] = ()

    def is_stop(self, token: int) -> bool:
        """True if the target ends an answer with `token` (one of `stops`, or the end of turn when none is set)."""
        return token in (self.stops or (self.eot,))

    def vocab_ids(self) -> list[int]:
        """Every marker id (think, tool calls, end of turn), sorted: kept in the draft vocab whatever the counts."""
        return sorted(set(self.texts.values()))


def stop_ids(tokenizer, generation_eos=None) -> tuple[int, ...]:
    """Every id the target stops on, sorted: the chat template's end of turn (chat.end_of_turn; none for a tokenizer
    without a chat template), the tokenizer's EOS and `generation_eos` (the generation config's `eos_token_id`: an
    int, a list or None). Kimi-K2.5 has two, `[EOS]` (163585, the tokenizer's) and `<|im_end|>` (163586, the end of
    turn), and it is served stopping on either (SGLang 0.5.14 `srt/configs/model_config.py` `hf_eos_token_id`: the
    generation config's EOS list, beside the tokenizer's EOS). Raises chat.MaskError when the template closes an
    assistant turn with no special token."""
    ids = {end_of_turn(tokenizer)[0]} if getattr(tokenizer, "chat_template", None) else set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    extra = generation_eos if isinstance(generation_eos, (list, tuple, set)) else \
        [] if generation_eos is None else [generation_eos]
    return tuple(sorted(ids | {int(t) for t in extra}))


def target_markers(tokenizer, generation_eos=None) -> TargetMarkers:
    """The marker ids of `tokenizer` and its chat template (module docstring); stops: stop_ids(tokenizer,
    generation_eos). Raises chat.MaskError when the template closes an assistant turn with no special token
    (chat.end_of_turn)."""
    src = template_source(tokenizer)
    texts: dict[str, int] = {}
    think_ids = [single_token(tokenizer, t) for t in THINK]
    think = None
    if all(i is not None for i in think_ids) and THINK[1] in src:
        think = (think_ids[0], think_ids[1])
        texts.update(zip(THINK, think_ids))
    fmt, ids = None, ()
    for name, marks in TOOL_FORMATS.items():
        present = [m for m in marks if m]
        if not all(m in src for m in present):
            continue
        found = [single_token(tokenizer, m) for m in present]
        fmt, ids = name, tuple(None for _ in marks)
        if all(i is not None for i in found):
            ids = tuple(single_token(tokenizer, m) if m else None for m in marks)
            texts.update(zip(present, found))
        break
    eot, eot_text = end_of_turn(tokenizer)
    texts[eot_text] = eot
    stops = stop_ids(tokenizer, generation_eos)
    texts.update({tokenizer.convert_ids_to_tokens(t): t for t in stops})
    as_object = bool(ARGUMENTS_TOJSON.search(src)) and "arguments is string" not in src
    return TargetMarkers(think, fmt, ids, eot, texts, think is None and THINK[1] in src, as_object, stops)


def _raw_arguments(body: str) -> tuple[str, str]:
    """(name, arguments as written) of a hermes tool call body {"name": N, "arguments": A}: A is the exact JSON text
    the target wrote (whitespace and key order kept). Raises ValueError if the body is not such an object."""
    obj = json.loads(body)
    if not isinstance(obj, dict) or "name" not in obj:
        raise ValueError(f"tool call body is not {{'name', 'arguments'}}: {body[:80]!r}")
    key = body.find('"arguments"')
    if key < 0:
        return str(obj["name"]), "{}"
    start = body.index(":", key) + 1
    while body[start].isspace():
        start += 1
    _, end = json.JSONDecoder().raw_decode(body, start)
    return str(obj["name"]), body[start:end]


def _tool_calls(m: TargetMarkers, text: str, ids: list[int], decode) -> tuple[str, list[dict]]:
    """(text before the first tool call, tool calls in OpenAI form) of an answer after its reasoning: the calls
    start at the format's first marker, found as a token id where the markers are single tokens (`ids` [O]), else
    in the decoded `text` (the fallback)."""
    marks = TOOL_FORMATS[m.tool_format]
    first_mark = marks[0] or marks[2]
    first_id = m.tool_ids[0] if m.tool_ids[0] is not None else m.tool_ids[2]
    if first_id is not None:
        if first_id not in ids:
            return text, []
        head, text = decode(ids[:ids.index(first_id)]), decode(ids[ids.index(first_id):])
    elif first_mark not in text:
        return text, []
    else:
        head, text = text[:text.index(first_mark)], text[text.index(first_mark):]
    _, _, call_open, sep, call_close = marks
    calls = []
    for k, chunk in enumerate(text.split(call_open)[1:]):
        body = chunk.split(call_close)[0]
        if m.tool_format == "hermes":
            name, args = _raw_arguments(body.strip())
            call_id = f"call_{k}"
        else:
            name, _, args = body.partition(sep)
            name = call_id = name.strip()
            if m.tool_format == "kimi":                       # functions.NAME:INDEX, the id Kimi's template writes
                name = name.split(".", 1)[-1].rsplit(":", 1)[0]
        if m.arguments_as_object:
            args = json.loads(args)
        calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
    return head, calls


def parse_answer(tokenizer, m: TargetMarkers, ids: list[int], opened_think: bool = False) -> dict:
    """The assistant message an answer's ids spell: {'role': 'assistant', 'content', 'reasoning_content' (when the
    answer has a reasoning span), 'tool_calls' (when it has tool calls)}; reasoning as written (the template strips
    what it strips), content as written, or stripped where a reasoning span or tool calls were split off (module
    docstring of eagle3_core.data.history: what the history then renders).

    ids [O]: the answer, with or without the stop token it ended on (any of m.stops: Kimi's `[EOS]` as well as
    `<|im_end|>`). opened_think: the prompt ends with the think open
    marker (K2.5 and DeepSeek-V3.1 in thinking mode, a template's forced <think>), so the answer starts inside its
    reasoning. Reasoning runs to the think close marker (an answer cut before it is all reasoning); tool calls
    start at the format's first marker; calls whose body is not what the format says (cut at max_new_tokens,
    malformed JSON) stay in the content as text."""
    ids = list(ids)
    if ids and m.is_stop(ids[-1]):
        ids = ids[:-1]
    decode = lambda x: tokenizer.decode(x, skip_special_tokens=False)  # noqa: E731
    msg: dict = {"role": "assistant"}
    if m.think is not None:
        t_open, t_close = m.think
        if t_close in ids:
            k = ids.index(t_close)
            head = ids[1:k] if ids[:1] == [t_open] else ids[:k]
            msg["reasoning_content"], ids = decode(head), ids[k + 1:]
        elif opened_think or ids[:1] == [t_open]:
            msg["reasoning_content"], ids = decode(ids[1:] if ids[:1] == [t_open] else ids), []
    text = decode(ids)
    if m.think_text:                                          # fallback: <think> blocks as text
        if THINK[1] in text:
            head, text = text.split(THINK[1], 1)
            msg["reasoning_content"] = head.split(THINK[0], 1)[-1] if THINK[0] in head else head
        elif opened_think or text.lstrip().startswith(THINK[0]):
            msg["reasoning_content"], text = text.split(THINK[0], 1)[-1], ""
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] if m.tool_format else ids
    if m.tool_format is not None:
        try:
            text, calls = _tool_calls(m, text, ids, decode)
        except ValueError:                       # a call cut short or malformed: the text as written, no call
            calls = []
        if calls:
            msg["tool_calls"] = calls
    # text split off a reasoning span or tool calls is stripped, as servers' parsers return it and templates expect
    # it (Qwen3 writes a newline before a tool call only after non-empty content)
    msg["content"] = text.strip() if "reasoning_content" in msg or "tool_calls" in msg else text
    return msg


def normalized(msg: dict) -> dict:
    """An assistant message with inline reasoning (a <think> block in its content, no `reasoning_content`) given
    apart, as a reasoning-aware template or server parser reads it; other messages as they are."""
    content = msg.get("content") or ""
    if msg.get("reasoning_content") or THINK[1] not in content:
        return msg
    head, answer = content.split(THINK[1], 1)
    return {**msg, "reasoning_content": head.split(THINK[0], 1)[-1], "content": answer}


def same_message(a: dict, b: dict) -> str | None:
    """None if assistant messages `a` (what the data or server says) and `b` (read back from the trained tokens)
    say the same (reasoning and content equal up to surrounding whitespace, inline reasoning read as given apart:
    `normalized`; tool calls equal by name and parsed arguments), else what differs ('reasoning', 'content' or
    'tool calls')."""
    a, b = normalized(a), normalized(b)
    def args(c):
        v = c["function"].get("arguments")
        try:
            return json.loads(v) if isinstance(v, str) else v
        except ValueError:
            return v
    if (a.get("reasoning_content") or "").strip() != (b.get("reasoning_content") or "").strip():
        return "reasoning"
    if (a.get("content") or "").strip() != (b.get("content") or "").strip():
        return "content"
    ca, cb = a.get("tool_calls") or [], b.get("tool_calls") or []
    if [(c["function"]["name"], args(c)) for c in ca] != [(c["function"]["name"], args(c)) for c in cb]:
        return "tool calls"
    return None
