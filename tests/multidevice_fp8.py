"""Run by test_fp8_boundaries.py in a subprocess with 8 CPU devices (XLA_FLAGS set first).

Float8 under ``shard_map`` over 8 devices (issue 28 item 6): both orders hold as many float8
casts as the same step rewritten at the per-device shapes, compute what it computes on each
device's rows, and a per-device batch too small for float8 is said, once."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from test_fp8_boundaries import N, _inputs, float8_casts, float8_gemms, make_step, sharded_forward

import jmp_rewrite as jr

assert jax.device_count() == 8, jax.devices()
mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
ws, x = _inputs(8 * N)  # N rows per device: float8's smallest GEMM


def shard(fun):
    return jax.shard_map(fun, mesh=mesh, in_specs=(P(), P("d")), out_specs=(P(), P()))


local = jr.rewrite(make_step(None), dtype=jnp.bfloat16, fp8=True)
expected = float8_casts(local, ws, x[:N])  # the body at one device's shapes
assert expected >= 8, expected
versions = {
    "shard_map(rewrite)": shard(jr.rewrite(make_step("d"), dtype=jnp.bfloat16, fp8=True)),
    "rewrite(shard_map)": jr.rewrite(shard(make_step("d")), dtype=jnp.bfloat16, fp8=True),
}
reference = jax.jit(shard(jr.rewrite(make_step("d"), dtype=jnp.bfloat16)))(ws, x)
for name, fn in versions.items():
    count = float8_casts(fn, ws, x)
    assert count == expected, (name, count, expected)
    loss, new = jax.jit(fn)(ws, x)
    # float8 against bfloat16: the loss within float8's few percent, the SGD step tiny
    np.testing.assert_allclose(loss, reference[0], rtol=5e-2)
    for a, b in zip(new, reference[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=5e-3)
# rewrite(grad(f)) of a forward in shard_map: its 2 float8 GEMMs' 4 gradient GEMMs too
loss = jax.shard_map(sharded_forward, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
for name, fn in {
    "rewrite(grad)": jr.rewrite(jax.grad(loss), dtype=jnp.bfloat16, fp8=True),
    "grad(rewrite)": jax.grad(jr.rewrite(loss, dtype=jnp.bfloat16, fp8=True)),
}.items():
    assert float8_gemms(fn, ws, x) == 2 + 4, (name, float8_gemms(fn, ws, x))
report = jr.explain(shard(make_step("d")), ws, x, dtype=jnp.bfloat16, fp8=True, residuals=False)
assert report.float8_flops_share and not report.fp8_none

# 32 rows per device: every GEMM too small for float8 there (not on the global batch of 256)
small_x = x[: 8 * 32]
fn = jr.rewrite(shard(make_step("d")), dtype=jnp.bfloat16, fp8=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jax.jit(fn)(ws, small_x)
    jax.jit(fn)(ws, small_x + 1)
said = [w for w in caught if issubclass(w.category, jr.Fp8NoneSelectedWarning)]
assert len(said) == 1 and "shape: M=32" in str(said[0].message), [str(w.message) for w in said]
print("OK")
