"""Issue 28 item 6: float8 under ``shard_map``, and saying so when float8 runs nothing.

Inside ``shard_map`` a replicated parameter read beside device-varying activations is
``pvary``-ed first: an annotation that computes nothing. The parameter origin (what makes a
matmul a weight GEMM, and an update of it state) now passes through it, so float8 selection
sees through ``shard_map`` at the per-device shapes the body computes on, in both orders
(``shard_map(rewrite(step))`` and ``rewrite(shard_map(step))``); before, neither held a
float8 cast. Eight host devices: ``tests/multidevice_fp8.py``, in a subprocess.

When ``fp8=True`` (or rules) runs no matmul in float8, a
:class:`jmp_rewrite.Fp8NoneSelectedWarning` says why, once per function and reason, and
``explain`` (its summary, ``fp8_none``, and a ``float8_none`` lint finding) says it too.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jaxpr_walk import all_eqns, runs_in_half
from multidevice import run_on_eight_devices

import jmp_rewrite as jr

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

BF16 = jnp.bfloat16
N = 256  # per-device rows and widths: float8's smallest GEMM (Fp8Rules.min_dim)


def float8_casts(fun, *args) -> int:
    jaxpr = jax.make_jaxpr(fun)(*args)
    return sum(
        1
        for e in all_eqns(jaxpr)
        if e.primitive.name == "convert_element_type" and "float8" in str(e.params["new_dtype"])
    )


def _inputs(rows: int = N):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((rows, N)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal((N, N)) / 16, jnp.float32) for _ in range(4)]
    return ws, x


def make_step(axis: str | None):
    """An MLP train step; with ``axis``, its gradients and loss averaged over that axis."""

    def step(ws, x):
        def loss(ws):
            h = x
            for w in ws:
                h = jnp.tanh(h @ w)
            return jnp.mean(h**2)

        value, grads = jax.value_and_grad(loss)(ws)
        if axis is not None:
            value, grads = jax.lax.pmean((value, grads), axis)
        return value, [w - 0.1 * g for w, g in zip(ws, grads, strict=True)]

    return step


def _one_device(fun):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    return jax.shard_map(fun, mesh=mesh, in_specs=(P(), P("d")), out_specs=(P(), P()))


@pytest.mark.parametrize("order", ["shard_map_of_rewrite", "rewrite_of_shard_map"])
def test_float8_sees_through_shard_map(order):
    """One device (eight: ``test_float8_under_shard_map_on_eight_devices``); under jit (the
    choice is made when the program is traced: eager calls trace the same way)."""
    ws, x = _inputs()
    plain = jr.rewrite(make_step(None), dtype=BF16, fp8=True)
    if order == "shard_map_of_rewrite":
        fn = _one_device(jr.rewrite(make_step("d"), dtype=BF16, fp8=True))
    else:
        fn = jr.rewrite(_one_device(make_step("d")), dtype=BF16, fp8=True)
    expected = float8_casts(plain, ws, x)
    assert expected >= 8 and float8_casts(fn, ws, x) == expected
    loss, new = jax.jit(fn)(ws, x)
    ref_loss, ref_new = jax.jit(plain)(ws, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, b in zip(new, ref_new, strict=True):  # the same quantized GEMMs, fused otherwise
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    report = jr.explain(_one_device(make_step("d")), ws, x, dtype=BF16, fp8=True, residuals=False)
    assert report.float8_flops_share and not report.fp8_none


def float8_gemms(fun, *args) -> int:
    """The ``dot_general`` equations of ``fun``'s jaxpr reading a float8 operand."""
    return sum(
        1
        for e in all_eqns(jax.make_jaxpr(fun)(*args))
        if e.primitive.name == "dot_general"
        and any("float8" in str(v.aval.dtype) for v in e.invars)
    )


def sharded_forward(ws, x, axis: str = "d"):
    """An MLP's loss, its forward only: ``jax.grad`` of its ``shard_map`` transposes it."""
    h = x
    for w in ws:
        h = jnp.tanh(h @ w)
    return jax.lax.pmean(jnp.mean(h**2), axis)


def test_the_gradient_gemms_of_a_forward_in_shard_map_run_in_float8():
    """``rewrite(grad(f))`` with ``f``'s forward inside ``shard_map``: the 2 middle forward
    GEMMs run in float8 (the first and last are kept) and so do their 4 gradient GEMMs,
    in the transposed ``shard_map``, paired with the forward ones through the values they
    share (the body's parameters named as the caller's arguments; else 0 of 4). Eight
    devices: ``test_float8_under_shard_map_on_eight_devices``."""
    ws, x = _inputs()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    loss = jax.shard_map(sharded_forward, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
    assert float8_gemms(jr.rewrite(loss, dtype=BF16, fp8=True), ws, x) == 2
    assert float8_gemms(jr.rewrite(jax.grad(loss), dtype=BF16, fp8=True), ws, x) == 2 + 4
    assert float8_gemms(jax.grad(jr.rewrite(loss, dtype=BF16, fp8=True)), ws, x) == 2 + 4


def test_a_state_updated_in_shard_map_stays_float32():
    """The SGD step inside ``shard_map`` reads the ``pvary``-ed parameter: an update of it
    still, kept float32 (before, it was rounded to bfloat16: 1e-4 off, 100x the step's own
    rounding)."""
    ws, x = _inputs(8)
    w = ws[0]

    def step(w, x):
        g = x.T @ jnp.tanh(x @ w) / x.shape[0]  # a device-varying gradient
        return w - 1e-3 * g

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    shard = lambda f: jax.shard_map(f, mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d"))  # noqa: E731
    ref = shard(step)(w, x)
    for fn in (jr.rewrite(shard(step), dtype=BF16), shard(jr.rewrite(step, dtype=BF16))):
        out = jax.jit(fn)(w, x)
        assert out.dtype == jnp.float32
        np.testing.assert_allclose(out, ref, rtol=0, atol=3e-5)
        jaxpr = jax.make_jaxpr(fn)(w, x)
        assert any(runs_in_half(e) for e in all_eqns(jaxpr) if e.primitive.name == "dot_general")


# -- saying so --------------------------------------------------------------------------------


def small(ws, x):
    return jnp.tanh(x @ ws[0]) @ ws[1]


def _small_inputs():
    return [jnp.ones((16, 16)) / 16] * 2, jnp.ones((8, 16))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_fp8_selecting_nothing_says_why_once(jit):
    ws, x = _small_inputs()
    fn = jr.rewrite(small, dtype=BF16, fp8=True)
    call = jax.jit(fn) if jit else fn
    with pytest.warns(jr.Fp8NoneSelectedWarning) as record:
        out = call(ws, x)
    assert len(record) == 1 and record[0].filename == __file__
    message = str(record[0].message)
    assert message.startswith("rewrite(small) runs no matmul in float8 under fp8=True: ")
    assert "each of its 2 half-precision matmuls stays bfloat16" in message
    assert "the first weight GEMM" in message and "the last weight GEMM" in message
    np.testing.assert_allclose(out, small(ws, x), rtol=2e-2, atol=2e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(ws, x + 1)  # once per function and reason
        fn(ws, x + 2)


def test_fp8_with_nothing_in_half_says_so():
    fn = jr.rewrite(lambda x: jnp.exp(x).sum(), dtype=BF16, fp8=True)
    with pytest.warns(jr.Fp8NoneSelectedWarning, match="no matmul runs in half precision"):
        fn(jnp.ones(4))


def test_shape_reasons_are_counted_by_kind():
    ws, x = _small_inputs()
    rules = jr.Fp8Rules(keep_first=False, keep_last=False)
    with pytest.warns(jr.Fp8NoneSelectedWarning, match=r"2 x shape: M=8, N=16, K=16"):
        jr.rewrite(small, dtype=BF16, fp8=rules)(ws, x)


def deep(ws, x):
    for w in ws[:-1]:
        x = jnp.tanh(x @ w)
    return x @ ws[-1]


_SHAPE_RULE = "(float8 needs M, N, K >= 256 and multiples of 16)"
_FIRST = "the first weight GEMM (the input layer) stays bfloat16"
_LAST = "the last weight GEMM (the output head) stays bfloat16"


@pytest.mark.parametrize(
    "widths, said",
    [
        ([16] * 5, f"2 x shape: M=8, N=16, K=16 {_SHAPE_RULE}; 1 x {_FIRST}; 1 x {_LAST}"),
        (  # shapes of two kinds: counted together, the first named
            [16, 32, 16, 16, 16],
            f"2 x shape: M=8, N=16, K=32 {_SHAPE_RULE}, the first of them; 1 x {_FIRST}; "
            f"1 x {_LAST}",
        ),
        ([16] * 3, f"1 x {_FIRST}; 1 x {_LAST}"),
    ],
    ids=["four", "five-shapes-differ", "two"],
)
def test_the_warning_counts_each_reason(widths, said):
    """Each reason is counted by the matmuls it holds back, not by all of them (``2 x`` for
    the one first weight GEMM would be wrong)."""
    ws = [jnp.ones((a, b)) / a for a, b in zip(widths, widths[1:])]
    x = jnp.ones((8, widths[0]))
    with pytest.warns(jr.Fp8NoneSelectedWarning) as record:
        jr.rewrite(deep, dtype=BF16, fp8=True)(ws, x)
    n = len(ws)
    assert [str(r.message) for r in record] == [
        f"rewrite(deep) runs no matmul in float8 under fp8=True: each of its {n} "
        f"half-precision matmuls stays bfloat16: {said}"
    ]


def test_no_warning_when_float8_runs_or_is_off():
    ws, x = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error", jr.Fp8NoneSelectedWarning)
        jr.rewrite(make_step(None), dtype=BF16, fp8=True)(ws, x)
        jr.rewrite(small, dtype=BF16)(*_small_inputs())


def test_rewrite_jaxpr_and_explain_say_it_too():
    ws, x = _small_inputs()
    closed = jax.make_jaxpr(small)(ws, x)
    with pytest.warns(jr.Fp8NoneSelectedWarning, match="^rewrite_jaxpr runs no matmul"):
        new = jr.rewrite_jaxpr(closed, dtype=BF16, fp8=True)
    assert any(runs_in_half(e) for e in new.jaxpr.eqns if e.primitive.name == "dot_general")
    report = jr.explain(small, ws, x, dtype=BF16, fp8=True, residuals=False)
    assert report.fp8_none.startswith("each of its 2 half-precision matmuls stays bfloat16")
    assert f"float8: no matmul under fp8=True: {report.fp8_none}" in report.summary()
    assert report.to_dict()["fp8_none"] == report.fp8_none
    (finding,) = [f for f in report.lint() if f.kind == "float8_none"]
    assert report.fp8_none in finding.message and "Fp8Rules(include=" in finding.change
    assert len(finding.equations) == 2
    plain = jr.explain(small, ws, x, dtype=BF16, residuals=False)
    assert not plain.fp8_none and not [f for f in plain.lint() if f.kind == "float8_none"]


# -- eight devices ----------------------------------------------------------------------------


def test_float8_under_shard_map_on_eight_devices():
    assert run_on_eight_devices("multidevice_fp8.py").strip().endswith("OK")


def _lowered_dot_dtypes(fun, platform, *args) -> set[str]:
    """The operand element types of the dots of ``fun`` lowered for ``platform`` (from this
    CPU host: cross-platform lowering needs no plugin), read from the StableHLO text."""
    text = jax.jit(fun).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    found = set()
    for line in text.splitlines():
        if "stablehlo.dot_general" in line or "stablehlo.convolution" in line:
            found.update(t for t in ("f8E4M3FN", "f8E5M2", "bf16", "f32") if f"x{t}>" in line)
    return found


@pytest.mark.parametrize("order", ["rewrite_of_grad", "grad_of_rewrite"])
def test_a_tpu_lowering_runs_the_selected_matmuls_in_bfloat16(order):
    """XLA:TPU has no native float8 matmul on the generations it compiles here: the TPU
    branch is the bfloat16 matmul; CUDA's is float8; the CPU's the exact emulation."""
    ws, x = _inputs()

    def loss(ws, x):
        h = x
        for w in ws:
            h = jnp.tanh(h @ w)
        return jnp.mean(h**2)

    if order == "rewrite_of_grad":
        fun = jr.rewrite(jax.grad(loss), dtype=BF16, fp8=True)
    else:
        fun = jax.grad(jr.rewrite(loss, dtype=BF16, fp8=True))
    tpu = _lowered_dot_dtypes(fun, "tpu", ws, x)
    cuda = _lowered_dot_dtypes(fun, "cuda", ws, x)
    assert "f8E4M3FN" in cuda and "f8E5M2" in cuda
    assert "bf16" in tpu and not {"f8E4M3FN", "f8E5M2"} & tpu
    # The CPU runs the float8 rounding (emulated exactly), as before.
    assert float8_casts(fun, ws, x) > 0
    got = fun(ws, x)
    want = jax.grad(loss)(ws, x)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=0.2, atol=2e-4)


def test_on_a_tpu_the_warning_says_the_matmuls_run_bfloat16(monkeypatch):
    """Where the default device is a TPU, fp8=True says once that its float8 matmuls run as
    bfloat16 there (why_none names the platform and the count)."""
    from jmp_rewrite._src import fp8 as fp8_lib

    monkeypatch.setattr(fp8_lib, "_default_platform", lambda: "tpu")
    ws, x = _inputs()
    with pytest.warns(jr.Fp8NoneSelectedWarning) as record:
        jr.rewrite(make_step(None), dtype=BF16, fp8=True)(ws, x)
    (message,) = {str(r.message) for r in record}
    assert "matmuls selected for float8, but on a TPU they run as bfloat16" in message
    assert "v5e, v5p or v6e" in message


def test_on_a_tpu_a_program_that_selects_nothing_says_why_as_elsewhere(monkeypatch):
    """The TPU's reason is for matmuls selected for float8; with none selected the warning
    gives the reasons each stayed bfloat16, as on any platform."""
    from jmp_rewrite._src import fp8 as fp8_lib

    monkeypatch.setattr(fp8_lib, "_default_platform", lambda: "tpu")
    ws, x = _small_inputs()
    with pytest.warns(jr.Fp8NoneSelectedWarning) as record:
        jr.rewrite(small, dtype=BF16, fp8=True)(ws, x)
    (message,) = {str(r.message) for r in record}
    assert "each of its 2 half-precision matmuls stays bfloat16" in message
    assert "on a TPU" not in message and "selected for float8" not in message
