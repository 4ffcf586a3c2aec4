"""Token budgets, measured in the prompts stage before any request is sent.

A train row's length is counted in tokens of the target's chat template, rendered as the generation stage will send
it (the row's tools, `generation.chat_template_kwargs`, the generation prompt; `data.chat.prompt_ids`). A prompt row is
over the budget when prompt tokens + generation.max_new_tokens > features.max_length (the longest answer would not
fit in a training sample); a row kept as it is (mode 'keep') when its whole conversation is longer than
max_length. In turn-by-turn mode the data's earlier answers stand in for the target's, which may be longer: the
tokenize stage's `prompts.overlong` handles what still does not fit.

Policies (`prompts.over_budget`), applied to rows over the budget, counted per source:
  drop        the row is left out of train.parquet: no request is ever sent for it
  last_turns  the earliest turns are dropped (system message kept) until the rest fits; the conversation then
              starts at a user turn. A row whose final user turn alone does not fit is dropped
  long        the row is kept whole and marked (meta.long = true) for long-sample training; features.max_length
              cuts it later (prompts.overlong). A prompt-mode row whose prompt alone has max_length tokens or more
              (no room for one answer token) is dropped: it would only fail the tokenize stage
The prompts stage asks the budget row by row while it fills the train set (RowBudget, prompt_set.build_prompts):
under every policy a row left out is replaced by the next spare row of its source's stable order.
"""
from __future__ import annotations

import json

from jinja2 import TemplateError

from eagle3_core.data.chat import prompt_ids, render_chat

POLICIES = ("drop", "last_turns", "long")


def row_tokens(tokenizer, messages: list[dict], mode: str, tools: list[dict] | None,
               template_kwargs: dict | None) -> int:
    """Tokens of one row as the template renders it: the prompt with the generation prompt (mode 'prompt'), or
    the whole conversation (mode 'keep')."""
    if mode == "keep":
        text = render_chat(tokenizer, messages, add_generation_prompt=False, tools=tools, template_kwargs=template_kwargs)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return len(prompt_ids(tokenizer, messages, tools, template_kwargs))


def _fits(n: int, mode: str, max_new_tokens: int, max_length: int) -> bool:
    return n + (0 if mode == "keep" else max_new_tokens) <= max_length


def last_turns(tokenizer, messages: list[dict], mode: str, tools, template_kwargs, max_new_tokens: int,
               max_length: int) -> tuple[list[dict], int] | None:
    """(the conversation cut to its last turns that fit, its tokens), or None if even the last user turn (with
    what follows it) does not fit. Keeps the system message; the kept part starts at a user turn. Binary search over
    the user turns: fewer turns never render longer."""
    system = [m for m in messages[:1] if m["role"] == "system"]
    starts = [i for i, m in enumerate(messages) if m["role"] == "user" and i > len(system) - 1]
    lo, hi, best = 0, len(starts) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        cut = system + messages[starts[mid]:]
        n = row_tokens(tokenizer, cut, mode, tools, template_kwargs)
        if _fits(n, mode, max_new_tokens, max_length):
            best, hi = (cut, n), mid - 1
        else:
            lo = mid + 1
    return best


def _quantiles(values: list[int]) -> dict:
    if not values:
        return {"rows": 0}
    v = sorted(values)

    def q(p: float) -> int:
        return v[min(len(v) - 1, int(p * len(v)))]
    return {"rows": len(v), "min": v[0], "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": v[-1],
            "mean": round(sum(v) / len(v), 1)}


