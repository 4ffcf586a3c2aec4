"""History as the template renders it: a conversation's trained turns, each with exactly the context the target was
given when it wrote that turn, merged into as few samples as the template allows.

Legend: P context tokens of one turn (its prompt: the conversation before it rendered with the generation prompt),
O answer tokens of that turn (its end-of-turn token included unless it was cut at max_new_tokens), T sample tokens.

A trained turn is (context [P], answer [O]), from one of two sources:
- 'server': a regenerated turn of a token-id API: the prompt ids sent and the output ids the server returned (the
  end-of-turn token appended where the answer stopped and the server left it out). Nothing is re-tokenized.
- 'template' (the text path: kept data, the OpenAI API, a data turn kept in a turn-by-turn row): the prompt rendered
  with the generation prompt (P_i) and the template's own rendering of the turn after it: the conversation up to and
  including the turn is rendered, must start with P_i, and the answer is what follows, up to the first end-of-turn
  token (a turn cut at max_new_tokens: up to the end of its last text, cut_span); both tokenized on their own,
  without special tokens added (what a server tokenizes). The answer must read
  back as the message it came from (markers.parse_answer against markers.same_message: the round trip), and a
  template that writes an empty think block for it where the target in this thinking mode writes its reasoning
  (the generation prompt opens <think>, or the answer is `<think></think>`) is refused: the draft would learn an
  empty thinking the target never writes. Each refusal raises RoundTripError naming its cause.

Merge rule: turns are taken in order; a turn whose context extends the current sample token for token (the
sample's ids are the context's first ids) continues it (the rest of the context with loss 0, then its answer with
loss 1); any other starts a new sample. So a tool-call chain, whose every context is the one before plus the call
and its result, is one sample, and a template that rewrites history (Qwen3 and DeepSeek-V3.1 drop earlier turns'
reasoning once a user turn follows; Kimi empties their think blocks) gives a new sample where it does: extraction
grows with the turns, not with their square, and every turn is trained in the context the target saw.
"""
from __future__ import annotations

from dataclasses import dataclass

from eagle3_core.data.chat import MaskError, end_of_turn, prompt_ids, render_chat, renderable_message
from eagle3_core.data.markers import TargetMarkers, parse_answer, same_message, target_markers


class RoundTripError(MaskError):
    """A text-path turn whose rendering is not what the target writes after its generation prompt; `cause` is one
    of CAUSES (counted per cause in the tokenize manifest)."""

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


CAUSES = {
    "prefix": "the template does not render the turn's prompt as the start of the conversation with the turn (it "
              "rewrites earlier text once the answer is appended)",
    "no_end": "the template writes no end-of-turn token after the turn",
    "reasoning": "the template renders the turn's reasoning differently (e.g. drops it: Kimi-K2-Thinking writes "
                 "<think></think> for the last plain answer, DeepSeek-V3.1 for every answer); train thinking turns "
                 "from the server's ids (generation.api 'sglang' or 'llama.cpp')",
    "content": "the template renders the turn's text differently from the message",
    "tool calls": "the template renders the turn's tool calls differently from the message",
    "empty_thinking": "the target thinks in this mode (its generation prompt or the template opens <think>) but the "
                      "turn has no reasoning, so it would train an empty think block the target never writes; "
                      "regenerate the source (kept: 'regenerate'), turn thinking off (generation."
                      "chat_template_kwargs), or set kept: 'mask' / 'refuse'",
}


