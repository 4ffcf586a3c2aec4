"""Every SGLang call of the `sglang` features backend, in this one module: SGLang's own ModelRunner on one
torchrun rank, prefill-only batches of whole samples through it, and every token's aux and final hidden states and
argmax taken from its logits processor. Imported only in the SGLang environment (sglang_python), by the
ranks of features/sglang_worker.py; the rest of the backend (batches, layer-id rule, argmax, Extractor) is
features/sglang_extract.py and needs no SGLang.

Written against sglang 0.5.14 (config.feature_config.SGLANG_VERSION; what SpecForge 0.2.0 pins, whose
`specforge/offline_capture/sglang_backend/` drives the same calls). The internals it relies on, by upstream file
(python/sglang/srt/...), each name checked against that release's wheel by tests/test_sglang_backend.py through
the stand-in tests/sglang_standin/, which mirrors exactly these:
- server_args.py: `ServerArgs` (model_path, revision, trust_remote_code, dtype, tp_size, ep_size, pp_size,
  mem_fraction_static, disable_cuda_graph, chunked_prefill_size, enable_return_hidden_states, random_seed).
- configs/model_config.py: `ModelConfig.from_server_args`, `.hf_config`, `.num_hidden_layers`, `.hidden_size`.
- model_executor/model_runner.py: `ModelRunner(model_config, mem_fraction_static, gpu_id, tp_rank, tp_size,
  moe_ep_rank, moe_ep_size, pp_rank, pp_size, nccl_port, server_args, is_draft_worker)`, which joins the process
  group torchrun started (distributed/parallel_state.py `init_distributed_environment` keeps an initialised
  default group) and loads the weights; then `.alloc_memory_pool()`, `.init_attention_backends()`,
  `.init_cuda_graphs()` (with disable_cuda_graph: the eager runner), `.forward(forward_batch)` returning
  `ModelRunnerOutput.logits_output`; `.model`, `.req_to_token_pool`, `.token_to_kv_pool_allocator` (`.clear()`),
  `.model_config`, `.server_args` (`.page_size`).
- managers/schedule_batch.py: `Req(rid, origin_input_text, origin_input_ids, sampling_params)` with
  `.full_untruncated_fill_ids`, `.fill_len`, `.extend_input_len`, `.prefix_indices`, `.logprob_start_len` set by
  hand (the scheduler's prefix match is skipped: nothing is cached); `ScheduleBatch.init_new(reqs,
  req_to_token_pool, token_to_kv_pool_allocator, tree_cache, model_config, enable_overlap, spec_algorithm)`,
  `.prepare_for_extend()`, `.prefill_input_ids_cpu` / `.input_ids` / `.device`, `.capture_hidden_mode`.
- mem_cache/radix_cache.py `RadixCache(params)`, mem_cache/cache_init_params.py `CacheInitParams(disable,
  req_to_token_pool, token_to_kv_pool_allocator, page_size)`.
- model_executor/forward_batch_info.py: `ForwardBatch.init_new(batch, model_runner)`, `CaptureHiddenMode.FULL`.
- sampling/sampling_params.py `SamplingParams(temperature, max_new_tokens)`; speculative/spec_info.py
  `SpeculativeAlgorithm.NONE`.
- layers/logits_processor.py: `LogitsProcessor`, replaced in the model by CapturingLogits, which SGLang's model
  files call as `logits_processor(input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states)` with the
  final-normed hidden_states [N, H_t] of every token and the captured layer inputs (models/llama.py,
  models/deepseek_v2.py `forward`).
- layers/vocab_parallel_embedding.py: `ParallelLMHead.weight` (this rank's vocab slice, padded) and
  `.shard_indices.org_vocab_start_index` / `.org_vocab_end_index` (its real rows).
- models/*.py: `set_eagle3_layers_to_capture(layer_ids)` and the `layers_to_capture` it sets on the model's
  decoder (`.model`, or `.language_model.model` for models/kimi_k25.py), read back to verify the layer-id rule
  (sglang_extract.capture_argument).
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from eagle3_core.features.sglang_extract import capture_argument, capture_rule, sharded_argmax


@dataclass
class Captured:
    """What CapturingLogits returns in place of a LogitsProcessorOutput: every token of the prefill batch, in
    batch order. next_token_logits is None (no sampling follows)."""
    aux: torch.Tensor                    # [N, 3H_t], model dtype: the captured layers, ascending, concatenated
    final: torch.Tensor                  # [N, H_t]: the final-normed hidden state lm_head reads
    target_top1: torch.Tensor            # int32 [N]: argmax over the whole vocab
    next_token_logits: None = None


class CapturingLogits(torch.nn.Module):
    """In place of a model's LogitsProcessor: keeps every token's states (no pruning to the last token) and the
    argmax over the whole vocab from this rank's lm_head slice (sglang_extract.sharded_argmax, a collective over
    the ranks); no [N, V] logits are made."""

    def __init__(self, chunk: int = 4096):
        super().__init__()
        self.chunk = chunk

    def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None,
                hidden_states_before_norm=None) -> Captured:
        if not aux_hidden_states:
            raise RuntimeError("SGLang passed no aux hidden states: set_eagle3_layers_to_capture was not applied")
        s = lm_head.shard_indices
        weight = lm_head.weight[:s.org_vocab_end_index - s.org_vocab_start_index]      # padding rows cut off
        return Captured(aux=torch.cat(aux_hidden_states, dim=-1), final=hidden_states,
                        target_top1=sharded_argmax(hidden_states, weight, s.org_vocab_start_index, chunk=self.chunk))


def _decoder_with_capture(model):
    """The module whose `layers_to_capture` SGLang's model files set (the decoder, `.model`)."""
    inner = getattr(model, "language_model", None) or model
    return inner.model


