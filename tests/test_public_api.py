"""The public surface: every exported name is documented, and the docstring examples run."""

import doctest
import importlib
import inspect
import os
import re
import tomllib

import pytest

import jmp_rewrite


def _defining_modules() -> list[str]:
    """Every private module that defines a public name: their docstrings make the API
    reference, so each example there runs."""
    modules = {getattr(getattr(jmp_rewrite, n), "__module__", None) for n in jmp_rewrite.__all__}
    prefix = "jmp_rewrite._src."
    return sorted(m.removeprefix(prefix) for m in modules if m and m.startswith(prefix))


MODULES = _defining_modules()


def test_the_modules_include_those_with_examples():
    assert {
        "rewrite",
        "explain.build",
        "settings",
        "compare.comparison",
        "loss_scale.scale",
        "fp8",
    } <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(f"jmp_rewrite._src.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
    assert result.attempted > 0 or ">>>" not in inspect.getsource(module), name


@pytest.mark.parametrize("name", sorted(jmp_rewrite.__all__))
def test_exported_and_documented(name):
    obj = getattr(jmp_rewrite, name)
    if callable(obj) and not isinstance(obj, tuple):
        doc = inspect.getdoc(obj) or ""
        assert len(doc) > 40, f"{name} needs a docstring"
        if inspect.isfunction(obj) and not name.startswith("MixedPrecision"):
            assert "Example" in doc or "Returns" in doc, name


def test_nothing_private_is_exported():
    assert all(not n.startswith("_") for n in jmp_rewrite.__all__)
    assert len(set(jmp_rewrite.__all__)) == len(jmp_rewrite.__all__)


def test_the_version_is_written_once_and_read_by_the_metadata_and_the_site():
    assert re.fullmatch(r"\d+\.\d+\.\d+", jmp_rewrite.__version__), jmp_rewrite.__version__
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(repo, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert "version" in project["project"]["dynamic"] and "version" not in project["project"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "jmp_rewrite.__version__"
    }
    with open(os.path.join(repo, "docs", "conf.py"), encoding="utf-8") as f:
        conf = f.read()
    assert "release = jmp_rewrite.__version__" in conf and "version = " in conf
