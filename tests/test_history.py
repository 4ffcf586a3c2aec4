"""What the target writes is what the draft learns: regeneration through a token API on real chat templates
(tests/data/templates on the stand-in tokenizer of tests/chat_templates.py), the history rule of
eagle3_core/data/history.py, and the round trip of the text path.

Each regeneration goes through `generation.regenerate` (the stage's own code) against `SGLangTokenStandIn`, which
speaks SGLang's /generate (token ids in, token ids out) and answers with scripted target outputs; the tokenize
stage's `row_samples` then builds the samples. Checked: every trained answer equals, token for token, the ids the
server returned (plus the end-of-turn token); every context equals the template's rendering of the conversation at
that turn, with the target's earlier answers as the history message its ids spell; the number of samples follows the
merge rule (one for a kept history, a new one where the template rewrites it)."""
import asyncio
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from chat_templates import stand_in
from eagle3_core.config import GenerationConfig, ServerConfig
from eagle3_core.data import prompt_set as prompts_mod
from eagle3_core.data.chat import prompt_ids
from eagle3_core.data.history import RoundTripError, tokenize_chat
from eagle3_core.data.markers import target_markers
from eagle3_core.data.samples import row_samples
from eagle3_core.generation.regenerate import regenerate
from sglang_stand_in import SGLangTokenStandIn

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CHAT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "DATA ONE"},
        {"role": "user", "content": "And 3+3?"}]
CHAIN = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
KIMI_CALL = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
             '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
DS_CALL = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
           '<｜tool▁calls▁end｜>')
DS_END = "<｜end▁of▁sentence｜>"
# case -> (stand-in, chat-template kwargs, [chat answers], samples, [tool-chain answers], samples): what the target
# writes after each generation prompt, and how many samples the merge rule gives
CASES = {
    "qwen3_thinking": ("qwen3", {}, ["<think>\nTwo plus two.\n</think>\n\nIt is 4.<|im_end|>",
                                     "<think>\nThree plus three.\n</think>\n\nIt is 6.<|im_end|>"], 2,
                       ["<think>\nI need the weather.\n</think>\n\n" + QWEN_CALL + "<|im_end|>",
                        "<think>\nThe tool says 21.\n</think>\n\nIt is 21 degrees.<|im_end|>"], 1),
    "qwen3_no_thinking": ("qwen3", {"enable_thinking": False}, ["It is 4.<|im_end|>", "It is 6.<|im_end|>"], 2,
                          [QWEN_CALL + "<|im_end|>", "It is 21 degrees.<|im_end|>"], 2),
    "kimi_k2_thinking": ("kimi_k2_thinking", {}, ["<think>Two plus two.</think>It is 4.<|im_end|>",
                                                  "<think>Three plus three.</think>It is 6.<|im_end|>"], 2,
                         ["<think>I need the weather.</think>" + KIMI_CALL + "<|im_end|>",
                          "<think>The tool says 21.</think>It is 21 degrees.<|im_end|>"], 1),
    "kimi_k25": ("kimi_k25", {}, ["Two plus two.</think>It is 4.<|im_end|>",
                                  "Three plus three.</think>It is 6.<|im_end|>"], 2,
                 ["I need the weather.</think>" + KIMI_CALL + "<|im_end|>",
                  "The tool says 21.</think>It is 21 degrees.<|im_end|>"], 1),
    "deepseek_v31_thinking": ("deepseek_v31", {"thinking": True},
                              ["Two plus two.</think>It is 4." + DS_END, "Three plus three.</think>It is 6." + DS_END],
                              2, None, None),
    "deepseek_v31_tools": ("deepseek_v31", {"thinking": False}, ["It is 4." + DS_END, "It is 6." + DS_END], 1,
                           [DS_CALL + DS_END, "It is 21 degrees." + DS_END], 1),
    "qwen25_tools": ("qwen25_tools", {}, ["It is 4.<|im_end|>", "It is 6.<|im_end|>"], 1,
                     [QWEN_CALL + "<|im_end|>", "It is 21 degrees.<|im_end|>"], 1),
}


