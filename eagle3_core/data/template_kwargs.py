"""`generation.chat_template_kwargs` checked against what the target's chat template reads.

A Jinja template reads its arguments as free variables: `{%- if enable_thinking is defined and enable_thinking is
false %}` (Qwen3's tokenizer_config.json), `{%- if not thinking %}` (DeepSeek-V3.1's). A key the template never
reads is dropped without a word by every renderer (transformers' `apply_chat_template`, SGLang's and vLLM's
`chat_template_kwargs`), so `{"enable_thinkng": false}` trains in the other thinking mode; a string where the
template tests a boolean is just as silent: `"false"` is truthy, and `"false" is false` is not true. Both are
refused here, before anything is rendered.

How a template uses a variable is read from its AST (jinja2's parser and `jinja2.meta.find_undeclared_variables`):
  strict   tested with `is true` / `is false` / `is boolean`, or compared with a boolean literal: only a JSON
           boolean works (0 and 1 are not `false` / `true` to Jinja's tests)
  truth    used only as a condition (`if x`, `not x`, `x and y`, a ternary's test): a string is refused
  value    rendered, compared with a non-boolean, filtered, indexed, iterated, passed to a call: any JSON value
  defined  `is defined` / `is undefined` / `is none` only: any value
A variable assigned from another (`{% set thinking = enable_thinking %}`, also through `| default(...)`) passes its
uses on to the one it is assigned from.
"""
from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from jinja2 import meta, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# what the renderer passes itself (transformers chat_template_utils.render_jinja_template; SGLang and vLLM the same)
RENDERER_SET = ("messages", "tools", "documents", "add_generation_prompt")
# globals the renderer adds to jinja2's own (transformers chat_template_utils._compile_jinja_template)
RENDERER_GLOBALS = ("raise_exception", "strftime_now")
_STRICT_TESTS = {"true", "false", "boolean"}
_NEUTRAL_TESTS = {"defined", "undefined", "none"}


class TemplateKwargsError(ValueError):
    """chat_template_kwargs the template does not read, or reads as another type; the message names the key, the
    template's nearest variable or the type to write. `kind`: 'unknown', 'type' or 'reserved'."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


class GenerationTag(Extension):
    """`{% generation %} ... {% endgeneration %}` (transformers' assistant-mask marker) parsed as its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _environment():
    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                         extensions=[loopcontrols, GenerationTag])


def _alias_source(node) -> str | None:
    """The variable an assigned expression is (`x`, or `x | default(...)`), or None."""
    while isinstance(node, nodes.Filter) and node.name in ("default", "d"):
        node = node.node
    return node.name if isinstance(node, nodes.Name) else None


@dataclass(frozen=True)
class _Reads:
    """What a walk of a template's AST found: uses {variable: uses so far} and aliases {assigned variable: the
    variables it is set from}."""
    uses: dict[str, set[str]] = field(default_factory=dict)
    aliases: dict[str, set[str]] = field(default_factory=dict)


@lru_cache(maxsize=16)
def template_variables(template: str) -> dict[str, frozenset[str]]:
    """{variable: uses} for every variable `template` reads without defining it (jinja2.meta), uses a subset of
    {'strict', 'truth', 'value', 'defined'} (module docstring). Raises jinja2.TemplateSyntaxError for a template
    that does not parse."""
    ast = _environment().parse(template)
    free = meta.find_undeclared_variables(ast)
    reads = _Reads()
    _visit(ast, "value", reads)
    _pass_alias_uses(reads)
    return {name: frozenset(reads.uses.get(name, set())) for name in sorted(free)}


def _visit(node, ctx: str, reads: _Reads) -> None:
    """Record in `reads` how `node` and its children use each variable; ctx: the use of `node` itself."""
    if isinstance(node, nodes.Name):
        if node.ctx == "load":
            reads.uses.setdefault(node.name, set()).add(ctx)
        return
    if isinstance(node, nodes.Assign) and isinstance(node.target, nodes.Name):
        if (src := _alias_source(node.node)) is not None:
            reads.aliases.setdefault(node.target.name, set()).add(src)
            reads.uses.setdefault(src, set())
            return
    if not _visit_condition(node, ctx, reads) and not _visit_test(node, ctx, reads):
        for child in node.iter_child_nodes():
            _visit(child, "value", reads)


def _visit_condition(node, ctx: str, reads: _Reads) -> bool:
    """_visit of an `if`, a ternary, `not`, `and`/`or`: their operands used as conditions. False for another
    node."""
    if isinstance(node, (nodes.If, nodes.CondExpr)):
        _visit(node.test, "truth", reads)
        rest = [n for f in node.fields if f != "test" for n in _children(getattr(node, f))]
        for child in rest:
            _visit(child, ctx if isinstance(node, nodes.CondExpr) else "value", reads)
        return True
    if isinstance(node, nodes.Not):
        _visit(node.node, "truth", reads)
        return True
    if isinstance(node, (nodes.And, nodes.Or)):
        for child in (node.left, node.right):
            _visit(child, ctx if ctx in ("truth", "strict") else "value", reads)
        return True
    return False


def _visit_test(node, ctx: str, reads: _Reads) -> bool:
    """_visit of a test (`is false`, `is defined`), a comparison or a `default` filter. False for another node."""
    if isinstance(node, nodes.Test):
        inner = "strict" if node.name in _STRICT_TESTS else "defined" if node.name in _NEUTRAL_TESTS else "value"
        _visit(node.node, inner, reads)
        for child in [*node.args, *node.kwargs]:
            _visit(child, "value", reads)
        return True
    if isinstance(node, nodes.Compare):
        operands = [node.expr, *(op.expr for op in node.ops)]
        boolean = any(isinstance(o, nodes.Const) and isinstance(o.value, bool) for o in operands)
        for child in operands:
            _visit(child, "strict" if boolean else "value", reads)
        return True
    if isinstance(node, nodes.Filter) and node.name in ("default", "d") and node.node is not None:
        _visit(node.node, ctx, reads)
        for child in [*node.args, *node.kwargs]:
            _visit(child, "value", reads)
        return True
    return False


def _pass_alias_uses(reads: _Reads) -> None:
    """Let the uses of each alias flow back to what it was set from, until nothing changes."""
    changed = True
    while changed:
        changed = False
        for target, sources in reads.aliases.items():
            for src in sources:
                if not reads.uses.get(target, set()) <= reads.uses.setdefault(src, set()):
                    reads.uses[src] |= reads.uses[target]
                    changed = True


def _children(value) -> list:
    if isinstance(value, nodes.Node):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, nodes.Node)]
    return []


def template_arguments(template: str, reserved=()) -> list[str]:
    """The variables a caller can set through chat_template_kwargs: what the template reads, less what the renderer
    sets itself (RENDERER_SET, jinja2's and the renderer's globals, `reserved`: e.g. the tokenizer's special
    tokens)."""
    taken = set(RENDERER_SET) | set(RENDERER_GLOBALS) | set(_environment().globals) | set(reserved)
    return [name for name in template_variables(template) if name not in taken]


def kwarg_problem(template: str, key: str, value, reserved=(), where: str = "generation.chat_template_kwargs",
                  template_name: str = "the target's chat template") -> TemplateKwargsError | None:
    """What is wrong with one chat_template_kwargs entry for `template`, or None: a key it does not read (the error
    names its nearest variable, or every variable it reads), one the renderer sets itself, or a value it would read
    as another type (a non-boolean where it tests `is true/false`, a string where it only tests truth)."""
    if key in RENDERER_SET or key in reserved:
        return TemplateKwargsError(f"{where}: {key!r} is set by the renderer itself (messages, tools, the generation "
                                   f"prompt, the tokenizer's special tokens), not a template argument; remove it",
                                   "reserved")
    args = template_arguments(template, reserved)
    if key not in args:
        near = difflib.get_close_matches(key, args, n=1, cutoff=0.6)
        hint = (f"did you mean {near[0]!r}?" if near else
                f"it reads {args}" if args else "it reads no argument: remove chat_template_kwargs")
        return TemplateKwargsError(f"{where}: {template_name} does not read {key!r} (the renderer would drop it "
                                   f"without a word); {hint}", "unknown")
    uses = template_variables(template)[key]
    if "strict" in uses and not isinstance(value, bool):
        return TemplateKwargsError(
            f"{where}: {key!r} = {value!r} ({type(value).__name__}), but {template_name} tests {key!r} with "
            f"`is true` / `is false`, which only a JSON boolean passes; write {_boolean(value)}", "type")
    if "truth" in uses and "value" not in uses and isinstance(value, str):
        return TemplateKwargsError(
            f"{where}: {key!r} = {value!r} is a string, but {template_name} uses {key!r} only as a condition, "
            f"where every non-empty string is true; write {_boolean(value)}", "type")
    return None


def check_template_kwargs(template: str, kwargs: dict | None, reserved=(),
                          where: str = "generation.chat_template_kwargs") -> None:
    """Raise the kwarg_problem of the first bad entry of `kwargs` for `template` (TemplateKwargsError)."""
    for key, value in (kwargs or {}).items():
        if (problem := kwarg_problem(template, key, value, reserved, where)) is not None:
            raise problem


def _boolean(value) -> str:
    text = str(value).strip().lower()
    return "false (a JSON boolean)" if text in ("false", "0", "no", "off", "") else "true (a JSON boolean)"


def tokenizer_templates(tokenizer) -> dict[str, str]:
    """{name: template} of the templates a tokenizer renders with: its one template ('default'), or each of its
    named ones (transformers picks 'tool_use' when tools are given, else 'default'). Empty without a template."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        return dict(t)
    return {"default": t} if t else {}


def tokenizer_kwargs_problems(tokenizer, kwargs: dict | None, where: str = "generation.chat_template_kwargs"
                              ) -> list[TemplateKwargsError]:
    """kwarg_problem of each entry against the templates of `tokenizer` (tokenizer_templates), its special tokens
    reserved: with named templates ({'default', 'tool_use'}) a key must be read by one of them, and none may read
    it as another type. A tokenizer without a template reads no argument. Empty when every entry is right."""
    if not kwargs:
        return []
    templates = tokenizer_templates(tokenizer)
    if not templates:
        return [TemplateKwargsError(f"{where}: the tokenizer has no chat template, so no argument is read; remove "
                                    f"it", "unknown")]
    reserved = tuple(getattr(tokenizer, "special_tokens_map", {}) or {})
    out = []
    for key, value in kwargs.items():
        found = [kwarg_problem(t, key, value, reserved, where,
                               "the target's chat template" + (f" {name!r}" if len(templates) > 1 else ""))
                 for name, t in templates.items()]
        typed = [p for p in found if p is not None and p.kind != "unknown"]
        if typed or all(p is not None for p in found):
            out.append((typed or found)[0])
    return out


def check_tokenizer_kwargs(tokenizer, kwargs: dict | None, where: str = "generation.chat_template_kwargs") -> None:
    """Raise the first of tokenizer_kwargs_problems (TemplateKwargsError)."""
    if problems := tokenizer_kwargs_problems(tokenizer, kwargs, where):
        raise problems[0]


def chat_template_file(path: str | Path) -> str:
    """The chat template in a .jinja file, or the (default) 'chat_template' of a tokenizer_config.json. Raises
    OSError for a missing file, ValueError for a JSON file without one."""
    path = Path(path)
    text = path.read_text()
    if path.suffix != ".json":
        return text
    t = json.loads(text).get("chat_template")
    if isinstance(t, list):                           # named templates: [{name, template}, ...]
        t = next((x["template"] for x in t if x.get("name") == "default"), t[0]["template"] if t else None)
    if not isinstance(t, str):
        raise ValueError(f"{path}: no 'chat_template' in it; pass the template's .jinja file")
    return t
