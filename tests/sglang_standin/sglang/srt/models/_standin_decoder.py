"""The stand-in's own machinery (mirrors nothing; see sglang/__init__.py): a transformers decoder standing in for
an SGLang model file's, run request by request over a ragged extend batch, with the *inputs* of the layers in
`layers_to_capture` recorded as SGLang's model files record them."""
from __future__ import annotations

import torch
from torch import nn

from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead


class StandinModel(nn.Module):
    """The decoder (`.model` of an SGLang causal LM): transformers' base model built from the config."""

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        from transformers import AutoModel
        self._base = AutoModel.from_config(config)
        self.embed_tokens, self.layers, self.norm = self._base.embed_tokens, self._base.layers, self._base.norm
        self.layers_to_capture: list[int] = []

    def forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None):
        """(final-normed hidden [N, H], [input of layer i, [N, H], for i in layers_to_capture]) or the hidden
        alone when nothing is captured, as upstream's model forward returns them."""
        captured: dict[int, list[torch.Tensor]] = {i: [] for i in self.layers_to_capture}
        hooks = [self.layers[i].register_forward_pre_hook(
            lambda _m, args, kwargs, i=i: captured[i].append(
                (args[0] if args else kwargs["hidden_states"])[0]), with_kwargs=True)
            for i in self.layers_to_capture]
        finals, start = [], 0
        try:
            for n in forward_batch.extend_seq_lens_cpu:
                out = self._base(input_ids=input_ids[None, start:start + n], use_cache=False)
                finals.append(out.last_hidden_state[0])
                start += n
        finally:
            for h in hooks:
                h.remove()
        hidden = torch.cat(finals)
        if not self.layers_to_capture:
            return hidden
        return hidden, [torch.cat(captured[i]) for i in self.layers_to_capture]


class StandinCausalLM(nn.Module):
    """What SGLang's causal LM classes share: `.model`, a vocab-parallel `.lm_head`, `.logits_processor`,
    `.capture_aux_hidden_states`, forward handing the states to the logits processor, load_weights, and the part of
    set_eagle3_layers_to_capture every model file writes alike. `_decoder`: the model file's decoder class (a
    StandinModel); `_layer_inputs`: the model file's own rule from EAGLE-3 layer ids to the layers whose inputs
    are captured."""
    _decoder = StandinModel

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        self.config = config
        self.model = self._decoder(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                      params_dtype=self.model.embed_tokens.weight.dtype)
        self.logits_processor = LogitsProcessor(config)
        self.capture_aux_hidden_states = False

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        # upstream, in each model file: None -> the inputs of layers [2, L // 2, L - 3]; given ids -> that file's rule
        self.capture_aux_hidden_states = True
        if layer_ids is None:
            L = self.config.num_hidden_layers
            self.model.layers_to_capture = [2, L // 2, L - 3]
        else:
            self.model.layers_to_capture = self._layer_inputs(list(layer_ids))

    def _layer_inputs(self, layer_ids: list[int]) -> list[int]:
        raise NotImplementedError("each stand-in model file states its own layer-id rule")

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None):
        hidden = self.model(input_ids, positions, forward_batch)
        aux = None
        if self.capture_aux_hidden_states:
            hidden, aux = hidden
        return self.logits_processor(input_ids, hidden, self.lm_head, forward_batch, aux)

    def load_weights(self, weights):
        base, lm = {}, None
        for name, w in weights:
            if name == "lm_head.weight":
                lm = w
            elif name.startswith("model."):
                base[name[len("model."):]] = w
        self.model._base.load_state_dict(base, strict=True)
        lm = self.model.embed_tokens.weight.data if lm is None else lm           # tied embeddings
        self.lm_head.weight_loader(self.lm_head.weight, lm.to(self.lm_head.weight.dtype))
