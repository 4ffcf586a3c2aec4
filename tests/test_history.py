"""What the target writes is what the draft learns: regeneration through a token API on real chat templates
(tests/data/chat_templates on the stand-in tokenizer of tests/chat_templates.py), the history rule of
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
from eagle3_core.data.history import RoundTripError
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


def regenerate_row(tmp_path, tok, messages, answers, kwargs, tools=None, meta=None, turns="all", max_new=200):
    """One prompt row regenerated turn by turn through the token API of the stand-in server; returns (the
    generation row as the tokenize stage reads it, the server)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "s/r", "source": "s", "messages": json.dumps(messages),
                                          "mode": "prompt", "tools": json.dumps(tools) if tools else "",
                                          "meta": json.dumps(meta or {})}]), prompts)
    gen = GenerationConfig(api="sglang", turns=turns, concurrency=1, max_new_tokens=max_new, flush_rows=1,
                           chat_template_kwargs=kwargs, max_truncated_frac=1.0, progress_interval_s=60)
    m = target_markers(tok)
    with SGLangTokenStandIn(tok, answers, m.eot, m.stops) as server:
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
    want = [out + ([] if m.is_stop(out[-1]) else [m.eot]) for out in server.returned]
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


def masked_text(tok, sample) -> str:
    return tok.decode([t for t, w in zip(sample["input_ids"], sample["loss_mask"]) if w])


def test_kimi_reasoning_round_trip(toks, tmp_path):
    """Kimi-K2.5 in thinking mode (its generation prompt ends in <think>): through the token API the trained tokens
    are exactly what the target wrote, `Two plus two.</think>It is 4.<|im_end|>` (not the re-rendered
    `</think><think>\\nTwo plus two.\\n</think>\\n\\nIt is 4.<|im_end|>` of inline reasoning), and the row's text
    fields are read from the ids; the same answer on the text path is refused, naming the cause (K2.5 renders a
    final plain answer with an empty think block)."""
    tok = toks["kimi_k25"]
    answer = "Two plus two.</think>It is 4.<|im_end|>"
    row, server = regenerate_row(tmp_path, tok, CHAT[:1], [answer], {}, turns="final")
    assert tok.decode(server.received[0]).endswith("<|im_assistant|>assistant<|im_middle|><think>")
    assert (row["reasoning"], row["response"]) == ("Two plus two.", "It is 4.")
    (sample,), source = row_samples(tok, row, 4096, "truncate")
    assert source == "server" and masked_text(tok, sample) == answer
    assert sample["input_ids"] == server.received[0] + server.returned[0]
    text_row = {**row, "api": "openai", "prompt_ids": [], "output_ids": []}     # what the OpenAI API gives
    with pytest.raises(RoundTripError, match="renders the turn's reasoning differently") as e:
        row_samples(tok, text_row, 4096, "truncate")
    assert e.value.cause == "reasoning"


def kimi_with_eos():
    """The K2.5-style stand-in with Kimi's two stop tokens: the tokenizer's EOS `[EOS]` (163585 in Kimi-K2.5) apart
    from the chat end of turn `<|im_end|>` (163586)."""
    tok = stand_in("kimi_k25")
    tok.add_special_tokens({"eos_token": "[EOS]"})
    return tok


def test_a_turn_that_stopped_on_eos_trains_exactly_the_servers_ids_with_both_kimi_end_tokens(tmp_path):
    """Kimi-K2.5 stops on `[EOS]` as well as on `<|im_end|>`: a turn the server ended with `[EOS]` is trained as the
    server returned it, `...It is 4.[EOS]`, not `[EOS]<|im_end|>` (a pair the target never writes); the history
    message of the next turn holds no `[EOS]` text; the next turn, ended with `<|im_end|>`, keeps its own."""
    tok = kimi_with_eos()
    m = target_markers(tok)
    eos, im_end = tok.convert_tokens_to_ids("[EOS]"), tok.convert_tokens_to_ids("<|im_end|>")
    assert m.stops == tuple(sorted({eos, im_end})) and m.eot == im_end and m.texts["[EOS]"] == eos
    answers = ["Two plus two.</think>It is 4.[EOS]", "Three plus three.</think>It is 6.<|im_end|>"]
    row, server = regenerate_row(tmp_path, tok, CHAT, answers, {})
    assert [out[-1] for out in server.returned] == [eos, im_end]
    assert row["messages"][1]["content"] == "It is 4." and "[EOS]" not in json.dumps(row["messages"])
    samples = check_row(tok, row, server, {}, None, 2)
    assert [[t for t, w in zip(s["input_ids"], s["loss_mask"]) if w] for s in samples] == server.returned
    assert [masked_text(tok, s) for s in samples] == answers


