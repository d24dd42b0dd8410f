"""Issue 22: a state update with leading axes added to its state, and biases that are none.

``rewrite(vmap(step))`` with the state unbatched (``[D]`` in, ``[B, D]`` out) and a ``scan``
stacking per-step updates as its ``ys`` (``[D]`` in, ``[T, D]`` out) update an input whose
shape the output has with leading axes added. Each element is still the state updated, so
it must stay float32 (``origins.updates_state``); before the fix it was rounded in half and
drifted (bfloat16: the change ~0.4 off float32 where hand-written half is ~0.003).

A bias broadcast onto activations (``x @ w + b``, batch and layer norm's offset) is as
linear in ``b`` and of the same shapes: it is told apart by the step size that scales a
state's update *at its top* (``paint_additions.stepped``: a literal or scalar factor of the
increment, or of the state itself). A norm's or a dense layer's increment has a factor that
spans the bias's axes (``(x - mean) * inv * scale``) or is a matmul: no state, the
activations stay half. The first fix searched the increment's whole upstream for a step and
took batch norm's ``mean = sum / n`` for one (``test_memory_parity``'s ResNet block).

Numerics are judged as in ``tests/test_state_in_loops.py``: the rewrite is never further
from float32 than a hand-written half-precision version of the same program (matmuls in
half, state and updates in float32), here on the *change* of the state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from test_state_in_loops import DTYPES, assert_not_worse, f32

import jmp_rewrite

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

D, N, B = 16, 8, 3  # features, rows per example, leading axis (batch or scan steps)
W = f32(40, D, D, scale=0.25)
V = f32(41, D, D, scale=0.25)
HALF = (jnp.float16, jnp.bfloat16)


def _cast(half: Any) -> Callable[[jax.Array], jax.Array]:
    """Hand-written half precision casts matmul operands; ``None``: the float32 program."""
    return (lambda a: a) if half is None else (lambda a: a.astype(half))


def _matmul(a: jax.Array, b: jax.Array, half: Any) -> jax.Array:
    c = _cast(half)
    return (c(a) @ c(b)).astype(jnp.float32)


def _loss(p: dict[str, jax.Array], x: jax.Array, half: Any) -> jax.Array:
    c = _cast(half)  # by hand: the activations in half too, the loss in float32
    h = jnp.tanh(c(x) @ c(p["w"])) + c(p["b"])
    y = (h @ c(V)).astype(jnp.float32)
    return jnp.mean(y * y)


def _params() -> dict[str, jax.Array]:
    return {"w": W, "b": f32(42, D) + 2.0}  # values 0.1-2, changes 1e-4-1e-3


# ------------------------------------------------------------------------------------------
# The family: one step of each update, (state, x, half) -> new state
# ------------------------------------------------------------------------------------------


def _moments(seed: int) -> dict[str, jax.Array]:
    """Adam's moments after some steps: a first step from zero moments is sign descent,
    which turns the rounding of a gradient near zero into a flipped sign."""
    return jax.tree.map(lambda p: 1e-2 * f32(seed, *p.shape), _params())


def _optax(opt: optax.GradientTransformation) -> tuple[Callable, Callable]:
    def step(state, x, half):
        p, o = state
        u, o = opt.update(jax.grad(_loss)(p, x, half), o, p)
        return optax.apply_updates(p, u), o

    def init():
        nu = jax.tree.map(jnp.square, _moments(49))
        o = opt.init(_params())
        return _params(), _with_moments(o, _moments(48), nu)

    return step, init


def _with_moments(o: Any, mu: Any, nu: Any) -> Any:
    """Optax's state ``o`` with its ``ScaleByAdamState`` holding ``mu``, ``nu`` (count 10)."""
    if hasattr(o, "mu") and hasattr(o, "nu"):
        return o._replace(count=jnp.asarray(10, jnp.int32), mu=mu, nu=nu)
    if isinstance(o, tuple) and not hasattr(o, "_fields"):
        return tuple(_with_moments(s, mu, nu) for s in o)
    return o


def _sgd(state, x, half):
    g = jax.grad(_loss)(state, x, half)
    return jax.tree.map(lambda p, g: p - 1e-2 * g, state, g)


def _adam_by_hand(state, x, half):  # the oracle's: the step size inside the quotient
    p, mu, nu = state
    g = jax.grad(_loss)(p, x, half)
    mu = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, mu, g)
    nu = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, nu, g)
    p = jax.tree.map(lambda p, m, v: p - 1e-3 * m / (jnp.sqrt(v) + 1e-8), p, mu, nu)
    return p, mu, nu


