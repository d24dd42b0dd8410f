"""Nothing silent: a rewrite that is off says so once, and a loss-scale optimizer fed gradients
of an unscaled loss says so once (issue 16, item 3)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import jmp_rewrite as jr
from jmp_rewrite._src.loss_scale import state as loss_scale_state

W = 0.1 * jnp.ones((8, 8))
X = jnp.ones((4, 8))


def layer(w, x):
    return jnp.tanh(x @ w).sum()


@pytest.fixture
def fresh_unscaled_warning(monkeypatch):
    monkeypatch.setattr(loss_scale_state, "_WARNED_UNSCALED", [False])


def test_rewrite_off_on_cpu_says_so_once_with_the_reason():
    """dtype=None decides where the program is lowered (issue 37.3): on this CPU the
    function runs unchanged, and the warning says so and what a TPU or GPU lowering runs."""
    fn = jr.rewrite(layer)
    with pytest.warns(jr.RewriteOffWarning) as record:
        fn(W, X)
    assert len(record) == 1
    message = str(record[0].message)
    assert message.startswith(
        "rewrite(layer) runs unchanged here: dtype=None picks the half dtype where the "
        "program is lowered"
    )
    assert "default device is a cpu" in message and "dtype=jnp.float16" in message
    assert "lowered for tpu it runs in bfloat16, for cuda in float16" in message
    assert record[0].filename == __file__  # points at the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn(W, X)  # once per function and reason
        jax.jit(fn)(W, X + 1)
    with pytest.warns(jr.RewriteOffWarning) as record:
        jax.jit(jr.rewrite(layer))(W, X)  # under jit: still the caller's line, not JAX's
    assert record[0].filename == __file__


def test_rewrite_off_after_enable_without_dtype_says_why():
    jr.enable_mixed_precision_graph_rewrite(optax.sgd(0.1))
    try:
        with pytest.warns(jr.RewriteOffWarning, match="enable_mixed_precision_graph_rewrite is on"):
            jr.rewrite(layer)(W, X)
    finally:
        jr.disable_mixed_precision_graph_rewrite()


def test_an_explicit_dtype_never_warns():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = jr.rewrite(layer, dtype=jnp.float16)(W, X)
    assert [str(w.message) for w in caught] == []
    assert out.dtype == layer(W, X).dtype


def _setup():
    tx = jr.loss_scale_optimizer(optax.sgd(0.1))
    params = {"w": W}
    return tx, params, tx.init(params)


def _loss(params, x):
    return layer(params["w"], x)


@pytest.mark.usefixtures("fresh_unscaled_warning")
def test_jax_grad_with_a_loss_scale_optimizer_warns_once():
    tx, params, state = _setup()

    @jax.jit
    def step(params, state, x):
        grads = jax.grad(_loss)(params, x)  # the mistake: no scale_loss
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    with pytest.warns(jr.UnscaledGradientsWarning, match="divided by the loss scale") as record:
        step(params, state, X)
    # It points at the update call in the user's step, not into jmp_rewrite or JAX's tracing.
    assert (record[0].filename, record[0].lineno) == (__file__, _line_of(step, "tx.update("))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(params, state, X + 1)  # once per process


def _line_of(fn, text: str) -> int:
    import inspect

    lines, first = inspect.getsourcelines(inspect.unwrap(fn))
    return first + next(i for i, line in enumerate(lines) if text in line)


@pytest.mark.usefixtures("fresh_unscaled_warning")
def test_the_unscaled_warning_points_past_flaxs_optimizer_at_the_users_step():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, jr.loss_scale_optimizer(optax.sgd(0.1)), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        grads = nnx.grad(lambda m: jnp.tanh(m(x)).sum())(model)  # the mistake again
        optimizer.update(model, grads)

    with pytest.warns(jr.UnscaledGradientsWarning) as record:
        step(model, optimizer, X)
    assert (record[0].filename, record[0].lineno) == (
        __file__,
        _line_of(step, "optimizer.update("),
    )


@pytest.mark.usefixtures("fresh_unscaled_warning")
@pytest.mark.parametrize("how", ["value_and_grad", "scale_loss", "rewrite", "eager"])
def test_scaled_losses_and_eager_calls_do_not_warn(how):
    tx, params, state = _setup()

    def step(params, state, x):
        if how == "scale_loss":
            grads = jax.grad(lambda p: jr.scale_loss(_loss(p, x), state))(params)
        else:
            _, grads = jr.value_and_grad(_loss)(state, params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    wrapped = {
        "value_and_grad": jax.jit(step),
        "scale_loss": jax.jit(step),
        "rewrite": jax.jit(jr.rewrite(step, dtype=jnp.float16)),
        "eager": lambda *a: tx.update(jax.grad(_loss)(params, X), state, params),
    }[how]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = wrapped(params, state, X)
    assert [str(w.message) for w in caught] == []
    assert all(jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(out))


@pytest.mark.usefixtures("fresh_unscaled_warning")
def test_flax_nnx_optimizer_with_scale_loss_does_not_warn():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, jr.loss_scale_optimizer(optax.sgd(0.1)), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        def loss_fn(model):
            return jr.scale_loss(jnp.tanh(model(x)).sum(), optimizer)

        grads = nnx.grad(loss_fn)(model)
        optimizer.update(model, grads)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(model, optimizer, X)
