"""The function-calling prompt set (tests/data/bfcl: a slice of the Berkeley Function Calling Leaderboard as PyPI's
bfcl-eval ships it) read by the `bfcl` row format: the first turn as the prompt, BFCL's tool schemas as OpenAI
`tools` with BFCL's type names mapped to JSON-schema types."""
import json

from conftest import SHARED_DATA
from eagle3_core.config.mix import SourceSpec
from eagle3_core.data.prompt_set import load_source

BFCL = SHARED_DATA / "bfcl" / "function_calling.jsonl"


def _types(schema) -> set[str]:
    if isinstance(schema, list):
        return set().union(*map(_types, schema)) if schema else set()
    if not isinstance(schema, dict):
        return set()
    own = {schema["type"]} if isinstance(schema.get("type"), str) else set()
    return own.union(*(_types(v) for v in schema.values()))


def test_every_bfcl_row_becomes_a_prompt_with_its_tools():
    rejects = []
    rows = load_source(SourceSpec(path=str(BFCL)), rejects=rejects)
    assert rejects == [] and len(rows) == 40
    first = rows[0]
    assert first["id"] == "function_calling/simple_python_0"
    assert first["messages"] == [{"role": "user", "content": "Find the area of a triangle with a base of 10 units "
                                                             "and height of 5 units."}]
    tools = json.loads(first["tools"])
    assert tools == [{"type": "function", "function": {
        "name": "calculate_triangle_area", "description": "Calculate the area of a triangle given its base and height.",
        "parameters": {"type": "object", "properties": {
            "base": {"type": "integer", "description": "The base of the triangle."},
            "height": {"type": "integer", "description": "The height of the triangle."},
            "unit": {"type": "string", "description": "The unit of measure (defaults to 'units' if not specified)"}},
            "required": ["base", "height"]}}}]
    assert json.loads(first["meta"])["format"] == "bfcl" and json.loads(first["meta"])["tools_from"] == "function"
    raw = [json.loads(line) for line in BFCL.read_text().splitlines()]
    assert {"dict", "float", "tuple"} <= _types([r["function"] for r in raw])          # BFCL's own names ...
    all_types = _types([t["function"]["parameters"] for r in rows for t in json.loads(r["tools"])])
    assert all_types <= {"object", "number", "array", "integer", "string", "boolean"}  # ... JSON schema's
    by_cat = {}
    for r, src in zip(rows, raw, strict=True):
        by_cat.setdefault(src["id"].rsplit("_", 1)[0], []).append(len(json.loads(r["tools"])))
        assert r["messages"][-1]["role"] == "user" and r["messages"][-1]["content"] == src["question"][0][-1]["content"]
    assert set(by_cat) == {"simple_python", "multiple", "parallel", "parallel_multiple"}
    assert max(by_cat["multiple"]) >= 2 and set(by_cat["simple_python"]) == {1}


def test_a_bfcl_row_without_turns_is_rejected_naming_the_field(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "question": ["not a turn"], "function": []}) + "\n")
    rejects = []
    assert load_source(SourceSpec(path=str(bad)), rejects=rejects) == []
    assert "row 0: field 'question' is not a list of turns" in rejects[0]["reason"]


def test_a_template_that_drops_tools_is_found_and_the_prompts_stage_warns(tmp_path, tokenizer):
    """SmolLM2's template (the embedded target's) never reads `tools`: BFCL's prompts reach it without the
    functions, and the prompts stage says so per source; Qwen2.5's template renders them."""
    from chat_templates import stand_in
    from eagle3_core.config import PipelineConfig
    from eagle3_core.data.chat import renders_tools
    from eagle3_core.pipeline.prompts_stage import run_prompts
    row = load_source(SourceSpec(path=str(BFCL), max_rows=1))[0]
    assert not renders_tools(tokenizer, row["messages"], json.loads(row["tools"]))
    assert renders_tools(stand_in("qwen25_tools"), row["messages"], json.loads(row["tools"]))
    cfg = PipelineConfig.model_validate({"run_dir": str(tmp_path / "run"), "prompts": {
        "mix": {"name": "tools", "sources": [{"path": str(BFCL)},
                                              {"path": str(SHARED_DATA / "gsm8k" / "train.jsonl"), "max_rows": 20}]},
        "num_train": 30, "num_eval": 4}})
    lines = []
    m = run_prompts(cfg, log=lines.append)
    per = m["stats"]["tools_not_rendered"]
    train = [r for r in m["train_ids"] if r.startswith("function_calling/")]
    assert list(per) == ["function_calling"] and per["function_calling"]["rows"] == len(train) > 0
    assert per["function_calling"]["probed_row"] in train
    warn = [x for x in lines if "carry tool schemas" in x]
    assert len(warn) == 1 and "source function_calling" in warn[0] and "does not render `tools`" in warn[0]
