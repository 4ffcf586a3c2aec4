"""Loss masks and chat templates on the embedded target's real tokenizer (handed cases C1-C4): ChatML (SmolLM2's own
template), and Llama-3-style and Qwen3-thinking-style templates applied to the same tokenizer with their special
tokens added. Decoding the masked tokens of each trained turn must give exactly that turn's rendered text plus its
end-of-turn token."""
import copy

import pytest

from eagle3_core.data.chat import MaskError, end_of_turn, prompt_ids
from eagle3_core.data.history import RoundTripError, tokenize_chat, tokenize_conversation

USER = [{"role": "user", "content": "What is 2+2?"}]
MULTI = [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": "What is 2+2?"},
         {"role": "assistant", "content": "<think>\n2 plus 2 makes 4.\n</think>\n\nIt is 4."},
         {"role": "user", "content": "And 3+3?"},
         {"role": "assistant", "content": "<think>\n3 plus 3 makes 6.\n</think>\n\nIt is 6."}]

# Llama-3-Instruct layout (meta-llama/Meta-Llama-3-8B-Instruct tokenizer_config.json): BOS once, role headers,
# content trimmed, <|eot_id|> closes every turn
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# Qwen3 thinking layout (Qwen/Qwen3-8B tokenizer_config.json, tools header left out): reasoning from
# `reasoning_content` or an inline </think>; assistant turns after the last user query keep a <think> block (the
# final one always), earlier ones lose it; tool calls as <tool_call> JSON; tool results inside a user turn
QWEN3 = """{%- set ns = namespace(last_query=messages|length - 1, found=false) -%}
{%- for m in messages[::-1] -%}{%- set i = messages|length - 1 - loop.index0 -%}
{%- if not ns.found and m.role == 'user' -%}{%- set ns.last_query = i -%}{%- set ns.found = true -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'system' or m.role == 'user' -%}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' -%}
{%- set content = m.content or '' -%}{%- set reasoning = m.reasoning_content or '' -%}
{%- if not reasoning and '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}
{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}
{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}<|im_start|>assistant
<think>
{{ reasoning.strip('\\n') }}
</think>

{{ content.lstrip('\\n') }}
{%- else -%}<|im_start|>assistant
{{ content }}
{%- endif -%}
{%- for c in m.tool_calls or [] -%}
{%- if loop.first and content %}
{% elif not loop.first %}
{% endif -%}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments }}}
</tool_call>
{%- endfor -%}<|im_end|>
{% elif m.role == 'tool' -%}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant
{% endif -%}"""


def _with_template(tokenizer, template, special=(), bos=None):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    if special:
        tok.add_special_tokens({"additional_special_tokens": list(special)})
    if bos:
        tok.bos_token = bos
    return tok


@pytest.fixture(scope="module")
def llama3_tok(tokenizer):
    return _with_template(tokenizer, LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                              "<|eot_id|>"], bos="<|begin_of_text|>")


@pytest.fixture(scope="module")
def qwen3_tok(tokenizer):
    return _with_template(tokenizer, QWEN3)


def masked_spans(tok, seq) -> list[str]:
    """Decoded text of each contiguous run of supervised tokens."""
    spans, run = [], []
    for t, m in zip(seq["input_ids"] + [None], seq["loss_mask"] + [0]):
        if m:
            run.append(t)
        elif run:
            spans.append(tok.decode(run))
            run = []
    return spans


def test_chatml_mask_covers_exactly_the_assistant_text_and_end_of_turn(tokenizer):
    """C1: the mask has 0s and 1s and covers exactly the assistant text + <|im_end|>."""
    seq = tokenize_conversation(tokenizer, USER, "It is 4.", "r0")
    ids, mask = seq["input_ids"], seq["loss_mask"]
    assert 0 in mask and 1 in mask
    supervised = [t for t, m in zip(ids, mask) if m]
    assert tokenizer.decode(supervised) == "It is 4.<|im_end|>"
    assert supervised[-1] == tokenizer.eos_token_id
    # the mask is one contiguous span at the end of what the target generated
    first = mask.index(1)
    assert all(mask[first:]) and not any(mask[:first])
    assert ids[:first] == prompt_ids(tokenizer, USER)