def _sgd_on_a_statistic(state, x, half):  # the oracle's: no gradient, a step still
    return state - 1e-2 * jnp.mean(jnp.tanh(_matmul(x, W, half)), 0)


def _momentum_on_a_statistic(state, x, half):  # a heavy-ball buffer: m * buf + g; no
    return 0.9 * state + jnp.sum(jnp.tanh(_matmul(x, W, half)), 0)  # step but the decay


def _ema(state, x, half):  # a running statistic: m * old + (1 - m) * stat
    return 0.99 * state + 0.01 * jnp.mean(jnp.tanh(_matmul(x, W, half)), 0)


def _rk4(state, x, half):  # an ODE state: y + dt / 6 * (k1 + 2 k2 + 2 k3 + k4)
    dt, force = 0.05, jnp.mean(x, 0)

    def f(y):
        return jnp.tanh(_matmul(y, W, half)) - 0.5 * y + force

    k1 = f(state)
    k2 = f(state + dt / 2 * k1)
    k3 = f(state + dt / 2 * k2)
    k4 = f(state + dt * k3)
    return state + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)


UPDATES: dict[str, tuple[Callable, Callable]] = {
    "sgd": (_sgd, _params),
    "momentum": _optax(optax.sgd(1e-2, momentum=0.9)),
    "adam": _optax(optax.adam(1e-3)),
    "adamw": _optax(optax.adamw(1e-3, weight_decay=1e-2)),
    "adam_by_hand": (
        _adam_by_hand,
        lambda: (_params(), _moments(48), jax.tree.map(jnp.square, _moments(49))),
    ),
    "sgd_on_a_statistic": (_sgd_on_a_statistic, lambda: f32(43, D) + 1.0),
    "momentum_on_a_statistic": (_momentum_on_a_statistic, lambda: f32(43, D) + 100.0),
    "ema": (_ema, lambda: f32(43, D) + 1.0),
    "rk4": (_rk4, lambda: f32(44, D) + 1.0),
}


def _batched(step: Callable, half: Any, form: str) -> Callable:
    """``(state, xs) -> new states``, ``[B, ...]`` each: the step vmapped with the state
    unbatched, or scanned over ``xs`` with the state closed over and its updates stacked."""

    def one(state, x):
        return step(state, x, half)

    if form == "scan_ys":
        return lambda state, xs: lax.scan(lambda _, x: (None, one(state, x)), None, xs)[1]
    return jax.vmap(one, in_axes=(None, 0))


def _rewritten(step: Callable, dtype: Any, form: str) -> Callable:
    if form == "vmap_rewrite":  # the rewrite sees the unbatched step: the same-shape rule
        return jax.vmap(jmp_rewrite.rewrite(lambda s, x: step(s, x, None), dtype=dtype), (None, 0))
    return jmp_rewrite.rewrite(_batched(step, None, form), dtype=dtype)


def _changes(new: Any, old: Any) -> list[jax.Array]:
    """The float leaves of ``new - old`` (``old`` broadcast along the leading axis)."""
    pairs = zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True)
    return [n - o for n, o in pairs if jnp.issubdtype(n.dtype, jnp.floating)]


def _producers(fn: Callable, *args: Any) -> list[Any]:
    """For each output of ``fn``'s jaxpr, the equation computing it, looking into the
    ``jit`` and ``scan`` equations that hand it out (None: an input handed on)."""

    def find(jaxpr, var):
        for eqn in jaxpr.eqns:
            if var in eqn.outvars:
                inner = eqn.params.get("jaxpr")
                if inner is None:
                    return eqn
                inner = getattr(inner, "jaxpr", inner)
                return find(inner, inner.outvars[eqn.outvars.index(var)])
        return None

    closed = jax.make_jaxpr(fn)(*args)
    return [find(closed.jaxpr, v) for v in closed.jaxpr.outvars]


def _rounded(eqn: Any) -> bool:
    """Whether an output comes from a cast out of half precision: computed in half."""
    if eqn is None or eqn.primitive.name != "convert_element_type":
        return False
    return eqn.invars[0].aval.dtype in HALF


FORMS = pytest.mark.parametrize("form", ["rewrite_vmap", "vmap_rewrite", "scan_ys"])


