"""Issue 29: the rule families a planted bug got past -- each pinned by a rule about values.

* Family 1, matmul precision: a matmul or convolution that asks for ``HIGHEST`` (or names a
  dot algorithm) stays float32; everything below it -- ``DEFAULT``, ``HIGH`` (between the
  two), their string spellings, any pair of them, ``DotAlgorithmPreset.DEFAULT`` -- is
  painted by the lists, and runs in half with its precision kept.
* Family 4, ``while`` loops the rewrite evaluates at trace time: a condition returning a
  boolean carry as it is (``lambda c: c[0]``) reads it, so a traced initial value means a
  loop that may run (its carries painted as a running loop's), a literal ``False`` one that
  never runs (carries handed on unrounded); a carry the condition does not read -- a PRNG
  key, a token -- is no obstacle to knowing that a literal counter stops at once.
* Family 5, float8 rules: a GEMM in a loop body is every iteration's, so the program's last
  weight GEMM inside a ``scan`` over layers is no output head and runs in float8; a matmul
  both included and excluded stays bfloat16 (exclude wins).
* Family 8, TF's platform rule on GPUs faked by compute capability (6.1: no rewrite, 7.0 and
  8.0: float16), through ``platform_dtype``/``platform_choice`` and through ``dtype=None``.

Family 9 (explain's numbers) is in ``tests/test_explain_oracles.py``.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jaxpr_walk import lowered_prims, prims

import jmp_rewrite
from jmp_rewrite._src import settings

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
P = lax.Precision
A = lax.DotAlgorithmPreset
RNG = np.random.default_rng(29)


def arr(*shape, scale=0.3):
    return jnp.asarray(RNG.standard_normal(shape) * scale, F32)


X, W1, W2 = arr(8, 16), arr(16, 16), arr(16, 16)


# ------------------------------------------------------------------------------------------
# Family 1: matmul precisions and dot algorithms
# ------------------------------------------------------------------------------------------

KEPT = "keep_highest_precision_float32"
PRECISIONS = [
    pytest.param(None, False, id="None"),
    pytest.param(P.DEFAULT, False, id="DEFAULT"),
    pytest.param(P.HIGH, False, id="HIGH"),
    pytest.param(P.HIGHEST, True, id="HIGHEST"),
    pytest.param((P.DEFAULT, P.HIGH), False, id="DEFAULT,HIGH"),
    pytest.param((P.HIGH, P.DEFAULT), False, id="HIGH,DEFAULT"),
    pytest.param((P.HIGH, P.HIGHEST), True, id="HIGH,HIGHEST"),
    pytest.param((P.HIGHEST, P.DEFAULT), True, id="HIGHEST,DEFAULT"),
    pytest.param("default", False, id="'default'"),
    pytest.param("bfloat16", False, id="'bfloat16'"),
    pytest.param("high", False, id="'high'"),
    pytest.param("tensorfloat32", False, id="'tensorfloat32'"),
    pytest.param("highest", True, id="'highest'"),
    pytest.param("float32", True, id="'float32'"),
    pytest.param(A.DEFAULT, False, id="algorithm-DEFAULT"),
    pytest.param(A.F32_F32_F32, True, id="algorithm-F32_F32_F32"),
    pytest.param(A.BF16_BF16_F32, True, id="algorithm-BF16_BF16_F32"),
    pytest.param(A.TF32_TF32_F32, True, id="algorithm-TF32_TF32_F32"),
]


def _with_precision(precision):
    """A matmul of the asked precision between two default ones (so the program is
    painted): ``tanh(x @ w1) . w2 @ w1``."""

    def f(x, w1, w2):
        return jnp.dot(jnp.tanh(x @ w1), w2, precision=precision) @ w1

    return f


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("precision, kept", PRECISIONS)
def test_matmul_precision_below_highest_is_painted_by_the_lists(precision, kept, dtype):
    f = _with_precision(precision)
    painted = jmp_rewrite.paint(f, X, W1, W2, dtype=dtype)
    dots = [e for e in painted if e.primitive == "dot_general"]
    assert [e.colour for e in dots[::2]] == ["allow", "allow"]
    middle = dots[1]
    if kept:
        assert (middle.colour, middle.painted_by) == ("float32", KEPT), f"\n{painted}"
    else:
        assert (middle.colour, middle.painted_by) == ("allow", "add_allowlist_ops"), painted
    # The emitted matmul keeps the precision it was asked for, in the dtype it was painted.
    emitted = prims(jax.make_jaxpr(jmp_rewrite.rewrite(f, dtype=dtype))(X, W1, W2), "dot_general")
    traced = prims(jax.make_jaxpr(f)(X, W1, W2), "dot_general")
    assert emitted[1].params["precision"] == traced[1].params["precision"]
    emitted = emitted[1]
    want = jnp.dtype(F32) if kept else jnp.dtype(dtype)
    assert [a.aval.dtype for a in emitted.invars] == [want, want]


@pytest.mark.parametrize("precision, kept", [(P.HIGH, False), (P.HIGHEST, True), (None, False)])
def test_convolution_precision(precision, kept):
    """The same rule for a convolution (a 1-D one between two matmuls)."""

    def f(x, w, k):
        h = jnp.tanh(x @ w)[None]
        y = lax.conv_general_dilated(
            h, k, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"), precision=precision
        )
        return y[0] @ w

    k = arr(3, 16, 16)
    conv = [e for e in jmp_rewrite.paint(f, X, W1, k, dtype=F16) if e.primitive.startswith("conv")]
    assert [(e.colour, e.painted_by) for e in conv] == [
        ("float32", KEPT) if kept else ("allow", "add_allowlist_ops")
    ]


def test_precision_high_runs_in_half_and_close_to_float32():
    """``precision=HIGH`` in half precision computes what float32 does, to half's rounding;
    ``preferred_element_type=float32`` on a matmul painted half is TF's choice: the result in
    half (README, Pitfalls), cast back to float32 at the output."""

    def f(x, w1, w2):
        h = jnp.dot(jnp.tanh(x @ w1), w2, precision=P.HIGH, preferred_element_type=F32)
        return h @ w1

    want = f(X, W1, W2)
    got = jmp_rewrite.rewrite(f, dtype=F16)(X, W1, W2)
    assert got.dtype == F32
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-3)
    (_, middle, _) = prims(
        jax.make_jaxpr(jmp_rewrite.rewrite(f, dtype=F16))(X, W1, W2), "dot_general"
    )
    assert middle.params["preferred_element_type"] == F16
    assert middle.params["precision"] == (P.HIGH, P.HIGH)


# ------------------------------------------------------------------------------------------
# Family 4: while loops whose condition the rewrite evaluates
# ------------------------------------------------------------------------------------------


def _flag_loop(init):
    """``while c[0]``: the condition returns its boolean carry as it is; the body clears it
    after three trips. ``init`` gives the flag's initial value from ``x``."""

    def f(x, w):
        def body(c):
            _, h, i = c
            return i + 1 < 3, jnp.tanh(h @ w), i + 1

        return lax.while_loop(lambda c: c[0], body, (init(x), x, 0))[1]

    return f


def _carry(painted):
    (carry,) = [e for e in painted if e.primitive == "<carry>" and e.float32]
    return carry


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
def test_a_condition_returning_a_traced_boolean_carry_reads_it(dtype):
    """The flag starts traced (``sum(x) > -1e9``, True): the loop runs, its carry is painted
    as a running loop's (half, between the body's matmul and itself) and the result is the
    three-trip one, to half's rounding."""
    f = _flag_loop(lambda x: jnp.sum(x) > -1e9)
    carry = _carry(jmp_rewrite.paint(f, X, W1, dtype=dtype))
    assert carry.colour == "allow", carry
    assert carry.painted_by != "keep_unrun_loop_carries_float32"
    want = f(X, W1)
    got = jax.jit(jmp_rewrite.rewrite(f, dtype=dtype))(X, W1)
    assert not np.allclose(want, X)  # the loop ran
    np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("start, runs", [(True, True), (False, False)])
def test_a_condition_returning_a_literal_boolean_carry(start, runs):
    """A literal initial flag: ``True`` runs the loop (painted as above); ``False`` never runs
    it, so the carry hands ``x`` on unrounded (kept float32, the output bit-exact)."""
    f = _flag_loop(lambda x: start)
    carry = _carry(jmp_rewrite.paint(f, X, W1, dtype=F16))
    got = jmp_rewrite.rewrite(f, dtype=F16)(X, W1)
    if runs:
        assert carry.colour == "allow", carry
        np.testing.assert_allclose(got, f(X, W1), rtol=3e-2, atol=3e-2)
    else:  # the loop's result is an output, a copy of x: the first rule to keep it says so
        assert carry.colour == "float32", carry
        assert carry.painted_by in ("keep_output_copies_float32", "keep_unrun_loop_carries_float32")
        np.testing.assert_array_equal(got, X)


@pytest.mark.parametrize("stop", [0, 2])
def test_a_condition_constant_made_in_the_function(stop):
    """``n = jnp.int32(stop)`` made inside the function reaches the condition as a literal
    operand (a condition constant): with ``stop = 0`` the loop never runs and hands ``x`` on
    bit-exact; with 2 it runs in half."""

    def f(x, w):
        n = jnp.int32(stop)
        body = lambda c: (c[0] + 1, jnp.tanh(c[1] @ w))  # noqa: E731
        return lax.while_loop(lambda c: c[0] < n, body, (0, x))[1]

    got = jmp_rewrite.rewrite(f, dtype=F16)(X, W1)
    if stop:
        np.testing.assert_allclose(got, f(X, W1), rtol=3e-2, atol=3e-2)
    else:
        np.testing.assert_array_equal(got, X)


def _key_loop(stop):
    """A literal counter, a PRNG key the condition never reads, and an activation."""

    def f(x, w, key):
        def body(c):
            i, k, h = c
            k, sub = jax.random.split(k)
            return i + 1, k, jnp.tanh(h @ w) + 0.01 * jax.random.normal(sub, h.shape)

        return lax.while_loop(lambda c: c[0] < stop, body, (0, key, x))[2]

    return f


@pytest.mark.parametrize("key", ["typed", "raw"])
@pytest.mark.parametrize("stop", [3, 0])
def test_an_unread_key_carry_with_a_literal_counter(stop, key):
    """No TypeError from the key the condition does not read (a typed key has no NumPy
    dtype); the counter alone decides: 3 trips run (half, close to float32), 0 trips hand
    ``x`` on bit-exact."""
    k = jax.random.key(1) if key == "typed" else jax.random.PRNGKey(1)
    f = _key_loop(stop)
    got = jmp_rewrite.rewrite(f, dtype=F16)(X, W1, k)
    if stop:
        np.testing.assert_allclose(got, f(X, W1, k), rtol=3e-2, atol=3e-2)
        assert _carry(jmp_rewrite.paint(f, X, W1, k, dtype=F16)).colour == "allow"
    else:
        np.testing.assert_array_equal(got, X)
        carry = _carry(jmp_rewrite.paint(f, X, W1, k, dtype=F16))
        assert carry.colour == "float32", carry


# ------------------------------------------------------------------------------------------
# Family 5: float8 rules
# ------------------------------------------------------------------------------------------

SMALL = dict(min_dim=16, multiple=16)


def _layers(x, w_in, ws):
    """An input layer, then a scan over layers: the program's last weight GEMM is the scan
    body's (no head after it)."""
    h = x @ w_in

    def layer(h, w):
        with jax.named_scope("blk"):
            return jnp.tanh(h @ w), None

    return lax.scan(layer, h, ws)[0]


def _fp8_dots(report):
    return [
        (e.path, e.float8, e.float8_left) for e in report.equations if e.primitive == "dot_general"
    ]


def test_the_last_weight_gemm_in_a_scan_body_runs_in_float8():
    args = (arr(32, 32), arr(32, 32), arr(4, 32, 32))
    rules = jmp_rewrite.Fp8Rules(**SMALL)
    report = jmp_rewrite.explain(_layers, *args, dtype=BF16, fp8=rules, residuals=False)
    assert _fp8_dots(report) == [
        ("dot_general", "", "the first weight GEMM (the input layer) stays bfloat16"),
        ("scan/body/dot_general", "e4m3 x e4m3", ""),
    ]
    got, want = jmp_rewrite.rewrite(_layers, dtype=BF16, fp8=rules)(*args), _layers(*args)
    # e4m3 rounds each operand to 2^-4: measured 0.077-0.107 of the norm over 31 draws of
    # these shapes (bfloat16: 0.006-0.008); a wrong scale or format is off by far more
    assert np.linalg.norm(got - want) < 0.15 * np.linalg.norm(want)


def test_a_matmul_both_included_and_excluded_stays_bfloat16():
    args = (arr(32, 32), arr(32, 32), arr(4, 32, 32))
    rules = jmp_rewrite.Fp8Rules(include=("blk*",), exclude=("blk*",), **SMALL)
    report = jmp_rewrite.explain(_layers, *args, dtype=BF16, fp8=rules, residuals=False)
    assert _fp8_dots(report)[1] == ("scan/body/dot_general", "", "excluded by 'blk*'")
    # included only: float8; the first layer included by its source line's pattern too
    rules = jmp_rewrite.Fp8Rules(include=("blk*", "*test_rule_families.py:*"), **SMALL)
    report = jmp_rewrite.explain(_layers, *args, dtype=BF16, fp8=rules, residuals=False)
    assert [f for _, f, _ in _fp8_dots(report)] == ["e4m3 x e4m3", "e4m3 x e4m3"]


# ------------------------------------------------------------------------------------------
# Family 8: the platform's dtype on (fake) GPUs
# ------------------------------------------------------------------------------------------


class FakeDevice:
    """What ``platform_choice`` reads of a ``jax.Device``."""

    def __init__(self, platform, compute_capability=None):
        self.platform = platform
        if compute_capability is not None:
            self.compute_capability = compute_capability


DEVICES = [
    pytest.param(FakeDevice("gpu", "6.1"), None, "compute capability is 6.1", id="gpu-6.1"),
    pytest.param(FakeDevice("gpu", "7.0"), F16, "", id="gpu-7.0"),
    pytest.param(FakeDevice("cuda", "7.5"), F16, "", id="cuda-7.5"),
    pytest.param(FakeDevice("gpu", "8.0"), F16, "", id="gpu-8.0"),
    pytest.param(FakeDevice("gpu", "9.0"), F16, "", id="gpu-9.0"),
    pytest.param(FakeDevice("gpu", "6.9"), None, "compute capability is 6.9", id="gpu-6.9"),
    pytest.param(FakeDevice("gpu"), None, "reports no compute capability", id="gpu-unknown"),
    pytest.param(FakeDevice("tpu"), BF16, "", id="tpu"),
    pytest.param(FakeDevice("cpu"), None, "the default device is a cpu", id="cpu"),
]


@pytest.mark.parametrize("device, dtype, why", DEVICES)
def test_platform_choice_by_compute_capability(device, dtype, why):
    got, reason = settings.platform_choice(device)
    assert got == (None if dtype is None else np.dtype(dtype))
    assert jmp_rewrite.platform_dtype(device) == got
    assert (why in reason) and (bool(reason) == (dtype is None))


@pytest.mark.parametrize("device, dtype, why", DEVICES)
def test_dtype_none_follows_the_default_device(device, dtype, why, monkeypatch):
    """``rewrite(f)`` and ``explain(f)`` with ``dtype=None`` on a machine whose first device
    is ``device`` (``jax.devices`` faked): explain and the warning speak of that device
    (float16 from compute capability 7.0, off below it with the reason, bfloat16 on a TPU);
    the program decides where it is lowered (issue 37.3): bfloat16 for a TPU, for CUDA this
    machine's GPU's rule (float16 when it has none: a deviceless compile), float32 else."""
    monkeypatch.setattr(jax, "devices", lambda *a: [device])
    f = _with_precision(None)
    report = jmp_rewrite.explain(f, X, W1, W2, residuals=False)
    assert report.dtype == ("none" if dtype is None else np.dtype(dtype).name)
    assert why in report.off_reason
    rewritten = jmp_rewrite.rewrite(f)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        emitted = jax.make_jaxpr(rewritten)(X, W1, W2)
    on_gpu = device.platform in ("gpu", "cuda")
    cuda = (dtype or F32) if on_gpu else F16
    for platform, want in (("tpu", BF16), ("cuda", cuda), ("cpu", F32), ("rocm", F32)):
        dots = lowered_prims(emitted, "dot_general", platform)
        assert {a.aval.dtype for e in dots for a in e.invars} == {np.dtype(want)}, platform
    off = [w for w in caught if issubclass(w.category, jmp_rewrite.RewriteOffWarning)]
    assert len(off) == (dtype is None)
    if off:
        assert why in str(off[0].message)
    assert settings.platform_choice()[0] == (None if dtype is None else np.dtype(dtype))
