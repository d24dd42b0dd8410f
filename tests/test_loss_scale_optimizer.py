"""The loss-scale optimizer: step sequences, dtypes, helpers, composition and persistence."""

from __future__ import annotations

import doctest
import importlib

import chex
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_rewrite as jr
from jmp_rewrite._src import _jax_compat as compat
from jmp_rewrite._src.loss_scale.finite import count_non_finite
from jmp_rewrite._src.trace.regions import FLOAT32_REGION_SCOPE

INT32_MAX = 2**31 - 1


pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")


def maybe_jit(jit: bool):
    return jax.jit if jit else (lambda f: f)


def assert_trees_equal(actual, desired):
    assert jax.tree.structure(actual) == jax.tree.structure(desired)
    for a, d in zip(jax.tree.leaves(actual), jax.tree.leaves(desired), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(d))


def assert_trees_close(actual, desired, rtol=1e-6, atol=0.0):
    assert jax.tree.structure(actual) == jax.tree.structure(desired)
    for a, d in zip(jax.tree.leaves(actual), jax.tree.leaves(desired), strict=True):
        wide = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(d) else np.float64
        np.testing.assert_allclose(np.asarray(a, wide), np.asarray(d, wide), rtol=rtol, atol=atol)


BAD = {"nan": jnp.nan, "+inf": jnp.inf, "-inf": -jnp.inf}


def scripted_grads(step: int, scale: float, event: str) -> dict:
    """True gradients of step ``step`` (exact binary fractions) times ``scale``, poisoned."""
    grads = {"w": jnp.array([0.25 * step, -0.5]), "b": jnp.array(0.125)}
    grads = jax.tree.map(lambda g: g * scale, grads)
    if event != "ok":
        if step % 2:
            grads["w"] = grads["w"].at[1].set(BAD[event])
        else:
            grads["b"] = grads["b"].at[()].set(BAD[event])
    return grads


PARAMS = {"w": jnp.array([1.0, -2.0]), "b": jnp.array(0.5)}

# events, and the expected (scale in force, scale after, good_steps, applied, skipped, last)
# for DynamicLossScale(initial_loss_scale=4, increment_period=2).
SCRIPT = [
    ("ok", 4.0, 4.0, 1, 1, 0, True),
    ("ok", 4.0, 8.0, 0, 2, 0, True),  # grows; this step still unscales with 4
    ("nan", 8.0, 4.0, 0, 2, 1, False),
    ("+inf", 4.0, 2.0, 0, 2, 2, False),
    ("ok", 2.0, 2.0, 1, 3, 2, True),
    ("-inf", 2.0, 1.0, 0, 3, 3, False),
    ("nan", 1.0, 1.0, 0, 3, 4, False),  # floor at 1
    ("ok", 1.0, 1.0, 1, 4, 4, True),
    ("ok", 1.0, 2.0, 0, 5, 4, True),
    ("ok", 2.0, 2.0, 1, 6, 4, True),
]


# --------------------------------------------------------------------------------------------
# Step sequences.


@pytest.mark.parametrize("use_select", [False, True])
@pytest.mark.parametrize("jit", [False, True])
def test_step_sequence_sgd_momentum(jit, use_select):
    """Scale, counters, flag, params and inner state after every scripted step."""
    inner = optax.sgd(0.5, momentum=0.5)
    scale_rule = jr.DynamicLossScale(initial_loss_scale=4.0, increment_period=2)
    tx = jr.loss_scale_optimizer(inner, scale_rule, use_select=use_select)
    update = maybe_jit(jit)(tx.update)
    params, state = PARAMS, tx.init(PARAMS)
    ref_params, ref_state = PARAMS, inner.init(PARAMS)  # plain sgd on the finite steps only
    for step, (event, in_force, scale, good, applied, skipped, last) in enumerate(SCRIPT, 1):
        assert float(jr.get_loss_scale(state)) == in_force
        grads = scripted_grads(step, in_force, event)
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        if event == "ok":
            ref_updates, ref_state = inner.update(scripted_grads(step, 1.0, "ok"), ref_state)
            ref_params = optax.apply_updates(ref_params, ref_updates)
        else:
            assert_trees_equal(updates, jax.tree.map(jnp.zeros_like, grads))
        assert float(state.loss_scale) == scale, step
        assert int(state.good_steps) == good, step
        assert int(state.applied_steps) == applied, step
        assert int(state.skipped_steps) == skipped, step
        assert bool(state.last_step_applied) == last, step
        assert bool(jr.last_step_applied(state)) == last, step
        assert_trees_equal(params, ref_params)  # binary fractions: exact
        assert_trees_equal(state.inner_state, ref_state)
    # The final bias, written out: 6 steps applied, momentum traces 0.125 * (2 - 0.5**k).
    assert float(params["b"]) == 0.5 - 0.5 * sum(0.125 * (2 - 0.5**k) for k in range(6))
    assert state.loss_scale.dtype == jnp.float32 and state.good_steps.dtype == jnp.int32


@pytest.mark.parametrize("use_select", [False, True])
@pytest.mark.parametrize("jit", [False, True])
def test_adam_count_and_moments_do_not_advance_on_skipped_steps(jit, use_select):
    inner = optax.adam(0.1)
    tx = jr.loss_scale_optimizer(
        inner, jr.DynamicLossScale(initial_loss_scale=8.0), use_select=use_select
    )
    update = maybe_jit(jit)(tx.update)
    params, state = PARAMS, tx.init(PARAMS)
    ref_params, ref_state = PARAMS, inner.init(PARAMS)
    events = ["ok", "nan", "+inf", "ok", "-inf", "ok"]
    for step, event in enumerate(events, 1):
        before = state.inner_state
        scale = float(state.loss_scale)
        updates, state = update(scripted_grads(step, scale, event), state, params)
        params = optax.apply_updates(params, updates)
        if event == "ok":
            ref_updates, ref_state = inner.update(scripted_grads(step, 1.0, "ok"), ref_state)
            ref_params = optax.apply_updates(ref_params, ref_updates)
        else:
            assert_trees_equal(state.inner_state, before)  # count, mu and nu untouched
        assert int(state.inner_state[0].count) == int(ref_state[0].count)
        assert_trees_close(state.inner_state, ref_state)
        assert_trees_close(params, ref_params)
    assert int(state.inner_state[0].count) == 3


@pytest.mark.parametrize("jit", [False, True])
def test_an_empty_leaf_is_checked_as_holding_nothing(jit):
    """A zero-size leaf (a zero-width feature block) holds no non-finite value: steps apply
    and skip as without it (the per-leaf check reshaped it to ``(-1, 0)``: a crash)."""
    params = {"w": jnp.ones((4, 3)), "empty": jnp.ones((4, 0))}
    tx = jr.loss_scale_optimizer(optax.sgd(1.0), jr.DynamicLossScale(initial_loss_scale=2.0))
    update = maybe_jit(jit)(tx.update)
    state = tx.init(params)
    grads = {"w": jnp.full((4, 3), 2.0), "empty": jnp.ones((4, 0))}
    updates, state = update(grads, state, params)
    assert bool(state.last_step_applied)
    np.testing.assert_array_equal(updates["w"], -jnp.ones((4, 3)))
    assert updates["empty"].shape == (4, 0)
    grads["w"] = grads["w"].at[0, 0].set(jnp.inf)
    updates, state = update(grads, state, params)
    assert not bool(state.last_step_applied) and float(state.loss_scale) == 1.0
    np.testing.assert_array_equal(updates["w"], jnp.zeros((4, 3)))
    for method in ("elementwise", "dot"):
        n = count_non_finite(
            jax.tree.leaves(grads), jnp.float32(1.0), scale_at_least_one=True, method=method
        )
        assert int(n) == 1


@pytest.mark.parametrize("jit", [False, True])
def test_unscales_with_the_scale_in_force_not_the_grown_one(jit):
    tx = jr.loss_scale_optimizer(
        optax.sgd(1.0), jr.DynamicLossScale(initial_loss_scale=2.0, increment_period=1)
    )
    state = tx.init(PARAMS)
    updates, state = maybe_jit(jit)(tx.update)(scripted_grads(1, 2.0, "ok"), state)
    assert float(state.loss_scale) == 4.0  # grew on this step...
    assert_trees_equal(updates, jax.tree.map(lambda g: -g, scripted_grads(1, 1.0, "ok")))


@pytest.mark.parametrize("jit", [False, True])
def test_refuses_to_grow_to_infinity_and_keeps_applying(jit):
    tx = jr.loss_scale_optimizer(
        optax.sgd(1.0), jr.DynamicLossScale(initial_loss_scale=2.0**127, increment_period=1)
    )
    update = maybe_jit(jit)(tx.update)
    params, state = PARAMS, tx.init(PARAMS)
    true = jax.tree.map(lambda g: g * 2.0**-110, scripted_grads(1, 1.0, "ok"))
    for step in range(1, 4):
        updates, state = update(jax.tree.map(lambda g: g * 2.0**127, true), state, params)
        params = optax.apply_updates(params, updates)
        assert float(state.loss_scale) == 2.0**127 and int(state.good_steps) == 0
        assert bool(state.last_step_applied) and int(state.applied_steps) == step
    assert_trees_equal(params, jax.tree.map(lambda p, g: p - 3 * g, PARAMS, true))
    _, state = update(scripted_grads(1, 2.0**127, "nan"), state, params)
    assert float(state.loss_scale) == 2.0**126 and not bool(state.last_step_applied)


def test_default_is_tf1_dynamic_scale():
    state = jr.loss_scale_optimizer(optax.sgd(0.1)).init(PARAMS)
    assert float(state.loss_scale) == 2.0**15 and int(state.good_steps) == 0
    assert bool(state.last_step_applied) and state.debug == ()
    assert jr.MixedPrecisionLossScaleOptimizer is jr.loss_scale_optimizer


def test_counters_saturate_instead_of_wrapping():
    tx = jr.loss_scale_optimizer(optax.sgd(0.1), jr.DynamicLossScale(increment_period=3))
    state = tx.init(PARAMS)._replace(
        applied_steps=jnp.int32(INT32_MAX), skipped_steps=jnp.int32(INT32_MAX)
    )
    _, state = tx.update(scripted_grads(1, 1.0, "ok"), state)
    _, state = tx.update(scripted_grads(1, 1.0, "nan"), state)
    assert int(state.applied_steps) == INT32_MAX and int(state.skipped_steps) == INT32_MAX


# --------------------------------------------------------------------------------------------
# Fixed scales.


def test_fixed_scale_always_applies_like_tf():
    tx = jr.loss_scale_optimizer(optax.sgd(1.0), loss_scale=8)
    params, state = PARAMS, tx.init(PARAMS)
    updates, state = tx.update(scripted_grads(1, 8.0, "ok"), state, params)
    assert_trees_equal(updates, jax.tree.map(lambda g: -g, scripted_grads(1, 1.0, "ok")))
    updates, state = tx.update(scripted_grads(1, 8.0, "nan"), state, params)
    assert bool(jnp.isnan(updates["w"][1]))  # TF's FixedLossScale applies non-finite steps
    assert float(state.loss_scale) == 8.0 and int(state.applied_steps) == 2
    assert int(state.skipped_steps) == 0 and bool(state.last_step_applied)


@pytest.mark.parametrize("jit", [False, True])
def test_fixed_scale_can_skip_non_finite_steps(jit):
    tx = jr.loss_scale_optimizer(optax.sgd(1.0), jr.FixedLossScale(0.5, skip_non_finite=True))
    update = maybe_jit(jit)(tx.update)
    state = tx.init(PARAMS)
    updates, state = update(scripted_grads(1, 0.5, "-inf"), state, PARAMS)
    assert_trees_equal(updates, jax.tree.map(jnp.zeros_like, PARAMS))
    assert not bool(state.last_step_applied) and int(state.skipped_steps) == 1
    updates, state = update(scripted_grads(2, 0.5, "ok"), state, PARAMS)
    assert_trees_equal(updates, jax.tree.map(lambda g: -g, scripted_grads(2, 1.0, "ok")))
    assert float(state.loss_scale) == 0.5


def test_scale_below_one_catches_overflow_of_the_unscaled_gradients():
    # Scaled value 2e38 is finite, unscaled (x4) it is not: the step must be skipped.
    tx = jr.loss_scale_optimizer(
        optax.sgd(1.0),
        jr.DynamicLossScale(initial_loss_scale=0.25, min_loss_scale=2.0**-4),
    )
    state = tx.init({"w": jnp.zeros(3)})
    _, state = tx.update({"w": jnp.array([1.0, 2e38, 0.0])}, state)
    assert not bool(state.last_step_applied) and float(state.loss_scale) == 0.125


# --------------------------------------------------------------------------------------------
# Dtypes.


@pytest.mark.parametrize("use_select", [False, True])
@pytest.mark.parametrize(
    "param_dtype, grad_dtype",
    [
        (jnp.float32, jnp.float32),
        (jnp.bfloat16, jnp.bfloat16),
        (jnp.float16, jnp.float16),
        (jnp.float32, jnp.float16),
    ],
)
def test_dtypes_of_updates_and_state(param_dtype, grad_dtype, use_select):
    tx = jr.loss_scale_optimizer(
        optax.adam(0.1), jr.DynamicLossScale(initial_loss_scale=2.0**10), use_select=use_select
    )
    params = {"w": jnp.array([1.0, -2.0, 3.0], param_dtype)}
    state = tx.init(params)
    assert state.inner_state[0].mu["w"].dtype == jnp.float32  # float32 even for half params
    true = jnp.array([0.5, -0.25, 2.0**-12], jnp.float32)
    grads = {"w": (true * 2.0**10).astype(grad_dtype)}
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert updates["w"].dtype == grad_dtype
    assert state.inner_state[0].mu["w"].dtype == jnp.float32
    assert state.inner_state[0].nu["w"].dtype == jnp.float32
    ref_updates, _ = optax.adam(0.1).update(
        {"w": grads["w"].astype(jnp.float32) / 2.0**10}, optax.adam(0.1).init(params)
    )
    assert_trees_close(updates, jax.tree.map(lambda u: u.astype(grad_dtype), ref_updates))
    new_params = optax.apply_updates(params, updates)
    assert new_params["w"].dtype == param_dtype


def test_float16_overflow_of_scaled_gradients_is_skipped():
    tx = jr.loss_scale_optimizer(optax.adam(0.1))  # 2**15
    params = {"w": jnp.ones(3, jnp.float16)}
    state = tx.init(params)
    grads = {"w": (jnp.array([1.0, 4.0, 0.5]) * 2.0**15).astype(jnp.float16)}  # 131072 -> inf
    assert bool(jnp.isinf(grads["w"][1]))
    updates, state = tx.update(grads, state, params)
    assert not bool(state.last_step_applied) and float(state.loss_scale) == 2.0**14
    assert updates["w"].dtype == jnp.float16 and not bool(jnp.any(updates["w"]))
    assert int(state.inner_state[0].count) == 0


def test_inner_state_dtype_changed_by_update_is_cast_back():
    # scale_by_adam without mu_dtype promotes float16 moments to float32 during the update;
    # init on float16 params would otherwise make the two cond branches disagree.
    tx = jr.loss_scale_optimizer(optax.adam(0.1, mu_dtype=jnp.bfloat16))
    params = {"w": jnp.ones(2, jnp.float16)}
    state = tx.init(params)
    _, new_state = jax.jit(tx.update)({"w": jnp.ones(2, jnp.float16)}, state, params)
    assert jax.tree.map(lambda x: x.dtype, new_state) == jax.tree.map(lambda x: x.dtype, state)
    assert new_state.inner_state[0].mu["w"].dtype == jnp.bfloat16


# --------------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize(
    "loss_scale, error, pattern",
    [
        ("static", ValueError, r"loss_scale must be 'dynamic', a positive number.*got 'static'"),
        (None, TypeError, r"loss_scale must be 'dynamic'.*got None \(NoneType\)"),
        (True, TypeError, r"got True \(bool\)"),
        ([2.0], TypeError, r"got \[2.0\] \(list\)"),
        (0, ValueError, r"FixedLossScale: loss_scale_value must be .*got 0"),
        (-8.0, ValueError, r"loss_scale_value must be .*got -8.0"),
        (float("inf"), ValueError, r"loss_scale_value must be .*got inf"),
    ],
)
def test_bad_loss_scale_is_rejected_with_the_options(loss_scale, error, pattern):
    with pytest.raises(error, match=pattern):
        jr.loss_scale_optimizer(optax.sgd(0.1), loss_scale)


def test_bad_optimizer_and_options_are_rejected():
    with pytest.raises(TypeError, match=r"expects an optax GradientTransformation.*got 'adam'"):
        jr.loss_scale_optimizer("adam")
    with pytest.raises(ValueError, match="already a loss-scale optimizer"):
        jr.loss_scale_optimizer(jr.loss_scale_optimizer(optax.sgd(0.1)))
    with pytest.raises(ValueError, match=r"use_select must be True or False; got 'yes'"):
        jr.loss_scale_optimizer(optax.sgd(0.1), use_select="yes")
    with pytest.raises(ValueError, match=r"debug must be True or False; got 1"):
        jr.loss_scale_optimizer(optax.sgd(0.1), debug=1)
    with pytest.raises(ValueError, match=r"axis_name must be None, a hashable axis name"):
        jr.loss_scale_optimizer(optax.sgd(0.1), axis_name=())
    with pytest.raises(ValueError, match=r"axis_name .*got \[\['i'\]\]"):
        jr.loss_scale_optimizer(optax.sgd(0.1), axis_name=[["i"]])


