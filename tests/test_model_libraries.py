"""Models as people write them in Flax NNX and Equinox, trained through the rewrite.

NNX: a stateful train step (``step(model, optimizer, x, y)`` updating both in place) in both
decoration orders, with BatchNorm, Dropout and ``nnx.Optimizer`` around a loss-scale optimizer.
Equinox: ``eqx.filter_jit`` + ``eqx.filter_value_and_grad`` over MLP, Conv and attention
modules, whose functions, strings and flags are static leaves.
"""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jaxpr_walk import prims, runs_in_half

import jmp_rewrite as jr

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

F16, BF16 = jnp.float16, jnp.bfloat16
RTOL = {F16: 1e-2, BF16: 5e-2}
HALF_OPS = ("dot_general", "conv_general_dilated")


def assert_model_ops_run_in_half(jaxpr, fun, *args, dtype, expected):
    """The ``expected`` convs and matmuls outside float32 regions (the model's, forward and
    backward) are painted half, and exactly that many run in half in the emitted ``jaxpr``;
    the loss scaler's float32 region (a few reductions written as dots) stays float32."""
    painted = jr.paint(fun, *args, dtype=dtype)
    outside = [e for e in painted if e.primitive in HALF_OPS and not e.in_float32_region]
    assert len(outside) == expected and {e.colour for e in outside} == {"allow"}
    ops = [e for name in HALF_OPS for e in prims(jaxpr, name)]
    assert sum(runs_in_half(e) for e in ops) == expected


# -- Flax NNX --------------------------------------------------------------------------------


class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 8, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.dropout = nnx.Dropout(0.25, rngs=rngs)
        self.linear = nnx.Linear(8 * 8 * 8, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.conv(x)))
        x = self.dropout(x.reshape(x.shape[0], -1))
        return self.linear(x)


