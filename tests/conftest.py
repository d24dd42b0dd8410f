"""Shared fixtures and the hypothesis profiles. Test helpers live in jaxpr_walk.py
(importable: tests/ is on sys.path).

Property tests run derandomized by default (profile ``ci``: a seed from the test's source
and node id, and no constants from the loaded modules, see below: the same examples alone and
in the suite; a failure prints its ``@reproduce_failure`` blob to replay it); their edge cases
are pinned with ``@example``. ``HYPOTHESIS_PROFILE=random`` draws new
examples on every run, to look for failures by hand:
``HYPOTHESIS_PROFILE=random .venv/bin/python -m pytest tests/test_loss_scale.py``;
``HYPOTHESIS_PROFILE=long`` does too, and runs 200 generated programs per dtype in
``tests/test_oracle.py`` instead of a few, shrinking a counterexample.
A test's own ``@settings`` (example counts, phases) apply on top of the profile.
"""

import os
import warnings

import jax
import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, database=None, print_blob=True)
settings.register_profile("random", deadline=None, print_blob=True)
# By hand, to explore: new examples every run, and many more of the generated programs of
# tests/test_oracle.py (which reads this profile's name), shrunk when one fails.
settings.register_profile("long", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _no_constants_from_loaded_modules() -> None:
    """Hypothesis (6.13x+) draws about 5% of its numbers from the literals of the local
    modules in ``sys.modules`` (ours: jmp_rewrite, benchmarks/, tools/). Which of those a
    process has imported depends on which tests ran before in it (an xdist worker, one file
    run alone), so the same derandomized test drew other programs in the full suite than
    alone (measured: importing every ``jmp_rewrite._src`` module first turned a passing
    generated test into a failing one). An empty pool makes the draws depend on the test's
    source and node id only. It is an internal of hypothesis: where it is gone, a warning
    says so and the draws may again depend on the loaded modules."""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:
        providers = None
    if providers is None or not hasattr(providers, "_get_local_constants"):
        warnings.warn(
            "hypothesis no longer has providers._get_local_constants: derandomized draws may "
            "depend on which local modules are imported (see tests/conftest.py)",
            stacklevel=1,
        )
        return
    empty = type(providers._local_constants)()
    providers._get_local_constants = lambda: empty


_no_constants_from_loaded_modules()


@pytest.fixture
def leak_checking():
    """Marker fixture: run this test with ``jax_check_tracer_leaks`` on (see below)."""


@pytest.fixture
def leak_check_only_where_asked(request):
    """pyproject turns on ``jax_check_tracer_leaks`` for the suite. It disables JAX's caches,
    so every eager op and every jit call recompiles (3-10x slower). Modules that use this
    fixture (``pytestmark = pytest.mark.usefixtures(...)``) run without it, except tests that
    request ``leak_checking``, which trace every code path of the module under the check."""
    with jax.check_tracer_leaks("leak_checking" in request.fixturenames):
        yield
