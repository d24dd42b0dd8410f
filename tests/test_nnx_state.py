"""Flax NNX state through ``jmp_rewrite.value_and_grad`` and the functions that trace NNX steps.

``jr.value_and_grad(loss_fn)(optimizer, model, ...)`` must keep what ``loss_fn`` sets on the
NNX objects among its arguments (BatchNorm statistics, Dropout's ``Rngs`` counters, any
``Variable``) as ``nnx.value_and_grad`` does, and differentiate their ``nnx.Param`` variables
only: the reference of every test here is ``nnx.value_and_grad`` of the loss scaled with
``jr.scale_loss``, eager, under ``nnx.jit`` and under the rewrite in both orders.
``explain``, ``paint`` and ``compare`` trace (compare also runs) a step on copies of the
NNX state and leave the caller's objects as they were.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_rewrite as jr

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

BF16 = jnp.bfloat16
SCALE = 8.0
X = jax.random.normal(jax.random.key(1), (16, 4), jnp.float32) + 1.0
Y = jnp.arange(16) % 3


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dropout: bool = True):
        self.linear = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs) if dropout else None
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.bn(self.linear(x)))
        return self.head(self.dropout(h) if self.dropout is not None else h)


class Counter(nnx.Variable):
    """A user's own Variable kind: neither a Param nor a BatchStat."""


def loss_fn(model, x, y):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def setup(dropout=True):
    model = Net(nnx.Rngs(0, dropout=1), dropout)
    tx = jr.loss_scale_optimizer(optax.sgd(0.1), SCALE)
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def ours(model, optimizer, x, y):
    loss, grads = jr.value_and_grad(loss_fn)(optimizer, model, x, y)
    optimizer.update(model, grads)
    return loss, grads


def reference(model, optimizer, x, y):
    def scaled(model):
        loss = loss_fn(model, x, y)
        return jr.scale_loss(loss, optimizer), loss

    (_, loss), grads = nnx.value_and_grad(scaled, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss, grads


WRAPS = {
    "eager": lambda f: f,
    "nnx.jit": nnx.jit,
    "nnx.jit(rewrite(bf16))": lambda f: nnx.jit(jr.rewrite(f, dtype=BF16)),
    "rewrite(bf16)(nnx.jit)": lambda f: jr.rewrite(nnx.jit(f), dtype=BF16),
    "rewrite(bf16)": lambda f: jr.rewrite(f, dtype=BF16),
}


def values(tree):
    """The arrays of ``tree`` as NumPy arrays (random keys as their key data)."""

    def host(a):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a = jax.random.key_data(a)
        return np.asarray(a)

    return [host(a) for a in jax.tree.leaves(tree)]


def assert_states_close(a, b, rtol):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(values(a), values(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol * 1e-2)


def rng_count(model):
    return int(model.dropout.rngs.count[...])


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_batch_stats_move_as_with_nnx_value_and_grad(wrap):
    """BatchNorm alone (no RNG among the arguments): the statistics stayed exactly 0.0 and
    1.0 after any number of steps when value_and_grad dropped the model's updates."""
    model, optimizer = setup(dropout=False)
    ref_model, ref_optimizer = nnx.clone((model, optimizer))
    step, ref_step = WRAPS[wrap](ours), WRAPS[wrap](reference)
    assert float(jnp.abs(model.bn.mean[...]).max()) == 0.0
    outs = [step(model, optimizer, X, Y) for _ in range(2)]
    ref_outs = [ref_step(ref_model, ref_optimizer, X, Y) for _ in range(2)]
    assert float(jnp.abs(model.bn.mean[...]).max()) > 1e-2
    assert float(jnp.abs(model.bn.var[...] - 1.0).max()) > 1e-2
    assert_states_close(nnx.state(model, nnx.BatchStat), nnx.state(ref_model, nnx.BatchStat), 1e-6)
    assert_states_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param), 1e-6)
    for (loss, grads), (ref_loss, ref_grads) in zip(outs, ref_outs, strict=True):
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
        assert_states_close(grads, ref_grads, rtol=1e-5)
    assert int(optimizer.step[...]) == 2
    assert bool(jr.last_step_applied(optimizer))


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_dropout_masks_differ_between_steps(wrap):
    def masked_loss(model, x):
        mask = model.dropout(jnp.ones((16, 8))) != 0
        return jnp.mean(model(x) ** 2), mask

    def step(model, optimizer, x):
        (loss, mask), grads = jr.value_and_grad(masked_loss, has_aux=True)(optimizer, model, x)
        optimizer.update(model, grads)
        return mask

    def ref_step(model, optimizer, x):
        def scaled(model):
            loss, mask = masked_loss(model, x)
            return jr.scale_loss(loss, optimizer), mask

        (_, mask), grads = nnx.value_and_grad(scaled, has_aux=True)(model)
        optimizer.update(model, grads)
        return mask

    model, optimizer = setup()
    ref_model, ref_optimizer = nnx.clone((model, optimizer))
    step, ref_step = WRAPS[wrap](step), WRAPS[wrap](ref_step)
    assert rng_count(model) == 0
    first, second = step(model, optimizer, X), step(model, optimizer, X)
    assert bool(jnp.any(first != second))  # the same mask twice when the counter was lost
    assert rng_count(model) == 4  # two draws per step
    np.testing.assert_array_equal(first, ref_step(ref_model, ref_optimizer, X))
    np.testing.assert_array_equal(second, ref_step(ref_model, ref_optimizer, X))
    assert rng_count(ref_model) == 4
    assert float(jnp.abs(model.bn.mean[...]).max()) > 1e-2
    assert_states_close(nnx.state(model, nnx.BatchStat), nnx.state(ref_model, nnx.BatchStat), 1e-6)
    assert_states_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param), 1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_gradients_are_nnx_value_and_grads_times_the_loss_scale(jit, leak_checking):
    model, optimizer = setup()
    ref_model = nnx.clone(model)

    def grads_of(model, optimizer):
        return jr.value_and_grad(loss_fn)(optimizer, model, X, Y)

    def ref_grads_of(model):
        return nnx.value_and_grad(loss_fn)(model, X, Y)

    if jit:
        grads_of, ref_grads_of = nnx.jit(grads_of), nnx.jit(ref_grads_of)
    loss, grads = grads_of(model, optimizer)
    ref_loss, ref_grads = ref_grads_of(ref_model)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    # An nnx.State of the Params only, as nnx.value_and_grad gives: no BatchStat, no RNG.
    assert isinstance(grads, nnx.State)
    assert jax.tree.structure(grads) == jax.tree.structure(nnx.state(model, nnx.Param))
    for g, r in zip(values(grads), values(ref_grads), strict=True):
        np.testing.assert_allclose(g, SCALE * r, rtol=1e-5, atol=1e-7)
    assert_states_close(nnx.state(model, nnx.BatchStat), nnx.state(ref_model, nnx.BatchStat), 1e-6)
    assert rng_count(model) == rng_count(ref_model) == 1