@pytest.mark.parametrize("name", ["kimi_k25", "kimi_k2_thinking"])
def test_kept_rows_without_reasoning_would_teach_empty_thinking_and_are_refused(toks, name):
    """Kept multi-turn rows of a non-thinking model (Kimi-K2's own trajectories) under a thinking Kimi: every turn
    would train an empty think block (`</think>` right after the prompt's <think>, or `<think></think>`), which the
    target in thinking mode never writes: refused, cause 'empty_thinking'. In non-thinking mode (K2.5's
    `thinking: false`) the same turns are what the target writes and train, as one sample."""
    tok = toks[name]
    row = {"id": "k/1", "source": "k", "mode": "keep", "tools": "", "meta": "{}", "finish_reason": "kept",
           "messages": CHAT[:1] + [{"role": "assistant", "content": "It is 4."}, CHAT[2],
                                   {"role": "assistant", "content": "It is 6."}]}
    with pytest.raises(RoundTripError, match="k/1: assistant turn 1: the target thinks") as e:
        row_samples(tok, row, 4096, "truncate")
    assert e.value.cause == "empty_thinking"
    if name == "kimi_k25":
        (sample,), _ = row_samples(tok, row, 4096, "truncate", {"thinking": False})
        assert masked_text(tok, sample) == "It is 4.<|im_end|>It is 6.<|im_end|>"


def test_deepseek_thinking_rows(toks, tmp_path):
    """DeepSeek-V3.1 thinking rows (generation prompt `<｜Assistant｜><think>`, every earlier answer rendered with
    `<think></think>`): the token path trains `reasoning</think>answer<｜end▁of▁sentence｜>` as the target wrote
    it, one sample per turn (the template rewrites the history); on the text path a thinking turn is refused
    naming the real cause, the dropped reasoning (it was refused before as 'rewrites earlier turns')."""
    tok = toks["deepseek_v31"]
    answers = ["Two plus two.</think>It is 4." + DS_END, "Three plus three.</think>It is 6." + DS_END]
    row, server = regenerate_row(tmp_path, tok, CHAT, answers, {"thinking": True})
    samples, _ = row_samples(tok, row, 4096, "truncate", {"thinking": True})
    assert [masked_text(tok, s) for s in samples] == answers
    assert "Two plus two." not in tok.decode(samples[1]["input_ids"])      # history as DeepSeek renders it
    kept = {**row, "mode": "keep", "turns": None, "api": "kept"}
    with pytest.raises(RoundTripError, match="assistant turn 1: the template renders the turn's reasoning") as e:
        row_samples(tok, kept, 4096, "truncate", {"thinking": True})
    assert e.value.cause == "reasoning"


def test_kept_choices_mask_refuse_and_regenerate(toks, tmp_path):
    """A source's kept choice for the data's turns: 'mask' leaves a kept tool-call turn untrained context,
    'refuse' leaves the row untrained (counted), 'regenerate' makes mode 'keep' rows prompt rows; 'mask' with
    mode 'keep' is refused at once (nothing would be left to train)."""
    from eagle3_core.config.mix import SourceSpec
    from eagle3_core.data.prompt_set import load_source
    tok = toks["qwen3"]
    answers = ["<think>\nThe tool says 21.\n</think>\n\nIt is 21 degrees.<|im_end|>"]
    chain = [CHAIN[0], {**CHAIN[1], "reasoning_content": "I need the weather."}, CHAIN[2]]
    row, _ = regenerate_row(tmp_path / "a", tok, chain, answers, {}, TOOLS)          # the data's call kept
    both, _ = row_samples(tok, {**row, "meta": json.dumps({})}, 4096, "truncate")
    masked, _ = row_samples(tok, {**row, "meta": json.dumps({"kept": "mask"})}, 4096, "truncate")
    assert [s["turns"] for s in both] == [[1, 3]] and [s["turns"] for s in masked] == [[3]]
    assert masked_text(tok, masked[0]) == answers[0] and QWEN_CALL in masked_text(tok, both[0])
    assert QWEN_CALL in tok.decode(masked[0]["input_ids"])                            # still the context
    assert row_samples(tok, {**row, "meta": json.dumps({"kept": "refuse"})}, 4096, "truncate") == ([], "refused")
    path = tmp_path / "kept.jsonl"
    path.write_text(json.dumps({"id": "x", "messages": CHAT + [{"role": "assistant", "content": "It is 6."}]}) + "\n")
    (r,) = load_source(SourceSpec(path=str(path), mode="keep", kept="regenerate"))
    assert r["mode"] == "prompt" and json.loads(r["meta"])["kept"] == "regenerate"
    with pytest.raises(ValueError, match="kept 'mask' with mode 'keep' leaves nothing to train"):
        SourceSpec(path=str(path), mode="keep", kept="mask")


def test_marker_tokens_are_always_in_the_draft_vocab_and_coverage_is_per_source():
    """The target's markers (think, tool calls, end of turn) are in the draft vocab even when rarer than every
    other token; coverage is counted per source on its supervised tokens."""
    import torch

    from eagle3_core.data.vocab_map import build_vocab_map, coverage_by_source
    counts = torch.tensor([9, 8, 7, 6, 0, 1])
    d2t, t2d = build_vocab_map(counts, 3, always=[4, 5])
    assert t2d.nonzero().flatten().tolist() == [0, 4, 5]
    ids = [torch.tensor([0, 1, 4]), torch.tensor([0, 5, 2])]
    masks = [torch.tensor([0, 1, 1]), torch.tensor([1, 1, 1])]
    cov = coverage_by_source(ids, masks, ["a", "b"], t2d)
    assert cov == {"a": {"supervised": 2, "in_vocab": 1, "coverage": 0.5},
                   "b": {"supervised": 3, "in_vocab": 2, "coverage": 2 / 3}}


def test_on_policy_fraction_counts_supervised_tokens_that_are_the_targets_argmax(tmp_path):
    """features.on_policy on a shard in the store's layout: token t counts when target_top1[t - 1] == ids[t],
    over supervised tokens after the first; per source; the early gate names a source below the limit."""
    import torch
    from safetensors.torch import save_file

    from eagle3_core.features.on_policy import check_on_policy, on_policy_by_source
    ids = torch.tensor([5, 6, 7, 8, 5, 9, 9], dtype=torch.int32)
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1], dtype=torch.int8)
    top1 = torch.tensor([6, 7, 0, 1, 9, 1, 2], dtype=torch.int32)          # a: 6, 7 right, 8 wrong; b: 9 right, 9 wrong
    save_file({"input_ids": ids, "loss_mask": mask, "target_top1": top1, "offsets": torch.tensor([0, 4, 7])},
              str(tmp_path / "shard_00000.safetensors"), metadata={"ids": json.dumps(["a/1", "b/1"])})
    per = on_policy_by_source(tmp_path, {"a/1": "a", "b/1": "b"}, ["shard_00000.safetensors"])
    assert per == {"a": {"supervised": 3, "on_policy": 2, "fraction": 2 / 3},
                   "b": {"supervised": 2, "on_policy": 1, "fraction": 0.5}}
    check_on_policy(per, 0.5, "the first shard")
    with pytest.raises(ValueError, match="source b: 50.0% of 2 supervised tokens .* below features.min_on_policy 60%"):
        check_on_policy(per, 0.6, "the first shard")


def test_the_pipeline_regenerates_through_llama_servers_token_api_and_trains_its_ids(e2e_run):
    """The session's end-to-end run (debug_tiny: the real llama-server on the embedded target, generation.api
    'auto'): every prompt goes through /completion with the prompt as token ids, and every trained answer is,
    token for token, the ids llama-server reported; the report gives each source's on-policy fraction and the
    draft vocab's coverage of it."""
    from eagle3_core.contract.layout import RunLayout
    from eagle3_core.pipeline.report import collect, markdown
    cfg, _ = e2e_run
    run = RunLayout(cfg.run_dir)
    gm = json.loads((run.generations / "manifest.json").read_text())
    assert gm["api"] == "llama.cpp" and gm["token_ids"].startswith("from the server")
    rows = {r["id"]: r for s in gm["shards"] for r in prompts_mod.read_rows(run.generations / s)}
    samples = pq.read_table(run.tokenized_train).to_pylist()
    assert sorted(s["id"] for s in samples) == sorted(rows)
    eot = 2                                                                     # <|im_end|>
    for s in samples:
        r = rows[s["id"]]
        out = r["output_ids"] + ([] if r["finish_reason"] == "length" or r["output_ids"][-1] == eot else [eot])
        assert s["input_ids"] == r["prompt_ids"] + out
        assert [t for t, w in zip(s["input_ids"], s["loss_mask"]) if w] == out
    tm = json.loads((run.tokenized / "manifest.json").read_text())
    assert tm["token_sources"] == {"server": len(rows)} and tm["marker_tokens"] == {"<|im_end|>": eot}
    by_source = collect(cfg.run_dir)["by_source"]
    (st,) = by_source.values()
    assert st["samples"] == len(samples) and 0.5 < st["on_policy"] <= 1.0 and 0.5 < st["vocab_coverage"] <= 1.0
    table = "| source | samples | supervised tokens | on-policy | draft vocab coverage |"
    assert table in markdown(collect(cfg.run_dir))


