"""Issue 17: every rule that decides a dtype has a test that fails when the rule breaks.

Each test below was written against a bug that once passed the whole suite (the issue's
numbered items; ``tools/mutant_list.py`` keeps them as mutants). They assert what a user
sees: output values and dtypes, and which equations of the emitted program run in half
precision -- not how the painter got there -- so they keep their meaning when the passes
change.

1. "Already half" and "is it float32" look at every operand and keep a requested float32
   output: a bfloat16 matmul with ``preferred_element_type=float32`` in a float16 rewrite
   stays as written.
2. A user's cast to float32 goes half only when *every* reader is half.
3. A cast whose value is an output stays float32, at every level (``UNSAFE_FORCE_ALL``
   included).
4. Constants -- literals, captured arrays, values computed from them -- are clamped to the
   half range, not turned into infinities (a fully masked softmax row stays finite); an
   infinite constant stays infinite.
5. Gradients through gathers and broadcasts accumulate in float32 in both orders,
   ``jax.grad(rewrite(f))`` and ``rewrite(jax.grad(f))``.
7. The centring ``x - mean`` of a normalization statistic stays float32 in bfloat16.

Plus ``lax.custom_linear_solve``: its bodies are rewritten like any other sub-jaxpr.
(Item 6, the op lists, is tested against TF's lists in test_op_lists.py; item 8, the loss
scale reaching ``max_loss_scale``, in test_loss_scale.py.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jaxpr_walk import all_eqns, casts, emitted, float_in_dtypes, prims, runs_in_half

import jmp_rewrite as jr

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

F32, F16, BF16 = np.dtype(np.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16)
HALF = pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
RNG = np.random.default_rng(17)


def _rand(*shape: int, scale: float = 1.0) -> jax.Array:
    return jnp.asarray(scale * RNG.standard_normal(shape), jnp.float32)


def _dims(lhs_contract: int = 1, rhs_contract: int = 0):
    return (((lhs_contract,), (rhs_contract,)), ((), ()))


# -- 1. "already half" / "is it float32" use every operand ----------------------------------

XB = jnp.asarray(RNG.standard_normal((4, 64)), jnp.bfloat16)
WB = jnp.asarray(RNG.standard_normal((64, 4)), jnp.bfloat16)
X32, W32 = _rand(4, 64), _rand(64, 4)


def _mixed_matmuls(xb, wb, x32, w32):
    """A float32 matmul (painted) beside matmuls that are not float32 programs."""
    half_in = lax.dot_general(xb, wb, _dims(), preferred_element_type=jnp.float32)
    mixed = lax.dot_general(x32, wb, _dims(), preferred_element_type=jnp.float32)
    mixed_rhs = lax.dot_general(xb, w32, _dims(), preferred_element_type=jnp.float32)
    return half_in, mixed, mixed_rhs, x32 @ w32


def test_matmuls_with_half_operands_keep_their_dtypes_and_float32_output():
    expected = _mixed_matmuls(XB, WB, X32, W32)
    rewritten = jr.rewrite(_mixed_matmuls, dtype=jnp.float16)
    got = rewritten(XB, WB, X32, W32)
    for name, y, ref in zip(["bf16 x bf16", "f32 x bf16", "bf16 x f32"], got, expected):
        assert y.dtype == F32, name
        np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6, err_msg=name)
    dots = prims(emitted(rewritten, XB, WB, X32, W32), "dot_general")
    signatures = sorted(
        (tuple(str(d) for d in float_in_dtypes(e)), str(e.outvars[0].aval.dtype)) for e in dots
    )
    assert signatures == sorted(
        [
            (("bfloat16", "bfloat16"), "float32"),
            (("float32", "bfloat16"), "float32"),
            (("bfloat16", "float32"), "float32"),
            (("float16", "float16"), "float16"),  # the float32 matmul, painted
        ]
    )


def test_a_float16_matmul_is_left_alone_by_a_bfloat16_rewrite():
    xh, wh = XB.astype(jnp.float16), WB.astype(jnp.float16)

    def f(xh, wh, x32, w32):
        y = lax.dot_general(xh, wh, _dims(), preferred_element_type=jnp.float32)
        return y, x32 @ w32

    rewritten = jr.rewrite(f, dtype=jnp.bfloat16)
    y, _ = rewritten(xh, wh, X32, W32)
    np.testing.assert_array_equal(y, f(xh, wh, X32, W32)[0])
    dots = prims(emitted(rewritten, xh, wh, X32, W32), "dot_general")
    assert (
        sorted(str(d) for e in dots for d in float_in_dtypes(e))
        == ["bfloat16"] * 2 + ["float16"] * 2
    )


# -- 2. a cast goes half only when every reader is half ---------------------------------------


@HALF
def test_a_cast_read_by_a_half_matmul_and_a_float32_op_stays_float32(dtype):
    w = _rand(4, 4)
    n = jnp.array([[1, 7, 320, 70001]], jnp.int32)  # 70001: inf in float16, 70144 in bf16

    def f(n, w):
        c = n.astype(jnp.float32)
        return c @ w, jnp.sin(c)  # sin is float32-only

    rewritten = jr.rewrite(f, dtype=dtype)
    _, sin = rewritten(n, w)
    np.testing.assert_array_equal(sin, f(n, w)[1])
    jaxpr = emitted(rewritten, n, w)
    assert [runs_in_half(e) for e in prims(jaxpr, "dot_general")] == [True]
    assert float_in_dtypes(prims(jaxpr, "sin")[0]) == [F32]
    int_casts = [e for e in casts(jaxpr) if e.invars[0].aval.dtype == jnp.int32]
    assert [np.dtype(e.params["new_dtype"]) for e in int_casts] == [F32]


@HALF
def test_a_cast_read_only_by_half_ops_casts_straight_to_half(dtype):
    w = _rand(4, 4)
    n = jnp.array([[1, 0, 1, 1]], jnp.int32)

    def f(n, w):
        return n.astype(jnp.float32) @ w

    jaxpr = emitted(jr.rewrite(f, dtype=dtype), n, w)
    int_casts = [e for e in casts(jaxpr) if e.invars[0].aval.dtype == jnp.int32]
    assert [np.dtype(e.params["new_dtype"]) for e in int_casts] == [dtype]


# -- 3. a cast feeding an output stays float32 ------------------------------------------------


@pytest.mark.parametrize("level", ["DEFAULT", "UNSAFE_FORCE_ALL"])
def test_a_cast_whose_value_is_an_output_stays_float32(level):
    w = _rand(2, 2)
    n = jnp.array([3, 100000], jnp.int32)

    def f(n, w):
        c = n.astype(jnp.float32)
        return c, c @ w

    rewritten = jr.rewrite(f, dtype=jnp.float16, level=level)
    c, _ = rewritten(n, w)
    assert c.dtype == F32
    np.testing.assert_array_equal(c, [3.0, 1e5])
    jaxpr = emitted(rewritten, n, w)
    assert all(runs_in_half(e) for e in prims(jaxpr, "dot_general"))
    int_casts = [e for e in casts(jaxpr) if e.invars[0].aval.dtype == jnp.int32]
    assert [np.dtype(e.params["new_dtype"]) for e in int_casts] == [F32]


# -- 4. constants are clamped to the half range -----------------------------------------------

F32_MIN = float(np.finfo(np.float32).min)
MASK = jnp.array([[True, False, True, True], [False] * 4])  # row 1 fully masked
# Arrays the function captures: jaxpr constants (a scalar would be inlined as a literal).
CAPTURED_MIN = jnp.full((4,), F32_MIN)
CAPTURED_INT = np.full((4,), -1_000_000, np.int32)
# An additive attention bias, as attention code builds it (strongly typed: no cast of it).
CAPTURED_BIAS = jnp.asarray(np.where(np.asarray(MASK), 0.0, F32_MIN).astype(np.float32))
MASKINGS = {
    "python float": lambda s: jnp.where(MASK, s, F32_MIN),
    "python float operand": lambda s: jnp.where(MASK, s, s + F32_MIN),  # a half add reads it
    "captured array": lambda s: jnp.where(MASK, s, CAPTURED_MIN),
    "computed from a captured array": lambda s: jnp.where(MASK, s, CAPTURED_MIN * 0.5),
    "cast of a captured int": lambda s: jnp.where(MASK, s, CAPTURED_INT.astype(np.float32)),
    "additive captured bias": lambda s: s + CAPTURED_BIAS,
}


@HALF
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("masking", list(MASKINGS))
def test_mask_constants_are_clamped_to_the_half_range(dtype, jit, masking):
    w, x = _rand(4, 4), _rand(2, 4)

    def f(w, x):
        return jax.nn.softmax(MASKINGS[masking](x @ w), axis=-1)

    rewritten = jr.rewrite(f, dtype=dtype)
    out = (jax.jit(rewritten) if jit else rewritten)(w, x)
    ref = f(w, x)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(out[1], np.full(4, 0.25))  # uniform, as in float32
    np.testing.assert_allclose(out, ref, atol=2e-2)
    jaxpr = emitted(rewritten, w, x)
    masking_ops = [
        e
        for e in [*prims(jaxpr, "select_n"), *prims(jaxpr, "add")]
        if e.outvars[0].aval.shape == MASK.shape and float_in_dtypes(e)
    ]
    # the mask did go half; in float32 only a float32 constant beyond the range pinned
    # before its cast (its flags, the pin: ``masking``)
    in_float32 = [e for e in masking_ops if not runs_in_half(e)]
    assert any(runs_in_half(e) for e in masking_ops)
    assert len(in_float32) <= 2 * (masking == "additive captured bias"), in_float32


CAPTURED_NINF = jnp.full((4,), -np.inf, jnp.float32)
INFINITE = {
    "python float": lambda s: jnp.where(MASK, s, -np.inf),
    "captured array": lambda s: jnp.where(MASK, s, CAPTURED_NINF),
    # the constant is an operand of the half add itself (no call in between)
    "python float operand": lambda s: jnp.where(MASK, s, s + -np.inf),
    "captured array operand": lambda s: jnp.where(MASK, s, s + CAPTURED_NINF),
}


@HALF
@pytest.mark.parametrize("where", list(INFINITE))
def test_infinite_constants_stay_infinite(dtype, where):
    w, x = _rand(4, 4), _rand(2, 4)

    def f(w, x):
        return INFINITE[where](x @ w)

    out = jr.rewrite(f, dtype=dtype)(w, x)
    np.testing.assert_array_equal(np.isneginf(out), ~MASK)


# -- 5. gradient accumulation through gathers and broadcasts, both orders -----------------

V, D, N = 8, 16, 1024
TOKENS = np.concatenate([np.zeros(N - 64, np.int32), RNG.integers(1, V, 64).astype(np.int32)])
EMB, W, B = _rand(V, D), _rand(D, D, scale=0.25), _rand(D)
R = jnp.asarray(RNG.uniform(0.5, 1.5, (N, D)), jnp.float32)


def _embedding_loss(emb, b, w, tokens, r):
    """Token 0 is 960 of the 1024 lookups: its gradient row sums 960 contributions."""
    h = emb[tokens] @ w + b
    return jnp.sum(h * r)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


ORDERS = {
    "grad(rewrite)": lambda dtype: jax.grad(jr.rewrite(_embedding_loss, dtype=dtype), (0, 1)),
    "rewrite(grad)": lambda dtype: jr.rewrite(jax.grad(_embedding_loss, (0, 1)), dtype=dtype),
}


@HALF
@pytest.mark.parametrize("order", list(ORDERS))
def test_gather_and_broadcast_gradients_accumulate_in_float32(dtype, order):
    grad = ORDERS[order](dtype)
    args = (EMB, B, W, TOKENS, R)
    ref_emb, ref_b = jax.grad(_embedding_loss, (0, 1))(*args)
    g_emb, g_b = grad(*args)
    assert g_emb.dtype == g_b.dtype == F32
    # Measured: float16 3e-4, bfloat16 2e-3; accumulated in half: 1e-2 and 0.5.
    bound = 3e-3 if dtype == F16 else 2e-2
    assert _rel(g_emb[0], ref_emb[0]) < bound
    assert _rel(g_b, ref_b) < bound
    # Every accumulation of the program (the gather's transpose, a scatter-add; the bias
    # broadcast's, a sum) runs on float32 values, whatever the CPU does with half sums.
    jaxpr = jax.make_jaxpr(grad)(*args)
    sums = [
        e
        for e in all_eqns(jaxpr)
        if e.primitive.name == "scatter-add"
        or e.primitive.name == "reduce_sum"
        and e.invars[0].aval.size > e.outvars[0].aval.size
    ]
    assert {e.primitive.name for e in sums} == {"reduce_sum", "scatter-add"}
    for e in sums:
        assert set(float_in_dtypes(e)) == {F32}, e
    assert any(runs_in_half(e) for e in prims(jaxpr, "dot_general"))


# -- 7. normalization centring stays float32 in bfloat16 ----------------------------------


@HALF
def test_normalization_statistics_and_centring_stay_float32(dtype):
    w1, w2, x = _rand(8, 16), _rand(16, 8), _rand(4, 8)

    def f(w1, w2, x):
        h = x @ w1
        mean = jnp.mean(h, axis=-1, keepdims=True)
        centred = h - mean
        var = jnp.mean(centred * centred, axis=-1, keepdims=True)
        return (centred * lax.rsqrt(var + 1e-5)) @ w2

    jaxpr = emitted(jr.rewrite(f, dtype=dtype), w1, w2, x)
    assert [runs_in_half(e) for e in prims(jaxpr, "dot_general")] == [True, True]
    (centring,) = prims(jaxpr, "sub")
    statistics = [*prims(jaxpr, "reduce_sum"), *prims(jaxpr, "rsqrt"), centring]
    for e in statistics:
        assert set(float_in_dtypes(e)) == {F32}, e
    (square,) = [e for e in prims(jaxpr, "mul") if e.invars[0] is e.invars[1]]
    assert set(float_in_dtypes(square)) == {F32}


# -- custom_linear_solve: bodies rewritten like every other sub-jaxpr -----------------------


def _solve_program(m, x, b):
    def matvec(v):
        return (m @ m.T) @ v

    def solve(_, v):
        return jnp.linalg.solve(m @ m.T, v)

    return lax.custom_linear_solve(matvec, b, solve, symmetric=True) * x


@HALF
def test_custom_linear_solve_bodies_are_rewritten(dtype):
    m = jnp.eye(4) * 2.0 + 0.1 * _rand(4, 4)
    x, b = _rand(4), _rand(4)
    rewritten = jr.rewrite(_solve_program, dtype=dtype)
    np.testing.assert_allclose(rewritten(m, x, b), _solve_program(m, x, b), rtol=0.1, atol=0.1)
    jaxpr = emitted(rewritten, m, x, b)
    solve = prims(jaxpr, "custom_linear_solve")[0]  # ours (jnp.linalg.solve holds another)
    # The equation keeps its signature; its matvec and solve bodies are rewritten inside.
    assert set(float_in_dtypes(solve)) == {F32}
    assert {np.dtype(v.aval.dtype) for v in solve.outvars} == {F32}
    # The user's matmuls run in half; jnp.linalg.solve's own refinement matmuls ask for
    # precision=HIGHEST and stay float32 (paint.keep_highest_precision_float32).
    dots = prims(jaxpr, "dot_general")
    highest = [e for e in dots if e.params.get("precision") not in (None, (None, None))]
    default = [e for e in dots if e not in highest]
    assert len(default) >= 2 and all(runs_in_half(e) for e in default)
    assert all(set(float_in_dtypes(e)) == {F32} for e in highest)
    assert all(set(float_in_dtypes(e)) == {F32} for e in prims(jaxpr, "triangular_solve"))
    grads = jax.grad(lambda m, b: jnp.sum(rewritten(m, x, b)), (0, 1))(m, b)
    ref = jax.grad(lambda m, b: jnp.sum(_solve_program(m, x, b)), (0, 1))(m, b)
    for g, r in zip(grads, ref, strict=True):
        assert g.dtype == F32
        np.testing.assert_allclose(g, r, rtol=0.1, atol=0.1)


# -- rules the items above lean on ------------------------------------------------------------


def test_a_call_operand_read_by_half_and_float32_ops_reaches_both_exactly():
    """Item 2 through a call: a ``jit`` operand read inside by a half matmul and a float32
    op is passed as it is (one cast per reader inside), never pre-cast to half."""
    w = _rand(4, 4)
    c = jnp.array([[1.0, 7.0, 320.0, 70001.0]], jnp.float32)

    @jax.jit
    def inner(c, w):
        return c @ w, jnp.sin(c)

    def f(c, w):
        return inner(c * 1.0, w)

    for dtype in (F16, BF16):
        _, sin = jr.rewrite(f, dtype=dtype)(c, w)
        np.testing.assert_array_equal(sin, f(c, w)[1])


def test_cubes_stay_float32_in_float16():
    """``x**3`` is TF's Pow (deny): it overflows half for |x| > 40 (gelu's tanh form), and
    deny spreads to the infer op that adds it to the matmul's output."""
    w = jnp.eye(4)

    def f(w, x):
        h = x @ w
        return h**3 + h

    x = jnp.array([[50.0, -50.0, 3.0, 0.5]])  # 50**3 = 125000: inf in float16
    rewritten = jr.rewrite(f, dtype=jnp.float16)
    np.testing.assert_allclose(rewritten(w, x), f(w, x), rtol=1e-3)
    jaxpr = emitted(rewritten, w, x)
    assert runs_in_half(prims(jaxpr, "dot_general")[0])
    for name in ("integer_pow", "add"):
        assert set(float_in_dtypes(prims(jaxpr, name)[0])) == {F32}, name