def test_chatml_multi_turn_masks_every_assistant_turn_with_its_reasoning(tokenizer):
    (seq,) = tokenize_chat(tokenizer, MULTI, "m0", train="all")        # ChatML keeps the history: one sample
    assert masked_spans(tokenizer, seq) == [MULTI[2]["content"] + "<|im_end|>", MULTI[4]["content"] + "<|im_end|>"]
    assert seq["input_ids"][-1] == tokenizer.eos_token_id             # ends at the last end-of-turn token
    (last,) = tokenize_chat(tokenizer, MULTI, "m0", train="last")       # regenerated final turn only
    assert masked_spans(tokenizer, last) == [MULTI[4]["content"] + "<|im_end|>"]
    assert last["input_ids"] == prompt_ids(tokenizer, MULTI[:4]) + [t for t, m in zip(last["input_ids"],
                                                                                       last["loss_mask"]) if m]


@pytest.mark.parametrize("msgs", [USER + [{"role": "assistant", "content": "<think>\nsum\n</think>\n\nIt is 4."}],
                                  MULTI])
def test_llama3_template_masks_each_turn_and_eot(llama3_tok, msgs):
    eot_id, eot = end_of_turn(llama3_tok)
    assert eot == "<|eot_id|>" and eot_id == llama3_tok.convert_tokens_to_ids("<|eot_id|>")
    samples = tokenize_chat(llama3_tok, msgs, "l3")
    want = [m["content"].strip() + "<|eot_id|>" for m in msgs if m["role"] == "assistant"]
    assert [span for seq in samples for span in masked_spans(llama3_tok, seq)] == want
    # one sample per turn here: the generation prompt ends in "\n\n", one token (ĊĊ) at the end of a prompt but
    # two (Ċ Ċ) before the answer's text once the turn is history, so the next context does not extend the sample
    # token for token (history.merge_turns); each turn is trained in the context the server tokenizes
    assert len(samples) == len(want)
    for seq, i in zip(samples, [i for i, m in enumerate(msgs) if m["role"] == "assistant"]):
        assert seq["input_ids"].count(llama3_tok.bos_token_id) == 1 and seq["input_ids"][0] == llama3_tok.bos_token_id
        # everything before the supervised tokens is exactly what a server sends for that answer
        assert seq["input_ids"][:seq["loss_mask"].index(1)] == prompt_ids(llama3_tok, msgs[:i])


def test_qwen3_template_strips_earlier_reasoning_and_each_turn_trains_in_its_own_context(qwen3_tok):
    """The template keeps <think> only after the last user query, so the second turn's context is not the first
    sample continued: two samples, each turn trained with its reasoning in the context the target had when it
    wrote it (eagle3_core/data/history.py, the merge rule)."""
    first, second = tokenize_chat(qwen3_tok, MULTI, "q3", train="all")
    assert (first["id"], second["id"]) == ("q3/turn2", "q3/turn4")
    assert masked_spans(qwen3_tok, first) == ["<think>\n2 plus 2 makes 4.\n</think>\n\nIt is 4.<|im_end|>"]
    assert masked_spans(qwen3_tok, second) == ["<think>\n3 plus 3 makes 6.\n</think>\n\nIt is 6.<|im_end|>"]
    assert second["input_ids"][:second["loss_mask"].index(1)] == prompt_ids(qwen3_tok, MULTI[:4])
    assert "2 plus 2" not in qwen3_tok.decode(second["input_ids"])          # history as the template renders it
    # the same with reasoning given apart from the answer, as servers return it
    split = [{**m, "content": m["content"].split("</think>\n\n")[-1],
              "reasoning_content": m["content"].split("\n</think>")[0].removeprefix("<think>\n")}
             if m["role"] == "assistant" else m for m in MULTI]
    assert tokenize_chat(qwen3_tok, split, "q3", train="all") == [first, second]
    (single,) = tokenize_chat(qwen3_tok, MULTI[:3], "q3s")
    assert masked_spans(qwen3_tok, single) == masked_spans(qwen3_tok, first)


