"""`python -m eagle3_core.plan CONFIG`: disk, GPU-hours and wall time per stage of a run at N GPUs, from a rates
file whose every rate says where it comes from, before anything runs.

Legend: S train samples, R samples regenerated (prompt-mode rows: kept rows need no request), T tokens per sample
(prompt + answer, capped at features.max_length), O answer tokens per sample, E epochs, G GPUs.

    generation  R * O / (tok_s per server * servers)          servers = G // gpus_per_server (at least 1)
    features    S / (samples_s per replica * replicas)  or  S * T / (tok_s per replica * replicas)
    disk        S * T * store_formats.bytes_per_token(format, H_t)   (store_formats.features_bytes; check's rule too)
    train       E * S * T / (tok_s per GPU * G * ddp_efficiency); format 'online' adds E times the features time
    evaluate    num_eval * eval_s_per_prompt

A rates file (JSON, configs/rates.json) holds named profiles; each rate is {value, unit, status, source} with status
'measured' (source: where and when: the run or benchmark that measured it), 'given' (a number the user states, e.g.
the reference team's 2,300 tok/s) or 'scaled' (derived from a measured rate by a stated ratio).
`--measure RUN_DIR` writes the measured rates of a finished run (its manifests' counts and seconds) into a
profile. A profile with `"beside": OTHER` (e.g. a backend's measured projection) is planned next to OTHER's
features row whenever OTHER is planned (features_beside); one with `"train_from": OTHER` takes its train rate
from profile OTHER (the draft's own measured rate: kimi_k25_agentic's from kimi_k25_draft; load_rates).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eagle3_core.config import PipelineConfig, config_or_preset
from eagle3_core.features.store_formats import FORMATS, features_bytes
from eagle3_core.plan_inputs import compare, free_disk, kept_shares, measured_rates, parse_size
from eagle3_core.training.stopping import planned_epochs

STATUSES = ("measured", "given", "scaled")
DEFAULT_RATES = Path(__file__).resolve().parents[1] / "configs" / "rates.json"


def load_rates(path: str | Path, profile: str) -> dict[str, dict]:
    """The rates of `profile` in the rates file at `path`: {name: {value, unit, status, source}}. A profile with
    `"train_from": OTHER` takes train_tok_s_per_gpu from profile OTHER (the draft's own measured profile, e.g.
    kimi_k25_draft), its source saying so. Raises ValueError naming the file, profile and rate for an unknown
    profile, a missing field, a status outside STATUSES, or a train_from profile without that rate."""
    data = json.loads(Path(path).read_text())
    profiles = data.get("profiles", {})
    if profile not in profiles:
        raise ValueError(f"{path}: no profile {profile!r}; profiles: {sorted(profiles)}")
    rates = dict(profiles[profile]["rates"])
    if "train_from" in profiles[profile]:
        other = profiles[profile]["train_from"]
        train = load_rates(path, other).get("train_tok_s_per_gpu")
        if train is None:
            raise ValueError(f"{path}: profile {profile!r} has train_from {other!r}, which has no "
                             "train_tok_s_per_gpu; add that rate to it or drop train_from")
        rates["train_tok_s_per_gpu"] = {**train, "source": f"{train['source']} [profile {other}]"}
    for name, r in rates.items():
        missing = {"value", "unit", "status", "source"} - set(r)
        if missing or r["status"] not in STATUSES or not str(r["source"]).strip():
            raise ValueError(f"{path}: profile {profile!r} rate {name!r}: needs value, unit, a status in {STATUSES} "
                             f"and a source saying where and when it was measured or who gives it (missing "
                             f"{sorted(missing) or 'a valid status or source'})")
    return rates


# the rates each stage needs (a tuple: any one of them); a profile lacking one leaves that stage unplanned and says
# so (plan_run's "unplanned"), and --fill-from names the profile to take it from (fill_rates)
STAGE_RATES = {
    "generation": ["gpus_per_server", "generation_tok_s_per_server", "output_tokens_per_sample"],
    "features": ["gpus_per_extraction_replica", ("extraction_samples_s_per_replica", "extraction_tok_s_per_replica"),
                 "tokens_per_sample", "target_hidden_size"],
    "train": ["train_tok_s_per_gpu", "tokens_per_sample"],
}


def missing_rates(rates: dict, stage: str, fmt: str = "bf16", hidden_size: int | None = None) -> list[str]:
    """The rates `stage` needs that `rates` lacks ('a or b' where either would do). The features stage needs no
    target_hidden_size in format 'online' (nothing stored) or where `hidden_size` is given; train in format 'online'
    needs the features stage's rates too (the target runs every epoch)."""
    needs = list(STAGE_RATES[stage])
    if stage == "features" and (fmt == "online" or hidden_size is not None):
        needs.remove("target_hidden_size")
    if stage == "train" and fmt == "online":
        needs += [n for n in STAGE_RATES["features"] if n != "target_hidden_size" and n not in needs]
    names = [n if isinstance(n, tuple) else (n,) for n in needs]
    return [" or ".join(n) for n in names if not any(k in rates for k in n)]


