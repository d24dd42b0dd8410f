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

import gc
import os
import shutil
import tempfile
import warnings
import zlib

import jax
import numpy as np
import pytest
from hypothesis import settings

# ------------------------------------------------------------------------------------------
# How the suite compiles. XLA:CPU's backend compile was 78% of the suite's time (measured on
# test_symbolic_shapes + test_round4_numerics: 206 of 264 s). Two settings, for the tests only:
# - LLVM at -O0 (``--xla_backend_optimization_level=0``): a third less compile time. The HLO
#   passes (fusion, layout, algebraic simplification) still run, so the programs computed are
#   the ones users get; only the machine code is less optimised, and the tests' arrays are tiny.
# - a compilation cache shared by the xdist workers and the tests' subprocesses, made fresh for
#   each run and removed after it (nothing carries over between runs): the same HLO (the
#   float32 reference of a model, the same train step under another test) compiles once.
# Both go through the environment, so workers and subprocesses inherit them.
# ------------------------------------------------------------------------------------------
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()
_OWN_CACHE = "JMP_TEST_COMPILATION_CACHE" not in os.environ
if _OWN_CACHE:  # the controller (or a run without xdist) makes it; workers inherit it
    os.environ["JMP_TEST_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="jmp-test-xla-cache-")
_CACHE_DIR = os.environ["JMP_TEST_COMPILATION_CACHE"]
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def pytest_unconfigure(config):
    if _OWN_CACHE:
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)


# Under ``jax_check_tracer_leaks`` every trace that outlives its ``del`` runs a full
# ``gc.collect()``, whose cost grows with everything alive in the worker: the libraries
# imported, the test modules, JAX's caches of every program traced so far. Measured: leak-checked
# tests ran 2-15x slower late in the suite than alone (``test_export_under_the_tracer_leak_check``
# 31 s against 2 s). What is alive after collection, and after each module, is frozen
# (``gc.freeze``: the collector no longer scans it), so a collection costs what the running
# test made. The leak check still sees every tracer a test makes: those are never frozen.
def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def _freeze_what_each_module_leaves():
    yield
    gc.collect()
    gc.freeze()


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


@pytest.fixture(autouse=True)
def _module_generators_seeded_per_test(request):
    """A test module's random generators (``RNG = np.random.default_rng(29)``, drawn from
    inside its tests) are re-seeded for each test from its node id: which tests an xdist
    worker happened to run before it no longer changes its inputs (a float8 error bound failed
    in one run and passed in others that way)."""
    module = request.module
    for name, value in list(vars(module).items()):
        if isinstance(value, np.random.Generator):
            seed = zlib.crc32(f"{request.node.nodeid}:{name}".encode())
            setattr(module, name, np.random.default_rng(seed))


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
