"""Issue 28 item 2 and issue 29 family 6: big values, honest overflow.

A value a constant beyond the half range reaches through ops that keep its magnitude --
a mask fill, the bias built from it, a relative-position or ALiBi bias plus it, the scores
it is added to -- is *big* (``Origin.big``); in half precision its elements the constant put
out of range hold the half type's largest finite value with the constant's sign
(``masking``), whatever boundary it crossed and however the constant is spelled. A value
computed beyond the range (``exp(x) / 0.5``, a gradient through a mask bias) still
overflows, as in hand-written half precision, and the loss-scale optimizer still skips.

Each spelling, fill, boundary and model runs once, float16 and bfloat16, and both orders
of ``grad`` and ``rewrite``, taking turns (:func:`_cases`: the file stays cheap).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import mask_models as mm
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxpr_walk import all_eqns

import jmp_rewrite as jr

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

F16, BF16 = jnp.float16, jnp.bfloat16
ORDERS = pytest.mark.parametrize("order", ["grad_of_rewrite", "rewrite_of_grad"])
ORDER = ("grad_of_rewrite", "rewrite_of_grad")
F32_MIN = float(np.finfo(np.float32).min)
B, T, D = 3, 6, 8
# rows of the pair mask: a full row, a half-padded one, a fully padded one (all queries)
VALID = np.array([6, 3, 0])
AM = (np.arange(T)[None, :] < VALID[:, None]).astype(np.int32)
CAUSAL = np.tril(np.ones((T, T), np.float32))


def _rand(*shape: int, seed: int = 0, scale: float = 1.0) -> jax.Array:
    return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


WQ, WK, X = _rand(D, D, seed=1, scale=1.5), _rand(D, D, seed=2, scale=1.5), _rand(B, T, D, seed=3)
REL = _rand(2 * T - 1, seed=4, scale=0.5)


def _scores(wq, wk, x):
    """Scores in the tens: ``s - 65504`` rounds unevenly in float16, or overflows."""
    return jnp.einsum("btd,bsd->bts", x @ wq, x @ wk)


def _pos(rel):  # T5's learned relative-position bias (one head)
    return rel[jnp.arange(T)[None, :] - jnp.arange(T)[:, None] + T - 1]


# -- how the fill is spelled -------------------------------------------------------------------
def _literal(m, fill):
    return (1.0 - m) * fill


def _full(m, fill):  # issue 28 2d: a jnp.full array rather than a number
    return (1.0 - m) * jnp.full((T, T), fill)


def _broadcast(m, fill):
    return jnp.where(m > 0, 0.0, jnp.broadcast_to(jnp.asarray(fill, jnp.float32), m.shape))


def _select(m, fill):  # T5X: lax.select of zeros and a full fill
    return lax.select(m > 0, jnp.zeros(m.shape), jnp.full(m.shape, fill))


SPELLINGS = {"literal": _literal, "full": _full, "broadcast": _broadcast, "select": _select}
FILLS = {
    "finfo32": F32_MIN,
    "finfo16": float(np.finfo(np.float16).min),  # at the float16 limit: a fill there too
    "finfo_half": None,  # finfo of the half dtype the rewrite uses
    "minus_1e10": -1e10,
}


def _fill(name: str, dtype) -> float:
    return float(jnp.finfo(dtype).min) if FILLS[name] is None else FILLS[name]


# -- the boundaries the bias crosses ------------------------------------------------------------
def _through(boundary: str, fn):
    """``fn(m, rel)`` computed across ``boundary``."""
    if boundary == "plain":
        return fn
    if boundary == "jit":
        return jax.jit(fn)
    if boundary == "checkpoint":
        return jax.checkpoint(fn)
    if boundary == "cond":  # both branches frozen-or-big: the mask's bias either way
        return lambda m, rel: lax.cond(jnp.sum(m) >= 0, fn, lambda m, r: fn(m, r) * 1.0, m, rel)
    if boundary == "scan":
        return lambda m, rel: lax.scan(lambda c, _: (c, fn(m, rel)), 0.0, None, length=2)[1][-1]
    if boundary == "while":  # the bias recomputed in the body, carried out
        return lambda m, rel: lax.while_loop(
            lambda c: c[0] < 2, lambda c: (c[0] + 1, fn(m, rel)), (0, jnp.zeros(m.shape))
        )[1]
    if boundary == "custom_vjp":
        g = jax.custom_vjp(fn)
        g.defvjp(lambda m, rel: (fn(m, rel), (m, rel)), lambda res, ct: jax.vjp(fn, *res)[1](ct))
        return g
    assert boundary == "shard_map", boundary
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    return jax.shard_map(fn, mesh=mesh, in_specs=(P(), P()), out_specs=P())


BOUNDARIES = ("plain", "cond", "scan", "while", "jit", "checkpoint", "custom_vjp", "shard_map")


def _cases(names: str, rows: list[tuple]) -> pytest.MarkDecorator:
    """``rows`` each with a half dtype appended, float16 and bfloat16 by turns."""
    rows = [(*r, (F16, BF16)[i % 2]) for i, r in enumerate(rows)]
    ids = ["-".join(str(v) if not isinstance(v, type) else v.__name__ for v in r) for r in rows]
    return pytest.mark.parametrize(f"{names},dtype", rows, ids=ids)


def _attention(spelling: str, fill: float, boundary: str, relative: bool, mask: str = "int"):
    """softmax(scores + pos + mask bias): the bias built across ``boundary``; the mask an
    integer argument (frozen) or a float one (``valid_q * valid_k * causal``: not frozen)."""

    def bias(m, rel):
        b = SPELLINGS[spelling](m, fill)
        return b + _pos(rel) if relative else b

    inner = _through(boundary, bias)

    def f(wq, wk, x, rel, am):
        if mask == "int":
            m = (am[:, :, None] * am[:, None, :]).astype(jnp.float32)
        else:  # issue 28 2b: a float argument, multiplied in the program
            m = am[:, :, None] * am[:, None, :] * CAUSAL
        return jax.nn.softmax(_scores(wq, wk, x) + jax.vmap(inner, (0, None))(m, rel), axis=-1)

    return f


def _args(mask: str = "int"):
    return WQ, WK, X, REL, AM if mask == "int" else AM.astype(np.float32)


def _check(f, dtype, mask="int", edge=False):
    """Fully masked rows uniform as in float32, none non-finite, the rest close. An
    ``edge`` fill (``finfo(float16).min`` in float16) leaves float32's fully masked rows
    ``softmax(s - 65504)``, not uniform: pinned, they are uniform, as hand-written float16
    rounds them; only the queries with a key are compared."""
    args = _args(mask)
    ref = np.asarray(f(*args))
    out = np.asarray(jr.rewrite(f, dtype=dtype)(*args), np.float32)
    assert np.isfinite(ref).all()
    assert np.isfinite(out).all(), f"{int((~np.isfinite(out)).sum())} non-finite"
    np.testing.assert_allclose(out[2], np.full((T, T), 1 / T), rtol=1e-2)  # fully masked
    rows = AM.astype(bool) if edge else np.ones((B, T), bool)  # queries with a key
    tol = 0.1 if dtype == BF16 else 0.02  # scores ~10
    np.testing.assert_allclose(out[rows], ref[rows], atol=tol)


@_cases("boundary,relative", [(b, i % 3 != 0) for i, b in enumerate(BOUNDARIES)])
def test_every_boundary(boundary, relative, dtype):
    """Issue 28 2a/2c: the bias (a relative-position bias plus the mask's, or the mask's
    alone) crossing a boundary is big on both sides of it."""
    _check(_attention("select", F32_MIN, boundary, relative), dtype)


SPELLING_CASES = [  # float16 and bfloat16 by turns: each fill beyond the type's range
    ("literal", "finfo32", "int"),
    ("full", "finfo32", "float"),
    ("broadcast", "finfo16", "int"),  # float16's finfo.min: an edge fill
    ("select", "finfo_half", "float"),  # bfloat16's: an edge fill
    ("literal", "minus_1e10", "float"),
    ("broadcast", "finfo_half", "int"),
    ("full", "minus_1e10", "int"),
    ("select", "finfo32", "int"),
]


@_cases("spelling,fill,mask", SPELLING_CASES)
def test_every_spelling(spelling, fill, mask, dtype):
    """Issue 28 2b/2d: literal, ``jnp.full``, broadcast, select; either dtype's ``finfo``,
    ``-1e10``; an integer mask or a float argument."""
    value = _fill(fill, dtype)
    if abs(value) < float(jnp.finfo(dtype).max):
        raise AssertionError("the fill is within this half type's range: no case")
    edge = abs(value) == float(jnp.finfo(dtype).max)
    _check(_attention(spelling, value, "plain", True, mask), dtype, mask, edge)


@_cases("boundary", [("plain",), ("cond",), ("scan",)])
def test_an_infinite_fill_stays_what_float32_makes_it(boundary, dtype):
    """``-inf`` is no finite value beyond the range: fully masked rows NaN as in float32."""
    f = _attention("broadcast", -np.inf, boundary, True)
    ref = np.asarray(f(*_args()))
    out = np.asarray(jr.rewrite(f, dtype=dtype)(*_args()), np.float32)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    assert np.isnan(ref[2]).all()


@_cases(
    "order,boundary",  # no while: float32 has no reverse mode through it
    [(ORDER[i // 2 % 2], b) for i, b in enumerate(b for b in BOUNDARIES if b != "while")],
)
def test_gradients_across_boundaries(order, boundary, dtype):
    f = _attention("select", F32_MIN, boundary, True)
    v = _rand(B, T, T, seed=9)
    am = jnp.asarray(AM)  # a NumPy mask into a vmapped custom_vjp trips jax.make_jaxpr itself

    def loss(wq, wk, rel):
        return jnp.sum(f(wq, wk, X, rel, am) * v)

    ref = jax.grad(loss, argnums=(0, 1, 2))(WQ, WK, REL)
    if order == "grad_of_rewrite":
        got = jax.grad(jr.rewrite(loss, dtype=dtype), argnums=(0, 1, 2))(WQ, WK, REL)
    else:
        got = jr.rewrite(jax.grad(loss, argnums=(0, 1, 2)), dtype=dtype)(WQ, WK, REL)
    for g, r in zip(got, ref, strict=True):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(g, r, atol=0.05 * float(jnp.max(jnp.abs(r))))


# -- end to end: T5X-style and ALiBi encoders ---------------------------------------------------
TOLERANCE = {F16: (2e-3, 2e-2), BF16: (1e-2, 1.5e-1)}  # loss, gradients (relative)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not b.any():  # a gradient that is exactly zero (ALiBi's unused relative bias)
        return float(np.linalg.norm(a))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@_cases(
    "order,kind,fill",
    [
        ("grad_of_rewrite", "t5", F32_MIN),
        ("grad_of_rewrite", "alibi", -1e10),
        ("rewrite_of_grad", "alibi", F32_MIN),
        ("rewrite_of_grad", "t5", -1e10),
    ],
)
def test_encoders_end_to_end(order, kind, fill, dtype):
    """Issue 28 2a: loss and gradients of a two-layer encoder with padded rows, against
    float32 and within a small factor of hand-written half precision's error."""
    p = mm.init()

    def loss(p):
        return mm.loss(p, mm.TOKENS, mm.MASK, kind=kind, fill=fill)

    def hand(p):
        return mm.loss(p, mm.TOKENS, mm.MASK, kind=kind, dtype=dtype)

    l32, g32 = jax.value_and_grad(loss)(p)
    lh, gh = jax.value_and_grad(hand)(p)
    if order == "grad_of_rewrite":
        lr, gr = jax.value_and_grad(jr.rewrite(loss, dtype=dtype))(p)
    else:
        lr, gr = jr.rewrite(jax.value_and_grad(loss), dtype=dtype)(p)
    leaves = jax.tree.leaves(gr)
    assert np.isfinite(float(lr)) and all(np.isfinite(np.asarray(g)).all() for g in leaves)
    tol_loss, tol_grad = TOLERANCE[dtype]
    assert abs(float(lr) - float(l32)) <= tol_loss * abs(float(l32))
    for g, r, h in zip(leaves, jax.tree.leaves(g32), jax.tree.leaves(gh), strict=True):
        assert _rel(g, r) <= max(tol_grad, 3 * _rel(h, r)), (_rel(g, r), _rel(h, r))


