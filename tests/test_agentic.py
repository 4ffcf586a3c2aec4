"""Agentic and reasoning data as the target writes it (issue 24), against the real llama-server serving the embedded
target with --jinja; what the server received is read through a recording proxy (tests/recording_proxy.py) that
forwards every request unchanged. Token budgets before any request, turn-by-turn regeneration, tools and tool calls,
the server's own token ids, the early quality gate."""
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle3_core.config import FeatureConfig, GenerationConfig, PipelineConfig, PromptConfig, ServerConfig
from eagle3_core.config.mix import DataMix, SourceSpec
from eagle3_core.data import prompt_set as prompts_mod
from eagle3_core.data.chat import prompt_ids
from eagle3_core.data.samples import row_samples
from eagle3_core.generation.quality import QualityGateError
from eagle3_core.pipeline.generation_stage import run_generation
from eagle3_core.pipeline.prompts_stage import run_prompts
from eagle3_core.pipeline.tokenize_stage import run_tokenize
from eagle3_core.serving.launcher import llama_server
from eagle3_core.target.loading import embedded_gguf_path
from recording_proxy import RecordingProxy
from test_data import QWEN3, _with_template, masked_spans

SYSTEM = {"role": "system", "content": "Answer in one short sentence."}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
# the Qwen3-style template of tests/test_data.py, with a tools header and arguments given as JSON text or an
# object (llama.cpp checks a template by rendering tool calls with object arguments)
QWEN3_TOOLS = ("{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
               "{% endfor %}\n</tools><|im_end|>\n{% endif -%}\n"
               + QWEN3.replace("{{ c.function.arguments }}", "{% if c.function.arguments is string %}"
                               "{{ c.function.arguments }}{% else %}{{ c.function.arguments | tojson }}{% endif %}"))
# thinking off, as Qwen3's enable_thinking=False writes it: an empty think block in the generation prompt
QWEN3_TOOLS_NO_THINKING = QWEN3_TOOLS.replace(
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{% endif -%}",
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif -%}")


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with llama_server(embedded_gguf_path(), tmp_path_factory.mktemp("srv") / "server.log", parallel=2,
                      ctx_per_slot=1024, extra_args=["-t", "1"]) as url:
        yield url


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run_cfg(run_dir: Path, url: str, prompts: PromptConfig, **gen) -> PipelineConfig:
    return PipelineConfig(run_dir=run_dir, prompts=prompts,
                          server=ServerConfig(kind="external", urls=[url], probe_interval_s=0.5),
                          features=FeatureConfig(max_length=gen.pop("max_length", 1024)),
                          generation=GenerationConfig(**{"max_new_tokens": 48, "concurrency": 2, "shard_size": 4,
                                                         "flush_rows": 1, "max_truncated_frac": 1.0, **gen}))


def gen_rows(cfg: PipelineConfig) -> list[dict]:
    return [r for f in sorted((cfg.run_dir / "generations").glob("shard_*.parquet"))
            for r in prompts_mod.read_rows(f)]


