"""A stage as one frozen row: every fact the rest of the pipeline reads about it (its directory, upstream stages,
inputs key and the older keys it accepts, body, outputs, intact check, shard hooks, summary fields, timeout,
tags). Each stage module ends with its row (`ROW`, the deploy module's two `LLAMA_CPP_ROW` and `SGLANG_ROW`);
pipeline.table lists them in order (`STAGES`, the only table), and the done decision (pipeline.run), the key
upstreams (keys.upstream_keys, keys.UPSTREAM), the Prefect tasks (tasks/stage_tasks.py), the summary lines and the
report read it.

A new stage is its module with its row, registered (`register`) by pipeline.table or by the code that adds it (a
test's toy stage), and a flow: nothing else names it."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from eagle3_core.config import PipelineConfig
from eagle3_core.contract.layout import STAGE_DIRS

KeyFn = Callable[[PipelineConfig, dict], str]
OlderFn = Callable[[PipelineConfig, dict], tuple[str, ...]]
IntactFn = Callable[[PipelineConfig], Callable[[dict], list[str]] | None]


def no_older_keys(cfg: PipelineConfig, up: dict) -> tuple[str, ...]:
    """The older keys of a stage whose key formula never changed: none."""
    return ()


@dataclass(frozen=True)
class Shards:
    """The hooks of a stage run as one task per shard: `run(cfg, shard, log=..., ...)` one shard's record,
    `finish(cfg, shard_manifests, ...)` the stage's manifest from them; for the shards' done decisions
    (pipeline.run.decide_shards, decide_shard), given `up` (the upstream keys, read once): `status(cfg, up)`
    {'shards': ids, 'done': finished ids, 'records': {finished id: its record}, ...} for planning, `done(cfg,
    shard, up)` one shard's record if it is finished, else None; `task`/`finish_task` the Prefect task names,
    `tags`/`timeout_h` the shard task's."""
    run: Callable[..., dict]
    finish: Callable[..., dict]
    status: Callable[[PipelineConfig, dict], dict]
    done: Callable[[PipelineConfig, int, dict], dict | None]
    task: str
    finish_task: str
    tags: tuple[str, ...] = ()
    timeout_h: float | None = None


@dataclass(frozen=True)
class Stage:
    """A row of the stage table.

    name: the stage's name (flows, tasks, manifests' readers and `up` name it so). key(cfg, up): the inputs key its
    manifest holds when it is done, from the config and `up`, {upstream stage: its manifest's inputs_key}.
    upstream: the stages whose outputs it reads and whose keys its own names. directory: its directory under the run
    directory (default: contract.layout.STAGE_DIRS, where the layers below the pipeline read the built-in stages'
    directories; a new stage names its own, and `register` adds it there). older(cfg, up): the keys of older
    formulas a finished run's manifest may hold for the same settings (contract.compat), also done. intact(cfg): the
    check of outputs its manifest's `files` record does not cover (the shards of generation and features).
    body(cfg, log=..., ...): the stage run whole, returning its manifest (its `progress` hook named by `progress`:
    (keyword, unit) of the progress artifact the task moves). outputs: files (relative to its directory) its
    manifest records and its done check compares. shards: the hooks of a sharded stage (Shards). summary: the
    manifest fields its summary line names (scalars; a field a manifest lacks is left out). timeout_h: its task's
    timeout in hours (None: none). tags: its task's tags ('gpu', 'server': concurrency limits). in_report: the
    run report needs its manifest (False: read where present)."""
    name: str
    key: KeyFn
    body: Callable[..., dict] | None = None
    upstream: tuple[str, ...] = ()
    directory: str = ""
    older: OlderFn = no_older_keys
    intact: IntactFn | None = None
    outputs: tuple[str, ...] = ()
    shards: Shards | None = None
    summary: tuple[str, ...] = ()
    timeout_h: float | None = None
    tags: tuple[str, ...] = ()
    progress: tuple[str, str] | None = None
    in_report: bool = True
    doc: str = field(default="", compare=False)

    def __post_init__(self):
        if not self.directory:
            if self.name not in STAGE_DIRS:
                raise ValueError(f"stage {self.name!r}: give its directory (Stage(directory=...)): it is not one "
                                 f"of the built-in stages' ({', '.join(STAGE_DIRS)})")
            object.__setattr__(self, "directory", STAGE_DIRS[self.name])


# the rows registered, in pipeline order (pipeline.table registers the built-in stages)
STAGES: dict[str, Stage] = {}


def register(row: Stage) -> Stage:
    """Add `row` to the stage table (STAGES, after those registered before it) and its directory to the run layout's
    (contract.layout.STAGE_DIRS, so that RunLayout.stage_dir and the upstream reads find it); returns it. A stage
    registered again is replaced in its place. Raises ValueError for an upstream stage not registered before it, or
    a directory another stage has."""
    if (missing := [u for u in row.upstream if u not in STAGES]):
        raise ValueError(f"stage {row.name!r}: its upstream stages {missing} are not in the table: register them "
                         f"first")
    if (other := next((n for n, d in STAGE_DIRS.items() if d == row.directory and n != row.name), None)):
        raise ValueError(f"stage {row.name!r}: directory {row.directory!r} is the {other} stage's: name another")
    STAGE_DIRS[row.name] = row.directory
    STAGES[row.name] = row
    return row


def unregister(name: str) -> None:
    """Take stage `name` out of the table and the run layout (a test's toy stage, once the test is done)."""
    STAGES.pop(name, None)
    STAGE_DIRS.pop(name, None)


def row_of(stage: Stage | str) -> Stage:
    """The row of `stage` (a row, or a registered stage's name). Raises KeyError naming the stages registered."""
    if isinstance(stage, Stage):
        return stage
    if stage not in STAGES:
        raise KeyError(f"no stage {stage!r} in the stage table (pipeline.table.STAGES: {', '.join(STAGES)})")
    return STAGES[stage]
