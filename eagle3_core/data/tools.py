"""Tool schemas of a row, normalized to the OpenAI Chat Completions `tools` list:
[{"type": "function", "function": {"name": str, "description"?: str, "parameters"?: JSON schema}}].

Where they are found:
  openai   a `tools` field beside `messages` (a list, or that list as JSON text): OpenAI API reference, Chat
           Completions `tools`; function-calling sets in this layout (e.g. the DeepSWE / SWE-smith tool sets)
  hermes   a `<tools> ... </tools>` block inside the system message (NousResearch hermes-function-calling-v1,
           Hermes tool-calling prompt format): a JSON list, or a Python literal of one (single quotes, as in
           `func-calling.json`), of schemas with or without the {"type": "function", "function": ...} wrapper
  bfcl     a `function` field: a list of {name, description, parameters} whose types are BFCL's names ('dict',
           'float', 'tuple', 'any', ...), mapped to JSON-schema types by BFCL's own table (bfcl-eval
           `bfcl_eval/constants/type_mappings.py` GORILLA_TO_OPENAPI: dict -> object, float -> number, ...)
The system text stays as the data has it (it is what the rows' answers were written after); the schemas also go
into the row's `tools` column, which the generation stage sends with each request and the tokenize stage renders.
A template that renders tools itself then shows them twice for Hermes rows: give such sources without the block
(or with mode 'keep') where that matters.
"""
from __future__ import annotations

import ast
import json
import re

from eagle3_core.data.row_formats import RowReject

_BLOCK = re.compile(r"<tools>(.*?)</tools>", re.DOTALL)
# BFCL's parameter type names -> JSON schema (bfcl-eval 2026.3.23 constants/type_mappings.py GORILLA_TO_OPENAPI)
BFCL_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": "string", "list": "array",
              "bool": "boolean", "double": "number", "long": "integer", "short": "integer", "byte": "integer",
              "char": "string", "String": "string", "Any": "string", "ArrayList": "array", "Array": "array",
              "HashMap": "object", "Hashtable": "object", "Queue": "array", "Stack": "array", "Bigint": "integer"}


def json_schema_types(schema):
    """A copy of `schema` with every string `type` of BFCL's (BFCL_TYPES) as its JSON-schema type."""
    if isinstance(schema, list):
        return [json_schema_types(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    return {k: (BFCL_TYPES.get(v, v) if k == "type" and isinstance(v, str) else json_schema_types(v))
            for k, v in schema.items()}


def _function(entry, where: str) -> dict:
    if not isinstance(entry, dict):
        raise RowReject(f"{where}: a tool is {type(entry).__name__}, not an object with a function name")
    fn = entry.get("function", entry) if entry.get("type", "function") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RowReject(f"{where}: a tool has no function name (expected {{'type': 'function', 'function': "
                        f"{{'name': ...}}}} or {{'name': ...}})")
    return {"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters") if k in fn}}


def _parse(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        raise RowReject(f"{where} is neither JSON nor a Python literal; fix the row or drop the source's tools") \
            from None


def row_tools(row: dict, messages: list[dict]) -> tuple[list[dict], str | None]:
    """(tools, where they came from: 'tools' | 'function' | 'system' | None) of one raw row and its normalized messages.
    Raises RowReject naming the field when a `tools` field or `<tools>` block cannot be read."""
    if isinstance(row.get("function"), list) and isinstance(row.get("question"), list):   # BFCL
        return [_function(json_schema_types(t), "field 'function'") for t in row["function"]], "function"
    raw = row.get("tools")
    if raw:
        raw = _parse(raw, "field 'tools'") if isinstance(raw, str) else raw
        raw = [raw] if isinstance(raw, dict) else raw
        if not isinstance(raw, list):
            raise RowReject(f"field 'tools' is {type(raw).__name__}, not a list of tool schemas")
        return [_function(t, "field 'tools'") for t in raw], "tools"
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
    blocks = [b for b in _BLOCK.findall(system) if b.strip()]      # "... within <tools></tools> XML tags" names it
    if not blocks:
        return [], None
    tools = []
    for block in blocks:
        parsed = _parse(block, "the <tools> block of the system message")
        for t in parsed if isinstance(parsed, list) else [parsed]:
            tools.append(_function(t, "the <tools> block of the system message"))
    return tools, "system"