@pytest.mark.slow
def test_prompts_over_the_budget_are_measured_and_dropped_before_any_request(server, tmp_path):
    """3 rows over the budget (prompt + max_new_tokens > max_length) and 5 short ones: the prompts stage reports
    every length per source and drops the 3; the generation stage sends exactly 5 requests, none for a long row."""
    long_rows = [{"id": f"l{i}", "prompt": f"Summarize {i}: " + "the cat sat on the mat " * 120} for i in range(3)]
    short = [{"id": f"s{i}", "prompt": q} for i, q in enumerate(
        ["What is 2+2?", "Say yes.", "Name a color.", "What is 3+3?", "Say no.", "Name a fruit."])]
    mix = DataMix(name="t", sources=[
        SourceSpec(name="long", path=write_jsonl(tmp_path / "long.jsonl", long_rows), count=3),
        SourceSpec(name="short", path=write_jsonl(tmp_path / "short.jsonl", short), count=6)])
    with RecordingProxy(server) as proxy:
        cfg = run_cfg(tmp_path / "run", proxy.url, PromptConfig(mix=mix, num_train=8, num_eval=1, seed=1),
                      max_new_tokens=8, max_length=512)
        lines = []
        m = run_prompts(cfg, log=lines.append)
        assert m["eval_ids"][0].startswith("short/")              # seed 1: the held-out row is a short one
        b = m["budget"]["per_source"]
        assert {k: b["long"][k] for k in ("rows", "over", "dropped", "last_turns", "long")} == \
            {"rows": 3, "over": 3, "dropped": 3, "last_turns": 0, "long": 0}
        assert {k: b["short"][k] for k in ("rows", "over", "dropped")} == {"rows": 5, "over": 0, "dropped": 0}
        assert b["long"]["tokens"]["rows"] == 3 and b["long"]["tokens"]["min"] > 512 - 8
        assert b["short"]["tokens"]["rows"] == 5 and b["short"]["tokens"]["max"] < 40
        assert "long: 3 rows" in lines[0] and "3 dropped" in lines[0]
        train = prompts_mod.read_rows(cfg.run_dir / "prompts" / "train.parquet")
        assert sorted(r["id"] for r in train) == sorted(m["train_ids"]) and len(train) == 5
        assert all(json.loads(r["meta"])["prompt_tokens"] < 40 for r in train)
        assert m["stats"]["train"] == 5 and m["stats"]["per_source"]["short"]["train"] == 5
        assert proxy.posts == []                                  # measured and dropped before any request
        run_generation(cfg, log=quiet)
        sent = proxy.bodies("/v1/chat/completions")
    assert len(sent) == 5
    assert not any("the cat sat" in json.dumps(body) for body in sent)


def test_last_turns_and_long_policies(tokenizer):
    """'last_turns' keeps the system message and the last turns that fit; 'long' keeps the row whole, marked, unless
    its prompt alone has max_length tokens or more."""
    from eagle3_core.data.budget import apply_budget
    big = "word " * 300
    msgs = [SYSTEM, {"role": "user", "content": big}, {"role": "assistant", "content": big},
            {"role": "user", "content": "And now?"}]
    row = {"id": "r", "source": "s", "messages": msgs, "mode": "prompt", "tools": "", "meta": "{}"}
    kept, st = apply_budget(tokenizer, [row], 16, 256, "last_turns")
    assert kept[0]["messages"] == [SYSTEM, msgs[3]] and st["per_source"]["s"]["last_turns"] == 1
    meta = json.loads(kept[0]["meta"])
    assert meta["over_budget"] == "last_turns" and meta["messages_dropped"] == 2
    assert meta["tokens_after_cut"] == len(prompt_ids(tokenizer, [SYSTEM, msgs[3]]))
    assert meta["prompt_tokens"] == len(prompt_ids(tokenizer, msgs)) > 600
    n = meta["prompt_tokens"]
    kept, st = apply_budget(tokenizer, [row], 16, n + 8, "long")        # prompt + 16 new > n + 8: over, kept long
    assert kept[0]["messages"] == msgs and json.loads(kept[0]["meta"])["long"] is True
    assert st["per_source"]["s"]["long"] == 1 and st["per_source"]["s"]["over"] == 1
    assert apply_budget(tokenizer, [row], 16, n + 8, "drop")[0] == []
    # 'long' never sends a prompt that alone fills max_length: no answer token would fit in a training sample
    for limit in (n, n - 1, 256):
        kept, st = apply_budget(tokenizer, [row], 16, limit, "long")
        assert kept == [] and st["per_source"]["s"]["prompt_over_max_length"] == 1
        assert st["per_source"]["s"]["long"] == 0 and st["per_source"]["s"]["dropped"] == 1


