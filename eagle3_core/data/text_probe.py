"""Whether a text API (`generation.api` 'openai': the server answers in text, the tokenize stage re-renders it with
the chat template) can train what the target writes: one probe turn with reasoning, one cut inside its reasoning
(or inside its answer, for a target that does not think in the configured mode), rendered through the target's chat
template before any generation, as eagle3_core.data.history's round trip would render them after it.

Why before: the round trip refuses each such row at tokenize, after the whole generation (a K2.5 agentic run: ~30 h
of generation, then every answer with reasoning refused). Checked on the template text alone, so `check` runs it
offline (`--chat-template`). Thinking mode: the generation prompt (with generation.chat_template_kwargs) ends in a
closed think block (`</think>`: Qwen3 `enable_thinking: false`, K2.5 `thinking: false`, DeepSeek-V3.1 by default)
means the target writes no reasoning; a template that knows `</think>` and does not close it thinks.
"""
from __future__ import annotations

from eagle3_core.data.chat import THINK_CLOSE, renderable_message
from eagle3_core.data.template_kwargs import tokenizer_templates
from eagle3_core.target.loading import load_tokenizer

PROMPT = [{"role": "user", "content": "What is 2+2?"}]
REASONING, ANSWER = "Two plus two makes four.", "It is 4."


def _render(template: str, messages: list[dict], generation_prompt: bool, kwargs: dict | None) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template  # slow import: check loads no transformers
    native = "reasoning_content" in template
    msgs = [renderable_message(m, native) for m in messages]
    return render_jinja_template([msgs], chat_template=template, add_generation_prompt=generation_prompt,
                                 **(kwargs or {}))[0][0]


def thinks(template: str, kwargs: dict | None) -> bool:
    """True if the target writes reasoning after its generation prompt in this thinking mode (module docstring)."""
    prompt = _render(template, PROMPT, True, kwargs)
    return THINK_CLOSE in template and not prompt.rstrip().endswith(THINK_CLOSE)


def text_api_problem(template: str, kwargs: dict | None) -> str | None:
    """None if the template renders the probe turns (module docstring) as the target writes them after its
    generation prompt: the rendering of the conversation with the turn starts with the generation prompt and holds
    the turn's reasoning and text after it. Else what fails, naming the probe turn. Raises what the template
    raises (jinja2 TemplateError)."""
    prompt = _render(template, PROMPT, True, kwargs)
    if thinks(template, kwargs):
        probes = [("a finished answer with reasoning", {"reasoning_content": REASONING, "content": ANSWER}),
                  ("an answer cut inside its reasoning", {"reasoning_content": REASONING[:10], "content": ""})]
    else:
        probes = [("a finished answer", {"content": ANSWER}), ("an answer cut short", {"content": ANSWER[:5]})]
    for name, msg in probes:
        full = _render(template, PROMPT + [{"role": "assistant", **msg}], False, kwargs)
        if not full.startswith(prompt):
            return (f"{name}: the rendered turn does not start with the generation prompt (it ends in "
                    f"{prompt[-20:]!r}, the turn renders {full[len(prompt) - 20:][:60]!r})")
        span = full[len(prompt):]
        for part in ("reasoning_content", "content"):
            if msg.get(part) and msg[part] not in span:
                return (f"{name}: the template drops its {part.replace('_content', '')} after the generation "
                        f"prompt (renders {span[:60]!r})")
    return None


def text_api_problems(chat_template: str, kwargs: dict | None) -> list[tuple[str, str]]:
    """[('generation.api', why and the fix)] when the text API cannot train what the target writes under `kwargs`
    (data.text_probe: one turn with reasoning and one cut-off turn through the template), else []."""
    if (why := text_api_problem(chat_template, kwargs)) is None:
        return []
    return [("generation.api", f"'openai' returns text, which the tokenize stage re-renders with the target's chat "
                               f"template, and under chat_template_kwargs {kwargs or {}} the template does not render "
                               f"what the target writes: {why}; every such answer would be refused after the whole "
                               f"generation. Set generation.api 'sglang' (or 'auto' with server.kind 'sglang'): the "
                               f"server's own token ids are trained as they are")]


def target_template(target) -> str | None:
    """The default chat template of `target` (a TargetConfig): its tokenizer's, read like the prompts stage reads
    it; None when it has none."""
    templates = tokenizer_templates(load_tokenizer(target))
    return templates.get("default") or next(iter(templates.values()), None)
