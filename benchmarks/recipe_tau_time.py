"""Acceptance length against wall time: our trainer's recipes and SpecForge 0.2.0's online training on the same
regenerated data, every epoch's draft measured by one offline evaluator on the same held-out prompts.

  python benchmarks/recipe_tau_time.py --config configs/e2e_gsm8k.json --recipes configs/recipes_gsm8k.json \
      [--target DIR] [--out DIR] [--plot docs/img/recipe_tau_time.png] [--only NAME,...] [--workers W] \
      [--measure-device cuda] [--record-batch 64] [--no-specforge]

Data: the config's prompts, regeneration and tokenization (train_end_to_end.data_stages, cached by their manifests).
Ours: the features stage once (timed, from scratch, or its time read back from RUN_DIR/recipes/features.json when
that store is still the one timed), then each recipe of the --recipes file ({name: partial PipelineConfig, e.g.
{"train": {"epochs": 5, "lr": 1e-3}, "draft": {"draft_vocab_size": 16384}}, merged into the config) in a run folder
of its own, RUN_DIR/recipes/NAME, that links the shared prompts, generations, tokenized rows and features: its vocab
stage (a vocab size of its own) and train stage run there, every epoch's `last` draft kept. Two keys of a recipe are
not config fields: "samples": N trains on the first N of the nested subsets of scaling_study (a second data size
from the same store; its features time is counted as N / all train samples of the whole), "sources": {SOURCE: N}
trains on the first N of each source's own nested subset instead (a sample's source: its id's prefix, "gsm8k/..."),
"measure": "last" measures its final epoch only (default every epoch).
A recipe's wall time at epoch e: features + its vocab + its train stage up to the end of epoch e (held-out TTT eval
and checkpoints included; copying the snapshots is left out), compiled from a cold cache (cold_compile).
SpecForge: train_end_to_end.specforge_online with the config's own recipe (its target forward in the loop, its
BF16Optimizer), its weights at each epoch end loaded into our draft class (same parameter names); wall time from
the target's load to that epoch's end.
Measured after all training, chain drafting with eval.num_draft_steps, greedy, eval.max_new_tokens, on the run's
held-out prompts (their ids in the result), target fp32: --evaluator replay (default) records the target once
(RUN_DIR/recipes/recording.pt) and replays every draft on it (eagle3_core.evaluation.replay_eval: the same verify steps
as decoding, without a target forward per step); --evaluator decode runs scaling_study.measure_drafts (speculative
decoding, a baseline per process). The drafts are split over W processes (on a GPU they share it: launch-bound).
Cached: a recipe whose RUN_DIR/recipes/NAME/trained.json holds the same settings is not trained again, a draft whose
measured.json holds the same eval settings is not measured again (a long search can go on over several calls).

Writes OUT/results.json (every point: trainer, recipe, epoch, seconds, tau, 95% CI, per-prompt counts), the plot
(tau against seconds, both trainers) and prints, for each recipe, its best tau within SpecForge's wall time with
the paired bootstrap interval of its difference from SpecForge's final draft (the same prompts resampled for both).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from eagle3_core.config import PipelineConfig, TargetConfig, load_config  # noqa: E402
from eagle3_core.contract.layout import STAGE_DIRS  # noqa: E402

SHARED = tuple(STAGE_DIRS[s] for s in ("prompts", "generation", "tokenize", "features"))   # folders every recipe reads
NOT_CONFIG = ("samples", "sources", "measure")                       # recipe keys this script reads itself


def merged(base: dict, override: dict) -> dict:
    """base with override's keys replaced, nested dicts merged key by key."""
    out = dict(base)
    for k, v in override.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def recipe_config(base: PipelineConfig, name: str, recipe: dict) -> PipelineConfig:
    """The config of one recipe: `recipe` (less NOT_CONFIG) merged into `base`, run_dir RUN_DIR/recipes/NAME with
    the SHARED folders of base linked into it (created once). Raises pydantic's ValidationError naming a bad field."""
    from eagle3_core.contract.layout import RunLayout
    fields = {k: v for k, v in recipe.items() if k not in NOT_CONFIG}
    cfg = PipelineConfig.model_validate(merged(base.model_dump(mode="json"), fields) | {
        "run_dir": str(Path(base.run_dir) / "recipes" / name)})
    src, dst = RunLayout(base.run_dir), RunLayout(cfg.run_dir)
    dst.run_dir.mkdir(parents=True, exist_ok=True)
    for stage in SHARED:
        link = getattr(dst, stage)
        if not link.exists():
            link.symlink_to(getattr(src, stage).resolve(), target_is_directory=True)
    return cfg


