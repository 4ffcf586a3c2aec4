"""The layer rules of docs/architecture.md, counted on the source (ast): the folder map and its layer order (no upward
import, no import cycle), small eagle3_core files, no module importing another module's `_private` name, no Prefect
in eagle3_core, the page's stage table equal to the code's, and imports at the top unless a comment says why."""
from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

from eagle3_core.contract.layout import STAGE_DIRS, RunLayout
from eagle3_core.pipeline.table import STAGES

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 400
LARGEST_LINES = 370


def _py_files(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


def _imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, imported name or None for `import module`) of every import in `path`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out += [(node.lineno, "." * node.level + (node.module or ""), a.name) for a in node.names]
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_eagle3_core_file_is_over_400_lines_and_the_largest_keep_room():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _py_files("eagle3_core")}
    long = {f: n for f, n in sizes.items() if n > MAX_LINES}
    assert not long, f"eagle3_core files over {MAX_LINES} lines (split them by responsibility): {long}"
    largest = dict(sorted(sizes.items(), key=lambda kv: -kv[1])[:4])
    assert max(largest.values()) <= LARGEST_LINES, f"the four largest files must keep room below {MAX_LINES}: {largest}"


def _layer_table() -> dict[str, int]:
    """{folder or root module: layer} of docs/architecture.md's '## Folders and layers' table (`config/` -> 'config',
    `check.py` -> 'check')."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Folders and layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    out = {}
    for line in rows:
        layer, names = [c.strip() for c in line.strip("|").split("|")][:2]
        for name in re.findall(r"`([\w./]+)`", names):
            out[name.removesuffix("/").removesuffix(".py")] = int(layer)
    return out


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_imports() -> dict[str, set[str]]:
    """{module: the eagle3_core modules it imports}, module level and inside functions alike; `from pkg import mod`
    counts the module mod, `from mod import name` the module mod."""
    files = {_module_of(p): p for p in _py_files("eagle3_core")}
    edges = {m: set() for m in files}
    for m, path in files.items():
        package = m if path.name == "__init__.py" else m.rsplit(".", 1)[0]
        for _, module, name in _imports(path):
            if module.startswith("."):
                level = len(module) - len(module.lstrip("."))
                base = package.split(".")[: len(package.split(".")) - (level - 1)]
                module = ".".join(base + ([module.lstrip(".")] if module.lstrip(".") else []))
            if module.split(".")[0] != "eagle3_core":
                continue
            target = f"{module}.{name}" if name and f"{module}.{name}" in files else module
            if target != m:
                edges[m].add(target)
    return edges


def _group(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "eagle3_core"


def test_the_folder_map_is_the_packages():
    code = {p.name for p in (ROOT / "eagle3_core").iterdir() if (p / "__init__.py").exists()}
    code |= {p.stem for p in (ROOT / "eagle3_core").glob("*.py") if p.name != "__init__.py"}
    assert set(_layer_table()) == code


def test_no_module_name_is_used_twice():
    names = {}
    for p in _py_files("eagle3_core"):
        name = p.parent.name if p.name == "__init__.py" else p.stem
        names.setdefault(name, []).append(str(p.relative_to(ROOT)))
    assert not {n: fs for n, fs in names.items() if len(fs) > 1}


def test_no_import_cycle_and_no_import_against_the_layer_order():
    edges = _package_imports()
    # import cycles: strongly connected groups of two or more modules (Tarjan)
    index, low, stack, on, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not groups, f"modules that import each other (directly or around a circle): {groups}"
    layer = _layer_table()
    against = sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                     if _group(a) != "eagle3_core" and _group(b) != "eagle3_core" and _group(a) != _group(b)
                     and layer[_group(b)] >= layer[_group(a)])
    assert not against, f"imports of a folder of the same or a higher layer (docs/architecture.md): {against}"
    assert not [a for a, targets in edges.items() if "eagle3_core" in targets], "import the defining module"


def test_no_stage_module_imports_another():
    """A stage module (pipeline/*_stage.py) imports no other stage module, at module level or inside a function:
    what two stages share lives below them (training.startup, features.store_run, pipeline.keys, pipeline.run)."""
    stages = {p.stem for p in (ROOT / "eagle3_core" / "pipeline").glob("*_stage.py")}
    between = [(path.stem, line, module) for path in (ROOT / "eagle3_core" / "pipeline").glob("*_stage.py")
               for line, module, name in _imports(path)
               if (other := module.rsplit(".", 1)[-1] if module.startswith("eagle3_core.pipeline.") else
                   (name if module == "eagle3_core.pipeline" else None)) in stages and other != path.stem]
    assert len(stages) == 8 and between == [], between


def test_no_module_imports_another_modules_private_name():
    found = []
    for path in _py_files("eagle3_core", "benchmarks", "tasks", "flows"):
        for line, module, name in _imports(path):
            parts = module.lstrip(".").split(".") + ([name] if name else [])
            if any(_private(p) for p in parts if p):
                found.append(f"{path.relative_to(ROOT)}:{line}: {module} {name or ''}".strip())
    assert not found, "imports of another module's private name (make the helper public): " + "; ".join(found)


def test_eagle3_core_imports_no_prefect():
    found = [f"{p.relative_to(ROOT)}:{line}" for p in _py_files("eagle3_core") for line, module, _ in _imports(p)
             if module.split(".")[0] == "prefect"]
    assert not found, f"eagle3_core must not import prefect (docs/architecture.md layers): {found}"


def _doc_stage_table() -> list[tuple[str, str]]:
    """(stage, directory) of each row of docs/architecture.md's '## Stage table'."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Stage table", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip().lower() for c in rows[0].strip("|").split("|")]
    assert header[:2] == ["stage", "directory"], header
    assert re.fullmatch(r"[|\- :]+", rows[1]), rows[1]
    out = []
    for line in rows[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        out.append((cells[0].strip("`"), cells[1].strip("`").rstrip("/")))
    return out


def test_the_architecture_pages_stage_table_is_the_codes():
    assert _doc_stage_table() == [(s.name, s.directory) for s in STAGES.values()]


def test_the_run_layout_and_stage_dirs_read_the_stage_table(tmp_path):
    run = RunLayout(tmp_path)
    assert STAGE_DIRS == {name: s.directory for name, s in STAGES.items()}
    for name, d in STAGE_DIRS.items():
        assert run.stage_dir(name) == tmp_path / d
    assert [run.prompts, run.generations, run.tokenized, run.features, run.vocab, run.draft, run.eval,
            run.deploy_llama_cpp, run.deploy_sglang] == [tmp_path / d for d in STAGE_DIRS.values()]
    for s in STAGES.values():
        assert set(s.upstream) <= set(STAGES), (s.name, s.upstream)


def test_every_path_of_a_run_is_named_in_the_run_layout_alone():
    """No module of eagle3_core, tasks or flows joins a literal name onto a run directory (`run_dir / "x"`): the
    run's paths are RunLayout's (contract/layout.py), the one place that names them."""
    joined = re.compile(r"run_dir\)? / [\"f]")
    found = [f"{f.relative_to(ROOT)}:{i}" for f in _py_files("eagle3_core", "tasks", "flows")
             if f.name != "layout.py" for i, line in enumerate(f.read_text().splitlines(), 1) if joined.search(line)]
    assert found == [], found


def test_fault_injection_lives_with_the_tests():
    """Faults are injected by tests/fault_site (sitecustomize on a subprocess's PYTHONPATH, or a call of the killed
    script), never by production code: no fault variable, injector or hook in eagle3_core/ or tasks/."""
    words = ("EAGLE3_FAULT_INJECT", "FAULT_INJECT", "maybe_fail", "tasks.faults", "InjectedFault", "_mid_write_hook",
             "fault_site", "fault_injection")
    found = [f"{p.relative_to(ROOT)}: {word}" for p in _py_files("eagle3_core", "tasks")
             for word in words if word in p.read_text()]
    assert not found, found
    assert not (ROOT / "tasks" / "faults.py").exists()


def test_one_path_per_computation():
    """No runtime switch to a former implementation in eagle3_core/ or tasks/: the former TTT step and shard
    writer are references in tests/reference_paths.py, imported only by tests and benchmarks (the equivalence tests
    test_ttt.test_ttt_loss_equals_the_former_step and test_features.test_zero_copy_shard_writer_matches_...)."""
    words = ("set_fast_step", "fast_step", "zero_copy", "compile_merge = ", "reference_ttt_loss",
             "write_shard_concat", "extract_batch")
    found = [f"{p.relative_to(ROOT)}: {word}" for p in _py_files("eagle3_core", "tasks", "flows", "deployments")
             for word in words if word in p.read_text()]
    assert not found, found
    importers = {p.parent.name for p in _py_files("eagle3_core", "tasks", "flows", "benchmarks", "tests")
                 for _, module, _ in _imports(p) if module == "reference_paths"}
    assert importers == {"tests", "benchmarks"}, importers


def test_flows_call_no_eagle3_core_function_except_config_and_presets():
    """Flows call tasks (and the task-level contexts of tasks/control.py) only: planning, server start and stop,
    the config check and refresh are tasks with their own state and log. flows/ may import from eagle3_core only
    its config module (PipelineConfig, load_config, preset)."""
    found = [f"{p.relative_to(ROOT)}:{line}: {module} {name or ''}".strip() for p in _py_files("flows")
             for line, module, name in _imports(p)
             if module.split(".")[0] == "eagle3_core" and module != "eagle3_core.config"]
    assert not found, f"flows/ reach past their tasks into eagle3_core: {found}"


def test_no_file_cites_what_a_clone_lacks():
    """A user's clone holds only the repository: no tracked file names the design notes kept beside the maintainers'
    checkout (each fact is cited from its public source instead)."""
    lacking = ("REFERENCE" + ".md", "DESIGN" + ".md", "STYLE" + ".md", "../" + "shared")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    found = [f"{name}: {word}" for name in tracked if (ROOT / name).is_file()
             and not name.endswith((".png", ".gguf", ".safetensors", ".parquet"))
             for word in lacking if word in (ROOT / name).read_text(errors="ignore")]
    assert not found, found


# dotted names in prose that are not ours: attributes of a transformers config object, a pattern of field names
NOT_OURS = {"config.text_config": "transformers' PretrainedConfig attribute",
            "config.to_dict": "transformers' PretrainedConfig method",
            "generation.max_": "the pattern generation.max_*_frac in docs/guide.md"}
DOTTED = re.compile(r"(?<![\w/.-])((?:[a-z_][a-z0-9_]*\.)+[A-Za-z_]\w*)")


def _module_names() -> dict[str, set[str]]:
    """{dotted module name under eagle3_core (without the prefix): its top-level names, class members as
    'Class.member'}."""
    out = {}
    for path in _py_files("eagle3_core"):
        parts = path.relative_to(ROOT / "eagle3_core").with_suffix("").parts
        names = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                names |= {f"{node.name}.{m.name}" for m in getattr(node, "body", [])
                          if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
                names |= {f"{node.name}.{m.target.id}" for m in getattr(node, "body", [])
                          if isinstance(m, ast.AnnAssign) and isinstance(m.target, ast.Name)}
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                names |= {t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                          if isinstance(t, ast.Name)}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        out[".".join(p for p in parts if p != "__init__")] = names
    return out


def _config_field(ref: str) -> bool:
    """Whether `ref` is a field path of PipelineConfig (generation.api, features.backend, ...)."""
    import typing

    from eagle3_core.config import PipelineConfig
    model = PipelineConfig
    for i, part in enumerate(ref.split(".")):
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return i > 0 and hasattr(model, part)                    # a property or method of a config section
        model = next((a for a in (field.annotation, *typing.get_args(field.annotation))
                      if hasattr(a, "model_fields")), None)
        if model is None:
            return i == len(ref.split(".")) - 1
    return True


def _resolves(ref: str, modules: dict[str, set[str]]) -> bool:
    """Whether `ref` (eagle3_core.x.y.f, x.y.f or a suffix y.f of a module path, then names in it) names a module
    of the package or a name in one, or a config field."""
    parts = ref.removeprefix("eagle3_core.").split(".")
    for i in range(len(parts), 0, -1):
        head, rest = ".".join(parts[:i]), parts[i:]
        for mod in (m for m in modules if m == head or m.endswith("." + head)):
            if not rest or ".".join(rest[:2]) in modules[mod] or rest[0] in modules[mod]:
                return True
    return _config_field(ref)


def test_every_dotted_name_in_docstrings_and_docs_exists():
    """A docstring or a docs page naming a module, function or config field by a dotted name names one that
    exists (a move leaves no dangling reference); names outside the package are listed in NOT_OURS."""
    modules = _module_names()
    firsts = {m.split(".")[0] for m in modules} | {"eagle3_core"}
    texts = [(str(p.relative_to(ROOT)), ast.get_docstring(n, clean=False) or "") for p in _py_files("eagle3_core")
             for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    texts += [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted((ROOT / "docs").rglob("*.md"))]
    missing = sorted({(where, ref) for where, text in texts for ref in DOTTED.findall(text)
                      if ref.split(".")[0] in firsts and ref not in NOT_OURS
                      and not re.search(r"\.(py|json|jsonl|md|safetensors|parquet|gguf|txt|png|toml)$", ref)
                      and not _resolves(ref, modules)})
    assert not missing, f"dotted names that name nothing (fix them to the module that holds it now): {missing}"


MAX_FUNCTION_LINES = 60
# product functions allowed past MAX_FUNCTION_LINES, each with its reason (none: split them where their steps are)
LONG_FUNCTIONS: dict[str, str] = {}


def test_no_product_function_is_over_60_lines():
    """Every function in eagle3_core, from `def` to its last line (a nested function counts in its parent and
    alone), is at most MAX_FUNCTION_LINES lines, except LONG_FUNCTIONS (named with their reason)."""
    functions = [(p, n) for p in _py_files("eagle3_core") for n in ast.walk(ast.parse(p.read_text()))
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    long = {f"{p.relative_to(ROOT)}:{n.name}": n.end_lineno - n.lineno + 1 for p, n in functions
            if n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES}
    unexplained = {k: v for k, v in long.items() if k not in LONG_FUNCTIONS}
    assert not unexplained, (f"functions over {MAX_FUNCTION_LINES} lines (split them where their steps are, or "
                             f"name them in LONG_FUNCTIONS with the reason): {unexplained}")
    assert not set(LONG_FUNCTIONS) - set(long), f"LONG_FUNCTIONS names short ones: {set(LONG_FUNCTIONS) - set(long)}"


def _comment_lines(source: str) -> set[int]:
    """Line numbers of `source` that hold a `#` comment (tokenize: a `#` inside a string does not count)."""
    return {t.start[0] for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}


def test_every_import_inside_a_function_says_why_on_its_line():
    """Imports sit at the top of their module. One that is not a direct child of the module body (inside a function,
    or a try/except at the top) carries its reason as a comment on its first line: an optional dependency (SGLang,
    Triton, a newer torch), a slow import used on one path (transformers, datasets, matplotlib), code run in a
    foreign python. The count of such imports is in the message."""
    inner, bare = [], []
    for p in _py_files("eagle3_core"):
        source = p.read_text()
        tree, comments = ast.parse(source, str(p)), _comment_lines(source)
        top = {id(n) for n in tree.body}
        for n in ast.walk(tree):
            if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in top:
                inner.append(f"{p.relative_to(ROOT)}:{n.lineno}")
                if n.lineno not in comments:
                    bare.append(inner[-1])
    assert not bare, (f"{len(inner)} imports inside functions in eagle3_core, {len(bare)} of them without a reason "
                      f"comment on their line (move each to the top of its module, or say why it stays there): "
                      f"{bare}")