def _bits(tree) -> bytes:
    return b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("kind", ["t5", "alibi"])
def test_rewrite_of_grad_of_an_encoder_does_not_depend_on_what_ran_before(kind):
    """Issue 36.5(b): an outside run saw non-finite ``rewrite(grad)`` gradients of the padded
    encoders in one process, finite ones on two workers. What that could depend on is run
    between two computations of the same gradients, which must be finite and bit-equal: a
    fresh ``rewrite`` of the same function (its caches keyed by ``id`` of objects freed and
    reused after garbage collection), other rewrites traced and freed in between, and the
    config flags another test may change (``jax_softmax_custom_jvp``,
    ``jax_default_matmul_precision``), set for an unrelated program and restored."""
    import gc

    p = mm.init()

    def loss(p):
        return mm.loss(p, mm.TOKENS, mm.MASK, kind=kind, fill=-1e10)

    def gradients():
        return jax.jit(jr.rewrite(jax.value_and_grad(loss), dtype=F16))(p)

    first = gradients()
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(first))
    other = lambda x: jax.nn.softmax(x @ x.T)  # noqa: E731
    for name, value in (
        ("jax_softmax_custom_jvp", not jax.config.jax_softmax_custom_jvp),
        ("jax_default_matmul_precision", "highest"),
    ):
        old = getattr(jax.config, name)
        jax.config.update(name, value)
        try:
            jax.grad(lambda x: jr.rewrite(other, dtype=F16)(x).sum())(jnp.ones((4, 4)))
        finally:
            jax.config.update(name, old)
    for _ in range(3):  # rewrites traced and freed: their ids are free for reuse
        jr.rewrite(jax.value_and_grad(loss), dtype=BF16)(p)
        gc.collect()
    assert _bits(gradients()) == _bits(first)


