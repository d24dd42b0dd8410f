"""Issue 28 item 1: complex values between half-precision matmuls.

No clamp, cast or painting decision touches a complex value: there is no half-precision
complex type, so a complex value, and the float32 parts read from it (``h.real``,
``abs(z)``, a cast from complex), stay as the program wrote them, while the real float32
matmuls around them run in half precision as by hand (``(x @ w).astype(complex64)`` rounds
``x @ w`` once, as a hand-written half model does). Before the fix, ``rewrite(grad(f))`` of a
complex recurrence raised ``ValueError: Clip received a complex value``: a complex value was
taken for an integer one (frozen, so clamped when cast to half), and its real part's cast
was painted half.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_walk import HALF, all_eqns, runs_in_half, sub_jaxprs

import jmp_rewrite

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

F16, BF16 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16)
DTYPES = pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
UNIT_ROUNDOFF = {F16: 2.0**-11, BF16: 2.0**-8}
T, B, D = 8, 4, 16


def _params() -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    return {
        "x": f32(rng.standard_normal((T, B, D))),
        "w": f32(rng.standard_normal((D, D)) / np.sqrt(D)),
        "w2": f32(rng.standard_normal((D, D)) / np.sqrt(D)),
        "lr": f32(rng.uniform(0.5, 0.9, D)),
        "li": f32(rng.uniform(-0.3, 0.3, D)),
        "logdt": f32(rng.uniform(-3.0, -1.0, D)),
    }


def _half(half):
    return (lambda a: a.astype(half)) if half is not None else (lambda a: a)


def lru(p, half=None):
    """The issue's repro: a complex diagonal recurrence (LRU) fed by a matmul, in a scan."""
    c = _half(half)
    lam = p["lr"] + 1j * p["li"]

    def step(h, xt):
        h = lam * h + (c(xt) @ c(p["w"])).astype(jnp.complex64)
        return h, h.real

    _, ys = jax.lax.scan(step, jnp.zeros((B, D), jnp.complex64), p["x"])
    return (ys**2).mean()


def s5(p, half=None):
    """S4/S5-style: a complex ``lam`` discretised as ``exp(dt * lam)``; conj, abs, imag."""
    c = _half(half)
    lam = -p["lr"] + 10j * p["li"]
    lam_bar = jnp.exp(jnp.exp(p["logdt"]) * lam)
    b_bar = (lam_bar - 1) / lam
    u = (c(p["x"]) @ c(p["w"])).astype(jnp.float32)

    def step(h, ut):
        h = lam_bar * h + b_bar * ut
        return h, (h * jnp.conj(h)).real + jnp.abs(h) + jnp.imag(h)

    _, ys = jax.lax.scan(step, jnp.zeros((B, D), jnp.complex64), u)
    return (c(ys) @ c(p["w2"])).astype(jnp.float32).mean()


def fft_conv(p, half=None):
    """An FFT long convolution (jnp.fft) between two matmuls."""
    c = _half(half)
    h = (c(p["x"][0]) @ c(p["w"])).astype(jnp.float32)
    k = jnp.exp(-jnp.arange(D, dtype=jnp.float32) / 4) * p["lr"]
    y = jnp.fft.irfft(jnp.fft.rfft(h, n=2 * D) * jnp.fft.rfft(k, n=2 * D), n=2 * D)[:, :D]
    return jnp.tanh(c(y) @ c(p["w2"])).astype(jnp.float32).mean()


def complex_matmul(p, half=None):
    """A complex matmul fed by a real one; abs and conj of its result."""
    c = _half(half)
    h = (c(p["x"][0]) @ c(p["w"])).astype(jnp.complex64)
    z = h @ (p["w2"] + 1j * p["w"])
    return (jnp.abs(z) ** 2).mean() + jnp.real(jnp.sum(z * jnp.conj(z))) / 100


MODELS = {"lru": lru, "s5": s5, "fft_conv": fft_conv, "complex_matmul": complex_matmul}


def _rel(out, ref) -> float:
    return max(
        float(np.linalg.norm(np.ravel(a - b)) / (np.linalg.norm(np.ravel(b)) + 1e-30))
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True)
    )


@functools.cache
def _reference(name: str, dtype: Any) -> tuple[Any, float]:
    """Float32's value and gradients, and the hand-written half version's error."""
    fn, p = MODELS[name], _params()
    ref = jax.jit(jax.value_and_grad(fn))(p)
    by_hand = jax.jit(jax.value_and_grad(lambda q: fn(q, dtype)))(p)
    return ref, _rel(by_hand, ref)


def _no_complex_value_touched(jaxpr: Any) -> None:
    """No equation reading a complex value gives a half-precision one (no cast from complex
    into half); loops and calls are looked into."""
    for e in all_eqns(jaxpr):
        if list(sub_jaxprs(e)):
            continue
        reads_complex = any(jnp.issubdtype(a.aval.dtype, jnp.complexfloating) for a in e.invars)
        if reads_complex:
            outs = [np.dtype(v.aval.dtype) for v in e.outvars]
            assert not any(d in HALF for d in outs), e


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("order", ["grad_rewrite", "rewrite_grad"])
@DTYPES
def test_complex_programs_match_float32_as_hand_written_half(name, order, dtype):
    """Both orders of grad and rewrite, under jit: float32's dtypes, finite, within 3x the
    hand-written half version's error (+ 2u), the real matmuls in half, and no complex value
    cast or clamped."""
    fn, p = MODELS[name], _params()
    ref, by_hand = _reference(name, dtype)
    if order == "grad_rewrite":
        g = jax.value_and_grad(jmp_rewrite.rewrite(fn, dtype=dtype))
    else:
        g = jmp_rewrite.rewrite(jax.value_and_grad(fn), dtype=dtype)
    out = jax.jit(g)(p)
    assert jax.tree.map(lambda a: a.dtype, out) == jax.tree.map(lambda a: a.dtype, ref)
    assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(out))
    err = _rel(out, ref)
    assert err <= 3 * by_hand + 2 * UNIT_ROUNDOFF[dtype], (err, by_hand)
    # what the rewrite emits (grad(rewrite(f)): JAX transposes the forward's casts itself)
    emitted = jmp_rewrite.rewrite(fn if order == "grad_rewrite" else jax.grad(fn), dtype=dtype)
    jaxpr = jax.make_jaxpr(emitted)(p)
    assert any(runs_in_half(e) for e in all_eqns(jaxpr) if e.primitive.name == "dot_general")
    _no_complex_value_touched(jaxpr)


@pytest.mark.parametrize("order", ["grad_rewrite", "rewrite_grad"])
@DTYPES
def test_the_issue_repro_runs_without_jit(order, dtype):
    """The issue's LRU, eager (raised ``Clip received a complex value`` in rewrite(grad))."""
    p = _params()
    if order == "grad_rewrite":
        g = jax.value_and_grad(jmp_rewrite.rewrite(lru, dtype=dtype))
    else:
        g = jmp_rewrite.rewrite(jax.value_and_grad(lru), dtype=dtype)
    ref, by_hand = _reference("lru", dtype)
    assert _rel(g(p), ref) <= 3 * by_hand + 2 * UNIT_ROUNDOFF[dtype]


@pytest.mark.parametrize("level", [None, "UNSAFE_FORCE_ALL"])
def test_no_painting_decision_touches_a_complex_value(level):
    """An equation with a complex operand or result (``abs``, ``real``, a complex ``mul``, a
    cast from complex) is never painted half, not even under UNSAFE_FORCE_ALL: TF's complex
    ops (ComplexAbs, Real, Cast from complex) are on no list."""
    p = _params()
    fn = jax.value_and_grad(s5)
    report = jmp_rewrite.explain(fn, p, dtype=F16, level=level, residuals=False)
    closed = jax.make_jaxpr(fn)(p)
    touching = {
        str(e.primitive)
        for e in all_eqns(closed)
        if any(jnp.issubdtype(a.aval.dtype, jnp.complexfloating) for a in [*e.invars, *e.outvars])
    }
    assert {"abs", "real", "imag", "mul", "convert_element_type"} <= touching
    assert report.converted  # the real matmuls are half
    complex_eqs = [
        e
        for e in report.equations
        if e.primitive in ("abs", "real", "imag", "conj", "complex")
        or any(d.startswith("complex") for d in e.out_dtypes)
        or (e.primitive == "convert_element_type" and not e.in_dtypes)  # from complex
    ]
    assert complex_eqs and not [e.path for e in complex_eqs if e.half]
    assert all(not e.float32 for e in complex_eqs)


def test_a_value_read_from_a_complex_one_overflows_as_by_hand():
    """``real(fft(x))`` is computed from the float input, not a constant: beyond float16's
    range it overflows when cast into a half matmul, as in a hand-written float16 model (the
    loss-scale optimizer then skips the step), instead of being clamped like a mask."""
    x = jnp.full((4, 64), 2000.0, jnp.float32)  # its FFT's DC term: 128000 > 65504
    w = jnp.ones((64, 8), jnp.float32) / 64

    def f(x, w):
        return jnp.real(jnp.fft.fft(x)) @ w

    by_hand = (jnp.real(jnp.fft.fft(x)).astype(jnp.float16) @ w.astype(jnp.float16)).astype(
        jnp.float32
    )
    out = jmp_rewrite.rewrite(f, dtype=F16)(x, w)
    assert np.isfinite(f(x, w)).all()
    assert not np.isfinite(by_hand).all()
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(by_hand))


def test_a_matmul_reading_a_real_part_is_no_one_hot_embedding():
    """Float8: a weight GEMM whose activation is a cast from complex (an FFT mixing layer's
    real part) is a weight GEMM, not a one-hot embedding (a cast from integers)."""
    n = 256
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((n, n)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal((n, n)) / 16, jnp.float32) for _ in range(3)]

    def f(ws, x):
        h = jnp.tanh(x @ ws[0])
        with warnings.catch_warnings():  # the imaginary part goes, as meant
            warnings.simplefilter("ignore", np.exceptions.ComplexWarning)
            h = jax.lax.convert_element_type(jnp.fft.fft(h), jnp.float32)  # FNet: real part
        return jnp.tanh(h @ ws[1]) @ ws[2]

    report = jmp_rewrite.explain(f, ws, x, dtype=BF16, fp8=True, residuals=False)
    dots = [e for e in report.equations if e.primitive == "dot_general"]
    assert [bool(e.float8) for e in dots] == [False, True, False], [e.float8_left for e in dots]