def cached(path: Path, settings: dict) -> dict | None:
    """The JSON at path if it was written for these settings, else None."""
    if path.exists() and (old := json.loads(path.read_text())).get("settings") == settings:
        return old
    return None


def subset_indices(ids: list[str], recipe: dict) -> list[int]:
    """Indices into the train split (its sample ids, in order) that a recipe trains on: every one; with "samples" N
    the first N of scaling_study's nested subsets; with "sources" {SOURCE: N} the first N of each source's own
    nested subset (a sample's source: the prefix of its id before '/'). Raises ValueError naming a source with fewer
    samples than asked."""
    from eagle3_core.studies.scaling_study import nested_subset
    if "sources" in recipe:
        keep = []
        for source, n in recipe["sources"].items():
            own = [i for i, sid in enumerate(ids) if sid.split("/", 1)[0] == source]
            if n > len(own):
                raise ValueError(f"recipe sources: {source!r} has {len(own)} train samples, {n} asked")
            keep += [own[j] for j in nested_subset(len(own), n, 0)]
        return sorted(keep)
    if "samples" in recipe:
        if recipe["samples"] > len(ids):
            raise ValueError(f"recipe samples {recipe['samples']} > {len(ids)} train samples")
        return nested_subset(len(ids), recipe["samples"], 0)
    return list(range(len(ids)))


def epoch_tokens(cfg: PipelineConfig, recipe: dict) -> int:
    """Tokens an epoch of `recipe` trains on (subset_indices of the train split)."""
    from eagle3_core.pipeline.train_stage import train_split
    train_all, _ = train_split(cfg)
    return sum(len(train_all[i]["input_ids"]) for i in subset_indices([s["id"] for s in train_all], recipe))


def subset_train(cfg: PipelineConfig, recipe: dict, on_epoch, log) -> float:
    """The train stage's trainer on the recipe's subset of the train split (subset_indices; the held-out TTT eval
    split unchanged), into RUN_DIR/draft; returns the subset's share of the train samples the store holds."""
    from eagle3_core.contract.layout import RunLayout
    from eagle3_core.pipeline.train_stage import claim_training_dir, fresh_draft, train_key, train_split
    from eagle3_core.training.trainer import train
    train_all, eval_s = train_split(cfg)
    keep = subset_indices([s["id"] for s in train_all], recipe)
    draft, lm_head = fresh_draft(cfg, log=lambda s: None)
    out = RunLayout(cfg.run_dir).draft
    tag = json.dumps(recipe.get("sources")) if "sources" in recipe else recipe["samples"]
    claim_training_dir(out, f"{train_key(cfg)}-n{tag}")
    train(draft, [train_all[i] for i in keep], eval_s, lm_head, cfg.train, out,
          log=log, on_epoch=on_epoch, tensorboard=False)
    return len(keep) / len(train_all)


def cold_compile() -> None:
    """Make the next training compile from nothing, as a run of its own would: dynamo's in-process caches
    cleared and inductor pointed at an empty cache folder (otherwise a recipe after the first reuses its graphs)."""
    torch.compiler.reset()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor_")


