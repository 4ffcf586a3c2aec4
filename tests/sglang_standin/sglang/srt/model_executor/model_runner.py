"""Stand-in for sglang 0.5.14 `srt/model_executor/model_runner.py` (see sglang/__init__.py): one rank's model
runner. As upstream, it joins the torch.distributed world already initialised (tp_size ranks) instead of making
one, loads the checkpoint's safetensors into the model class its config names, and `forward` returns a
ModelRunnerOutput whose logits_output is what the model's logits processor returned."""
from __future__ import annotations

import dataclasses
import torch
import torch.distributed as dist

from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

_REQ_SLOTS, _KV_SLOTS = 256, 1 << 16          # the stand-in's pool sizes (upstream: from mem_fraction_static)


@dataclasses.dataclass
class ModelRunnerOutput:
    logits_output: object
    can_run_graph: bool


def _model_class(architecture: str):
    from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
    from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration
    from sglang.srt.models.llama import LlamaForCausalLM
    classes = {"LlamaForCausalLM": LlamaForCausalLM, "Qwen3ForCausalLM": LlamaForCausalLM,
               "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM, "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
               "KimiK25ForConditionalGeneration": KimiK25ForConditionalGeneration}
    if architecture not in classes:
        raise ValueError(f"the SGLang stand-in runs {sorted(classes)}, not {architecture}")
    return classes[architecture]


def _checkpoint_names(weights):
    """transformers' names of a vision-language wrapper's text weights (`model.language_model.X`, `lm_head.weight`)
    as its checkpoint names them (`language_model.model.X`, `language_model.lm_head.weight`), what upstream's
    load_weights reads; its vision weights as they are."""
    for name, w in weights:
        if name.startswith("model.language_model."):
            name = "language_model.model." + name[len("model.language_model."):]
        elif name == "lm_head.weight":
            name = "language_model.lm_head.weight"
        yield name, w


class ModelRunner:
    def __init__(self, model_config, mem_fraction_static: float, gpu_id: int, tp_rank: int, tp_size: int,
                 moe_ep_rank: int, moe_ep_size: int, pp_rank: int, pp_size: int, nccl_port: int, server_args,
                 is_draft_worker: bool = False):
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != tp_size * pp_size or (dist.is_initialized() and dist.get_rank() != tp_rank):
            raise RuntimeError(f"stand-in ModelRunner: rank {tp_rank} of tp {tp_size} in a world of {world}")
        if tp_size % moe_ep_size or moe_ep_rank != tp_rank // (tp_size // moe_ep_size):
            raise RuntimeError(f"stand-in ModelRunner: moe_ep_rank {moe_ep_rank} of {moe_ep_size} for tp rank "
                               f"{tp_rank} of {tp_size}")
        self.model_config, self.server_args = model_config, server_args
        self.mem_fraction_static, self.gpu_id = mem_fraction_static, gpu_id
        self.tp_rank, self.tp_size, self.moe_ep_rank, self.moe_ep_size = tp_rank, tp_size, moe_ep_rank, moe_ep_size
        self.pp_rank, self.pp_size, self.is_draft_worker = pp_rank, pp_size, is_draft_worker
        self.device = server_args.device
        self.req_to_token_pool = self.token_to_kv_pool_allocator = None
        self.load_model()

    def load_model(self):
        # upstream reads the safetensors through its own loader; the stand-in has transformers read them (and fuse
        # per-expert weights into its MoE layout) and hands the tensors to the model's load_weights as upstream does
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
        hf = self.model_config.hf_config
        dtype = hf.dtype if self.server_args.dtype == "auto" else getattr(torch, self.server_args.dtype)
        self.model = _model_class(hf.architectures[0])(hf).to(dtype)
        wrapped = getattr(hf, "text_config", None) is not None           # a vision-language wrapper (Kimi-K2.5)
        auto = AutoModelForImageTextToText if wrapped else AutoModelForCausalLM
        loaded = auto.from_pretrained(self.model_config.model_path, dtype=dtype)
        self.model.load_weights(_checkpoint_names(loaded.state_dict().items()) if wrapped
                                else loaded.state_dict().items())
        self.model.to(self.device).eval()

    def alloc_memory_pool(self, memory_pool_config=None):
        self.req_to_token_pool = ReqToTokenPool(_REQ_SLOTS, self.model_config.hf_text_config.max_position_embeddings,
                                                self.device)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(_KV_SLOTS, None, self.device)

    def init_attention_backends(self):
        pass                                      # upstream: attention kernels; the stand-in runs transformers'

    def init_cuda_graphs(self, capture_decode_cuda_graph: bool = True):
        pass                                      # upstream: the eager runner when cuda graphs are disabled

    def forward(self, forward_batch, skip_attn_backend_init=None, pp_proxy_tensors=None, reinit_attn_backend=False,
                split_forward_count: int = 1) -> ModelRunnerOutput:
        out = self.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)
        return ModelRunnerOutput(logits_output=out, can_run_graph=False)
