"""The documentation's own Sphinx extension.

- Before the pages are read, it generates what they show from real results, into
  ``docs/_generated`` (never committed): the painting diagram of a small model
  (``painting_diagram.py``, from :func:`jmp_rewrite.paint`), the HTML report of
  :func:`jmp_rewrite.explain` on it, and the benchmark plots (``benchmark_plots.py``, from
  the tables of ``benchmarks.md``).
- A NamedTuple's fields are listed once, from its docstring.
- Type hints name the private modules where a public class is defined
  (``jmp_rewrite._src.explain.build.Report``): such a reference resolves to the public name's entry
  (``jmp_rewrite.Report``), and only when that public name is the same object.
"""

from __future__ import annotations

import importlib
import os
import time

from sphinx.application import Sphinx
from sphinx.util import logging

import jmp_rewrite

logger = logging.getLogger(__name__)
HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.dirname(HERE)
GENERATED = os.path.join(DOCS, "_generated")


def _generate(app: Sphinx) -> None:
    os.makedirs(GENERATED, exist_ok=True)
    for name in ("painting_diagram", "benchmark_plots"):
        start = time.perf_counter()
        importlib.import_module(name).main(DOCS, GENERATED)
        logger.info(f"[jmp_docs] {name}: {time.perf_counter() - start:.1f} s")


def _public_name(target: str) -> str | None:
    """``jmp_rewrite.NAME`` for a reference to a public object by another path, else None."""
    name = target.rsplit(".", 1)[-1]
    if name not in jmp_rewrite.__all__ or target == f"jmp_rewrite.{name}":
        return None
    module_name, _, attribute = target.rpartition(".")
    if module_name:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            return None
        if getattr(module, attribute, None) is not getattr(jmp_rewrite, name):
            return None
    return f"jmp_rewrite.{name}"


def _documented_suffix(domain, target: str) -> str | None:
    """The one documented object whose name ends with ``.target`` (a docstring's short
    ``:class:`EquationComparison``` written in its own module), else None."""
    matches = [name for name in domain.objects if name.endswith(f".{target}")]
    return matches[0] if len(matches) == 1 else None


def _resolve_public(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    domain = env.get_domain("py")
    target = _public_name(node["reftarget"])
    if target is None and "." not in node["reftarget"]:
        target = _documented_suffix(domain, node["reftarget"])
    if target is None:
        return None
    return domain.resolve_xref(
        env, node["refdoc"], app.builder, node["reftype"], target, node, contnode
    )


def _skip_namedtuple_fields(app, what, name, obj, skip, options):
    """A NamedTuple's fields are documented by its docstring's Attributes section; autodoc
    would list them a second time (as "Alias for field number N")."""
    if (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
        return True
    return None


def setup(app: Sphinx) -> dict:
    app.connect("autodoc-skip-member", _skip_namedtuple_fields)
    app.connect("builder-inited", _generate)
    app.connect("missing-reference", _resolve_public)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
