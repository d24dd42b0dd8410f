"""Issue 28 item 5: kernels, and every equation whose body is no program of arrays.

A Pallas kernel is its author's precision decision: ``pallas_call`` runs as written, its
operands cast back to the dtypes it was traced with, and ``explain`` says so. Before the fix
its body was re-traced as a program of arrays and ``get`` raised ``ValueError: get must be
called on Ref types``. The rule is about the body, not the primitive (``equations.sealed``):
a body that takes, gives or closes over a Ref (``pallas_call``, ``run_state``, ``pl.loop``, a
``jit``, ``cond`` or loop writing a ``jax.new_ref`` array) runs as written; bodies of arrays
(``custom_vmap``, ``custom_linear_solve``, ``reduce``, ``composite``, ``custom_partitioning``)
are rewritten as programs of their own, as before.

The tutorial's matmul kernel has no derivative (``pallas_call`` has no transpose rule): it is
tested forward only. The flash-attention kernel carries a ``custom_vjp`` with a plain-JAX
backward pass (as real kernels do), so both orders of ``grad`` and ``rewrite`` are tested.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jaxpr_walk import prims, runs_in_half, sub_jaxprs
from program_gen import _pallas_matmul as tutorial_matmul
from program_gen import attention_reference, pallas_attention

import jmp_rewrite
from jmp_rewrite._src.explain.html import reason

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

F16, BF16 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16)
DTYPES = pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
TOL = {F16: 1e-2, BF16: 5e-2}
T, D = 16, 32

_rng = np.random.default_rng(0)
X = jnp.asarray(_rng.standard_normal((T, D)), jnp.float32)
WS = [jnp.asarray(_rng.standard_normal((D, D)) / np.sqrt(D), jnp.float32) for _ in range(4)]


def matmul_model(ws, x):
    """Half-precision matmuls around the tutorial's gridded matmul kernel."""
    return jnp.tanh(tutorial_matmul(x @ ws[0], ws[1])) @ ws[2]


def flash_model(ws, x):
    """Projections around a flash-attention kernel (online softmax over key blocks)."""
    q, k, v = (x @ ws[i] for i in range(3))
    return jnp.tanh(pallas_attention(q, k, v) @ ws[3])


def _loss(model):
    return lambda ws, x: jnp.mean(model(ws, x) ** 2)


def _rel(out, ref) -> float:
    return max(
        float(np.linalg.norm(np.ravel(a - b)) / np.linalg.norm(np.ravel(b)))
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True)
    )


def _kernels_as_traced(rewritten, original) -> None:
    """Every kernel of the rewritten program is one of the original's, equation for
    equation, with operands and results in its traced dtypes (float32 here)."""
    new, old = prims(rewritten, "pallas_call"), prims(original, "pallas_call")
    assert new
    traced = {str(e.params["jaxpr"]): [v.aval.dtype for v in [*e.invars, *e.outvars]] for e in old}
    for e in new:
        assert traced.get(str(e.params["jaxpr"])) == [v.aval.dtype for v in [*e.invars, *e.outvars]]


def test_the_kernels_compute_what_their_references_do():
    np.testing.assert_allclose(tutorial_matmul(X, WS[0]), X @ WS[0], rtol=1e-5, atol=1e-5)
    q, k, v = X @ WS[0], X @ WS[1], X @ WS[2]
    np.testing.assert_allclose(
        pallas_attention(q, k, v), attention_reference(q, k, v), rtol=1e-5, atol=1e-5
    )
    with pytest.raises(ValueError):  # no transpose rule: the tutorial kernel is forward only
        jax.grad(lambda x: tutorial_matmul(x, WS[0]).sum())(X)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("model", [matmul_model, flash_model], ids=["matmul", "flash"])
@DTYPES
def test_a_kernel_runs_as_written_between_half_matmuls(model, dtype, jit):
    fn = jmp_rewrite.rewrite(model, dtype=dtype)
    out = (jax.jit(fn) if jit else fn)(WS, X)
    ref = model(WS, X)
    assert out.dtype == jnp.float32
    assert _rel(out, ref) < TOL[dtype]
    rewritten, original = jax.make_jaxpr(fn)(WS, X), jax.make_jaxpr(model)(WS, X)
    _kernels_as_traced(rewritten, original)
    outside = [e for e in rewritten.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert outside and all(runs_in_half(e) for e in outside)


@pytest.mark.parametrize("order", ["grad_rewrite", "rewrite_grad"])
@DTYPES
def test_flash_kernel_in_both_orders_of_grad(order, dtype):
    loss = _loss(flash_model)
    ref = jax.grad(loss)(WS, X)
    if order == "grad_rewrite":
        g = jax.grad(jmp_rewrite.rewrite(loss, dtype=dtype))
    else:
        g = jmp_rewrite.rewrite(jax.grad(loss), dtype=dtype)
    out = jax.jit(g)(WS, X)
    assert [a.dtype for a in out] == [jnp.float32] * 4
    assert _rel(out, ref) < 2 * TOL[dtype]
    _kernels_as_traced(jax.make_jaxpr(g)(WS, X), jax.make_jaxpr(jax.grad(loss))(WS, X))


def test_explain_says_a_kernel_runs_as_written():
    report = jmp_rewrite.explain(flash_model, WS, X, dtype=BF16, residuals=False)
    (kernel,) = [e for e in report.equations if e.primitive == "pallas_call"]
    assert not kernel.half and kernel.painted_by == "keep_kernels_as_written"
    assert kernel.in_dtypes_after == ("float32",) * 3
    assert "kernel" in reason(kernel) and "as written" in reason(kernel)
    assert sum(e.half for e in report.equations if e.primitive == "dot_general") == 4


def test_a_program_whose_only_matmul_is_in_a_kernel_is_unchanged():
    """A kernel's matmuls are not the rewrite's to paint: nothing to do, as TF says."""
    p = jmp_rewrite.paint(lambda a, b: tutorial_matmul(a, b), X, WS[0], dtype=F16)
    assert not p.changed and not p.half


# -- every other equation holding a body ----------------------------------------------------


def _run_state(a, b):
    def body(refs):
        a_ref, o_ref = refs
        o_ref[...] = a_ref[...] @ b

    return pl.run_state(body)((a, jnp.zeros_like(a)))[1]


def _pl_loop(a, b):
    def body(refs):
        a_ref, o_ref = refs

        @pl.loop(0, 3)
        def _(i):
            o_ref[...] = o_ref[...] + a_ref[...] @ b

    return pl.run_state(body)((a, jnp.zeros_like(a)))[1]


def _ref_in_loop(a, b):
    r = jax.new_ref(jnp.zeros_like(a))

    def body(i, c):
        r[...] = r[...] + jnp.tanh(c @ b)
        return c @ b

    c = jax.lax.fori_loop(0, 3, body, a)
    return r[...] @ b + c


def _ref_in_jit(a, b):
    r = jax.new_ref(jnp.zeros_like(a))

    @jax.jit
    def write(r, a):
        r[...] = a @ b

    write(r, a)
    return r[...]


def _ref_in_cond(a, b):
    r = jax.new_ref(jnp.zeros_like(a))

    def taken(a):
        r[...] = a @ b

    def other(a):
        r[...] = a

    jax.lax.cond(jnp.sum(a) > 0, taken, other, a)
    return r[...]


@jax.custom_batching.custom_vmap
def _custom_vmap(a, b):
    return jnp.tanh(a @ b)


_custom_vmap.def_vmap(
    lambda size, batched, a, b: (jax.vmap(lambda u, v: jnp.tanh(u @ v))(a, b), True)
)


def _reduce(a, b):
    return jnp.broadcast_to(
        jax.lax.reduce(a @ b, 0.0, lambda u, v: u + v * v, (1,))[:, None], a.shape
    )


def _composite(a, b):
    return jax.lax.composite(lambda u, v: jnp.tanh(u @ v), name="test.tanh_matmul")(a, b)


def _linear_solve(a, b):
    m = a.T @ a / D + 4 * jnp.eye(D)
    return jax.lax.custom_linear_solve(lambda v: m @ v, b, lambda mv, v: jnp.linalg.solve(m, v))


HOLDERS = {
    "run_state": (_run_state, True),
    "pl_loop": (_pl_loop, True),
    "new_ref_in_fori_loop": (_ref_in_loop, True),
    "new_ref_in_jit": (_ref_in_jit, True),
    "new_ref_in_cond": (_ref_in_cond, True),
    "custom_vmap": (lambda a, b: _custom_vmap(a, b), False),
    "reduce": (_reduce, False),
    "composite": (_composite, False),
    "custom_linear_solve": (_linear_solve, False),
}


@pytest.mark.parametrize("name", sorted(HOLDERS))
@DTYPES
def test_every_body_holder_runs_as_written_or_is_rewritten(name, dtype):
    """A body over Refs (sealed) runs as written, its operands and results float32, the
    matmuls around it in half; a body of arrays is rewritten as a program of its own."""
    inner, sealed = HOLDERS[name]

    def f(a, b):
        return jnp.tanh(inner(a @ WS[0], b)) @ WS[1]

    fn = jmp_rewrite.rewrite(f, dtype=dtype)
    out, ref = jax.jit(fn)(X, WS[2]), f(X, WS[2])
    assert out.dtype == jnp.float32 and _rel(out, ref) < TOL[dtype]
    np.testing.assert_allclose(fn(X, WS[2]), out, rtol=TOL[dtype], atol=TOL[dtype])
    top = jax.make_jaxpr(fn)(X, WS[2]).jaxpr.eqns
    assert all(runs_in_half(e) for e in top if e.primitive.name == "dot_general")
    report = jmp_rewrite.explain(f, X, WS[2], dtype=dtype, residuals=False)
    kept = [e.path for e in report.equations if e.painted_by == "keep_kernels_as_written"]
    assert bool(kept) == sealed, kept
    if sealed:  # the holder's bodies as traced: no half value inside
        original = jax.make_jaxpr(f)(X, WS[2]).jaxpr.eqns
        bodies = lambda eqns: [str(j) for e in eqns for j in sub_jaxprs(e)]  # noqa: E731
        assert bodies(top) == bodies(original) and bodies(top)


def test_a_value_read_from_a_ref_is_computed_not_a_constant():
    """A Ref made from zeros (a constant) and then written with a computed value holds that
    value: read back beyond float16's range it overflows in a half matmul as by hand (the
    loss-scale optimizer skips the step), instead of being clamped as a constant would be."""
    x = jnp.full((4, 8), 300.0, jnp.float32)  # x * x = 90000 > 65504
    w = jnp.ones((8, 8), jnp.float32) / 8

    def f(x, w):
        r = jax.new_ref(jnp.zeros_like(x))
        r[...] = x * x
        return r[...] @ w

    by_hand = ((x * x).astype(jnp.float16) @ w.astype(jnp.float16)).astype(jnp.float32)
    out = jmp_rewrite.rewrite(f, dtype=F16)(x, w)
    assert np.isfinite(f(x, w)).all() and not np.isfinite(by_hand).any()
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(by_hand))
