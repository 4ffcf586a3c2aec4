"""generation.chat_template_kwargs checked against what the target's chat template reads, and rendered (with the
row's tools) everywhere a prompt is rendered: the prompts stage's budget, regeneration, tokenize, the offline
evaluators (the evaluate stage, studies.scaling_study.held_out_prompts, the replay recording) and both deployment
benchmarks.

Templates: Qwen3's and DeepSeek-V3.1's own (tests/data/chat_templates, copies of llama.cpp's models/templates);
the target is the embedded SmolLM2-135M with Qwen3's template in its tokenizer (a stand-in: the real Qwen3
tokenizer lives on the model hub), so the template's `enable_thinking` changes the tokens the target is given."""
import copy
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import SHARED_DATA
from eagle3_core.config import FeatureConfig, GenerationConfig, PipelineConfig, PromptConfig, ServerConfig, TargetConfig
from eagle3_core.data.chat import prompt_ids, render_chat
from eagle3_core.data.template_kwargs import (
    TemplateKwargsError,
    check_template_kwargs,
    check_tokenizer_kwargs,
    template_variables,
)

TEMPLATES = SHARED_DATA / "chat_templates"
QWEN3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
DEEPSEEK = (TEMPLATES / "deepseek-ai-DeepSeek-V3.1.jinja").read_text()
NO_THINKING = {"enable_thinking": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
ROWS = [{"id": f"w{i}", "messages": [{"role": "user", "content": q}], "tools": TOOLS}
        for i, q in enumerate(["Is it raining in Paris?", "Is it sunny in Rome?", "Weather in Oslo?"])]


def quiet(*_):
    pass


def test_a_kwargs_typo_and_a_wrong_type_are_refused(tokenizer):
    """Qwen3 tests `enable_thinking is false`: a typo is dropped by the renderer without a word (the same prompt as
    no kwargs at all), a string "false" is not `false`; both are refused, naming the key, the nearest variable or
    the type to write. DeepSeek-V3.1 reads `thinking` (and `enable_thinking` through it) only as a condition."""
    qwen3 = copy.deepcopy(tokenizer)
    qwen3.chat_template = QWEN3
    msgs = ROWS[0]["messages"]
    silent = render_chat(qwen3, msgs, True, template_kwargs={"enable_thinkng": False})
    assert silent == render_chat(qwen3, msgs, True) != render_chat(qwen3, msgs, True, template_kwargs=NO_THINKING)
    assert render_chat(qwen3, msgs, True, template_kwargs={"enable_thinking": "false"}) == silent   # "false" is on
    assert template_variables(QWEN3)["enable_thinking"] == {"defined", "strict"}
    with pytest.raises(TemplateKwargsError, match=r"does not read 'enable_thinkng'.*did you mean 'enable_thinking'"):
        check_tokenizer_kwargs(qwen3, {"enable_thinkng": False})
    with pytest.raises(TemplateKwargsError, match=r"'enable_thinking' = 'false' \(str\).*`is true` / `is false`.*"
                                                  r"write false \(a JSON boolean\)"):
        check_tokenizer_kwargs(qwen3, {"enable_thinking": "false"})
    with pytest.raises(TemplateKwargsError, match="write false"):
        check_template_kwargs(QWEN3, {"enable_thinking": 0})                  # 0 is not `false` either
    check_tokenizer_kwargs(qwen3, NO_THINKING)
    check_template_kwargs(DEEPSEEK, {"thinking": True})
    check_template_kwargs(DEEPSEEK, {"enable_thinking": False})
    with pytest.raises(TemplateKwargsError, match=r"'thinking' = 'true' is a string.*only as a condition"):
        check_template_kwargs(DEEPSEEK, {"thinking": "true"})
    with pytest.raises(TemplateKwargsError, match="did you mean 'thinking'"):
        check_template_kwargs(DEEPSEEK, {"thinkng": True})
    with pytest.raises(TemplateKwargsError, match="set by the renderer itself"):
        check_template_kwargs(QWEN3, {"add_generation_prompt": False})
    with pytest.raises(TemplateKwargsError, match="it reads no argument"):      # SmolLM2's ChatML template
        check_tokenizer_kwargs(tokenizer, NO_THINKING)


def test_check_refuses_the_kwargs_against_a_chat_template_file(tmp_path, capsys):
    """`check CONFIG --target-config ... --chat-template FILE`: the kwargs refused offline, naming the field."""
    from eagle3_core.check import main
    (tmp_path / "tmpl.jinja").write_text(QWEN3)
    cfg = json.loads((SHARED_DATA.parent.parent / "configs" / "kimi_k25_agentic_100k.json").read_text())
    cfg["generation"]["chat_template_kwargs"] = {"enable_thinkng": False}
    (tmp_path / "run.json").write_text(json.dumps(cfg))
    args = [str(tmp_path / "run.json"), "--target-config", str(SHARED_DATA / "kimi_k25" / "config.json")]
    assert main(args + ["--chat-template", str(tmp_path / "tmpl.jinja")]) == 1
    err = capsys.readouterr().err
    assert "- generation.chat_template_kwargs: the target's chat template does not read 'enable_thinkng'" in err
    assert "did you mean 'enable_thinking'" in err
    from eagle3_core.check import check_run                 # no template offline: not checked, and it says so
    from test_check import TARGET
    facts, problems = check_run(PipelineConfig(generation=GenerationConfig(chat_template_kwargs={"x": 1},
                                                                           max_new_tokens=64),
                                               features=FeatureConfig(max_length=256)),
                                target_config=TARGET, memory=(1 << 40, "test"), gpus=None)
    assert problems == [] and "the prompts stage checks them" in facts["chat_template_kwargs"]["checked against"]


@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory, tokenizer):
    """The embedded target with Qwen3's chat template: its converted config and weights linked, its tokenizer saved
    with the template."""
    from eagle3_core.target.loading import local_model_dir
    src = Path(local_model_dir(TargetConfig()))
    out = tmp_path_factory.mktemp("qwen3_template_target")
    for name in ("config.json", "model.safetensors"):
        (out / name).symlink_to(src / name)
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = QWEN3
    tok.save_pretrained(out)
    return TargetConfig(model=str(out))


