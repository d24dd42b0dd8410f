"""Sphinx configuration of the jmp_rewrite documentation (``make docs``).

Built with warnings as errors (``-W --keep-going``) and every cross-reference checked
(``nitpicky``). Nothing is fetched from the network: no intersphinx, no link check. Names of
other libraries (jax, optax, numpy, flax) in signatures stay plain text (``nitpick_ignore``
below), since their inventories would have to be downloaded.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "_ext"))
sys.path.insert(0, os.path.dirname(HERE))  # the repository: jmp_rewrite from this checkout

import jmp_rewrite  # noqa: E402

project = "jmp_rewrite"
author = "the jmp_rewrite authors"
copyright = "the jmp_rewrite authors"  # noqa: A001
release = jmp_rewrite.__version__  # beside the title on every page
version = release

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",  # [source] links to the highlighted source, built here (no network)
    "sphinx_copybutton",
    "jmp_docs",
]

# The copy button copies the code of a ``>>>`` example without its prompts and its output.
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True
copybutton_only_copy_prompt_lines = True

# MyST: Markdown pages (the README's passages move over unchanged), notebooks via myst-nb.
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links are checked like the rest
exclude_patterns = ["_build", "_generated", "README.md", "notebooks/.ipynb_checkpoints"]

# The notebooks have no stored outputs (notebooks/make_notebooks.py writes them bare): they
# run while the site is built, about 20 s for the three, cached in _build/.jupyter_cache so a
# rebuild reruns only a changed one. A cell that raises fails the build.
nb_execution_mode = "cache"
nb_execution_cache_path = os.path.join(HERE, "_build", ".jupyter_cache")
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True

# The API reference: Google-style docstrings, type hints in the parameter lists.
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True}  # a flag listed here is on, whatever its value
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
python_maximum_signature_line_length = 88
add_module_names = False
# The page's contents list names a method "update", not "LossScaleOptimizerState.update".
toc_object_entries_show_parents = "hide"

nitpicky = True
# Other libraries' names: no inventory for them (no network at build time).
nitpick_ignore_regex = [
    (
        "py:.*",
        r"(jax|jaxlib|optax|numpy|np|flax|equinox|haiku|chex|collections|typing|types)"
        r"(\..*)?",
    ),
    # The type variables of decorators (``F = TypeVar("F", bound=Callable)``).
    ("py:class", r"(jmp_rewrite\._src\.(\w+\.)+)?F"),
    (
        "py:.*",
        r"(Array|ArrayLike|DTypeLike|PyTree|Any|Callable|Sequence|Mapping|Iterable|"
        r"Iterator|Hashable|ParamSpec|TypeVar|Self|NamedTuple|Literal|Optional|Union)",
    ),
]

html_theme = "sphinx_book_theme"
# The sidebar's title and every page's <title> suffix, with the version; the home page's
# <title> is this alone (docs/_templates/layout.html), not "jmp_rewrite — jmp_rewrite".
html_title = f"jmp_rewrite {release}"
templates_path = ["_templates"]
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": False,
    "use_fullscreen_button": False,
    "home_page_in_toc": True,
    "show_navbar_depth": 1,
    # pydata-sphinx-theme (0.16+) puts a search field in a header bar of its own unless this
    # is set here; sphinx-book-theme has its own in the sidebar: one bar, one search field.
    "navbar_persistent": [],
}
html_last_updated_fmt = None
html_copy_source = False
html_show_sourcelink = False
