"""Stage `prompts`: the prompt sources read, checked, deduplicated, split and fitted to the token budget
(prompts/{train,eval}.parquet, rejects.jsonl)."""
from __future__ import annotations

import json

from jinja2 import TemplateError

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.compat import prompt_fields_v4
from eagle3_core.contract.layout import RunLayout
from eagle3_core.contract.manifest import read_manifest
from eagle3_core.data import prompt_set as prompts_mod
from eagle3_core.data.budget import RowBudget, budget_line
from eagle3_core.data.chat import MaskError, renders_tools
from eagle3_core.data.held_out import digests_from_files, eval_set_digest
from eagle3_core.data.markers import target_markers
from eagle3_core.data.samples import row_samples
from eagle3_core.data.template_kwargs import check_tokenizer_kwargs
from eagle3_core.generation.turns import unanswered_turns
from eagle3_core.pipeline import run as stage_run
from eagle3_core.pipeline.keys import stage_key, target_key
from eagle3_core.pipeline.stage import Stage
from eagle3_core.target.loading import load_tokenizer


# the prompt settings that change the rows or the stage's verdict (max_reject_frac); overlong, the tokenize stage's,
# stays out
PROMPT_RESULT_FIELDS = ("sources", "mix", "num_train", "num_eval", "eval_ids", "seed", "max_reject_frac",
                        "over_budget")


def prompts_key(cfg: PipelineConfig, up: dict | None = None) -> str:
    """Inputs key of the prompts stage (no upstream stage: `up` unused): the prompt settings that change the rows
    or the stage's verdict (PROMPT_RESULT_FIELDS; eval_ids only when set), what makes each source's rows what they are
    (prompts.source_fingerprints: local files' sha256, Hugging Face data sets' name/split/revision) and what the
    token budget depends on (the target's template, max_length, max_new_tokens, chat-template arguments)."""
    fields = [f for f in PROMPT_RESULT_FIELDS if f != "eval_ids" or cfg.prompts.eval_ids is not None]
    return _prompts_key(cfg, cfg.prompts.model_dump(mode="json", include=set(fields)))


def prompts_older_keys(cfg: PipelineConfig, up: dict | None = None) -> tuple[str, ...]:
    """The key a prompts stage finished before the keys hashed results only holds (compat.prompt_fields_v4).
    Remove when runs written before f66665b are no longer supported: their prompts stage (and all below) then runs
    again (compat.LEGACY_READERS)."""
    return (_prompts_key(cfg, prompt_fields_v4(cfg.prompts)),)


def _prompts_key(cfg: PipelineConfig, prompt_fields: dict) -> str:
    g = cfg.generation
    for s in (prompt_fields.get("mix") or {}).get("sources", []):     # the defaults: the key of runs before them
        if s.get("kept") in ("train", "auto"):      # 'auto' is told apart by the manifest's kept_routes (routes_stale)
            del s["kept"]
    return stage_key(prompt_fields, prompts_mod.source_fingerprints(cfg.prompts), target_key(cfg),
                     {"max_length": cfg.features.max_length, "max_new_tokens": g.max_new_tokens,
                      "chat_template_kwargs": g.chat_template_kwargs})


def kept_probe(tokenizer, template_kwargs: dict | None):
    """probe(row) -> None | (cause, reason) for data.samples.route_kept: None where every assistant turn of the
    kept row trains on the text path as the target's template renders it with `template_kwargs` (samples.row_samples:
    the round trip, an empty think block where the target thinks), else the cause (history.CAUSES, 'template' for a
    template error or a row it cannot train) and the refusal's message."""
    markers = target_markers(tokenizer)

    def probe(row: dict) -> tuple[str, str] | None:
        try:
            row_samples(tokenizer, row, 10**9, "truncate", template_kwargs, use_server_ids=False, markers=markers)
        except (MaskError, TemplateError) as e:
            return getattr(e, "cause", "template"), str(e)
        return None
    return probe


def routes_stale(cfg: PipelineConfig, manifest: dict) -> list[str]:
    """['kept_routes'] when a finished prompts manifest does not hold a route for exactly the mode 'keep' sources
    whose kept choice is 'auto' (written before kept sources were probed, or for kept 'train', whose key is the
    same): the stage runs again; else [].
    Remove the missing-routes case when runs written before d264da2 are no longer supported
    (compat.LEGACY_READERS)."""
    auto = sorted(s.label for s in prompts_mod.source_specs(cfg.prompts) if s.mode == "keep" and s.kept == "auto")
    routes = manifest.get("kept_routes")
    if (routes is None and auto) or (routes is not None and sorted(routes) != auto):
        return ["kept_routes"]
    return []


def run_prompts(cfg: PipelineConfig, log=print) -> dict:
    """Read, normalize, reject, dedupe, sample and split the prompt sources into prompts/{train,eval}.parquet;
    bad rows go to prompts/rejects.jsonl with source, row and reason. generation.chat_template_kwargs are checked
    against the target's chat template first (data.template_kwargs). Every train row is measured with the template
    and the token budget applied as the train set is filled (prompts.over_budget; eagle3_core.data.budget: a row
    left out is replaced by a spare row of its source): the length distribution and the policy's counts per source
    are logged and kept in the manifest (`budget`), and so are the user turns generation.turns will not answer, per
    source with the reason (`stats.unanswered_turns`). A mode 'keep' source with kept 'auto' has its first row
    rendered with the template first (kept_probe): its rows are kept, or re-routed to regeneration where the
    template would not train them as the target writes them; logged with the reason and kept in the manifest
    (`kept_routes`: source -> {route, probed_row, cause, reason}). Raises ValueError when no train row fits the
    token budget."""
    return stage_run.run(stage_run.decision(cfg, ROW), lambda: _build_prompt_files(cfg, log), log=log)


def _build_prompt_files(cfg: PipelineConfig, log) -> dict:
    """The prompts stage's body (run_prompts): the rows built under the token budget, checked, written and logged;
    returns the manifest's fields."""
    run, g = RunLayout(cfg.run_dir), cfg.generation
    run.prompts.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(cfg.target)
    check_tokenizer_kwargs(tok, g.chat_template_kwargs)          # before anything is rendered with them
    earlier = prompts_mod.earlier_prompts(read_manifest(run.prompts / "manifest.json"), cfg.prompts)
    if earlier is not None:                  # a manifest from before digests were kept: its files have them
        earlier = digests_from_files(earlier, run.prompts_eval, run.prompts_train)
    budget = RowBudget(tok, g.max_new_tokens, cfg.features.max_length, cfg.prompts.over_budget,
                       g.chat_template_kwargs or None, str(run.prompts_train))
    train, evals, stats = prompts_mod.build_prompts(cfg.prompts, rejects_path=run.prompts / "rejects.jsonl",
                                                    earlier=earlier, budget=budget,
                                                    probe=kept_probe(tok, g.chat_template_kwargs or None))
    routes = _kept_routes(stats, log)
    digest = stats.pop("content_digests")        # of the rows as the sources hold them, before the budget trims
    budget = budget.stats()
    log(budget_line(budget) + (f"; the train set is {stats['train_short']} short of prompts.num_train: no spare "
                               f"rows of those sources fit" if stats["train_short"] else ""))
    stats["unanswered_turns"] = _unanswered(train, g, log)
    stats["tools_not_rendered"] = _tools_not_rendered(tok, train, g.chat_template_kwargs or None, log)
    _check_train_left(cfg, train)
    _count_train(stats, train)
    evals = _write_prompt_rows(run, train, evals)
    _log_prompt_counts(run.prompts, train, evals, stats, earlier, log)
    return _prompts_manifest(cfg, run, stats, budget, train, evals, digest, routes)


def _kept_routes(stats: dict, log) -> dict:
    """{source: kept_route} taken out of stats['per_source'] (the kept 'auto' sources probed: route_kept), each
    logged with its route and reason."""
    routes = {k: v.pop("kept_route") for k, v in stats["per_source"].items() if "kept_route" in v}
    for source, route in routes.items():
        log(f"prompts: kept source {source}: its rows are trained as kept (row {route['probed_row']} renders as "
            f"the target writes it)" if route["route"] == "train" else f"prompts: kept source {source}: its rows "
            f"are regenerated by the target (kept 'auto'): {route['reason']}")
    return routes


def _unanswered(train: list[dict], g, log) -> dict:
    """generation.turns.unanswered_turns of the train rows under generation config `g`, logged per source."""
    unanswered = unanswered_turns(train, g.turns, g.max_turns)
    for source, u in unanswered.items():
        log(f"prompts: source {source}: {u['turns']} user turn(s) of {u['rows']} row(s) will not be answered: "
            f"{u['reason']}")
    return unanswered


def _tools_not_rendered(tok, train: list[dict], template_kwargs: dict | None, log) -> dict:
    """{source: {rows, probed_row}} for each source whose train rows carry tool schemas that the target's chat template
    does not show (data.chat.renders_tools on the source's first such row), each logged as a warning: the target
    answers those prompts without seeing the functions, so the draft learns no tool calls from them."""
    first: dict[str, dict] = {}
    rows: dict[str, int] = {}
    for r in train:
        if r.get("tools"):
            first.setdefault(r["source"], r)
            rows[r["source"]] = rows.get(r["source"], 0) + 1
    out = {}
    for source, r in first.items():
        msgs = json.loads(r["messages"]) if isinstance(r["messages"], str) else r["messages"]
        tools = json.loads(r["tools"]) if isinstance(r["tools"], str) else r["tools"]
        if not renders_tools(tok, msgs, tools, template_kwargs):
            out[source] = {"rows": rows[source], "probed_row": r["id"]}
            log(f"prompts: WARNING source {source}: {rows[source]} train rows carry tool schemas, but the target's "
                f"chat template does not render `tools` (row {r['id']} renders the same without them): the target "
                f"answers them without seeing the functions. Use a target whose template takes tools, or give the "
                f"schemas in the system message")
    return out