def train_step(model, optimizer, x, y, poison):
    """The NNX idiom: gradients of the scaled loss, then ``optimizer.update`` in place.
    ``poison`` multiplies the loss (inf: a step the loss scaler must skip)."""

    def loss_fn(model):
        logits = model(x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() * poison
        return jr.scale_loss(loss, optimizer), loss

    (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss


NNX_X = jax.random.normal(jax.random.key(1), (16, 8, 8, 1), jnp.float32)
NNX_Y = jnp.arange(16) % 10


def nnx_setup():
    model = CNN(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, jr.loss_scale_optimizer(optax.adam(1e-2)), wrt=nnx.Param)
    return model, optimizer


def inner_count(optimizer):
    (adam, *_) = jr.get_loss_scale_state(optimizer).inner_state
    return int(adam.count[...])  # an nnx Variable or an array: [...] reads either


ORDERS = {
    "nnx.jit(rewrite(step))": lambda f: nnx.jit(jr.rewrite(f, dtype=F16)),
    "rewrite(nnx.jit(step))": lambda f: jr.rewrite(nnx.jit(f), dtype=F16),
}


@pytest.mark.parametrize("order", list(ORDERS))
def test_nnx_train_step_updates_model_and_optimizer_in_place(order):
    model, optimizer = nnx_setup()
    ref_model, ref_optimizer = nnx.clone((model, optimizer))
    step = ORDERS[order](train_step)
    kernel, bias = model.conv.kernel[...], model.linear.bias[...]
    mean, count = model.bn.mean[...], model.dropout.rngs.count[...]

    loss = step(model, optimizer, NNX_X, NNX_Y, jnp.float32(1.0))
    ref_loss = nnx.jit(train_step)(ref_model, ref_optimizer, NNX_X, NNX_Y, jnp.float32(1.0))
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL[F16])
    assert loss.dtype == jnp.float32
    # Parameters, optimizer and the model's own state (BatchNorm, Dropout's RNG) moved.
    assert int(optimizer.step[...]) == 1 and inner_count(optimizer) == 1
    assert np.abs(model.conv.kernel[...] - kernel).max() > 1e-3
    assert np.abs(model.linear.bias[...] - bias).max() > 1e-3
    assert np.abs(model.bn.mean[...] - mean).max() > 1e-4
    assert int(model.dropout.rngs.count[...]) == int(count) + 1
    np.testing.assert_allclose(model.bn.mean[...], ref_model.bn.mean[...], rtol=1e-2, atol=1e-4)
    # Same direction as the float32 step (Adam's first step is about lr * sign(grad)).
    moved, ref_moved = model.conv.kernel[...] - kernel, ref_model.conv.kernel[...] - kernel
    assert np.mean(np.sign(moved) == np.sign(ref_moved)) > 0.9
    assert model.conv.kernel[...].dtype == jnp.float32  # master weights stay float32

    # A non-finite loss: the loss scaler skips the update and halves its scale.
    kernel, bias = model.conv.kernel[...], model.linear.bias[...]
    scale = jr.get_loss_scale(optimizer)
    loss = step(model, optimizer, NNX_X, NNX_Y, jnp.float32(jnp.inf))
    assert not np.isfinite(loss)
    np.testing.assert_array_equal(model.conv.kernel[...], kernel)
    np.testing.assert_array_equal(model.linear.bias[...], bias)
    state = jr.get_loss_scale_state(optimizer)
    assert inner_count(optimizer) == 1 and int(state.skipped_steps) == 1
    assert not bool(jr.last_step_applied(optimizer))
    assert float(jr.get_loss_scale(optimizer)) == float(scale) / 2
    # flax's Optimizer.update counts calls, applied or not; the loss scaler's counters and
    # Adam's count are the ones that say how many steps were applied.
    assert int(optimizer.step[...]) == 2


def test_nnx_step_runs_convs_and_matmuls_in_half():
    model, optimizer = nnx_setup()
    graphdef, state = nnx.split((model, optimizer))
    step = jr.rewrite(train_step, dtype=F16)

    def pure(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        loss = step(model, optimizer, x, y, 1.0)
        return loss, nnx.state((model, optimizer))

    jaxpr = jax.make_jaxpr(pure)(state, NNX_X, NNX_Y)
    # conv forward and kernel gradient; linear forward, input and kernel gradients
    args = (model, optimizer, NNX_X, NNX_Y, 1.0)
    assert_model_ops_run_in_half(jaxpr, train_step, *args, dtype=F16, expected=5)
    batch_ops = [e for n in HALF_OPS for e in prims(jaxpr, n) if e.invars[0].aval.shape[0] == 16]
    assert len(batch_ops) == 5 and all(runs_in_half(e) for e in batch_ops)
    assert jaxpr.out_avals[0].dtype == jnp.float32


def test_nnx_method_and_grad_outside_the_rewrite(leak_checking):
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 8, rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)

        @jr.rewrite(dtype=BF16)
        def __call__(self, x):
            return nnx.relu(self.bn(self.linear(x)))

    net = Net(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(3), (16, 4)) + 1.0
    mean, kernel = net.bn.mean[...], net.linear.kernel.get_value()
    out = net(x)  # eager, as a method: BatchNorm's statistics are written back
    assert out.dtype == jnp.float32
    assert np.abs(net.bn.mean[...] - mean).max() > 1e-3
    assert net.linear.kernel.get_value() is kernel  # only what the call set is written back
    mean = net.bn.mean[...]
    loss, grads = nnx.jit(nnx.value_and_grad(lambda m: m(x).sum()))(net)
    assert np.abs(net.bn.mean[...] - mean).max() > 1e-4
    assert grads.linear.kernel[...].shape == (4, 8) and np.isfinite(loss)


def test_nnx_functional_style_state_pytrees_under_grad():
    """``nnx.split`` + ``nnx.merge`` inside the loss, states passed as pytrees: nothing is
    mutated, so nothing is written back (the variables belong to jax.grad's caller)."""
    model, _ = nnx_setup()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, rest, x, y):
        model = nnx.merge(graphdef, params, rest, copy=True)
        logits = model(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    grads = jax.jit(jax.grad(jr.rewrite(loss, dtype=BF16)))(params, rest, NNX_X, NNX_Y)
    ref = jax.jit(jax.grad(loss))(params, rest, NNX_X, NNX_Y)
    g, r = grads["linear"]["kernel"][...], ref["linear"]["kernel"][...]
    assert float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) < 5e-2
    assert jax.tree.structure(grads) == jax.tree.structure(ref)


def test_nnx_forms_that_cannot_write_back_are_errors():
    model, _ = nnx_setup()
    x = NNX_X[:2]
    with pytest.raises(ValueError, match="flax.nnx object declared static.*nnx.jit"):
        jr.rewrite(lambda m, x: m(x), dtype=F16, static_argnums=0)(model, x)

    def grows(m, x):
        m.extra = nnx.Param(jnp.zeros(3))
        return m(x)

    with pytest.raises(ValueError, match="changed the structure of its flax.nnx arguments"):
        jr.rewrite(grows, dtype=F16)(model, x)
    assert not hasattr(model, "extra")


# -- Equinox ---------------------------------------------------------------------------------

needs_equinox = pytest.mark.skipif(
    importlib.util.find_spec("equinox") is None, reason="equinox is not installed"
)


