"""What `plan` reads besides the config and the rates file: a finished run's measured rates (`--measure RUN_DIR`
writes them into a rates profile) and its measured / planned time per stage (`--against RUN_DIR`), from its stage
manifests; the free disk to fit the features into (`--disk SIZE`, or the run directory's file system); the routes
a finished prompts stage gave kept 'auto' sources (kept_shares)."""
from __future__ import annotations

import json
import shutil
from datetime import date
from pathlib import Path

from eagle3_core.contract.layout import RunLayout
from eagle3_core.contract.manifest import read_manifest


def measured_rates(run_dir: Path, where: str) -> dict[str, dict]:
    """Rates measured by a finished run (its stage manifests): generation tok/s, features tok/s, train token
    passes/s, seconds per held-out prompt, tokens per sample and feature bytes per sample, each marked measured
    with `where` and today's date. Raises FileNotFoundError naming a missing manifest."""
    def m(d: str) -> dict:
        path = Path(run_dir) / d / "manifest.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} missing: plan measures finished runs only")
        return json.loads(path.read_text())
    gen, tok, feat, draft, ev, prompts = (m(d) for d in ("generations", "tokenized", "features", "draft", "eval",
                                                           "prompts"))
    S = tok["samples"]
    epochs = len(draft["history"])
    feature_bytes = feat.get("bytes") or feat["bytes_per_token"] * feat["tokens"]
    src = f"{where}, {date.today().isoformat()} ({run_dir})"

    def r(value, unit):
        return {"value": round(value, 4), "unit": unit, "status": "measured", "source": src}
    return {"generation_tok_s_per_server": r(gen["completion_tokens"] / gen["seconds"], "output tok/s"),
            "gpus_per_server": {"value": 1, "unit": "devices", "status": "given", "source": "one server here"},
            "output_tokens_per_sample": r(gen["completion_tokens"] / max(len(prompts["train_ids"]), 1), "tokens"),
            "tokens_per_sample": r(tok["tokens"] / S, "tokens"),
            "samples_per_row": r(S / max(tok.get("rows") or len(prompts["train_ids"]), 1), "samples per row"),
            "extraction_tok_s_per_replica": r(tok["tokens"] / (feat["seconds"] + tok["seconds"]), "tok/s"),
            "gpus_per_extraction_replica": {"value": 1, "unit": "devices", "status": "given", "source": "one here"},
            "feature_bytes_per_sample": r(feature_bytes / S, "bytes"),
            "target_hidden_size": {"value": feat["hidden_size"], "unit": "H_t", "status": "measured",
                                   "source": f"{run_dir}/features/manifest.json"},
            "train_tok_s_per_gpu": r(epochs * tok["tokens"] * draft["train_samples"] / S / draft["seconds"],
                                     "token passes/s"),
            "eval_s_per_prompt": r(ev["seconds"] / len(prompts["eval_ids"]), "s per held-out prompt")}


def compare(p: dict, run_dir: Path) -> dict[str, float]:
    """measured / planned wall time per stage of a finished run (its manifests' seconds; features includes
    tokenize): 1.0 is a perfect plan."""
    secs = {}
    for stage, dirs in (("generation", ["generations"]), ("features", ["tokenized", "features"]),
                        ("train", ["draft"]), ("evaluate", ["eval"])):
        secs[stage] = sum(json.loads((Path(run_dir) / d / "manifest.json").read_text())["seconds"] for d in dirs)
    return {r["stage"]: secs[r["stage"]] / (r["hours"] * 3600) for r in p["stages"] if r["hours"] > 0}


UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30,
         "TIB": 2 ** 40}


def parse_size(text: str) -> float:
    """Bytes of a size such as '11TB' (10^12 bytes a TB), '10 TiB' (2^40), '500GB' or '1e12'. Raises ValueError
    naming the text and the units understood."""
    t = text.strip().upper().replace(" ", "")
    unit = next((u for u in sorted(UNITS, key=len, reverse=True) if u and t.endswith(u)), "")
    try:
        value = float(t[:len(t) - len(unit)])
    except ValueError:
        raise ValueError(f"--disk {text!r}: give a number and a unit of {[u for u in UNITS if u]} (TB = 10^12 "
                         "bytes, TiB = 2^40), e.g. 11TB") from None
    return value * UNITS[unit]


def free_disk(run_dir: str | Path) -> tuple[int, str]:
    """(free bytes, folder) of the file system holding run_dir (or the nearest folder above it that exists)."""
    run = Path(run_dir)
    where = next(p for p in [run, *run.absolute().parents] if p.exists())
    return shutil.disk_usage(where).free, str(where)


def kept_shares(cfg) -> tuple[float, float]:
    """(share of the counted rows kept as they are, share of those kept only because their source is not routed
    yet), over the mix's sources given by count (cfg: a PipelineConfig whose prompts.mix is set). Rows kept as
    they are need no request: mode 'keep' sources with kept 'train', 'mask' or 'refuse', and kept 'auto' sources
    unless a finished prompts stage routed them to 'regenerate' (prompts/manifest.json `kept_routes`). Before that
    stage has run, an 'auto' source counts as kept and plan.markdown names its rows: each one the probe re-routes is
    one more request."""
    routes = (read_manifest(RunLayout(cfg.run_dir).manifest("prompts")) or {}).get("kept_routes") or {}
    kept = unrouted = total = 0
    for s in cfg.prompts.mix.sources:
        if not s.count:
            continue
        total += s.count
        route = routes.get(s.label, {}).get("route", s.kept) if s.kept == "auto" else s.kept
        kept += s.count if s.mode == "keep" and route != "regenerate" else 0
        unrouted += s.count if s.mode == "keep" and route == "auto" else 0
    return kept / max(total, 1), unrouted / max(total, 1)