class RowBudget:
    """The token budget as a function of one train row: `budget(row)` is the row as the policy keeps it (meta gains
    `prompt_tokens`, and `over_budget` where the policy acted) or None (left out). Each row id is measured once and
    its result kept, so that the prompts stage can ask while it fills the train set from each source's stable order
    (prompt_set.build_prompts) and again for the rows it ends with. `stats()`: as apply_budget's.

    Raises ValueError naming the row (`where`, id) if the template cannot render it, and for an unknown policy."""

    def __init__(self, tokenizer, max_new_tokens: int, max_length: int, policy: str,
                 template_kwargs: dict | None = None, where: str = "prompts"):
        if policy not in POLICIES:
            raise ValueError(f"prompts.over_budget {policy!r} is not one of {POLICIES}")
        self.tokenizer, self.policy = tokenizer, policy
        self.max_new_tokens, self.max_length = max_new_tokens, max_length
        self.template_kwargs, self.where = template_kwargs, where
        self.results: dict[str, dict | None] = {}
        self.per: dict[str, dict] = {}
        self.lengths: dict[str, list[int]] = {}

    def __call__(self, r: dict) -> dict | None:
        if r["id"] not in self.results:
            self.results[r["id"]] = self._apply(r)
        return self.results[r["id"]]

    def _apply(self, r: dict) -> dict | None:
        st = self.per.setdefault(r["source"], {"rows": 0, "over": 0, "dropped": 0, "last_turns": 0, "long": 0,
                                               "prompt_over_max_length": 0})
        st["rows"] += 1
        tools = json.loads(r["tools"]) if r.get("tools") else None
        mode, new, limit, kw = r["mode"], self.max_new_tokens, self.max_length, self.template_kwargs
        try:
            n = row_tokens(self.tokenizer, r["messages"], mode, tools, kw)
            meta = {**json.loads(r.get("meta") or "{}"), "prompt_tokens": n}
            self.lengths.setdefault(r["source"], []).append(n)
            if _fits(n, mode, new, limit):
                return {**r, "meta": json.dumps(meta)}
            st["over"] += 1
            if self.policy == "long" and (mode == "keep" or n < limit):
                st["long"] += 1
                return {**r, "meta": json.dumps({**meta, "over_budget": "long", "long": True})}
            if self.policy == "long":              # the prompt alone leaves no room for one answer token: never sent
                st["prompt_over_max_length"] += 1
            elif self.policy == "last_turns" and (cut := last_turns(self.tokenizer, r["messages"], mode, tools, kw,
                                                                     new, limit)):
                st["last_turns"] += 1
                return {**r, "messages": cut[0], "meta": json.dumps(
                    {**meta, "over_budget": "last_turns", "messages_dropped": len(r["messages"]) - len(cut[0]),
                     "tokens_after_cut": cut[1]})}
            st["dropped"] += 1
            return None
        except (TemplateError, ValueError) as e:
            raise ValueError(f"{self.where}: row {r['id']} (source {r['source']}): the target's chat template cannot "
                             f"render it for the token budget ({type(e).__name__}: {e}); fix or drop the row "
                             f"(e.g. the source's max_chars)") from e

    def stats(self) -> dict:
        """{policy, max_length, max_new_tokens, per_source: {source: {rows (measured), over, dropped, last_turns,
        long, prompt_over_max_length, tokens: {rows, min, p50, p90, p99, max, mean}}}}."""
        per = {source: {**st, "tokens": _quantiles(self.lengths.get(source, []))} for source, st in self.per.items()}
        return {"policy": self.policy, "max_length": self.max_length, "max_new_tokens": self.max_new_tokens,
                "per_source": per}


def apply_budget(tokenizer, rows: list[dict], max_new_tokens: int, max_length: int, policy: str,
                 template_kwargs: dict | None = None, where: str = "prompts") -> tuple[list[dict], dict]:
    """(rows left after the policy, stats) for train rows ({id, source, messages, mode, tools, meta}).

    Each row's meta gains `prompt_tokens` (its measured tokens, before any cut) and, where the policy acted,
    `over_budget` ('last_turns' or 'long'). stats: {policy, max_length, max_new_tokens, per_source: {source:
    {rows, over, dropped, last_turns, long, prompt_over_max_length, tokens: {rows, min, p50, p90, p99, max,
    mean}}}} (token counts measured before the policy; 'over' counts rows over the budget; under 'long' a
    prompt-mode row whose prompt alone fills max_length is dropped and counted in 'prompt_over_max_length' and
    'dropped'). Raises ValueError naming the row (`where`, id) if the template cannot render it, and for an
    unknown policy."""
    budget = RowBudget(tokenizer, max_new_tokens, max_length, policy, template_kwargs, where)
    kept = [k for r in rows if (k := budget(r)) is not None]
    return kept, budget.stats()


def budget_line(stats: dict) -> str:
    """One log line: per source, token quantiles and what the policy did."""
    parts = []
    for source, st in stats["per_source"].items():
        t = st["tokens"]
        q = f"p50 {t['p50']}, p90 {t['p90']}, max {t['max']}" if t["rows"] else "no rows"
        parts.append(f"{source}: {st['rows']} rows ({q} tokens), {st['over']} over the budget, {st['dropped']} "
                     f"dropped, {st['last_turns']} cut to their last turns, {st['long']} kept long"
                     + (f", {st['prompt_over_max_length']} with a prompt alone of max_length or more"
                        if st.get("prompt_over_max_length") else ""))
    return (f"prompts: token budget features.max_length {stats['max_length']} >= prompt + generation.max_new_tokens "
            f"{stats['max_new_tokens']} (policy {stats['policy']!r}); " + "; ".join(parts))