def test_qwen3_tool_calls_are_trained_and_tool_results_are_not(qwen3_tok):
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}
    msgs = USER + [{"role": "assistant", "content": "", "reasoning_content": "Use the tool.", "tool_calls": [call]},
                   {"role": "tool", "content": "4"},
                   {"role": "assistant", "content": "It is 4.", "reasoning_content": "The tool said 4."}]
    (seq,) = tokenize_chat(qwen3_tok, msgs, "tc")                      # a tool-call chain: one sample
    assert masked_spans(qwen3_tok, seq) == [
        '<think>\nUse the tool.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n'
        '</tool_call><|im_end|>',
        "<think>\nThe tool said 4.\n</think>\n\nIt is 4.<|im_end|>"]
    text = qwen3_tok.decode(seq["input_ids"])
    assert "<tool_response>\n4\n</tool_response>" in text
    # without its reasoning the final turn would train `<think>\n\n</think>`, which Qwen3 thinking never writes
    with pytest.raises(RoundTripError, match="tc: assistant turn 3: the target thinks") as e:
        tokenize_chat(qwen3_tok, msgs[:-1] + [{"role": "assistant", "content": "It is 4."}], "tc")
    assert e.value.cause == "empty_thinking"


def test_mask_equals_return_assistant_tokens_mask_where_the_template_has_generation_markers(tokenizer):
    """On a template with {% generation %} markers, transformers' own assistant mask and ours agree token for
    token; SmolLM2's template has no markers, so there the option gives nothing to compare."""
    marked = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
              "{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m['role'] }}\n"
              "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = _with_template(tokenizer, marked)
    ref = tok.apply_chat_template(MULTI, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    (seq,) = tokenize_chat(tok, MULTI, "g")
    assert seq["input_ids"] == ref["input_ids"] and seq["loss_mask"] == list(ref["assistant_masks"])


def test_truncated_response_does_not_train_an_end_of_turn(tokenizer):
    seq = tokenize_conversation(tokenizer, USER, "It is", "r0", truncated=True)
    assert seq["input_ids"][-1] != tokenizer.eos_token_id
    assert tokenizer.decode([t for t, m in zip(seq["input_ids"], seq["loss_mask"]) if m]) == "It is"


def test_empty_mask_is_an_error(tokenizer):
    with pytest.raises(MaskError, match="r7.*empty loss mask"):
        tokenize_conversation(tokenizer, USER, "It is 4.", "r7", max_length=5)
    with pytest.raises(MaskError, match="r8.*must end with an assistant turn"):
        tokenize_chat(tokenizer, USER, "r8")


def test_overlong_samples_are_cut_or_dropped(tokenizer):
    (full,) = tokenize_chat(tokenizer, MULTI, "o", train="all")
    n = len(full["input_ids"])
    (cut,) = tokenize_chat(tokenizer, MULTI, "o", train="all", max_length=n - 3)
    assert cut["cut"] and cut["input_ids"] == full["input_ids"][:n - 3]
    assert cut["loss_mask"] == full["loss_mask"][:n - 3]
    assert tokenize_chat(tokenizer, MULTI, "o", train="all", max_length=n - 3, overlong="drop") == []
    assert not tokenize_chat(tokenizer, MULTI, "o", train="all", max_length=n, overlong="drop")[0]["cut"]


def test_think_prefix_in_generation_prompt_keeps_prompt_plus_completion_tokens(tokenizer):
    """C2: the generation prompt opens <think>; the trained sequence is prompt tokens + completion tokens."""
    tok = _with_template(tokenizer, "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                         "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
                         "{% endif %}")
    completion = "2+2 is 4.\n</think>\n\n4"
    seq = tokenize_conversation(tok, USER, "<think>\n" + completion, "c2")
    p = prompt_ids(tok, USER)
    c = tok(completion + "<|im_end|>", add_special_tokens=False)["input_ids"]
    assert seq["input_ids"] == p + c
    assert seq["loss_mask"] == [0] * len(p) + [1] * len(c)


def test_history_reasoning_stripped_by_template_never_spills_the_mask(tokenizer):
    """C3: a template that drops earlier turns' reasoning. Only the final assistant turn is trained, its mask
    covers exactly its text; a template that rewrites earlier turns when one is appended, or that rewrites the
    trained turn itself, is rejected, never silently mis-masked."""
    strip = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
             "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
             "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = _with_template(tokenizer, strip)
    history = USER + [{"role": "assistant", "content": "<think>hm</think>4"}, {"role": "user", "content": "and 3+3?"}]
    seq = tokenize_conversation(tok, history, "<think>add</think>6", "c3")
    trained = tok.decode([t for t, m in zip(seq["input_ids"], seq["loss_mask"]) if m])
    assert trained == "<think>add</think>6<|im_end|>"
    # every turn trained, each as the template renders it when it is the turn being written: two samples, since
    # the second turn's context is the first turn without its reasoning
    both = tokenize_chat(tok, history + [{"role": "assistant", "content": "<think>add</think>6"}], "c3a")
    assert [masked_spans(tok, s) for s in both] == [["<think>hm</think>4<|im_end|>"],
                                                    ["<think>add</think>6<|im_end|>"]]
    # rewrites the last user turn once an answer follows: the prompt is no longer a prefix
    marks_last = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{% if loop.last %} (last)"
                  "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% endif %}")
    with pytest.raises(MaskError, match="c3b.*prompt as the start of the conversation"):
        tokenize_conversation(_with_template(tokenizer, marks_last), USER, "4", "c3b")
    # strips reasoning from every assistant turn, the trained one included
    strip_all = strip.replace(" and not loop.last", "")
    with pytest.raises(MaskError, match="c3c: assistant turn 1: the template renders the turn's reasoning differ"):
        tokenize_conversation(_with_template(tokenizer, strip_all), USER, "<think>add</think>6", "c3c")