class Runner:
    """One rank's SGLang ModelRunner for prefill-only capture. tp_size ranks (the torchrun world, its default
    process group already initialised) build it together; ep_size 1 or tp_size (SGLang's moe_ep_size).
    mem_fraction_static None: SGLang's default. Raises what SGLang raises (no GPU, weights that do not fit)."""

    def __init__(self, model_path: str, revision: str | None, trust_remote_code: bool, tp_size: int, ep_size: int,
                 rank: int, gpu_id: int, mem_fraction_static: float | None, nccl_port: int):
        extra = {} if mem_fraction_static is None else {"mem_fraction_static": mem_fraction_static}
        args = ServerArgs(model_path=model_path, revision=revision, trust_remote_code=trust_remote_code,
                          dtype="auto", tp_size=tp_size, ep_size=ep_size, pp_size=1, disable_cuda_graph=True,
                          chunked_prefill_size=-1, enable_return_hidden_states=True, random_seed=0, **extra)
        config = ModelConfig.from_server_args(args)
        self.runner = ModelRunner(model_config=config, mem_fraction_static=args.mem_fraction_static, gpu_id=gpu_id,
                                  tp_rank=rank, tp_size=tp_size, moe_ep_rank=rank // (tp_size // ep_size),
                                  moe_ep_size=ep_size, pp_rank=0, pp_size=1, nccl_port=nccl_port, server_args=args,
                                  is_draft_worker=False)
        self.runner.alloc_memory_pool()
        self.runner.init_attention_backends()
        self.runner.init_cuda_graphs()
        self.model = self.runner.model
        wrapped = [name for name, m in self.model.named_modules() if isinstance(m, LogitsProcessor)]
        if not wrapped:
            raise RuntimeError(f"{type(self.model).__name__} has no SGLang LogitsProcessor to capture through")
        for name in wrapped:
            parent, _, child = name.rpartition(".")
            setattr(self.model.get_submodule(parent) if parent else self.model, child, CapturingLogits())
        self.num_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        self.config = config.hf_config.to_dict()

    def set_aux_layers(self, ids: list[int]) -> list[int]:
        """Capture the outputs of layers `ids` (ascending, ours: target.family.resolve_aux_ids): the pinned
        version's set_eagle3_layers_to_capture with sglang_extract.capture_argument's argument, then its
        layers_to_capture read back. Returns those layer inputs ([i + 1 for i in ids]). Raises ValueError where
        the rule cannot express `ids`, RuntimeError if SGLang captured other layers (another layer-id rule)."""
        rule = capture_rule(self.model)
        self.model.set_eagle3_layers_to_capture(capture_argument(ids, rule))
        got = list(_decoder_with_capture(self.model).layers_to_capture)
        if got != [i + 1 for i in ids]:
            raise RuntimeError(f"SGLang's {type(self.model).__name__}.set_eagle3_layers_to_capture captures the "
                               f"inputs of layers {got}, not {[i + 1 for i in ids]} (the outputs of "
                               f"features.aux_layer_ids {ids}): its layer-id rule is not 0.5.14's {rule!r}")
        return got

    @torch.no_grad()
    def prefill(self, seqs: list[list[int]]) -> dict[str, torch.Tensor]:
        """One extend forward of `seqs` (whole samples, one request each, no cached prefix): {aux [N, 3H_t],
        final [N, H_t], target_top1 int32 [N]} on this rank's GPU, samples back to back. A collective: every rank
        runs it on the same seqs. The KV pools are cleared afterwards (nothing is kept between batches)."""
        r = self.runner
        reqs = []
        for i, s in enumerate(seqs):
            req = Req(rid=str(i), origin_input_text="", origin_input_ids=array("q", s),
                      sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
            req.full_untruncated_fill_ids = array("q", s)
            req.fill_len = len(s)
            req.extend_input_len = len(s) - len(req.prefix_indices)
            req.logprob_start_len = len(s) - 1
            reqs.append(req)
        try:
            cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=r.req_to_token_pool,
                                               token_to_kv_pool_allocator=r.token_to_kv_pool_allocator,
                                               page_size=r.server_args.page_size))
            batch = ScheduleBatch.init_new(reqs=reqs, req_to_token_pool=r.req_to_token_pool,
                                           token_to_kv_pool_allocator=r.token_to_kv_pool_allocator, tree_cache=cache,
                                           model_config=r.model_config, enable_overlap=False,
                                           spec_algorithm=SpeculativeAlgorithm.NONE)
            batch.prepare_for_extend()
            if batch.prefill_input_ids_cpu is not None:          # 0.5.14 leaves the ids on the host until here
                batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
                batch.prefill_input_ids_cpu = None
            batch.capture_hidden_mode = CaptureHiddenMode.FULL
            out = r.forward(ForwardBatch.init_new(batch, r)).logits_output
        finally:
            r.req_to_token_pool.clear()
            r.token_to_kv_pool_allocator.clear()
        if not isinstance(out, Captured):
            raise RuntimeError(f"SGLang's forward returned {type(out).__name__}, not the captured states")
        return {"aux": out.aux, "final": out.final, "target_top1": out.target_top1}
