"""The package's shape: no import cycles (type-only imports included), modules of ~600 lines.

Every ``import`` counts as an edge wherever it is written: at the top, inside a function, or
under ``if TYPE_CHECKING:`` (a type-only cycle is still two modules that cannot be read, or
split, one without the other). Importing a package's own ``__init__`` implicitly is no edge.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jmp_rewrite"
#: Lines a module of ``jmp_rewrite/_src`` may have (the developer guide says ~600).
MAX_LINES = 620
#: Data, not code: the op lists with a reason per key.
SIZE_EXEMPT = {"op_lists.py"}


def _modules(package: pathlib.Path) -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(path: pathlib.Path, name: str, modules: dict[str, pathlib.Path]) -> set[str]:
    """The modules of ``modules`` that ``path`` (module ``name``) imports, anywhere in it."""
    is_package = path.name == "__init__.py"
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # ``import a.b.c`` of a non-module
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
    return edges


def _graph(package: pathlib.Path) -> dict[str, set[str]]:
    modules = _modules(package)
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_was_read():
    graph = _graph(PACKAGE)
    assert "jmp_rewrite._src.report" in graph["jmp_rewrite._src.explain_view"]
    assert "jmp_rewrite._src.explain_view" in graph["jmp_rewrite._src.explain"]
    assert "jmp_rewrite._src.painting" in graph["jmp_rewrite._src.paint"]


def test_no_import_cycles():
    assert _cycles(_graph(PACKAGE)) == []


def test_views_do_not_import_the_report_builder():
    graph = _graph(PACKAGE)
    for view in ("explain_view", "explain_html", "report"):
        assert "jmp_rewrite._src.explain" not in graph[f"jmp_rewrite._src.{view}"], view


def test_checker_catches_type_only_and_function_level_cycles(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n"
    )
    (pkg / "c.py").write_text("def f():\n    from . import d\n")
    (pkg / "d.py").write_text("import pkg.c\n")
    (pkg / "e.py").write_text("import pkg.a\n")
    assert _cycles(_graph(pkg)) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]


@pytest.mark.parametrize(
    "path",
    sorted(p for p in (PACKAGE / "_src").glob("*.py") if p.name not in SIZE_EXEMPT),
    ids=lambda p: p.name,
)
def test_modules_stay_small(path):
    lines = len(path.read_text().splitlines())
    assert lines < MAX_LINES, f"{path.name} has {lines} lines: split it by concern"
