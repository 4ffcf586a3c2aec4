"""A night's work: the scheduled run reads its prompt sources in full, regenerates and extracts only the rows it
has not seen (the run grows: prompts.build_prompts keeps the earlier rows and the held-out set of the first night,
the shard plans keep every finished shard), warm-starts from the last night's draft, and promotes tonight's export
only if its tau on the (frozen) held-out prompts is not worse than the promoted one's.

In the run directory:
  nights.json          one record per night: prompts, new prompts, answers generated, tau and its 95% interval,
                       the draft it started from, whether it was promoted
  nights/night_NNN/    the draft each night started from (a copy of the export of the night before)
  promoted/            the export that passed: the draft to serve
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.manifest import read_manifest, write_manifest


def nights_path(run_dir: Path) -> Path:
    return Path(run_dir) / "nights.json"


def history(run_dir: Path) -> list[dict]:
    """The records of earlier nights (nights.json), oldest first; [] before the first."""
    return (read_manifest(nights_path(run_dir)) or {}).get("nights", [])


def _copy_dir(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.replace(dst)


def plan_night(cfg: PipelineConfig, log=print) -> tuple[PipelineConfig, dict]:
    """(tonight's config, the night's plan). Tonight's config takes every usable prompt of the sources
    (prompts.available_prompts less num_eval; a mix with fixed counts keeps its counts) and, from the second night
    on, warm-starts (train.init_from) from a copy of the last night's export (nights/night_NNN), keeping its vocab
    map. A night whose prompt sources did not change keeps the last night's settings, so every stage is done and
    nothing runs again. Raises ValueError if the sources hold no more than num_eval prompts."""
    from eagle3_core.data.prompt_set import available_prompts
    from eagle3_core.pipeline.prompts_stage import prompts_key
    run, nights = Path(cfg.run_dir), history(cfg.run_dir)
    tonight = cfg.model_copy(deep=True)
    fixed = cfg.prompts.mix is not None and any(s.count is not None for s in cfg.prompts.mix.sources)
    if not fixed:
        n = available_prompts(cfg.prompts)
        if n <= cfg.prompts.num_eval:
            raise ValueError(f"the prompt sources hold {n} usable prompts, not more than prompts.num_eval "
                             f"{cfg.prompts.num_eval}: a night needs training prompts beyond the held-out ones")
        tonight.prompts.num_train = n - cfg.prompts.num_eval
    last = nights[-1] if nights else None
    if last is not None:
        tonight.train.init_from = last.get("init_from")
        tonight.train.init_vocab = "keep"
        done = read_manifest(run / "prompts" / "manifest.json") or {}
        if done.get("inputs_key") == prompts_key(tonight) and last.get("num_train") == tonight.prompts.num_train:
            log(f"night {len(nights)}: the prompt sources have not changed since night {last['night']}: "
                f"nothing new to train on")
            return tonight, {"night": len(nights), "started_at": time.time(), "new": False,
                             "num_train": tonight.prompts.num_train, "init_from": tonight.train.init_from}
        if (run / "draft" / "export" / "config.json").exists():
            start = run / "nights" / f"night_{len(nights):03d}"
            _copy_dir(run / "draft" / "export", start)
            tonight.train.init_from = str(start)
    log(f"night {len(nights)}: {tonight.prompts.num_train} train prompts"
        + (f" ({tonight.prompts.num_train - last['num_train']:+d} since night {last['night']})" if last else "")
        + (f", warm start from {tonight.train.init_from}" if tonight.train.init_from else ", a fresh draft"))
    return tonight, {"night": len(nights), "started_at": time.time(), "new": True,
                     "num_train": tonight.prompts.num_train, "init_from": tonight.train.init_from}


def finish_night(tonight: PipelineConfig, plan: dict, log=print) -> dict:
    """Record the night (nights.json) and promote tonight's export to promoted/ if its chain tau on the held-out
    prompts is at least the promoted night's (the first night always is). Returns the night's record: night,
    num_train, new_prompts, generated (answers generated tonight, from the shard records), tau, tau_ci95,
    init_from, promoted, promoted_night (the night whose draft promoted/ now holds)."""
    run = Path(tonight.run_dir)
    nights = history(run)
    summary = (read_manifest(run / "eval" / "manifest.json") or {})["summary"]["trained"]
    records = [json.loads(p.read_text()) for p in sorted((run / "generations").glob("shard_*.json"))]
    generated = sum(r.get("generated", 0) for r in records if r.get("started_at", 0) >= plan["started_at"])
    best = next((n for n in reversed(nights) if n["night"] == (nights[-1]["promoted_night"] if nights else -1)),
                None)
    promote = plan["new"] and (best is None or summary["tau"] >= best["tau"])
    if promote:
        _copy_dir(run / "draft" / "export", run / "promoted")
    record = {"night": plan["night"], "num_train": plan["num_train"],
              "new_prompts": plan["num_train"] - (nights[-1]["num_train"] if nights else 0),
              "generated": generated, "tau": summary["tau"], "tau_ci95": summary["tau_ci95"],
              "init_from": plan["init_from"], "new": plan["new"], "promoted": promote,
              "promoted_night": plan["night"] if promote else (nights[-1]["promoted_night"] if nights else None)}
    write_manifest(nights_path(run), {"nights": [*nights, record]})
    log(f"night {record['night']}: tau {record['tau']:.2f} ({record['tau_ci95'][0]:.2f}-{record['tau_ci95'][1]:.2f}) "
        f"on the held-out prompts, {generated} answers generated; "
        + ("promoted" if promote else f"not promoted (night {record['promoted_night']}'s draft stays)")
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
        lines.append(f"| {n['night']} | {n['num_train']} | {n['new_prompts']:+d} | {n['generated']} | "
                     f"{n['tau']:.2f} ({lo:.2f}-{hi:.2f}) | {n['init_from'] or 'fresh'} | "
                     f"{'yes' if n['promoted'] else 'no, night ' + str(n['promoted_night']) + ' stays'} |")
    return lines
