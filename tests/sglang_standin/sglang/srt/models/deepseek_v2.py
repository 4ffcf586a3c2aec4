"""Stand-in for sglang 0.5.14 `srt/models/deepseek_v2.py` (see sglang/__init__.py): its EAGLE-3 layer-id rule,
which adds one only when the first id is 1 (other ids are taken as layer inputs as they are)."""
from __future__ import annotations

from sglang.srt.models._standin_decoder import StandinCausalLM, StandinModel


class DeepseekV2Model(StandinModel):
    pass


class DeepseekV2ForCausalLM(StandinCausalLM):
    _decoder = DeepseekV2Model

    def _layer_inputs(self, layer_ids):
        # upstream set_eagle3_layers_to_capture: one is added only when the first id is 1
        return [i + 1 for i in layer_ids] if layer_ids and layer_ids[0] == 1 else layer_ids


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass
