"""The target's chat template: rendering (with the row's tools, chat-template arguments and reasoning given apart),
prompt token ids as a server tokenizes them, the end-of-turn token.

Every piece is tokenized on its own, without special tokens added: the template is the only source of BOS (handed
case C4). How trained turns and their loss masks come out of these renderings (the text path and the server's own
ids, one sample per run of turns whose history the template keeps): eagle3_core.data.history.
"""
from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_SENTINEL = "Q7zEndOfTurnProbe"


class MaskError(ValueError):
    """A row whose loss mask cannot be built correctly; the message names the row and the fix."""


def prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None,
               template_kwargs: dict | None = None) -> list[int]:
    """Token ids of `messages` rendered with the chat template and the generation prompt (what a server sees).
    tools: OpenAI tool schemas passed to the template (`tools=`); template_kwargs: more template arguments (e.g.
    {'enable_thinking': False}), as `generation.chat_template_kwargs` sends them to a server."""
    text = render_chat(tokenizer, messages, add_generation_prompt=True, tools=tools, template_kwargs=template_kwargs)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    _check_single_bos(tokenizer, ids, "prompt")
    return ids


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None,
                template_kwargs: dict | None = None) -> str:
    """`messages` rendered as text by the target's chat template, with the row's `tools` and chat-template
    arguments (e.g. {'enable_thinking': False}); reasoning given apart (`reasoning_content`) goes to a template
    that reads that field as it is (Qwen3, Kimi), to others inline (renderable_message). Raises what the template
    raises (jinja2 TemplateError, transformers' ValueError for an empty conversation)."""
    native = reads_reasoning_field(tokenizer)
    return tokenizer.apply_chat_template([renderable_message(m, native) for m in messages], tokenize=False,
                                         add_generation_prompt=add_generation_prompt, tools=tools or None,
                                         **(template_kwargs or {}))


def renders_tools(tokenizer, messages: list[dict], tools: list[dict], template_kwargs: dict | None = None) -> bool:
    """Whether the chat template shows `tools` (OpenAI tool schemas) in the prompt of `messages`: the rendering with
    them differs from the one without. A template that never reads `tools` (SmolLM2's, Llama-2's) drops the schemas,
    and the target answers a function-calling prompt without seeing the functions."""
    return (render_chat(tokenizer, messages, True, tools, template_kwargs)
            != render_chat(tokenizer, messages, True, None, template_kwargs))


def reads_reasoning_field(tokenizer) -> bool:
    """True if the chat template reads `reasoning_content` (Qwen3, Kimi-K2-Thinking and K2.5 do): such a template
    places the reasoning itself, and a <think> block put inline into the content would be rendered twice (Kimi
    wraps the content in its own think block)."""
    t = getattr(tokenizer, "chat_template", None) or ""
    return "reasoning_content" in (" ".join(t.values()) if isinstance(t, dict) else t)


def renderable_message(m: dict, native: bool = False) -> dict:
    """The message as the template gets it: reasoning given apart (`reasoning_content`) stays a field for a
    template that reads it (`native`), and otherwise goes back inline as a <think> block: templates that parse
    reasoning out of the content find it there, the others render it as it is instead of dropping it."""
    if m.get("role") == "assistant" and m.get("reasoning_content") and not native:
        rest = {k: v for k, v in m.items() if k != "reasoning_content"}
        return {**rest, "content": assistant_content(m.get("content") or "", m["reasoning_content"])}
    return m


def _check_single_bos(tokenizer, ids: list[int], where: str) -> None:
    bos = tokenizer.bos_token_id
    if bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
        raise MaskError(f"{where}: sequence starts with two BOS tokens; the chat template already emits BOS")


def assistant_content(response: str, reasoning: str = "") -> str:
    """Assistant turn text; reasoning returned separately by the server is put back in a <think> block."""
    if reasoning and THINK_OPEN not in response:
        return f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{response}"
    return response


def end_of_turn(tokenizer) -> tuple[int, str]:
    """(id, text) of the token the chat template closes an assistant turn with (<|im_end|>, <|eot_id|>, ...): the
    first special token after the answer in a rendered one-turn chat. Raises MaskError if there is none."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": _SENTINEL}], tokenize=False)
    tail = text[text.rindex(_SENTINEL) + len(_SENTINEL):]
    special = set(tokenizer.all_special_ids)
    first = next((t for t in tokenizer(tail, add_special_tokens=False)["input_ids"] if t in special), None)
    if first is None:
        raise MaskError(f"the chat template ends an assistant turn with {tail[:30]!r}, no special token; add the "
                        f"end-of-turn token to the tokenizer's special tokens (seen with transformers 5.17 on a "
                        f"tokenizer converted from GGUF, which 5.24 flags special: upgrade transformers, or point "
                        f"target.model at a directory with the model's own tokenizer files)")
    return first, tokenizer.convert_ids_to_tokens(first)
