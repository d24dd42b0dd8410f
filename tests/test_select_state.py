"""A select hands on the values it did not update unrounded: ``where``, ``lax.select``,
``select_n`` and a ``cond`` under ``vmap``.

Found by the generated programs (``test_oracle``'s ``vmap-cond-square-state``): under
``vmap`` a ``cond`` of a batched predicate runs both branches and selects their results with
``select_n``. TF's pass 5 paints a select half when a half op is next to it, so beside a
nonlinear update computed in half (``0.5 * s * s + 0.01 * (h @ w)``: no linear state) the
select was half and the state the ``cond`` did not update came back rounded to bfloat16 (a
``cond`` itself hands it on exact: ``test_round4_numerics``' item 8). A select now chooses as
a ``cond`` output does (``paint_additions.keep_float32_reads_unrounded``): it moves half
values only when every case that is a value hands it one; a case that is a program input or
a float32 value (a copy of an input, a loop carry handed on, ``exp(x)``) makes it float32
where it is read in float32, the update's half cases cast up after the matmul, exactly. Its
constant cases (a mask's fill) take its type: masked scores stay half.

Each spelling of the family updates the rows of a batch whose predicate holds and hands the
others on: those must be bit-exact, the updated rows as float32 computes them within half's
rounding, the outputs float32, and every matmul still in half, eager and under ``jit``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jaxpr_walk import emitted, prims, runs_in_half

import jmp_rewrite as jr

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

F32 = jnp.float32
HALF = pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])

B, N, D = 4, 8, 16
_RNG = np.random.default_rng(7)
W = jnp.asarray(_RNG.standard_normal((D, D)) / 4, F32)
W2 = jnp.asarray(_RNG.standard_normal((D, D)) / 4, F32)
#: rows 0 and 2 positive (their predicate holds: updated), rows 1 and 3 negative (handed on)
SIGNS = np.array([1.0, -1.0, 1.0, -1.0], np.float32)
X = jnp.asarray(np.abs(_RNG.standard_normal((B, N, D))) * SIGNS[:, None, None] + 0.0, F32)
S = jnp.asarray(_RNG.uniform(0.5, 1.5, (D,)), F32)  # an unbatched state
SB = jnp.asarray(_RNG.uniform(0.5, 1.5, (B, D)), F32)  # a state per batch row
UPDATED = SIGNS > 0


def _update(c: jax.Array, h: jax.Array) -> jax.Array:
    """A nonlinear step (no linear state: TF's colours) reading a half matmul; the add runs
    in half in both dtypes (pass 4: it reads the matmul's scaling)."""
    return (0.5 * c * c + 0.01 * (h[:1] @ W)).reshape(c.shape)


def _update2(c: jax.Array, h: jax.Array) -> jax.Array:
    return (0.3 * c * c + 0.02 * (h[1:2] @ W2)).reshape(c.shape)


def _holds(h: jax.Array) -> jax.Array:
    return jnp.mean(h) > 0.0


def _rows(x: jax.Array) -> jax.Array:
    return jnp.mean(x, axis=(1, 2)) > 0.0


def _where(x, s):
    new = jax.vmap(_update)(s, x)
    return jnp.where(_rows(x)[:, None], new, s)


def _where_scalar(x, s):  # one row, an unbatched state, a scalar predicate
    return jnp.stack([jnp.where(_holds(x[i]), _update(s, x[i]), s) for i in range(B)])


def _lax_select(x, s):
    new = jax.vmap(_update)(s, x)
    return lax.select(jnp.broadcast_to(_rows(x)[:, None], s.shape), new, s)


def _select_n(x, s):  # three cases: the state, two updates (case 2 where the row holds)
    which = jnp.broadcast_to(jnp.where(_rows(x), 2, 0)[:, None], s.shape)
    return lax.select_n(which, s, jax.vmap(_update2)(s, x), jax.vmap(_update)(s, x))


def _vmap_cond(x, s):  # the generator's: the state unbatched, the predicate batched
    return jax.vmap(lambda h: lax.cond(_holds(h), lambda c: _update(c, h), lambda c: c, s))(x)


def _vmap_cond_batched(x, s):
    def one(h, c):
        return lax.cond(_holds(h), lambda c: _update(c, h), lambda c: c, c)

    return jax.vmap(one)(x, s)


def _vmap_switch(x, s):  # three branches: select_n of three cases after batching
    def one(h):
        i = jnp.where(_holds(h), 2, 0)
        return lax.switch(i, [lambda c: c, lambda c: _update2(c, h), lambda c: _update(c, h)], s)

    return jax.vmap(one)(x)


def _vmap_scan_cond(x, s):  # a cond of a batched predicate inside a scan: a carried state
    def one(h):
        def body(c, _):
            return lax.cond(_holds(h), lambda c: _update(c, h), lambda c: c, c), None

        return lax.scan(body, s, None, length=3)[0]

    return jax.vmap(one)(x)


def _vmap_fori_computed_init(x, s):  # the carry enters computed in float32, not an input
    def one(h):
        body = lambda _, c: lax.cond(_holds(h), lambda c: _update(c, h), lambda c: c, c)  # noqa: E731
        return lax.fori_loop(0, 2, body, s * 2.0)

    return jax.vmap(one)(x) * 0.5  # exact: halves the doubled state back


def _while_where(x, s):
    def body(ic):
        i, c = ic
        return i + 1, jnp.where(_rows(x)[:, None], jax.vmap(_update)(c, x), c)

    return lax.while_loop(lambda ic: ic[0] < 2, body, (0, s))[1]


#: name -> (program, state, trips of the update on an updated row)
SPELLINGS: dict[str, tuple[Callable, jax.Array, int]] = {
    "where": (_where, SB, 1),
    "where_scalar": (_where_scalar, S, 1),
    "lax_select": (_lax_select, SB, 1),
    "select_n": (_select_n, SB, 1),
    "vmap_cond": (_vmap_cond, S, 1),
    "vmap_cond_batched_state": (_vmap_cond_batched, SB, 1),
    "vmap_switch": (_vmap_switch, S, 1),
    "vmap_scan_cond": (_vmap_scan_cond, S, 3),
    "vmap_fori_computed_init": (_vmap_fori_computed_init, S, 2),
    "while_where": (_while_where, SB, 2),
}


def _bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


@HALF
@JIT
@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_a_select_hands_the_state_it_did_not_update_on_exactly(dtype, jit, spelling):
    f, s, _ = SPELLINGS[spelling]
    rewritten = jr.rewrite(f, dtype=dtype)
    got = (jax.jit(rewritten) if jit else rewritten)(X, s)
    want = f(X, s)
    assert got.dtype == F32 and got.shape == want.shape == (B, D)
    kept = ~UPDATED
    np.testing.assert_array_equal(_bits(got[kept]), _bits(jnp.broadcast_to(s, (B, D))[kept]))
    # the updated rows: as float32 computes them, within half's rounding (not handed on)
    assert not np.array_equal(
        np.asarray(got[UPDATED]), np.asarray(jnp.broadcast_to(s, (B, D))[UPDATED])
    )
    np.testing.assert_allclose(got[UPDATED], want[UPDATED], rtol=3e-2, atol=3e-3)
    dots = prims(emitted(rewritten, X, s), "dot_general")
    assert dots and all(runs_in_half(d) for d in dots)  # the updates' matmuls still in half


@HALF
def test_vmap_of_the_rewrite_agrees(dtype):
    """``vmap(rewrite(f))`` sees a ``cond`` (item 8's rule) where ``rewrite(vmap(f))`` sees
    the select: both hand the untouched rows on, bit for bit the same."""

    def one(h, s):
        return lax.cond(_holds(h), lambda c: _update(c, h), lambda c: c, s)

    outer = jax.vmap(jr.rewrite(one, dtype=dtype), in_axes=(0, None))(X, S)
    inner = jr.rewrite(jax.vmap(one, in_axes=(0, None)), dtype=dtype)(X, S)
    kept = ~UPDATED
    np.testing.assert_array_equal(_bits(outer[kept]), _bits(inner[kept]))
    np.testing.assert_array_equal(_bits(inner[kept]), _bits(jnp.broadcast_to(S, (B, D))[kept]))


def _exp_program(x, w):
    """Item 8's program under vmap: ``exp(x)`` is float32 (deny in float16; infer reading no
    half value in bfloat16) and 162754.8 overflows float16: a select hands it on as is."""

    def one(h):
        y = lax.cond(jnp.mean(h) > 12.5, lambda h: h @ W2, lambda h: h, jnp.exp(h))
        return y @ w, y

    return jax.vmap(one)(x)


@HALF
@JIT
def test_a_float32_value_a_vmapped_cond_hands_on_comes_back_exact(dtype, jit):
    x = (
        jnp.full((B, 4, D), 12.0)
        + 0.01 * jnp.arange(D)
        + jnp.asarray([0.0, 1.0, 0.0, 1.0])[:, None, None]
    )
    rewritten = jr.rewrite(_exp_program, dtype=dtype)
    mm, y = (jax.jit(rewritten) if jit else rewritten)(x, jnp.eye(D))
    kept = np.array([True, False, True, False])  # mean 12.08 < 12.5: exp(x) handed on
    np.testing.assert_array_equal(_bits(y[kept]), _bits(jnp.exp(x)[kept]))
    assert y.dtype == F32
    dots = prims(emitted(rewritten, x, jnp.eye(D)), "dot_general")
    assert all(runs_in_half(d) for d in dots)  # y @ w still in half: the cast after the select


def _selects(fun, *args, shape) -> list:
    """The program's selects of that shape (not the emitter's own: a clamp's, a pin's)."""
    return [e for e in prims(emitted(fun, *args), "select_n") if e.outvars[0].aval.shape == shape]


@HALF
@pytest.mark.parametrize("fill", ["literal", "full", "captured"])
def test_a_mask_fill_takes_the_selects_type(dtype, fill):
    """A constant case is no value handed on: ``where(m, q @ k.T, -1e9)`` stays half beside
    its matmul (as TF paints Select), whatever spells the fill."""
    m = jnp.tril(jnp.ones((N, N), bool))
    captured = np.full((N, N), -1e4, np.float32)
    fills = {
        "literal": lambda s: -1e4,
        "full": lambda s: jnp.full(s.shape, -1e4, s.dtype),
        "captured": lambda s: captured,
    }

    def scores(q, k):
        s = q @ k.T
        return jnp.where(m, s, fills[fill](s))

    q = jnp.asarray(_RNG.standard_normal((N, D)), F32)
    rewritten = jr.rewrite(scores, dtype=dtype)
    (select,) = _selects(rewritten, q, q, shape=(N, N))
    assert runs_in_half(select)
    np.testing.assert_allclose(rewritten(q, q), scores(q, q), rtol=2e-2, atol=0.2)


@HALF
def test_a_select_of_half_values_stays_half(dtype):
    """Every case a half value (two matmuls): the select moves half values, as before."""

    def f(x, w):
        h = x[0]
        return jnp.where(_holds(h), h @ w, h @ W2) @ w

    rewritten = jr.rewrite(f, dtype=dtype)
    (select,) = _selects(rewritten, X, W, shape=(N, D))
    assert runs_in_half(select)
    assert rewritten(X, W).dtype == F32
