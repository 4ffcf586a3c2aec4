"""The reference rehearsal's pieces (tests/test_reference_rehearsal*.py): the tiny Kimi-K2.5-shaped target, each
mix source's local fixture file, and what the SGLang token-API stand-in answers.

The target: transformers' `Kimi_K25Config` wrapper around a 4-layer DeepSeek-V3 text model (MLA, routed experts
packed INT4 by compressed-tensors as the published checkpoint packs them: tests/int4_targets.py) whose vocabulary is
the stand-in tokenizer's: the embedded tokenizer with Kimi's marker tokens as single ids and the K2.5-style
template, thinking on by default (tests/chat_templates.py), and Kimi-K2.5's two end tokens, the tokenizer's EOS
`[EOS]` and the end of turn `<|im_end|>`, both in generation_config.json's `eos_token_id` as in the published
checkpoint (tests/test_history.py `kimi_with_eos`)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from chat_templates import stand_in
from int4_targets import build_int4
from sglang_stand_in import SGLangTokenStandIn

FIX = Path(__file__).parent / "fixtures"
LAYERS = 4
MAX_POSITIONS = 1024


def tokenizer():
    tok = stand_in("kimi_k25")
    tok.add_special_tokens({"eos_token": "[EOS]"})
    return tok


def build_target(out: Path) -> Path:
    """The tiny INT4 Kimi-K2.5 target with its tokenizer at `out`; returns `out`."""
    tok = tokenizer()
    eos, im_end = tok.convert_tokens_to_ids("[EOS]"), tok.convert_tokens_to_ids("<|im_end|>")
    build_int4("kimi_k25", out, layers=LAYERS, vocab_size=len(tok), max_position_embeddings=MAX_POSITIONS,
               eos_token_id=eos, bos_token_id=None)
    tok.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, im_end]}))
    return out


def _hermes_variant(tmp: Path, name: str, tag: str) -> str:
    """The hermes-function-calling fixture row (func-calling.json's fields) with its texts tagged, standing for
    another file of the same repository (func-calling-singleturn.json, glaive-function-calling-5k.json)."""
    rows = json.loads((FIX / "prompt_formats" / "hermes_function_calling.json").read_text())
    for r in rows:
        r["id"] = f"{r['id']}-{tag}"
        for turn in r["conversations"]:
            if turn["from"] == "human":
                turn["value"] = f"({tag}) {turn['value']}"
    path = tmp / name
    path.write_text(json.dumps(rows))
    return str(path)


def local_sources(tmp: Path) -> dict[str, dict]:
    """{source label of the reference mix: the fields that point it at its local fixture file} (hub name, revision,
    data file, split and config: locations; count and max_rows: sizes). Each file holds rows in the fields of the
    hub data set it stands for (tests/fixtures/prompt_formats/README.md)."""
    pf, kept = FIX / "prompt_formats", FIX / "kept_sources"

    def src(path, count, hf="json"):
        return {"hf": hf, "revision": None, "data_files": str(path), "count": count, "max_rows": None}
    return {
        "swe-agent-trajectories": src(pf / "swe_agent_trajectories.parquet", 1, "parquet"),
        "deepswe-kimi-k2": src(kept / "deepswe_kimi_k2.jsonl", 3),
        "kimi-k2.5-2000x": src(kept / "kimi_k25_2000x.jsonl", 3),
        "hermes-function-calling": src(pf / "hermes_function_calling.json", 1),
        "hermes-function-calling-singleturn": src(_hermes_variant(tmp, "singleturn.json", "singleturn"), 1),
        "hermes-glaive-function-calling": src(_hermes_variant(tmp, "glaive.json", "glaive"), 1),
        "mixture-of-thoughts": {**src(pf / "mixture_of_thoughts.jsonl", 1), "config": None},
        "openthoughts-114k": src(pf / "openthoughts_114k.jsonl", 1),
        "ultrachat-200k": {**src(pf / "ultrachat_200k.jsonl", 1), "split": "train"},
        "sharegpt-vicuna": src(pf / "sharegpt_vicuna.json", 2),
    }


TOOL_CALL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>"
             '{{}}<|tool_call_end|><|tool_calls_section_end|>')
DECLARED_NAME = re.compile(r'"name":\s*"([A-Za-z_][\w.-]*)"')


def answers(n: int, long_words: int = 200) -> list[str]:
    """What the target writes after its generation prompt (which opens `<think>`), for the i-th request: in turn a
    reasoning answer ending `<|im_end|>`, a tool call ending `<|im_end|>`, a reasoning answer ending `[EOS]`, and
    every sixth one an answer with no end that the server cuts at max_new_tokens."""
    out = []
    for i in range(n):
        kind = i % 6
        if kind == 5:
            out.append(f"Step {i}: " + " ".join(f"word{k}" for k in range(long_words)))
        elif kind == 1:
            out.append(f"I should call a tool ({i}).</think>{TOOL_CALL}<|im_end|>")
        elif kind == 2:
            out.append(f"Two plus {i} is {i + 2}.</think>It is {i + 2}.[EOS]")
        else:
            out.append(f"Thinking about request {i}.</think>The answer to request {i} is {i * 7 % 13}.<|im_end|>")
    return out


class KimiStandIn(SGLangTokenStandIn):
    """The token-API stand-in answering the scripted `answers` in order, except that a request whose prompt declares
    a function (Kimi's template renders a row's tools as JSON in the prompt) is answered with a call of the first one
    it declares, and a scripted tool call sent to a prompt that declares none becomes a reasoning answer.
    `tool_calls` counts the tool calls answered."""

    def __init__(self, tok, script: list[str], eot: int, stops: tuple[int, ...]):
        super().__init__(tok, script, eot, stops)
        self.tool_calls = 0

    def _generate(self, path: str, body: dict) -> tuple[int, dict]:
        i = len(self.received)
        if i < len(self.answers):
            found = DECLARED_NAME.search(self.tokenizer.decode(body["input_ids"]))
            if found:
                self.tool_calls += 1
                call = TOOL_CALL.format(name=found.group(1))
                self.answers[i] = f"I should call {found.group(1)} ({i}).</think>{call}<|im_end|>"
            elif "{name}" in self.answers[i]:
                self.answers[i] = f"No tool is declared ({i}).</think>Answer {i}.<|im_end|>"
        return super()._generate(path, body)
