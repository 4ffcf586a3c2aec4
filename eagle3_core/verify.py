"""Full verification of a run's data files: every feature shard and generation shard read in full and checked
against the sha256 its record holds.

Done checks during a run cost metadata only (manifest.file_intact: size and mtime against the record); this is the
explicit, expensive check, for after a copy between machines or when a disk is suspect. At the reference case's
9 TB it reads 9 TB: run it on purpose, not on every rerun.

    python -m eagle3_core.verify RUN_DIR [--quarantine]

Exit 0: every file matches. Exit 1: the bad files are named; with --quarantine they are renamed to
`<name>.corrupt`, so that the next run of the stage redoes exactly those shards (nothing else is lost).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_core.contract.layout import RunLayout
from eagle3_core.contract.manifest import read_manifest, shard_records
from eagle3_core.features.store import bad_shards


@dataclass
class VerifyReport:
    """What verify_run read: per stage the shard count and bytes checked; `bad` the paths that failed."""
    checked: dict[str, int] = field(default_factory=dict)
    bytes_read: int = 0
    seconds: float = 0.0
    bad: list[Path] = field(default_factory=list)


def _generation_records(out: Path) -> list[dict]:
    return [rec for rec in shard_records(out) if rec.get("complete") and "sha256" in rec]


def verify_run(run_dir: Path, threads: int = 4) -> VerifyReport:
    """Check every listed feature shard (features/manifest.json) and every finished generation shard
    (generations/shard_*.json) of `run_dir` by sha256 (manifest.file_intact with checksum=True). Returns a
    VerifyReport; reads each file in full. Raises FileNotFoundError if `run_dir` is not a directory."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a run directory")
    layout, report, t0 = RunLayout(run_dir), VerifyReport(), time.monotonic()
    for stage, out, entries in [
            ("features", layout.features, (read_manifest(layout.manifest("features")) or {}).get("shards", [])),
            ("generation", layout.generations, _generation_records(layout.generations))]:
        report.checked[stage] = len(entries)
        report.bytes_read += sum((out / e["file"]).stat().st_size for e in entries if (out / e["file"]).exists())
        report.bad += [out / name for name in bad_shards(out, entries, threads, checksum=True)]
    report.seconds = time.monotonic() - t0
    return report


def quarantine(paths: list[Path]) -> list[Path]:
    """Rename each existing path to `<name>.corrupt` (kept for inspection); the stage's next run sees the shard
    missing and redoes it alone. Returns the new paths."""
    moved = []
    for p in paths:
        if p.exists():
            moved.append(p.rename(p.with_name(p.name + ".corrupt")))
    return moved


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Read every feature and generation shard of a run in full and check "
                                            "its sha256 against its record (done checks use size and mtime only).")
    p.add_argument("run_dir", help="the run directory (e.g. runs/demo)")
    p.add_argument("--quarantine", action="store_true",
                   help="rename bad shards to <name>.corrupt so that the next run redoes exactly those")
    p.add_argument("--threads", type=int, default=4, help="files hashed at once")
    a = p.parse_args(argv)
    try:
        report = verify_run(Path(a.run_dir), a.threads)
    except FileNotFoundError as e:
        print(f"verify: {e}", file=sys.stderr)
        return 2
    checked = ", ".join(f"{n} {stage} shards" for stage, n in report.checked.items())
    print(f"verify: {checked}; {report.bytes_read / 1e9:.3f} GB read in {report.seconds:.1f} s")
    if not report.bad:
        print("verify: every shard matches its sha256")
        return 0
    for path in report.bad:
        print(f"verify: BAD {path} (missing, resized or sha256 mismatch)", file=sys.stderr)
    if a.quarantine:
        moved = quarantine(report.bad)
        print(f"verify: {len(moved)} file(s) renamed to *.corrupt; rerun the pipeline (or the stage): it redoes "
              f"exactly those shards", file=sys.stderr)
    else:
        print("verify: rerun with --quarantine to move them aside; the next run then redoes exactly those shards",
              file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
