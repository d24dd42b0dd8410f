"""The public surface: every exported name is documented, and the docstring examples run."""

import doctest
import importlib
import inspect

import pytest

import jmp_rewrite

MODULES = [
    "rewrite",
    "explain",
    "seed",
    "regions",
    "loss_scale",
    "loss_scale_optimizer",
    "finite",
    "loss_scale_state",
    "environment",
    "fp8",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(f"jmp_rewrite._src.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


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
