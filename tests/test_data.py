"""Loss masks and chat templates on the embedded target's real tokenizer (handed cases C1-C4)."""
import pytest

from eagle3_core.data import MaskError, prompt_ids, tokenize_conversation

USER = [{"role": "user", "content": "What is 2+2?"}]


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


def test_truncated_response_does_not_train_an_end_of_turn(tokenizer):
    seq = tokenize_conversation(tokenizer, USER, "It is", "r0", truncated=True)
    assert seq["input_ids"][-1] != tokenizer.eos_token_id
    assert tokenizer.decode([t for t, m in zip(seq["input_ids"], seq["loss_mask"]) if m]) == "It is"


def test_empty_mask_is_an_error(tokenizer):
    with pytest.raises(MaskError, match="r7"):
        tokenize_conversation(tokenizer, USER, "It is 4.", "r7", max_length=5)


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
    # rewrites the last user turn once an answer follows: the prompt is no longer a prefix
    marks_last = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{% if loop.last %} (last)"
                  "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% endif %}")
    with pytest.raises(MaskError, match="c3b.*prefix"):
        tokenize_conversation(_with_template(tokenizer, marks_last), USER, "4", "c3b")
    # strips reasoning from every assistant turn, the trained one included
    strip_all = strip.replace(" and not loop.last", "")
    with pytest.raises(MaskError, match="c3c.*changes the assistant text"):
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


def _with_template(tokenizer, template):
    import copy
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok
