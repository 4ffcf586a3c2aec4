"""One flow per pipeline stage, so a user can run (or schedule) any stage alone from the UI."""
from __future__ import annotations

from prefect import flow

from eagle3_core.config import PipelineConfig, preset
from tasks import stages as t


def _cfg(config: PipelineConfig | None) -> PipelineConfig:
    return config or preset("demo")


@flow(name="prompts")
def prompts_flow(config: PipelineConfig | None = None) -> dict:
    """Load, dedupe and split prompts into train and held-out sets."""
    return t.prompts_task(_cfg(config))


@flow(name="generation")
def generation_flow(config: PipelineConfig | None = None) -> dict:
    """Regenerate responses with the target on an inference server (started and stopped here for llama.cpp)."""
    return t.generation_task(_cfg(config))


@flow(name="features")
def features_flow(config: PipelineConfig | None = None) -> dict:
    """Tokenize with loss masks, then extract the target's aux hidden states."""
    cfg = _cfg(config)
    t.tokenize_task(cfg)
    return t.features_task(cfg)


@flow(name="vocab")
def vocab_flow(config: PipelineConfig | None = None) -> dict:
    """Build the draft vocab map (d2t, t2d)."""
    return t.vocab_task(_cfg(config))


@flow(name="train")
def train_flow(config: PipelineConfig | None = None) -> dict:
    """Train the EAGLE-3 draft with training-time test and export it for SGLang."""
    return t.train_task(_cfg(config))


@flow(name="evaluate")
def evaluate_flow(config: PipelineConfig | None = None) -> dict:
    """Measure tau of the trained and an untrained draft on held-out prompts."""
    return t.evaluate_task(_cfg(config))


@flow(name="deploy-llama-cpp")
def deploy_llama_cpp_flow(config: PipelineConfig | None = None) -> dict:
    """Serve the draft on llama.cpp's EAGLE-3 mode and benchmark it against the same server without a draft."""
    return t.deploy_llama_cpp_task(_cfg(config))
