"""Issue 15: no extra memory over hand-written mixed precision, each cause closed on purpose.

The GPU figures (``benchmarks/gpu_memory.py``, a deviceless XLA:GPU compile) traced the
rewrite's extra memory to four painting decisions; each is pinned here by behaviour, and
checked against float32 numerically:

1. tanh-GELU in bfloat16: ``x**3`` (TF ``Pow``) is infer in the bfloat16 lists
   (``op_lists.DIFFERENCES_FROM_TF``), so the whole GELU runs in half;
2. tanh-GELU in float16: the power only feeds the tanh, where an overflow saturates
   (``paint.release_saturated_powers``): computed in float32, it spreads no deny;
3. normalization in float16: statistics kept float32 spread no deny into the normalized
   activations, the residual add and the ReLU (TF's fused batch norm is infer);
4. a float32 value read in float32 is never a half-precision round trip
   (``paint.keep_float32_reads_unrounded``: the LayerNorm scale of GPT's first block);

and the loss-scale optimizer's finiteness check is a few fused reductions, exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jmp_rewrite as jr
from jmp_rewrite._src.loss_scale.finite import (
    LEAVES_PER_REDUCTION,
    any_non_finite,
    any_non_finite_fused,
    check_finite,
)

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

F16, BF16 = jnp.float16, jnp.bfloat16
KEY = jax.random.key(0)


def _colours(records, primitive):
    return [e.colour for e in records if e.primitive == primitive]


def _mlp_loss(w1, w2, x):
    return jnp.mean(jax.nn.gelu(x @ w1, approximate=True) @ w2)


def _mlp_args(scale=1.0):
    k1, k2, k3 = jax.random.split(KEY, 3)
    w1 = jax.random.normal(k1, (16, 32)) * 0.3
    w2 = jax.random.normal(k2, (32, 8)) * 0.3
    x = jax.random.normal(k3, (8, 16)) * scale
    return w1, w2, x


# ------------------------------------------------------------------------------ (1), (2) GELU


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_tanh_gelu_runs_in_half_forward_and_backward(dtype, leak_checking):
    records = jr.paint(jax.grad(_mlp_loss, argnums=(0, 1)), *_mlp_args(), dtype=dtype)
    # The GELU's tanh, its scalings and sums, and their derivatives: all half.
    assert _colours(records, "tanh") == ["allow"]
    gelu = [e for e in records if e.primitive in ("add", "sub") and e.float32]
    assert gelu and all(e.half for e in gelu), [(e.primitive, e.colour) for e in gelu]
    (cube,) = [e for e in records if e.primitive == "integer_pow" and e.key == "integer_pow"]
    if dtype == BF16:
        # bfloat16 has float32's exponent range: x**3 is infer (TF: deny).
        assert cube.list == "infer" and cube.half
    else:
        # float16: x**3 stays float32 (TF's Pow), but feeding only the tanh it spreads no deny.
        assert cube.list == "deny" and cube.colour == "float32"
        assert cube.painted_by == "release_saturated_powers"
    gelu = ("integer_pow", "tanh", "add", "sub", "add_any")
    assert not any(e.colour == "deny" for e in records if e.primitive in gelu)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_tanh_gelu_numerics_against_float32(dtype):
    args = _mlp_args()
    ref = jax.grad(_mlp_loss, argnums=(0, 1))(*args)
    got = jax.jit(jr.rewrite(jax.grad(_mlp_loss, argnums=(0, 1)), dtype=dtype))(*args)
    tol = 2e-2 if dtype == BF16 else 4e-3
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol * float(jnp.abs(r).max()))


def test_float16_gelu_saturates_where_the_power_overflows():
    # |x| > 40: x**3 overflows float16; the tanh saturates to +-1 and the GELU is x or 0,
    # as in float32 (no NaN, no Inf).
    w = jnp.eye(4)
    x = jnp.array([[50.0, -50.0, 300.0, -300.0]])
    f = lambda w, x: jax.nn.gelu(x @ w, approximate=True) @ w  # noqa: E731
    got = jr.rewrite(f, dtype=F16)(w, x)
    np.testing.assert_array_equal(got, [[50.0, 0.0, 300.0, 0.0]])


def test_a_power_read_elsewhere_stays_deny_in_float16():
    def f(w, x):
        h = x @ w
        cube = h**3
        return (jnp.tanh(cube) + cube) @ w  # the power's value reaches the sum unsaturated

    (cube,) = [e for e in jr.paint(f, jnp.eye(4), jnp.ones((2, 4)), dtype=F16)][1:2]
    assert cube.primitive == "integer_pow" and cube.colour == "deny"


def test_a_power_scaled_by_zero_or_summed_with_itself_stays_deny():
    def by_zero(w, x):
        h = x @ w
        return jnp.tanh(h**3 * 0.0) @ w  # 0 * inf is NaN

    def with_itself(w, x):
        c = (x @ w) ** 3
        return jnp.tanh(c - c) @ w

    for f in (by_zero, with_itself):
        records = jr.paint(f, jnp.eye(4), jnp.ones((2, 4)), dtype=F16)
        assert _colours(records, "integer_pow") == ["deny"], f.__name__


# ------------------------------------------------------------------------- (3) normalization


def _batch_norm(x, scale, bias):
    mean = jnp.mean(x, axis=(0, 1, 2))
    var = jnp.mean(jnp.square(x - mean), axis=(0, 1, 2))
    return (x - mean) * lax.rsqrt(var + 1e-5) * scale + bias


def _conv(x, w):
    return lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def _residual_block_forward(params, x):
    """A ResNet stage: a stem conv, then conv-BN-ReLU-conv-BN, the residual add, ReLU."""
    h = _conv(x, params["w0"])
    y = jax.nn.relu(_batch_norm(_conv(h, params["w1"]), params["s1"], params["b1"]))
    y = _batch_norm(_conv(y, params["w2"]), params["s2"], params["b2"])
    return jax.nn.relu(y + h)


def _residual_block(params, x):
    return jnp.mean(_residual_block_forward(params, x) ** 2)


def _block_args():
    k0, k1, k2, k3 = jax.random.split(KEY, 4)
    params = {
        "w0": jax.random.normal(k0, (3, 3, 8, 8)) * 0.2,
        "w1": jax.random.normal(k1, (3, 3, 8, 8)) * 0.2,
        "w2": jax.random.normal(k2, (3, 3, 8, 8)) * 0.2,
        "s1": jnp.ones(8),
        "b1": jnp.zeros(8),
        "s2": jnp.ones(8),
        "b2": jnp.zeros(8),
    }
    return params, jax.random.normal(k3, (4, 6, 6, 8))


def test_float16_normalization_statistics_float32_activations_half():
    records = jr.paint(_residual_block_forward, *_block_args(), dtype=F16)
    stats = [e for e in records if e.painted_by == "keep_normalization_statistics_float32"]
    assert {e.primitive for e in stats} >= {"reduce_sum", "rsqrt"}
    assert all(e.colour == "float32" for e in stats)  # float32, and no deny from them
    assert not any(e.colour == "deny" for e in records)
    # The ReLUs and the residual add run in half; the normalization itself (the centring,
    # the product by the statistic and the affine) computes in float32, spreading nothing,
    # and is rounded to half once for the ReLU (paint/norms.py).
    assert _colours(records, "max") == ["allow", "allow"]
    norm = [e for e in records if e.painted_by == "compute_normalizations_float32"]
    assert {e.primitive for e in norm} >= {"sub", "mul", "add"}
    assert all(e.colour == "float32" for e in norm)
    rest = [e for e in records if e.primitive in ("add", "mul") and e not in stats + norm]
    assert len(rest) >= 1 and all(e.half for e in rest), rest  # the residual add


def test_float16_normalization_numerics_against_float32():
    params, x = _block_args()
    ref_loss, ref = jax.value_and_grad(_residual_block)(params, x)
    loss, got = jax.jit(jr.rewrite(jax.value_and_grad(_residual_block), dtype=F16))(params, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-2)
    for key in params:
        scale = float(jnp.abs(ref[key]).max())
        np.testing.assert_allclose(got[key], ref[key], atol=2e-2 * scale)


# ------------------------------------------------------------------ (4) float32 reads unrounded

S = np.full((4,), 1 + 2.0**-13, np.float32)  # no float16 or bfloat16 number: rounds to 1


def _shared_broadcast(x, s, w):
    sb = lax.broadcast_in_dim(s, x.shape, (1,))
    kept = jnp.exp(x) * sb  # float32: exp is deny
    half = (x @ w) * sb  # half: follows the matmul
    return kept, half


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_a_float32_op_reads_a_shared_broadcast_unrounded(dtype):
    x, w = jnp.ones((2, 4)) * 0.5, jnp.eye(4)
    records = jr.paint(_shared_broadcast, x, S, w, dtype=dtype)
    (bcast,) = [e for e in records if e.primitive == "broadcast_in_dim"]
    assert bcast.colour == "float32" and bcast.painted_by == "keep_float32_reads_unrounded"
    assert _colours(records, "mul") == ["deny", "allow"]
    kept, _ = jax.jit(jr.rewrite(_shared_broadcast, dtype=dtype))(x, S, w)
    np.testing.assert_array_equal(kept, jnp.exp(x) * S)  # exact: S was never rounded


def test_layer_norm_scale_is_not_rounded_when_its_multiply_is_float32():
    # GPT's first LayerNorm: nothing half upstream, so the normalization is float32; the
    # backward multiply by the same broadcast scale is half.
    def loss(scale, w, x):
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
        h = (x - mean) * lax.rsqrt(var + 1e-5) * scale
        return jnp.mean((h @ w) ** 2), h

    x = jax.random.normal(KEY, (4, 8))
    args = (np.full((8,), 1 + 2.0**-13, np.float32), jnp.eye(8), x)
    step = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    records = jr.paint(step, *args, dtype=BF16)
    assert all(c == "float32" for c in _colours(records, "broadcast_in_dim")[:1])
    (_, h), _ = jax.jit(jr.rewrite(step, dtype=BF16))(*args)
    (_, h_ref), _ = step(*args)
    np.testing.assert_allclose(h, h_ref, rtol=1e-6)  # float32 throughout, scale unrounded


def test_a_clear_op_after_a_half_producer_is_still_half():
    # Only data movement of float32 values stays float32; a transpose of a matmul's result
    # read by a float32 op is a half value already.
    def f(x, w):
        t = (x @ w).T
        return jnp.exp(t), t @ w

    records = jr.paint(f, jnp.ones((4, 4)), jnp.eye(4), dtype=F16)
    assert _colours(records, "transpose") == ["allow"]


# ------------------------------------------------------------------------- finiteness check


def _leaves():
    return [
        jnp.ones((4, 3)),
        jnp.ones((5,), F16),
        jnp.array(2.0),
        jnp.ones((2, 2, 3), BF16),
        jnp.zeros((0, 3)),
        jnp.arange(3),  # integer leaves are ignored
    ]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_fused_finiteness_check_is_exact(jit):
    inv = jnp.float32(1.0 / 1024)

    def bad(leaves, scaled=True):
        f = lambda leaves: any_non_finite_fused(leaves, inv, scaled=scaled)  # noqa: E731
        return bool((jax.jit(f) if jit else f)(leaves))

    leaves = _leaves()
    assert not bad(leaves)
    big = leaves[:]
    big[0] = big[0].at[1].set(3.0e38)  # finite values whose sum overflows: still finite
    big[1] = big[1].at[0].set(65504.0)
    assert not bad(big)
    for value in (jnp.nan, jnp.inf, -jnp.inf):
        for i, index in ((0, (2, 1)), (1, 4), (2, ()), (3, (1, 0, 2))):
            poisoned = leaves[:]
            poisoned[i] = poisoned[i].at[index].set(value)
            assert bad(poisoned), (value, i)
    assert not bad([jnp.arange(3)]) and not bad([])
    # Unscaled (a scale below 1): g * inv_scale overflows float32 -> non-finite.
    assert bad([jnp.full((3,), 3.0e38)], scaled=False) is False
    huge = jnp.float32(4.0)
    assert bool(any_non_finite_fused([jnp.full((3,), 3.0e38)], huge, scaled=False))


def test_fused_finiteness_check_past_one_reduction():
    leaves = [jnp.full((i % 7 + 1,), 1.0) for i in range(2 * LEAVES_PER_REDUCTION + 5)]
    check = jax.jit(lambda leaves: any_non_finite_fused(leaves, jnp.float32(1.0), scaled=True))
    assert not bool(check(leaves))
    for i in (0, LEAVES_PER_REDUCTION, len(leaves) - 1):
        poisoned = leaves[:]
        poisoned[i] = poisoned[i].at[0].set(jnp.nan)
        assert bool(check(poisoned)), i


def test_finiteness_check_per_platform():
    # Decided at lowering: a GPU program gets one concatenated reduction, the CPU one the
    # per-leaf "dot" check; both answer the same on CPU.
    leaves = [jnp.ones((4, 3)), jnp.ones((5,))]

    def f(leaves):
        return any_non_finite(leaves, jnp.float32(0.5), scale_at_least_one=True, whole_leaves=True)

    cuda = jax.jit(f).trace(leaves).lower(lowering_platforms=("cuda",)).as_text()
    cpu = jax.jit(f).trace(leaves).lower(lowering_platforms=("cpu",)).as_text()
    tpu = jax.jit(f).trace(leaves).lower(lowering_platforms=("tpu",)).as_text()
    assert "dot_general" not in cuda and "tensor<17xf32>" in cuda
    assert "dot_general" in cpu
    # A TPU slice's gradients are sharded over its chips (and a deviceless compile sees one
    # host device): no concatenation, which would gather every gradient onto every chip.
    joins = [line for line in tpu.splitlines() if "concatenate" in line]
    assert joins and not [line for line in joins if "f32>" in line]  # only the flags, i1
    assert "dot_general" not in tpu and "tensor<17xf32>" not in tpu
    assert "tensor<4x3xi1>" in tpu and "tensor<5xi1>" in tpu  # one reduction per leaf
    assert int(f(leaves)) == 0
    leaves[1] = leaves[1].at[2].set(jnp.inf)
    assert int(f(leaves)) == 1 and int(jax.jit(f)(leaves)) == 1
    finite, _ = check_finite(
        leaves, jnp.float32(0.5), axis_name=None, debug=False, scale_at_least_one=True
    )
    assert not bool(finite)
