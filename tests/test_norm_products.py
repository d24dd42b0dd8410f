"""A normalization computes in float32 and is rounded to half once (``paint/norms.py``).

The centring ``x - mean``, the product by the statistic and the per-feature affine after it
run in float32 from the half activations, as TF's fused op and Flax's ``LayerNorm``/
``RMSNorm``/``BatchNorm``/``GroupNorm(dtype=half)`` compute them; the matmuls and activations
on either side keep TF's colours (half), and nothing spreads: the residual add after the norm
stays half. In ``rewrite(grad(f))`` the norm's backward pass (the cotangent's products by the
statistic and the scale, the statistic's cotangent, the sums into ``x``'s cotangent) is
float32 too. The numerics: the gradient of ``tanh(x @ w + b)`` read by an RMS norm (the
generator's ``grad-tanh-into-rms-norm``; ``benchmarks/numerics_norms.py``) is no worse than
the Flax-style hand-written half model, in both orders and both half dtypes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jaxpr_walk import all_eqns, float_in_dtypes, runs_in_half

import jmp_rewrite as jr

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

HALVES = pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
F32 = np.dtype(np.float32)
B, D, G = 8, 16, 4


def layer(h, s, b):
    mean = jnp.mean(h, -1, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), -1, keepdims=True)
    return (h - mean) * lax.rsqrt(var + 1e-5) * s + b


def rms(h, s, b):
    return h * lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * s


def batch(h, s, b):  # Flax's BatchNorm: statistics over the batch axis, scale folded in
    mean = jnp.mean(h, 0)
    var = jnp.mean(jnp.square(h), 0) - jnp.square(mean)
    return (h - mean) * (lax.rsqrt(var + 1e-5) * s) + b


def group(h, s, b):
    hg = h.reshape(B, G, D // G)
    mean = jnp.mean(hg, -1, keepdims=True)
    var = jnp.mean(jnp.square(hg - mean), -1, keepdims=True)
    return ((hg - mean) * lax.rsqrt(var + 1e-5)).reshape(B, D) * s + b


NORMS = pytest.mark.parametrize("norm", [layer, rms, batch, group], ids=lambda f: f.__name__)


def block(p, x, norm):
    w1, w2, s, b = p
    h = jnp.tanh(x @ w1)
    y = h + norm(h, s, b)  # the residual add after the norm
    return jnp.tanh(y @ w2)


def params(seed=0):
    rng = np.random.default_rng(seed)
    w = [jnp.asarray(rng.standard_normal((D, D)) / 4, jnp.float32) for _ in range(2)]
    s = jnp.asarray(1 + 0.1 * rng.standard_normal(D), jnp.float32)
    b = jnp.asarray(0.1 * rng.standard_normal(D), jnp.float32)
    x = jnp.asarray(rng.standard_normal((B, D)), jnp.float32)
    return [*w, s, b], x


def _readers_of(eqns, var):
    return [e for e in eqns if any(v is var for v in e.invars)]


def _normalizing_products(eqns):
    """The ``mul`` equations reading the statistic (the ``rsqrt``, through moves and
    ``rsqrt * scale``), and what reads the normalized value up to its first cast."""
    moves = {"broadcast_in_dim", "reshape", "convert_element_type", "mul"}
    found, todo = [], [e.outvars[0] for e in eqns if e.primitive.name == "rsqrt"]
    seen = set()
    while todo:
        v = todo.pop()
        for e in _readers_of(eqns, v):
            if id(e) in seen:
                continue
            seen.add(id(e))
            if e.primitive.name == "mul" and e.outvars[0].aval.size > v.aval.size:
                found.append(e)
            elif e.primitive.name in moves:
                todo.append(e.outvars[0])
    return found


@HALVES
@NORMS
def test_norm_products_run_in_float32_between_half_neighbours(norm, dtype):
    p, x = params()
    eqns = list(
        all_eqns(jax.make_jaxpr(jr.rewrite(lambda p, x: block(p, x, norm), dtype=dtype))(p, x))
    )
    products = _normalizing_products(eqns)
    assert products, "no product by the statistic found"
    for e in products:
        assert float_in_dtypes(e) == [F32, F32], e
    subs = [e for e in eqns if e.primitive.name == "sub" and e.outvars[0].aval.shape[-1] > 1]
    if norm is not rms:  # the centring x - mean: float32 everywhere
        assert subs and all(F32 in float_in_dtypes(e) and not runs_in_half(e) for e in subs)
    # the matmuls, the tanh before the norm and the residual add after it stay half
    for name in ("dot_general", "tanh"):
        assert all(runs_in_half(e) for e in eqns if e.primitive.name == name), name
    adds = [e for e in eqns if e.primitive.name == "add" and e.outvars[0].aval.shape == (B, D)]
    residual = [e for e in adds if all(getattr(v.aval, "shape", ()) == (B, D) for v in e.invars)]
    assert residual and all(runs_in_half(e) for e in residual)
    # the normalized output is rounded to half once, for its half readers
    down = [
        e
        for e in eqns
        if e.primitive.name == "convert_element_type"
        and e.outvars[0].aval.shape == (B, D)
        and np.dtype(e.params["new_dtype"]) == np.dtype(dtype)
        and np.dtype(e.invars[0].aval.dtype) == F32
    ]
    assert len(down) == 2, down  # the input x, and the normalized output


@HALVES
@pytest.mark.parametrize("norm", [layer, rms], ids=lambda f: f.__name__)
def test_norm_backward_in_float32_in_rewrite_of_grad(norm, dtype):
    """``rewrite(grad(f))``: the cotangent's products by the statistic are float32 too."""
    p, x = params()

    def loss(p, x):
        return jnp.mean(jnp.square(block(p, x, norm)))

    fun = jr.rewrite(jax.grad(loss), dtype=dtype)
    eqns = list(all_eqns(jax.make_jaxpr(fun)(p, x)))
    products = _normalizing_products(eqns)
    assert len(products) >= 2  # forward x * r, backward ct * r
    for e in products:
        assert float_in_dtypes(e) == [F32, F32], e
    assert all(runs_in_half(e) for e in eqns if e.primitive.name == "dot_general")