@pytest.fixture(scope="module")
def run(tmp_path_factory, qwen3_target):
    """prompts, generation (in process, 2 new tokens) and tokenize of 2 train + 1 held-out tool rows, thinking off."""
    from eagle3_core.pipeline.generation_stage import run_generation
    from eagle3_core.pipeline.prompts_stage import run_prompts
    from eagle3_core.pipeline.tokenize_stage import run_tokenize
    from eagle3_core.target.loading import load_tokenizer
    root = tmp_path_factory.mktemp("kwargs_run")
    (root / "tools.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = PipelineConfig(run_dir=root / "run", target=qwen3_target,
                         prompts=PromptConfig(sources=[str(root / "tools.jsonl")], num_train=2, num_eval=1),
                         server=ServerConfig(kind="transformers"), features=FeatureConfig(max_length=512),
                         generation=GenerationConfig(max_new_tokens=2, concurrency=2, max_truncated_frac=1.0,
                                                     chat_template_kwargs=NO_THINKING))
    prompts = run_prompts(cfg, log=quiet)
    run_generation(cfg, log=quiet)
    run_tokenize(cfg, log=quiet)
    return cfg, load_tokenizer(qwen3_target), prompts


def _expected(tok, messages, kwargs=NO_THINKING):
    return prompt_ids(tok, messages, TOOLS, kwargs)


def test_the_prompts_stage_refuses_a_typo_before_rendering_anything(run, tmp_path):
    cfg, _, _ = run
    bad = cfg.model_copy(update={"run_dir": tmp_path / "bad", "generation": cfg.generation.model_copy(
        update={"chat_template_kwargs": {"enable_thinkng": False}})})
    from eagle3_core.pipeline.prompts_stage import run_prompts
    with pytest.raises(TemplateKwargsError, match="did you mean 'enable_thinking'"):
        run_prompts(bad, log=quiet)
    assert not (tmp_path / "bad" / "prompts" / "train.parquet").exists()


