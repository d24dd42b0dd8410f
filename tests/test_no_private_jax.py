"""No module of jmp_rewrite (or its tests, benchmarks) may import JAX's private ``jax._src``."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted(
    p
    for folder in ("jmp_rewrite", "tests", "benchmarks")
    for p in (ROOT / folder).rglob("*.py")
    if p.name != "test_no_private_jax.py"
)


def _private_imports(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("jax._src")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax._src"):
            found.append(node.module)
        elif isinstance(node, ast.Attribute) and node.attr == "_src":
            if isinstance(node.value, ast.Name) and node.value.id == "jax":
                found.append("jax._src")
    return found


def test_sources_were_found():
    assert any(p.parts[-2] == "_src" for p in SOURCES)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_jax_src_imports(path):
    assert _private_imports(path) == [], f"{path} imports jax._src"


def test_checker_catches_private_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from jax._src import core\nimport jax._src.pjit\nx = jax._src\n")
    assert len(_private_imports(bad)) == 3


#: JAX's parameter names for higher-order primitives' bodies and operand layouts: they live in
#: trace/higher_order.py (and _jax_compat.py) alone, so a JAX release that renames one touches one
#: module (issue 7: scan's ``num_consts`` became ``ft_in`` in jax 0.12).
LAYOUT_PARAMS = (
    "num_consts",
    "num_carry",
    "cond_nconsts",
    "body_nconsts",
    "cond_jaxpr",
    "body_jaxpr",
    "call_jaxpr",
    "fun_jaxpr",
    "ft_in",
    "in_specs",
    "branches",
)
LAYOUT_HOME = {"trace/higher_order.py", "_jax_compat.py"}  # relative to jmp_rewrite/_src
SRC = ROOT / "jmp_rewrite" / "_src"


def _layout_params(path: pathlib.Path) -> list[str]:
    """String constants naming a layout parameter (``params["num_consts"]`` and the like)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in LAYOUT_PARAMS
    ]


@pytest.mark.parametrize(
    "path",
    [
        p
        for p in SOURCES
        if p.is_relative_to(SRC) and p.relative_to(SRC).as_posix() not in LAYOUT_HOME
    ],
    ids=lambda p: str(p.relative_to(SRC)),
)
def test_layout_params_only_in_higher_order(path):
    assert _layout_params(path) == [], f"{path.name} reads JAX's layout params directly"


def test_layout_checker_catches_a_param(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('n = eqn.params["num_consts"]\nb = p.get("branches")\n')
    assert _layout_params(bad) == ["num_consts", "branches"]