@pytest.mark.slow
def test_three_turns_are_regenerated_in_order_after_the_targets_own_answers(server, tmp_path, tokenizer):
    """turns='all': a 3-turn conversation gives 3 requests, in order, request k carrying the target's answers
    1..k-1 in place of the data's; every regenerated turn is in the loss mask."""
    data = [SYSTEM, {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "DATA ONE"},
            {"role": "user", "content": "What is 3+3?"}, {"role": "assistant", "content": "DATA TWO"},
            {"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "DATA THREE"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"id": "c", "messages": data}, {"id": "e", "messages": data[:2]}])
    with RecordingProxy(server) as proxy:
        cfg = run_cfg(tmp_path / "run", proxy.url, PromptConfig(sources=[path], num_train=1, num_eval=1, seed=3),
                      turns="all")
        run_prompts(cfg, log=quiet)
        assert prompts_mod.read_rows(cfg.run_dir / "prompts" / "train.parquet")[0]["id"].endswith("/c")
        gm = run_generation(cfg, log=quiet)
        posts = list(proxy.posts)
    assert len(posts) == 3
    answers = [p["answer"]["choices"][0]["message"]["content"] for p in posts]
    assert all(p["answer"]["choices"][0]["finish_reason"] == "stop" for p in posts), answers
    A = [{"role": "assistant", "content": a} for a in answers]
    assert [p["body"]["messages"] for p in posts] == [data[:2], data[:2] + A[:1] + data[3:4],
                                                      data[:2] + A[:1] + data[3:4] + A[1:2] + data[5:6]]
    assert not any("DATA" in json.dumps(p["body"]) for p in posts)
    (row,) = gen_rows(cfg)
    assert row["messages"] == data[:2] + A[:1] + data[3:4] + A[1:2] + data[5:6] + A[2:]
    assert [t["index"] for t in json.loads(row["turns"])] == [2, 4, 6] and row["turn_requests"] == 3
    assert gm["turns"] == {"mode": "all", "max_turns": None, "requests": 3, "rows_by_requests": {"3": 1}}
    tm = run_tokenize(cfg, log=quiet)
    (sample,) = pq.read_table(cfg.run_dir / "tokenized" / "train.parquet").to_pylist()
    assert masked_spans(tokenizer, sample) == [a + "<|im_end|>" for a in answers]
    assert tm["token_sources"] == {"template": 1}


def test_each_regenerated_turn_trains_its_reasoning_where_the_template_strips_it(qwen3_tok):
    """Qwen3-style template (earlier turns lose their <think>): one sample per regenerated turn, each trained on
    that turn with its reasoning, as the template renders it when the turn is the one being written."""
    msgs = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "It is 4.", "reasoning_content": "Two and two."},
            {"role": "user", "content": "3+3?"},
            {"role": "assistant", "content": "It is 6.", "reasoning_content": "Three and three."}]
    row = {"id": "q", "mode": "prompt", "messages": msgs, "tools": "", "finish_reason": "stop",
           "turns": json.dumps([{"index": 1}, {"index": 3}]), "api": "openai"}
    samples, source = row_samples(qwen3_tok, row, 1024, "truncate")
    assert [s["id"] for s in samples] == ["q/turn1", "q/turn3"] and source == "template"
    assert [masked_spans(qwen3_tok, s) for s in samples] == [
        ["<think>\nTwo and two.\n</think>\n\nIt is 4.<|im_end|>"],
        ["<think>\nThree and three.\n</think>\n\nIt is 6.<|im_end|>"]]
    # the second sample's context is the conversation as the template renders it at that turn (reasoning gone)
    assert "Two and two." not in qwen3_tok.decode(samples[1]["input_ids"])


@pytest.fixture(scope="module")
def qwen3_tok(tokenizer):
    return _with_template(tokenizer, QWEN3_TOOLS)


