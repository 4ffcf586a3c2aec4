"""What people look at in the Prefect UI: shard progress bars, shard tables, the report (Markdown), tables of
tau and stage times, and a PNG plot of acceptance. Artifact keys are lowercase-dash."""
from __future__ import annotations

import base64
from pathlib import Path

from prefect.artifacts import (
    create_image_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)


class ShardProgress:
    """A progress artifact `<stage>-progress` that moves as shards finish."""

    def __init__(self, stage: str, total: int):
        self.total, self.done = total, 0
        self.id = create_progress_artifact(0.0, key=f"{stage}-progress",
                                           description=f"{stage}: shards finished of {total}")

    def step(self) -> None:
        self.done += 1
        update_progress_artifact(self.id, 100.0 * self.done / max(self.total, 1))


class RequestProgress:
    """A progress artifact `<key>-progress` fed by regenerate's progress snapshots (done/total prompts, output
    tok/s, failures, retries in its description)."""

    def __init__(self, key: str):
        self.key, self.id = key, None

    def update(self, snap: dict) -> None:
        desc = (f"{snap['done']}/{snap['total']} prompts, {snap['recent_tokens_per_s']:.0f} output tok/s, "
                f"{snap['failed']} failed, {snap['retries']} retries")
        if self.id is None:
            self.id = create_progress_artifact(100.0 * snap["fraction"], key=f"{self.key}-progress", description=desc)
        else:
            update_progress_artifact(self.id, 100.0 * snap["fraction"], description=desc)


def shard_table(stage: str, rows: list[dict]) -> None:
    """Table artifact `<stage>-shards`: one row per shard with its counts (columns: the manifests' scalar fields)."""
    keep = [{k: v for k, v in r.items() if isinstance(v, (int, float, str)) and k not in ("sha256", "inputs_key")}
            for r in rows]
    create_table_artifact(keep, key=f"{stage}-shards", description=f"{stage}: one row per shard")


def acceptance_plot(summary: dict, history: list[dict], path: Path) -> Path:
    """PNG: acceptance per draft position (trained vs untrained, offline) and simulated tau per training epoch."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ev = summary["eval"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    for name in ("trained", "untrained"):
        acc = ev[name]["accept_per_position"]
        a.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{name} (tau {ev[name]['tau']:.2f})")
    a.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1), title="Acceptance per position",
          xticks=range(1, len(ev["trained"]["accept_per_position"]) + 1))
    a.legend()
    b.plot([h["epoch"] for h in history], [h["train"]["tau_sim"] for h in history], marker=".")
    b.set(xlabel="epoch", ylabel="simulated tau (train)", title="Training")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def publish_report(summary: dict, markdown: str, history: list[dict], run_dir: Path) -> None:
    """Markdown report, tau and stage-time tables and the acceptance plot as artifacts of the current run."""
    create_markdown_artifact(markdown, key="eagle3-report", description="EAGLE-3 draft report")
    ev = summary["eval"]
    rows = [{"draft": n, "tau": round(ev[n]["tau"], 3), "tau_ci95": str(ev[n]["tau_ci95"]),
             "tokens_per_s": round(ev[n]["tokens_per_s"], 1), "where": "offline (HF target verifies)"}
            for n in ("trained", "untrained")]
    if (lc := summary.get("llama_cpp")):
        rows.append({"draft": "trained", "tau": round(lc["tau"], 3), "tau_ci95": str(lc["tau_ci95"]),
                     "tokens_per_s": round(lc["tokens_per_s"], 1), "where": "llama.cpp draft-eagle3"})
    create_table_artifact(rows, key="eagle3-acceptance", description="Acceptance length tau of the drafts")
    create_table_artifact([{"stage": k, "seconds": v} for k, v in summary["stage_seconds"].items()],
                          key="eagle3-stage-times", description="Wall time per stage (s)")
    png = acceptance_plot(summary, history, run_dir / "report_acceptance.png")
    # the UI shows an image artifact from a URL: a data URL keeps the small PNG self-contained
    url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    create_image_artifact(url, key="eagle3-acceptance-plot", description=f"{png} (acceptance and training)")