# -- issue 29 family 6: honest overflow -----------------------------------------------------------
ONE = jnp.ones((1, 1))


def _read_in_half(v):
    """``v`` through a matmul with one term per output: its output is its half operand."""
    return (v[..., None] @ ONE)[..., 0]


def test_a_computed_value_divided_by_a_literal_overflows():
    """``exp(x) / 0.5`` (x = 12) read in float16 overflows: 0.5 is no fill."""
    x = jnp.full((4, 4), 12.0)
    out = jr.rewrite(lambda x: _read_in_half(jnp.exp(x) / 0.5), dtype=F16)(x)
    assert np.isposinf(np.asarray(out)).all()


@pytest.mark.parametrize("boundary", ["plain", "jit", "cond"])
def test_a_computed_value_plus_a_mask_bias(boundary):
    """``exp(x) + (1 - m) * -1e9`` read in float16: ``inf`` where ``m = 1`` (``exp(12)``
    overflows, as by hand), the half type's largest finite value where the fill put it
    out of range (``m = 0``)."""
    x, m = jnp.full((4, 4), 12.0), jnp.asarray(np.eye(4, dtype=np.float32))
    bias = _through(boundary, lambda m, _: (1.0 - m) * -1e9)
    out = np.asarray(
        jr.rewrite(lambda x, m: _read_in_half(jnp.exp(x) + bias(m, 0.0)), dtype=F16)(x, m)
    )
    eye = np.eye(4, dtype=bool)
    assert np.isposinf(out[eye]).all()
    np.testing.assert_array_equal(out[~eye], -65504.0)


