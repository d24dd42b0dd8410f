"""No test asserts nothing: every test function checks something (issue 17).

A test that only runs code ("no exception") passes whatever the code computes. Each
``test_*`` function of the suite must contain an ``assert``, or call ``pytest.raises`` /
``pytest.warns`` / ``pytest.fail``, ``np.testing.*``, an ``assert*`` function, or a helper
of the test modules that (transitively) does.
"""

from __future__ import annotations

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
_ASSERTING_CALLS = ("pytest.raises", "pytest.warns", "pytest.fail", "np.testing.", "numpy.testing.")


def _calls(fn: ast.AST) -> list[ast.expr]:
    return [n.func for n in ast.walk(fn) if isinstance(n, ast.Call)]


def _name(func: ast.expr) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _asserts_directly(fn: ast.AST) -> bool:
    if any(isinstance(n, ast.Assert) for n in ast.walk(fn)):
        return True
    for func in _calls(fn):
        text = ast.unparse(func)
        if text.startswith(_ASSERTING_CALLS) or _name(func).startswith("assert"):
            return True
    return False


def _functions() -> dict[str, dict[str, list[ast.FunctionDef]]]:
    """module -> function name -> definitions (nested ones included)."""
    out: dict[str, dict[str, list[ast.FunctionDef]]] = {}
    for path in sorted(TESTS.glob("*.py")):
        table: dict[str, list[ast.FunctionDef]] = {}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                table.setdefault(node.name, []).append(node)
        out[path.name] = table
    return out


def test_every_test_function_asserts_something():
    modules = _functions()
    every = [f for table in modules.values() for fs in table.values() for f in fs]
    asserting = {id(f) for f in every if _asserts_directly(f)}
    names = {f.name for f in every if id(f) in asserting}
    changed = True
    while changed:  # helpers that call asserting helpers (by name, across test modules)
        changed = False
        for f in every:
            if id(f) not in asserting and any(_name(c) in names for c in _calls(f)):
                asserting.add(id(f))
                names.add(f.name)
                changed = True
    silent = [
        f"{module}::{f.name}"
        for module, table in modules.items()
        if module.startswith("test_")
        for name, fs in table.items()
        if name.startswith("test_")
        for f in fs
        if f.col_offset == 0 and id(f) not in asserting
    ]
    assert len(every) > 500  # the walk found the suite
    assert not silent, f"tests that assert nothing: {silent}"
