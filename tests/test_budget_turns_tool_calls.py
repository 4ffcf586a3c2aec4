"""What reaches training is what the target can write: tool calls checked per row, token budgets that fit (check's
refusal, 'long' and 'drop' keeping the growth rules), every user turn of Spec-Bench's two-turn rows answered, and
an SGLang reply without spec_verify_ct counted as zero verify steps."""
import asyncio
import json

import httpx
import pytest

from conftest import SHARED_DATA
from eagle3_core.config import GenerationConfig, PipelineConfig, PromptConfig, ServerConfig
from eagle3_core.config.mix import DataMix, SourceSpec
from eagle3_core.data import prompt_set as prompts_mod
from eagle3_core.data.budget import RowBudget, apply_budget, budget_problems
from eagle3_core.data.chat import prompt_ids
from eagle3_core.data.tool_calls import ToolCallError, check_generation_tool_calls, check_tool_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
SPEC_BENCH = SHARED_DATA / "spec_bench" / "question.jsonl"


def call(name="get_weather", arguments='{"city": "Paris"}'):
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}


def chat(*calls):
    return [{"role": "user", "content": "Is it raining in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": list(calls)},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"rain": true}'},
            {"role": "assistant", "content": "Yes."}]


def test_malformed_tool_calls_are_refused_and_json_string_arguments_accepted(tmp_path):
    assert check_tool_calls(chat(call()), TOOLS) == 1                               # JSON text, as OpenAI gives it
    assert check_tool_calls(chat(call(arguments={"city": "Paris"})), TOOLS) == 1     # an object
    cut = r"arguments are not complete JSON \(Unterminated string starting at: character 9 of 13; cut off\?\)"
    for bad, why in ((call(arguments='{"city": "Par'), r"message 1: the call of 'get_weather': " + cut),
                     (call(arguments='["Paris"]'), "arguments are a JSON list, not an object"),
                     (call(arguments=7), "arguments are int, neither a JSON object nor the JSON text of one"),
                     (call(name="get_wether"), r"calls 'get_wether', a function the row's tools do not declare "
                                               r"\(declared: \['get_weather'\]; nearest 'get_weather'\)")):
        with pytest.raises(ToolCallError, match=why):
            check_tool_calls(chat(bad), TOOLS)
    with pytest.raises(ToolCallError, match="the row declares no tools"):
        check_tool_calls(chat(call()), None)
    # the prompts stage: each bad row rejected with its reason, counted per source; the good row goes through
    rows = [{"id": "ok", "messages": chat(call()), "tools": TOOLS},
            {"id": "cut", "messages": chat(call(arguments='{"city": ')), "tools": TOOLS},
            {"id": "undeclared", "messages": chat(call(name="search")), "tools": TOOLS},
            {"id": "no_tools", "messages": chat(call())}]
    path = tmp_path / "calls.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rejects = []
    got = prompts_mod.load_source(SourceSpec(path=str(path), mode="keep"), rejects=rejects)
    assert [r["id"] for r in got] == ["calls/ok"] and got[0]["messages"][1]["tool_calls"][0] == call()
    assert [(r["row"], r["reason"].split(": ", 1)[1].split(":")[0]) for r in rejects] == [
        (1, "message 1"), (2, "message 1"), (3, "message 1")]
    assert "not complete JSON" in rejects[0]["reason"] and "'search'" in rejects[1]["reason"]
    assert "declares no tools" in rejects[2]["reason"]
    # the tokenize stage: the target's own answer with a cut-off call is refused with the reason
    row = {"messages": chat(call())[:1], "tools": json.dumps(TOOLS), "tool_calls": json.dumps([call(arguments='{')])}
    with pytest.raises(ToolCallError, match="the answer: the call of 'get_weather': arguments are not complete JSON"):
        check_generation_tool_calls(row)


def _cfg(**kw) -> PipelineConfig:
    parts = {"server": ServerConfig(kind="sglang", extra_args=["--tp-size", "8", "--context-length", "8192"]),
             "generation": GenerationConfig(max_new_tokens=2048), "features": {"max_length": 8000}}
    parts.update(kw)
    return PipelineConfig(**parts)


def test_check_refuses_a_budget_prompt_rows_cannot_fit():
    """max_new_tokens against features.max_length, and the regenerating server's context against both (SGLang's
    must exceed the longest request, a llama.cpp slot must hold it)."""
    facts, problems = budget_problems(_cfg(), 262144)
    assert problems == [] and facts["room_for_the_prompt"] == 5952 and facts["server_context"] == 8192
    _, problems = budget_problems(_cfg(generation=GenerationConfig(max_new_tokens=8192)), 262144)
    assert [f for f, _ in problems] == ["generation.max_new_tokens", "server.extra_args"]
    assert "8192 leaves no room for a prompt in features.max_length 8000" in problems[0][1]
    assert "is not above generation.max_new_tokens 8192" in problems[1][1]
    _, problems = budget_problems(_cfg(features={"max_length": 8192}), 262144)
    assert [f for f, _ in problems] == ["server.extra_args"] and "is below 8193" in problems[0][1]
    assert budget_problems(_cfg(features={"max_length": 8191}), None)[1] == []
    no_flag = _cfg(server=ServerConfig(kind="sglang", extra_args=["--tp-size", "8"]))
    assert budget_problems(no_flag, 4096)[0]["server_context"] == 4096               # SGLang's default: the model's
    assert "is below 8001" in budget_problems(no_flag, 4096)[1][0][1]
    long_ = _cfg(features={"max_length": 4096}, prompts=PromptConfig(over_budget="long"),
                 server=ServerConfig(kind="sglang", extra_args=["--context-length", "6143"]))
    assert "is below 6144" in budget_problems(long_, None)[1][0][1]                  # 4095 + 2048 + 1
    assert budget_problems(long_.model_copy(update={"prompts": PromptConfig()}), None)[1] == []
    slot = _cfg(server=ServerConfig(kind="llama.cpp", ctx_per_slot=4096))
    assert [f for f, _ in budget_problems(slot, None)[1]] == ["server.ctx_per_slot"]
    assert budget_problems(_cfg(server=ServerConfig(kind="llama.cpp", ctx_per_slot=8000)), None)[1] == []
    assert budget_problems(_cfg(server=ServerConfig(kind="external", url="http://x")), None)[0][
        "server_context"] == "not known"
    keep = _cfg(generation=GenerationConfig(max_new_tokens=9000), prompts=PromptConfig(
        mix=DataMix(name="k", sources=[SourceSpec(path="a.jsonl", mode="keep", count=136)]), num_train=120))
    assert budget_problems(keep, None)[1] == []                                      # kept rows send no request


def _rows(tmp_path, n: int, long_every: int, reps: int = 60):
    """n prompts; every `long_every`-th one long (60 reps: 395 tokens with the embedded target's template, 30: 215;
    the others about 40)."""
    rows = [{"id": f"q{i}", "prompt": (f"Question {i}: " + "the cat sat on the mat " * reps if i % long_every == 0
                                       else f"What is {i} plus {i}?")} for i in range(n)]
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_drop_fills_the_train_set_from_spare_rows_keeping_the_growth_rules(tmp_path, tokenizer):
    """20 train + 2 held-out prompts of a 40-row source where every 4th row is over the budget: without filling
    the train set comes out short (the rows the budget drops), with it every train row fits and there are 20; a
    larger sample (24) is a superset in the same order, the held-out rows stay held out."""
    src = _rows(tmp_path, 40, 4)
    cfg = PromptConfig(sources=[src], num_train=20, num_eval=2, seed=3)

    def budget():
        return RowBudget(tokenizer, 16, 128, "drop")
    train0, _, _ = prompts_mod.build_prompts(cfg)
    short, _ = apply_budget(tokenizer, train0, 16, 128, "drop")
    assert len(short) < 20                                                      # the old behaviour: short
    b = budget()
    train, evals, stats = prompts_mod.build_prompts(cfg, budget=b)
    assert len(train) == 20 and stats["train_short"] == 0 and stats["train"] == 20
    assert all(json.loads(r["meta"])["prompt_tokens"] + 16 <= 128 for r in train)
    st = b.stats()["per_source"]["q"]
    assert st["dropped"] == st["over"] == st["rows"] - 20 > 0
    assert {r["id"] for r in train}.isdisjoint(r["id"] for r in evals) and len(evals) == 2
    earlier = {"train_ids": [r["id"] for r in train], "eval_ids": [r["id"] for r in evals]}
    grown, grown_eval, _ = prompts_mod.build_prompts(cfg.model_copy(update={"num_train": 24}), earlier=earlier,
                                                     budget=budget())
    assert [r["id"] for r in grown][:20] == earlier["train_ids"] and len(grown) == 24
    assert [r["id"] for r in grown_eval] == earlier["eval_ids"]
    assert all(json.loads(r["meta"])["prompt_tokens"] + 16 <= 128 for r in grown)
    again, _, _ = prompts_mod.build_prompts(cfg, budget=budget())                   # stable order
    assert [r["id"] for r in again] == earlier["train_ids"]
    # too few rows fit: the train set is as long as the source allows, and says how short
    few, held, stats = prompts_mod.build_prompts(cfg.model_copy(update={"num_train": 37}), budget=budget())
    fit = 40 - 10 - sum(not int(r["id"].rsplit("q", 1)[1]) % 4 == 0 for r in held)   # 10 long rows, 1 held out
    assert len(few) == fit < 37 and stats["train_short"] == 37 - fit


def test_long_keeps_over_budget_rows_but_never_a_prompt_that_alone_fills_max_length(tmp_path, tokenizer):
    src = _rows(tmp_path, 12, 4, reps=30)                                        # long prompts: 215 tokens
    b = RowBudget(tokenizer, 64, 256, "long")
    train, _, _ = prompts_mod.build_prompts(PromptConfig(sources=[src], num_train=10, num_eval=1, seed=1), budget=b)
    st = b.stats()["per_source"]["q"]
    long_rows = [r for r in train if json.loads(r["meta"]).get("long")]
    assert len(train) == 10 and st["prompt_over_max_length"] == 0 and len(long_rows) == st["long"] > 0
    assert all(256 - 64 < json.loads(r["meta"])["prompt_tokens"] < 256 for r in long_rows)
    b = RowBudget(tokenizer, 64, 128, "long")                                    # now the long prompts fill 128
    train, _, stats = prompts_mod.build_prompts(PromptConfig(sources=[src], num_train=8, num_eval=1, seed=1),
                                                budget=b)
    st = b.stats()["per_source"]["q"]
    assert st["prompt_over_max_length"] == st["dropped"] == st["over"] > 0 and st["long"] == 0
    assert stats["train_short"] == 0
    assert all(json.loads(r["meta"])["prompt_tokens"] < 128 for r in train) and len(train) == 8


def test_two_turn_spec_bench_rows_are_answered_turn_by_turn(tmp_path, target_model, tokenizer):
    """MT-bench's two-turn questions of Spec-Bench: under turns 'all' the second user turn is sent after the
    target's own first answer (2 requests a row); under 'final', or past max_turns, the prompts stage says which
    turns are left unanswered and why."""
    from eagle3_core.generation.regenerate import regenerate
    from eagle3_core.generation.turns import unanswered_turns
    from eagle3_core.serving.hf_generate import BatchedGenerator
    rows = prompts_mod.load_source(SourceSpec(path=str(SPEC_BENCH), max_rows=2))      # MT-bench's first two
    raw = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines()[:2]]
    assert [json.loads(r["meta"])["later_user_turns"] for r in rows[:2]] == [q["turns"][1:] for q in raw]
    assert unanswered_turns(rows[:2], "final", None) == {"question": {"rows": 2, "turns": 2, "reason": (
        "generation.turns is 'final': only the first turn is a prompt; set generation.turns 'all' to answer the "
        "later turns after the target's own answers")}}
    assert unanswered_turns(rows[:2], "all", None) == {}
    assert unanswered_turns(rows[:2], "all", 1)["question"]["reason"] == \
        "generation.max_turns 1 caps the turns answered per row"
    path = tmp_path / "train.parquet"
    prompts_mod.write_rows(path, rows[:1])                                      # one row: 2 forwards on CPU
    gen = GenerationConfig(max_new_tokens=3, concurrency=1, turns="all", max_truncated_frac=1.0, gate_after=64)
    engine = BatchedGenerator(target_model, tokenizer, 1, 3, stop_ids=[tokenizer.eos_token_id])
    engine.eos = set(range(len(tokenizer)))          # every answer stops at once: a turn cut at max_new_tokens
    #                                                  would end the row (generation/turns.py)
    out = tmp_path / "gen"
    asyncio.run(regenerate(path, out, {0: (0, 1)}, "k", gen, ServerConfig(kind="transformers"), [], tokenizer,
                           log=lambda *_: None, engine=engine))
    got = prompts_mod.read_rows(out / "shard_00000.parquet")
    for r, q in zip(got, raw[:1], strict=True):
        msgs = r["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
        assert [msgs[0]["content"], msgs[2]["content"]] == q["turns"] and r["turn_requests"] == 2
        assert [(t["index"], t["finish_reason"]) for t in json.loads(r["turns"])] == [(1, "stop"), (3, "stop")]
        # the second request: the first turn, the target's own answer, the second turn
        assert r["prompt_ids"] == prompt_ids(tokenizer, msgs[:3])


def test_a_reply_without_spec_verify_ct_counts_as_zero_verify_steps():
    """SGLang leaves the spec_* fields out of a reply whose request ran no verify step (the stand-in of
    tests/test_sglang_bench.py does the same for verify_ct 0): the benchmark counts it as zero verify steps, its
    tokens still count, and it is not aborted."""
    from eagle3_core.evaluation.sglang_bench import benchmark_server
    from test_sglang_bench import PROMPTS, SGLangStandIn
    plan = {0: (60, 20), 1: (1, 0), 2: (64, 32), 3: (30, 30)}                # prompt 1: one token, no verify step
    server = SGLangStandIn(plan, "EAGLE3")
    res = asyncio.run(benchmark_server("http://sglang", PROMPTS, [2], 64, transport=httpx.MockTransport(server)))
    (level,) = res["levels"]
    assert level["replies_without_verify_steps"] == 1 and level["spec_verify_ct"] == 20 + 32 + 30
    assert level["tau"] == pytest.approx((60 + 1 + 64 + 30) / 82)
    assert level["tau_per_category"] == {"coding": pytest.approx(61 / 20), "math": pytest.approx(94 / 62)}