def server_context(cfg, target_context: int | None) -> tuple[int | None, str]:
    """(context length in tokens of the server that regenerates, or None where unknown, where it comes from): SGLang
    started by the stage: `--context-length` in server.extra_args (sglang 0.5.14 srt/server_args.py; default: the
    model's context, `target_context`); llama.cpp: server.ctx_per_slot (each slot's share of `-c`); in process
    ('transformers'): the target's context; an external server: unknown."""
    s = cfg.server
    if s.kind == "sglang":
        args = list(s.extra_args)
        for i, a in enumerate(args):
            if a == "--context-length" and i + 1 < len(args):
                return int(args[i + 1]), "server.extra_args --context-length"
            if a.startswith("--context-length="):
                return int(a.split("=", 1)[1]), "server.extra_args --context-length"
        return target_context, "SGLang's default: the target's context (no --context-length in server.extra_args)"
    if s.kind == "llama.cpp":
        return s.ctx_per_slot, "server.ctx_per_slot"
    if s.kind == "transformers":
        return target_context, "the target's context (in process)"
    return None, "an external server: its context is not known here"


def budget_problems(cfg, target_context: int | None = None) -> tuple[dict, list[tuple[str, str]]]:
    """(facts, problems) of a run's token budget, from its config alone (`check`). A prompt-mode row is trained
    when prompt + generation.max_new_tokens <= features.max_length; refused: a max_new_tokens that leaves no room
    for a prompt (every prompt-mode row would be over the budget), and a server context that does not exceed the
    longest request the budget lets through (prompt + max_new_tokens up to max_length; under over_budget 'long'
    max_length - 1 + max_new_tokens): a llama.cpp slot holds that many tokens; SGLang refuses a request whose
    input plus the tokens it reserves plus max_new_tokens exceed its context length, and any input of the context
    length or more (python/sglang/srt/managers/tokenizer_manager.py, `_validate_one_request`), so there the
    context must exceed it. Runs whose sources are all kept as they are (mode 'keep') send no request: nothing to
    check."""
    p, g, f = cfg.prompts, cfg.generation, cfg.features
    modes = [s.mode for s in p.mix.sources] if p.mix is not None else ["prompt"]
    ctx, where = server_context(cfg, target_context)
    facts = {"prompt_mode_sources": "prompt" in modes, "policy": p.over_budget, "max_new_tokens": g.max_new_tokens,
             "features.max_length": f.max_length, "room_for_the_prompt": f.max_length - g.max_new_tokens,
             "server_context": ctx if ctx is not None else "not known", "server_context_from": where}
    if "prompt" not in modes:
        return facts, []
    problems = []
    if g.max_new_tokens >= f.max_length:
        problems.append(("generation.max_new_tokens", (
            f"{g.max_new_tokens} leaves no room for a prompt in features.max_length {f.max_length}: a prompt-mode row "
            f"is trained when prompt + max_new_tokens <= max_length, so every one would be over the budget "
            f"(prompts.over_budget {p.over_budget!r}); raise features.max_length to max_new_tokens plus the "
            f"prompts' length (the prompts stage logs their tokens) or lower max_new_tokens")))
    if ctx is None:
        return facts, problems
    longest = f.max_length - 1 + g.max_new_tokens if p.over_budget == "long" else f.max_length
    field = "server.ctx_per_slot" if cfg.server.kind == "llama.cpp" else "server.extra_args"
    need = longest + (cfg.server.kind == "sglang")
    if ctx <= g.max_new_tokens:
        problems.append((field, f"the server's context {ctx} ({where}) is not above generation.max_new_tokens "
                                f"{g.max_new_tokens}: no prompt fits beside the answer; raise it to {need}"))
    elif ctx < need:
        problems.append((field, f"the server's context {ctx} ({where}) is below {need}: the longest "
                                f"request (prompt + max_new_tokens) the token budget lets through (features."
                                f"max_length {f.max_length}"
                                + (f" - 1 + max_new_tokens {g.max_new_tokens} under over_budget 'long'"
                                   if p.over_budget == "long" else "")
                                + f") is {longest} tokens, and the server would refuse or cut it; raise the context to "
                                f"{need} or lower features.max_length"))
    return facts, problems