@DTYPES
@FORMS
@pytest.mark.parametrize("update", list(UPDATES))
def test_a_state_update_with_leading_axes_stays_float32(dtype, form, update):
    """Every step of the family, batched with the state unbatched or stacked by a scan,
    updates its state (parameters, optimizer moments, a running statistic, an ODE state) in
    float32: no output is computed in half, the change is as close to float32 as by hand,
    and the matmuls stay half. Before the fix, in bfloat16, the change of an SGD step on a
    statistic was 1.1 off float32 (by hand 0.002), an EMA's 0.18 (0.0005), an RK4 step's
    0.07 (0.002); steps on gradients stayed float32 by TF's colours, their sums float32."""
    step, init = UPDATES[update]
    state, xs = init(), f32(45, B, N, D)
    ref = _batched(step, None, form)(state, xs)
    hand = _batched(step, dtype, form)(state, xs)
    got = _rewritten(step, dtype, form)(state, xs)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), got) == jax.tree.map(
        lambda a: (a.shape, a.dtype), ref
    )
    assert_not_worse(_changes(got, state), _changes(hand, state), _changes(ref, state), update)
    if form != "vmap_rewrite":
        f = _batched(step, None, form)
        producers = _producers(jmp_rewrite.rewrite(f, dtype=dtype), state, xs)
        assert not any(_rounded(e) for e in producers), update
        report = jmp_rewrite.explain(f, state, xs, dtype=dtype)
        dots = [e for e in report.equations if e.primitive == "dot_general"]
        assert dots and all(e.half for e in dots)
        kept = [e for e in report.equations if e.painted_by == "keep_state_updates_float32"]
        assert any(e.primitive in ("add", "sub") for e in kept)


@pytest.mark.parametrize("form", ["rewrite_vmap", "scan_ys"])
@pytest.mark.parametrize("update", ["ema", "rk4", "adam"])
def test_a_state_update_with_leading_axes_stays_float32_under_jit(form, update):
    """The same, the rewrite called under ``jax.jit`` (bfloat16)."""
    step, init = UPDATES[update]
    state, xs = init(), f32(46, B, N, D)
    ref = _batched(step, None, form)(state, xs)
    hand = _batched(step, jnp.bfloat16, form)(state, xs)
    got = jax.jit(_rewritten(step, jnp.bfloat16, form))(state, xs)
    assert_not_worse(_changes(got, state), _changes(hand, state), _changes(ref, state), update)


@DTYPES
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_step_size_per_batch_element_is_a_step_size(dtype, jit):
    """``vmap`` over learning rates from one state (a sweep's first step): the step size is
    ``[B, 1]`` against ``[B, D]``, one value per batch element: a step still, float32."""

    def step(s, x, lr, half=None):
        return s - lr * jnp.mean(jnp.tanh(_matmul(x, W, half)), 0)

    s, xs, lrs = f32(47, D) + 1.0, f32(48, B, N, D), jnp.asarray([1e-2, 3e-3, 1e-3])
    batched, axes = jax.vmap(step, (None, 0, 0)), (None, 0, 0)
    rewritten = jmp_rewrite.rewrite(batched, dtype=dtype)
    got = (jax.jit(rewritten) if jit else rewritten)(s, xs, lrs)
    ref = batched(s, xs, lrs)
    hand = jax.vmap(lambda s, x, lr: step(s, x, lr, dtype), axes)(s, xs, lrs)
    assert_not_worse(got - s, hand - s, ref - s, "sgd with a step size per element")
    assert not any(_rounded(e) for e in _producers(rewritten, s, xs, lrs))


# ------------------------------------------------------------------------------------------
# Not states: biases and norm offsets broadcast onto activations
# ------------------------------------------------------------------------------------------

X4 = f32(50, B, 6, 6, 8)  # NHWC
WC = f32(51, 3, 3, 8, 8, scale=0.2)
X = f32(52, B, N, D)
BIAS, GAMMA = f32(53, D), f32(54, D) + 1.0


def _conv(x, w):
    return lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def _bn_by_hand(x, w, scale, offset):
    h = _conv(x, w)
    mean = jnp.mean(h, axis=(0, 1, 2))
    var = jnp.mean(jnp.square(h - mean), axis=(0, 1, 2))
    return (h - mean) * lax.rsqrt(var + 1e-5) * scale + offset


_BN, _LN = nn.BatchNorm(use_running_average=False), nn.LayerNorm()
_BN_VARS = _BN.init(jax.random.PRNGKey(0), X4)
_LN_VARS = _LN.init(jax.random.PRNGKey(0), X)


def _bn_linen(x, w, variables):  # training mode: the running statistics are states
    return _BN.apply(variables, _conv(x, w), mutable=["batch_stats"])