def test_helpers_reject_states_without_exactly_one_loss_scale_state():
    with pytest.raises(ValueError, match="no LossScaleOptimizerState found in the given dict"):
        jr.get_loss_scale({"w": jnp.ones(2)})
    with pytest.raises(ValueError, match="no LossScaleOptimizerState"):
        jr.scale_loss(1.0, optax.adam(0.1).init(PARAMS))
    two = optax.chain(
        jr.loss_scale_optimizer(optax.sgd(0.1)), jr.loss_scale_optimizer(optax.sgd(0.1))
    )
    with pytest.raises(ValueError, match=r"found 2 LossScaleOptimizerStates \(at \[0\], \[1\]\)"):
        jr.last_step_applied(two.init(PARAMS))
    with pytest.raises(TypeError, match="expects a callable"):
        jr.value_and_grad(3)
    plain = jr.loss_scale_optimizer(optax.sgd(0.1))
    with pytest.raises(ValueError, match="needs a loss_scale_optimizer built with debug=True"):
        jr.non_finite_leaves(plain.init(PARAMS), PARAMS)


def test_update_with_the_inner_optimizers_state_says_how_to_wrap_it():
    """Issue 14 item 6: an old checkpoint (the inner optimizer's state) restored into the
    wrapped optimizer (was: ``AttributeError: 'tuple' object has no attribute ...``)."""
    tx = jr.loss_scale_optimizer(optax.adam(1e-3))
    old_state = optax.adam(1e-3).init(PARAMS)
    with pytest.raises(TypeError, match=r"expects the state its own init returns.*got a tuple"):
        tx.update(PARAMS, old_state, PARAMS)
    # The fix the message gives works, and keeps the restored moments.
    old_state = optax.adam(1e-3).update(PARAMS, old_state, PARAMS)[1]
    state = tx.init(PARAMS)._replace(inner_state=old_state)
    _, state = tx.update(PARAMS, state, PARAMS)
    assert int(state.inner_state[0].count) == 2 and int(state.applied_steps) == 1


def test_value_and_grad_with_jax_calling_convention_says_state_first():
    """Issue 14 item 6: ``value_and_grad(loss)(params, x, y)`` (was: a TypeError from the
    user's own function, ``missing 1 required positional argument``)."""

    def loss(params, x, y):
        return jnp.sum((params["w"] * x - y) ** 2)

    x = jnp.ones(2)
    with pytest.raises(TypeError, match=r"value_and_grad\(loss\)\(opt_state, \*args\).*a dict"):
        jr.value_and_grad(loss)(PARAMS, x, x)
    state = jr.loss_scale_optimizer(optax.sgd(0.1), 4).init(PARAMS)
    value, _ = jr.value_and_grad(loss)(state, PARAMS, x, x)  # the call the message gives
    assert float(value) == float(loss(PARAMS, x, x))


# --------------------------------------------------------------------------------------------
# Helpers.


def test_scale_loss_is_float32_and_exact():
    state = jr.loss_scale_optimizer(optax.sgd(0.1)).init(PARAMS)
    scaled = jr.scale_loss(jnp.float16(3.0), state)  # 3 * 2**15 would overflow float16
    assert scaled.dtype == jnp.float32 and float(scaled) == 3.0 * 2**15
    assert float(jr.scale_loss(jnp.bfloat16(0.5), state)) == 2.0**14


@pytest.mark.parametrize("jit", [False, True])
def test_value_and_grad_returns_true_value_and_scaled_grads(jit):
    tx = jr.loss_scale_optimizer(optax.sgd(0.1), 8)
    state = tx.init(PARAMS)

    def loss(params, x, *, offset):
        return jnp.sum(params["w"] * x) + params["b"] ** 2 + offset

    x = jnp.array([1.0, 3.0])
    value, grads = maybe_jit(jit)(jr.value_and_grad(loss))(state, PARAMS, x, offset=1.0)
    assert float(value) == float(loss(PARAMS, x, offset=1.0))
    assert_trees_equal(grads, {"w": 8.0 * x, "b": jnp.array(8.0 * 2 * 0.5)})

    def loss_aux(params, x):
        return jnp.sum(params["w"] * x), {"n": x.size}

    (value, aux), (g_params, g_x) = jr.value_and_grad(loss_aux, argnums=(0, 1), has_aux=True)(
        state, PARAMS, x
    )
    assert float(value) == -5.0 and aux == {"n": 2}
    assert_trees_equal(g_x, 8.0 * PARAMS["w"])
    assert_trees_equal(g_params["w"], 8.0 * x)


def test_get_loss_scale_finds_the_state_in_optax_containers():
    ls = jr.loss_scale_optimizer(optax.sgd(0.1), 64)
    containers = {
        "chain": optax.chain(optax.identity(), ls),
        "named_chain": optax.named_chain(("a", optax.identity()), ("ls", ls)),
        "multi_steps": optax.MultiSteps(ls, 2).gradient_transformation(),
        "inject_around": optax.inject_hyperparams(
            jr.loss_scale_optimizer, static_args=("loss_scale",)
        )(opt=optax.sgd(0.1), loss_scale=64),
        "masked": optax.masked(ls, {"w": True, "b": True}),
    }
    for name, tx in containers.items():
        state = tx.init(PARAMS)
        assert float(jr.get_loss_scale(state)) == 64.0, name
        assert bool(jr.last_step_applied(state)), name
        assert int(jr.get_loss_scale_state(state).skipped_steps) == 0, name


def test_loss_scale_can_be_read_and_set_with_optax_tree_utils():
    tx = jr.loss_scale_optimizer(optax.sgd(1.0))
    state = optax.tree_utils.tree_set(tx.init(PARAMS), loss_scale=jnp.float32(4.0))
    assert float(optax.tree_utils.tree_get(state, "loss_scale")) == 4.0
    updates, _ = tx.update(scripted_grads(1, 4.0, "ok"), state)
    assert_trees_equal(updates, jax.tree.map(lambda g: -g, scripted_grads(1, 1.0, "ok")))


def test_is_loss_scale_optimizer():
    assert jr.is_loss_scale_optimizer(jr.loss_scale_optimizer(optax.adam(0.1)))
    assert not jr.is_loss_scale_optimizer(optax.adam(0.1))
    assert not jr.is_loss_scale_optimizer(optax.chain(jr.loss_scale_optimizer(optax.sgd(0.1))))
    assert not jr.is_loss_scale_optimizer(object())


@pytest.mark.parametrize("jit", [False, True])
def test_debug_reports_which_leaf_and_whether_nan_or_inf(jit):
    tx = jr.loss_scale_optimizer(optax.sgd(0.1), 2, debug=True)
    params = {"a": jnp.zeros(3), "b": {"c": jnp.zeros(2), "d": jnp.zeros(())}}
    state = tx.init(params)
    grads = {
        "a": jnp.array([1.0, jnp.nan, jnp.inf]),
        "b": {"c": jnp.array([-jnp.inf, 0.0]), "d": jnp.array(1.0)},
    }
    update = maybe_jit(jit)(tx.update)
    # A fixed scale applies anyway; the debug state still records what was wrong.
    _, state = update(grads, state, params)
    assert jr.non_finite_leaves(state, params) == [("['a']", "nan+inf"), ("['b']['c']", "inf")]
    np.testing.assert_array_equal(state.debug.leaf_has_nan, [True, False, False])
    _, state = update(jax.tree.map(jnp.ones_like, params), state, params)
    assert jr.non_finite_leaves(state, params) == []
    with pytest.raises(ValueError, match="tree has 1 leaves but the debug state records 3"):
        jr.non_finite_leaves(state, {"x": jnp.zeros(1)})


def test_extra_args_reach_the_inner_transformation():
    def scale_by_extra():
        def init(params):
            del params
            return optax.EmptyState()

        def update(updates, state, params=None, *, factor):
            del params
            return jax.tree.map(lambda g: g * factor, updates), state

        return optax.GradientTransformationExtraArgs(init, update)

    tx = jr.loss_scale_optimizer(scale_by_extra(), 4)
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    updates, _ = tx.update({"w": jnp.array([4.0, 8.0])}, tx.init({"w": jnp.zeros(2)}), factor=3.0)
    assert_trees_equal(updates, {"w": jnp.array([3.0, 6.0])})


def test_update_runs_in_a_float32_region():
    tx = jr.loss_scale_optimizer(optax.adam(0.1))
    state = tx.init(PARAMS)
    jaxpr = jax.make_jaxpr(tx.update)(scripted_grads(1, 1.0, "ok"), state, PARAMS)
    eqns = compat.open_jaxpr(jaxpr).eqns
    assert any(e.primitive.name == "cond" for e in eqns)
    outside = [e.primitive.name for e in eqns if FLOAT32_REGION_SCOPE not in compat.name_stack(e)]
    assert outside == []


def test_rewritten_train_step_keeps_the_whole_update_float32():
    tx = jr.loss_scale_optimizer(optax.adam(1e-2))
    x = jnp.ones((2, 4))

    def step(params, state, x):
        loss_fn = lambda p: jnp.sum(jnp.tanh(x @ p["w"]) + p["b"])
        _, grads = jr.value_and_grad(loss_fn)(state, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = {"w": jnp.full((4, 4), 0.1), "b": jnp.zeros(4)}
    painting = list(jr.paint(step, params, tx.init(params), x, dtype=jnp.bfloat16))
    region = [e for e in painting if e.in_float32_region]
    # The check, the cond and Adam's arithmetic, all float32; the model's matmuls half.
    assert {"is_finite", "sqrt", "div", "<cond-output>"} <= {e.primitive for e in region}
    assert [e.primitive for e in region if e.colour != "float32"] == []
    assert any(e.primitive == "dot_general" and e.colour == "allow" for e in painting)
    new_params, state = jax.jit(jr.rewrite(step, dtype=jnp.bfloat16))(params, tx.init(params), x)
    assert state.inner_state[0].mu["w"].dtype == jnp.float32
    assert bool(state.last_step_applied) and int(state.inner_state[0].count) == 1
    assert new_params["w"].dtype == jnp.float32


def test_rewritten_train_step_traces_once_through_skips_and_scale_changes():
    """The state keeps its structure and dtypes whatever happens: one trace, one compile."""
    tx = jr.loss_scale_optimizer(
        optax.adam(1e-2), jr.DynamicLossScale(initial_loss_scale=2.0**10, increment_period=2)
    )

    @chex.assert_max_traces(n=1)
    def step(params, state, x):
        loss_fn = lambda p: jnp.sum((x @ p["w"]) ** 2)
        _, grads = jr.value_and_grad(loss_fn)(state, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    chex.clear_trace_counter()
    train_step = jax.jit(jr.rewrite(step, dtype=jnp.float16))
    params = {"w": jnp.full((4, 4), 0.1, jnp.float32)}  # not weakly typed, as step returns it
    state = tx.init(params)
    scales, applied = [], []
    for scale_x in (0.01, 0.01, 0.01, 100.0, 0.01):  # 100: float16 gradients overflow
        params, state = train_step(params, state, jnp.full((2, 4), scale_x))
        scales.append(float(jr.get_loss_scale(state)))
        applied.append(bool(jr.last_step_applied(state)))
    assert applied == [True, True, True, False, True]
    assert scales == [2.0**10, 2.0**11, 2.0**11, 2.0**10, 2.0**10]


@pytest.mark.parametrize("method", ["elementwise", "dot"])
def test_finiteness_check_methods_are_exact(method):
    leaves = [
        jnp.ones((4, 3)),
        jnp.ones((5,)),
        jnp.array(2.0),
        jnp.ones((2, 2, 3)),
        jnp.arange(3),  # integer leaves are ignored
    ]
    inv = jnp.float32(1.0 / 1024)

    count_fn = jax.jit(
        lambda leaves: count_non_finite(leaves, inv, scale_at_least_one=True, method=method)
    )

    def count(leaves):
        return int(count_fn(leaves))

    assert count(leaves) == 0
    # Finite values whose row sum overflows float32 are still finite.
    big = leaves[:]
    big[0] = big[0].at[1].set(3.0e38)
    assert count(big) == 0
    for bad in (jnp.nan, jnp.inf, -jnp.inf):
        for i, index in ((0, (2, 1)), (1, 4), (2, ()), (3, (1, 0, 2))):
            poisoned = leaves[:]
            poisoned[i] = poisoned[i].at[index].set(bad)
            assert count(poisoned) == 1, (bad, i)
    two = leaves[:]
    two[0] = two[0].at[0, 0].set(jnp.nan)
    two[3] = two[3].at[0, 0, 0].set(jnp.inf)
    assert count(two) == 2
    with pytest.raises(ValueError, match="method must be"):
        count_non_finite(leaves, inv, scale_at_least_one=True, method="fast")


# --------------------------------------------------------------------------------------------
# Composition.


def test_outermost_in_chain_so_clipping_sees_unscaled_gradients():
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    tx = jr.loss_scale_optimizer(inner)
    true = {"w": jnp.array([0.25, -0.25]), "b": jnp.array(0.125)}  # norm < 1: not clipped
    updates, _ = jax.jit(tx.update)(jax.tree.map(lambda g: g * 2.0**15, true), tx.init(PARAMS))
    assert_trees_equal(updates, jax.tree.map(lambda g: -g, true))
    # Large true gradients are clipped to norm 1, as without loss scaling.
    large = {"w": jnp.array([3.0, -4.0]), "b": jnp.array(0.0)}
    updates, _ = tx.update(jax.tree.map(lambda g: g * 2.0**15, large), tx.init(PARAMS))
    ref, _ = inner.update(large, inner.init(PARAMS))
    assert_trees_close(updates, ref)
    assert float(optax.tree.norm(updates)) == pytest.approx(1.0)


def test_wrapping_multisteps_drops_a_non_finite_micro_batch():
    """Recommended nesting: each micro-batch is unscaled and checked on its own."""
    tx = jr.loss_scale_optimizer(
        optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2),
        jr.DynamicLossScale(initial_loss_scale=4.0, increment_period=100),
    )
    update = jax.jit(tx.update)
    params, state = PARAMS, tx.init(PARAMS)
    g = [scripted_grads(s, 1.0, "ok") for s in range(1, 6)]
    # (event, gradient index, expected mini_step after, expected scale after)
    script = [("ok", 0, 1, 4.0), ("nan", 1, 1, 2.0), ("ok", 2, 0, 2.0), ("ok", 3, 1, 2.0)]
    expected = [PARAMS, PARAMS, None, None]
    expected[2] = jax.tree.map(lambda p, a, b: p - (a + b) / 2, PARAMS, g[0], g[2])
    expected[3] = expected[2]
    for (event, i, mini_step, scale), want in zip(script, expected, strict=True):
        grads = scripted_grads(i + 1, float(state.loss_scale), event)
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        assert int(state.inner_state.mini_step) == mini_step
        assert float(state.loss_scale) == scale
        assert_trees_equal(params, want)
    assert int(state.inner_state.gradient_step) == 1 and int(state.skipped_steps) == 1


def test_inside_multisteps_the_scale_is_fixed_for_a_window():
    tx = optax.MultiSteps(
        jr.loss_scale_optimizer(
            optax.sgd(1.0), jr.DynamicLossScale(initial_loss_scale=4.0, increment_period=1)
        ),
        every_k_schedule=2,
    )
    update = jax.jit(tx.update)
    params, state = PARAMS, tx.init(PARAMS)
    g = [scripted_grads(s, 1.0, "ok") for s in range(1, 5)]
    scales = []
    for i in range(4):
        scale = jr.get_loss_scale(state)
        scaled = jax.tree.map(lambda x, scale=scale: x * scale, g[i])
        updates, state = update(scaled, state, params)
        params = optax.apply_updates(params, updates)
        scales.append(float(jr.get_loss_scale(state)))
    assert scales == [4.0, 8.0, 8.0, 16.0]  # one adjustment per window
    want = jax.tree.map(lambda p, a, b, c, d: p - (a + b) / 2 - (c + d) / 2, PARAMS, *g)
    assert_trees_equal(params, want)


def test_inside_multisteps_one_inf_micro_batch_poisons_optax_accumulator():
    """Why the docs say to wrap MultiSteps: optax (0.2.8) resets its accumulator as 0 * acc.

    If this fails, optax fixed the reset; revisit the MultiSteps notes of
    ``loss_scale_optimizer`` (nesting inside MultiSteps may then be fine).
    """
    tx = optax.MultiSteps(jr.loss_scale_optimizer(optax.sgd(1.0), 4), every_k_schedule=2)
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    for event in ("+inf", "ok", "ok", "ok"):
        _, state = update(scripted_grads(1, 4.0, event), state, PARAMS)
    assert not bool(jr.all_finite(state.acc_grads))


@pytest.mark.parametrize("use_select", [False, True])
@pytest.mark.parametrize("jit", [False, True])
def test_lookahead_updates_shaped_like_lookahead_params(jit, use_select):
    """optax.lookahead takes gradients of the fast parameters and returns LookaheadParams
    updates (fast and slow); they come back in the parameters' dtype, zero when skipped."""
    inner = optax.lookahead(optax.sgd(1.0), sync_period=2, slow_step_size=0.5)
    tx = jr.loss_scale_optimizer(
        inner, jr.DynamicLossScale(initial_loss_scale=4.0), use_select=use_select
    )
    update = maybe_jit(jit)(tx.update)
    bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), PARAMS)
    params = optax.LookaheadParams.init_synced(bf16)
    state = tx.init(params)
    ref_params = optax.LookaheadParams.init_synced(PARAMS)
    ref_state = inner.init(ref_params)
    for step, event in enumerate(("ok", "nan", "ok", "ok"), start=1):
        grads = scripted_grads(step, float(jr.get_loss_scale(state)), event)
        grads = jax.tree.map(lambda g: g.astype(jnp.bfloat16), grads)
        updates, new_state = update(grads, state, params)
        assert isinstance(updates, optax.LookaheadParams)
        assert {u.dtype for u in jax.tree.leaves(updates)} == {jnp.dtype(jnp.bfloat16)}
        if event == "ok":
            true = jax.tree.map(lambda g: g.astype(jnp.bfloat16), scripted_grads(step, 1, "ok"))
            ref_updates, ref_state = inner.update(true, ref_state, ref_params)
            ref_params = optax.apply_updates(ref_params, ref_updates)
        else:
            assert not any(np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
            assert_trees_equal(new_state.inner_state, state.inner_state)
        params, state = optax.apply_updates(params, updates), new_state
        # The reference runs in float32; the wrapped parameters are bfloat16.
        assert_trees_close(params, ref_params, rtol=1e-2)
    assert int(state.inner_state.steps_since_sync) == 1  # 3 applied steps, sync period 2
    assert not np.array_equal(np.asarray(params.slow["w"]), np.asarray(bf16["w"]))


def test_complex_parameters_keep_their_imaginary_part():
    params = {"z": jnp.array([1 + 2j, 3 - 1j], jnp.complex64), "w": jnp.ones(2)}
    true = {"z": jnp.array([0.5 + 0.25j, -1 + 1j], jnp.complex64), "w": jnp.array([0.5, 1.0])}
    inner = optax.adam(0.1)
    tx = jr.loss_scale_optimizer(inner, 8)
    updates, state = jax.jit(tx.update)(jax.tree.map(lambda g: g * 8, true), tx.init(params))
    ref, ref_state = inner.update(true, inner.init(params))
    assert updates["z"].dtype == jnp.complex64 and state.inner_state[0].mu["z"].dtype == (
        jnp.complex64
    )
    assert_trees_close(updates, ref)
    assert_trees_close(state.inner_state, ref_state)


def test_inject_hyperparams_inside_changes_the_learning_rate_and_freezes_on_skip():
    inner = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
    tx = jr.loss_scale_optimizer(inner, 4)
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    updates, state = update(scripted_grads(1, 4.0, "ok"), state)
    assert_trees_equal(updates, jax.tree.map(lambda g: -0.5 * g, scripted_grads(1, 1.0, "ok")))
    state.inner_state.hyperparams["learning_rate"] = jnp.asarray(0.25)
    tx_skip = jr.loss_scale_optimizer(inner, jr.FixedLossScale(4, skip_non_finite=True))
    _, skipped = jax.jit(tx_skip.update)(scripted_grads(1, 4.0, "nan"), state)
    assert_trees_equal(skipped.inner_state, state.inner_state)
    updates, state = update(scripted_grads(2, 4.0, "ok"), state)
    assert_trees_equal(updates, jax.tree.map(lambda g: -0.25 * g, scripted_grads(2, 1.0, "ok")))
    assert int(state.inner_state.count) == 2


def test_donated_jit_gives_the_same_trajectory():
    tx = jr.loss_scale_optimizer(
        optax.adam(0.1), jr.DynamicLossScale(initial_loss_scale=4.0, increment_period=2)
    )

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    plain, donated = jax.jit(step), jax.jit(step, donate_argnums=(0, 1))
    run = {"plain": (PARAMS, tx.init(PARAMS)), "donated": (PARAMS, tx.init(PARAMS))}
    for i, event in enumerate(["ok", "nan", "ok", "ok"], 1):
        for name, fn in (("plain", plain), ("donated", donated)):
            params, state = run[name]
            params = jax.tree.map(jnp.copy, params)
            grads = scripted_grads(i, float(state.loss_scale), event)
            run[name] = fn(params, state, grads)
        assert_trees_equal(run["plain"], run["donated"])


class _Linear(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)


def test_flax_nnx_optimizer():
    def loss_fn(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    @nnx.jit
    def scaled_step(model, optimizer, x, y):
        grads = nnx.grad(lambda m: jr.scale_loss(loss_fn(m, x, y), optimizer))(model)
        optimizer.update(model, grads)

    @nnx.jit
    def plain_step(model, optimizer, x, y):
        optimizer.update(model, nnx.grad(loss_fn)(model, x, y))

    model, ref_model = _Linear(nnx.Rngs(0)), _Linear(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, jr.loss_scale_optimizer(optax.adam(0.1)), wrt=nnx.Param)
    ref_optimizer = nnx.Optimizer(ref_model, optax.adam(0.1), wrt=nnx.Param)
    x, y = jnp.ones((4, 3)), jnp.zeros((4, 2))
    for _ in range(2):
        scaled_step(model, optimizer, x, y)
        plain_step(ref_model, ref_optimizer, x, y)
    assert_trees_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param), rtol=1e-5)
    assert float(jr.get_loss_scale(optimizer)) == 2.0**15
    assert int(jr.get_loss_scale_state(optimizer).applied_steps) == 2

    before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    scaled_step(model, optimizer, x.at[0, 0].set(jnp.nan), y)
    assert_trees_equal(nnx.state(model, nnx.Param), before)  # skipped
    assert not bool(jr.last_step_applied(optimizer))
    assert float(jr.get_loss_scale(optimizer)) == 2.0**14
    assert float(jr.get_loss_scale(nnx.state(optimizer))) == 2.0**14  # State form too
    assert float(jr.get_loss_scale(optimizer.opt_state)) == 2.0**14  # Variables unwrapped
    assert int(optimizer.step[...]) == 3  # nnx counts every call; use applied_steps instead
    assert int(jr.get_loss_scale_state(nnx.state(optimizer)).applied_steps) == 2


# --------------------------------------------------------------------------------------------
# Persistence.


@pytest.mark.parametrize("debug", [False, True])
def test_checkpoint_round_trip_continues_the_exact_trajectory(debug):
    tx = jr.loss_scale_optimizer(
        optax.adam(0.1),
        jr.DynamicLossScale(initial_loss_scale=8.0, increment_period=2),
        debug=debug,
    )

    @jax.jit
    def apply(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def step(params, state, event, i):
        return apply(params, state, scripted_grads(i, float(state.loss_scale), event))

    events = ["ok", "ok", "nan", "ok", "+inf", "ok", "ok", "ok", "-inf", "ok"]
    trajectory, carry = [], (PARAMS, tx.init(PARAMS))
    for i, event in enumerate(events):
        carry = step(*carry, event, i)
        trajectory.append(carry)

    saved = flax.serialization.to_bytes(trajectory[4])  # mid-way, right after a skip
    template = (jax.tree.map(jnp.zeros_like, PARAMS), tx.init(PARAMS))
    carry = flax.serialization.from_bytes(template, saved)
    assert_trees_equal(carry, trajectory[4])
    assert isinstance(carry[1], jr.LossScaleOptimizerState)
    for i in range(5, len(events)):
        carry = step(*carry, events[i], i)
        assert_trees_equal(carry, trajectory[i])
    assert float(carry[1].loss_scale) == float(trajectory[-1][1].loss_scale)


# --------------------------------------------------------------------------------------------
# Tracer leaks: every code path traced once under jax_check_tracer_leaks.


def test_no_tracer_leaks(leak_checking):
    """Every variant's update traced under ``jax.check_tracer_leaks`` (a traced ``apply``:
    ``lax.cond`` or ``jnp.where``) gives the eager update's results (a concrete ``apply``:
    Python picks the branch), on an applied and on a skipped step; so do the ``axis_name``
    paths under a named ``vmap`` and a jitted train step. Inputs and eager references are
    computed with the check off: it disables JAX's caches, and they trace nothing."""
    variants = [
        jr.loss_scale_optimizer(optax.adam(0.1)),
        jr.loss_scale_optimizer(optax.adam(0.1), use_select=True),
        jr.loss_scale_optimizer(optax.adam(0.1), debug=True),
        jr.loss_scale_optimizer(optax.adam(0.1), 8),
        jr.loss_scale_optimizer(optax.adam(0.1), jr.FixedLossScale(8, skip_non_finite=True)),
        jr.loss_scale_optimizer(optax.MultiSteps(optax.sgd(0.1), 2)),
        optax.MultiSteps(jr.loss_scale_optimizer(optax.sgd(0.1)), 2).gradient_transformation(),
    ]
    events = ("ok", "nan")
    with jax.check_tracer_leaks(False):
        grads = {e: scripted_grads(1, 4.0, e) for e in events}
        states = [tx.init(PARAMS) for tx in variants]
        eager = [
            [tx.update(grads[e], st, PARAMS) for e in events] for tx, st in zip(variants, states)
        ]
    for tx, state, expected in zip(variants, states, eager, strict=True):
        update = jax.jit(tx.update).lower(grads["ok"], state, PARAMS).compile()
        for event, ref in zip(events, expected, strict=True):
            assert_trees_close(update(grads[event], state, PARAMS), ref, rtol=1e-6, atol=0)
    for (_, ok_state), (_, nan_state) in eager[:3]:  # dynamic scale: halved on the skip
        assert float(jr.get_loss_scale(ok_state)) == 2.0**15
        assert float(jr.get_loss_scale(nan_state)) == 2.0**14
        assert bool(jr.last_step_applied(ok_state)) and not jr.last_step_applied(nan_state)

    # axis_name under a named vmap axis (psum / pmax paths): both members see the same
    # gradients when one is poisoned, so each gets the unbatched update; both skip.
    for debug in (False, True):
        tx = jr.loss_scale_optimizer(optax.sgd(0.1), axis_name="i", debug=debug)
        plain = jr.loss_scale_optimizer(optax.sgd(0.1), debug=debug)
        with jax.check_tracer_leaks(False):
            state = tx.init(PARAMS)
            batched = {
                e: jax.tree.map(lambda g, o: jnp.stack([g, o]), grads["ok"], grads[e])
                for e in events
            }
            expected = {e: plain.update(grads[e], plain.init(PARAMS), PARAMS)[0] for e in events}
        vmapped = jax.vmap(tx.update, in_axes=(0, None, None), axis_name="i", out_axes=(0, None))
        update = jax.jit(vmapped).lower(batched["ok"], state, PARAMS).compile()
        for e in events:
            updates, new_state = update(batched[e], state, PARAMS)
            for member in (0, 1):
                member_updates = jax.tree.map(lambda u, m=member: u[m], updates)
                assert_trees_close(member_updates, expected[e], rtol=1e-6, atol=0)
            assert bool(jr.last_step_applied(new_state)) == (e == "ok")

    def train_step(params, state):
        loss, g = jr.value_and_grad(lambda p: jnp.sum(p["w"] ** 2) + p["b"])(state, params)
        updates, state = variants[0].update(g, state, params)
        return optax.apply_updates(params, updates), state, loss, jr.last_step_applied(state)

    step = jax.jit(train_step).lower(PARAMS, states[0]).compile()
    params, _, loss, applied = step(PARAMS, states[0])
    assert float(loss) == 5.5 and bool(applied)
    # adam's first step moves each parameter by the learning rate against its gradient
    assert_trees_close(params, {"w": jnp.array([0.9, -1.9]), "b": jnp.array(0.4)}, rtol=1e-5)


@pytest.mark.parametrize("name", ["loss_scale.finite", "loss_scale.state"])
def test_docstring_examples_of_the_helper_modules_run(name):
    """test_public_api runs loss_scale_optimizer's; these are the pieces it imports."""
    module = importlib.import_module(f"jmp_rewrite._src.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
