"""Generation rows -> training samples (input_ids, loss_mask): the body of the tokenize stage.

Legend: T tokens of one sample; P prompt tokens; O output tokens the server returned.

Which turns a row trains, each with the context the target had (eagle3_core.data.history: the two sources of a
turn, the round trip of the text path, the merge rule):
- final-turn rows (`generation.turns = 'final'`): the regenerated answer; from the server's own ids where a
  token-id API ('llama.cpp', 'sglang') returned them (prompt_ids [P] + output_ids [O], no re-tokenization: a text
  round trip can merge or split tokens the target never did, `check_server_ids` measures how often), else on the
  text path (the OpenAI API returns text), tool calls included as the template renders them;
- turn-by-turn rows (`turns = 'all'`): every regenerated turn (the server's ids per turn where the row has them:
  `turn_prompt_ids`, `turn_output_ids`) and the data's assistant turns kept in the row (its tool-call turns), unless
  the source's `kept` choice is 'mask' (prompt row meta 'kept'): then they are context only;
- mode 'keep' rows: every assistant turn of the data, on the text path.
Consecutive turns share a sample while the template keeps the history they were written after (history.merge_turns).
All renderings use the row's tools and `generation.chat_template_kwargs`, as the requests did.
"""
from __future__ import annotations

import json

from eagle3_core.config.mix import SourceSpec
from eagle3_core.data.chat import MaskError
from eagle3_core.data.history import fit, merge_turns, server_turn, template_turn, tokenize_chat
from eagle3_core.data.markers import TargetMarkers, target_markers
from eagle3_core.serving.client import TOKEN_ID_APIS


def row_tools(row: dict) -> list[dict] | None:
    """The row's OpenAI tool schemas (the `tools` column, JSON text), or None."""
    return json.loads(row["tools"]) if row.get("tools") else None


def row_meta(row: dict) -> dict:
    """The row's `meta` column (JSON text) as a dict ({} if none)."""
    return json.loads(row["meta"]) if row.get("meta") else {}


def final_answer(row: dict) -> dict:
    """The assistant message of a final-turn row's answer: its text, reasoning (given apart) and tool calls."""
    msg = {"role": "assistant", "content": row["response"]}
    if row.get("reasoning"):
        msg["reasoning_content"] = row["reasoning"]
    if row.get("tool_calls"):
        msg["tool_calls"] = json.loads(row["tool_calls"])
    return msg


def uses_server_ids(row: dict) -> bool:
    """True if the row's regenerated turns are trained on the server's own token ids (a token-id API's final-turn
    row with ids, or its turn-by-turn row with the ids of every turn)."""
    if row.get("api") not in TOKEN_ID_APIS or row.get("mode") == "keep":
        return False
    if row.get("turns"):
        return bool(row.get("turn_output_ids")) and len(row["turn_output_ids"]) == len(json.loads(row["turns"]))
    return bool(row.get("output_ids")) and bool(row.get("prompt_ids"))


def server_id_sample(tokenizer, row: dict, max_length: int, overlong: str, markers=None) -> dict | None:
    """The sample of a final-turn row from the server's ids: {'input_ids': prompt_ids + output_ids (+ end-of-turn),
    'loss_mask', 'cut'}, or None (longer than max_length and overlong 'drop'). Raises MaskError naming the row if
    nothing is supervised."""
    markers = markers or target_markers(tokenizer)
    turn = server_turn(markers, len(row["messages"]), row["prompt_ids"], row["output_ids"], row["finish_reason"])
    return fit(merge_turns([turn], row["id"])[0], max_length, overlong, row["id"])


def retokenized_sample(tokenizer, row: dict, max_length: int | None, overlong: str,
                       template_kwargs: dict | None, markers=None) -> dict | None:
    """A final-turn row on the text path (train='last'); see history.tokenize_chat."""
    out = tokenize_chat(tokenizer, row["messages"] + [final_answer(row)], row["id"], train="last",
                        truncated=row["finish_reason"] == "length", max_length=max_length, overlong=overlong,
                        tools=row_tools(row), template_kwargs=template_kwargs, markers=markers)
    return out[0] if out else None


def data_turns(row: dict) -> list[int]:
    """Message indices of the assistant turns a row would train that come from the data, not the target: every
    one of a mode 'keep' row, the turns a turn-by-turn row kept (its tool-call turns); none for a final-turn row."""
    msgs = row["messages"]
    if row.get("mode") == "keep":
        return [i for i, m in enumerate(msgs) if m.get("role") == "assistant"]
    if not row.get("turns"):
        return []
    regenerated = {t["index"] for t in json.loads(row["turns"])}
    return [i for i, m in enumerate(msgs) if m.get("role") == "assistant" and i not in regenerated]


