"""Loss-scale objects: validation, immutability and TF1's exact dynamic update rule."""

from __future__ import annotations

import dataclasses
import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings

import jmp_rewrite as jr

F32_MAX = float(np.finfo(np.float32).max)


pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")


def maybe_jit(jit: bool):
    return jax.jit if jit else (lambda f: f)


def reference_tf1_update(scale, good, finite, *, period, multiplier, floor=1.0, ceiling=None):
    """TF1 ``DynamicLossScale.update``, transcribed from its pseudocode, in float32."""
    scale = np.float32(scale)
    if finite:
        if good + 1 >= period:
            with np.errstate(over="ignore"):
                new = np.float32(scale * np.float32(multiplier))
            if np.isfinite(new) and (ceiling is None or new <= ceiling):
                scale = new
            good = 0
        else:
            good += 1
    else:
        good = 0
        scale = max(np.float32(scale / np.float32(multiplier)), np.float32(floor))
    return float(scale), good, bool(finite)


# --------------------------------------------------------------------------------------------
# Construction and validation.


def test_defaults_are_tf1s():
    ls = jr.DynamicLossScale()
    assert ls.initial_loss_scale == 2.0**15
    assert ls.increment_period == 2000
    assert ls.multiplier == 2.0
    assert ls.min_loss_scale == 1.0
    assert ls.max_loss_scale is None
    assert ls.is_dynamic and ls.skips_non_finite
    fixed = jr.FixedLossScale(128)
    assert fixed.loss_scale_value == 128.0 and isinstance(fixed.loss_scale_value, float)
    assert not fixed.is_dynamic and not fixed.skips_non_finite


@pytest.mark.parametrize(
    "kwargs, argument, shown",
    [
        ({"initial_loss_scale": 0}, "initial_loss_scale", "0"),
        ({"initial_loss_scale": -4.0}, "initial_loss_scale", "-4.0"),
        ({"initial_loss_scale": math.inf}, "initial_loss_scale", "inf"),
        ({"initial_loss_scale": math.nan}, "initial_loss_scale", "nan"),
        ({"initial_loss_scale": 1e39}, "initial_loss_scale", "1e+39"),
        ({"initial_loss_scale": "big"}, "initial_loss_scale", "'big'"),
        ({"initial_loss_scale": True}, "initial_loss_scale", "True"),
        ({"initial_loss_scale": 0.5}, "initial_loss_scale", "0.5"),  # below the floor of 1
        ({"increment_period": 0}, "increment_period", "0"),
        ({"increment_period": 2.5}, "increment_period", "2.5"),
        ({"increment_period": True}, "increment_period", "True"),
        ({"increment_period": 2**31}, "increment_period", "2147483648"),
        ({"multiplier": 1.0}, "multiplier", "1.0"),
        ({"multiplier": 0.5}, "multiplier", "0.5"),
        ({"multiplier": math.inf}, "multiplier", "inf"),
        ({"multiplier": None}, "multiplier", "None"),
        ({"min_loss_scale": 0.0}, "min_loss_scale", "0.0"),
        ({"min_loss_scale": -1.0}, "min_loss_scale", "-1.0"),
        ({"max_loss_scale": 0.5}, "max_loss_scale", "0.5"),  # below min_loss_scale
        ({"max_loss_scale": math.inf}, "max_loss_scale", "inf"),
        ({"initial_loss_scale": 64.0, "max_loss_scale": 32.0}, "initial_loss_scale", "64.0"),
    ],
)
def test_dynamic_loss_scale_rejects_bad_arguments(kwargs, argument, shown):
    with pytest.raises(ValueError) as info:
        jr.DynamicLossScale(**kwargs)
    message = str(info.value)
    # names the offending argument first and says what is allowed
    assert message.startswith(f"DynamicLossScale: {argument} must"), message
    assert shown in message


@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan, "8", None, True, 1e39, 1e-46])
def test_fixed_loss_scale_rejects_bad_values(value):
    with pytest.raises(ValueError, match="loss_scale_value must be a finite real number"):
        jr.FixedLossScale(value)


def test_fixed_loss_scale_rejects_non_bool_skip_flag():
    with pytest.raises(ValueError, match="skip_non_finite must be True or False; got 'yes'"):
        jr.FixedLossScale(2.0, skip_non_finite="yes")


def test_boundary_values_are_accepted():
    assert jr.DynamicLossScale(initial_loss_scale=1.0).initial_loss_scale == 1.0
    assert jr.DynamicLossScale(increment_period=2**31 - 1).increment_period == 2**31 - 1
    assert jr.DynamicLossScale(initial_loss_scale=F32_MAX).initial_loss_scale == F32_MAX
    low = jr.DynamicLossScale(initial_loss_scale=0.25, min_loss_scale=2.0**-5)
    assert low.min_loss_scale == 2.0**-5
    assert jr.DynamicLossScale(initial_loss_scale=np.float32(4.0)).initial_loss_scale == 4.0
    assert jr.DynamicLossScale(increment_period=np.int64(5)).increment_period == 5


def test_loss_scales_are_immutable_hashable_values_and_not_pytrees():
    ls = jr.DynamicLossScale(initial_loss_scale=8, increment_period=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ls.multiplier = 4.0  # type: ignore[misc]
    assert ls == jr.DynamicLossScale(initial_loss_scale=8.0, increment_period=3)
    assert hash(ls) == hash(jr.DynamicLossScale(initial_loss_scale=8.0, increment_period=3))
    # Static configuration: a single opaque leaf, never flattened into arrays.
    assert jax.tree.leaves(ls) == [ls]
    assert jax.tree.leaves(jr.FixedLossScale(2.0)) == [jr.FixedLossScale(2.0)]


def test_init_gives_float32_scale_and_int32_counter():
    scale, good = jr.DynamicLossScale(initial_loss_scale=512).init()
    assert scale.dtype == jnp.float32 and scale.shape == () and float(scale) == 512.0
    assert good.dtype == jnp.int32 and int(good) == 0


# --------------------------------------------------------------------------------------------
# The update rule, step by step.


@pytest.mark.parametrize("jit", [False, True])
def test_dynamic_rule_walks_a_scripted_sequence(jit):
    ls = jr.DynamicLossScale(initial_loss_scale=4.0, increment_period=3, multiplier=2.0)
    update = maybe_jit(jit)(ls.update)
    # (finite?, expected scale after, expected good_steps after)
    script = [
        (True, 4.0, 1),
        (True, 4.0, 2),
        (True, 8.0, 0),  # third consecutive finite step: grow, reset
        (True, 8.0, 1),
        (False, 4.0, 0),  # overflow: back off, reset
        (True, 4.0, 1),
        (False, 2.0, 0),
        (False, 1.0, 0),
        (False, 1.0, 0),  # floor at 1
        (True, 1.0, 1),
        (True, 1.0, 2),
        (True, 2.0, 0),
    ]
    scale, good = ls.init()
    for i, (finite, want_scale, want_good) in enumerate(script):
        scale, good, apply = update(scale, good, jnp.array(finite))
        assert (float(scale), int(good), bool(apply)) == (want_scale, want_good, finite), i
        assert scale.dtype == jnp.float32 and good.dtype == jnp.int32


@pytest.mark.parametrize("jit", [False, True])
def test_growth_to_infinity_is_refused_and_counter_still_resets(jit):
    ls = jr.DynamicLossScale(initial_loss_scale=2.0**127, increment_period=1)
    update = maybe_jit(jit)(ls.update)
    scale, good = ls.init()
    for _ in range(3):
        scale, good, apply = update(scale, good, jnp.array(True))
        assert float(scale) == 2.0**127 and int(good) == 0 and bool(apply)
    scale, good, apply = update(scale, good, jnp.array(False))
    assert float(scale) == 2.0**126 and int(good) == 0 and not bool(apply)
    scale, good, apply = update(scale, good, jnp.array(True))
    assert float(scale) == 2.0**127


def test_growth_from_just_below_float32_max_with_odd_multiplier_is_refused():
    ls = jr.DynamicLossScale(initial_loss_scale=F32_MAX / 2, increment_period=1, multiplier=3.0)
    scale, good, _ = ls.update(*ls.init(), jnp.array(True))
    assert float(scale) == float(np.float32(F32_MAX / 2)) and int(good) == 0


def test_max_loss_scale_refuses_growth_past_it_without_clamping():
    ls = jr.DynamicLossScale(initial_loss_scale=4.0, increment_period=1, max_loss_scale=12.0)
    scale, good = ls.init()
    got = []
    for finite in (True, True, True, False, True):
        scale, good, _ = ls.update(scale, good, jnp.array(finite))
        got.append((float(scale), int(good)))
    # 4 -> 8; 16 > 12 refused (stays 8, not clamped to 12); back off to 4; grow to 8.
    assert got == [(8.0, 0), (8.0, 0), (8.0, 0), (4.0, 0), (8.0, 0)]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_growth_may_reach_max_loss_scale_exactly(jit):
    """TF1: ``new <= max`` grows; the ceiling itself is a valid scale (issue 17, item 8)."""
    ls = jr.DynamicLossScale(initial_loss_scale=2.0**17, increment_period=1, max_loss_scale=2.0**20)
    update = maybe_jit(jit)(ls.update)
    scale, good = ls.init()
    got = []
    for _ in range(4):
        scale, good, _ = update(scale, good, jnp.array(True))
        got.append(float(scale))
    assert got == [2.0**18, 2.0**19, 2.0**20, 2.0**20]


def test_min_loss_scale_below_one_and_custom_multiplier():
    ls = jr.DynamicLossScale(
        initial_loss_scale=9.0, increment_period=2, multiplier=3.0, min_loss_scale=0.5
    )
    scale, good = ls.init()
    got = []
    for finite in (False, False, False, False, True, True):
        scale, good, _ = ls.update(scale, good, jnp.array(finite))
        got.append(float(scale))
    assert got == pytest.approx([3.0, 1.0, 0.5, 0.5, 0.5, 1.5], rel=1e-7)


def test_fixed_rule_keeps_scale_and_applies_unless_asked_to_skip():
    for skip in (False, True):
        ls = jr.FixedLossScale(64, skip_non_finite=skip)
        scale, good = ls.init()
        for finite in (True, False, True):
            scale, good, apply = ls.update(scale, good, jnp.array(finite))
            assert float(scale) == 64.0 and int(good) == 0
            assert bool(apply) == (finite or not skip)


def test_hand_edited_counter_past_the_period_grows_at_once():
    ls = jr.DynamicLossScale(initial_loss_scale=2.0, increment_period=4)
    scale, good, _ = ls.update(jnp.float32(2.0), jnp.int32(2**31 - 1), jnp.array(True))
    assert float(scale) == 4.0 and int(good) == 0


def test_rule_vmaps_over_a_batch_of_states():
    ls = jr.DynamicLossScale(initial_loss_scale=8.0, increment_period=1)
    scales = jnp.array([8.0, 1.0, 2.0**127], jnp.float32)
    goods = jnp.zeros(3, jnp.int32)
    finite = jnp.array([True, False, True])
    new_scales, new_goods, apply = jax.vmap(ls.update)(scales, goods, finite)
    np.testing.assert_array_equal(new_scales, [16.0, 1.0, 2.0**127])
    np.testing.assert_array_equal(new_goods, [0, 0, 0])
    np.testing.assert_array_equal(apply, [True, False, True])


_SCAN_CACHE: dict = {}
_MAX_EVENTS = 40


def _run_rule(ls: jr.DynamicLossScale, events: list[bool]):
    """The rule over an event sequence in one jitted scan, compiled once per rule config.

    ``update`` does not read ``initial_loss_scale`` and the events are padded to a fixed
    length, so hypothesis examples share compilations.
    """
    key = (ls.increment_period, ls.multiplier, ls.min_loss_scale, ls.max_loss_scale)
    if key not in _SCAN_CACHE:

        def run(scale, good, events):
            def body(carry, finite):
                scale, good, apply = ls.update(*carry, finite)
                return (scale, good), (scale, good, apply)

            return jax.lax.scan(body, (scale, good), events)[1]

        _SCAN_CACHE[key] = jax.jit(run)
    padded = list(events) + [True] * (_MAX_EVENTS - len(events))
    return _SCAN_CACHE[key](*ls.init(), jnp.array(padded))


# The edges, pinned (hypothesis' derandomized examples need not reach them): growth onto
# the ceiling exactly, growth to infinity refused at 2**127, back-off onto the floor.
@example(events=[True] * 4, period=1, multiplier=2.0, exponent=0, floor=1.0, ceiling=8.0)
@example(events=[True] * 3, period=1, multiplier=4.0, exponent=16, floor=1.0, ceiling=2.0**20)
@example(
    events=[True, True, False, True],
    period=1,
    multiplier=2.0,
    exponent=127,
    floor=1.0,
    ceiling=None,
)
@example(
    events=[False] * 3 + [True] * 4, period=3, multiplier=4.0, exponent=3, floor=0.25, ceiling=None
)
@settings(max_examples=30, deadline=None)
@given(
    events=st.lists(st.booleans(), min_size=1, max_size=_MAX_EVENTS),
    period=st.sampled_from([1, 3]),
    # Powers of two, so that XLA's division-by-constant rewrite is exact (a 3 can be 1 ulp off).
    multiplier=st.sampled_from([2.0, 4.0]),
    exponent=st.sampled_from([0, 3, 20, 126, 127]),
    floor=st.sampled_from([1.0, 0.25]),
    ceiling=st.sampled_from([None, 2.0**20]),
)
def test_rule_matches_tf1_pseudocode(events, period, multiplier, exponent, floor, ceiling):
    initial = 2.0**exponent
    if ceiling is not None and initial > ceiling:
        initial = ceiling
    ls = jr.DynamicLossScale(
        initial_loss_scale=initial,
        increment_period=period,
        multiplier=multiplier,
        min_loss_scale=floor,
        max_loss_scale=ceiling,
    )
    scales, goods, applies = (np.asarray(x) for x in _run_rule(ls, events))
    ref_scale, ref_good = initial, 0
    for i, finite in enumerate(events):
        ref_scale, ref_good, ref_apply = reference_tf1_update(
            ref_scale,
            ref_good,
            finite,
            period=period,
            multiplier=multiplier,
            floor=floor,
            ceiling=ceiling,
        )
        got = (float(scales[i]), int(goods[i]), bool(applies[i]))
        assert got == (ref_scale, ref_good, ref_apply), i


def test_rules_trace_without_leaks(leak_checking):
    """Under ``jax.check_tracer_leaks``, the jitted and the vmapped rules give the eager
    rule's results (growth onto the ceiling, back-off, a fixed scale skipping)."""
    rules = (
        jr.DynamicLossScale(initial_loss_scale=2.0**19, increment_period=1, max_loss_scale=2.0**20),
        jr.FixedLossScale(4, True),
    )
    for ls in rules:
        scales = jnp.array([2.0**19, 2.0**20, 8.0], jnp.float32)
        goods = jnp.zeros(3, jnp.int32)
        finite = jnp.array([True, True, False])
        eager = [ls.update(s, g, f) for s, g, f in zip(scales, goods, finite)]
        for one, (s, g, f) in zip(eager, zip(scales, goods, finite)):
            jitted = jax.jit(ls.update)(s, g, f)
            for a, b in zip(jitted, one, strict=True):
                np.testing.assert_array_equal(a, b)
        batched = jax.jit(jax.vmap(ls.update))(scales, goods, finite)
        for i, out in enumerate(batched):
            np.testing.assert_array_equal(out, [e[i] for e in eager])
        if ls.is_dynamic:
            assert [float(e[0]) for e in eager] == [2.0**20, 2.0**20, 4.0]
        else:
            assert [bool(e[2]) for e in eager] == [True, True, False]