def test_a_tool_call_cut_short_stays_text_and_the_markers_fall_back_to_text(toks, tokenizer):
    """An answer cut inside its tool call (max_new_tokens) reads back as text, never an error; a template whose
    markers are not single tokens (Qwen3's on the bare embedded tokenizer) is read in the decoded text."""
    from chat_templates import TEMPLATES
    from eagle3_core.data.markers import parse_answer
    tok = toks["qwen3"]
    cut = tok("<think>\nGo.\n</think>\n\n<tool_call>\n{\"name\": \"get_wea", add_special_tokens=False)["input_ids"]
    msg = parse_answer(tok, target_markers(tok), cut)
    assert msg["reasoning_content"] == "\nGo.\n" and "tool_calls" not in msg and msg["content"].startswith("<tool")
    bare = __import__("copy").deepcopy(tokenizer)
    bare.chat_template = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
    m = target_markers(bare)
    assert m.think is None and m.think_text and m.tool_format == "hermes" and m.tool_ids == (None,) * 5
    text = "<think>\nGo.\n</think>\n\n" + QWEN_CALL + "<|im_end|>"
    msg = parse_answer(bare, m, bare(text, add_special_tokens=False)["input_ids"])
    assert msg["reasoning_content"] == "\nGo.\n" and msg["content"] == ""
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory):
    """The Qwen3 stand-in tokenizer saved as a local target directory (what run_tokenize loads)."""
    target = tmp_path_factory.mktemp("qwen3_tokenizer")
    stand_in("qwen3").save_pretrained(target)
    return target


def test_the_tokenize_stage_counts_round_trip_refusals_per_source_and_cause(qwen3_target, toks, tmp_path):
    """The text path's refusals in the tokenize stage (run_tokenize on a hand-made generations output, the target
    the Qwen3 stand-in, thinking by default): a kept Kimi-K2-style trajectory without reasoning is refused, counted in
    tokenized/manifest.json's rejected_causes under its source and cause, with its reason in rejects.jsonl; answers
    with their reasoning (the OpenAI API's text) train as the template renders them after the generation prompt."""
    from eagle3_core.config import PipelineConfig, PromptConfig, TargetConfig
    from eagle3_core.contract.manifest import write_manifest
    from eagle3_core.pipeline.tokenize_stage import run_tokenize
    kept = {"id": "k2/1", "source": "k2", "mode": "keep", "tools": "", "meta": "{}", "finish_reason": "kept",
            "response": "", "reasoning": "", "messages": json.dumps(CHAT + [{"role": "assistant", "content": "6."}])}
    answered = [{"id": f"own/{i}", "source": "own", "mode": "prompt", "tools": "", "meta": "{}",
                 "finish_reason": "stop", "response": "It is 4.", "reasoning": "Two plus two.",
                 "messages": json.dumps(CHAT[:1])} for i in range(3)]
    cfg = PipelineConfig(run_dir=tmp_path / "run", target=TargetConfig(model=str(qwen3_target)),
                         prompts=PromptConfig(max_reject_frac=1.0))
    gen = cfg.run_dir / "generations"
    gen.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(answered + [kept]), gen / "shard_00000.parquet")
    write_manifest(gen / "manifest.json", {"inputs_key": "hand-made", "shards": ["shard_00000.parquet"]})
    m = run_tokenize(cfg, log=lambda *_: None)
    assert m["rejected_causes"] == {"k2": {"empty_thinking": 1}} and m["rejected_per_source"] == {"own": 0, "k2": 1}
    (reject,) = [json.loads(x) for x in (cfg.run_dir / "tokenized" / "rejects.jsonl").read_text().splitlines()]
    assert reject["id"] == "k2/1" and reject["row"] == 3 and reject["reason"].startswith("RoundTripError")
    assert "assistant turn 1: the target thinks" in reject["reason"] and m["samples"] == 3
    samples = pq.read_table(cfg.run_dir / "tokenized" / "train.parquet").to_pylist()
    want = "<think>\nTwo plus two.\n</think>\n\nIt is 4.<|im_end|>"
    assert {masked_text(toks["qwen3"], s) for s in samples} == {want}


