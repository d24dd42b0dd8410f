"""Shared fixtures. Test helpers live in jaxpr_walk.py (importable: tests/ is on sys.path)."""

import jax
import pytest


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
