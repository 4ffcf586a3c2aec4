"""Stand-in for sglang 0.5.14 `srt/models/kimi_k25.py` (see sglang/__init__.py): Kimi-K2.5's wrapper, its text
model a DeepseekV3ForCausalLM under `.language_model` (aliased `.model`), `set_eagle3_layers_to_capture` handed to
it, and the checkpoint's `language_model.` prefix stripped from the names its load_weights passes on. The vision
tower and projector are not stood in (upstream loads their weights inline; the rehearsal sends text only), so
their weights are skipped."""
from __future__ import annotations

from torch import nn

from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM


class KimiK25ForConditionalGeneration(nn.Module):
    def __init__(self, config, quant_config=None, prefix: str = "", **kwargs):
        super().__init__()
        self.config, self.quant_config = config, quant_config
        self.language_model = DeepseekV3ForCausalLM(config.text_config, quant_config)

    @property
    def model(self):
        return self.language_model

    def forward(self, input_ids, positions, forward_batch, get_embedding: bool = False, pp_proxy_tensors=None):
        return self.language_model(input_ids, positions, forward_batch)

    def load_weights(self, weights):
        # upstream: vision weights loaded inline, every other name passed on without its `language_model.`
        self.language_model.load_weights((name.replace("language_model.", ""), w) for name, w in weights
                                         if "vision_tower" not in name and "mm_projector" not in name)

    def set_eagle3_layers_to_capture(self, layer_ids=None) -> None:
        self.language_model.set_eagle3_layers_to_capture(layer_ids)

    @property
    def lm_head(self):
        return self.language_model.lm_head


EntryClass = [KimiK25ForConditionalGeneration]