def _check_train_left(cfg: PipelineConfig, train: list[dict]) -> None:
    """Raise ValueError when the token budget left no train row."""
    g = cfg.generation
    if not train:
        raise ValueError(f"prompts: every train row is over the token budget (prompt + generation.max_new_tokens "
                         f"{g.max_new_tokens} > features.max_length {cfg.features.max_length}) and "
                         f"prompts.over_budget is {cfg.prompts.over_budget!r}: raise max_length, lower "
                         f"max_new_tokens or choose 'last_turns' / 'long'")


def _count_train(stats: dict, train: list[dict]) -> None:
    """stats['train'] and each source's 'train' count set to the rows kept after the budget (in place)."""
    stats["train"] = len(train)
    for st in stats["per_source"].values():
        st.pop("train", None)
    for r in train:
        st = stats["per_source"][r["source"]]
        st["train"] = st.get("train", 0) + 1


def _write_prompt_rows(run: RunLayout, train: list[dict], evals: list[dict]) -> list[dict]:
    """prompts/train.parquet (each row with its prompt_sha256) and prompts/eval.parquet written; returns the
    held-out rows as written."""
    prompts_mod.write_rows(run.prompts_train, [{**r, "prompt_sha256": prompts_mod.prompt_digest(r)} for r in train])
    # held-out rows are prompts: a kept conversation's final assistant turn is what the target must produce
    evals = [{**r, "messages": r["messages"][:-1]}
             if r["messages"] and r["messages"][-1].get("role") == "assistant" else r for r in evals]
    prompts_mod.write_rows(run.prompts_eval, evals)
    return evals


def _log_prompt_counts(out, train: list[dict], evals: list[dict], stats: dict, earlier: dict | None, log) -> None:
    """The stage's summary lines: how a grown run kept the earlier one's rows, then the counts per source."""
    kept = sum(r["mode"] == "keep" for r in train)
    if earlier:
        log(f"prompts: grown from the earlier run in {out}: {stats['train_from_earlier']} of its "
            f"{len(earlier['train_ids'])} train prompts kept first, in their order, "
            f"{len(train) - stats['train_from_earlier']} new; held-out set {stats['eval_chosen']}")
        for lost in stats["eval_lost"]:
            log(f"prompts: WARNING earlier held-out prompt {lost['id']}: {lost['why']}")
    log(f"prompts: {len(train)} train ({kept} with responses kept), {len(evals)} held-out, {stats['rejected']} "
        f"rejected, {stats['duplicates_dropped']} duplicates; per source: "
        + ", ".join(f"{k} {v.get('train', 0)}+{v.get('eval', 0)}" for k, v in stats["per_source"].items()))


def _prompts_manifest(cfg: PipelineConfig, run: RunLayout, stats: dict, budget: dict, train: list[dict],
                      evals: list[dict], digest: dict, routes: dict) -> dict:
    """The prompts manifest's fields (`digest`: {row id: held_out.content_digest})."""
    specs = prompts_mod.source_specs(cfg.prompts)
    return {"stats": stats, "budget": budget, "seed": cfg.prompts.seed, "train_ids": [r["id"] for r in train],
            "eval_ids": [r["id"] for r in evals],
            # what each row asks (held_out.content_digest): a later run finds them again by content
            "train_digests": [digest[r["id"]] for r in train], "eval_digests": [digest[r["id"]] for r in evals],
            "eval_set": eval_set_digest([digest[r["id"]] for r in evals]),
            "sources": [s.model_dump(exclude_defaults=True) for s in specs],
            "unpinned": [s.label for s in specs if s.hf and not s.revision and s.hf not in ("json", "parquet")],
            "rejects": run.relative(run.prompts / "rejects.jsonl"), "kept_routes": routes}


def prompts_intact(cfg: PipelineConfig):
    """The prompts stage's check beyond its files (stage_run.decide): kept sources routed as they still are
    (routes_stale)."""
    return lambda manifest: routes_stale(cfg, manifest)


ROW = Stage("prompts", prompts_key, run_prompts, older=prompts_older_keys, intact=prompts_intact,
            outputs=("train.parquet", "eval.parquet"), summary=("train_ids", "eval_ids"), timeout_h=2)