def test_template_emitting_bos_gives_one_bos(tokenizer):
    """C4: the template emits BOS and the tokenizer also adds one on encode: exactly one BOS results."""
    tok = _with_template(tokenizer, "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                         "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.bos_token = "<|endoftext|>"
    tok.add_bos_token = True
    bos = tok.bos_token_id
    rendered = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert tok(rendered)["input_ids"][:2] == [bos, bos]       # the trap: naive encoding doubles BOS
    seq = tokenize_conversation(tok, USER, "4", "c4")
    assert seq["input_ids"].count(bos) == 1 and seq["input_ids"][0] == bos
    assert prompt_ids(tok, USER).count(bos) == 1


@pytest.mark.slow
def test_stages_regenerate_prompt_rows_and_train_kept_rows_as_they_are(tmp_path, tokenizer):
    """prompts -> generation (real llama-server) -> tokenize on a mix of multi-turn rows: prompt rows get the final
    assistant turn regenerated after the dataset's earlier turns, and only that turn is trained; kept rows are not
    sent to the server and every assistant turn is trained."""
    from conftest import SHARED_DATA
    from eagle3_core.config import GenerationConfig, PipelineConfig, PromptConfig, ServerConfig
    from eagle3_core.config.mix import DataMix, SourceSpec
    from eagle3_core.data import prompt_set as prompts_mod
    from eagle3_core.pipeline.generation_stage import run_generation
    from eagle3_core.pipeline.prompts_stage import run_prompts
    from eagle3_core.pipeline.tokenize_stage import run_tokenize
    share = str(SHARED_DATA / "sharegpt/dummy_conversation.json")
    mix = DataMix(name="t", sources=[SourceSpec(name="kept", path=share, mode="keep", count=4),
                                     SourceSpec(name="regen", path=share, mode="prompt", count=4, min_chars=60)])
    cfg = PipelineConfig(run_dir=tmp_path / "run", prompts=PromptConfig(mix=mix, num_train=6, num_eval=2),
                         server=ServerConfig(parallel=2, ctx_per_slot=1024),
                         # 16 tokens cut most answers: the gate (tested in test_generation.py) is not this test's
                         generation=GenerationConfig(max_new_tokens=16, concurrency=2, max_truncated_frac=1.0))
    pm = run_prompts(cfg, log=lambda *_: None)
    assert pm["stats"]["per_source"]["kept"]["selected"] == 4 and (cfg.run_dir / "prompts/rejects.jsonl").exists()
    # held-out rows are prompts only, kept ones too: the evaluator must not see the answer it measures
    held_out = prompts_mod.read_rows(cfg.run_dir / "prompts" / "eval.parquet")
    assert len(held_out) == 2 and all(r["messages"][-1]["role"] == "user" for r in held_out)
    gm = run_generation(cfg, log=lambda *_: None)
    rows = {r["id"]: r for s in gm["shards"] for r in prompts_mod.read_rows(cfg.run_dir / "generations" / s)}
    kept = [r for r in rows.values() if r["mode"] == "keep"]
    regen = [r for r in rows.values() if r["mode"] == "prompt"]
    assert kept and regen and gm["finish_reasons"]["kept"] == len(kept)
    assert all(r["response"] and r["messages"][-1]["role"] == "user" for r in regen)
    assert any(len(r["messages"]) > 1 for r in regen)                   # multi-turn prompts were sent whole
    run_tokenize(cfg, log=lambda *_: None)
    import pyarrow.parquet as pq
    for t in pq.read_table(cfg.run_dir / "tokenized" / "train.parquet").to_pylist():
        r = rows[t["id"]]
        if r["mode"] == "keep":
            want = [m["content"] + "<|im_end|>" for m in r["messages"] if m["role"] == "assistant"]
        else:
            want = [r["response"] + ("" if r["finish_reason"] == "length" else "<|im_end|>")]
        assert masked_spans(tokenizer, t) == want, t["id"]


def test_kept_rows_only_need_no_server(tmp_path):
    """A mix whose rows are all kept as they are regenerates nothing: the generation stage runs without a server
    (kind 'external' with no URL would raise if one were asked for) and passes every conversation on whole."""
    from conftest import SHARED_DATA
    from eagle3_core.config import PipelineConfig, PromptConfig, ServerConfig
    from eagle3_core.config.mix import DataMix, SourceSpec
    from eagle3_core.data import prompt_set as prompts_mod
    from eagle3_core.pipeline.generation_stage import run_generation
    from eagle3_core.pipeline.prompts_stage import run_prompts
    share = str(SHARED_DATA / "sharegpt/dummy_conversation.json")
    mix = DataMix(name="t", sources=[SourceSpec(name="kept", path=share, mode="keep", count=6)])
    cfg = PipelineConfig(run_dir=tmp_path / "run", prompts=PromptConfig(mix=mix, num_train=4, num_eval=2),
                         server=ServerConfig(kind="external"))
    run_prompts(cfg, log=lambda *_: None)
    train = {r["id"]: r for r in prompts_mod.read_rows(cfg.run_dir / "prompts" / "train.parquet")}
    gm = run_generation(cfg, log=lambda *_: None)
    assert gm["finish_reasons"] == {"kept": 4}
    rows = [r for s in gm["shards"] for r in prompts_mod.read_rows(cfg.run_dir / "generations" / s)]
    assert {r["id"]: r["messages"] for r in rows} == {i: r["messages"] for i, r in train.items()}
