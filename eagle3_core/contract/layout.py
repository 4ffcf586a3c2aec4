"""The run layout: every path under a run directory, written once. One directory per stage (STAGE_DIRS), each with
manifest.json, plus the files other stages read."""
from __future__ import annotations

from pathlib import Path

# each built-in stage's directory under the run directory, which the layers below the pipeline read through
# RunLayout; a stage's row (eagle3_core.pipeline.stage.Stage) takes its directory from here, and a stage added later
# names its own, which registering its row adds here (stage.register)
STAGE_DIRS = {"prompts": "prompts", "generation": "generations", "tokenize": "tokenized", "features": "features",
              "vocab": "vocab", "train": "draft", "evaluate": "eval", "deploy-llama-cpp": "deploy_llama_cpp",
              "deploy-sglang": "deploy_sglang"}


class RunLayout:
    """Paths of one run directory. `RunLayout(cfg.run_dir).features` is run_dir/features, and so on."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)

    def stage_dir(self, stage: str) -> Path:
        """Directory of stage `stage` (a name of the stage table)."""
        return self.run_dir / STAGE_DIRS[stage]

    def manifest(self, stage: str) -> Path:
        """manifest.json of stage `stage`."""
        return self.stage_dir(stage) / "manifest.json"

    @property
    def prompts(self) -> Path:
        return self.stage_dir("prompts")

    @property
    def generations(self) -> Path:
        return self.stage_dir("generation")

    @property
    def tokenized(self) -> Path:
        return self.stage_dir("tokenize")

    @property
    def features(self) -> Path:
        return self.stage_dir("features")

    @property
    def vocab(self) -> Path:
        return self.stage_dir("vocab")

    @property
    def draft(self) -> Path:
        return self.stage_dir("train")

    @property
    def eval(self) -> Path:
        return self.stage_dir("evaluate")

    @property
    def deploy_llama_cpp(self) -> Path:
        return self.stage_dir("deploy-llama-cpp")

    @property
    def deploy_sglang(self) -> Path:
        return self.stage_dir("deploy-sglang")

    @property
    def prompts_train(self) -> Path:
        """prompts/train.parquet: the train prompts (rows of prompts.write_rows)."""
        return self.prompts / "train.parquet"

    @property
    def prompts_eval(self) -> Path:
        """prompts/eval.parquet: the held-out prompts (final assistant turn removed)."""
        return self.prompts / "eval.parquet"

    @property
    def tokenized_train(self) -> Path:
        """tokenized/train.parquet: id, input_ids, loss_mask per sample."""
        return self.tokenized / "train.parquet"

    @property
    def features_head(self) -> Path:
        """features/head.json: the inputs key and target id the feature store was last written for."""
        return self.features / "head.json"

    @property
    def vocab_map(self) -> Path:
        """vocab/vocab_map.safetensors: d2t, t2d, counts."""
        return self.vocab / "vocab_map.safetensors"

    @property
    def draft_export(self) -> Path:
        """draft/export: the exported draft (SGLang-loadable)."""
        return self.draft / "export"

    # files of the run as a whole, beside the stage directories
    @property
    def report_md(self) -> Path:
        """report.md: the run's report (tasks/report.py)."""
        return self.run_dir / "report.md"

    @property
    def report_json(self) -> Path:
        """report.json: the report's numbers; the next report reads its quiet speeds (the load flag)."""
        return self.run_dir / "report.json"

    @property
    def report_plots(self) -> Path:
        """plots/: the report's PNG plots (pipeline.report.write_plots)."""
        return self.run_dir / "plots"

    @property
    def report_acceptance_png(self) -> Path:
        """report_acceptance.png: the acceptance plot published as the UI's image artifact."""
        return self.run_dir / "report_acceptance.png"

    @property
    def report_on_policy(self) -> Path:
        """report_on_policy.json: the on-policy fraction per source, kept per feature store."""
        return self.run_dir / "report_on_policy.json"

    @property
    def nights(self) -> Path:
        """nights.json: the nightly runs' table (pipeline.nightly)."""
        return self.run_dir / "nights.json"

    @property
    def scaling(self) -> Path:
        """scaling/: the scaling study's points and plot (studies.scaling_study)."""
        return self.run_dir / "scaling"

    @property
    def team_bet(self) -> Path:
        """team_bet/: the team-bet study's recording and points (studies.team_bet_run)."""
        return self.run_dir / "team_bet"

    def relative(self, path: Path) -> str:
        """`path` (under the run directory) as a manifest stores it: relative to the run directory, so that a run
        directory copied or moved elsewhere still finds its own files (read back by `stored`)."""
        return Path(path).relative_to(self.run_dir).as_posix()

    def stored(self, value: str) -> Path:
        """A path a manifest stored, resolved under this run directory: relative to it (`relative`), or, as
        manifests stored it before (absolute, or relative to the directory the run started in, e.g.
        'runs/demo/draft/export'), from its stage directory on (the last part naming one of STAGE_DIRS), where
        that exists here. Any other path as stored."""
        path = Path(value)
        if not path.is_absolute() and (self.run_dir / path).exists():
            return self.run_dir / path
        parts = path.parts
        for i in range(len(parts) - 1, -1, -1):
            if parts[i] in STAGE_DIRS.values() and (self.run_dir / Path(*parts[i:])).exists():
                return self.run_dir / Path(*parts[i:])
        return path