def test_undifferentiated_nodes_keywords_and_custom_variables_keep_their_updates():
    """A module passed by keyword or at a position not in ``argnums``, and a user's own
    Variable set inside the loss: updated as nnx.value_and_grad updates them."""
    model, optimizer = setup()
    calls = Counter(jnp.zeros([], jnp.int32))
    w = jnp.ones((3,))

    def loss(w, calls, *, model):
        calls[...] = calls[...] + 1
        return jnp.mean(model(X) * w)

    def ref_loss(w, calls, model):
        return jr.scale_loss(loss(w, calls, model=model), optimizer)

    ref_model, ref_calls = nnx.clone(model), nnx.clone(calls)
    value, grads = nnx.jit(jr.value_and_grad(loss))(optimizer, w, calls, model=model)
    ref_value, ref_grads = nnx.jit(nnx.value_and_grad(ref_loss))(w, ref_calls, ref_model)
    np.testing.assert_allclose(value * SCALE, ref_value, rtol=1e-6)
    np.testing.assert_allclose(grads, ref_grads, rtol=1e-6)
    assert int(calls[...]) == int(ref_calls[...]) == 1
    assert_states_close(nnx.state(model, nnx.BatchStat), nnx.state(ref_model, nnx.BatchStat), 1e-6)
    assert float(jnp.abs(model.bn.mean[...]).max()) > 1e-2
    assert rng_count(model) == 1

    # Two modules differentiated at once, the second by a negative position.
    other = nnx.Linear(3, 1, rngs=nnx.Rngs(2))
    _, (g_model, g_other) = jr.value_and_grad(lambda m, o: jnp.mean(o(m(X))), argnums=(0, -1))(
        optimizer, model, other
    )
    assert jax.tree.structure(g_other) == jax.tree.structure(nnx.state(other, nnx.Param))
    assert jax.tree.structure(g_model) == jax.tree.structure(nnx.state(model, nnx.Param))
    assert rng_count(model) == 2


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_a_module_passed_only_by_keyword_keeps_its_updates(jit):
    """The only NNX object a keyword (the positional arguments plain arrays): the call still
    goes through NNX's split and merge, so BatchNorm's statistics (computed from ``w`` here)
    and Dropout's ``Rngs`` count are written back as ``nnx.value_and_grad`` writes them,
    and ``w``'s gradient is its gradient times the loss scale."""
    model, optimizer = setup()
    ref_model = nnx.clone(model)
    w = jnp.linspace(0.5, 1.5, 4)

    def loss(w, *, model):
        return jnp.mean(model(X * w) ** 2)

    def ref_loss(w, model):
        return jr.scale_loss(loss(w, model=model), optimizer)

    grads_of, ref_grads_of = jr.value_and_grad(loss), nnx.value_and_grad(ref_loss)
    if jit:
        grads_of, ref_grads_of = nnx.jit(grads_of), nnx.jit(ref_grads_of)
    value, grads = grads_of(optimizer, w, model=model)
    ref_value, ref_grads = ref_grads_of(w, ref_model)
    np.testing.assert_allclose(value * SCALE, ref_value, rtol=1e-6)
    assert grads.shape == w.shape and grads.dtype == jnp.float32
    np.testing.assert_allclose(grads, ref_grads, rtol=1e-5)
    assert float(jnp.abs(model.bn.mean[...]).max()) > 1e-2
    assert_states_close(nnx.state(model, nnx.BatchStat), nnx.state(ref_model, nnx.BatchStat), 1e-6)
    assert rng_count(model) == rng_count(ref_model) == 1


