"""Sampling settings of one run side by side: how the target regenerated the training answers (the generations
manifest), how the evaluation measured (the eval manifest) and how the target is served (eval.serving, declared),
and what differs between them: a draft trained on answers sampled otherwise learns another distribution than the
one it is measured on, and a tau measured at other settings than the served ones is not the served tau."""
from __future__ import annotations


# evaluation decoded greedily before eval.sampling (evaluate.measure, llama.cpp deployment): what an older eval
# manifest that says nothing measured at
EVAL_SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "greedy": True, "chat_template_kwargs": {}}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "thinking")


def _thinking(kwargs: dict | None) -> str:
    """The thinking mode of chat-template arguments: e.g. 'enable_thinking=False', or 'template default'."""
    keys = [k for k in (kwargs or {}) if "think" in k.lower()]
    return ", ".join(f"{k}={kwargs[k]}" for k in keys) or "template default"


def _differ(a: dict, b: dict) -> list[str]:
    """What differs between two sides of compare_sampling: 'greedy vs sampled' first, then each field."""
    fields = [k for k in SAMPLING_FIELDS if a[k] != b[k]]
    return (["greedy vs sampled"] if (a["temperature"] == 0.0) != (b["temperature"] == 0.0) else []) + fields


def compare_sampling(regen: dict | None, evaluation: dict | None, serving: dict | None = None) -> dict:
    """Regeneration's sampling (generations manifest) beside evaluation's (eval manifest; greedy when it says
    nothing) and the declared serving settings (eval.serving, in the eval manifest; None: not declared):
    {'regeneration': {temperature, top_p, top_k, thinking}, 'evaluation': {...}, 'serving': {...} (when declared),
    'mismatch': [what regeneration and evaluation differ in], 'serving_mismatch': [what evaluation and serving
    differ in]}. A draft trained on sampled answers and measured greedily (or the reverse) learns another
    distribution than the one it is measured on (SpecForge issue 465); so does one trained in another thinking
    mode; and a tau measured at other settings than the served ones is not the served tau (issue: acceptance
    falls with temperature for engines that draft greedily, vLLM PR 16899). Serving's thinking mode is the
    evaluation's (the template arguments are the run's)."""
    sides = {}
    named = (("regeneration", regen or {}), ("evaluation", evaluation or EVAL_SAMPLING))
    for name, s in named + ((("serving", {**serving, "chat_template_kwargs": (evaluation or {}).get(
            "chat_template_kwargs")}),) if serving else ()):
        sides[name] = {"temperature": float(s.get("temperature", 0.0)), "top_p": float(s.get("top_p", 1.0)),
                       "top_k": int(s.get("top_k", 0)), "thinking": _thinking(s.get("chat_template_kwargs"))}
    return {**sides, "mismatch": _differ(sides["regeneration"], sides["evaluation"]),
            "serving_mismatch": _differ(sides["evaluation"], sides["serving"]) if serving else []}