def fill_rates(rates: dict, other: dict, other_name: str) -> dict:
    """`rates` with every rate it lacks taken from profile `other_name`'s `other`, each such rate's source saying so.
    Extraction rates come as a group: a profile that has one keeps its own and takes none of `other`'s."""
    own_extraction = any(k.startswith("extraction_") for k in rates)
    taken = {k: {**v, "source": f"{v['source']} [taken from profile {other_name}]"} for k, v in other.items()
             if k not in rates and not (own_extraction and k.startswith("extraction_"))}
    return {**taken, **rates}


def _workload(cfg: PipelineConfig, rates: dict) -> dict:
    """Samples, regenerated rows, answer and total tokens per sample for `cfg` under `rates` (None where the rates
    lack output_tokens_per_sample or tokens_per_sample). Samples are counted after splitting: a row whose template
    rewrites its history gives several (data.history; the rate `samples_per_row`, measured by a finished run, 1
    where the rates have none)."""
    S = cfg.prompts.num_train
    kept, unrouted = (kept_shares(cfg) if cfg.prompts.mix is not None else (0.0, 0.0))
    O = T = None
    if "output_tokens_per_sample" in rates:
        O = min(rates["output_tokens_per_sample"]["value"], cfg.generation.max_new_tokens)
    if "tokens_per_sample" in rates:
        T = min(rates["tokens_per_sample"]["value"], cfg.features.max_length)
    per_row = rates.get("samples_per_row", {}).get("value", 1.0)
    return {"samples": round(S * per_row), "rows": S, "regenerated": S - round(S * kept),
            "unrouted": round(S * unrouted), "answer_tokens": O, "tokens": T}


def _rate(rates: dict, *names: str) -> tuple[str, dict] | None:
    return next(((n, rates[n]) for n in names if n in rates), None)