def train_ours(base: PipelineConfig, name: str, recipe: dict, features_seconds: float) -> dict:
    """Train one recipe (module docstring), every epoch's draft kept in RUN_DIR/recipes/NAME/epochs/epoch_E;
    returns trained.json {settings, vocab_seconds, epochs: [{epoch, seconds, dir}]} (cached)."""
    from eagle3_core.contract.layout import RunLayout
    from eagle3_core.pipeline.train_stage import run_train
    from eagle3_core.pipeline.vocab_stage import run_vocab
    cfg = recipe_config(base, name, recipe)
    run = RunLayout(cfg.run_dir)
    settings = {"recipe": recipe, "train": cfg.train.model_dump(mode="json"),
                "draft": cfg.draft.model_dump(mode="json"), "features_seconds": features_seconds}
    if old := cached(run.run_dir / "trained.json", settings):
        print(f"== recipe {name}: trained before", flush=True)
        return old
    for d in (run.vocab, run.draft, run.run_dir / "epochs"):
        shutil.rmtree(d, ignore_errors=True)
    cold_compile()
    t0 = time.monotonic()
    run_vocab(cfg, log=lambda s: None)
    vocab_seconds = time.monotonic() - t0
    marks, left_out = [], [0.0]
    t0 = time.monotonic()

    def snapshot(epochs_done: int, epochs: int) -> None:
        paused = time.monotonic()
        marks.append(paused - t0 - left_out[0])
        shutil.copytree(run.draft / "last", run.run_dir / "epochs" / f"epoch_{epochs_done}")
        left_out[0] += time.monotonic() - paused

    def log(s: str) -> None:
        print(f"   [{name}] {s}", flush=True)

    share = 1.0
    if "samples" in recipe or "sources" in recipe:
        share = subset_train(cfg, recipe, snapshot, log)
        manifest = {}
    else:
        manifest = run_train(cfg, log=log, on_epoch=snapshot)
    epochs = [{"epoch": e, "seconds": features_seconds * share + vocab_seconds + s,
               "dir": str(run.run_dir / "epochs" / f"epoch_{e}")} for e, s in enumerate(marks, 1)]
    out = {"settings": settings, "vocab_seconds": vocab_seconds, "features_share": share, "epochs": epochs,
           "epoch_tokens": epoch_tokens(cfg, recipe),
           "best": manifest.get("best"), "stopping": manifest.get("stopping")}   # the exported epoch; the rule's
    (run.run_dir / "trained.json").write_text(json.dumps(out, indent=2))
    return out


def train_specforge(base: PipelineConfig, device: torch.device) -> dict:
    """SpecForge's online run with the config's recipe (module docstring), each epoch's draft in our format in
    RUN_DIR/recipes/specforge/epochs/epoch_E; returns trained.json (cached) as train_ours does."""
    from eagle3_core.pipeline.train_stage import fresh_draft
    from eagle3_core.training.checkpoint import save_draft
    from train_end_to_end import specforge_online
    here = Path(base.run_dir) / "recipes" / "specforge"
    settings = {"train": base.train.model_dump(mode="json"), "draft": base.draft.model_dump(mode="json")}
    if old := cached(here / "trained.json", settings):
        print("== specforge: trained before", flush=True)
        return old
    shutil.rmtree(here / "epochs", ignore_errors=True)
    cold_compile()
    epochs = []

    def snapshot(epochs_done: int, seconds: float, model) -> None:
        ours, _ = fresh_draft(base, log=lambda s: None)
        missing, unexpected = ours.load_state_dict(model.state_dict(), strict=False)
        if missing or not all("rotary" in k or "inv_freq" in k for k in unexpected):
            raise RuntimeError(f"SpecForge's draft does not map onto ours: missing {missing}, extra {unexpected}")
        save_draft(ours.float(), here / "epochs" / f"epoch_{epochs_done}")
        epochs.append({"epoch": epochs_done, "seconds": seconds, "dir": str(here / "epochs" / f"epoch_{epochs_done}")})

    specforge_online(base, device, on_epoch=snapshot)
    out = {"settings": settings, "epochs": epochs}
    (here / "trained.json").write_text(json.dumps(out, indent=2))
    return out


def eval_settings(cfg: PipelineConfig) -> dict:
    """What a measurement depends on besides the draft: the eval settings and the held-out prompts."""
    from eagle3_core.contract.layout import RunLayout
    return {"eval": cfg.eval.model_dump(mode="json"),
            "eval_ids": json.loads((RunLayout(cfg.run_dir).prompts / "manifest.json").read_text()).get("eval_ids")}


