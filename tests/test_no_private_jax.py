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
