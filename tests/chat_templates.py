"""The real chat templates of tests/data/chat_templates (sources and licences in tests/data/README.md) on a stand-in
tokenizer: the embedded target's (SmolLM2-135M-Instruct's, loaded once per session) with each template's special
tokens added as single tokens, as the real tokenizers have them (the real ones live on the model hub, out of reach
here). Every template's marker tokens (think, tool calls, end of turn) are thus one id each, as in the target."""
from __future__ import annotations

import copy
from functools import lru_cache

from conftest import SHARED_DATA

TEMPLATES = SHARED_DATA / "chat_templates"
KIMI = ["<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<think>", "</think>",
        "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>", "<|tool_call_end|>"]
# name -> (template file, special tokens added, BOS token or None)
STAND_INS = {
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                              "</tool_response>"], None),
    "kimi_k2_thinking": ("Kimi-K2-Thinking.jinja", KIMI, None),
    "kimi_k25": ("Kimi-K2.5-style.jinja", KIMI, None),
    "deepseek_v31": ("deepseek-ai-DeepSeek-V3.1.jinja", ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                                            "<｜Assistant｜>", "<think>", "</think>", "<｜tool▁calls▁begin｜>",
                                            "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                                            "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"],
                     "<｜begin▁of▁sentence｜>"),
    "qwen25_tools": ("Qwen-Qwen2.5-7B-Instruct.jinja", ["<tool_call>", "</tool_call>"], None),
}


@lru_cache(maxsize=None)
def _base():
    from eagle3_core.config import TargetConfig
    from eagle3_core.target.loading import load_tokenizer
    return load_tokenizer(TargetConfig())


def stand_in(name: str):
    """A fresh copy of the embedded tokenizer with template `name` of STAND_INS and its special tokens."""
    file, special, bos = STAND_INS[name]
    tok = copy.deepcopy(_base())
    tok.chat_template = (TEMPLATES / file).read_text()
    tok.add_special_tokens({"additional_special_tokens": special})
    if bos:
        tok.bos_token = bos
    return tok
