"""Sampling settings in one shape: the regeneration's (GenerationConfig's own fields), the evaluation's
(eval.sampling) and the declared serving settings (eval.serving), compared in the report (pipeline.report)."""
from __future__ import annotations

from pydantic import Field

from eagle3_core.config.strict import StrictModel


class SamplingConfig(StrictModel):
    """Temperature, top-k and top-p as every engine here applies them (SGLang, vLLM, transformers: temperature,
    then top-k, then top-p; llama.cpp's default chain applies top-k and top-p before temperature:
    evaluation.replay_sampled.filtered_probs), and the seed of sampled runs. temperature 0 is greedy (argmax)."""
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy (the default for regeneration and evaluation)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling (1.0: off); recorded beside temperature")
    top_k: int = Field(0, ge=0, description="keep the k most probable tokens (0: off)")
    seed: int = Field(0, ge=0, description="seed of sampled runs (temperature > 0): trajectories and coin flips of "
                                           "the replay, the `seed` regeneration sends")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