# --- numerics: benchmarks/numerics_norms.py's program, bounded by the hand-written half ----


def rms_model(p, x, dtype=None):
    w, b, g = p
    if dtype is not None:
        w, b, x = w.astype(dtype), b.astype(dtype), x.astype(dtype)
    h = jnp.tanh(x @ w + b)
    if dtype is not None:  # Flax's RMSNorm(dtype=dtype)
        h = h.astype(jnp.float32)
        y = (h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * g).astype(dtype)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))
    y = h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * g
    return jnp.mean(jnp.square(y))


def _error(a, truth):
    a = np.asarray(a, np.float64)
    return float(np.linalg.norm(a - truth) / np.linalg.norm(truth))


@HALVES
def test_norm_gradients_no_worse_than_hand_written(dtype):
    grad = jax.grad(rms_model)
    ways = {
        "rewrite(grad)": jr.rewrite(grad, dtype=dtype),
        "grad(rewrite)": jax.grad(jr.rewrite(rms_model, dtype=dtype)),
        "hand": jax.grad(lambda p, x: rms_model(p, x, dtype)),
    }
    errors = {k: [] for k in ways}
    for seed in range(8):
        rng = np.random.default_rng(seed)
        p = [
            jnp.asarray(rng.standard_normal((16, 16)) / 4, jnp.float32),
            jnp.asarray(0.1 * rng.standard_normal(16), jnp.float32),
            jnp.asarray(1 + 0.1 * rng.standard_normal(16), jnp.float32),
        ]
        x = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
        with jax.enable_x64(True):
            truth = grad([jnp.asarray(a, jnp.float64) for a in p], jnp.asarray(x, jnp.float64))
            truth = [np.asarray(t) for t in truth]
        for key, fun in ways.items():
            got = fun(p, x)
            errors[key].append([_error(got[i], truth[i]) for i in range(2)])
    median = {k: np.median(np.array(v), axis=0) for k, v in errors.items()}
    for key in ("rewrite(grad)", "grad(rewrite)"):  # dW and db
        assert np.all(median[key] <= 1.05 * median["hand"]), (key, median)
