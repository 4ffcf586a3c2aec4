"""Tokenization with the target's chat template and the assistant-only loss mask.

Legend: T tokens of one sample.

The conversation is rendered once with the template (text F). Each trained assistant turn i starts where the
template's rendering of the turns before it, with the generation prompt, ends (P_i; checked to be a prefix of F:
a template that rewrites earlier turns once later ones exist fails here, handed case C3) and ends with the first
end-of-turn token after that (the token the template closes an assistant turn with, found by rendering a one-turn
chat). F is cut at these boundaries and each piece is tokenized on its own, without special tokens added: the
template is the only source of BOS (handed case C4), the prompt of the final turn is tokenized exactly as a server
tokenizes P_i, and the masked tokens decode to exactly the turn's rendered text plus its end-of-turn token
(handed cases C1, C2). loss_mask = 1 on those tokens; 0 on system/user/tool turns, the template's role headers and
generation prompts, and text between turns. The sequence ends at the last trained turn's end-of-turn token.

Templates that strip earlier turns' reasoning (Qwen3, DeepSeek-R1: only turns after the last user message keep
their <think> block): the mask follows the template. An earlier assistant turn is trained as the template renders
it in the full conversation, without its reasoning: that is the context the target sees when it serves the next
turn. Its reasoning is not trained. The final turn must keep its text and reasoning, or the row is an error.

One method for every template. On a template with `{% generation %}` markers it gives the same mask as
transformers' `return_assistant_tokens_mask` (tests/test_data.py); SmolLM2's ChatML template has no markers, so
that option gives nothing there.
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
    """`messages` rendered as text by the target's chat template (reasoning given apart put back inline), with the
    row's `tools` and chat-template arguments (e.g. {'enable_thinking': False}); raises what the template raises
    (jinja2 TemplateError, transformers' ValueError for an empty conversation)."""
    return tokenizer.apply_chat_template([renderable_message(m) for m in messages], tokenize=False,
                                         add_generation_prompt=add_generation_prompt, tools=tools or None,
                                         **(template_kwargs or {}))


def renderable_message(m: dict) -> dict:
    """Reasoning given apart (`reasoning_content`) goes back inline as a <think> block: templates that know
    reasoning parse it out of the content, the others render it as it is instead of dropping it."""
    if m.get("role") == "assistant" and m.get("reasoning_content"):
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


def split_reasoning(content: str) -> tuple[str, str]:
    """(reasoning, visible answer) of an assistant text with an inline <think> block."""
    if THINK_CLOSE not in content:
        return "", content.strip()
    head, answer = content.rsplit(THINK_CLOSE, 1)
    return head.split(THINK_OPEN)[-1].strip(), answer.strip()


def tokenize_chat(tokenizer, messages: list[dict], row_id: str, train: str = "all", truncated: bool = False,
                  max_length: int | None = None, overlong: str = "truncate", tools: list[dict] | None = None,
                  template_kwargs: dict | None = None) -> dict | None:
    """input_ids and loss_mask of a conversation that ends with an assistant turn.

    train: 'all' trains every assistant turn (responses kept as they are), 'last' only the final one (the turn the
    target regenerated; earlier turns are context). truncated=True (finish reason 'length'): the final turn has no
    end-of-turn token. Longer than max_length: overlong='truncate' cuts to max_length, 'drop' returns None.
    tools / template_kwargs: rendered with them, as `prompt_ids` renders a request's prompt.

    Returns {'input_ids': list[int], 'loss_mask': list[int] (0/1), 'cut': bool (truncated to max_length)}, equal
    lengths T. Raises MaskError naming `row_id` if there is no assistant turn, the template does not render a turn's
    prompt as a prefix of the conversation, changes the final turn's text or reasoning, or the mask comes out
    empty.
    """
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not turns or turns[-1] != len(messages) - 1:
        raise MaskError(f"row {row_id}: the conversation must end with an assistant turn; drop the row")
    trained = turns if train == "all" else turns[-1:]
    render = dict(tools=tools, template_kwargs=template_kwargs)
    full = render_chat(tokenizer, messages, add_generation_prompt=False, **render)
    _, eot = end_of_turn(tokenizer)
    spans = []
    for i in trained:
        prefix = render_chat(tokenizer, messages[:i], add_generation_prompt=True, **render)
        if not full.startswith(prefix):
            raise MaskError(f"row {row_id}: the chat template does not render the prompt of turn {i} as a prefix "
                            f"of the conversation (it rewrites earlier turns); split this row by turn or drop it")
        start = len(prefix)
        assert not spans or start >= spans[-1][1], f"row {row_id}: turn {i} starts inside the previous turn"
        end = full.find(eot, start)
        last = i == turns[-1]
        if end < 0 and not (last and truncated):
            raise MaskError(f"row {row_id}: assistant turn {i} has no end-of-turn token {eot!r} in the rendering")
        end = (len(full) if end < 0 else end) if last and truncated else end + len(eot)
        reasoning, answer = split_reasoning(renderable_message(messages[i]).get("content") or "")
        span = full[start:end]
        if answer not in span or (last and reasoning not in span):
            raise MaskError(f"row {row_id}: the chat template changes the assistant text it trains on in turn {i} "
                            f"(e.g. strips reasoning); use a template that keeps it, or drop the row")
        spans.append((start, end))
    ids, mask, pos = [], [], 0
    for start, end in spans:
        for text, m in ((full[pos:start], 0), (full[start:end], 1)):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
            ids += piece
            mask += [m] * len(piece)
        pos = end
    _check_single_bos(tokenizer, ids, f"row {row_id}")
    cut = max_length is not None and len(ids) > max_length
    if cut and overlong == "drop":
        return None
    if cut:
        ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        raise MaskError(f"row {row_id}: empty loss mask (empty response, or the prompt alone is longer than "
                        f"max_length {max_length}); set prompts.overlong='drop' or raise features.max_length")
    return {"input_ids": ids, "loss_mask": mask, "cut": cut}


def tokenize_conversation(tokenizer, messages: list[dict], response: str, row_id: str, truncated: bool = False,
                          max_length: int | None = None) -> dict:
    """input_ids and loss_mask for prompt `messages` answered by `response` (only that answer is trained).
    Returns {'input_ids', 'loss_mask'}; raises MaskError as tokenize_chat does."""
    seq = tokenize_chat(tokenizer, messages + [{"role": "assistant", "content": response}], row_id, train="last",
                        truncated=truncated, max_length=max_length)
    return {"input_ids": seq["input_ids"], "loss_mask": seq["loss_mask"]}
