"""Stage `tokenize`: each regenerated conversation tokenized with the target's chat template, with the loss mask
over the assistant tokens it trains on (tokenized/train.parquet, rejects.jsonl)."""
from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq
from jinja2 import TemplateError

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.layout import RunLayout
from eagle3_core.data import prompt_set as prompts_mod
from eagle3_core.data.history import RoundTripError
from eagle3_core.data.markers import target_markers
from eagle3_core.data.rejects import finish_rejects
from eagle3_core.data.samples import check_server_ids, row_samples
from eagle3_core.data.tool_calls import check_generation_tool_calls
from eagle3_core.pipeline import run as stage_run
from eagle3_core.pipeline.keys import stage_key, target_key, upstream_keys, upstream_manifest
from eagle3_core.pipeline.stage import Stage
from eagle3_core.target.loading import generation_eos_ids, load_tokenizer


def tokenize_key(cfg: PipelineConfig, up: dict | None = None) -> str:
    """Inputs key of the tokenize stage: the generations (`up`: {'generation': its key}; default: read from its
    manifest), the max length and overlong policy, the target (its chat template), and the history rule where it
    changed the samples (history_rule)."""
    up = upstream_keys(cfg, ROW) if up is None else up
    return stage_key(up["generation"], cfg.features.max_length, cfg.prompts.overlong, target_key(cfg),
                     *history_rule(cfg))


def history_rule(cfg: PipelineConfig) -> list[dict]:
    """[the rule's name] for runs whose samples the history rule of eagle3_core.data.history changed (turn by turn,
    rows kept as they are, a source's kept choice), else []: a final-turn row trains the tokens it trained before,
    so such runs keep their key and their features."""
    specs = cfg.prompts.mix.sources if cfg.prompts.mix is not None else []
    if cfg.generation.turns == "all" or any(s.mode == "keep" or s.kept not in ("train", "auto")
                                                for s in specs):
        return [{"history": "turns merged while the template keeps history, round trip checked"}]
    return []


def run_tokenize(cfg: PipelineConfig, log=print) -> dict:
    """Tokenize each conversation with the target's chat template (tools and generation.chat_template_kwargs as the
    requests had them); loss mask over assistant tokens: the regenerated final turn of prompt rows (the server's own
    ids where a token-id API returned them), every regenerated turn of turn-by-turn rows, every assistant turn of
    rows kept as they are (tokenize_rows.row_samples). A row whose tool calls cannot be trained (a function its tools
    do not declare, arguments that are no complete JSON object: data.tool_calls) is rejected with the reason.
    Samples longer than features.max_length are cut or dropped (prompts.overlong), counted in the manifest, with the
    token source and a sample check of the server's ids. Raises ValueError when every sample is dropped, RejectError
    (data.rejects.finish_rejects) when a source rejects more than prompts.max_reject_frac of its rows."""
    up = upstream_manifest(cfg.run_dir, "generation")
    return stage_run.run(stage_run.decision(cfg, ROW), lambda: _tokenize_generations(cfg, up, log), log=log)


@dataclass
class _Tally:
    """What tokenizing the generation shards gathers: the samples' rows {id, input_ids, loss_mask, source}, samples
    cut at max_length, ids of rows whose samples were all dropped, rejects {source, file, row, id, reason}, per
    source {read, rejected, refused}, token sources {name: rows}, up to 16 rows with the server's ids (for
    samples.check_server_ids), reject causes per source {source: {cause: rows}}."""
    rows: list = field(default_factory=list)
    n_cut: int = 0
    dropped: list = field(default_factory=list)
    rejects: list = field(default_factory=list)
    per: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)
    id_rows: list = field(default_factory=list)
    causes: dict = field(default_factory=dict)


