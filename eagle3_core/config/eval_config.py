"""Evaluation and deployment settings: the offline tau measurement and the SGLang deployment benchmark."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from eagle3_core.config.sampling_config import SamplingConfig
from eagle3_core.config.strict import StrictModel


def check_tree_params(num_steps: int, topk: int, num_draft_tokens: int) -> None:
    """Raise ValueError unless (S, k, T) is a tree SGLang would build (its server-argument checks, sglang
    `python/sglang/srt/server_args.py`)."""
    if num_steps < 1 or topk < 1:
        raise ValueError(f"num_steps {num_steps} and topk {topk} must be >= 1")
    if topk == 1 and num_draft_tokens != num_steps + 1:
        raise ValueError(f"topk 1 is a chain: num_draft_tokens must be num_steps + 1 = {num_steps + 1}, "
                         f"got {num_draft_tokens} (SGLang forces this)")
    candidates = topk + (num_steps - 1) * topk * topk
    if not 2 <= num_draft_tokens <= candidates + 1:
        raise ValueError(f"num_draft_tokens {num_draft_tokens} must be in [2, {candidates + 1}] for num_steps "
                         f"{num_steps} and topk {topk} (root + at most {candidates} candidates)")


class EvalConfig(StrictModel):
    evaluator: Literal["auto", "decode", "replay"] = Field(
        "auto", description="'decode': the target decodes in this process, verifying the draft step by step "
                            "(speculate); 'replay': the target's greedy outputs on the held-out prompts, recorded "
                            "once (a temperature-0 pass on the serving engine), with their aux states from the "
                            "features backend, and the draft replayed against them (replay_eval); 'auto': replay "
                            "where the features backend is sharded (no process holds the target), else decode")
    num_draft_steps: int = Field(5, ge=1, description="S: draft steps per verify step (chain length, tree depth)")
    max_new_tokens: int = Field(128, ge=1, description="tokens generated per held-out prompt")
    tie_gap: float = Field(1e-3, description="a spec/target mismatch counts as a near-tie below this top-2 gap")
    tree_topk: int = Field(4, ge=1, description="k of the tree run (SGLang --speculative-eagle-topk); 1: no tree run")
    tree_num_draft_tokens: int = Field(8, ge=2, description="T verify tokens of the tree run, root included "
                                                            "(SGLang --speculative-num-draft-tokens)")
    tree_prompts: int | None = Field(None, ge=1, description="held-out prompts for the tree run (None: all)")
    untrained_prompts: int | None = Field(None, ge=1, description="held-out prompts for the untrained-draft "
                                                                  "reference (None: all)")
    sampling: SamplingConfig = Field(SamplingConfig(), description="the settings tau is measured at (temperature 0: "
                                     "greedy; above: evaluation.replay_sampled, one sampled trajectory per prompt "
                                     "and seed, seeds seed..seed+sampled_seeds-1)")
    sampled_seeds: int = Field(4, ge=1, description="trajectories per held-out prompt at temperature > 0")
    serving: SamplingConfig | None = Field(None, description="the settings the target is served at (declared, e.g. "
                                           "temperature 1.0, top_p 0.95): shown in the report's sampling table "
                                           "beside regeneration and evaluation; where it differs from eval.sampling, "
                                           "the evaluate stage and the llama.cpp deployment measure tau at it too")

    @property
    def measured_samplings(self) -> list[SamplingConfig]:
        """The settings the evaluate stage and the llama.cpp deployment measure tau at: eval.sampling, then the
        declared eval.serving where it differs (each with eval.sampled_seeds seeds from its own seed when sampled)."""
        return [self.sampling] + ([self.serving] if self.serving is not None and self.serving != self.sampling
                                  else [])

    @model_validator(mode="after")
    def _tree_sglang_accepts(self):
        if self.tree_topk > 1:
            check_tree_params(self.num_draft_steps, self.tree_topk, self.tree_num_draft_tokens)
        return self


class SGLangDeployConfig(StrictModel):
    """Phase 6 on SGLang: the exported draft served with EAGLE3 against the same server without it.
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
    max_new_tokens: int = Field(256, ge=1, description="tokens generated per benchmark request")
    per_category: int | None = Field(10, ge=1, description="Spec-Bench / HumanEval prompts per category")
    startup_timeout_s: float = Field(3600.0, gt=0, description="a 1T-parameter target loads for tens of minutes")