@pytest.fixture(scope="module")
def toks():
    return {name: stand_in(name) for name in {c[0] for c in CASES.values()}}


def regenerate_row(tmp_path, tok, messages, answers, kwargs, tools=None, meta=None, turns="all"):
    """One prompt row regenerated turn by turn through the token API of the stand-in server; returns (the
    generation row as the tokenize stage reads it, the server)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "s/r", "source": "s", "messages": json.dumps(messages),
                                          "mode": "prompt", "tools": json.dumps(tools) if tools else "",
                                          "meta": json.dumps(meta or {})}]), prompts)
    gen = GenerationConfig(api="sglang", turns=turns, concurrency=1, max_new_tokens=200, flush_rows=1,
                           chat_template_kwargs=kwargs, max_truncated_frac=1.0, progress_interval_s=60)
    with SGLangTokenStandIn(tok, answers, target_markers(tok).eot) as server:
        asyncio.run(regenerate(prompts, tmp_path / "gen", [0], "k", gen, ServerConfig(kind="external"),
                               [server.url], tok, log=lambda *_: None))
    (row,) = prompts_mod.read_rows(tmp_path / "gen" / "shard_00000.parquet")
    return row, server


def check_row(tok, row, server, kwargs, tools, n_samples):
    """The acceptance checks (module docstring) on one regenerated row; returns its samples."""
    m = target_markers(tok)
    assert len(server.received) == len(json.loads(row["turns"]))
    for k, t in enumerate(json.loads(row["turns"])):
        # the context sent is the template's rendering of the conversation at that turn, the target's own earlier
        # answers included as the messages their ids spell
        assert server.received[k] == prompt_ids(tok, row["messages"][:t["index"]], tools, kwargs or None)
        assert row["turn_prompt_ids"][k] == server.received[k] and row["turn_output_ids"][k] == server.returned[k]
    samples, source = row_samples(tok, row, 4096, "truncate", kwargs or None)
    assert source == "server" and len(samples) == n_samples
    trained = [[t for t, w in zip(s["input_ids"], s["loss_mask"]) if w] for s in samples]
    want = [out + ([] if out[-1] == m.eot else [m.eot]) for out in server.returned]
    assert [t for run in trained for t in run] == [t for out in want for t in out]     # token for token
    k = 0
    for s in samples:
        for turn in s["turns"]:
            start = len(server.received[k])
            # each answer sits right after its own context: the sample's ids before it are what the server got
            assert s["input_ids"][:start] == server.received[k]
            assert s["input_ids"][start:start + len(want[k])] == want[k]
            assert all(s["loss_mask"][start:start + len(want[k])]) and not s["loss_mask"][start - 1]
            k += 1
    return samples


@pytest.mark.parametrize("case", sorted(CASES))
def test_regenerated_turns_train_the_servers_ids_in_the_templates_context(case, toks, tmp_path):
    name, kwargs, chat, n_chat, chain, n_chain = CASES[case]
    tok = toks[name]
    row, server = regenerate_row(tmp_path / "chat", tok, CHAT, chat, kwargs)
    samples = check_row(tok, row, server, kwargs, None, n_chat)
    assert [len(s["turns"]) for s in samples] == ([2] if n_chat == 1 else [1, 1])
    # the history message is what the ids spell, read by the target's markers, not a server's parser
    first = row["messages"][1]
    assert first["content"] == "It is 4." and (first.get("reasoning_content") or "").strip() == \
        ("Two plus two." if "Two plus two." in chat[0] else "")
    if chain is None:
        return
    # the data's tool-call turn regenerated (kept: 'regenerate'): the target calls the same tool, so the data's
    # result answers it and the chain goes on; every context extends the previous sample: one sample
    row, server = regenerate_row(tmp_path / "chain", tok, CHAIN, chain, kwargs, TOOLS, {"kept": "regenerate"})
    assert [t.get("ended") for t in json.loads(row["turns"])] == [None, None]
    assert row["messages"][1]["tool_calls"][0]["function"]["name"] == "get_weather"
    check_row(tok, row, server, kwargs, TOOLS, n_chain)
