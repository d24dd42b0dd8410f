"""Issue 29: ``compare``'s numbers for a program's outputs, against the outputs themselves.

``compare`` runs the float32 and the rewritten program and reports, per output, the largest
relative error (``max|h - r| / max|r|``), the norm error (``||h - r|| / ||r||``), and counts
of overflow (finite in float32, infinite in half), underflow (non-zero in float32, zero in
half) and NaN. Here the same figures are computed from the outputs of ``f`` and of
``jax.jit(rewrite(f))`` -- another run of the same rewritten program -- with NumPy, for
programs built to have each: values that underflow float16 beside exact zeros (a ReLU), one
large error among small ones (the two errors then differ), overflow and NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_rewrite

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

RNG = np.random.default_rng(2929)
X = jnp.asarray(RNG.standard_normal((16, 32)), jnp.float32)
W = jnp.asarray(RNG.standard_normal((32, 32)) / 6, jnp.float32)


def tiny(x, w):
    """About half of the values exact zeros (the ReLU), the rest ~3e-8 x N(0, 1): in half
    precision (the scaling lies between two matmuls) many below float16's smallest
    subnormal (6e-8), some above."""
    return (jax.nn.relu(x @ w) * 3e-8) @ jnp.eye(32, dtype=jnp.float32)


@jmp_rewrite.float32_region
def _exact(x, w):
    return x @ w


@jmp_rewrite.float32_region
def _add_at_origin(y, e):
    return y.at[0, 0].add(e - y[0, 0] * 100.0)


def spike(x, w):
    """The product in float32 (a float32 region), one element plus 100 x (its half-precision
    value - its float32 value): the error sits in that element, so the max-relative error
    exceeds the norm error."""
    return _add_at_origin(_exact(x, w), (x @ w)[0, 0] * 100.0)


def overflow(x, w):
    """Beyond float16's range after a half product (finite in float32), and inf - inf."""
    a = (x @ w) * 3e4
    return a, a - a


def _figures(r: np.ndarray, h: np.ndarray) -> dict:
    r, h = r.astype(np.float64), h.astype(np.float64)
    fin = np.isfinite(r) & np.isfinite(h)
    d = np.where(fin, np.abs(h - r), 0.0)
    scale = np.where(np.isfinite(r), np.abs(r), 0.0)
    out = {
        "overflow": int(np.sum(np.isfinite(r) & np.isinf(h))),
        "underflow": int(np.sum(np.isfinite(r) & (r != 0) & (h == 0))),
        "nan": int(np.sum(np.isnan(h) & ~np.isnan(r))),
        "max_abs_f32": float(scale.max()),
    }
    if out["overflow"] or out["nan"] or np.any(np.isfinite(r) & ~np.isfinite(h)):
        out["rel_error"] = out["norm_error"] = np.inf
    else:
        out["rel_error"] = float(d.max() / (scale.max() + 1e-30))
        out["norm_error"] = float(np.linalg.norm(d) / (np.linalg.norm(scale) + 1e-30))
    return out


@pytest.mark.parametrize("fun", [tiny, spike, overflow], ids=["tiny", "spike", "overflow"])
def test_compare_outputs_figures_are_the_outputs(fun):
    report = jmp_rewrite.compare(fun, X, W, dtype=jnp.float16)
    want = jax.tree.leaves(jax.jit(fun)(X, W))
    got = jax.tree.leaves(jax.jit(jmp_rewrite.rewrite(fun, dtype=jnp.float16))(X, W))
    assert len(report.outputs) == len(want)
    for rec, r, h in zip(report.outputs, want, got, strict=True):
        fig = _figures(np.asarray(r), np.asarray(h))
        for name in ("overflow", "underflow", "nan"):
            assert getattr(rec, name) == fig[name], (rec.path, name, getattr(rec, name), fig)
        assert rec.max_abs_f32 == pytest.approx(fig["max_abs_f32"], rel=1e-12)
        for name in ("rel_error", "norm_error"):
            assert getattr(rec, name) == pytest.approx(fig[name], rel=1e-9), (rec.path, name)


def test_the_programs_show_what_they_are_built_for():
    """The figures above are not vacuous: underflow beside exact zeros, a max-relative error
    above the norm error, overflow and NaN."""
    r, h = (np.asarray(f(X, W)) for f in (tiny, jmp_rewrite.rewrite(tiny, dtype=jnp.float16)))
    fig = _figures(r, h)
    assert fig["underflow"] > 0 and np.sum(r == 0) > 0
    r, h = (np.asarray(f(X, W)) for f in (spike, jmp_rewrite.rewrite(spike, dtype=jnp.float16)))
    fig = _figures(r, h)
    assert fig["rel_error"] > 2 * fig["norm_error"] > 0
    outs = [np.asarray(a) for a in overflow(X, W)]
    half = [np.asarray(a) for a in jmp_rewrite.rewrite(overflow, dtype=jnp.float16)(X, W)]
    assert _figures(outs[0], half[0])["overflow"] > 0
    assert _figures(outs[1], half[1])["nan"] > 0