@dataclass
class Turn:
    """One trained turn: `index` its message index, `context` [P] and `answer` [O] token ids, `source` 'server' |
    'template'."""
    index: int
    context: list[int]
    answer: list[int]
    source: str


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def template_turn(tokenizer, markers: TargetMarkers, messages: list[dict], i: int, row_id: str,
                  truncated: bool = False, tools: list[dict] | None = None,
                  template_kwargs: dict | None = None) -> Turn:
    """Assistant turn `messages[i]` on the text path (module docstring): its context and the template's rendering
    of it, round-trip checked. truncated: the turn was cut at max_new_tokens (no end-of-turn token; the answer runs
    to the end of the rendering). Raises RoundTripError naming `row_id`, the turn and the cause."""
    render = dict(tools=tools, template_kwargs=template_kwargs)
    prefix = render_chat(tokenizer, messages[:i], add_generation_prompt=True, **render)
    full = render_chat(tokenizer, messages[:i + 1], add_generation_prompt=False, **render)

    def refuse(cause: str, detail: str = "") -> RoundTripError:
        return RoundTripError(f"row {row_id}: assistant turn {i}: {CAUSES[cause]}{detail}; refused", cause)
    if not full.startswith(prefix):
        head = prefix.rstrip()
        if head.endswith("<think>") and full.startswith(head[:-len("<think>")]):
            # the generation prompt opens the reasoning and the rendered turn does not (DeepSeek-V3.1: `</think>`):
            # the template drops the reasoning, not the history
            raise refuse("reasoning", f" (the generation prompt ends in <think>, the rendered turn in "
                                      f"{full[len(head) - len('<think>'):][:40]!r})")
        raise refuse("prefix")
    _, eot = end_of_turn(tokenizer)
    end = full.find(eot, len(prefix))
    if end < 0 and not truncated:
        raise refuse("no_end")
    span = full[len(prefix):] if end < 0 else full[len(prefix):end + (0 if truncated else len(eot))]
    if truncated:
        span = cut_span(span, messages[i])
    context, answer = prompt_ids(tokenizer, messages[:i], tools, template_kwargs), _ids(tokenizer, span)
    if markers.think is not None:
        opened = bool(context) and context[-1] == markers.think[0]
    else:
        opened = markers.think_text and prefix.rstrip().endswith("<think>")
    back = parse_answer(tokenizer, markers, answer, opened_think=opened)
    want = renderable_message(messages[i], native=markers.think is not None or markers.think_text)
    if (diff := same_message(want, back)) is not None:       # a cut turn too: cut_span ends it where it stopped
        raise refuse(diff, f" (rendered as {tokenizer.decode(answer)[:120]!r})")
    if "reasoning_content" in back and not back["reasoning_content"].strip() and not truncated:
        raise refuse("empty_thinking")
    return Turn(i, context, answer, "template")


def cut_span(span: str, message: dict) -> str:
    """The rendering `span` of a turn cut at max_new_tokens, ended where the target stopped writing: right after
    the message's last text (its content, or its reasoning when it was cut inside it). What a template closes after
    that is not what the target wrote: a K2.5 answer cut inside its reasoning gets no `</think>`, Qwen3's
    `\n</think>\n\n` is not invented at the cut. A message with tool calls keeps the span as rendered (the round
    trip then checks the calls)."""
    if message.get("tool_calls"):
        return span
    last = message.get("content") if (message.get("content") or "").strip() else message.get("reasoning_content")
    for tail in (last or "", (last or "").strip()):     # as written (ChatML), else as a template strips it (Qwen3)
        if tail and (k := span.rfind(tail)) >= 0:
            return span[:k + len(tail)]
    return span


def server_turn(markers: TargetMarkers, index: int, prompt: list[int], output: list[int], finish: str) -> Turn:
    """A regenerated turn from the server's ids, trained as they are: the end-of-turn token is appended only where
    the answer stopped (finish reason other than 'length') and the server returned none of the target's stop ids
    (llama.cpp leaves the stop token out). A turn that ended on another stop id (Kimi's `[EOS]`) keeps it alone:
    `[EOS]<|im_end|>` is a pair the target never writes."""
    output = list(output)
    if finish != "length" and (not output or not markers.is_stop(output[-1])):
        output.append(markers.eot)
    return Turn(index, list(prompt), output, "server")


