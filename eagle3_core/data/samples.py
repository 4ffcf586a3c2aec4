"""Generation rows -> training samples (input_ids, loss_mask): the body of the tokenize stage.

Legend: T tokens of one sample; P prompt tokens; O output tokens the server returned.

Which tokens a row trains (docs/architecture.md, stage `tokenize`):
- mode 'keep' rows: every assistant turn of the data, re-tokenized with the target's chat template;
- final-turn rows (`generation.turns = 'final'`) of a token-id API ('llama.cpp', 'sglang'): the server's own ids,
  prompt_ids [P] (what the server was sent) + output_ids [O] (what the target produced), loss on the O ids and on
  the end-of-turn token (appended when the answer stopped and the server left it out). No re-tokenization: a text
  round trip can merge or split tokens the target never did (`check_server_ids` measures how often);
- final-turn rows of the OpenAI API (text only): the answer re-tokenized with the template, tool calls included as
  the template renders them (`data.tokenize_chat`, train='last');
- turn-by-turn rows (`turns = 'all'`): the regenerated conversation, every assistant turn trained (train='all'),
  re-tokenized. Where the template drops earlier turns' reasoning (Qwen3, DeepSeek-R1: only turns after the last
  user message keep their <think> block) one sample per assistant turn instead, each ending at that turn and
  trained on it alone: every turn's reasoning is then trained as the template renders it at that turn, which is
  what the target sees when it writes it.
All renderings use the row's tools and `generation.chat_template_kwargs`, as the requests did.
"""
from __future__ import annotations

import json

from eagle3_core.data.chat import (
    MaskError,
    assistant_content,
    end_of_turn,
    render_chat,
    renderable_message,
    split_reasoning,
    tokenize_chat,
)
from eagle3_core.serving.client import TOKEN_ID_APIS


def row_tools(row: dict) -> list[dict] | None:
    """The row's OpenAI tool schemas (the `tools` column, JSON text), or None."""
    return json.loads(row["tools"]) if row.get("tools") else None


def final_answer(row: dict) -> dict:
    """The assistant message of a final-turn row's answer: text with its reasoning inline, its tool calls."""
    msg = {"role": "assistant", "content": assistant_content(row["response"], row["reasoning"] or "")}
    if row.get("tool_calls"):
        msg["tool_calls"] = json.loads(row["tool_calls"])
    return msg


def uses_server_ids(row: dict) -> bool:
    """True if the row is trained on the server's own token ids (final-turn row of a token-id API with ids)."""
    return (row.get("api") in TOKEN_ID_APIS and not row.get("turns") and bool(row.get("output_ids"))
            and bool(row.get("prompt_ids")))


def strips_history_reasoning(tokenizer, messages: list[dict], tools=None, template_kwargs=None) -> bool:
    """True if the template leaves out the reasoning of an assistant turn before the last one (checked by
    rendering `messages`: some earlier turn's reasoning text is not in the rendering)."""
    full = render_chat(tokenizer, messages, add_generation_prompt=False, tools=tools, template_kwargs=template_kwargs)
    turns = [m for m in messages if m.get("role") == "assistant"][:-1]
    for m in turns:
        reasoning, _ = split_reasoning(renderable_message(m).get("content") or "")
        if reasoning and reasoning not in full:
            return True
    return False


def server_id_sample(tokenizer, row: dict, max_length: int, overlong: str) -> dict | None:
    """{'input_ids': prompt_ids + output_ids (+ end-of-turn), 'loss_mask', 'cut'} from the server's ids, or None
    (longer than max_length and overlong 'drop'). Raises MaskError naming the row if nothing is supervised."""
    eot, _ = end_of_turn(tokenizer)
    prompt, output = list(row["prompt_ids"]), list(row["output_ids"])
    if row["finish_reason"] != "length" and output[-1] != eot:
        output.append(eot)                     # the server stopped at end-of-turn and did not return it
    ids, mask = prompt + output, [0] * len(prompt) + [1] * len(output)
    cut = len(ids) > max_length
    if cut and overlong == "drop":
        return None
    ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        raise MaskError(f"row {row['id']}: empty loss mask (the prompt alone is {len(prompt)} tokens, longer than "
                        f"features.max_length {max_length}); set prompts.over_budget='drop' or raise max_length")
    return {"input_ids": ids, "loss_mask": mask, "cut": cut}


