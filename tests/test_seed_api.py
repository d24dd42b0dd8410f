"""enable_mixed_precision_graph_rewrite / disable_...: TF1's seed API."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxpr_walk import emitted, lowered_prims, prims, runs_in_half

import jmp_rewrite as jr


@pytest.fixture(autouse=True)
def _switched_off():
    jr.disable_mixed_precision_graph_rewrite()
    yield
    jr.disable_mixed_precision_graph_rewrite()


W = 0.1 * jnp.ones((4, 4))
X = jnp.ones((2, 4))


@jr.rewrite
def layer(w, x):
    return jnp.tanh(x @ w) @ w


@jr.rewrite(dtype=jnp.bfloat16)
def pinned(w, x):
    return x @ w


def _dot_dtypes(fun, platform="cpu"):
    """The matmuls' dtypes as ``fun`` is lowered for ``platform`` (dtype=None decides there)."""
    # a fresh lambda each time: jax.make_jaxpr caches traces per function object
    j = emitted(lambda w, x: fun(w, x), W, X)
    return [str(d.invars[0].aval.dtype) for d in lowered_prims(j, "dot_general", platform)]


def test_enable_returns_a_loss_scale_optimizer_and_switches_the_rewrite_on():
    assert _dot_dtypes(layer) == ["float32", "float32"]  # CPU: TF leaves it alone
    tx = jr.enable_mixed_precision_graph_rewrite(optax.sgd(0.1), dtype=jnp.float16)
    assert jr.is_loss_scale_optimizer(tx) and jr.mixed_precision_graph_rewrite_enabled()
    assert _dot_dtypes(layer) == ["float16", "float16"]
    assert _dot_dtypes(pinned) == ["bfloat16"]  # a pinned dtype wins
    state = tx.init({"w": W})
    assert float(jr.get_loss_scale(state)) == 2.0**15  # TF's default dynamic scale
    jr.disable_mixed_precision_graph_rewrite()
    assert not jr.mixed_precision_graph_rewrite_enabled()
    assert _dot_dtypes(layer) == ["float32", "float32"]
    assert _dot_dtypes(pinned) == ["bfloat16"]


def test_enable_without_dtype_follows_the_platform():
    """Without a dtype the switch picks where the program is lowered, as dtype=None does."""
    jr.enable_mixed_precision_graph_rewrite(optax.sgd(0.1))
    assert _dot_dtypes(layer) == ["float32", "float32"]  # CPU: no fast half precision
    assert _dot_dtypes(layer, "tpu") == ["bfloat16", "bfloat16"]
    assert _dot_dtypes(layer, "cuda") == ["float16", "float16"]
    assert _dot_dtypes(pinned, "cuda") == ["bfloat16"]  # a pinned dtype wins everywhere


def test_fixed_loss_scale_and_options_pass_through():
    tx = jr.enable_mixed_precision_graph_rewrite(
        optax.sgd(0.1), loss_scale=128, dtype=jnp.bfloat16, level="TENSOR_CORES_ONLY"
    )
    assert float(jr.get_loss_scale(tx.init({"w": W}))) == 128.0
    j = emitted(lambda w, x: layer(w, x), W, X)
    assert all(runs_in_half(d) for d in prims(j, "dot_general"))


@pytest.mark.parametrize("jit", [False, True])
def test_train_step_with_the_seed_api(jit):
    tx = jr.enable_mixed_precision_graph_rewrite(optax.adam(1e-2), dtype=jnp.float16)
    params = {"w": W}
    state = tx.init(params)

    def loss(p, x):
        return jnp.mean(layer(p["w"], x) ** 2)

    def step(params, state):
        value, grads = jr.value_and_grad(loss)(state, params, X)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    step = jax.jit(step) if jit else step
    values = []
    for _ in range(5):
        params, state, value = step(params, state)
        values.append(float(value))
    assert values[-1] < values[0]
    assert params["w"].dtype == jnp.float32
    assert bool(jr.last_step_applied(state))


def test_errors():
    with pytest.raises(TypeError, match="optax transformation"):
        jr.enable_mixed_precision_graph_rewrite(lambda g: g)
    with pytest.raises(ValueError, match="already be a loss-scale optimizer"):
        jr.enable_mixed_precision_graph_rewrite(jr.loss_scale_optimizer(optax.sgd(0.1)))
    with pytest.raises(TypeError, match="unknown rewrite option"):
        jr.enable_mixed_precision_graph_rewrite(optax.sgd(0.1), dtyp=jnp.float16)
    with pytest.raises(ValueError, match="float16"):
        jr.enable_mixed_precision_graph_rewrite(optax.sgd(0.1), dtype=jnp.float32)
    with pytest.raises(ValueError, match="level"):
        jr.enable_mixed_precision_graph_rewrite(optax.sgd(0.1), dtype=jnp.float16, level="FAST")
    with pytest.raises((ValueError, TypeError)):
        jr.enable_mixed_precision_graph_rewrite(optax.sgd(0.1), loss_scale="static")
    assert not jr.mixed_precision_graph_rewrite_enabled()  # nothing switched on by failures


def test_enabling_twice_warns_and_replaces_options():
    jr.enable_mixed_precision_graph_rewrite(optax.sgd(0.1), dtype=jnp.float16)
    with pytest.warns(UserWarning, match="already on"):
        jr.enable_mixed_precision_graph_rewrite(optax.sgd(0.1), dtype=jnp.bfloat16)
    assert _dot_dtypes(layer) == ["bfloat16", "bfloat16"]
    np.testing.assert_allclose(layer(W, X), jnp.tanh(X @ W) @ W, rtol=2e-2)