def test_computed_values_overflow_honestly():
    """Only constants, frozen values and sentinels are clamped: a value computed from an input
    by a constant float16 holds overflows to inf in half, so that loss scaling sees the
    overflow (a clamped 65504 would hide it). A product by a constant float16 cannot hold
    (1e5) is the user's sentinel (``origins.sentinel_scaled``): clamped, as the constant
    itself is where a half op reads it."""
    w = jnp.ones((1, 1))

    def f(w, x):
        return (x * 1e4) @ w  # one product: a clamped 65504 would stay finite

    out = jr.rewrite(f, dtype=jnp.float16)(w, jnp.full((1, 1), 10.0))
    assert np.isposinf(np.asarray(out)).all()
    out = jr.rewrite(lambda w, x: (x * 1e5) @ w, dtype=jnp.float16)(w, jnp.ones((1, 1)))
    np.testing.assert_array_equal(out, [[65504.0]])


def test_deny_does_not_spread_through_a_comparison():
    """A deny op's boolean result (``exp(x) > 1``) carries no float data: the select it
    drives stays half between two matmuls."""
    w = _rand(4, 4)

    def f(w, x):
        h = x @ w
        return (jnp.where(jnp.exp(x) > 1.0, h, 0.0) * 2.0) @ w  # select, then an infer op

    jaxpr = emitted(jr.rewrite(f, dtype=jnp.float16), w, _rand(2, 4))
    (select,) = [e for e in prims(jaxpr, "select_n") if e.outvars[0].aval.shape == (2, 4)]
    assert runs_in_half(select) and runs_in_half(prims(jaxpr, "mul")[0])
    assert float_in_dtypes(prims(jaxpr, "exp")[0]) == [F32]


def test_a_float32_region_holds_under_unsafe_force_all():
    """UNSAFE_FORCE_ALL converts every op it can, but never one in a float32 region."""
    w = _rand(4, 4)

    @jr.float32_region
    def head(h):
        return jnp.exp(h @ w)

    def f(w, x):
        return head(jnp.tanh(x @ w))

    jaxpr = emitted(jr.rewrite(f, dtype=jnp.float16, level="UNSAFE_FORCE_ALL"), w, _rand(2, 4))
    assert [runs_in_half(e) for e in prims(jaxpr, "dot_general")] == [True, False]
    assert runs_in_half(prims(jaxpr, "tanh")[0])
    assert float_in_dtypes(prims(jaxpr, "exp")[0]) == [F32]


UPDATES = {
    "running average": lambda s, stat: 0.99 * s + 0.01 * stat,
    "sgd step": lambda s, stat: s - 0.01 * stat,
}


@HALF
@pytest.mark.parametrize("update", list(UPDATES))
def test_a_running_average_between_two_matmuls_is_updated_in_float32(dtype, update):
    """``new = 0.99 * s + 0.01 * mean(h)`` (or ``s - 0.01 * mean(h)``) scaling ``h`` before
    the next matmul: infer ops between two allow ops, but state carried from step to step
    (an output computed from the input of its shape) is updated in float32, not re-rounded
    to half every step."""
    w1, w2 = _rand(16, 16, scale=0.25), _rand(16, 16, scale=0.25)
    s = jnp.asarray(RNG.uniform(0.5, 1.5, (16,)), jnp.float32)
    x = _rand(8, 16)

    def step(w1, w2, s, x):
        h = x @ w1
        new = UPDATES[update](s, jnp.mean(h, axis=0))
        return (h * new) @ w2, new

    rewritten = jr.rewrite(step, dtype=dtype)
    _, new = rewritten(w1, w2, s, x)
    _, new32 = step(w1, w2, s, x)
    assert new.dtype == F32
    # Rounding s alone to half is ~u/sqrt(3) (bf16 2.3e-3); here only the 1% share is half.
    bound = {F16: 2e-5, BF16: 1.5e-4}[dtype]
    assert _rel(new, new32) < bound
    jaxpr = emitted(rewritten, w1, w2, s, x)
    assert [runs_in_half(e) for e in prims(jaxpr, "dot_general")] == [True, True]


_KEEPS_FLOAT32 = {
    "HIGHEST": lax.Precision.HIGHEST,
    "highest": "highest",
    "(HIGHEST, DEFAULT)": (lax.Precision.HIGHEST, lax.Precision.DEFAULT),
    "F32_F32_F32": lax.DotAlgorithmPreset.F32_F32_F32,
    "BF16_BF16_F32": lax.DotAlgorithmPreset.BF16_BF16_F32,
}
_PAINTED_BY_THE_LISTS = {
    "None": None,
    "DEFAULT": lax.Precision.DEFAULT,
    "preset DEFAULT": lax.DotAlgorithmPreset.DEFAULT,
}


@HALF
@pytest.mark.parametrize(
    "precision,keeps",
    [(v, True) for v in _KEEPS_FLOAT32.values()]
    + [(v, False) for v in _PAINTED_BY_THE_LISTS.values()],
    ids=[*_KEEPS_FLOAT32, *_PAINTED_BY_THE_LISTS],
)
def test_a_matmul_that_names_its_precision_or_algorithm_runs_as_written(dtype, precision, keeps):
    """``precision=HIGHEST`` or an explicit dot algorithm is the caller's choice of operand
    types: the matmul stays float32 (a preset was painted allow and ran in half before)."""
    a, b = _rand(8, 8), _rand(8, 8)

    def f(a, b):
        return jnp.dot(a, b, precision=precision)

    (dot,) = prims(emitted(jr.rewrite(f, dtype=dtype), a, b), "dot_general")
    assert runs_in_half(dot) is not keeps
    (painted,) = jr.paint(f, a, b, dtype=dtype).find("dot_general")
    assert painted.half is not keeps
    if keeps and not isinstance(precision, lax.DotAlgorithmPreset):  # presets: GPU only
        for g in (jr.rewrite(f, dtype=dtype), jax.jit(jr.rewrite(f, dtype=dtype))):
            np.testing.assert_array_equal(g(a, b), f(a, b))
