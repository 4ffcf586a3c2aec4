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


def _same_setting(a: dict, b: dict) -> bool:
    return all(float(a.get(k, d)) == float(b.get(k, d)) for k, d in (("temperature", 0.0), ("top_p", 1.0),
                                                                      ("top_k", 0)))


def tau_by_temperature(ev: dict, llama_cpp: dict | None = None) -> list[dict]:
    """The trained draft's tau at each setting the run measured (the evaluate stage's summary `ev`: eval.sampling,
    then `at_serving`; the llama.cpp deployment's summary: `by_sampling`, or its one greedy measurement before
    that), one row per setting: {temperature, top_p, top_k, greedy_draft, sampled, llama_cpp}, each tau a
    (tau, [lo, hi]) pair or None. greedy_draft is the offline tau under llama.cpp's rule (the draft's argmax
    accepted when the target samples it; at temperature 0 the greedy tau), sampled under min(1, q/p)."""
    sides = [(ev.get("sampling") or EVAL_SAMPLING, ev["trained"])]
    if ev.get("at_serving"):
        sides.append((ev["at_serving"]["sampling"], ev["at_serving"]["trained"]))
    engine = (llama_cpp or {}).get("by_sampling") or ([{**llama_cpp, "sampling": EVAL_SAMPLING}] if llama_cpp
                                                      else [])
    rows = []
    for s, tr in sides:
        pair = lambda d: (d["tau"], d["tau_ci95"]) if d else None                      # noqa: E731
        rules = tr.get("rules") or {"greedy_draft": tr}
        lc = next((b for b in engine if _same_setting(b["sampling"], s)), None)
        rows.append({"temperature": float(s.get("temperature", 0.0)), "top_p": float(s.get("top_p", 1.0)),
                     "top_k": int(s.get("top_k", 0)), "greedy_draft": pair(rules.get("greedy_draft")),
                     "sampled": pair(rules.get("sampled")), "llama_cpp": pair(lc)})
    return rows


def tau_by_temperature_markdown(ev: dict, llama_cpp: dict | None = None) -> list[str]:
    """The report's table of tau_by_temperature (no lines when the run measured greedily only)."""
    rows = tau_by_temperature(ev, llama_cpp)
    if all(r["temperature"] == 0.0 for r in rows):
        return []
    cell = lambda p: f"{p[0]:.2f} ({p[1][0]:.2f}-{p[1][1]:.2f})" if p else "-"         # noqa: E731
    lines = ["", "## tau by temperature (trained draft, 95% CI)", "",
             "| temperature | top_p | top_k | offline, greedy draft (llama.cpp's rule) | offline, sampled draft "
             "(min(1, p/q)) | llama.cpp |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['temperature']:g} | {r['top_p']:g} | {r['top_k'] or 'off'} | {cell(r['greedy_draft'])} | "
              f"{cell(r['sampled'])} | {cell(r['llama_cpp'])} |" for r in rows]
    return lines + ["", "At temperature 0 both rules give the greedy tau. llama.cpp drafts the draft's argmax and "
                    "accepts it when the target's sample equals it: compare its tau with the greedy-draft column. "
                    "SGLang's tau at temperature > 0 is not measured here (its benchmark sends the settings; no GPU)."]