@ORDERS
def test_the_gradient_through_a_mask_bias_overflows(order):
    """float32 gives ~1e9 (times the cotangent): beyond float16, so the gradient overflows
    (a clamped 65504 would be finite and wrong, and loss scaling blind)."""
    w, x = jnp.eye(4) * 0.1, jnp.full((4, 4), 2.0)
    loss = lambda w, x: jnp.sum(x + (1.0 - jax.nn.sigmoid(x @ w)) * -1e9)  # noqa: E731
    ref = jax.grad(loss)(w, x)
    assert np.isfinite(ref).all() and float(jnp.max(jnp.abs(ref))) > 1e9
    if order == "grad_of_rewrite":
        got = jax.grad(jr.rewrite(loss, dtype=F16))(w, x)
    else:
        got = jr.rewrite(jax.grad(loss), dtype=F16)(w, x)
    assert np.isinf(np.asarray(got)).all()


@ORDERS
def test_the_gradient_through_a_clamped_fill_is_the_fills(order):
    """``d((1 - m) * -1e9)/dm`` is ``1e9`` times the cotangent, whatever half holds for the
    fill: with a cotangent of ``2**-20`` it is ~954 (float16 holds it), not the ``65504``
    of the clamped literal (times ``2**-20``: 0.06)."""
    w, x = jnp.eye(4) * 0.5, jnp.full((4, 4), 2.0)
    loss = lambda w, x: jnp.sum((1.0 - x @ w) * -1e9 * 2.0**-20)  # noqa: E731
    ref = jax.grad(loss)(w, x)
    if order == "grad_of_rewrite":
        got = jax.grad(jr.rewrite(loss, dtype=F16))(w, x)
    else:
        got = jr.rewrite(jax.grad(loss), dtype=F16)(w, x)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, ref, rtol=1e-2)


