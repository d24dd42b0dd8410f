"""The mutants of ``tools/mutant_list.py`` still fit the source and the suite.

``tools/mutants.py`` (run by hand) applies each mutant and runs the tests it names. These
cheap checks keep the list from rotting silently: every mutant's original text occurs
exactly once in its file, and every test it names exists.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"tools.{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(f"tools.{name}", module)
    module.__name__ = f"tools.{name}"
    spec.loader.exec_module(module)
    return module


# curated + the planted rounds
ROUNDS = (
    "mutant_list",
    "mutants_round6",
    "mutants_round7",
    "mutants_round8",
    "mutants_round9",
    "mutants_round10",
)
MUTANTS = tuple(m for name in ROUNDS for m in _load(name).MUTANTS)


def _test_names(file: str) -> set[str]:
    tree = ast.parse((ROOT / file).read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_mutant_names_are_unique():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names)) and len(names) >= 50


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutant_applies_once_and_names_existing_tests(mutant):
    source = (ROOT / mutant.file).read_text()
    assert source.count(mutant.original) == 1, (
        f"{mutant.name}: its original text must occur exactly once in {mutant.file} "
        "(the source changed: update the mutant in tools/mutant_list.py)"
    )
    assert mutant.replacement != mutant.original and mutant.tests and mutant.bug
    for test in mutant.tests:
        file, _, name = test.partition("::")
        assert (ROOT / file).is_file(), f"{mutant.name}: no test file {file}"
        if name:
            assert name.split("[")[0] in _test_names(file), f"{mutant.name}: no test {test}"


def test_mutated_sources_still_parse():
    """A mutant is a bug, not a syntax error: the mutated module must still compile."""
    for m in MUTANTS:
        original = (ROOT / m.file).read_text()
        mutated = original.replace(m.original, m.replacement)
        assert mutated != original, m.name
        compile(mutated, m.file, "exec")  # a SyntaxError fails the test


def test_the_script_checks_the_list():
    assert _load("mutants").main(["--check"]) == 0