def test_diff_state_argnums_choose_the_variables_as_in_nnx():
    model, optimizer = setup()
    only_kernels = nnx.DiffState(0, nnx.All(nnx.Param, nnx.PathContains("kernel")))
    _, grads = jr.value_and_grad(loss_fn, argnums=only_kernels)(optimizer, model, X, Y)
    assert {p[-1] for p, _ in nnx.to_flat_state(grads)} == {"kernel"}
    assert rng_count(model) == 1 and float(jnp.abs(model.bn.mean[...]).max()) > 1e-2


def test_rewrite_of_value_and_grad_itself_writes_the_state_back():
    model, optimizer = setup()
    ref_model = nnx.clone(model)
    loss, grads = jr.rewrite(jr.value_and_grad(loss_fn), dtype=BF16)(optimizer, model, X, Y)
    ref_loss, ref_grads = jr.rewrite(nnx.value_and_grad(loss_fn), dtype=BF16)(ref_model, X, Y)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for g, r in zip(values(grads), values(ref_grads), strict=True):
        np.testing.assert_allclose(g, SCALE * r, rtol=2e-2, atol=1e-3)
    assert float(jnp.abs(model.bn.mean[...]).max()) > 1e-2
    assert_states_close(nnx.state(model, nnx.BatchStat), nnx.state(ref_model, nnx.BatchStat), 1e-6)
    assert rng_count(model) == rng_count(ref_model) == 1


def test_explain_paint_and_compare_leave_the_callers_objects_alone():
    """They trace the step on copies of the NNX state (compare runs it, twice): the caller's
    model and optimizer keep their values, concrete, and a real step still updates them."""
    model, optimizer = setup()
    before = values(nnx.state((model, optimizer)))
    report = jr.explain(ours, model, optimizer, X, Y, dtype=BF16)
    painted = jr.paint(ours, model, optimizer, X, Y, dtype=BF16)
    comparison = jr.compare(ours, model, optimizer, X, Y, dtype=BF16)
    assert report.converted and any(e.colour == "allow" for e in painted)
    assert comparison.outputs and comparison.changed
    leaves = jax.tree.leaves(nnx.state((model, optimizer)))
    assert not any(isinstance(a, jax.core.Tracer) for a in leaves)
    after = values(nnx.state((model, optimizer)))
    assert len(after) == len(before)
    for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(a, b)
    nnx.jit(jr.rewrite(ours, dtype=BF16))(model, optimizer, X, Y)
    assert float(jnp.abs(model.bn.mean[...]).max()) > 1e-2 and rng_count(model) == 1


@pytest.mark.parametrize("wrap", ["rewrite(bf16)", "nnx.jit(rewrite(bf16))"])
def test_rewrite_of_rngs_and_custom_variables_passed_directly(wrap):
    """``nnx.Rngs`` and a user's own Variable as arguments of a rewritten function: their
    new counts are on them after the call, as with nnx.jit, and each call draws anew."""

    def draw(rngs, calls, w):
        calls[...] = calls[...] + 1
        return jnp.tanh(jax.random.normal(rngs.noise(), (4, 4)) @ w)

    fn, ref_fn = WRAPS[wrap](draw), nnx.jit(draw)
    rngs, calls = nnx.Rngs(noise=3), Counter(jnp.zeros([], jnp.int32))
    ref_rngs, ref_calls = nnx.clone(rngs), nnx.clone(calls)
    w = jnp.full((4, 4), 0.1)
    first, second = fn(rngs, calls, w), fn(rngs, calls, w)
    ref_first, ref_second = ref_fn(ref_rngs, ref_calls, w), ref_fn(ref_rngs, ref_calls, w)
    assert int(rngs.noise.count[...]) == int(ref_rngs.noise.count[...]) == 2
    assert int(calls[...]) == int(ref_calls[...]) == 2
    assert bool(jnp.any(first != second))
    np.testing.assert_allclose(first, ref_first, rtol=2e-2, atol=1e-2)
    np.testing.assert_allclose(second, ref_second, rtol=2e-2, atol=1e-2)
