"""Stand-in for sglang 0.5.14 `srt/models/deepseek_v2.py` (see sglang/__init__.py): its EAGLE-3 layer-id rule,
which adds one only when the first id is 1 (other ids are taken as layer inputs as they are)."""
from __future__ import annotations

from sglang.srt.models._standin_decoder import StandinCausalLM, StandinModel


class DeepseekV2Model(StandinModel):
    pass


class DeepseekV2ForCausalLM(StandinCausalLM):
    _decoder = DeepseekV2Model

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.capture_aux_hidden_states = True
        if layer_ids is None:
            L = self.config.num_hidden_layers
            self.model.layers_to_capture = [2, L // 2, L - 3]
        elif layer_ids and layer_ids[0] == 1:
            self.model.layers_to_capture = [i + 1 for i in layer_ids]
        else:
            self.model.layers_to_capture = list(layer_ids)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass
