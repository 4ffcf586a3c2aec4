"""Hidden-state (features) settings: aux layer ids, lengths, shards, storage format and backend."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from eagle3_core.config.strict import StrictModel

# the SGLang release the 'sglang' backend is written against (sglang_runner.py's list of its internals); SpecForge
# 0.2.0 pins the same one. check refuses another version in the environment of PipelineConfig.sglang_python.
SGLANG_VERSION = "0.5.14"
# the torchrun backends, named by _parallel_needs_hf_tp's message: the rows of features.backends.BACKENDS with
# `torchrun` (config cannot import them; tests/test_features_stage.py checks this list and the descriptions)
TORCHRUN_BACKENDS = ("hf_tp", "ep_int4", "sglang")


class FeatureConfig(StrictModel):
    aux_layer_ids: list[int] | None = Field(None, description="None: default_aux_layer_ids(L)")
    max_length: int = Field(2048, ge=8, description="sequences are truncated to this many tokens")
    shard_samples: int = Field(64, ge=1, description="samples per safetensors shard")
    batch_tokens: int = Field(4096, ge=64, description="token budget of one extraction forward")
    format: Literal["bf16", "fp8", "fp8_topk", "online"] = Field(
        "bf16", description="feature storage: bf16; fp8 (e4m3, per-token scales, ~half the bytes); fp8_topk (fp8 "
                            "and the target's exact top-32 logits with the tail's exact mass: a teacher at least as "
                            "exact as bf16's for 0.9% more bytes than fp8); "
                            "online (nothing stored, training runs the target on the fly)")
    writer_threads: int = Field(2, ge=1, description="background threads serializing, hashing and writing shards")
    min_on_policy: float = Field(0.2, ge=0, le=1, description="early gate, checked on the first feature shard: "
                                 "fail when a source's fraction of supervised tokens that are the target's argmax "
                                 "is below this (data far from what the target writes); 0 turns it off")
    import_from: str | None = Field(None, description="a directory of SpecForge offline features (*.ckpt from its "
                                    "prepare_hidden_states.py): the stage imports them, checked against this run's "
                                    "tokenization, instead of running the target (features.specforge_import)")
    backend: str = Field(
        "hf", description="the extraction backend (eagle3_core.features.backends.BACKENDS): 'hf': the whole target in "
                          "this process on one device (HFExtractor); 'hf_tp': transformers' tensor-parallel plan over "
                          "tp_size processes under torchrun, one per GPU (features/tp_extract.py), for targets that "
                          "fit no single GPU; 'ep_int4': DeepSeek-V3 / Kimi-K2.5 with routed experts kept packed "
                          "INT4 as the checkpoint stores them, split over tp_size ranks (target/ep_loading.py), same "
                          "torchrun as 'hf_tp'; 'sglang': SGLang's own model runner (sglang=="
                          f"{SGLANG_VERSION}) in each of tp_size torchrun ranks, in the environment of the run's "
                          "sglang_python (features/sglang_worker.py). Recorded per shard, out of every key")
    mix_backends: bool = Field(False, description="let a run add shards of this backend to a store whose finished "
                                                  "shards another backend wrote (False: refused, naming them)")
    tp_size: int = Field(1, ge=1, description="processes (GPUs) the 'hf_tp', 'ep_int4' and 'sglang' backends shard "
                                              "the target over; torchrun's --nproc-per-node (1 with backend 'hf')")
    expert_parallel: bool = Field(False, description="'hf_tp' on an MoE target: routed experts whole on one rank "
                                                     "each (transformers' base_model_ep_plan, ep_size = tp_size) "
                                                     "instead of every expert split over the ranks; 'sglang': "
                                                     "SGLang's ep_size = tp_size (else 1: experts tensor-parallel)")
    mem_fraction_static: float | None = Field(None, gt=0, lt=1, description="'sglang': SGLang's "
                                              "--mem-fraction-static, the share of each GPU for weights and KV "
                                              "cache; None: SGLang's default for the GPU")
    shard_attention: bool = Field(True, description="'ep_int4': MLA heads split over the ranks (False: whole "
                                                    "attention on every rank)")

    @field_validator("aux_layer_ids")
    @classmethod
    def _three_ids(cls, v):
        if v is not None and len(v) != 3:
            raise ValueError(f"aux_layer_ids must hold 3 layer ids, got {v}")
        # order and repeats need no target: refused here; the range [0, L-2] by target_family.resolve_aux_ids
        if v is not None and len(set(v)) != 3:
            raise ValueError(f"features.aux_layer_ids = {v} repeats a layer; give 3 distinct layer ids")
        if v is not None and v != sorted(v):
            raise ValueError(f"features.aux_layer_ids = {v} is not ascending: SGLang and vLLM concatenate the "
                             f"captured layers in ascending order; write {sorted(v)}")
        return v

    @model_validator(mode="after")
    def _import_names_its_layers(self):
        if self.import_from and self.aux_layer_ids is None:
            raise ValueError(f"features.import_from {self.import_from!r} needs explicit features.aux_layer_ids: the "
                             f"other tool chose its layers (SpecForge: its draft config's "
                             f"eagle_aux_hidden_state_layer_ids); give the same three ids")
        return self

    @model_validator(mode="after")
    def _parallel_needs_hf_tp(self):
        if self.backend == "hf" and (self.tp_size != 1 or self.expert_parallel):
            names = " or ".join([", ".join(map(repr, TORCHRUN_BACKENDS[:-1])), repr(TORCHRUN_BACKENDS[-1])])
            raise ValueError(f"features.tp_size = {self.tp_size}, expert_parallel = {self.expert_parallel} need "
                             f"features.backend {names} (backend 'hf' loads the whole target in one process)")
        return self