def eqx_models():
    import equinox as eqx

    class MLP(eqx.Module):
        mlp: eqx.nn.MLP

        def __init__(self, key):
            self.mlp = eqx.nn.MLP(16, 4, 32, 2, activation=jax.nn.gelu, key=key)

        def __call__(self, x, key):
            return self.mlp(x)

    class ConvNet(eqx.Module):
        conv: eqx.nn.Conv2d
        linear: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.conv = eqx.nn.Conv2d(1, 4, 3, padding="SAME", key=k1)
            self.linear = eqx.nn.Linear(4 * 6 * 6, 4, key=k2)

        def __call__(self, x, key):
            return self.linear(jax.nn.relu(self.conv(x)).reshape(-1))

    class Attention(eqx.Module):
        attention: eqx.nn.MultiheadAttention
        linear: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.attention = eqx.nn.MultiheadAttention(2, 16, dropout_p=0.1, key=k1)
            self.linear = eqx.nn.Linear(16, 4, key=k2)

        def __call__(self, x, key):
            return self.linear(self.attention(x, x, x, key=key).mean(0))

    key = jax.random.key(4)
    return {
        "mlp": (MLP, jax.random.normal(key, (8, 16))),
        "conv": (ConvNet, jax.random.normal(key, (8, 1, 6, 6))),
        "attention": (Attention, jax.random.normal(key, (8, 5, 16))),
    }


def eqx_step(tx):
    import equinox as eqx

    def make_step(model, opt_state, x, y, key):
        def loss_fn(model):
            logits = jax.vmap(model)(x, jax.random.split(key, len(x)))
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return jr.scale_loss(loss, opt_state), loss

        (_, loss), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    return make_step


@functools.cache
def equinox_float32_loss(kind):
    """The loss of the float32 step (shared by the float16 and bfloat16 tests)."""
    import equinox as eqx

    cls, x = eqx_models()[kind]
    model = cls(jax.random.key(0))
    tx = jr.loss_scale_optimizer(optax.adam(1e-2))
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    y = jnp.arange(len(x)) % 4
    return eqx.filter_jit(eqx_step(tx))(model, opt_state, x, y, jax.random.key(5))[2]


@needs_equinox
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["mlp", "conv", "attention"])
def test_equinox_filter_jit_and_filter_value_and_grad(kind, dtype):
    import equinox as eqx

    cls, x = eqx_models()[kind]
    model = cls(jax.random.key(0))
    y = jnp.arange(len(x)) % 4
    tx = jr.loss_scale_optimizer(optax.adam(1e-2))
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    make_step = eqx_step(tx)
    step = eqx.filter_jit(jr.rewrite(make_step, dtype=dtype))

    key = jax.random.key(5)
    new_model, new_state, loss = step(model, opt_state, x, y, key)
    ref_loss = equinox_float32_loss(kind)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL[dtype])
    # Parameters moved, stayed float32; static leaves (functions, flags) came back as given.
    before, after = eqx.filter(model, eqx.is_array), eqx.filter(new_model, eqx.is_array)
    moved = [
        float(jnp.abs(a - b).max())
        for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True)
    ]
    assert min(moved) > 1e-4, moved
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(after))
    assert jax.tree.structure(new_model) == jax.tree.structure(model)
    static = [s for s in jax.tree.leaves(model) if not eqx.is_array(s)]
    assert [s for s in jax.tree.leaves(new_model) if not eqx.is_array(s)] == static
    assert bool(jr.last_step_applied(new_state))
    # A second step reuses the compiled program (same static leaves) and keeps training.
    _, _, loss2 = step(new_model, new_state, x, y, key)
    assert float(loss2) < float(loss)
    # Every matmul and convolution, forward and backward, runs in half precision.
    args = (model, opt_state, x, y, key)
    jaxpr = eqx.filter_make_jaxpr(jr.rewrite(make_step, dtype=dtype))(*args)[0]
    expected = {"mlp": 8, "conv": 5, "attention": 18}[kind]
    assert_model_ops_run_in_half(jaxpr, make_step, *args, dtype=dtype, expected=expected)


@needs_equinox
def test_equinox_grad_outside_the_rewrite():
    import equinox as eqx

    cls, x = eqx_models()["mlp"]
    model = cls(jax.random.key(0))
    key = jax.random.key(6)

    @jr.rewrite(dtype=BF16)
    def loss_fn(model, x):
        return jnp.mean(jax.vmap(model)(x, jax.random.split(key, len(x))) ** 2)

    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(model, x)
    ref_loss, ref_grads = eqx.filter_value_and_grad(loss_fn.__wrapped__)(model, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL[BF16])
    g, rg = grads.mlp.layers[0].weight, ref_grads.mlp.layers[0].weight
    assert g.dtype == jnp.float32
    assert float(jnp.linalg.norm(g - rg) / jnp.linalg.norm(rg)) < 5e-2


# -- A skipped step leaves everything as it was, whatever the model library ----------------


