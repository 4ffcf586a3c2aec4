"""A night's work: the scheduled run reads its prompt sources, takes up to prompts.num_train of their usable rows
(a night grows the run only as far as the config asks), regenerates and extracts only the rows it has not seen (the
run grows: prompts.build_prompts keeps the earlier rows and the held-out set of the first night, the shard plans
keep every finished shard), warm-starts from the current draft, and promotes tonight's export only if its tau on the
(frozen) held-out prompts is higher than the promoted one's. A run that finished before its first night continues:
its evaluated draft is night 0, the draft to beat.

In the run directory:
  nights.json          one record per night: prompts, new prompts, answers generated, tau and its 95% interval,
                       the draft it started from, whether it was promoted
  nights/night_NNN/    the draft each night started from (a copy of the export of the night before)
  promoted/            the export that passed: the draft to serve (draft/export holds the last night's candidate)
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.layout import RunLayout
from eagle3_core.contract.manifest import read_manifest, shard_records, write_manifest
from eagle3_core.data.prompt_set import available_prompts
from eagle3_core.pipeline.prompts_stage import prompts_key, prompts_older_keys


def nights_path(run_dir: Path) -> Path:
    return RunLayout(run_dir).nights


def history(run_dir: Path) -> list[dict]:
    """The records of earlier nights (nights.json), oldest first; [] before the first."""
    return (read_manifest(nights_path(run_dir)) or {}).get("nights", [])


def _copy_dir(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.replace(dst)


def _finished_run_record(run: Path) -> dict | None:
    """A run finished before its first night (an export and its evaluation, no nights.json) as night 0's record,
    its export copied to promoted/: the draft a night must beat. None if the run has no evaluated export."""
    ev, prompts = read_manifest(run / "eval" / "manifest.json"), read_manifest(run / "prompts" / "manifest.json")
    if not (run / "draft" / "export" / "config.json").exists() or not ev or not prompts:
        return None
    tau = ev["summary"]["trained"]
    _copy_dir(run / "draft" / "export", run / "promoted")
    n = len(prompts["train_ids"])
    return {"night": 0, "num_train": n, "new_prompts": n, "generated": 0, "tau": tau["tau"],
            "tau_ci95": tau["tau_ci95"], "init_from": None, "new": True, "promoted": True, "promoted_night": 0,
            "before_nights": True, "eval_set": prompts.get("eval_set")}


def plan_night(cfg: PipelineConfig, log=print) -> tuple[PipelineConfig, dict]:
    """(tonight's config, the night's plan), logged as one line saying what the night will do.

    Tonight's config keeps the config's prompts.num_train (a night grows the run only as far as the config asks:
    raise num_train, or set it above what the sources hold to take every new row they gain), capped at the usable
    prompts of the sources less num_eval (a mix with fixed counts keeps its counts). A run finished before its first
    night continues: its evaluated export becomes night 0 (promoted/, the draft a night must beat). From then on a
    night warm-starts (train.init_from) from a copy of the current export (nights/night_NNN), keeping its vocab
    map; a night whose prompts did not change keeps the last night's settings, so every stage is done and nothing
    runs again. Raises ValueError if the sources hold no more than num_eval prompts."""
    run, nights = Path(cfg.run_dir), history(cfg.run_dir)
    if not nights and (before := _finished_run_record(run)) is not None:
        write_manifest(nights_path(run), {"nights": [before]})
        nights = [before]
        log(f"night 1 continues the finished run {run}: its draft (tau {before['tau']:.2f}) is night 0, copied to "
            f"{run / 'promoted'}; a night's draft replaces it only if its tau is higher")
    tonight = cfg.model_copy(deep=True)
    fixed = cfg.prompts.mix is not None and any(s.count is not None for s in cfg.prompts.mix.sources)
    usable = None
    if not fixed:
        usable = available_prompts(cfg.prompts)
        if usable <= cfg.prompts.num_eval:
            raise ValueError(f"the prompt sources hold {usable} usable prompts, not more than prompts.num_eval "
                             f"{cfg.prompts.num_eval}: a night needs training prompts beyond the held-out ones")
        tonight.prompts.num_train = min(cfg.prompts.num_train, usable - cfg.prompts.num_eval)
    n, last = tonight.prompts.num_train, (nights[-1] if nights else None)
    source_note = ("" if usable is None else
                   f" (prompts.num_train {cfg.prompts.num_train}; the sources hold {usable - cfg.prompts.num_eval} "
                   f"beyond the held-out ones" + ("" if n < cfg.prompts.num_train else
                                                  ": raise prompts.num_train to grow the run") + ")")
    if last is not None:
        if not last.get("before_nights"):          # the settings the current draft was trained with
            tonight.train.init_from, tonight.train.init_vocab = last.get("init_from"), "keep"
        done = read_manifest(RunLayout(run).manifest("prompts")) or {}
        same = (prompts_key(tonight), *prompts_older_keys(tonight))           # an older formula's: same prompts
        if done.get("inputs_key") in same and last.get("num_train") == n:
            log(f"night {len(nights)}: {n} train prompts, as night {last['night']}{source_note}: nothing new to "
                f"train on, no stage runs again; promoted/ stays")
            return tonight, {"night": len(nights), "started_at": time.time(), "new": False,
                             "num_train": n, "init_from": tonight.train.init_from}
        if (run / "draft" / "export" / "config.json").exists():
            start = run / "nights" / f"night_{len(nights):03d}"
            _copy_dir(run / "draft" / "export", start)
            tonight.train.init_from, tonight.train.init_vocab = str(start), "keep"
    log(f"night {len(nights)}: {n} train prompts"
        + (f" ({n - last['num_train']:+d} since night {last['night']})" if last else "") + source_note
        + (f", warm start from {tonight.train.init_from}" if tonight.train.init_from else ", a fresh draft")
        + "; the new draft replaces promoted/ only if its held-out tau is higher")
    return tonight, {"night": len(nights), "started_at": time.time(), "new": True,
                     "num_train": n, "init_from": tonight.train.init_from}


def finish_night(tonight: PipelineConfig, plan: dict, log=print) -> dict:
    """Record the night (nights.json) and promote tonight's export to promoted/ if its chain tau on the held-out
    prompts is higher than the promoted night's (the first night of a fresh run always is, and so is the first
    night on a held-out set the prompts stage re-chose: the manifests' `eval_set` differ, and taus on other prompts
    do not compare). Returns the night's record: night,
    num_train, new_prompts, generated (answers generated tonight, from the shard records), tau, tau_ci95,
    init_from, promoted, promoted_night (the night whose draft promoted/ now holds)."""
    run = Path(tonight.run_dir)
    nights = history(run)
    summary = (read_manifest(RunLayout(run).manifest("evaluate")) or {})["summary"]["trained"]
    records = shard_records(RunLayout(run).generations)
    generated = sum(r.get("generated", 0) for r in records if r.get("started_at", 0) >= plan["started_at"])
    best = next((n for n in reversed(nights) if n["night"] == (nights[-1]["promoted_night"] if nights else -1)),
                None)
    eval_set = (read_manifest(run / "prompts" / "manifest.json") or {}).get("eval_set")
    # taus on different held-out sets do not compare (the prompts stage re-chose it: rows gone or changed)
    moved = best is not None and best.get("eval_set", eval_set) != eval_set
    promote = plan["new"] and (best is None or moved or summary["tau"] > best["tau"])   # only a higher tau replaces it
    if promote:
        _copy_dir(run / "draft" / "export", run / "promoted")
    record = {"night": plan["night"], "num_train": plan["num_train"],
              "new_prompts": plan["num_train"] - (nights[-1]["num_train"] if nights else 0),
              "generated": generated, "tau": summary["tau"], "tau_ci95": summary["tau_ci95"],
              "init_from": plan["init_from"], "new": plan["new"], "promoted": promote, "eval_set": eval_set,
              "promoted_night": plan["night"] if promote else (nights[-1]["promoted_night"] if nights else None)}
    write_manifest(nights_path(run), {"nights": [*nights, record]})
    log(f"night {record['night']}: tau {record['tau']:.2f} ({record['tau_ci95'][0]:.2f}-{record['tau_ci95'][1]:.2f}) "
        f"on the held-out prompts, {generated} answers generated; "
        + (f"promoted (the held-out set changed since night {best['night']}: its tau does not compare; this "
           f"night's is the first on the new set)" if promote and moved else "promoted" if promote else
           f"not promoted (night {record['promoted_night']}'s draft stays)")
        + f" -> {run / 'promoted'}")
    return record


def nights_markdown(run_dir: Path) -> list[str]:
    """The report's table of nights (empty before the first)."""
    nights = history(run_dir)
    if not nights:
        return []
    lines = ["", "## Nights", "", "| night | train prompts | new | answers generated | tau (95% CI) | started from | "
             "promoted |", "|---|---|---|---|---|---|---|"]
    for n in nights:
        lo, hi = n["tau_ci95"]
        start = n["init_from"] or ("the run before its nights" if n.get("before_nights") else "fresh")
        lines.append(f"| {n['night']} | {n['num_train']} | {n['new_prompts']:+d} | {n['generated']} | "
                     f"{n['tau']:.2f} ({lo:.2f}-{hi:.2f}) | {start} | "
                     f"{'yes' if n['promoted'] else 'no, night ' + str(n['promoted_night']) + ' stays'} |")
    return lines
