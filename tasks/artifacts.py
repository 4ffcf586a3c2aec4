"""What people look at in the Prefect UI: progress bars (shards, requests, training epochs, evaluation prompts),
shard tables, the report (Markdown with its plots embedded), tables of tau and stage times, and a PNG plot of
acceptance. Artifact keys are lowercase-dash and name the run directory (`run_key`), so two runs (demo and
debug-tiny, or two run directories of one preset) never overwrite each other's artifacts."""
from __future__ import annotations

import base64
import hashlib
import re
import time
from contextlib import contextmanager
from pathlib import Path

from prefect.artifacts import (
    create_image_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from eagle3_core.contract.layout import RunLayout
from eagle3_core.contract.numbers import eta_text
from eagle3_core.pipeline.report import embed_images
from eagle3_core.pipeline.report_numbers import RUN_NAMES, before_training_label


def run_key(run_dir: Path | str, name: str) -> str:
    """Artifact key `<name>-<run dir name>-<6 hex of its absolute path>`, e.g. 'eagle3-report-demo-3f9a1c':
    readable, one per run directory (two folders named 'demo' under different roots differ by the hash)."""
    path = Path(run_dir).resolve()
    slug = re.sub(r"[^a-z0-9]+", "-", path.name.lower()).strip("-")[:40] or "run"
    return f"{name}-{slug}-{hashlib.sha1(str(path).encode()).hexdigest()[:6]}"


class PipelineProgress:
    """The progress artifact `pipeline-progress-<run>` of the pipeline's own flow run (the page a user opens):
    'stage k of N: <the running stage's latest progress line>', its bar at (k - 1 + the stage's fraction) / N. The
    stages' bars (Progress, RequestProgress) mirror into it while it is registered for their run directory
    (`pipeline_progress`), so the parent run shows what each stage's page shows."""

    def __init__(self, run_dir: Path, stages: list[str]):
        self.stages, self.stage = list(stages), None
        self.id = create_progress_artifact(0.0, key=run_key(run_dir, "pipeline-progress"),
                                           description=f"pipeline: {len(self.stages)} stages to run")

    def enter(self, stage: str) -> None:
        """Stage `stage` starts (a name of `stages`; others are ignored)."""
        if stage in self.stages:
            self.stage = stage
            self.show(f"{stage}: started", 0.0)

    def show(self, line: str, fraction: float) -> None:
        if self.stage is None:
            return
        k, n = self.stages.index(self.stage), len(self.stages)
        update_progress_artifact(self.id, 100.0 * (k + min(max(fraction, 0.0), 1.0)) / n,
                                 description=f"stage {k + 1} of {n}: {line}")


_pipelines: dict[str, PipelineProgress] = {}           # run directory (resolved) -> its pipeline's progress


@contextmanager
def pipeline_progress(run_dir: Path, stages: list[str]):
    """Inside the pipeline flow: create its PipelineProgress and let the stages of `run_dir` mirror into it."""
    key = str(Path(run_dir).resolve())
    _pipelines[key] = PipelineProgress(run_dir, stages)
    try:
        yield _pipelines[key]
        update_progress_artifact(_pipelines[key].id, 100.0, description="pipeline: every stage done")
    finally:
        _pipelines.pop(key, None)


def stage_started(run_dir: Path, stage: str) -> None:
    """Tell the pipeline's progress (if a pipeline runs `run_dir`) that `stage` has started."""
    if (parent := _pipelines.get(str(Path(run_dir).resolve()))) is not None:
        parent.enter(stage)


def mirror_to_pipeline(run_dir: Path, line: str, fraction: float) -> None:
    """Show a stage's progress line in its pipeline's progress artifact (nothing if no pipeline runs `run_dir`)."""
    if (parent := _pipelines.get(str(Path(run_dir).resolve()))) is not None:
        parent.show(line, fraction)


class Progress:
    """A progress artifact `<name>-progress-<run>` moved by `update(done, total, what)`; its description reads
    'done of total <what>' with an ETA (mirrored into the pipeline's progress, mirror_to_pipeline)."""

    def __init__(self, run_dir: Path, name: str, total: int, what: str):
        self.name, self.what, self.total, self.t0 = name, what, total, time.monotonic()
        self.run_dir = run_dir
        self.id = create_progress_artifact(0.0, key=run_key(run_dir, f"{name}-progress"),
                                           description=f"{name}: 0 of {total} {what}")

    def update(self, done: int, total: int | None = None, detail: str = "") -> None:
        self.total = total or self.total
        desc = (f"{self.name}: {done} of {self.total} {self.what}{detail}"
                f"{eta_text(time.monotonic() - self.t0, done, self.total - done)}")
        update_progress_artifact(self.id, 100.0 * done / max(self.total, 1), description=desc)
        mirror_to_pipeline(self.run_dir, desc, done / max(self.total, 1))


def progress_callback(run_dir: Path, name: str, what: str):
    """A callback (done, total, detail='') that creates the progress artifact `<name>-progress-<run>` on its first
    call and moves it after: a stage that finds its work done on disk publishes no bar stuck at 0%."""
    bars: list[Progress] = []

    def update(done: int, total: int, detail: str = "") -> None:
        if not bars:
            bars.append(Progress(run_dir, name, total, what))
        bars[0].update(done, total, detail)
    return update


class ShardProgress(Progress):
    """A progress artifact `<stage>-progress-<run>` that moves as shards finish."""

    def __init__(self, run_dir: Path, stage: str, total: int):
        super().__init__(run_dir, stage, total, "shards finished")
        self.done = 0

    def step(self) -> None:
        self.done += 1
        self.update(self.done)


class RequestProgress:
    """A progress artifact `<key>-progress-<run>` fed by regenerate's progress snapshots (done/total prompts,
    output tok/s, failures, retries in its description)."""

    def __init__(self, run_dir: Path, key: str):
        self.key, self.id, self.run_dir, self.name = run_key(run_dir, f"{key}-progress"), None, run_dir, key

    def update(self, snap: dict) -> None:
        desc = (f"{snap['done']} of {snap['total']} prompts, {snap['recent_tokens_per_s']:.0f} output tok/s, "
                f"{snap['failed']} failed, {snap['retries']} retries"
                + (f", ETA {snap['eta_s'] / 60:.1f} min" if snap.get("eta_s") is not None else ""))
        if self.id is None:
            self.id = create_progress_artifact(100.0 * snap["fraction"], key=self.key, description=desc)
        else:
            update_progress_artifact(self.id, 100.0 * snap["fraction"], description=desc)
        mirror_to_pipeline(self.run_dir, f"{self.name}: {desc}", snap["fraction"])


# shard record fields a person does not read: content hashes, cache keys, nanosecond file times
UNREAD_FIELDS = ("sha256", "rows_sha256", "inputs_key", "mtime_ns", "ended_at")


def readable_shard_row(record: dict) -> dict:
    """One shard record as a table row a person reads: shard first, counts as they are, `seconds` to 0.1 s,
    `bytes` as MB to 0.01, `started_at` (Unix seconds) as 'HH:MM:SS' UTC, other floats to 4 significant digits;
    hashes, keys, nanosecond times and nested fields (lists, dicts) left out."""
    row = {"shard": record.get("shard")}
    for k, v in record.items():
        if k in UNREAD_FIELDS or k == "shard" or isinstance(v, bool) or not isinstance(v, (int, float, str)):
            continue
        if k == "started_at":
            row["started (UTC)"] = time.strftime("%H:%M:%S", time.gmtime(v))
        elif k == "bytes":
            row["MB"] = round(v / 1e6, 2)
        elif k == "seconds":
            row["seconds"] = round(v, 1)
        elif isinstance(v, float):
            row[k] = float(f"{v:.4g}")
        else:
            row[k] = v
    return row


def shard_table(run_dir: Path, stage: str, rows: list[dict]) -> None:
    """Table artifact `<stage>-shards-<run>`: one row per shard (readable_shard_row)."""
    create_table_artifact([readable_shard_row(r) for r in rows], key=run_key(run_dir, f"{stage}-shards"),
                          description=f"{stage}: one row per shard")


def acceptance_plot(summary: dict, history: list[dict], path: Path) -> Path:
    """PNG: acceptance per draft position (trained vs untrained, offline) and simulated tau per training epoch."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ev = summary["eval"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    for key, name in RUN_NAMES.items():
        name = name.replace("untrained", before_training_label(summary))
        if key not in ev:
            continue
        acc = ev[key]["accept_per_position"]
        a.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{name} (tau {ev[key]['tau']:.2f})")
    a.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1), title="Acceptance per position",
          xticks=range(1, len(ev["trained"]["accept_per_position"]) + 1))
    a.legend()
    b.plot([h["epoch"] for h in history], [h["train"]["tau_sim"] for h in history], marker=".")
    b.set(xlabel="epoch", ylabel="simulated tau (train)", title="Training")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def acceptance_rows(summary: dict) -> list[dict]:
    """The `eagle3-acceptance` table: one row per measured run (trained chain, trained tree, untrained chain, the
    trained draft on llama.cpp) under distinct names, tau and its 95% interval to 3 decimals."""
    ev, rows = summary["eval"], []
    for key, name in RUN_NAMES.items():
        name = name.replace("untrained", before_training_label(summary))
        if key in ev:
            d = ev[key]
            rows.append({"draft": name, "tau": round(d["tau"], 3), "tau_ci95_low": round(d["tau_ci95"][0], 3),
                         "tau_ci95_high": round(d["tau_ci95"][1], 3), "prompts": d.get("prompts"),
                         "tokens_per_s": round(d["tokens_per_s"], 1), "where": "offline (HF target verifies)"})
    if (lc := summary.get("llama_cpp")):
        rows.append({"draft": "trained, llama.cpp", "tau": round(lc["tau"], 3),
                     "tau_ci95_low": round(lc["tau_ci95"][0], 3), "tau_ci95_high": round(lc["tau_ci95"][1], 3),
                     "prompts": summary.get("eval_prompts"), "tokens_per_s": round(lc["tokens_per_s"], 1),
                     "where": "llama.cpp draft-eagle3"})
    return rows


def publish_report(summary: dict, markdown: str, history: list[dict], run_dir: Path) -> None:
    """Markdown report (plots embedded as data URIs: the UI cannot read files of the run directory), tau and
    stage-time tables and the acceptance plot as artifacts of the current run, keyed by the run directory."""
    create_markdown_artifact(embed_images(markdown, run_dir), key=run_key(run_dir, "eagle3-report"),
                             description=f"EAGLE-3 draft report of {run_dir}")
    create_table_artifact(acceptance_rows(summary), key=run_key(run_dir, "eagle3-acceptance"),
                          description="Acceptance length tau of the drafts (95% bootstrap interval over prompts)")
    create_table_artifact([{"stage": k, "seconds": v} for k, v in summary["stage_seconds"].items()],
                          key=run_key(run_dir, "eagle3-stage-times"), description="Wall time per stage (s)")
    png = acceptance_plot(summary, history, RunLayout(run_dir).report_acceptance_png)
    # the UI shows an image artifact from a URL: a data URL keeps the small PNG self-contained
    url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    create_image_artifact(url, key=run_key(run_dir, "eagle3-acceptance-plot"),
                          description=f"{png} (acceptance and training)")
