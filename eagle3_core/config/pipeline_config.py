"""The whole run's configuration (PipelineConfig composes the stage configs), named presets and config files."""
from __future__ import annotations

from pathlib import Path

from pydantic import Field, ValidationError

from eagle3_core.config.eval_config import EvalConfig, SGLangDeployConfig
from eagle3_core.config.feature_config import FeatureConfig
from eagle3_core.config.generation_config import GenerationConfig, ServerConfig
from eagle3_core.config.prompt_config import PromptConfig
from eagle3_core.config.sampling_config import SamplingConfig
from eagle3_core.config.strict import StrictModel
from eagle3_core.config.target_config import TargetConfig
from eagle3_core.config.train_config import DraftConfig, TrainConfig


class PipelineConfig(StrictModel):
    run_dir: Path = Field(Path("runs/demo"), description="every stage writes under this directory")
    target: TargetConfig = Field(TargetConfig(), description="the model the draft serves (weights, revision)")
    prompts: PromptConfig = Field(PromptConfig(), description="prompt sources and the train / held-out split")
    server: ServerConfig = Field(ServerConfig(), description="the inference server that regenerates answers")
    generation: GenerationConfig = Field(GenerationConfig(), description="regeneration: sampling, shards, quality gate")
    features: FeatureConfig = Field(FeatureConfig(), description="aux hidden states: backend, format, max length")
    draft: DraftConfig = Field(DraftConfig(), description="the draft model's shape and vocab size")
    train: TrainConfig = Field(TrainConfig(), description="TTT training: epochs, lr, warm start")
    eval: EvalConfig = Field(EvalConfig(), description="offline tau on the held-out prompts")
    deploy_sglang: SGLangDeployConfig = Field(SGLangDeployConfig(), description="the SGLang benchmark (GPU hosts)")
    sglang_python: str | None = Field(None, description="the python of an environment holding SGLang with its own "
                                      "pinned torch and transformers (`make sglang-env`: '.venv-sglang/bin/python', "
                                      "relative to the directory the run starts in): it runs features.backend "
                                      "'sglang' and the SGLang servers of generation (server.kind 'sglang') and "
                                      "deploy-sglang. None: this process's python")


def preset(name: str, run_dir: str | Path | None = None) -> PipelineConfig:
    """Named presets. `demo`: the embedded default at the sizes of `make demo`. `debug_tiny`: a handful of prompts
    for the end-to-end test. Raises ValueError for an unknown name."""
    if name == "demo":
        cfg = PipelineConfig(
            prompts=PromptConfig(num_train=120, num_eval=16),
            # 8 slots: ~178 tok/s on 2 cores vs ~158 with 4 (measured)
            server=ServerConfig(parallel=8, ctx_per_slot=1024),
            # 32-prompt shards; ~half of the 256-token answers are cut at the limit (measured: 58 of 120), and the
            # 135M target's greedy answers loop now and then (measured: 9 of 120 end in a runaway repetition)
            generation=GenerationConfig(max_new_tokens=256, concurrency=8, shard_size=32, max_truncated_frac=0.7,
                                        max_degenerate_frac=0.15),
            features=FeatureConfig(max_length=1024),
            # HumanEval answers use ~1.2K distinct tokens: a 2K draft vocab covers them and keeps lm_head cheap
            draft=DraftConfig(draft_vocab_size=2048),
            # 2 CPU cores: 3 TTT steps and 3 draft tokens keep the whole demo within 15 minutes
            # no eval split: 5% of 120 samples is too few to pick an epoch by (it picked epoch 3 of 7 once); the
            # held-out prompts measure the last epoch instead
            train=TrainConfig(epochs=6, lr=1e-3, batch_tokens=4096, ttt_length=3, eval_frac=0.0),
            # tree run on all 16 held-out prompts (~+100 s), paid for by measuring the untrained draft (tau ~1.0
            # by construction) on 4 prompts instead of 16 (~-110 s)
            # a declared serving temperature of 0.7: tau at T = 0 and 0.7, offline and on llama.cpp (2 sampled
            # trajectories per held-out prompt)
            eval=EvalConfig(num_draft_steps=3, max_new_tokens=128, tree_topk=4, tree_num_draft_tokens=8,
                            untrained_prompts=4, serving=SamplingConfig(temperature=0.7), sampled_seeds=2),
        )
    elif name == "debug_tiny":
        cfg = PipelineConfig(
            run_dir=Path("runs/debug_tiny"),
            prompts=PromptConfig(num_train=6, num_eval=2),
            server=ServerConfig(parallel=2),
            # 64 tokens cut nearly every answer short and one looping answer is 17% of 6: the gate would stop this
            # smoke run (tests/test_generation.py tests the gate); 2 shards (6 prompts)
            generation=GenerationConfig(max_new_tokens=64, concurrency=2, shard_size=4, max_truncated_frac=1.0,
                                        max_degenerate_frac=1.0),
            features=FeatureConfig(max_length=512, shard_samples=4),
            draft=DraftConfig(draft_vocab_size=1024),
            # enough epochs to memorise the 6 training answers: deployment tests replay them (tau well above 1)
            train=TrainConfig(epochs=30, lr=2e-3, ttt_length=3, eval_frac=0.0),
            eval=EvalConfig(num_draft_steps=3, max_new_tokens=16, tree_topk=2, tree_num_draft_tokens=6),
        )
    else:
        raise ValueError(f"unknown preset {name!r}; choose 'demo' or 'debug_tiny'")
    if run_dir is not None:
        cfg.run_dir = Path(run_dir)
    return cfg


class ConfigFileError(ValueError):
    """A configuration file that cannot be read as a PipelineConfig; the message names the file and each field."""


def load_config(path: str | Path) -> PipelineConfig:
    """Read a PipelineConfig from a JSON file. Raises ConfigFileError naming the file and, for each bad field, its
    location and the reason (an unknown field also names the nearest valid one); FileNotFoundError if missing."""
    path = Path(path)
    text = path.read_text()
    try:
        return PipelineConfig.model_validate_json(text)
    except ValidationError as e:
        lines = [f"  {'.'.join(str(x) for x in err['loc']) or '(top level)'}: {err['msg']}" for err in e.errors()]
        raise ConfigFileError(f"config file {path}: {e.error_count()} bad field(s)\n" + "\n".join(lines)) from None


def config_or_preset(arg: str) -> PipelineConfig:
    """A PipelineConfig from a JSON file path (config.load_config: errors name the file and each bad field) or a
    preset name. Raises ValueError for neither."""
    if Path(arg).is_file():
        return load_config(arg)
    return preset(arg)
