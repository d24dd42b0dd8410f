"""The package's shape: no import cycles (type-only imports included), modules of ~600 lines,
and ``jmp_rewrite/_src``'s folders as the developer guide draws them, imported one way.

Every ``import`` counts as an edge wherever it is written: at the top, inside a function, or
under ``if TYPE_CHECKING:`` (a type-only cycle is still two modules that cannot be read, or
split, one without the other). Importing a package's own ``__init__`` implicitly is no edge.

The layout (``docs/development.md``, section "Layout"): the guide's diagram is a text block
whose rows name the units of ``_src`` in brackets (a folder ``[trace/]`` or a top-level module
``[rewrite.py]``), stages in order, the earlier on top. The units drawn are the units on disk,
and no module imports a unit of a later row (units on one row may import each other; the
cycle check still applies): the diagram is the rule, so it cannot go stale.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jmp_rewrite"
SRC = PACKAGE / "_src"
GUIDE = ROOT / "docs" / "development.md"
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
    assert "jmp_rewrite._src.explain.report" in graph["jmp_rewrite._src.explain.view"]
    assert "jmp_rewrite._src.explain.view" in graph["jmp_rewrite._src.explain.build"]
    assert "jmp_rewrite._src.paint.painting" in graph["jmp_rewrite._src.paint.passes"]


def test_no_import_cycles():
    assert _cycles(_graph(PACKAGE)) == []


def test_views_do_not_import_the_report_builder():
    graph = _graph(PACKAGE)
    for view in ("explain.view", "explain.html", "explain.report"):
        assert "jmp_rewrite._src.explain.build" not in graph[f"jmp_rewrite._src.{view}"], view


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
    sorted(p for p in SRC.rglob("*.py") if p.name not in SIZE_EXEMPT),
    ids=lambda p: p.relative_to(SRC).as_posix(),
)
def test_modules_stay_small(path):
    lines = len(path.read_text().splitlines())
    assert lines < MAX_LINES, f"{path.relative_to(SRC)} has {lines} lines: split it by concern"


# ---- the layout ---------------------------------------------------------------------------

_UNIT = re.compile(r"\[([a-z_0-9]+/|[a-z_0-9]+\.py)\]")


def _diagram(text: str) -> list[list[str]]:
    """The rows of the guide's layout diagram: the units each names, top to bottom."""
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```text\n", 1)[1].split("```", 1)[0]
    return [units for line in block.splitlines() if (units := _UNIT.findall(line))]


def _units_on_disk(src: pathlib.Path) -> set[str]:
    folders = {f"{p.name}/" for p in src.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.name for p in src.glob("*.py") if p.name != "__init__.py"}
    return folders | modules


def _unit(module: str, prefix: str, src: pathlib.Path) -> str | None:
    """The unit of ``_src`` a module belongs to (None: ``_src`` itself, or outside it)."""
    if not module.startswith(prefix):
        return None
    head, _, rest = module.removeprefix(prefix).partition(".")
    return f"{head}/" if rest or (src / head).is_dir() else f"{head}.py"


def _backward_imports(package: pathlib.Path, rows: list[list[str]]) -> list[str]:
    """Imports of a unit of a later row, or of the public package (which imports every
    unit) from any row but the last: ``importer -> imported``."""
    prefix = f"{package.name}._src."
    rank = {unit: i for i, units in enumerate(rows) for unit in units}
    found = []
    for name, targets in _graph(package).items():
        here = _unit(name, prefix, package / "_src")
        if here is None:
            continue
        for target in sorted(targets):
            there = _unit(target, prefix, package / "_src")
            later = rank[there] > rank[here] if there else not target.startswith(prefix[:-1])
            if later and (there or rank[here] < len(rows) - 1):
                found.append(f"{name} -> {target}")
    return sorted(found)


def test_the_guide_draws_the_folders_on_disk():
    rows = _diagram(GUIDE.read_text())
    drawn = [unit for units in rows for unit in units]
    assert len(drawn) == len(set(drawn)), "a unit drawn twice"
    assert set(drawn) == _units_on_disk(SRC)


def test_no_module_imports_a_later_stage():
    assert _backward_imports(PACKAGE, _diagram(GUIDE.read_text())) == []


def test_the_layout_check_catches_a_backward_import(tmp_path):
    pkg = tmp_path / "pkg"
    for folder in ("", "_src", "_src/early", "_src/late"):
        (pkg / folder).mkdir(exist_ok=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "_src" / "early" / "a.py").write_text("from pkg._src.late import b\n")
    (pkg / "_src" / "late" / "b.py").write_text("import pkg._src.top\n")
    (pkg / "_src" / "top.py").write_text("def f():\n    import pkg\n")
    assert _backward_imports(pkg, [["top.py"], ["early/"], ["late/"]]) == [
        "pkg._src.early.a -> pkg._src.late.b",  # a later row's
        "pkg._src.top -> pkg",  # the public package, from a row but the last
    ]
    assert _backward_imports(pkg, [["top.py"], ["late/"], ["early/"]]) == ["pkg._src.top -> pkg"]
    assert _backward_imports(pkg, [["late/", "early/"], ["top.py"]]) == [
        "pkg._src.late.b -> pkg._src.top"  # one row imports freely within itself, not below
    ]


@pytest.mark.parametrize("init", sorted(SRC.glob("*/__init__.py")), ids=lambda p: p.parent.name)
def test_each_folder_says_what_it_decides_and_imports_nothing(init):
    tree = ast.parse(init.read_text())
    doc = ast.get_docstring(tree) or ""
    assert doc.count("\n") >= 2, f"{init.parent.name}/__init__.py needs a docstring of a few lines"
    assert "Reads" in doc and "Hands on" in doc, "say what it reads and what it hands on"
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