def _ln_linen(x, w, variables):
    return _LN.apply(variables, x @ w)


BIASES = {
    "bn_by_hand": (_bn_by_hand, (X4, WC, GAMMA[:8], BIAS[:8])),
    "bn_linen": (_bn_linen, (X4, WC, _BN_VARS)),
    "ln_linen": (_ln_linen, (X, W, _LN_VARS)),
    "dense": (lambda x, w, b: x @ w + b, (X, W, BIAS)),
    "dense_vmapped": (lambda x, w, b: jax.vmap(lambda x: x @ w + b)(x), (X, W, BIAS)),
    "dense_stacked": (
        lambda x, w, b: lax.scan(lambda _, x: (None, jnp.tanh(x @ w) + b), None, x)[1],
        (X, W, BIAS),
    ),
    "scaled_by_an_array": (lambda x, w, b: jnp.tanh(x @ w) * GAMMA + b, (X, W, BIAS)),
}


@DTYPES
@pytest.mark.parametrize("layer", list(BIASES))
def test_a_bias_broadcast_onto_activations_is_no_state(dtype, layer):
    """A bias or a norm's offset, of the output's trailing shape, added to activations with
    no step size at the top (a matmul; a factor spanning the bias's axes, as batch and layer
    norm's ``(x - mean) * inv * scale``) is no state: the add runs in half, as TF's colours
    paint it, and the activations come out of half precision (a norm written out computes its
    affine in float32 with it, as a fused norm does). (Linen's batch norm in
    training mode still updates its running statistics in float32: those are states.)"""
    f, args = BIASES[layer]
    report = jmp_rewrite.explain(f, *args, dtype=dtype)
    act = (B, 6, 6, 8) if layer.startswith("bn") else (N, D) if "stacked" in layer else X.shape
    adds = [e for e in report.equations if e.primitive == "add" and e.out_shapes[0] == act]
    # A normalization's affine is computed in float32 with it (compute_normalizations_float32,
    # as TF's fused norm and Flax do) and rounded once for half readers: no state either.
    norm = [e for e in adds if e.painted_by == "compute_normalizations_float32"]
    assert adds and all(e.half or e in norm for e in adds), [(e.path, e.painted_by) for e in adds]
    rewritten = jmp_rewrite.rewrite(f, dtype=dtype)
    producers = _producers(rewritten, *args)
    assert norm or _rounded(producers[0])  # the activations
    kept = [e for e in report.equations if e.painted_by == "keep_state_updates_float32"]
    if layer == "bn_linen":  # the running mean and variance: 0.99 * old + 0.01 * stat
        assert len(kept) >= 4 and not any(_rounded(e) for e in producers[1:])
        assert all(e.out_shapes[0] == (8,) for e in kept)
    else:
        assert not kept
    got, ref = jax.tree.leaves(rewritten(*args)), jax.tree.leaves(f(*args))
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, r, atol=0.1 * float(jnp.abs(r).max()))


@DTYPES
@pytest.mark.parametrize(
    "layer",
    [
        lambda x, w, b: 0.5 * jnp.tanh(x @ w) + b,
        lambda x, w, b: nn.LayerNorm(use_scale=False).apply({"params": {"bias": b}}, x @ w),
    ],
    ids=["scalar_scale", "layer_norm_without_scale"],
)
def test_a_bias_on_activations_scaled_by_a_step_like_factor_is_read_as_a_state(dtype, layer):
    """The residual ambiguity, pinned: a bias added to activations scaled by a literal or a
    value per row (``0.5 * act + b``, ``(x - mean) * rsqrt(var) + b``), the sum a program
    output, is shaped exactly as a batched step (``s - lr * g``) and kept float32 as one.
    Only that add and a scaling by a literal are float32: the matmul and what precedes it
    stay half, and the output is no less accurate."""
    report = jmp_rewrite.explain(layer, X, W, BIAS, dtype=dtype)
    kept = {e.primitive for e in report.equations if e.painted_by == "keep_state_updates_float32"}
    assert "add" in kept and kept <= {"add", "mul", "broadcast_in_dim", "reshape"}
    dots = [e for e in report.equations if e.primitive == "dot_general"]
    assert dots and all(e.half for e in dots)
    got, ref = jmp_rewrite.rewrite(layer, dtype=dtype)(X, W, BIAS), layer(X, W, BIAS)
    np.testing.assert_allclose(got, ref, atol=0.05 * float(jnp.abs(ref).max()))