def _tokenize_generations(cfg: PipelineConfig, up: dict, log) -> dict:
    """The tokenize stage's body (run_tokenize) over the generation manifest `up`: every shard's rows tokenized,
    rejects written (finish_rejects), tokenized/train.parquet written; returns the manifest's fields."""
    run = RunLayout(cfg.run_dir)
    out = run.tokenized
    tok = load_tokenizer(cfg.target)
    markers = target_markers(tok, generation_eos_ids(cfg.target))          # every stop id ends a turn
    kwargs = cfg.generation.chat_template_kwargs or None
    t = _Tally()
    for shard in up["shards"]:
        for index, r in enumerate(prompts_mod.read_rows(run.generations / shard)):
            _tokenize_row(cfg, tok, markers, kwargs, t, r, f"generations/{shard}", index)
    finish_rejects(out / "rejects.jsonl", t.rejects, t.per, cfg.prompts.max_reject_frac)
    if not t.rows:
        raise ValueError(f"tokenize: every sample is longer than features.max_length {cfg.features.max_length} "
                         f"and prompts.overlong is 'drop'; raise max_length or use 'truncate'")
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(t.rows), run.tokenized_train)
    n_tok, n_loss = sum(len(r["input_ids"]) for r in t.rows), sum(sum(r["loss_mask"]) for r in t.rows)
    check = check_server_ids(tok, t.id_rows, kwargs)
    log(f"tokenize: {len(t.rows)} samples, {n_tok} tokens, {n_loss} in the loss mask; over max_length "
        f"{cfg.features.max_length}: {t.n_cut} cut, {len(t.dropped)} dropped; {len(t.rejects)} rejected "
        f"({out / 'rejects.jsonl'}); token source: {t.sources}"
        + (f"; server ids equal to the re-tokenized text in {check['equal']} of {check['checked']} checked rows"
           if check["checked"] else ""))
    return _tokenize_manifest(cfg, run, t, markers, n_tok, n_loss, check)


def _tokenize_row(cfg: PipelineConfig, tok, markers, kwargs, t: _Tally, r: dict, file: str, index: int) -> None:
    """Generation row `r` (row `index` of `file`) tokenized into `t`: its samples, or its reject with the cause,
    its kept choice 'refuse' counted, its server ids kept for the check, a row whose samples were all dropped
    named."""
    st = t.per.setdefault(r.get("source") or "?", {"read": 0, "rejected": 0})
    st["read"] += 1
    try:
        check_generation_tool_calls(r)
        samples, source = row_samples(tok, r, cfg.features.max_length, cfg.prompts.overlong, kwargs,
                                      markers=markers)
    except (ValueError, TemplateError) as e:   # MaskError, RoundTripError, ToolCallError, template refusal
        st["rejected"] += 1
        cause = e.cause if isinstance(e, RoundTripError) else type(e).__name__
        t.causes.setdefault(r.get("source") or "?", {}).setdefault(cause, 0)
        t.causes[r.get("source") or "?"][cause] += 1
        t.rejects.append({"source": r.get("source") or "?", "file": file, "row": index,
                          "id": r["id"], "reason": f"{type(e).__name__}: {e}"})
        return
    t.sources[source] = t.sources.get(source, 0) + 1
    if source == "refused":                  # the source's kept choice 'refuse' (SourceSpec.kept)
        st["refused"] = st.get("refused", 0) + 1
        return
    if source == "server" and len(t.id_rows) < 16:
        t.id_rows.append(r)
    if not samples:
        t.dropped.append(r["id"])
        return
    t.n_cut += sum(s["cut"] for s in samples)
    t.rows += [{"id": s["id"], "input_ids": s["input_ids"], "loss_mask": s["loss_mask"],
                "source": r.get("source") or "?"} for s in samples]


def _tokenize_manifest(cfg: PipelineConfig, run: RunLayout, t: _Tally, markers, n_tok: int, n_loss: int,
                       check: dict) -> dict:
    """The tokenize manifest's fields: counts, the overlong policy's cuts and drops, rejects per source and cause,
    the token source."""
    return {
        "samples": len(t.rows), "tokens": n_tok, "loss_tokens": n_loss,
        "overlong": {"policy": cfg.prompts.overlong, "max_length": cfg.features.max_length, "cut": t.n_cut,
                     "dropped": len(t.dropped), "dropped_ids": t.dropped[:100]},
        "rejected": len(t.rejects), "rejected_per_source": {k: v["rejected"] for k, v in t.per.items()},
        "rejected_causes": t.causes, "rows": sum(v["read"] for v in t.per.values()) - len(t.rejects),
        "kept_refused": {k: v["refused"] for k, v in t.per.items() if v.get("refused")},
        "marker_tokens": markers.texts,
        "rejects": run.relative(run.tokenized / "rejects.jsonl"),
        "token_source": ("the server's own ids (prompt_ids + output_ids) for the regenerated turns of a "
                         "token-id API; the others re-tokenized with the target's chat template"
                         if any("server" in k for k in t.sources)
                         else "re-tokenized with the target's chat template (the OpenAI API returns text, not "
                         "ids)"),
        "token_sources": t.sources, "server_ids_check": check}


ROW = Stage("tokenize", tokenize_key, run_tokenize, upstream=("generation",), outputs=("train.parquet",), timeout_h=12)