@pytest.mark.slow
def test_a_kept_tool_call_turn_is_trained_as_rendered_and_requests_carry_the_tools(tmp_path, tokenizer):
    """A row with tools and a tool-call turn, turn by turn, on a server using the same Qwen3-style template: the
    data's tool-call turn and tool result are kept (tool results cannot be re-run), both text turns are
    regenerated, each request carries the row's tools, and the tool-call turn is in the trained tokens exactly as
    the template renders it (thinking off, as the data's turns have no reasoning: a thinking template would train an
    empty think block the target never writes, which data.history refuses)."""
    data = [SYSTEM, {"role": "user", "content": "Is it raining in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"rain": true}'},
            {"role": "assistant", "content": "DATA ANSWER"}, {"role": "user", "content": "Say yes."},
            {"role": "assistant", "content": "DATA TWO"}]
    path = write_jsonl(tmp_path / "tools.jsonl", [{"id": "t", "messages": data, "tools": TOOLS},
                                                  {"id": "e", "messages": data[:2]}])
    qwen3_tok = _with_template(tokenizer, QWEN3_TOOLS_NO_THINKING)
    (tmp_path / "tmpl.jinja").write_text(QWEN3_TOOLS_NO_THINKING)
    with llama_server(embedded_gguf_path(), tmp_path / "server.log", parallel=1, ctx_per_slot=1024,
                      extra_args=["-t", "1", "--chat-template-file", str(tmp_path / "tmpl.jinja")]) as url, \
            RecordingProxy(url) as proxy:
        cfg = run_cfg(tmp_path / "run", proxy.url, PromptConfig(sources=[path], num_train=1, num_eval=1, seed=3),
                      turns="all", concurrency=1)
        run_prompts(cfg, log=quiet)
        train = prompts_mod.read_rows(cfg.run_dir / "prompts" / "train.parquet")
        assert train[0]["id"].endswith("/t") and json.loads(train[0]["tools"]) == TOOLS
        run_generation(cfg, log=quiet)
        bodies = proxy.bodies("/v1/chat/completions")
    assert len(bodies) == 2 and all(b["tools"] == TOOLS for b in bodies)
    assert [len(b["messages"]) for b in bodies] == [4, 6] and bodies[0]["messages"][2]["tool_calls"] == [CALL]
    (row,) = gen_rows(cfg)
    samples, _ = row_samples(qwen3_tok, row, 1024, "truncate")
    spans = [s for sample in samples for s in masked_spans(qwen3_tok, sample)]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    assert spans[0] == call and len(spans) == 3                          # the tool-call turn + 2 regenerated turns
    rendered = qwen3_tok.apply_chat_template(row["messages"], tools=TOOLS, tokenize=False)
    assert "# Tools\n<tools>" in rendered and all(s.replace("<|im_end|>", "") in rendered for s in spans)


@pytest.mark.slow
def test_token_id_api_trains_on_the_servers_own_ids(server, tmp_path, tokenizer):
    """api 'llama.cpp': the tokenize stage trains on prompt_ids + output_ids as the server gave them (the manifest
    says so) and the sample check finds them equal to the re-tokenized text."""
    qs = ["What is 2+2?", "Say yes.", "Name a color.", "What is 3+3?", "Say no."]
    path = write_jsonl(tmp_path / "q.jsonl", [{"id": f"q{i}", "messages": [SYSTEM, {"role": "user", "content": q}]}
                                              for i, q in enumerate(qs)])
    cfg = run_cfg(tmp_path / "run", server, PromptConfig(sources=[path], num_train=4, num_eval=1), api="llama.cpp")
    run_prompts(cfg, log=quiet)
    run_generation(cfg, log=quiet)
    tm = run_tokenize(cfg, log=quiet)
    assert tm["token_sources"] == {"server": 4} and tm["token_source"].startswith("the server's own ids")
    assert tm["server_ids_check"]["checked"] == 4 and tm["server_ids_check"]["equal"] == 4
    by_id = {r["id"]: r for r in gen_rows(cfg)}
    for s in pq.read_table(cfg.run_dir / "tokenized" / "train.parquet").to_pylist():
        r = by_id[s["id"]]
        assert s["input_ids"] == r["prompt_ids"] + r["output_ids"] and r["finish_reason"] == "stop"
        assert r["output_ids"][-1] == 2 and sum(s["loss_mask"]) == len(r["output_ids"])   # 2: <|im_end|>


@pytest.mark.slow
def test_early_gate_fails_fast_after_the_first_answers(server, tmp_path):
    """Every answer is cut at 2 tokens and no truncated answer is allowed: the gate runs on the first 4 answers and
    stops the stage with examples; at most gate_after + concurrency requests were sent (of 16 prompts)."""
    from conftest import SHARED_DATA
    with RecordingProxy(server) as proxy:
        cfg = run_cfg(tmp_path / "run", proxy.url, PromptConfig(sources=[str(SHARED_DATA / "gsm8k/train.jsonl")],
                                                                num_train=16, num_eval=1),
                      max_new_tokens=2, max_truncated_frac=0.0, gate_after=4, concurrency=2)
        run_prompts(cfg, log=quiet)
        with pytest.raises(QualityGateError, match=r"(?s)early gate: the first 4 answers.*truncated: 4 of 4 answers "
                                                   r"\(100\.0%, limit 0\.0%.*'tail'"):
            run_generation(cfg, log=quiet)
        n = len(proxy.posts)
    assert 4 <= n <= 4 + 2


def test_report_shows_both_sampling_settings_and_flags_a_mismatch():
    from eagle3_core.evaluation.sampling_compare import compare_sampling
    from eagle3_core.pipeline.report import sampling_markdown
    same = compare_sampling({"temperature": 0.0, "top_p": 1.0, "chat_template_kwargs": {}}, None)
    assert same["mismatch"] == [] and same["evaluation"] == {"temperature": 0.0, "top_p": 1.0, "top_k": 0,
                                                             "thinking": "template default"}
    sp = compare_sampling({"temperature": 0.7, "top_p": 0.9, "chat_template_kwargs": {"enable_thinking": False}},
                          {"temperature": 0.0, "top_p": 1.0, "chat_template_kwargs": {}})
    assert sp["mismatch"] == ["greedy vs sampled", "temperature", "top_p", "thinking"]
    md = "\n".join(sampling_markdown(sp))
    assert "| regeneration | 0.7 | 0.9 | off | enable_thinking=False |" in md
    assert "| evaluation | 0 | 1 | off | template default |" in md
    assert "**Warning**: regeneration and evaluation sample differently (greedy vs sampled, temperature" in md
    assert "Warning" not in "\n".join(sampling_markdown(same)) and "serving" not in "\n".join(sampling_markdown(same))


def test_report_names_the_declared_serving_settings_and_their_mismatch_with_evaluation():
    from eagle3_core.evaluation.sampling_compare import compare_sampling
    from eagle3_core.pipeline.report import sampling_markdown
    regen = {"temperature": 0.7, "top_p": 0.95, "top_k": 20, "chat_template_kwargs": {}}
    sp = compare_sampling(regen, {**regen, "top_k": 0}, {"temperature": 1.0, "top_p": 0.95})
    assert sp["mismatch"] == ["top_k"] and sp["serving_mismatch"] == ["temperature"]
    assert sp["serving"] == {"temperature": 1.0, "top_p": 0.95, "top_k": 0, "thinking": "template default"}
    md = "\n".join(sampling_markdown(sp))
    assert "| regeneration | 0.7 | 0.95 | 20 | template default |" in md
    assert "| serving (declared) | 1 | 0.95 | off | template default |" in md
    assert "evaluation and the declared serving settings differ (temperature)" in md
    assert compare_sampling(regen, regen, {"temperature": 0.7, "top_p": 0.95, "top_k": 20})["serving_mismatch"] == []
    assert compare_sampling(regen, {"temperature": 0.0}, {"temperature": 1.0, "top_p": 0.95})[
        "serving_mismatch"] == ["greedy vs sampled", "temperature", "top_p"]


def test_tools_are_normalized_from_openai_tools_and_hermes_system_text(tmp_path):
    """The `tools` column: an OpenAI `tools` field (a list or JSON text) and a Hermes `<tools>` block (a Python
    literal inside the system text, which stays as it is) give the same OpenAI schema list."""
    from conftest import ROOT
    from eagle3_core.data.prompt_set import load_source
    hermes = load_source(SourceSpec(path=str(ROOT / "tests/fixtures/prompt_formats/hermes_function_calling.json"),
                                    mode="keep"))[0]
    assert json.loads(hermes["tools"]) == [{"type": "function", "function": {
        "name": "get_stock_price", "description": "Get a stock price", "parameters": {
            "type": "object", "properties": {"symbol": {"type": "string"}}, "required": ["symbol"]}}}]
    assert json.loads(hermes["meta"])["tools_from"] == "system" and "<tools>" in hermes["messages"][0]["content"]
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"id": "a", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS},
        {"id": "b", "messages": [{"role": "user", "content": "hi"}], "tools": json.dumps([TOOLS[0]["function"]])},
        {"id": "c", "messages": [{"role": "user", "content": "hi"}]}])
    rows = load_source(SourceSpec(path=path))
    assert [json.loads(r["tools"]) if r["tools"] else None for r in rows] == [TOOLS, TOOLS, None]
    rejects = []
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"id": "x", "messages": [{"role": "user", "content": "hi"}],
                                                "tools": [{"description": "no name"}]}])
    assert load_source(SourceSpec(path=bad), rejects=rejects) == []
    assert "row 0: field 'tools': a tool has no function name" in rejects[0]["reason"]
