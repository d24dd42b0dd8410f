"""What the loss-scale optimizer refuses, and the skips that a scale below 1 must not miss.

* A loss-scale optimizer nested anywhere inside another (issue 21 item 4): refused by
  ``init`` (and ``update``), naming where the inner one sits.
* A state that is not the one this optimizer's ``init`` makes (issue 21 item 5): ``debug``
  on/off, another inner optimizer, gradients of another structure: a ``ValueError`` naming
  both sides, under ``jax.jit`` too (the checks are static).
* A scale below 1 (fixed, or dynamic after backing off): a gradient that is finite scaled but
  overflows once unscaled must skip the step (issue 22).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

import jmp_rewrite as jr
from jmp_rewrite._src.loss_scale import state as loss_scale_state

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

PARAMS = {"w": jnp.array([1.0, -2.0]), "b": jnp.array(0.5)}
GRADS = {"w": jnp.array([0.25, -0.5]), "b": jnp.array(0.125)}


def maybe_jit(jit: bool):
    return jax.jit if jit else (lambda f: f)


def lso(inner, **kw):
    return jr.loss_scale_optimizer(inner, **kw)


# --------------------------------------------------------------------------------------------
# A loss-scale optimizer inside another.

#: Every way optax nests a transformation, each holding a loss-scale optimizer, and the path
#: of its state in the outer optimizer's state.
NESTINGS = {
    "chain": (lambda: optax.chain(optax.clip(1.0), lso(optax.adam(1e-3))), "inner_state[1]"),
    "named_chain": (
        lambda: optax.named_chain(("clip", optax.clip(1.0)), ("adam", lso(optax.adam(1e-3)))),
        "inner_state['adam']",
    ),
    "multi_transform": (
        lambda: optax.multi_transform(
            {"a": lso(optax.adam(1e-3)), "s": optax.sgd(0.1)}, {"w": "a", "b": "s"}
        ),
        "inner_state.inner_states['a'].inner_state",
    ),
    "partition": (
        lambda: optax.partition(
            {"a": optax.sgd(0.1), "s": lso(optax.adam(1e-3))}, {"w": "a", "b": "s"}
        ),
        "inner_state.inner_states['s'].inner_state",
    ),
    "inject_hyperparams": (
        lambda: optax.inject_hyperparams(lambda learning_rate: lso(optax.sgd(learning_rate)))(
            learning_rate=0.1
        ),
        "inner_state.inner_state",
    ),
    "MultiSteps": (
        lambda: optax.MultiSteps(lso(optax.adam(1e-3)), 2),
        "inner_state.inner_opt_state",
    ),
    "masked": (
        lambda: optax.masked(lso(optax.adam(1e-3)), {"w": True, "b": False}),
        "inner_state.inner_state",
    ),
    "apply_if_finite": (
        lambda: optax.apply_if_finite(lso(optax.adam(1e-3)), 3),
        "inner_state.inner_state",
    ),
    "schedule_free": (
        lambda: optax.contrib.schedule_free(lso(optax.sgd(1.0)), 0.1),
        "inner_state.base_optimizer_state",
    ),
    "mechanize": (
        lambda: optax.contrib.mechanize(lso(optax.adam(1e-3))),
        "inner_state.base_optimizer_state",
    ),
    "chain_in_chain": (
        lambda: optax.chain(optax.chain(optax.clip(1.0), lso(optax.adam(1e-3)))),
        "inner_state[0][1]",
    ),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("nesting", sorted(NESTINGS))
def test_a_loss_scale_optimizer_nested_anywhere_inside_another_is_refused_by_init(nesting, jit):
    make, path = NESTINGS[nesting]
    tx = lso(make())
    with pytest.raises(ValueError, match="contains another loss-scale optimizer") as info:
        maybe_jit(jit)(tx.init)(PARAMS)
    assert f"(its state is at {path} of this optimizer's state)" in str(info.value)
    assert "TF refuses" in str(info.value) and "outermost" in str(info.value)


def test_nested_loss_scale_optimizers_would_unscale_twice():
    # Why: the outer unscales with 2**15, the inner once more. For a gradient of 3e-5 Adam's
    # first update is -lr * g / (|g| + eps) = -1.0e-3 with one loss-scale optimizer; nested
    # (before init refused it) it was -8.4e-5, eps dominating the twice-unscaled gradient.
    params = {"w": jnp.array([1.0])}
    grads = {"w": jnp.array([3e-5 * 2.0**15])}  # the loss scaled once, by the outer scale
    good = lso(optax.chain(optax.clip(1e9), optax.adam(1e-3)))
    updates, _ = good.update(grads, good.init(params), params)
    np.testing.assert_allclose(updates["w"], [-1e-3], rtol=1e-3)
    twice = optax.adam(1e-3).update({"w": grads["w"] / 2.0**30}, optax.adam(1e-3).init(params))
    np.testing.assert_allclose(twice[0]["w"], [-8.4e-5], rtol=1e-2)  # what nesting gave
    nested = lso(optax.chain(optax.clip(1e9), lso(optax.adam(1e-3))))
    with pytest.raises(ValueError, match=r"inner_state\[1\]"):
        nested.init(params)


@pytest.mark.parametrize("jit", [False, True])
def test_update_refuses_a_hand_made_state_with_a_nested_loss_scale_state(jit):
    inner = lso(optax.adam(1e-3))
    tx = lso(optax.chain(optax.clip(1.0), inner))
    plain = lso(optax.chain(optax.clip(1.0), optax.adam(1e-3))).init(PARAMS)
    state = plain._replace(inner_state=(plain.inner_state[0], inner.init(PARAMS)))
    with pytest.raises(ValueError, match=r"another loss-scale optimizer.*inner_state\[1\]"):
        maybe_jit(jit)(tx.update)(GRADS, state, PARAMS)


def test_the_seed_api_refuses_a_loss_scale_optimizer_direct_or_nested():
    with pytest.raises(ValueError, match="must not already be a loss-scale optimizer"):
        jr.enable_mixed_precision_graph_rewrite(lso(optax.adam(1e-3)), dtype=jnp.float16)
    try:
        tx = jr.enable_mixed_precision_graph_rewrite(
            optax.chain(optax.clip(1.0), lso(optax.adam(1e-3))), dtype=jnp.float16
        )
        with pytest.raises(ValueError, match=r"inner_state\[1\]"):
            tx.init(PARAMS)
    finally:
        jr.disable_mixed_precision_graph_rewrite()


def test_one_loss_scale_optimizer_in_a_wrapper_is_accepted():
    # Not nested in another: MultiSteps around one loss-scale optimizer is allowed (the
    # README explains why wrapping MultiSteps is better), as is a chain holding one.
    for tx in (
        optax.MultiSteps(lso(optax.adam(1e-3)), 2),
        optax.chain(optax.clip(1.0), lso(optax.adam(1e-3))),
    ):
        state = tx.init(PARAMS)
        assert float(jr.get_loss_scale(state)) == 2.0**15


# --------------------------------------------------------------------------------------------
# A state that is not this optimizer's.


@pytest.mark.parametrize("jit", [False, True])
def test_debug_state_given_to_a_non_debug_optimizer_and_back_names_both(jit):
    plain, debug = lso(optax.adam(1e-3)), lso(optax.adam(1e-3), debug=True)
    with pytest.raises(
        ValueError, match=r"built with debug=True.*holds \(\) there.*built with debug=False"
    ):
        maybe_jit(jit)(debug.update)(GRADS, plain.init(PARAMS), PARAMS)
    with pytest.raises(
        ValueError,
        match=r"built with debug=False.*holds a LossScaleDebugState there.*debug=True",
    ):
        maybe_jit(jit)(plain.update)(GRADS, debug.init(PARAMS), PARAMS)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    "made_by, used_by, held, expected",
    [
        (optax.adam(1e-3), optax.sgd(0.1), "ScaleByAdamState", "EmptyState"),
        (optax.sgd(0.1), optax.adam(1e-3), "EmptyState", "ScaleByAdamState"),
        (optax.sgd(0.1, momentum=0.9), optax.adam(1e-3), "TraceState", "ScaleByAdamState"),
        (optax.adam(1e-3), optax.chain(optax.clip(1.0), optax.adam(1e-3)), "Adam", "Adam"),
    ],
)
def test_another_inner_optimizers_state_names_both(made_by, used_by, held, expected, jit):
    state = lso(made_by).init(PARAMS)
    for params in (PARAMS, None):
        with pytest.raises(ValueError, match="inner_state does not fit") as info:
            maybe_jit(jit)(lso(used_by).update)(GRADS, state, params)
        message = str(info.value)
        holds, makes = message.split("it holds ")[1].split(" makes ")
        assert held in holds.split(", but")[0] and expected in makes
        assert str(jax.tree.structure(state.inner_state))[:60] in message


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("jit", [False, True])
def test_gradients_of_another_structure_than_the_state_was_made_for(jit, debug):
    tx = lso(optax.adam(1e-3), debug=debug)
    state = tx.init(PARAMS)
    extra = {**GRADS, "c": jnp.ones(3)}
    renamed = {"w": GRADS["w"], "bias": GRADS["b"]}  # same leaf count, another structure
    for grads, params in ((extra, None), (extra, PARAMS), (renamed, None)):
        with pytest.raises(ValueError) as info:
            maybe_jit(jit)(tx.update)(grads, state, params)
        message = str(info.value)
        if debug and grads is extra:
            assert "the gradients have 3 leaves but the state's debug flags were made for 2" in (
                message
            )
        else:
            assert "inner_state does not fit" in message and "these gradients" in message
            assert str(jax.tree.structure(grads)) in message


@pytest.mark.parametrize("jit", [False, True])
def test_debug_with_gradients_of_another_leaf_count_is_refused(jit):
    # optax.sgd's state holds nothing of the params: only the debug flags know how many
    # gradient leaves init saw. Accepting 3 leaves would silently resize the flags.
    tx = lso(optax.sgd(0.1), debug=True)
    state = tx.init(PARAMS)
    for grads in ({**GRADS, "c": jnp.ones(3)}, {"w": GRADS["w"]}):
        n = len(jax.tree.leaves(grads))
        with pytest.raises(
            ValueError, match=f"the gradients have {n} leaves but the state's debug flags"
        ):
            maybe_jit(jit)(tx.update)(grads, state)
    updates, state = maybe_jit(jit)(tx.update)(GRADS, state)  # the right count is fine
    assert state.debug.leaf_has_nan.shape == (2,) and bool(state.last_step_applied)


def test_the_state_checks_cost_one_trace_of_init_per_structure():
    # Eager updates check every call; the inner init is traced once per gradient structure.
    calls = []
    adam = optax.adam(1e-3)

    def init(params):
        calls.append(1)
        return adam.init(params)

    tx = lso(optax.GradientTransformation(init, adam.update))
    state = tx.init(PARAMS)
    for _ in range(3):
        _, state = tx.update(GRADS, state, PARAMS)
    assert len(calls) == 2  # init itself, and one traced check


# --------------------------------------------------------------------------------------------
# A scale below 1: overflow that appears only when unscaling.


@pytest.mark.parametrize("use_select", [False, True])
@pytest.mark.parametrize("jit", [False, True])
def test_fixed_scale_below_one_skips_a_gradient_that_overflows_only_unscaled(jit, use_select):
    tx = jr.loss_scale_optimizer(
        optax.sgd(1.0), jr.FixedLossScale(0.5, skip_non_finite=True), use_select=use_select
    )
    params = {"w": jnp.array([1.0, 2.0, 3.0])}
    state = tx.init(params)
    grads = {"w": jnp.array([1.0, 2e38, 0.0])}  # finite; x2 (unscaled) is +inf
    updates, state = maybe_jit(jit)(tx.update)(grads, state, params)
    assert not bool(state.last_step_applied) and int(state.skipped_steps) == 1
    new = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(new["w"], params["w"])  # not -inf
    updates, state = maybe_jit(jit)(tx.update)({"w": jnp.array([1.0, 2.0, 0.0])}, state, params)
    np.testing.assert_array_equal(updates["w"], [-2.0, -4.0, -0.0])
    assert bool(state.last_step_applied) and float(state.loss_scale) == 0.5


@pytest.mark.parametrize("jit", [False, True])
def test_dynamic_scale_backed_off_below_one_skips_a_gradient_that_overflows_only_unscaled(jit):
    # Starts at 1 but may back off to 1/16: once below 1 the check must read unscaled values.
    tx = lso(optax.sgd(1.0), loss_scale=jr.DynamicLossScale(1.0, min_loss_scale=2.0**-4))
    params = {"w": jnp.array([1.0, 2.0, 3.0])}
    update = maybe_jit(jit)(tx.update)
    _, state = update({"w": jnp.array([jnp.nan, 0.0, 0.0])}, tx.init(params), params)
    assert float(state.loss_scale) == 0.5
    updates, state = update({"w": jnp.array([1.0, 2e38, 0.0])}, state, params)
    assert not bool(state.last_step_applied) and float(state.loss_scale) == 0.25
    assert bool(jnp.all(jnp.isfinite(optax.apply_updates(params, updates)["w"])))


# --------------------------------------------------------------------------------------------
# A skipped step changes nothing, bit for bit, whichever way it is chosen.


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("use_select", [False, True])
@pytest.mark.parametrize("jit", [False, True])
def test_a_skipped_step_keeps_a_negative_zero_parameter_with_select_or_cond(jit, use_select, dtype):
    # -0.0 + (+0.0) is +0.0: a skipped step must add -0.0, with jnp.where as with lax.cond.
    tx = lso(optax.sgd(0.1), use_select=use_select)
    params = {"w": jnp.array([-0.0, 0.0, -1.5], dtype)}
    state = tx.init(params)
    grads = {"w": jnp.array([1.0, jnp.inf, 2.0], dtype)}
    updates, state = maybe_jit(jit)(tx.update)(grads, state, params)
    assert not bool(state.last_step_applied)
    new = optax.apply_updates(params, updates)["w"]
    assert new.dtype == dtype
    np.testing.assert_array_equal(np.signbit(np.asarray(new, np.float32)), [True, False, True])
    np.testing.assert_array_equal(np.asarray(new, np.float32), [-0.0, 0.0, -1.5])


# --------------------------------------------------------------------------------------------
# A fixed scale of 1 scales nothing: jax.grad of the plain loss is right, and no warning.


@pytest.fixture
def fresh_unscaled_warning(monkeypatch):
    monkeypatch.setattr(loss_scale_state, "_WARNED_UNSCALED", [False])


@pytest.mark.usefixtures("fresh_unscaled_warning")
@pytest.mark.parametrize("loss_scale", [1, jr.FixedLossScale(1.0, skip_non_finite=True)])
def test_a_fixed_scale_of_one_does_not_warn_about_unscaled_gradients(loss_scale):
    tx = lso(optax.sgd(0.5), loss_scale=loss_scale)

    @jax.jit
    def step(params, state):
        grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2))(params)  # no scale_loss: fine at 1
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = {"w": jnp.array([1.0, -2.0])}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new, _ = step(params, tx.init(params))
    assert [str(w.message) for w in caught] == []
    np.testing.assert_array_equal(new["w"], [0.0, 0.0])  # w - 0.5 * 2w
    # Any other scale does warn: the gradients would be divided by it.
    other = lso(optax.sgd(0.5), loss_scale=2)
    with pytest.warns(jr.UnscaledGradientsWarning):
        jax.jit(lambda p, s: other.update(jax.grad(lambda p: jnp.sum(p["w"] ** 2))(p), s, p))(
            params, other.init(params)
        )


def test_an_optimizer_built_inside_jit_leaks_no_tracer_through_the_state_checks():
    # The checks remember the structure of each inner init's state; an init closing over a
    # traced learning rate must not be kept past its trace.
    params = {"w": jnp.ones(3)}

    @jax.jit
    def step(lr, params):
        tx = lso(optax.inject_hyperparams(optax.sgd)(learning_rate=lr))
        state = tx.init(params)
        _, grads = jr.value_and_grad(lambda p: jnp.sum(p["w"] ** 2))(state, params)
        return tx.update(grads, state, params)[0]

    with jax.checking_leaks():
        for lr in (0.1, 0.2):
            np.testing.assert_allclose(step(lr, params)["w"], [-2 * lr] * 3, rtol=1e-6)