def test_the_token_budget_measures_prompts_with_the_kwargs_and_tools(run):
    cfg, tok, _ = run
    from eagle3_core.data.prompt_set import read_rows
    rows = read_rows(cfg.run_dir / "prompts" / "train.parquet")
    for r in rows:
        n = json.loads(r["meta"])["prompt_tokens"]
        assert n == len(_expected(tok, r["messages"])) > len(prompt_ids(tok, r["messages"], TOOLS))
        assert tok.decode(_expected(tok, r["messages"])) == tok.decode(prompt_ids(tok, r["messages"], TOOLS)) + \
            "<think>\n\n</think>\n\n"
        assert json.loads(r["tools"]) == TOOLS


def test_regeneration_sends_the_prompt_rendered_with_the_kwargs_and_tools(run):
    cfg, tok, _ = run
    rows = [r for f in sorted((cfg.run_dir / "generations").glob("shard_*.parquet"))
            for r in pq.read_table(f).to_pylist()]
    assert len(rows) == 2
    for r in rows:
        assert r["prompt_ids"] == _expected(tok, json.loads(r["messages"]))
        text = tok.decode(r["prompt_ids"])
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and "# Tools" in text


def test_tokenize_renders_the_context_with_the_kwargs_and_tools(run):
    cfg, tok, _ = run
    from eagle3_core.data.prompt_set import read_rows
    by_id = {r["id"]: r for r in read_rows(cfg.run_dir / "prompts" / "train.parquet")}
    samples = pq.read_table(cfg.run_dir / "tokenized" / "train.parquet").to_pylist()
    assert len(samples) == 2
    for s in samples:
        context = s["input_ids"][:s["loss_mask"].index(1)]
        assert context == _expected(tok, by_id[s["id"]]["messages"])


def test_the_evaluate_stage_renders_held_out_prompts_with_the_kwargs_and_tools(run):
    """What both evaluators of the evaluate stage decode from (run_evaluate calls held_out_prompt_ids)."""
    cfg, tok, _ = run
    from eagle3_core.data.prompt_set import read_rows
    from eagle3_core.pipeline.evaluate_stage import held_out_prompt_ids
    rows = read_rows(cfg.run_dir / "prompts" / "eval.parquet")
    want = [_expected(tok, r["messages"]) for r in rows]
    assert held_out_prompt_ids(cfg, tok, rows) == want and len(want) == 1 and json.loads(rows[0]["tools"]) == TOOLS


def test_the_scaling_studys_held_out_prompts_carry_the_kwargs_and_tools(run):
    cfg, tok, _ = run
    from eagle3_core.data.prompt_set import read_rows
    from eagle3_core.studies.scaling_study import held_out_prompts
    rows = read_rows(cfg.run_dir / "prompts" / "eval.parquet")
    want = [_expected(tok, r["messages"]) for r in rows]
    got_rows, prompts, eos = held_out_prompts(cfg)
    assert [r["id"] for r in got_rows] == [r["id"] for r in rows] and prompts == want and eos == {tok.eos_token_id}


@pytest.mark.slow
def test_the_replay_recording_records_the_targets_answers_to_the_kwargs_prompts(run):
    """The replay evaluator's recording (what evaluate_stage._replay does): the target's greedy outputs on the
    held-out prompts, in process, and their aux states from the features backend over prompt + output."""
    cfg, tok, _ = run
    from eagle3_core.data.prompt_set import read_rows
    from eagle3_core.evaluation.replay_record import greedy_outputs
    from eagle3_core.pipeline.evaluate_stage import held_out_prompt_ids, replay_recordings
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"max_new_tokens": 2})})
    rows = read_rows(cfg.run_dir / "prompts" / "eval.parquet")
    prompts = held_out_prompt_ids(cfg, tok, rows)
    outputs = greedy_outputs(cfg, prompts, {tok.eos_token_id}, log=quiet)
    recs = replay_recordings(cfg, prompts, outputs, log=quiet)
    assert [r["prompt"] for r in recs] == [_expected(tok, r["messages"]) for r in rows]
    seqs = pq.read_table(cfg.run_dir / "eval" / "replay" / "tokenized" / "train.parquet").to_pylist()
    assert [s["input_ids"][:len(p)] for s, p in zip(seqs, prompts, strict=True)] == prompts
    assert recs[0]["aux"].shape[0] == len(prompts[0]) + len(outputs[0])


def test_the_sglang_deployment_sends_prompts_rendered_with_the_kwargs(run, tmp_path):
    """deploy-sglang's prompts (Spec-Bench and HumanEval first turns, no tools) through /generate: the ids SGLang
    (an in-process stand-in, tests/test_sglang_bench.py) receives are the template's with the run's kwargs."""
    import httpx

    from eagle3_core.evaluation.sglang_bench import SpecArgs
    from eagle3_core.evaluation.sglang_deploy import DEFAULT_SPEC_BENCH, benchmark_prompts, run_benchmark
    from eagle3_core.pipeline.deploy_stage import deploy_sglang_prompts
    from test_sglang_bench import SGLangStandIn
    cfg, tok, _ = run
    prompts = deploy_sglang_prompts(cfg, tok, benchmark_prompts(DEFAULT_SPEC_BENCH, False, 1))
    want = [prompt_ids(tok, r["messages"], None, NO_THINKING) for r in prompts]
    assert [p["input_ids"] for p in prompts] == want and len(want) == 13
    servers = {"base": SGLangStandIn({want[0][0]: (8, None)}), "spec": SGLangStandIn({want[0][0]: (8, 4)}, "EAGLE3")}

    async def route(request: httpx.Request) -> httpx.Response:
        return await servers[request.url.host](request)
    run_benchmark("target", SpecArgs("draft", 5, 1, 6), prompts, [2], tmp_path, 8, 32, 32,
                  urls={"baseline": "http://base", "eagle3": "http://spec"}, transport=httpx.MockTransport(route))
    sent = [b["input_ids"] for b in servers["spec"].bodies[1:]]                    # after the warm-up request
    assert sorted(sent) == sorted(want)
    assert all(tok.decode(ids).endswith("<think>\n\n</think>\n\n") for ids in sent)


@pytest.mark.slow
def test_the_llama_cpp_deployment_sends_the_kwargs_and_tools_and_the_server_renders_them(tmp_path):
    """deploy-llama-cpp's requests (the real llama-server, --jinja, Qwen3's template) carry the run's kwargs and
    each row's tools; the server's prompt token count is the template's with them."""
    from eagle3_core.evaluation.llama_cpp_deploy import run_requests
    from eagle3_core.serving.launcher import llama_server
    from eagle3_core.target.loading import embedded_gguf_path
    from recording_proxy import RecordingProxy
    (tmp_path / "tmpl.jinja").write_text(QWEN3)
    rows = [{"id": r["id"], "messages": r["messages"], "tools": json.dumps(TOOLS)} for r in ROWS[:2]]
    with llama_server(embedded_gguf_path(), tmp_path / "server.log", parallel=1, ctx_per_slot=1024,
                      extra_args=["-t", "1", "--chat-template-file", str(tmp_path / "tmpl.jinja")]) as url, \
            RecordingProxy(url) as proxy:
        got = run_requests(proxy.url, rows, 4, template_kwargs=NO_THINKING)
        bodies = proxy.bodies("/v1/chat/completions")
    assert [b["chat_template_kwargs"] for b in bodies] == [NO_THINKING] * 2 and all(b["tools"] == TOOLS
                                                                                    for b in bodies)
    from eagle3_core.target.loading import load_tokenizer
    tok = copy.deepcopy(load_tokenizer(TargetConfig()))
    tok.chat_template = QWEN3
    # usage.prompt_tokens: the whole prompt (timings.prompt_n counts only what the prompt cache did not hold)
    assert [r["prompt_tokens"] for r in got] == [len(_expected(tok, r["messages"])) for r in rows]