def recording(cfg: PipelineConfig, device: str, path: Path, batch: int) -> Path:
    """The target's greedy output and aux hidden states on the held-out prompts (replay_eval.record_target, target
    fp32 on `device`, `batch` prompts per generate), saved at `path` (torch.save of tensors and lists) and reused
    while the eval settings, the held-out prompts, the batch and the target are the same."""
    from eagle3_core.evaluation.replay_eval import record_target
    from eagle3_core.evaluation.speculate import TargetRunner
    from eagle3_core.pipeline.keys import aux_ids
    from eagle3_core.studies.scaling_study import held_out_prompts
    from eagle3_core.target.family import num_layers
    from eagle3_core.target.loading import load_target
    settings = {**eval_settings(cfg), "target": cfg.target.model_dump(mode="json"), "batch": batch}
    if path.exists() and torch.load(path, weights_only=True)["settings"] == settings:
        return path
    t0 = time.monotonic()
    _, prompts, eos = held_out_prompts(cfg)
    target = load_target(cfg.target, device, torch.float32)
    recs = record_target(TargetRunner(target, aux_ids(cfg, num_layers(target.config))), prompts,
                         cfg.eval.max_new_tokens, eos, batch=batch, pad_id=min(eos, default=0))
    torch.save({"settings": settings, "recordings": recs}, path)
    print(f"== recorded the target on {len(prompts)} held-out prompts in {time.monotonic() - t0:.0f} s", flush=True)
    return path


CHUNK = 16                 # held-out prompts per replay task: a call killed at its limit loses at most one per process


def measure_worker(cfg_json: str, dirs: list[str], device: str) -> None:
    """One process: the drafts in `dirs` measured by scaling_study.measure_drafts (the decoding evaluator), each
    entry written to DIR/measured.json."""
    from eagle3_core.studies.scaling_study import measure_drafts
    from eagle3_core.training.checkpoint import load_draft
    torch.set_num_threads(2)
    cfg = PipelineConfig.model_validate_json(cfg_json)
    settings = {**eval_settings(cfg), "evaluator": "decode"}
    keys = ("tau", "tau_ci95", "accept_per_position", "per_prompt", "lossless")
    for d, m in measure_drafts(cfg, {d: load_draft(Path(d)) for d in dirs}, device).items():
        (Path(d) / "measured.json").write_text(json.dumps({"settings": settings, **{k: m[k] for k in keys}}))


def part_path(d: str, a: int, b: int) -> Path:
    """Where the replay of held-out prompts a..b-1 by the draft in `d` is kept."""
    return Path(d) / "replay_parts" / f"prompts_{a:05d}_{b:05d}.json"


def replay_tasks(dirs: list[str], n: int, settings: dict) -> list[tuple[str, int, int]]:
    """(draft dir, first prompt, end) of every CHUNK of the n held-out prompts not yet replayed for `settings`."""
    return [(d, a, min(a + CHUNK, n)) for d in dirs for a in range(0, n, CHUNK)
            if not cached(part_path(d, a, min(a + CHUNK, n)), settings)]


def replay_worker(cfg_json: str, tasks: list[tuple[str, int, int]], device: str, recorded: str) -> None:
    """One process: each task's prompts replayed (replay_eval.replay_chain) by its draft on the recording, each
    chunk's runs written to part_path as soon as they are in."""
    from eagle3_core.evaluation.replay_eval import replay_chain
    from eagle3_core.training.checkpoint import load_draft
    torch.set_num_threads(2)
    cfg = PipelineConfig.model_validate_json(cfg_json)
    settings = {**eval_settings(cfg), "evaluator": "replay"}
    recs = torch.load(recorded, weights_only=True)["recordings"]
    drafts: dict = {}
    for d, a, b in tasks:
        draft = drafts.setdefault(d, load_draft(Path(d)).to(device).eval())
        runs = [replay_chain(draft, r, cfg.eval.num_draft_steps) for r in recs[a:b]]
        path = part_path(d, a, b)
        path.parent.mkdir(exist_ok=True)
        keep = ("accepted", "verify_steps", "tokens_from_verify")
        path.write_text(json.dumps({"settings": settings, "runs": [{k: r[k] for k in keep} for r in runs]}))


def merge_parts(d: str, n: int, settings: dict, num_steps: int) -> None:
    """DIR/measured.json from the draft's replayed chunks, in prompt order (replay_eval.summarize_runs)."""
    from eagle3_core.evaluation.replay_eval import summarize_runs
    runs = [r for a in range(0, n, CHUNK) for r in json.loads(part_path(d, a, min(a + CHUNK, n)).read_text())["runs"]]
    m = summarize_runs(runs, num_steps)
    keys = ("tau", "tau_ci95", "accept_per_position", "per_prompt")
    (Path(d) / "measured.json").write_text(json.dumps({"settings": settings, **{k: m[k] for k in keys}}))