def test_an_overflowing_gradient_through_a_mask_bias_skips_the_step():
    """The same gradient under the loss-scale optimizer: the step is skipped."""
    w, x = jnp.eye(4) * 0.1, jnp.full((4, 4), 2.0)
    tx = jr.loss_scale_optimizer(optax.sgd(1e-3), jr.DynamicLossScale(initial_loss_scale=1.0))

    def loss(w):
        return jnp.sum(x + (1.0 - jax.nn.sigmoid(x @ w)) * -1e9)

    def step(w, opt_state):
        _, grads = jr.value_and_grad(loss)(opt_state, w)
        updates, opt_state = tx.update(grads, opt_state, w)
        return optax.apply_updates(w, updates), opt_state

    opt_state = tx.init(w)
    new, opt_state = jax.jit(jr.rewrite(step, dtype=F16))(w, opt_state)
    state = jr.get_loss_scale_state(opt_state)
    assert int(state.skipped_steps) == 1 and not bool(state.last_step_applied)
    np.testing.assert_array_equal(new, w)


def _fill_array(*shape: int, fill: float) -> jax.Array:  # a captured constant, not a literal
    return jnp.asarray(np.full(shape, fill, np.float32))


#: A fill moved (not cast) on its way into half: by every move, choice and call of moves
#: (``jnp.flip``, ``jnp.where`` are calls), each reading the captured fill itself.
MOVES = {
    "broadcast_in_dim": lambda f: jnp.broadcast_to(jnp.float32(f), (4, 4)),
    "reshape": lambda f: jnp.reshape(_fill_array(16, fill=f), (4, 4)),
    "transpose": lambda f: jnp.transpose(_fill_array(4, 4, fill=f)),
    "squeeze": lambda f: jnp.squeeze(_fill_array(1, 4, 4, fill=f), 0),
    "expand_dims": lambda f: lax.expand_dims(_fill_array(4, fill=f), (0,)),
    "slice": lambda f: _fill_array(8, 4, fill=f)[:4],
    "dynamic_slice": lambda f: lax.dynamic_slice(_fill_array(8, 4, fill=f), (2, 0), (4, 4)),
    "gather": lambda f: _fill_array(8, 4, fill=f)[jnp.arange(4)],
    "chain": lambda f: jnp.transpose(jnp.reshape(_fill_array(16, fill=f), (4, 4))),
    "concatenate": lambda f: jnp.concatenate([_fill_array(2, 4, fill=f)] * 2),
    "pad": lambda f: lax.pad(_fill_array(2, 4, fill=f), jnp.float32(f), ((1, 1, 0), (0, 0, 0))),
    "pad_by_zeros": lambda f: lax.pad(_fill_array(2, 4, fill=f), 0.0, ((1, 1, 0), (0, 0, 0))),
    "tile": lambda f: jnp.tile(_fill_array(1, 4, fill=f), (4, 1)),
    "flip_call": lambda f: jnp.flip(_fill_array(4, 4, fill=f), 0),
    "where_call": lambda f: jnp.where(jnp.eye(4) > 0, _fill_array(4, 4, fill=f), f),
}
#: Per half type, a fill beyond its range and a cotangent scale bringing the gradient back.
SATURATING = {F16: (-1e9, 2.0**-20), BF16: (F32_MIN, 2.0**-120)}


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("move", list(MOVES))
def test_the_gradient_through_a_moved_fill_is_the_fills(move, dtype):
    """``d((1 - x @ w) * move(fill))/dw`` reads the fill's float32 value, however it was moved
    into half: float16 gives ~7629 (as float32 does), not the ``0.4998`` of the clamped
    ``-65504`` (times ``2**-20``); bfloat16 likewise with ``finfo(float32).min``. A move hands
    the float32 value of the operand it moved on (``tangents.Unsaturated.hand_on``)."""
    fill, scale = SATURATING[dtype]
    w, x = jnp.eye(4) * 0.5, jnp.full((4, 4), 2.0)
    loss = lambda w, x: jnp.sum((1.0 - x @ w) * MOVES[move](fill) * scale)  # noqa: E731
    ref = jax.grad(loss)(w, x)
    assert np.isfinite(ref).all() and float(jnp.min(jnp.abs(ref))) > 1e3
    rtol = 4 * float(jnp.finfo(dtype).eps)
    got = jax.grad(jr.rewrite(loss, dtype=dtype))(w, x)
    np.testing.assert_allclose(got, ref, rtol=rtol)
    if move in ("broadcast_in_dim", "concatenate", "flip_call"):  # the other order, in turn
        np.testing.assert_allclose(jr.rewrite(jax.grad(loss), dtype=dtype)(w, x), ref, rtol=rtol)