def retokenized_sample(tokenizer, row: dict, max_length: int | None, overlong: str,
                       template_kwargs: dict | None) -> dict | None:
    """A final-turn row re-tokenized with the template (train='last'); see data.tokenize_chat."""
    return tokenize_chat(tokenizer, row["messages"] + [final_answer(row)], row["id"], train="last",
                         truncated=row["finish_reason"] == "length", max_length=max_length, overlong=overlong,
                         tools=row_tools(row), template_kwargs=template_kwargs)


def row_samples(tokenizer, row: dict, max_length: int, overlong: str, template_kwargs: dict | None = None,
                use_server_ids: bool = True) -> tuple[list[dict], str]:
    """(samples, token source) of one generation row (messages decoded from JSON). Each sample is {'id',
    'input_ids': list[int] [T], 'loss_mask': list[int] 0/1 [T], 'cut': bool}; a sample longer than max_length
    with overlong 'drop' is left out. token source: 'server' (the server's ids) or 'template' (re-tokenized).
    Per-turn samples (see the module docstring) have ids '{row id}/turn{i}' (i: message index).
    Raises MaskError / jinja2 TemplateError for a row the template cannot train (the caller records it)."""
    tools = row_tools(row)
    render = dict(tools=tools, template_kwargs=template_kwargs)
    if row.get("mode") != "keep" and not row.get("turns"):
        if use_server_ids and uses_server_ids(row):
            seq, source = server_id_sample(tokenizer, row, max_length, overlong), "server"
        else:
            seq, source = retokenized_sample(tokenizer, row, max_length, overlong, template_kwargs), "template"
        return ([{"id": row["id"], **seq}] if seq else []), source
    msgs = row["messages"]
    truncated = row.get("mode") != "keep" and row["finish_reason"] == "length"
    if row.get("mode") == "keep" or not strips_history_reasoning(tokenizer, msgs, **render):
        seq = tokenize_chat(tokenizer, msgs, row["id"], train="all", truncated=truncated, max_length=max_length,
                            overlong=overlong, **render)
        return ([{"id": row["id"], **seq}] if seq else []), "template"
    out = []
    last = max(i for i, m in enumerate(msgs) if m.get("role") == "assistant")
    for i in (i for i, m in enumerate(msgs) if m.get("role") == "assistant"):
        seq = tokenize_chat(tokenizer, msgs[:i + 1], f"{row['id']}/turn{i}", train="last",
                            truncated=truncated and i == last, max_length=max_length, overlong=overlong, **render)
        if seq:
            out.append({"id": f"{row['id']}/turn{i}", **seq})
    return out, "template"


def check_server_ids(tokenizer, rows: list[dict], template_kwargs: dict | None, n: int = 16) -> dict:
    """Sample check of the token-id path: for the first `n` rows trained on server ids, does re-tokenizing the
    row's text with the template give exactly prompt_ids + output_ids (+ end-of-turn)? Returns {'checked',
    'equal', 'mismatched': [{id, first_diff (token index), server, template}] (at most 5)}."""
    checked, equal, bad = 0, 0, []
    for r in rows:
        if checked >= n:
            break
        if not uses_server_ids(r):
            continue
        checked += 1
        server = server_id_sample(tokenizer, r, 10**9, "truncate")["input_ids"]
        try:
            text = retokenized_sample(tokenizer, r, None, "truncate", template_kwargs)["input_ids"]
        except (MaskError, ValueError) as e:
            bad.append({"id": r["id"], "first_diff": None, "reason": str(e)[:200]})
            continue
        if text == server:
            equal += 1
            continue
        diff = next((k for k, (a, b) in enumerate(zip(server, text)) if a != b), min(len(server), len(text)))
        if len(bad) < 5:
            bad.append({"id": r["id"], "first_diff": diff, "server": server[diff:diff + 8],
                        "template": text[diff:diff + 8]})
    return {"checked": checked, "equal": equal, "mismatched": bad}


def batches_by_tokens(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped so that (batch size x longest sequence) stays within `budget` tokens; length-sorted."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > budget:              # ascending: i is the longest so far
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches
