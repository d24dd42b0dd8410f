"""Custom derivatives JAX's own libraries ship, differentiated in both orders (issue 21, 3).

``jax.grad(rewrite(f))`` re-runs every ``custom_vjp``/``custom_jvp`` rule of ``f`` on the
rewritten program. The rule must be asked what the original is asked, no more: only about
the arguments that are perturbed (never the values the function closes over, which JAX
refuses for a ``custom_vjp``: odeint's Runge-Kutta tableau raised ``CustomVJPException``),
and never about arguments a rule asserts are not perturbed (Equinox). Each case is checked
against ``jax.grad(f)`` in float32 in both orders, float16 and bfloat16, with and without
``jax.jit``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.experimental.ode import odeint

import jmp_rewrite as jr

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

F16, BF16 = jnp.float16, jnp.bfloat16
DTYPES = pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
#: Relative error of the gradient vs float32 allowed: half of compare's default tolerance
#: (1e-2 / 5e-2); measured at most 1.1e-3 (float16) and 8.2e-3 (bfloat16).
TOL = {F16: 5e-3, BF16: 2.5e-2}

_K = jax.random.split(jax.random.key(0), 2)
W = 0.3 * jax.random.normal(_K[0], (8, 8))
X = jax.random.normal(_K[1], (4, 8))
LABELS = jax.nn.one_hot(jnp.arange(4) % 8, 8)
SCALES = jnp.linspace(0.5, 1.5, 8)  # an array a custom_vjp closes over


def _ode(w, x):
    ys = odeint(lambda y, t, w: jnp.tanh(y @ w), x, jnp.array([0.0, 0.5]), w)
    return jnp.sum(ys[-1] ** 2)


def _checkpointed(policy: Any) -> Callable[..., Any]:
    def loss(w, x):
        f = jax.checkpoint(lambda z: jnp.tanh(z @ w) @ w, policy=policy)
        return jnp.sum(f(x) ** 2)

    return loss


def _root(w, x):
    h = x @ w

    def solve(g, y):
        return lax.fori_loop(0, 30, lambda i, y: y - g(y), jnp.zeros_like(h))

    f = lambda y: y - 0.5 * jnp.tanh(y) - h  # noqa: E731
    return jnp.sum(lax.custom_root(f, jnp.zeros_like(h), solve, lambda g, y: y) ** 2)


def _linear_solve(w, x):
    a = jnp.eye(8) * 2.0 + 0.1 * (w @ w.T)
    solve = lambda mv, v: jnp.linalg.solve(a.T, v.T).T  # noqa: E731
    return jnp.sum(lax.custom_linear_solve(lambda v: v @ a, x @ w, solve, symmetric=True) ** 2)


def _activation(fn: Callable[[Any], Any]) -> Callable[..., Any]:
    return lambda w, x: jnp.sum(fn(x @ w) @ w)


def _logits(w, x):
    return jnp.tanh(x @ w) @ w


@functools.partial(jax.custom_vjp)
def _closes_over_array(h):
    return jnp.tanh(h) * SCALES


# 3 * the true derivative: a test that differentiated the body instead would see it
_closes_over_array.defvjp(
    lambda h: (_closes_over_array(h), h), lambda h, g: (3 * (1 - jnp.tanh(h) ** 2) * SCALES * g,)
)


@eqx.filter_custom_vjp
def _eqx_scaled(h, scale, name):
    del name
    return jnp.tanh(h) * scale


@_eqx_scaled.def_fwd
def _eqx_fwd(perturbed, h, scale, name):
    return _eqx_scaled(h, scale, name), h


@_eqx_scaled.def_bwd
def _eqx_bwd(res, g, perturbed, h, scale, name):
    # Equinox asserts that ``scale`` (not the vjp argument) is not perturbed
    return 3 * (1 - jnp.tanh(res) ** 2) * scale * g


CASES: dict[str, Callable[..., Any]] = {
    "odeint": _ode,
    "checkpoint-nothing_saveable": _checkpointed(jax.checkpoint_policies.nothing_saveable),
    "checkpoint-dots_saveable": _checkpointed(jax.checkpoint_policies.dots_saveable),
    "checkpoint-dots_no_batch": _checkpointed(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    ),
    "custom_root": _root,
    "custom_linear_solve": _linear_solve,
    "relu": _activation(jax.nn.relu),
    "silu": _activation(jax.nn.silu),
    "softplus": _activation(jax.nn.softplus),
    "logsumexp": _activation(lambda h: jax.nn.logsumexp(h, axis=-1, keepdims=True) * h),
    "optax-softmax_cross_entropy": lambda w, x: jnp.mean(
        optax.softmax_cross_entropy(_logits(w, x), LABELS)
    ),
    "optax-scale_gradient": lambda w, x: jnp.sum(jnp.tanh(optax.scale_gradient(x @ w, 0.5)) @ w),
    "optax-projection_simplex": lambda w, x: jnp.sum(
        jax.vmap(optax.projections.projection_simplex)(x @ w) @ w
    ),
    "custom_vjp-closing-over-array": _activation(_closes_over_array),
    "equinox-filter_custom_vjp": lambda w, x: jnp.sum(_eqx_scaled(x @ w, jnp.cos(x[0]), "s") @ w),
}


def _rel(got: Any, ref: Any) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


@DTYPES
@pytest.mark.parametrize("name", list(CASES))
def test_gradient_in_both_orders(name, dtype):
    loss = CASES[name]
    ref = jax.grad(loss)(W, X)
    variants = {
        "grad(rewrite)": jax.grad(jr.rewrite(loss, dtype=dtype)),
        "rewrite(grad)": jr.rewrite(jax.grad(loss), dtype=dtype),
    }
    for order, fun in variants.items():
        for jit in (False, True):
            got = (jax.jit(fun) if jit else fun)(W, X)
            assert got.dtype == jnp.float32
            err = _rel(got, ref)
            assert err <= TOL[dtype], f"{order} jit={jit}: {err:.3g} off float32"


@DTYPES
def test_odeint_matmul_runs_in_half_and_rule_is_kept(dtype, leak_checking):
    # grad(rewrite(odeint)) raised CustomVJPException: the re-wrapped rule was asked about
    # the tableau the solver closes over. The dynamics' matmul runs in half.
    got = jax.grad(jr.rewrite(_ode, dtype=dtype))(W, X)
    assert _rel(got, jax.grad(_ode)(W, X)) <= TOL[dtype]
    p = jr.paint(jax.grad(_ode), W, X, dtype=dtype)
    assert any(e.half for e in p.find("dot_general"))


def test_closing_over_a_differentiated_value_is_refused_as_jax_does():
    def loss(w, x):
        d = jnp.cos(x[0])

        @jax.custom_vjp
        def f(h):
            return jnp.tanh(h) + d

        f.defvjp(lambda h: (f(h), h), lambda h, g: ((1 - jnp.tanh(h) ** 2) * g,))
        return jnp.sum(f(x @ w) @ w)

    with pytest.raises(Exception, match="closed-over value|unexpected tracer"):
        jax.grad(loss, argnums=1)(W, X)  # JAX refuses it too
    with pytest.raises(ValueError, match="closes over a value that is being differentiated"):
        jax.grad(jr.rewrite(loss, dtype=F16), argnums=1)(W, X)


def test_rules_reading_an_intermediate_are_a_clear_error():
    # JAX cannot run such a rule once the function is traced (its own jaxpr round trip fails
    # the same way); the message says what to do. rewrite(grad(f)) works.
    def loss(w, x):
        d = jnp.cos(x[0])

        @jax.custom_vjp
        def f(h):
            return jnp.tanh(h) * d

        f.defvjp(lambda h: (f(h), h), lambda h, g: ((1 - jnp.tanh(h) ** 2) * d * g,))
        return jnp.sum(f(x @ w) @ w)

    with pytest.raises(ValueError, match="reads a value computed inside"):
        jax.grad(jr.rewrite(loss, dtype=F16))(W, X)
    got = jr.rewrite(jax.grad(loss), dtype=F16)(W, X)
    assert _rel(got, jax.grad(loss)(W, X)) <= TOL[F16]