def merge_turns(turns: list[Turn], row_id: str) -> list[dict]:
    """Samples of `turns` (in conversation order) by the merge rule (module docstring): [{'id', 'input_ids' [T],
    'loss_mask' [T] (1 on answers), 'turns': message indices trained, 'sources': their sources}]. One sample keeps
    the row's id; several are named '{row_id}/turn{i}', i the message index of their first turn."""
    samples: list[dict] = []
    cur: dict | None = None
    for t in turns:
        n = len(cur["input_ids"]) if cur is not None else 0
        if cur is not None and len(t.context) >= n and t.context[:n] == cur["input_ids"]:
            rest = t.context[n:]
            cur["input_ids"] += rest + t.answer
            cur["loss_mask"] += [0] * len(rest) + [1] * len(t.answer)
        else:
            cur = {"input_ids": t.context + t.answer, "loss_mask": [0] * len(t.context) + [1] * len(t.answer),
                   "turns": [], "sources": []}
            samples.append(cur)
        cur["turns"].append(t.index)
        cur["sources"].append(t.source)
    for s in samples:
        s["id"] = row_id if len(samples) == 1 else f"{row_id}/turn{s['turns'][0]}"
    return samples


def fit(sample: dict, max_length: int | None, overlong: str, row_id: str) -> dict | None:
    """`sample` cut to max_length ('truncate', with 'cut': True) or None ('drop') when longer. Raises MaskError
    naming the row when nothing supervised is left."""
    cut = max_length is not None and len(sample["input_ids"]) > max_length
    if cut and overlong == "drop":
        return None
    out = {**sample, "cut": cut}
    if cut:
        out["input_ids"], out["loss_mask"] = sample["input_ids"][:max_length], sample["loss_mask"][:max_length]
    if not any(out["loss_mask"]):
        raise MaskError(f"row {row_id}: empty loss mask (empty answers, or the context alone is longer than "
                        f"max_length {max_length}); set prompts.overlong='drop' or raise features.max_length")
    return out


def tokenize_chat(tokenizer, messages: list[dict], row_id: str, train: str = "all", truncated: bool = False,
                  max_length: int | None = None, overlong: str = "truncate", tools: list[dict] | None = None,
                  template_kwargs: dict | None = None, markers: TargetMarkers | None = None) -> list[dict]:
    """Samples of a conversation that ends with an assistant turn, on the text path (module docstring).

    train: 'all' trains every assistant turn, 'last' only the final one (earlier turns are context). truncated: the
    final turn was cut at max_new_tokens (no end-of-turn token). Samples longer than max_length: overlong
    'truncate' cuts them, 'drop' leaves them out. tools / template_kwargs: rendered with them, as `chat.prompt_ids`
    renders a request's prompt; markers: the target's (markers.target_markers, computed when not given).

    Returns [{'id', 'input_ids' [T], 'loss_mask' [T] 0/1, 'cut', 'turns', 'sources'}] (merge_turns, fit). Raises
    MaskError naming `row_id` if there is no final assistant turn or the mask comes out empty, RoundTripError for a
    turn the template does not render as the target writes it."""
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not turns or turns[-1] != len(messages) - 1:
        raise MaskError(f"row {row_id}: the conversation must end with an assistant turn; drop the row")
    markers = markers or target_markers(tokenizer)
    trained = turns if train == "all" else turns[-1:]
    built = [template_turn(tokenizer, markers, messages, i, row_id, truncated and i == turns[-1], tools,
                           template_kwargs) for i in trained]
    return [s for s in (fit(s, max_length, overlong, row_id) for s in merge_turns(built, row_id)) if s]


def tokenize_conversation(tokenizer, messages: list[dict], response: str, row_id: str, truncated: bool = False,
                          max_length: int | None = None) -> dict:
    """input_ids and loss_mask for prompt `messages` answered by `response` (only that answer is trained): one
    sample {'input_ids', 'loss_mask'}. Raises as tokenize_chat does."""
    (seq,) = tokenize_chat(tokenizer, messages + [{"role": "assistant", "content": response}], row_id,
                           train="last", truncated=truncated, max_length=max_length)
    return {"input_ids": seq["input_ids"], "loss_mask": seq["loss_mask"]}