def _bits(tree):
    """Every array leaf as bytes (with its path), for bit-for-bit comparisons."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): np.asarray(v).tobytes() for p, v in flat}


def _negative_zero(tree):
    """``tree`` with the first element of its first float leaf set to -0.0."""
    leaves, treedef = jax.tree.flatten(tree)
    i = next(i for i, v in enumerate(leaves) if jnp.issubdtype(v.dtype, jnp.floating))
    leaves[i] = leaves[i].reshape(-1).at[0].set(-0.0).reshape(leaves[i].shape)
    return jax.tree.unflatten(treedef, leaves)


def _skip_case(library):
    """``(step, params, opt_state)``: ``step(params, opt_state, x, y, mult)`` returns the new
    pair; ``mult`` multiplies the gradients. Adam with weight decay (the update reads the
    parameters); NNX through ``nnx.remat`` and ``nnx.Optimizer``, functional (a ``jax.jit``
    step over ``nnx.split``'s state)."""
    tx = jr.loss_scale_optimizer(optax.adamw(1e-3))
    x = jax.random.normal(jax.random.key(1), (8, 16))

    def ce(logits, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    if library == "nnx_remat":

        class Net(nnx.Module):
            def __init__(self, rngs):
                self.blocks = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(2)])
                self.head = nnx.Linear(16, 4, rngs=rngs)

            def __call__(self, h):
                for block in self.blocks:
                    h = nnx.remat(lambda b, h: jax.nn.gelu(b(h)))(block, h)
                return self.head(h)

        model = Net(nnx.Rngs(0))
        graphdef, state = nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))

        def step(params, opt_state, x, y, mult):
            model, opt = nnx.merge(graphdef, {**params, **opt_state})

            def loss_fn(model):
                return jr.scale_loss(ce(model(x), y), opt)

            grads = nnx.grad(loss_fn)(model)
            opt.update(model, jax.tree.map(lambda g: g * mult, grads))
            new = nnx.state((model, opt))
            return {0: new[0]}, {1: new[1]}

        return step, {0: state[0]}, {1: state[1]}, x

    if library == "linen":
        import flax.linen as nn

        net = nn.Sequential([nn.Dense(16), nn.gelu, nn.Dense(4)])
        params = net.init(jax.random.key(0), x)
        apply = net.apply
    elif library == "equinox":
        import equinox as eqx

        mlp = eqx.nn.MLP(16, 4, 16, 1, activation=jax.nn.gelu, key=jax.random.key(0))
        params, static = eqx.partition(mlp, eqx.is_array)
        apply = lambda p, x: jax.vmap(eqx.combine(p, static))(x)  # noqa: E731
    else:  # plain dicts
        k1, k2 = jax.random.split(jax.random.key(0))
        params = {"w1": 0.25 * jax.random.normal(k1, (16, 16)), "b1": jnp.zeros(16)}
        params["w2"] = 0.25 * jax.random.normal(k2, (16, 4))
        apply = lambda p, x: jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"]  # noqa: E731

    def step(params, opt_state, x, y, mult):
        _, grads = jr.value_and_grad(lambda p: ce(apply(p, x), y))(opt_state, params)
        updates, opt_state = tx.update(jax.tree.map(lambda g: g * mult, grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, params, tx.init(params), x


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("library", ["nnx_remat", "linen", "equinox", "dicts"])
def test_skipped_step_leaves_parameters_and_optimizer_state_bit_identical(library, dtype):
    """Issue 14 item 2: a rewritten ``jax.jit`` step whose gradients are multiplied by inf is
    skipped, and every parameter and inner optimizer-state leaf is bit-identical afterwards,
    a parameter at -0.0 included (``p + 0.0`` would make it +0.0)."""
    step, params, opt_state, x = _skip_case(library)
    y = jnp.arange(len(x)) % 4
    step = jax.jit(jr.rewrite(step, dtype=dtype))
    params, opt_state = step(params, opt_state, x, y, jnp.float32(1.0))
    params = _negative_zero(params)
    inner = lambda s: jr.get_loss_scale_state(s).inner_state  # noqa: E731
    before = _bits(params), _bits(inner(opt_state))
    scale = float(jr.get_loss_scale(opt_state))
    params, opt_state = step(params, opt_state, x, y, jnp.float32(jnp.inf))
    assert not bool(jr.last_step_applied(opt_state))
    assert float(jr.get_loss_scale(opt_state)) == scale / 2
    after = _bits(params), _bits(inner(opt_state))
    assert after[0] == before[0], sorted(k for k in before[0] if after[0][k] != before[0][k])
    assert after[1] == before[1], sorted(k for k in before[1] if after[1][k] != before[1][k])