def _features_hours(w: dict, rates: dict, gpus: int) -> tuple[float, int, tuple[str, dict]]:
    """(wall hours, replicas, (rate name, rate)) of extracting the workload `w`'s samples."""
    per_replica = rates["gpus_per_extraction_replica"]["value"]
    replicas = max(1, gpus // per_replica)
    ext = _rate(rates, "extraction_samples_s_per_replica", "extraction_tok_s_per_replica")
    work = w["samples"] if ext[0].startswith("extraction_samples") else w["samples"] * w["tokens"]
    return work / (ext[1]["value"] * replicas) / 3600, replicas, ext


def plan_run(cfg: PipelineConfig, rates: dict, gpus: int, hidden_size: int | None = None) -> dict:
    """The plan of `cfg` on `gpus` GPUs under `rates` (load_rates): {workload, stages: [{stage, hours (wall),
    gpu_hours, disk_bytes, rate (name, value, unit, status, source) or None, note}], total_hours, disk_bytes,
    unplanned: {stage: [missing rates]}}. Disk: samples x tokens x the format's bytes per token
    (store_formats.features_bytes, the rule `check` uses), hidden_size H_t defaulting to the profile's
    target_hidden_size. A stage whose rates the profile lacks (missing_rates) gets 0 h and a note naming them.
    Raises ValueError for gpus < 1."""
    if gpus < 1:
        raise ValueError(f"gpus {gpus}: plan for at least one GPU (a CPU-only machine counts as 1)")
    if hidden_size is None and "target_hidden_size" in rates:
        hidden_size = int(rates["target_hidden_size"]["value"])
    w, rows, fmt, unplanned = _workload(cfg, rates), [], cfg.features.format, {}

    def row(stage, hours, gpu_hours, rate, disk=0.0, note=""):
        rows.append({"stage": stage, "hours": hours, "gpu_hours": gpu_hours, "disk_bytes": disk, "note": note,
                     "rate": None if rate is None else {"name": rate[0], **rate[1]}})

    def lacking(stage) -> bool:
        if missing := missing_rates(rates, stage, fmt, hidden_size):
            unplanned[stage] = missing
            row(stage, 0.0, 0.0, None, note=f"NOT PLANNED: the profile lacks {', '.join(missing)} (--fill-from "
                                            "another profile that has it)")
        return bool(missing)

    if not lacking("generation"):
        per_server = rates["gpus_per_server"]["value"]
        servers = max(1, gpus // per_server)
        gen = _rate(rates, "generation_tok_s_per_server")
        h = w["regenerated"] * w["answer_tokens"] / (gen[1]["value"] * servers) / 3600
        row("generation", h, h * servers * per_server, gen, note=f"{w['regenerated']} requests on {servers} "
                                                                  "server(s)")
    ext_h = None
    if not lacking("features"):
        ext_h, replicas, ext = _features_hours(w, rates, gpus)
        disk = features_bytes(fmt, w["samples"], w["tokens"], hidden_size or 0)
        if fmt == "online":            # token ids and masks only
            row("features", 0.0, 0.0, ext, disk, note="online: nothing stored; training runs the target every epoch")
        else:
            row("features", ext_h, ext_h * replicas * rates["gpus_per_extraction_replica"]["value"], ext, disk,
                note=f"{replicas} replica(s), {fmt}")
    if not lacking("train"):
        _train_row(cfg, rates, gpus, w, fmt, ext_h, row)
    ev = _rate(rates, "eval_s_per_prompt")
    if ev is None:
        row("evaluate", 0.0, 0.0, None, note="no rate in this profile")
    else:
        h = cfg.prompts.num_eval * ev[1]["value"] / 3600
        row("evaluate", h, h, ev, note=f"{cfg.prompts.num_eval} held-out prompts")
    return {"workload": w, "gpus": gpus, "format": fmt, "stages": rows, "unplanned": unplanned,
            "total_hours": sum(r["hours"] for r in rows), "disk_bytes": sum(r["disk_bytes"] for r in rows)}


def _train_row(cfg: PipelineConfig, rates: dict, gpus: int, w: dict, fmt: str, ext_h: float | None, row) -> None:
    """The train stage's row: E epochs of S x T token passes; format 'online' adds the target's forward (the
    features stage's hours, ext_h) every epoch."""
    tr = _rate(rates, "train_tok_s_per_gpu")
    eff = rates.get("ddp_efficiency", {"value": 1.0})["value"] if gpus > 1 else 1.0
    E, epochs_note = planned_epochs(cfg.train, w["samples"] * w["tokens"])     # epochs unset: the plateau rule's
    h = E * w["samples"] * w["tokens"] / (tr[1]["value"] * gpus * eff) / 3600
    note = f"{epochs_note}, DDP efficiency {eff:g}"
    if fmt == "online":
        if ext_h is None:
            ext_h = _features_hours(w, rates, gpus)[0]
        h += E * ext_h
        note += f", plus the target's forward every epoch ({E} x {ext_h:.2f} h)"
    row("train", h, h * gpus, tr, note=note)


def features_beside(path: str | Path, profile: str, cfg: PipelineConfig, rates: dict, gpus: int,
                    hidden_size: int | None = None) -> list[dict]:
    """The features stage planned with every profile of the rates file at `path` that names `profile` under
    "beside" (e.g. a measured backend's projection next to the team's given rate): its extraction rates in place of
    `profile`'s, the workload and disk of `profile`. Returns [{profile, hours, gpu_hours, rate, range_hours}] where
    range_hours are the hours at its `extraction_tok_s_per_replica_slow` / `_fast` rates when it has them."""
    out = []
    for name, prof in json.loads(Path(path).read_text()).get("profiles", {}).items():
        if prof.get("beside") != profile:
            continue
        alt = load_rates(path, name)
        base = {k: v for k, v in rates.items() if not k.startswith("extraction_")}

        def hours(rate_name: str) -> dict:
            merged = {**base, "extraction_tok_s_per_replica": alt[rate_name],
                      "gpus_per_extraction_replica": alt.get("gpus_per_extraction_replica",
                                                             rates["gpus_per_extraction_replica"])}
            return next(r for r in plan_run(cfg, merged, gpus, hidden_size)["stages"] if r["stage"] == "features")
        row = hours("extraction_tok_s_per_replica")
        span = [hours(k)["hours"] for k in ("extraction_tok_s_per_replica_slow", "extraction_tok_s_per_replica_fast")
                if k in alt]
        out.append({"profile": name, "hours": row["hours"], "gpu_hours": row["gpu_hours"], "rate": row["rate"],
                    "range_hours": span})
    return out


def markdown(p: dict) -> str:
    """The plan as a Markdown table, every rate with its status and source."""
    w = p["workload"]
    lines = [f"Plan at {p['gpus']} GPU(s), features {p['format']}: {w['samples']} samples ({w['regenerated']} "
             f"regenerated), {w['tokens'] or '?'} tokens and {w['answer_tokens'] or '?'} answer tokens per sample"
             + (f"; {w['unrouted']} rows of kept 'auto' sources counted as kept until the prompts stage routes "
                f"them (kept_routes): each one it re-routes is one more request" if w.get("unrouted") else ""), "",
             "| stage | wall h | GPU-h | disk | rate | status | source | note |", "|---|---|---|---|---|---|---|---|"]
    for r in p["stages"]:
        rate = r["rate"] or {}
        val = f"{rate['value']:g} {rate['unit']}" if rate else "-"
        hours, gpu_hours = (f"{r['hours']:.2f}", f"{r['gpu_hours']:.1f}") if rate else ("-", "-")   # not 0: unknown
        lines.append(f"| {r['stage']} | {hours} | {gpu_hours} | {r['disk_bytes'] / 1e12:.2f} TB | "
                     f"{val} | {rate.get('status', '-')} | {rate.get('source', '-')} | {r['note']} |")
    unknown = [r["stage"] for r in p["stages"] if not r["rate"]]
    total = f"total (without {', '.join(unknown)}: no rate)" if unknown else "total"
    lines.append(f"| {total} | {p['total_hours']:.2f} | | {p['disk_bytes'] / 1e12:.2f} TB | | | | |")
    return "\n".join(lines) + "\n"


def fits_table(cfg: PipelineConfig, rates: dict, gpus: int, free: float, hidden_size: int | None = None,
               days: float | None = None) -> list[dict]:
    """For each stored format (store_formats.FORMATS but the test format fp32): {format, disk_bytes, fits (the
    features within `free` bytes), hours (the whole plan's wall time), within (hours <= 24 days), max_samples (the
    most train samples whose features fit `free`; None for online), samples_in_time (the most train samples whose
    plan ends within the days at the same epochs: every stage but evaluate scales with the samples), unplanned
    (the stages the rates cannot plan; fits, within and the bounds they need are None then)."""
    out = []
    for fmt in [f for f in FORMATS if f != "fp32"]:
        alt = cfg.model_copy(update={"features": cfg.features.model_copy(update={"format": fmt})})
        p = plan_run(alt, rates, gpus, hidden_size)
        w, hours, bad = p["workload"], p["total_hours"], sorted(p["unplanned"])
        per_sample = p["disk_bytes"] / w["samples"] if fmt != "online" and "features" not in bad else None
        ev = sum(r["hours"] for r in p["stages"] if r["stage"] == "evaluate")
        in_time = None
        if days is not None and not bad and hours > ev:
            in_time = max(0, int(w["rows"] * (24 * days - ev) / (hours - ev)))
        out.append({"format": fmt, "disk_bytes": p["disk_bytes"], "hours": hours, "unplanned": bad, "rows": w["rows"],
                    "fits": None if "features" in bad else p["disk_bytes"] <= free,
                    "within": None if days is None or bad else hours <= 24 * days,
                    "max_samples": None if per_sample is None else int(free // per_sample * w["rows"] / w["samples"]),
                    "samples_in_time": in_time})
    return out


def fits_markdown(rows: list[dict], free: float, where: str, days: float | None) -> str:
    """The fits table and its verdict: which formats fit the disk and, with `days`, finish within it."""
    def yn(v):
        return "?" if v is None else "yes" if v else "no"
    lines = [f"Fits {free / 1e12:.2f} TB free ({where}; TB = 10^12 bytes)"
             + (f" within {days:g} days ({24 * days:g} h)" if days else "") + ":", "",
             "| format | disk | fits | wall h | within | most train samples on the disk | in time |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['format']} | {r['disk_bytes'] / 1e12:.2f} TB | {yn(r['fits'])} | {r['hours']:.1f}"
                     f"{' (without ' + ', '.join(r['unplanned']) + ')' if r['unplanned'] else ''} | "
                     f"{'-' if days is None else yn(r['within'])} | "
                     f"{'all' if r['max_samples'] is None and r['fits'] else r['max_samples'] or '?'} | "
                     f"{'-' if r['samples_in_time'] is None else r['samples_in_time']} |")
    if any(r["unplanned"] for r in rows):
        lines.append("\nSome stages are not planned (the profile lacks their rates: --fill-from): no verdict.")
        return "\n".join(lines) + "\n"
    ok = [r["format"] for r in rows if r["fits"] and r["within"] is not False]
    if ok:
        lines.append(f"\nFits{' in time' if days else ''}: {', '.join(ok)}.")
    else:
        why = [f"{r['format']} needs {r['disk_bytes'] / 1e12:.2f} TB > {free / 1e12:.2f} TB" if not r["fits"] else
               f"{r['format']} needs {r['hours']:.1f} h > {24 * days:g} h" for r in rows]
        lines.append(f"\nNo format fits: {'; '.join(why)}.")
        both = [(min(n for n in (r["max_samples"], r["samples_in_time"]) if n is not None), r["format"])
                for r in rows if r["max_samples"] is not None or r["samples_in_time"] is not None]
        if both:
            n = max(b[0] for b in both)
            fmts = " or ".join(f for m, f in both if m == n)
            lines.append(f"The most train samples that fit both: {n} in {fmts} (of {rows[0]['rows']}).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", help="a PipelineConfig JSON file or a preset name")
    p.add_argument("--profile", required=True, help="the rates profile to plan with (or to write, with --measure)")
    p.add_argument("--rates", default=str(DEFAULT_RATES), help="the rates file (default configs/rates.json)")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--hidden-size", type=int, default=None, help="H_t, when the profile plans disk per token")
    p.add_argument("--against", default=None, help="a finished run directory: print measured / planned per stage")
    p.add_argument("--measure", default=None, metavar="RUN_DIR",
                   help="write this finished run's measured rates into --profile instead of planning")
    p.add_argument("--where", default=None, help="with --measure: what measured it, e.g. 'make demo, 2 CPU cores'")
    p.add_argument("--fill-from", default=None, metavar="PROFILE",
                   help="take the rates --profile lacks from this profile (each one's source says so)")
    p.add_argument("--disk", default=None, metavar="SIZE", help="the free disk to fit the features into, e.g. 11TB "
                   "(10^12 bytes a TB; TiB for 2^40); default: the free space of the config's run_dir")
    p.add_argument("--days", type=float, default=None, help="the wall-time budget: say which formats finish within")
    a = p.parse_args(argv)
    if a.measure:
        if not a.where:
            p.error("--measure needs --where (the rates file says where each rate was measured)")
        path = Path(a.rates)
        data = json.loads(path.read_text()) if path.exists() else {"profiles": {}}
        data["profiles"][a.profile] = {"description": a.where, "rates": measured_rates(Path(a.measure), a.where)}
        path.write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote profile {a.profile!r} to {path}")
        return 0
    if not a.config:
        p.error("give CONFIG (or --measure RUN_DIR)")
    cfg = config_or_preset(a.config)
    rates = load_rates(a.rates, a.profile)
    if a.fill_from:
        rates = fill_rates(rates, load_rates(a.rates, a.fill_from), a.fill_from)
    for fmt in dict.fromkeys([cfg.features.format, "bf16", "fp8", "online"]):
        alt = cfg.model_copy(update={"features": cfg.features.model_copy(update={"format": fmt})})
        plan = plan_run(alt, rates, a.gpus, a.hidden_size)
        print(("" if fmt == cfg.features.format else f"With features.format '{fmt}':\n") + markdown(plan))
        if fmt == cfg.features.format and fmt != "online":
            given = next(r for r in plan["stages"] if r["stage"] == "features")
            for b in features_beside(a.rates, a.profile, alt, rates, a.gpus, a.hidden_size):
                r = b["rate"]
                span = f" ({min(b['range_hours']):.2f}-{max(b['range_hours']):.2f} h over its range)" \
                    if b["range_hours"] else ""
                print(f"features beside the given rate: {given['hours']:.2f} h at {given['rate']['value']:g} "
                      f"{given['rate']['unit']} ({a.profile}, {given['rate']['status']}); {b['hours']:.2f} h{span} "
                      f"at {r['value']:g} {r['unit']} ({b['profile']}, {r['status']}: {r['source']})\n")
        if a.against and fmt == cfg.features.format:
            print("measured / planned: " + ", ".join(f"{k} {v:.2f}x" for k, v in compare(plan, a.against).items()))
        if plan["unplanned"] and fmt == cfg.features.format:
            print(_unplanned_line(a.rates, a.profile, plan["unplanned"]))
    free, where = (parse_size(a.disk), "--disk") if a.disk else free_disk(cfg.run_dir)
    print(fits_markdown(fits_table(cfg, rates, a.gpus, free, a.hidden_size, a.days), free, where, a.days))
    return 0


def _unplanned_line(path: str | Path, profile: str, unplanned: dict[str, list[str]]) -> str:
    """What profile `profile` cannot plan, and the profiles of the rates file that hold the rates it lacks."""
    profiles = json.loads(Path(path).read_text()).get("profiles", {})
    lacking = {n for names in unplanned.values() for m in names for n in m.split(" or ")}
    holders = [k for k, v in profiles.items() if k != profile and lacking & set(v["rates"])]
    stages = ", ".join(f"{s} (lacks {', '.join(m)})" for s, m in unplanned.items())
    return (f"profile {profile!r} cannot plan {stages}: pass --fill-from PROFILE to take them from another profile "
            f"(these hold some: {holders})\n")


if __name__ == "__main__":
    sys.exit(main())