# stand-in -> (chat-template kwargs, what the target writes, tokens it may write before the cut): cut inside the
# reasoning (K2.5, Qwen3 thinking) or inside the answer (DeepSeek-V3.1 without thinking)
CUT = {"kimi_k25": ({}, "Let me add two and two carefully.</think>It is 4.<|im_end|>", 5),
       "qwen3": ({}, "<think>\nLet me add two and two carefully.\n</think>\n\nIt is 4.<|im_end|>", 6),
       "deepseek_v31": ({"thinking": False}, "Two and two make four, so it is 4." + DS_END, 6)}


@pytest.mark.parametrize("name", sorted(CUT))
def test_a_cut_off_turn_is_trained_without_a_closing_marker_the_message_lacks(toks, tmp_path, name):
    """A turn cut at max_new_tokens (finish reason 'length'): through the token API it is trained as the server's
    ids, no end of turn added; on the text path (the same answer as the OpenAI API gives it) the template's
    rendering is ended where the target stopped: no `</think>` after K2.5 reasoning cut short, no `\\n</think>\\n\\n`
    invented by Qwen3 at the cut, no end of turn: the trained span equals the server's ids. K2.5's template drops
    the reasoning of the last answer (it renders `<think></think>`): the cut turn is refused on the text path as a
    finished one is (cause 'reasoning'), not trained as `</think>` right after the prompt's `<think>`."""
    kwargs, answer, limit = CUT[name]
    tok = toks[name]
    row, server = regenerate_row(tmp_path, tok, CHAT[:1], [answer], kwargs, turns="final", max_new=limit)
    assert row["finish_reason"] == "length" and len(server.returned[0]) == limit
    (sample,), source = row_samples(tok, row, 4096, "truncate", kwargs)
    assert source == "server" and [t for t, w in zip(sample["input_ids"], sample["loss_mask"]) if w] == \
        server.returned[0]
    text_row = {**row, "api": "openai", "prompt_ids": [], "output_ids": []}
    if name == "kimi_k25":
        with pytest.raises(RoundTripError, match="renders the turn's reasoning differently") as e:
            row_samples(tok, text_row, 4096, "truncate", kwargs)
        assert e.value.cause == "reasoning"
        return
    (text,), source = row_samples(tok, text_row, 4096, "truncate", kwargs)
    assert source == "template" and text["input_ids"] == sample["input_ids"], \
        (tok.decode(text["input_ids"][-8:]), tok.decode(sample["input_ids"][-8:]))
    assert text["loss_mask"] == sample["loss_mask"] and "</think>" not in masked_text(tok, text)


def test_a_server_returning_ids_outside_the_vocabulary_is_refused_at_generation_naming_the_row_and_server(toks,
                                                                                                         tmp_path):
    """A server of another model answers with ids the target's tokenizer does not have: the row is recorded as
    failed at generation, naming the row and the server (it used to pass and crash extraction with an IndexError)."""
    tok = toks["qwen3"]

    class OtherModel(SGLangTokenStandIn):
        def _generate(self, path, body):
            status, payload = super()._generate(path, body)
            payload["output_ids"] = payload["output_ids"][:-1] + [len(tok) + 7]
            return status, payload

    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "s/r", "source": "s", "messages": json.dumps(CHAT[:1]),
                                          "mode": "prompt", "tools": "", "meta": "{}"}]), prompts)
    gen = GenerationConfig(api="sglang", concurrency=1, max_new_tokens=50, flush_rows=1, max_truncated_frac=1.0,
                           progress_interval_s=60)
    with OtherModel(tok, ["It is 4.<|im_end|>"], target_markers(tok).eot) as server:
        (record,) = asyncio.run(regenerate(prompts, tmp_path / "gen", [0], "k", gen, ServerConfig(kind="external"),
                                           [server.url], tok, log=lambda *_: None))
    text = json.dumps(record)
    assert "s/r" in text and server.url in text and "outside the target's vocabulary" in text, text[:800]