def _turn_by_turn(tokenizer, markers: TargetMarkers, row: dict, render: dict, server: bool) -> list:
    """The trained turns of a turn-by-turn row, in conversation order (module docstring)."""
    msgs, turns = row["messages"], json.loads(row["turns"])
    regenerated = {t["index"]: k for k, t in enumerate(turns)}
    mask_kept = row_meta(row).get("kept") == "mask"
    out = []
    for i, m in enumerate(msgs):
        if m.get("role") != "assistant" or (i not in regenerated and mask_kept):
            continue
        k = regenerated.get(i)
        if k is not None and server:
            out.append(server_turn(markers, i, row["turn_prompt_ids"][k], row["turn_output_ids"][k],
                                   turns[k].get("finish_reason", "")))
        else:
            cut = k is not None and turns[k].get("finish_reason") == "length"
            out.append(template_turn(tokenizer, markers, msgs[:i + 1], i, row["id"], cut, **render))
    return out


def row_samples(tokenizer, row: dict, max_length: int, overlong: str, template_kwargs: dict | None = None,
                use_server_ids: bool = True, markers: TargetMarkers | None = None) -> tuple[list[dict], str]:
    """(samples, token source) of one generation row (messages decoded from JSON). Each sample is {'id',
    'input_ids': list[int] [T], 'loss_mask': list[int] 0/1 [T], 'cut': bool, 'turns', 'sources'}; one longer than
    max_length with overlong 'drop' is left out. token source: 'server' (the server's ids), 'template' (the text
    path) or 'server+template' (a turn-by-turn row with both). Samples of a row split by the merge rule are named
    '{row id}/turn{i}' (i: message index of their first turn). markers: the target's (computed when not given).
    A row of a source with kept 'refuse' that holds data turns to train gives no sample, token source 'refused'.
    Raises MaskError (history.RoundTripError with its cause) / jinja2 TemplateError for a row the template cannot
    train (the caller records it)."""
    markers = markers or target_markers(tokenizer)
    if row_meta(row).get("kept") == "refuse" and data_turns(row):
        return [], "refused"
    render = dict(tools=row_tools(row), template_kwargs=template_kwargs)
    server = use_server_ids and uses_server_ids(row)
    if row.get("mode") == "keep" or not row.get("turns"):
        if server:
            turns = [server_turn(markers, len(row["messages"]), row["prompt_ids"], row["output_ids"],
                                 row["finish_reason"])]
        else:
            msgs = row["messages"] if row.get("mode") == "keep" else row["messages"] + [final_answer(row)]
            trained = [i for i, m in enumerate(msgs) if m.get("role") == "assistant"]
            if row.get("mode") != "keep":
                trained = trained[-1:]
            if not trained or trained[-1] != len(msgs) - 1:
                raise MaskError(f"row {row['id']}: the conversation must end with an assistant turn; drop the row")
            cut = row.get("mode") != "keep" and row["finish_reason"] == "length"
            turns = [template_turn(tokenizer, markers, msgs[:i + 1], i, row["id"], cut and i == trained[-1],
                                   **render) for i in trained]
    else:
        turns = _turn_by_turn(tokenizer, markers, row, render, server)
    samples = [s for s in (fit(s, max_length, overlong, row["id"]) for s in merge_turns(turns, row["id"])) if s]
    kinds = sorted({t.source for t in turns})
    return samples, "+".join(kinds) if kinds else "template"


def check_server_ids(tokenizer, rows: list[dict], template_kwargs: dict | None, n: int = 16) -> dict:
    """Sample check of the token-id path: for the first `n` rows trained on server ids, does re-tokenizing the
    row's text with the template give exactly prompt_ids + output_ids (+ end-of-turn)? Returns {'checked',
    'equal', 'mismatched': [{id, first_diff (token index), server, template}] (at most 5)} (final-turn rows)."""
    checked, equal, bad = 0, 0, []
    markers = None
    for r in rows:
        if checked >= n:
            break
        if not uses_server_ids(r) or r.get("turns"):
            continue
        checked += 1
        markers = markers or target_markers(tokenizer)
        server = server_id_sample(tokenizer, r, 10**9, "truncate", markers)["input_ids"]
        try:
            text = retokenized_sample(tokenizer, r, None, "truncate", template_kwargs, markers)["input_ids"]
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


def route_kept(spec: SourceSpec, rows: list[dict], probe) -> tuple[list[dict], dict | None]:
    """(rows, route) of a mode 'keep' source whose kept choice is 'auto' (SourceSpec.kept); (rows, None) for any
    other source or without a probe. probe(row) -> None where the row's kept turns train as the target's template
    renders them, else (cause, reason) (pipeline.prompts_stage.kept_probe). The source's first row is probed: passed,
    its rows stay kept (route 'train'); refused, every row becomes a prompt row the target answers, as with kept
    'regenerate' (meta 'kept': 'regenerate', 'kept_auto': the cause). route: {'route', 'probed_row', and where
    refused 'cause', 'reason'}."""
    if probe is None or spec.mode != "keep" or spec.kept != "auto" or not rows:
        return rows, None
    refused = probe(rows[0])
    if refused is None:
        return rows, {"route": "train", "probed_row": rows[0]["id"]}
    cause, reason = refused
    rows = [{**r, "mode": "prompt", "meta": json.dumps({**json.loads(r["meta"]), "kept": "regenerate",
                                                         "kept_auto": cause})} for r in rows]
    return rows, {"route": "regenerate", "probed_row": rows[0]["id"], "cause": cause, "reason": reason}
