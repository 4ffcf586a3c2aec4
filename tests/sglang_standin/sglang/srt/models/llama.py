"""Stand-in for sglang 0.5.14 `srt/models/llama.py` (see sglang/__init__.py): its EAGLE-3 layer-id rule."""
from __future__ import annotations

from sglang.srt.models._standin_decoder import StandinCausalLM, StandinModel


class LlamaModel(StandinModel):
    pass


class LlamaForCausalLM(StandinCausalLM):
    _decoder = LlamaModel

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        # upstream: None -> the inputs of [2, L // 2, L - 3]; ids are layer outputs, captured as inputs of id + 1
        self.capture_aux_hidden_states = True
        if layer_ids is None:
            L = self.config.num_hidden_layers
            self.model.layers_to_capture = [2, L // 2, L - 3]
        else:
            self.model.layers_to_capture = [i + 1 for i in layer_ids]
