"""What the SGLang stand-in (tests/sglang_standin) mirrors, name by name, and a check of each name against the
pinned sglang release's wheel, read as source (ast; nothing of it is imported or run).

A name is: a module (its file, at the same path), a public module-level class, function or constant, and for each
public class every public method (with __init__ / __post_init__) and the names of its parameters, and every
attribute it sets on self or declares in its body (dataclass fields, enum members), its own and those of stand-in
base classes. Upstream, a class's names include its bases' (followed through the module's imports across the
wheel), so a method defined in a mixin or base class counts. Names starting with `_` are the stand-in's own.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

STANDIN = Path(__file__).resolve().parent / "sglang_standin"
PINNED = "0.5.14"                       # eagle3_core.config.feature_config.SGLANG_VERSION (asserted by the test)
WHEEL_CACHE = Path(os.environ.get("EAGLE3_WHEEL_CACHE", Path.home() / ".cache" / "eagle3-pipeline" / "wheels"))


def _public(name: str) -> bool:
    return not name.startswith("_") or name in ("__init__", "__post_init__")


@dataclass
class ClassNames:
    methods: dict[str, list[str] | None] = field(default_factory=dict)      # name -> params (None: takes **kwargs)
    attributes: set[str] = field(default_factory=set)


def _params(fn: ast.FunctionDef) -> list[str] | None:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs][1 if fn.args.args else 0:]
    return None if a.kwarg else names


def _own_names(cls: ast.ClassDef) -> ClassNames:
    out = ClassNames()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.methods[node.name] = _params(node)
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and \
                        isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    out.attributes.add(sub.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.attributes.add(node.target.id)
        elif isinstance(node, ast.Assign):
            out.attributes.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return out


class Source:
    """A tree of sglang sources: `read(rel)` gives a module file's text (rel like 'sglang/srt/x.py') or None."""

    def __init__(self, read):
        self.read, self._trees = read, {}

    def tree(self, rel: str) -> ast.Module | None:
        if rel not in self._trees:
            text = self.read(rel)
            self._trees[rel] = ast.parse(text) if text is not None else None
        return self._trees[rel]

    def module_file(self, dotted: str) -> str | None:
        base = dotted.replace(".", "/")
        for rel in (f"{base}.py", f"{base}/__init__.py"):
            if self.tree(rel) is not None:
                return rel
        return None

    def top_names(self, rel: str) -> dict[str, ast.AST]:
        """Module-level names of `rel`: definitions, assignments and imports (name -> node)."""
        names = {}
        for node in self.tree(rel).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names[node.name] = node
            elif isinstance(node, ast.Assign):
                names.update({t.id: node for t in node.targets if isinstance(t, ast.Name)})
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names[node.target.id] = node
            elif isinstance(node, (ast.ImportFrom, ast.Import)):
                names.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
        return names

    def find_class(self, rel: str, name: str, depth: int = 0) -> tuple[str, ast.ClassDef] | None:
        """(file, ClassDef) of class `name` as module `rel` sees it (defined there or imported from sglang)."""
        node = self.top_names(rel).get(name) if depth < 8 else None
        if isinstance(node, ast.ClassDef):
            return rel, node
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("sglang"):
            orig = next(a.name for a in node.names if (a.asname or a.name) == name)
            target = self.module_file(node.module)
            return self.find_class(target, orig, depth + 1) if target else None
        return None

    def class_names(self, rel: str, name: str) -> ClassNames:
        """The names of class `name` of module `rel` and of its bases found in this tree."""
        found = self.find_class(rel, name)
        out = ClassNames()
        if found is None:
            return out
        where, cls = found
        for base in cls.bases:
            if isinstance(base, ast.Name):
                inherited = self.class_names(where, base.id)
                out.methods.update(inherited.methods)
                out.attributes |= inherited.attributes
        own = _own_names(cls)
        out.methods.update(own.methods)
        out.attributes |= own.attributes
        return out


def standin_source() -> Source:
    def read(rel: str):
        p = STANDIN / rel
        return p.read_text() if p.exists() else None
    return Source(read)


def mirrored(src: Source | None = None) -> list[tuple[str, str | None, ClassNames | None]]:
    """(module file, name or None for the module itself, the class's names or None) of everything the stand-in
    mirrors: its public modules, their public top-level definitions, each public class's public names."""
    src = src or standin_source()
    out = []
    for path in sorted(STANDIN.rglob("*.py")):
        rel = path.relative_to(STANDIN).as_posix()
        if any(part.startswith("_") and part != "__init__.py" for part in rel.split("/")):
            continue
        out.append((rel, None, None))
        for name, node in src.top_names(rel).items():
            if not _public(name) or isinstance(node, (ast.ImportFrom, ast.Import)):
                continue
            names = src.class_names(rel, name) if isinstance(node, ast.ClassDef) else None
            if names is not None:
                names.methods = {k: v for k, v in names.methods.items() if _public(k)}
                names.attributes = {a for a in names.attributes if _public(a)}
            out.append((rel, name, names))
    return out


def missing(upstream: Source, names=None) -> list[str]:
    """Every mirrored name that `upstream` lacks, as 'file: what' lines (empty when all exist)."""
    problems = []
    for rel, name, mine in names if names is not None else mirrored():
        if upstream.tree(rel) is None:
            if name is None:
                problems.append(f"{rel}: no such module")
            continue
        if name is None:
            continue
        if name not in upstream.top_names(rel):
            problems.append(f"{rel}: no {name}")
            continue
        if mine is None:
            continue
        theirs = upstream.class_names(rel, name)
        for method, params in mine.methods.items():
            if method not in theirs.methods:
                problems.append(f"{rel}: {name}.{method} missing")
            elif theirs.methods[method] is not None and params is not None:
                extra = [p for p in params if p not in theirs.methods[method]]
                if extra:
                    problems.append(f"{rel}: {name}.{method} has no parameter(s) {extra}")
        for attr in sorted(mine.attributes - theirs.attributes - set(theirs.methods)):
            problems.append(f"{rel}: {name}.{attr} is never set upstream")
    return problems


def wheel_source(wheel: Path) -> Source:
    z = zipfile.ZipFile(wheel)
    files = set(z.namelist())
    return Source(lambda rel: z.read(rel).decode() if rel in files else None)


def pinned_wheel() -> tuple[Path | None, str]:
    """(the sglang==PINNED wheel, '') from WHEEL_CACHE, downloaded there with pip (the cp311 manylinux wheel: its
    Python sources are those of every build) if absent; (None, why) when it cannot be had (no registry)."""
    have = sorted(WHEEL_CACHE.glob(f"sglang-{PINNED}-*.whl"))
    if have:
        return have[0], ""
    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", f"sglang=={PINNED}", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64", "-d", str(WHEEL_CACHE), "-q"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"pip download sglang=={PINNED} failed: {e}"
    have = sorted(WHEEL_CACHE.glob(f"sglang-{PINNED}-*.whl"))
    if done.returncode != 0 or not have:
        return None, f"pip download sglang=={PINNED} failed: {(done.stderr or done.stdout).strip()[-300:]}"
    return have[0], ""
