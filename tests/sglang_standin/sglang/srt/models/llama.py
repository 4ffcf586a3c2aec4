"""Stand-in for sglang 0.5.14 `srt/models/llama.py` (see sglang/__init__.py): its EAGLE-3 layer-id rule."""
from __future__ import annotations

from sglang.srt.models._standin_decoder import StandinCausalLM, StandinModel


class LlamaModel(StandinModel):
    pass


class LlamaForCausalLM(StandinCausalLM):
    _decoder = LlamaModel

    def _layer_inputs(self, layer_ids):
        # upstream set_eagle3_layers_to_capture: ids are layer outputs, captured as the inputs of id + 1
        return [i + 1 for i in layer_ids]