#: A move and arithmetic of the fill and a computed value, inside a call or not.
MOVED_AND_ADDED = {
    "call": jax.jit(lambda m, x, w: jnp.flip(m, 0) + x @ w),
    "plain": lambda m, x, w: jnp.flip(m, 0) + x @ w,
}


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
def test_a_call_of_a_move_and_arithmetic_on_a_fill_is_no_move(dtype):
    """``(1 - x @ w) * jit(lambda m, x, w: jnp.flip(m, 0) + x @ w)(fill, x, w)``: the call
    holds a move of the fill and arithmetic, so it is no move (``tangents.hands_on``: a call
    of moves only). Its half result is the pinned sum and the derivative reading it reads
    that, as the same ops outside a call do and as ``rewrite(grad(f))`` does: the same
    gradient whatever the spelling and the order, no further from float32 than careful
    hand-written half (the fill at the type's largest finite value; float16: 0.4998 where
    float32 gives 7629), and no float32 matmul in the derivative (handed on as a move, the
    call would be re-bound in float32 for it, in one order and one spelling only)."""
    fill, scale = SATURATING[dtype]
    w, x = jnp.eye(4) * 0.5, jnp.full((4, 4), 2.0)

    def loss_of(inner, fill=fill, cast=lambda v: v):
        return lambda w, x: jnp.sum(
            (1.0 - cast(x) @ cast(w))
            * inner(cast(_fill_array(4, 4, fill=fill)), cast(x), cast(w))
            * scale
        ).astype(jnp.float32)

    loss = loss_of(MOVED_AND_ADDED["call"])
    grad_outer = jax.grad(jr.rewrite(loss, dtype=dtype))
    got = grad_outer(w, x)
    plain = jax.grad(jr.rewrite(loss_of(MOVED_AND_ADDED["plain"]), dtype=dtype))(w, x)
    inner = jr.rewrite(jax.grad(loss), dtype=dtype)(w, x)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, plain)
    np.testing.assert_array_equal(got, inner)
    ref = jax.grad(loss)(w, x)
    half_max = float(jnp.finfo(dtype).max)
    hand = jax.grad(loss_of(MOVED_AND_ADDED["call"], -half_max, lambda v: v.astype(dtype)))(w, x)
    err = lambda g: float(jnp.abs(g - ref).max())  # noqa: E731
    assert np.isfinite(np.asarray(got)).all() and err(got) <= err(hand) * (1 + 1e-3)
    jaxpr = jax.make_jaxpr(grad_outer)(w, x)
    dots = [e for e in all_eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert dots and all(v.aval.dtype == dtype for e in dots for v in e.invars)


def _summed_through(loop: bool, fill: float):
    """``sum_t (1 - x_t @ w) * big * 2**-20`` with ``big = x0 + (1 - m) * fill``: a big value
    computed from a float input (not frozen), read by a half ``mul`` on every trip of a
    ``scan`` (``loop``) or of the same steps unrolled."""
    m = jnp.asarray(np.random.default_rng(5).random((4, 4)) > 0.3, jnp.float32)

    def loss(w, x0, xs):
        big = x0 + (1.0 - m) * fill

        def step(h, x):
            return h + (1.0 - x @ w) * big * 2.0**-20, None

        h = jnp.zeros((4, 4))
        if loop:
            return jnp.sum(lax.scan(step, h, xs)[0])
        for x in xs:
            h, _ = step(h, x)
        return jnp.sum(h)

    return loss


def test_the_gradient_through_a_big_value_read_in_a_loop_is_the_unrolled_loops():
    """``grad(rewrite(f))`` with a computed big value (a float input plus a ``-1e9`` mask
    bias) read in half inside a ``scan``: its derivative reads the float32 value, as the
    same steps unrolled read it (``tangents``: a big value pinned into half is
    differentiated at its float32 value), and as ``rewrite(grad(f))`` of the scan does.
    Cast into half outside the loop (as it was), the scan's gradients of ``w`` and ``xs``
    were 1.0 off float32 (relative; ``w``'s ``[0, 0]`` -0.36 where float32 gives -5537,
    unrolled -5536); handed in as float32 and pinned by its readers inside: 9e-5 and 3e-4,
    as unrolled (3e-4) and ``rewrite(grad(f))`` (9e-5, 3e-4). (The forward overflows
    honestly, -inf, unrolled or not.)"""
    rng = np.random.default_rng(6)
    w = jnp.asarray(0.5 * rng.standard_normal((4, 4)), jnp.float32)
    x0 = jnp.asarray(rng.standard_normal((4, 4)), jnp.float32)
    xs = jnp.asarray(rng.standard_normal((5, 4, 4)), jnp.float32)
    looped, unrolled = _summed_through(True, -1e9), _summed_through(False, -1e9)
    ref = jax.grad(looped, argnums=(0, 2))(w, x0, xs)
    plain = jax.grad(jr.rewrite(unrolled, dtype=F16), argnums=(0, 2))(w, x0, xs)
    got = jax.grad(jr.rewrite(looped, dtype=F16), argnums=(0, 2))(w, x0, xs)
    for g, p, r in zip(got, plain, ref, strict=True):
        assert g.dtype == jnp.float32
        assert _rel(p, r) < 1e-2  # the unrolled steps: float32's gradient, rounded
        assert _rel(g, r) <= 2 * _rel(p, r) + 1e-3


def test_a_forward_pass_through_a_moved_fill_binds_no_float32_copy_of_it():
    """The float32 stand-in of a saturated fill moved by a concatenate is made only when a
    derivative reads it: a forward pass whose readers are a max and a sum binds no float32
    ``concatenate`` (and no float32 ``select_n``) and gives float32's value."""

    def f(x, w):
        s = x @ w
        t = jnp.concatenate([s, jnp.full((4, 2), -1e9)], axis=1)
        return jnp.max(t, axis=-1).sum()

    x, w = (
        jnp.asarray(np.random.default_rng(s).standard_normal((n, 8)), jnp.float32)
        for s, n in ((40, 4), (41, 8))
    )
    closed = jax.make_jaxpr(jr.rewrite(f, dtype=jnp.float16))(x, w)
    f32_moves = [
        str(e.primitive)
        for e in closed.jaxpr.eqns
        if str(e.primitive) in ("concatenate", "select_n")
        and any(getattr(o.aval, "dtype", None) == jnp.float32 for o in e.outvars)
    ]
    assert f32_moves == []
    np.testing.assert_allclose(jr.rewrite(f, dtype=jnp.float16)(x, w), f(x, w), rtol=1e-2)
