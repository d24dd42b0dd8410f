"""How a rewritten function takes its arguments: static_argnums/static_argnames as in jax.jit,
every other non-array leaf static (Equinox's filter convention), the trace cache, the errors."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_walk import prims, runs_in_half

import jmp_rewrite as jr
from jmp_rewrite._src.trace import arguments

F32 = np.dtype(jnp.float32)
W = 0.3 * jax.random.normal(jax.random.key(1), (6, 6), jnp.float32)
X = jax.random.normal(jax.random.key(2), (3, 6), jnp.float32)


def blocks(w, x, n, act):
    for _ in range(n):
        x = act(x @ w)
    return x


def counting(fun):
    """``fun`` and a list that grows by one at each trace of it."""
    traces = []

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        traces.append(1)
        return fun(*args, **kwargs)

    return wrapped, traces


# -- static_argnums / static_argnames as jax.jit takes them ----------------------------------


@pytest.mark.parametrize(
    "static",
    [
        {"static_argnames": ("n", "act")},
        {"static_argnums": (2, 3)},
        {"static_argnums": (-2, -1)},
        {"static_argnums": 2, "static_argnames": "act"},
        {},  # undeclared: an int and a function are not arrays, so static anyway
    ],
)
@pytest.mark.parametrize("by_keyword", [False, True])
def test_static_arguments_by_position_or_keyword(static, by_keyword):
    f = jr.rewrite(blocks, dtype=jnp.float16, **static)
    out = f(W, X, n=2, act=jnp.tanh) if by_keyword else f(W, X, 2, jnp.tanh)
    ref = blocks(W, X, 2, jnp.tanh)
    assert out.dtype == F32
    np.testing.assert_allclose(out, ref, rtol=5e-3, atol=5e-3)
    assert not np.allclose(out, ref, rtol=1e-6, atol=1e-7)  # it did run in float16
    jaxpr = jax.make_jaxpr(lambda w, x: f(w, x, n=2, act=jnp.tanh))(W, X)
    dots = prims(jaxpr, "dot_general")
    assert len(dots) == 2 and all(runs_in_half(e) for e in dots)


def test_static_argument_names_map_through_the_signature():
    spec = arguments.resolve_static(blocks, None, ("n", "act"))
    assert spec.argnums == {2, 3} and spec.argnames == {"n", "act"}
    spec = arguments.resolve_static(blocks, (2, -1), None)
    assert spec.argnums == {2, 3} and spec.argnames == {"n", "act"}

    def keyword_only(x, *, mode):
        return x

    spec = arguments.resolve_static(keyword_only, None, "mode")
    assert spec.argnums == frozenset() and spec.argnames == {"mode"}


def test_jit_with_the_same_static_arguments_composes():
    f = jr.rewrite(blocks, dtype=jnp.bfloat16, static_argnames=("n", "act"))
    g = jax.jit(f, static_argnames=("n", "act"))
    ref = blocks(W, X, 3, jnp.tanh)
    for out in (g(W, X, 3, jnp.tanh), g(W, X, n=3, act=jnp.tanh)):
        np.testing.assert_allclose(out, ref, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("bad", [4, -5, (1, 7)])
def test_out_of_range_static_argnums_names_the_value_and_the_arity(bad):
    with pytest.raises(
        ValueError,
        match=re.escape(f"static_argnums={bad!r} is out of range: blocks(w, x, n, act) takes 4"),
    ):
        jr.rewrite(blocks, static_argnums=bad)


def test_static_argnums_beyond_the_parameters_are_fine_with_varargs():
    def total(*xs):
        return sum(x @ x for x in xs[:-1]) * xs[-1]

    f = jr.rewrite(total, dtype=jnp.float16, static_argnums=-1)
    out = f(W, W, 2.0)
    np.testing.assert_allclose(out, total(W, W, 2.0), rtol=5e-3, atol=5e-3)


def stacked(*xs):
    """``n`` layers of ``x @ w``: ``stacked(w, ..., n, x)`` (``n`` before the last argument)."""
    *ws, n, x = xs
    for _ in range(int(n)):  # a Python loop: ``n`` must be static
        for w in ws:
            x = jnp.tanh(x @ w)
    return x


def stacked_last(w, *rest):
    """``stacked(w, x, n)`` with ``n`` last."""
    x, n = rest
    return stacked(w, n, x)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    "fun, static, args",
    [
        (stacked, -2, lambda n: (W, W, np.int32(n), X)),
        (stacked, (-2,), lambda n: (W, np.int32(n), X)),
        (stacked_last, -1, lambda n: (W, X, np.int32(n))),
    ],
)
def test_negative_static_argnums_on_varargs_make_the_right_argument_static(fun, static, args, jit):
    # A NumPy integer is an array leaf, traced unless declared static: int(n) then fails. The
    # index counts from the end of each call's arguments, whatever their number.
    f = jr.rewrite(fun, dtype=jnp.float16, static_argnums=static)
    f = jax.jit(f, static_argnums=static) if jit else f
    for n in (1, 3):
        a = args(n)
        out = f(*a)
        assert out.dtype == F32
        np.testing.assert_allclose(out, fun(*a), rtol=2e-2, atol=2e-2)
        k = next(i for i, x in enumerate(a) if isinstance(x, np.integer))
        dyn = [x for i, x in enumerate(a) if i != k]
        jaxpr = jax.make_jaxpr(lambda *d, a=a, k=k: f(*d[:k], a[k], *d[k:]))(*dyn)
        dots = prims(jaxpr, "dot_general")
        assert len(dots) == n * (len(a) - 2) and all(runs_in_half(e) for e in dots)


def test_bad_static_names_and_types():
    with pytest.raises(ValueError, match="'steps', which is not a parameter of blocks"):
        jr.rewrite(blocks, static_argnames="steps")

    def positional_only(x, n, /):
        return x * n

    with pytest.raises(ValueError, match="positional-only.*static_argnums=1"):
        jr.rewrite(positional_only, static_argnames="n")
    with pytest.raises(TypeError, match="static_argnums must be an int"):
        jr.rewrite(blocks, static_argnums="n")
    with pytest.raises(TypeError, match="static_argnums must be an int"):
        jr.rewrite(static_argnums=[1.5])  # checked even before the function is given
    with pytest.raises(TypeError, match="static_argnames must be a str"):
        jr.rewrite(blocks, static_argnames=[2])

    def anything(x, **kw):
        return x

    jr.rewrite(anything, static_argnames="whatever")  # **kwargs takes any name, as in jit


# -- the filter convention: non-array leaves are static --------------------------------------


def test_non_array_leaves_of_any_pytree_are_static():
    def layer(params, x):
        x = params["act"](x @ params["w"])
        if params["kind"] == "residual":  # a string steering Python control flow
            x = x + jnp.zeros(params["width"])  # an int sizing an array
        return x

    params = {"w": W, "act": jax.nn.gelu, "kind": "residual", "width": 6}
    f = jr.rewrite(layer, dtype=jnp.bfloat16)
    np.testing.assert_allclose(f(params, X), layer(params, X), rtol=3e-2, atol=3e-2)
    jaxpr = jax.make_jaxpr(lambda w, x: f({**params, "w": w}, x))(W, X)
    assert [runs_in_half(e) for e in prims(jaxpr, "dot_general")] == [True]


def test_cache_keys_static_values_by_type_and_value_and_arrays_by_aval():
    fun, traces = counting(lambda x, n: x @ x * n)
    f = jr.rewrite(fun, dtype=jnp.float16)
    for _ in range(3):
        f(W, 2)
    assert len(traces) == 1
    f(W + 1.0, 2)  # new values, same avals
    assert len(traces) == 1
    f(W, 3)  # a new static value
    assert len(traces) == 2
    f(W, 3.0)  # equal but of another type, as jax.jit's static arguments
    assert len(traces) == 3
    f(W[:4, :4], 3.0)  # new shape
    assert len(traces) == 4
    f(W, np.float32(5.0))  # NumPy scalars are arrays: traced, so new values do not retrace
    f(W, np.float32(6.0))
    assert len(traces) == 5
    out = f(W, jnp.float32(7.0))  # an array of the same aval as the NumPy scalar
    assert len(traces) == 5
    np.testing.assert_allclose(out, W @ W * 7.0, rtol=5e-3, atol=5e-3)


def test_python_numbers_that_keep_changing_warn_naming_the_argument():
    f = jr.rewrite(lambda x, cfg: x @ x * cfg["lr"], dtype=jnp.float16)
    with pytest.warns(UserWarning, match=r"argument 1 \(cfg\)\['lr'\].*jnp.asarray"):
        for i in range(arguments.CHURN_WARNING_AFTER):
            f(W, {"lr": 0.1 * (i + 1)})
    out = f(W, {"lr": jnp.float32(0.5)})  # the fix: an array
    np.testing.assert_allclose(out, W @ W * 0.5, rtol=5e-3, atol=5e-3)


def test_unhashable_leaf_is_an_error_naming_its_path():
    class Config:  # an __eq__ without __hash__: unhashable
        def __eq__(self, other):
            return True

    def fun(x, opts):
        return x @ x

    f = jr.rewrite(fun, dtype=jnp.float16)
    with pytest.raises(TypeError, match=r"argument 1 \(opts\)\['cfg'\] is a Config.*hashable"):
        f(W, {"cfg": Config()})
    g = jr.rewrite(fun, dtype=jnp.float16, static_argnames="opts")
    with pytest.raises(TypeError, match="argument 'opts' is declared static but is not hashable"):
        g(W, opts=np.ones(2))
    # The way out the message gives: bind it.
    out = jr.rewrite(functools.partial(fun, opts=Config()), dtype=jnp.float16)(W)
    assert out.dtype == F32


def test_hashable_objects_are_static_and_frozen_dataclasses_key_by_value():
    @dataclasses.dataclass(frozen=True)
    class Cfg:
        scale: float
        act: str

    fun, traces = counting(lambda x, cfg: getattr(jnp, cfg.act)(x @ x) * cfg.scale)
    f = jr.rewrite(fun, dtype=jnp.float16)
    out = f(W, Cfg(2.0, "tanh"))
    f(W, Cfg(2.0, "tanh"))
    assert len(traces) == 1
    np.testing.assert_allclose(out, jnp.tanh(W @ W) * 2.0, rtol=5e-3, atol=5e-3)
    f(W, Cfg(2.0, "sin"))
    assert len(traces) == 2
    # NumPy strings are static too (NumPy numbers are arrays).
    g = jr.rewrite(lambda x, act: getattr(jnp, str(act))(x @ x), dtype=jnp.float16)
    np.testing.assert_allclose(g(W, np.str_("tanh")), jnp.tanh(W @ W), rtol=5e-3, atol=5e-3)


def test_non_array_outputs_are_returned_as_traced():
    def fun(x):
        return {"y": x @ x, "act": jnp.tanh, "name": "layer", "n": 3}

    out = jr.rewrite(fun, dtype=jnp.float16)(W)
    assert out["act"] is jnp.tanh and out["name"] == "layer" and out["n"] == 3
    assert out["y"].dtype == F32
    out = jax.jit(jr.rewrite(lambda x: (x @ x, None, ()), dtype=jnp.float16))(W)
    assert out[1] is None and out[2] == ()


def test_methods_count_self_like_jax_jit():
    class Layer:
        def __init__(self, w):
            self.w = w

        @functools.partial(jr.rewrite, dtype=jnp.float16, static_argnums=2)
        def __call__(self, x, n):
            for _ in range(n):
                x = jnp.tanh(x @ self.w)
            return x

    layer = Layer(W)
    np.testing.assert_allclose(layer(X, 2), blocks(W, X, 2, jnp.tanh), rtol=5e-3, atol=5e-3)
    with pytest.raises(ValueError, match="static_argnums=3 is out of range"):
        jr.rewrite(Layer.__call__.__wrapped__, static_argnums=3)


def test_trace_and_explain_take_the_same_arguments():
    report = jr.explain(blocks, W, X, 2, jnp.tanh, dtype=jnp.float16)
    assert [e.primitive for e in report.converted].count("dot_general") == 2
    painted = jr.paint(blocks, W, X, 2, jnp.tanh, dtype=jnp.float16, static_argnames="act")
    assert painted.colours("dot_general") == ["allow", "allow"]
    # ShapeDtypeStructs stand for arrays.
    spec = jax.ShapeDtypeStruct(W.shape, W.dtype)
    f = jr.rewrite(blocks, dtype=jnp.float16)
    entry, flat = f.trace(spec, spec, 1, jnp.tanh)
    assert flat == [spec, spec] and entry.painting.changed
