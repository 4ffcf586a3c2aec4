"""Tokenization with the target's chat template and the assistant-only loss mask.

Sequence = prompt tokens (template rendered with the generation prompt) + completion tokens (the rest of the
rendered conversation), each tokenized without special tokens added: the template is the only source of BOS, so
no sequence gets two (handed case C4). loss_mask[t] = 1 where x_t is an assistant token the target generated,
through the turn's end-of-turn token; 0 on the prompt, the template's generation prompt and text after the
end-of-turn token (handed case C1: an empty mask is an error).
"""
from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class MaskError(ValueError):
    """A row whose loss mask cannot be built correctly; the message names the row and the fix."""


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` rendered with the chat template and the generation prompt (what a server sees)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    _check_single_bos(tokenizer, ids, "prompt")
    return ids


def _check_single_bos(tokenizer, ids: list[int], where: str) -> None:
    bos = tokenizer.bos_token_id
    if bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
        raise MaskError(f"{where}: sequence starts with two BOS tokens; the chat template already emits BOS")


def assistant_content(response: str, reasoning: str = "") -> str:
    """Assistant turn text; reasoning returned separately by the server is put back in a <think> block."""
    if reasoning and THINK_OPEN not in response:
        return f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{response}"
    return response


def tokenize_conversation(tokenizer, messages: list[dict], response: str, row_id: str, truncated: bool = False,
                          max_length: int | None = None) -> dict:
    """input_ids and loss_mask for prompt `messages` answered by `response`.

    Returns {'input_ids': list[int], 'loss_mask': list[int]} of equal length T (<= max_length).
    truncated=True (finish reason 'length'): the target never emitted its end-of-turn token, so the sequence ends
    with the response text. Raises MaskError naming `row_id` if the rendered prompt is not a prefix of the rendered
    conversation (a template that rewrites history) or the mask is empty.
    """
    prefix = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)
    if not full.startswith(prefix):
        raise MaskError(f"row {row_id}: the chat template does not render the prompt as a prefix of the "
                        f"conversation (it rewrites earlier turns); split this row by turn or drop it")
    completion = full[len(prefix):]
    # the generation prompt may already hold the start of the response (e.g. an opened <think>): skip that part
    longest = min(len(prefix), len(response), 256)
    overlap = next((k for k in range(longest, 0, -1) if prefix.endswith(response[:k])), 0)
    if response[overlap:] not in completion:
        raise MaskError(f"row {row_id}: the chat template changes the assistant text it trains on (e.g. strips "
                        f"reasoning); use a template that keeps it, or drop the row")
    p_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    c_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    eot = tokenizer.eos_token_id
    end = len(c_ids)
    if eot is not None and eot in c_ids:
        end = len(c_ids) - c_ids[::-1].index(eot)                 # through the last end-of-turn token
        if truncated:
            end -= 1                                              # the target stopped at the length limit
        c_ids = c_ids[:end]
    ids = p_ids + c_ids
    mask = [0] * len(p_ids) + [1] * len(c_ids)
    _check_single_bos(tokenizer, ids, f"row {row_id}")
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        raise MaskError(f"row {row_id}: empty loss mask (empty response or prompt longer than max_length "
                        f"{max_length}); drop the row or raise features.max_length")
    return {"input_ids": ids, "loss_mask": mask}
