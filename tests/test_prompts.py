"""Prompt sources in their real formats (../shared/data), the disjoint split, and errors that name file and row."""
import json

import pytest
from conftest import SHARED_DATA

from eagle3_core.config import PromptConfig
from eagle3_core.prompts import build_prompts, load_source


def test_human_eval_split_is_disjoint_and_seeded():
    train, evals, stats = build_prompts(PromptConfig(num_train=120, num_eval=16, seed=3))
    assert stats["unique"] == 164 and len(train) == 120 and len(evals) == 16
    assert not {r["id"] for r in train} & {r["id"] for r in evals}
    again, _, _ = build_prompts(PromptConfig(num_train=120, num_eval=16, seed=3))
    assert [r["id"] for r in again] == [r["id"] for r in train]
    assert train[0]["messages"][-1]["role"] == "user" and "def " in train[0]["messages"][-1]["content"]


@pytest.mark.parametrize("path,first", [
    ("gsm8k/train.jsonl", "Natalia sold clips"),
    ("spec_bench/question.jsonl", None),
    ("sharegpt/dummy_conversation.json", None),
])
def test_real_formats_normalize_to_a_user_turn(path, first):
    rows = load_source(str(SHARED_DATA / path))
    assert len(rows) > 100
    for r in rows[:50]:
        assert r["messages"][-1]["role"] == "user" and r["messages"][-1]["content"].strip()
    if first:
        assert rows[0]["messages"][0]["content"].startswith(first)


def test_missing_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl.*prompts.sources"):
        load_source(str(tmp_path / "nope.jsonl"))


def test_malformed_jsonl_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "hi"}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl: line 2"):
        load_source(str(bad))
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text(json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(ValueError, match=r"nofield.jsonl row 0: no prompt field"):
        load_source(str(no_field))


def test_too_few_prompts_is_an_error(tmp_path):
    f = tmp_path / "few.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(3)))
    with pytest.raises(ValueError, match="3 unique prompts"):
        build_prompts(PromptConfig(sources=[str(f)], num_train=3, num_eval=1))
