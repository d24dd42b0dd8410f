"""Run by test_rewrite.py in a subprocess with 8 CPU devices (XLA_FLAGS set before import)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxpr_walk import lowered_prims, prims, runs_in_half

import jmp_rewrite as jr

assert jax.device_count() == 8, jax.devices()
mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
x = jax.random.normal(jax.random.key(0), (16, 4))
w = 0.3 * jax.random.normal(jax.random.key(1), (4, 4))

# shard_map with a collective: the body is painted, psum stays inside the manual region.
sm = jax.shard_map(
    lambda a, b: jax.lax.psum(jnp.tanh(a @ b), "d"),
    mesh=mesh,
    in_specs=(P("d"), P()),
    out_specs=P(),
)


def f(x, w):
    return sm(x, w) @ w


for dtype, tol in ((jnp.float16, 1e-2), (jnp.bfloat16, 5e-2)):
    g = jr.rewrite(f, dtype=dtype)
    np.testing.assert_allclose(jax.jit(g)(x, w), f(x, w), rtol=tol, atol=tol)
    grad_rw = jax.grad(lambda v, g=g: g(x, v).sum())(w)
    grad_ref = jax.grad(lambda v: f(x, v).sum())(w)
    np.testing.assert_allclose(grad_rw, grad_ref, rtol=tol, atol=tol * 10)
    j = jax.make_jaxpr(g)(x, w)
    assert prims(j, "shard_map") and all(runs_in_half(e) for e in prims(j, "dot_general"))

# jit shardings and sharding constraints survive.
s = NamedSharding(mesh, P("d"))


@jax.jit
def h(x, w):
    y = jax.lax.with_sharding_constraint(x @ w, s)
    return jnp.tanh(y) @ w


step = jax.jit(h, in_shardings=(s, None), out_shardings=s)
rw = jr.rewrite(step, dtype=jnp.float16)
out = jax.jit(rw)(x, w)
assert out.dtype == jnp.float32 and out.sharding.is_equivalent_to(s, 2), out.sharding
np.testing.assert_allclose(out, step(x, w), rtol=1e-2, atol=1e-2)
j = jax.make_jaxpr(rw)(x, w)
outer = prims(j, "jit")[0]
assert outer.params["in_shardings"][0] == s and outer.params["out_shardings"][0] == s
constraint = prims(j, "sharding_constraint")[0]
assert constraint.params["sharding"] == s and runs_in_half(constraint)

# SPMD jit over sharded inputs
xs = jax.device_put(x, s)
spmd = jax.jit(jr.rewrite(lambda a: jnp.tanh(a @ w) @ w, dtype=jnp.float16))
np.testing.assert_allclose(spmd(xs), jnp.tanh(x @ w) @ w, rtol=1e-2, atol=1e-2)

# Explicit mesh (jax.make_mesh's default), vma checking on (shard_map's default): the rewrite
# outside shard_map (traced at the inputs' shardings) and inside it (varying manual axes kept).
emesh = jax.make_mesh((8,), ("d",))
es = NamedSharding(emesh, P("d"))
ex = jax.device_put(x, es)


def body(a, b):
    h = jnp.tanh(a @ b)
    return jax.lax.psum(h.sum(0, keepdims=True), "d") + h @ b


def reference(a, b):
    return jax.shard_map(body, mesh=emesh, in_specs=(P("d"), P()), out_specs=P("d"))(a, b)


for dtype, tol in ((jnp.float16, 2e-2), (jnp.bfloat16, 1e-1)):
    want = np.asarray(reference(ex, w))
    inside = jax.shard_map(
        jr.rewrite(body, dtype=dtype), mesh=emesh, in_specs=(P("d"), P()), out_specs=P("d")
    )
    for fn in (inside, jax.jit(inside)):
        got = fn(ex, w)
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    j = jax.make_jaxpr(inside)(ex, w)
    assert prims(j, "dot_general") and all(runs_in_half(e) for e in prims(j, "dot_general"))
    with jax.set_mesh(emesh):
        outside = jr.rewrite(
            jax.shard_map(body, in_specs=(P("d"), P()), out_specs=P("d")), dtype=dtype
        )
        for fn in (outside, jax.jit(outside)):
            got = fn(ex, w)
            assert got.sharding.is_equivalent_to(es, 2), got.sharding
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
        j = jax.make_jaxpr(outside)(ex, w)
        assert all(runs_in_half(e) for e in prims(j, "dot_general"))
        # under the explicit mesh, a plain function of a sharded input keeps its sharding
        plain = jax.jit(jr.rewrite(lambda a: jnp.tanh(a @ w) @ w, dtype=dtype))
        got = plain(ex)
        assert got.sharding.is_equivalent_to(es, 2), got.sharding
        np.testing.assert_allclose(got, jnp.tanh(x @ w) @ w, rtol=tol, atol=tol)

# dtype=None (issue 37.3): inside and outside shard_map, under the explicit mesh, each
# lowering platform gets its program; this CPU runs the function unchanged.
warnings.simplefilter("ignore", jr.RewriteOffWarning)
want = np.asarray(jax.jit(reference)(ex, w))
inside = jax.shard_map(jr.rewrite(body), mesh=emesh, in_specs=(P("d"), P()), out_specs=P("d"))
with jax.set_mesh(emesh):
    outside = jr.rewrite(jax.shard_map(body, in_specs=(P("d"), P()), out_specs=P("d")))
    for fn in (inside, outside):
        got = jax.jit(fn)(ex, w)
        assert got.sharding.is_equivalent_to(es, 2), got.sharding
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        j = jax.make_jaxpr(fn)(ex, w)
        for platform, half in (("tpu", jnp.bfloat16), ("cuda", jnp.float16), ("cpu", None)):
            dots = lowered_prims(j, "dot_general", platform)
            dtypes = {a.aval.dtype for e in dots for a in e.invars}
            assert dots and dtypes == {np.dtype(half or jnp.float32)}, (platform, dtypes)
print("OK")
