"""Issue 29: explain's numbers against counts made another way (family 9 and the oracles).

``tests/explain_oracle.py`` counts matmul/conv FLOPs from the operand shapes, trip counts by
walking the jaxpr and shares from the equations; the painting goldens run it on every
painting of the corpus. Here that count is itself checked against XLA's
(``jax.jit(f).lower(...).cost_analysis()``, no compilation: XLA's HLO cost analysis of the
lowered program), and the issue's family 9 is pinned with numbers written by hand: a
convolution's FLOPs, the trips and FLOPs of a scan nested in a scan.

XLA counts a convolution's multiply-adds that read an input element (not the padding, not
the zeros an ``lhs_dilation`` inserts into a strided convolution's input gradient); explain
counted every tap of the window until this issue, so a stride-2 convolution's input gradient
was 4x its forward's FLOPs (``test_convolution_flops_are_xlas`` fails on that code). XLA
counts a loop body once (``test_xla_counts_a_loop_body_once``): trip counts are checked
against the independent walk, not against XLA.
"""

from __future__ import annotations

import itertools
import re

import explain_oracle
import golden_corpus
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jaxpr_walk import all_eqns

import jmp_rewrite

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

F32 = jnp.float32


def sds(*shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


def xla_flops(eqn) -> float:
    """XLA's FLOPs of one equation, bound alone at its operands' shapes (lowered only)."""
    avals = [sds(*v.aval.shape, dtype=v.aval.dtype) for v in eqn.invars]
    fun = lambda *args: eqn.primitive.bind(*args, **eqn.params)  # noqa: E731
    return jax.jit(fun).lower(*avals).cost_analysis()["flops"]


def _matmul_eqns(closed):
    return [e for e in all_eqns(closed) if e.primitive.name in explain_oracle.MATMULS]


def _explained(fun, *args, **kw):
    return jmp_rewrite.explain(fun, *args, dtype=jnp.bfloat16, residuals=False, **kw)


CONVS = [
    pytest.param(pad, stride, groups, dilation, id=f"{pad}-s{stride}-g{groups}-d{dilation}")
    for pad, stride, groups, dilation in itertools.product(
        ["VALID", "SAME", ((2, 1), (0, 3))], [1, 2], [1, 4], [1, 2]
    )
]


@pytest.mark.parametrize("pad, stride, groups, dilation", CONVS)
def test_convolution_flops_are_xlas(pad, stride, groups, dilation):
    """Family 9: every convolution of a convolution's forward and both gradients (the input
    gradient a padded, ``lhs``-dilated convolution, the kernel gradient a batch-grouped one)
    has explain's FLOPs = the independent count = XLA's."""

    def conv(x, k):
        return lax.conv_general_dilated(
            x,
            k,
            (stride, stride),
            pad,
            rhs_dilation=(dilation, dilation),
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=groups,
        )

    x, k = sds(2, 9, 8, 8), sds(3, 3, 8 // groups, 8)
    fun = jax.grad(lambda x, k: jnp.sum(conv(x, k) ** 2), argnums=(0, 1))
    closed = jax.make_jaxpr(fun)(x, k)
    eqns = _matmul_eqns(closed)
    assert len(eqns) >= 3  # forward, input gradient, kernel gradient
    report = _explained(fun, x, k)
    explained = [e.flops for e in report.equations if e.primitive == "conv_general_dilated"]
    counted = [explain_oracle.eqn_flops(e) for e in eqns]
    assert explained == counted
    assert counted == [xla_flops(e) for e in eqns]


def test_a_convolutions_flops_by_hand():
    """Family 9, numbers written out: a 3x3 SAME convolution of an 8x8 image, 4 -> 6
    channels, batch 2. Along each axis the 8 positions read 2 + 6 * 3 + 2 = 22 of their 24
    (output, tap) pairs (a border position's outer tap reads the padding), so
    2 * 2 * 6 * 4 * 22 * 22 FLOPs; VALID (6x6 outputs, all 18 pairs per axis) 2*2*6*4*18*18."""

    def conv(pad):
        return lambda x, k: lax.conv_general_dilated(
            x, k, (1, 1), pad, dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    x, k = sds(2, 8, 8, 4), sds(3, 3, 4, 6)
    same = _explained(conv("SAME"), x, k)
    valid = _explained(conv("VALID"), x, k)
    assert [e.flops for e in same.equations if e.flops] == [2 * 2 * 6 * 4 * 22 * 22]
    assert [e.flops for e in valid.equations if e.flops] == [2 * 2 * 6 * 4 * 18 * 18]
    assert same.matmul_flops == 46464 and valid.matmul_flops == 31104


DOTS = [
    pytest.param(lambda a, b: a @ b, (8, 16), (16, 32), id="matmul"),
    pytest.param(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), (3, 8, 16), (3, 16, 4), id="batch"),
    pytest.param(lambda a, b: jnp.einsum("ijk,jkl->il", a, b), (5, 6, 7), (6, 7, 3), id="two-k"),
    pytest.param(
        lambda a, b: jnp.einsum("bthd,bshd->bhts", a, b), (2, 5, 3, 4), (2, 7, 3, 4), id="attention"
    ),
    pytest.param(
        lambda a, b: lax.dot_general(a, b, (((0,), (1,)), ((), ())), preferred_element_type=F32),
        (16, 8),
        (4, 16),
        id="transposed-preferred",
    ),
]


@pytest.mark.parametrize("fun, a, b", DOTS)
def test_matmul_flops_are_xlas(fun, a, b):
    """A ``dot_general``'s FLOPs (batch, several contracting dimensions, any layout): explain
    = the independent count = XLA, forward and under ``grad``."""
    grad = jax.grad(lambda x, y: jnp.sum(fun(x, y)), argnums=(0, 1))
    closed = jax.make_jaxpr(grad)(sds(*a), sds(*b))
    eqns = _matmul_eqns(closed)
    report = _explained(grad, sds(*a), sds(*b))
    assert [e.flops for e in report.equations if e.primitive == "dot_general"] == [
        explain_oracle.eqn_flops(e) for e in eqns
    ]
    assert [explain_oracle.eqn_flops(e) for e in eqns] == [xla_flops(e) for e in eqns]


def test_xla_counts_a_loop_body_once():
    """Why trips are counted by walking the jaxpr: XLA's cost analysis counts a scan's body
    once, whatever its length (a scan of 5 matmuls costs one matmul and the loop's counter)."""
    w, x = sds(16, 16), sds(8, 16)

    def scanned(length):
        def f(w, x):
            return lax.scan(lambda c, _: (c @ w, None), x, None, length=length)[0]

        return jax.jit(f).lower(w, x).cost_analysis()["flops"]

    one = 2 * 8 * 16 * 16
    assert one <= scanned(5) < 2 * one
    assert scanned(5) == scanned(50)
    assert (
        _explained(
            lambda w, x: lax.scan(lambda c, _: (c @ w, None), x, None, length=5)[0], w, x
        ).matmul_flops
        == 5 * one
    )


def _nested(w, v, x):
    """An outer scan of 3 trips, a matmul in its body, and an inner scan of 4 trips (inside
    a jit) whose body holds another matmul: the layers of a model looped over time."""

    def inner(h, _):
        return jnp.tanh(h @ w), None

    def outer(h, _):
        h = jax.jit(lambda h: lax.scan(inner, h, None, length=4)[0])(h)
        return h @ v, None

    return lax.scan(outer, x, None, length=3)[0]


def test_trips_and_flops_of_a_scan_nested_in_a_scan():
    """Family 9: the inner matmul runs 3 x 4 = 12 times, the outer one 3 times; explain's
    trips and FLOPs say so, forward and under grad (JAX's transposed scans, nested the same
    way, plus the forward recomputed inside them)."""
    w, v, x = sds(16, 16), sds(16, 32), sds(8, 16)
    w2 = sds(32, 16)
    fun = lambda w, v, w2, x: _nested(w, v @ w2, x)  # noqa: E731 - v @ w2 is outside the loops
    report = _explained(fun, w, v, w2, x)
    dots = [(e.path, e.trips, e.flops) for e in report.equations if e.primitive == "dot_general"]
    mm = 2 * 8 * 16 * 16
    assert dots == [
        ("dot_general", 1, 2 * 16 * 32 * 16),
        ("scan/body/jit/scan/body/dot_general", 12, 12 * mm),
        ("scan/body/dot_general", 3, 3 * mm),
    ]
    assert report.matmul_flops == 2 * 16 * 32 * 16 + 15 * mm
    grad = jax.grad(lambda w, v, w2, x: jnp.sum(fun(w, v, w2, x)), argnums=(0, 1, 2))
    report = _explained(grad, w, v, w2, x)
    closed = jax.make_jaxpr(grad)(w, v, w2, x)
    assert explain_oracle.problems(closed, report) == []
    trips = sorted({e.trips for e in report.equations if e.primitive == "dot_general"})
    assert trips == [1, 3, 12]


def test_a_while_body_counts_once():
    """A ``while`` loop's trip count is not static: its body's matmul counts once (as XLA
    counts every loop body), a static ``fori_loop`` (a scan) its trips."""
    w, x = sds(16, 16), sds(8, 16)

    def loops(w, x):
        x = lax.while_loop(lambda c: c[0] < 7, lambda c: (c[0] + 1, c[1] @ w), (0, x))[1]
        return lax.fori_loop(0, 7, lambda i, c: c @ w, x)

    report = _explained(loops, w, x)
    assert [e.trips for e in report.equations if e.flops] == [1, 7]
    assert report.matmul_flops == 8 * 2 * 8 * 16 * 16


def test_summary_shares_of_float8_bfloat16_and_float32_sum_to_100():
    """Family 5: a float8 GEMM (included by its scope), a bfloat16 one and one in a float32
    region: the summary's three shares are each GEMM's FLOPs over the total, summing to 100%."""

    @jmp_rewrite.float32_region
    def exact(h, w):
        return h @ w

    def f(x, w1, w2, w3):
        with jax.named_scope("fp8"):
            h = x @ w1  # 2 * 32 * 64 * 64 = 262144
        h = jnp.tanh(h) @ w2  # 2 * 32 * 64 * 32 = 131072
        return exact(h, w3)  # 2 * 32 * 32 * 32 = 65536

    rules = jmp_rewrite.Fp8Rules(include=("fp8",), keep_first=False, keep_last=False)
    args = (sds(32, 64), sds(64, 64), sds(64, 32), sds(32, 32))
    report = jmp_rewrite.explain(f, *args, dtype=jnp.bfloat16, fp8=rules, residuals=False)
    total = 262144 + 131072 + 65536
    assert report.matmul_flops == total
    assert report.float8_flops_share == pytest.approx(262144 / total)
    assert report.half_flops_share == pytest.approx((262144 + 131072) / total)
    line = next(x for x in report.summary().splitlines() if "float8 /" in x)
    shares = [float(s) for s in re.findall(r"([\d.]+)%", line)]
    assert shares == [57.1, 28.6, 14.3]
    assert sum(shares) == pytest.approx(100, abs=0.15)
    closed = jax.make_jaxpr(f)(*args)
    assert explain_oracle.problems(closed, report) == []


def test_the_models_matmuls_match_xla():
    """Every distinct matmul and convolution of the benchmark models' train steps (the
    corpus's, forward and backward): the independent count = XLA's."""
    cases = [
        c
        for c in golden_corpus.models()
        if c.name in ("bench/resnet-step", "bench/transformer-step", "gpu/vit-adam-step")
    ]
    assert len(cases) == 3
    seen, checked = set(), 0
    for case in cases:
        for eqn in _matmul_eqns(jax.make_jaxpr(case.fun)(*case.args)):
            key = (
                eqn.primitive.name,
                tuple(tuple(v.aval.shape) for v in eqn.invars),
                str(sorted((k, str(v)) for k, v in eqn.params.items())),
            )
            if key in seen:
                continue
            seen.add(key)
            assert explain_oracle.eqn_flops(eqn) == xla_flops(eqn), key
            checked += 1
    assert checked > 30
    assert np.isfinite(checked)