def run_workers(target, shares: list, args: tuple) -> None:
    """Run target(args[0], share, *args[1:]) for every share in its own spawned process (CUDA does not survive a
    fork); raises RuntimeError naming the shares whose process failed."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(args[0], share, *args[1:])) for share in shares]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if bad := [s for p, s in zip(procs, shares, strict=True) if p.exitcode != 0]:
        raise RuntimeError(f"measuring failed for {bad}: see the traceback above")


def measure_all(cfg: PipelineConfig, dirs: list[str], workers: int, device: str, recorded: Path | None) -> None:
    """Measure every draft dir without a measured.json for these eval settings in `workers` processes. With
    `recorded` (a recording's path) by the replay evaluator in chunks of CHUNK prompts spread over the processes,
    each chunk kept as it is done (a later call goes on from the chunks left), else by the decoding evaluator, a
    draft per process. A failed worker raises RuntimeError naming its share."""
    settings = {**eval_settings(cfg), "evaluator": "replay" if recorded else "decode"}
    todo = [d for d in dirs if not cached(Path(d) / "measured.json", settings)]
    if not todo:
        return
    t0 = time.monotonic()
    if recorded:
        n = len(settings["eval_ids"])
        tasks = replay_tasks(todo, n, settings)
        workers = max(1, min(workers, len(tasks)))
        print(f"== replaying {len(todo)} drafts: {len(tasks)} chunks of {CHUNK} prompts in {workers} processes on "
              f"{device}", flush=True)
        if tasks:
            run_workers(replay_worker, [tasks[i::workers] for i in range(workers)],
                        (cfg.model_dump_json(), device, str(recorded)))
        for d in todo:
            merge_parts(d, n, settings, cfg.eval.num_draft_steps)
    else:
        workers = max(1, min(workers, len(todo)))
        print(f"== measuring {len(todo)} drafts in {workers} processes on {device}", flush=True)
        run_workers(measure_worker, [todo[i::workers] for i in range(workers)], (cfg.model_dump_json(), device))
    print(f"== measured in {time.monotonic() - t0:.0f} s", flush=True)


def points_of(trainer: str, name: str, trained: dict) -> list[dict]:
    """The measured epochs of one trained recipe as result points."""
    out = []
    for e in trained["epochs"]:
        if (f := Path(e["dir"]) / "measured.json").exists():
            m = json.loads(f.read_text())
            m.pop("settings")
            out.append({"trainer": trainer, "recipe": name, "epoch": e["epoch"], "seconds": e["seconds"],
                        "epoch_tokens": trained.get("epoch_tokens"), **m})
    return out


def plot(points: list[dict], path: Path, title: str) -> Path:
    """tau (95% CI bars) against wall seconds, one line per recipe and one for SpecForge."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in dict.fromkeys(p["recipe"] for p in points):
        pts = sorted((p for p in points if p["recipe"] == name), key=lambda p: p["seconds"])
        x, y = [p["seconds"] for p in pts], [p["tau"] for p in pts]
        err = [[p["tau"] - p["tau_ci95"][0] for p in pts], [p["tau_ci95"][1] - p["tau"] for p in pts]]
        style = dict(color="black", linestyle="--", marker="s") if name == "specforge" else dict(marker="o")
        ax.errorbar(x, y, yerr=err, capsize=3, label="SpecForge 0.2.0" if name == "specforge" else f"ours: {name}",
                    **style)
    ax.set_xlabel("wall time, seconds (ours: features + vocab + train; SpecForge: its online loop)")
    ax.set_ylabel("acceptance length tau (offline, held-out)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def summary(points: list[dict]) -> list[dict]:
    """Per recipe: its best point within SpecForge's final wall time and, against SpecForge's final draft, the
    difference in tau with its paired bootstrap 95% interval (evaluate.paired_bootstrap_diff_ci)."""
    from eagle3_core.evaluation.acceptance import paired_bootstrap_diff_ci
    sf = [p for p in points if p["trainer"] == "specforge"]
    final = max(sf, key=lambda p: p["epoch"]) if sf else None
    rows = []
    for name in dict.fromkeys(p["recipe"] for p in points if p["trainer"] == "ours"):
        mine = [p for p in points if p["recipe"] == name]
        pts = [p for p in mine if final is None or p["seconds"] <= final["seconds"]]
        best = max(pts, key=lambda p: p["tau"]) if pts else None
        last = max(mine, key=lambda p: p["epoch"])
        row = {"recipe": name, "best_within_specforge_time": best and {k: best[k] for k in ("epoch", "seconds",
                                                                                             "tau", "tau_ci95")},
               "last": {k: last[k] for k in ("epoch", "seconds", "tau", "tau_ci95")}}
        if best and final:
            row["minus_specforge"] = {"tau": best["tau"] - final["tau"],
                                      "ci95_paired": paired_bootstrap_diff_ci(best["per_prompt"], final["per_prompt"])}
        rows.append(row)
    return rows


def features_once(cfg: PipelineConfig, out: Path) -> float:
    """The features stage from scratch, timed; its seconds are read back from OUT/features.json while the store's
    manifest is the one timed (same inputs key)."""
    from eagle3_core.contract.layout import RunLayout
    from eagle3_core.pipeline.features_stage import run_features
    run = RunLayout(cfg.run_dir)
    record = out / "features.json"
    if record.exists() and (run.features / "manifest.json").exists():
        old, key = json.loads(record.read_text()), json.loads((run.features / "manifest.json").read_text())
        if old["inputs_key"] == key["inputs_key"]:
            return old["seconds"]
    shutil.rmtree(run.features, ignore_errors=True)
    t0 = time.monotonic()
    m = run_features(cfg, log=lambda s: None)
    seconds = time.monotonic() - t0
    record.write_text(json.dumps({"inputs_key": m["inputs_key"], "seconds": seconds}))
    return seconds


def report(res: dict, out: Path | None, plot_path: Path | None, title: str) -> None:
    """The plot (OUT/tau_time.png unless out is None, and plot_path; skipped with a note where matplotlib is
    missing: --replot draws it later from results.json) and the summary table, printed as markdown."""
    if res["points"]:
        try:
            for path in filter(None, (out and out / "tau_time.png", plot_path)):
                plot(res["points"], path, title)
        except ImportError as e:
            print(f"plot skipped ({e}): run --replot RESULTS.json where matplotlib is installed")
    print("| recipe | best tau within SpecForge's time | at (s, epoch) | minus SpecForge (paired 95% CI) | last |\n"
          "|---|---|---|---|---|")
    for row in res["summary"]:
        b, d, last = row["best_within_specforge_time"], row.get("minus_specforge"), row["last"]
        print(f"| {row['recipe']} | " + (f"{b['tau']:.3f} ({b['tau_ci95'][0]:.2f}-{b['tau_ci95'][1]:.2f}) | "
                                         f"{b['seconds']:.0f} s, epoch {b['epoch']} | " if b else "none | - | ")
              + (f"{d['tau']:+.3f} ({d['ci95_paired'][0]:+.3f} to {d['ci95_paired'][1]:+.3f}) |" if d else "- |")
              + f" {last['tau']:.3f} at {last['seconds']:.0f} s, epoch {last['epoch']} |")


def study_main(ap, study, plot) -> None:
    """A study script's main after its arguments are declared (--out, --plot, --replot among them): --replot redraws
    --plot from a result JSON; else study(args) runs with its progress on stderr, and the result JSON goes to --out
    and stdout (and is drawn to --plot). ap.error when --replot lacks --plot or --out is missing."""
    a = ap.parse_args()
    if a.replot:
        if not a.plot:
            ap.error("--replot needs --plot")
        print(plot(json.loads(a.replot.read_text()), a.plot))
        return
    if not a.out:
        ap.error("--out is needed (unless --replot)")
    with contextlib.redirect_stdout(sys.stderr):                    # progress on stderr, the JSON alone on stdout
        res = study(a)
    text = json.dumps(res, indent=2)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(text)
    if a.plot:
        plot(res, a.plot)
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, help="PipelineConfig JSON (configs/e2e_gsm8k.json)")
    ap.add_argument("--recipes", type=Path, help="JSON {name: partial PipelineConfig}")
    ap.add_argument("--target", default=None, help="target directory instead of the config's target.model")
    ap.add_argument("--out", type=Path, default=None, help="result folder (default RUN_DIR/recipes)")
    ap.add_argument("--plot", type=Path, default=None, help="also write the plot here (e.g. docs/img/recipe_tau_time.png)")
    ap.add_argument("--only", default="", help="comma-separated recipe names to train now (default all)")
    ap.add_argument("--no-specforge", action="store_true", help="do not train SpecForge now (reuse its cache)")
    ap.add_argument("--no-measure", action="store_true", help="train only; measure in a later call")
    ap.add_argument("--workers", type=int, default=1, help="processes that measure drafts")
    ap.add_argument("--measure-device", default="cpu", help="where the evaluator runs ('cpu', 'cuda')")
    ap.add_argument("--record-batch", type=int, default=1,
                    help="held-out prompts per batched greedy generate of the replay's recording (64 on a GPU: "
                         "seconds instead of minutes; 1: one prompt at a time, the decoding evaluator's baseline)")
    ap.add_argument("--evaluator", choices=("replay", "decode"), default="replay",
                    help="replay: the drafts against one recording of the target (replay_eval, fast); decode: "
                         "speculative decoding with the target at every verify step (scaling_study.measure_drafts)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where SpecForge trains")
    ap.add_argument("--replot", type=Path, default=None,
                    help="only draw the plot and print the table of this results.json (e.g. one from a GPU host)")
    a = ap.parse_args()
    if a.replot:
        res = json.loads(a.replot.read_text())
        res["summary"] = summary(res["points"])
        report(res, None if a.plot else a.replot.parent, a.plot, res.get("title", a.replot.parent.name))
        return
    if not (a.config and a.recipes):
        ap.error("--config and --recipes are needed (unless --replot)")
    from eagle3_core.pipeline.vocab_stage import run_vocab
    from train_end_to_end import data_stages
    cfg = load_config(a.config)
    if a.target:
        cfg = cfg.model_copy(update={"target": TargetConfig(model=a.target)})
    recipes = json.loads(a.recipes.read_text())
    only = set(filter(None, a.only.split(","))) or set(recipes)
    if unknown := only - set(recipes):
        raise SystemExit(f"--only {sorted(unknown)}: not in {a.recipes} (it has {sorted(recipes)})")
    out = a.out or Path(cfg.run_dir) / "recipes"
    out.mkdir(parents=True, exist_ok=True)
    data_stages(cfg)
    features_seconds = features_once(cfg, out)
    run_vocab(cfg, log=lambda s: None)               # SpecForge's draft vocab: the config's own
    print(f"== features: {features_seconds:.1f} s", flush=True)
    trained = {}
    for name, recipe in recipes.items():
        here = Path(cfg.run_dir) / "recipes" / name / "trained.json"
        if name in only:
            trained[name] = train_ours(cfg, name, recipe, features_seconds)
        elif here.exists():
            trained[name] = json.loads(here.read_text())
    sf_file = Path(cfg.run_dir) / "recipes" / "specforge" / "trained.json"
    sf = (json.loads(sf_file.read_text()) if sf_file.exists() else None) if a.no_specforge else \
        train_specforge(cfg, torch.device(a.device))
    dirs = [e["dir"] for name, t in trained.items()
            for e in (t["epochs"][-1:] if recipes[name].get("measure") == "last" else t["epochs"])]
    dirs += [e["dir"] for e in (sf or {}).get("epochs", [])]
    if not a.no_measure:
        recorded = None if a.evaluator == "decode" else \
            recording(cfg, a.measure_device, out / "recording.pt", a.record_batch)
        measure_all(cfg, dirs, a.workers, a.measure_device, recorded)
    points = [p for name, t in trained.items() for p in points_of("ours", name, t)]
    points += points_of("specforge", "specforge", sf) if sf else []
    res = {"config": str(a.config), "recipes": recipes, **eval_settings(cfg), "features_seconds": features_seconds,
           "points": points, "summary": summary(points)}
    res["title"] = (f"{Path(a.config).stem}: {len(res['eval_ids'] or [])} held-out prompts, chain of "
                    f"{cfg.eval.num_draft_steps}, {cfg.eval.max_new_tokens} new tokens")
    (out / "results.json").write_text(json.dumps(res, indent=2))
    report(res, out, a.plot, res["title"])
    print(f"written to {out / 'results.json'}")


if __name__ == "__main__":
    main()
