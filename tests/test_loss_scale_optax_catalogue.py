"""``loss_scale_optimizer`` around optax's catalogue: optimizers, contrib and wrappers.

Each case trains three steps under ``jax.jit``: finite, non-finite (skipped), finite. The
wrapped optimizer must follow the trajectory of the bare optimizer fed only the two finite
steps (the scale is a power of two, so unscaling is exact), leave its inner state untouched on
the skipped step and return zero updates of the applied structure. The jitted step must trace
once (``chex.assert_max_traces``): state and update structures and dtypes are stable.

Cases cover update structures that differ from the gradients: ``optax.lookahead`` returns
``LookaheadParams`` updates for ``LookaheadParams`` parameters; ``dpsgd`` takes per-example
gradients with a batch axis and returns updates without it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

import jmp_rewrite as jr

pytestmark = [
    pytest.mark.usefixtures("leak_check_only_where_asked"),
    # optax 0.2.8's contrib.dpsgd passes a seed on to differentially_private_aggregate.
    pytest.mark.filterwarnings('ignore:"seed" is deprecated:DeprecationWarning'),
]

X = jnp.asarray(np.random.default_rng(0).normal(size=(6, 4)), jnp.float32)
Y = jnp.asarray(np.random.default_rng(1).normal(size=(6, 3)), jnp.float32)
PARAMS = {
    "w": jnp.asarray(np.random.default_rng(2).normal(size=(4, 3)) * 0.5, jnp.float32),
    "b": jnp.zeros(3, jnp.float32),
}


def loss_fn(params: Any, x: jax.Array = X, y: jax.Array = Y) -> jax.Array:
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def per_example_grads(params: Any) -> Any:
    return jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, 0))(params, X[:, None], Y[:, None])


@dataclasses.dataclass(frozen=True)
class Case:
    """One catalogue entry: how to build it and what its ``update`` needs."""

    make: Callable[[], Any]
    #: ``extra(params, grads) -> dict`` of extra arguments to ``update`` (inside jit).
    extra: Callable[[Any, Any], dict] = lambda params, grads: {}
    #: The gradients fed to ``update``, from the model parameters.
    grads: Callable[[Any], Any] = jax.grad(loss_fn)
    #: The parameters ``init``/``update`` take, from the model parameters.
    wrap_params: Callable[[Any], Any] = lambda p: p
    #: The model parameters back from the wrapped ones.
    model_params: Callable[[Any], Any] = lambda p: p


def _value(params: Any, grads: Any) -> dict:
    return {"value": loss_fn(params)}


def _linesearch_args(params: Any, grads: Any) -> dict:
    return {"value": loss_fn(params), "grad": grads, "value_fn": loss_fn}


def _lookahead_params(params: Any) -> optax.LookaheadParams:
    return optax.LookaheadParams.init_synced(params)


def _label(params: Any) -> dict:
    return {"w": "a", "b": "b"}


SGD = optax.sgd(0.05)
ADAM = optax.adam(0.05)

with warnings.catch_warnings():  # some aliases are deprecated in favour of optax.contrib
    warnings.simplefilter("ignore", DeprecationWarning)
    CATALOGUE: dict[str, Case] = {
        # optax's optimizers.
        "adabelief": Case(lambda: optax.adabelief(0.05)),
        "adadelta": Case(lambda: optax.adadelta(0.5)),
        "adafactor": Case(lambda: optax.adafactor(0.05)),
        "adagrad": Case(lambda: optax.adagrad(0.05)),
        "adam": Case(lambda: optax.adam(0.05)),
        "adam_nesterov": Case(lambda: optax.adam(0.05, nesterov=True)),
        "adamax": Case(lambda: optax.adamax(0.05)),
        "adamaxw": Case(lambda: optax.adamaxw(0.05)),
        "adamw": Case(lambda: optax.adamw(0.05)),
        "adan": Case(lambda: optax.adan(0.05)),
        "amsgrad": Case(lambda: optax.amsgrad(0.05)),
        "fromage": Case(lambda: optax.fromage(0.05)),
        "lamb": Case(lambda: optax.lamb(0.05)),
        "lars": Case(lambda: optax.lars(0.05)),
        "lbfgs": Case(lambda: optax.lbfgs(), extra=_linesearch_args),
        "lion": Case(lambda: optax.lion(0.05)),
        "nadam": Case(lambda: optax.nadam(0.05)),
        "nadamw": Case(lambda: optax.nadamw(0.05)),
        "noisy_sgd": Case(lambda: optax.noisy_sgd(0.05, key=0)),
        "novograd": Case(lambda: optax.novograd(0.05)),
        "optimistic_adam_v2": Case(lambda: optax.optimistic_adam_v2(0.05)),
        "optimistic_gradient_descent": Case(lambda: optax.optimistic_gradient_descent(0.05)),
        "polyak_sgd": Case(lambda: optax.polyak_sgd(0.5), extra=_value),
        "radam": Case(lambda: optax.radam(0.05)),
        "rmsprop": Case(lambda: optax.rmsprop(0.05, momentum=0.9, centered=True)),
        "rprop": Case(lambda: optax.rprop(0.05)),
        "sgd": Case(lambda: optax.sgd(0.05, momentum=0.9, nesterov=True)),
        "sign_sgd": Case(lambda: optax.sign_sgd(0.05)),
        "signum": Case(lambda: optax.signum(0.05)),
        "sm3": Case(lambda: optax.sm3(0.05)),
        "yogi": Case(lambda: optax.yogi(0.05)),
        # optax.contrib.
        "acprop": Case(lambda: optax.contrib.acprop(0.05)),
        "ademamix": Case(lambda: optax.contrib.ademamix(0.05)),
        "adopt": Case(lambda: optax.contrib.adopt(0.05)),
        "cocob": Case(lambda: optax.contrib.cocob()),
        "dadapt_adamw": Case(lambda: optax.contrib.dadapt_adamw()),
        "dog": Case(lambda: optax.contrib.dog()),
        "dowg": Case(lambda: optax.contrib.dowg()),
        "dpsgd": Case(
            lambda: optax.contrib.dpsgd(0.05, l2_norm_clip=1.0, noise_multiplier=0.1, seed=0),
            grads=per_example_grads,
        ),
        "madgrad": Case(lambda: optax.contrib.madgrad(0.05)),
        "mechanize": Case(lambda: optax.contrib.mechanize(optax.adam(0.05))),
        "momo": Case(lambda: optax.contrib.momo(), extra=_value),
        "momo_adam": Case(lambda: optax.contrib.momo_adam(), extra=_value),
        "muon": Case(lambda: optax.contrib.muon(0.05)),
        "prodigy": Case(lambda: optax.contrib.prodigy()),
        "reduce_on_plateau": Case(
            lambda: optax.chain(ADAM, optax.contrib.reduce_on_plateau(patience=1)), extra=_value
        ),
        "sam": Case(lambda: optax.contrib.sam(SGD, optax.sgd(0.01), sync_period=2)),
        "schedule_free_adamw": Case(lambda: optax.contrib.schedule_free_adamw(0.05)),
        "schedule_free_sgd": Case(lambda: optax.contrib.schedule_free_sgd(0.05)),
        "simplified_ademamix": Case(lambda: optax.contrib.simplified_ademamix(0.05)),
        # Wrappers and combinators.
        "MultiSteps": Case(lambda: optax.MultiSteps(ADAM, every_k_schedule=2)),
        "apply_every": Case(lambda: optax.chain(optax.apply_every(2), SGD)),
        "apply_if_finite": Case(lambda: optax.apply_if_finite(ADAM, 3)),
        "chain_clip_adam": Case(lambda: optax.chain(optax.clip_by_global_norm(0.1), ADAM)),
        "conditionally_mask": Case(lambda: optax.conditionally_mask(ADAM, lambda n: n >= 1)),
        "flatten": Case(lambda: optax.flatten(ADAM)),
        "freeze": Case(lambda: optax.chain(optax.freeze({"w": False, "b": True}), SGD)),
        "inject_hyperparams": Case(lambda: optax.inject_hyperparams(optax.adam)(0.05)),
        "lookahead": Case(
            lambda: optax.lookahead(ADAM, sync_period=2, slow_step_size=0.5),
            wrap_params=_lookahead_params,
            model_params=lambda p: p.fast,
        ),
        "masked": Case(lambda: optax.masked(ADAM, {"w": True, "b": False})),
        "multi_transform": Case(lambda: optax.multi_transform({"a": ADAM, "b": SGD}, _label)),
        "named_chain": Case(lambda: optax.named_chain(("clip", optax.clip(0.5)), ("adam", ADAM))),
        "partition": Case(lambda: optax.partition({"a": ADAM, "b": SGD}, _label)),
        "schedule_free": Case(lambda: optax.contrib.schedule_free(optax.adam(1.0), 0.05)),
        "selective_transform": Case(
            lambda: optax.selective_transform(ADAM, freeze_mask={"w": False, "b": True})
        ),
    }


def _train(tx: Any, case: Case, events: tuple[str, ...], *, scaled: bool, jit: bool) -> list:
    """``[(model params, updates, state)]`` after each step of ``events``."""
    params = case.wrap_params(PARAMS)
    state = tx.init(params)

    def step(params: Any, state: Any, poison: jax.Array) -> Any:
        grads = case.grads(case.model_params(params))
        # One element of the first leaf becomes +Inf on a poisoned step.
        first, *rest = jax.tree.leaves(grads)
        first = first.reshape(-1).at[0].add(jnp.where(poison, jnp.inf, 0.0)).reshape(first.shape)
        grads = jax.tree.unflatten(jax.tree.structure(grads), [first, *rest])
        if scaled:  # the scale is a power of two: unscaling is exact
            scale = jr.get_loss_scale(state)
            grads_in = jax.tree.map(lambda g: g * scale, grads)
        else:
            grads_in = grads
        extra = case.extra(case.model_params(params), grads)
        updates, state = tx.update(grads_in, state, params, **extra)
        return optax.apply_updates(params, updates), updates, state

    if jit:
        chex.clear_trace_counter()  # chex counts by definition site, across tests
        step = jax.jit(chex.assert_max_traces(step, n=1))
    out = []
    for event in events:
        params, updates, state = step(params, state, jnp.asarray(event == "inf"))
        out.append((case.model_params(params), updates, state))
    return out


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_catalogue_member_skips_exactly_and_otherwise_matches_the_bare_optimizer(name):
    case = CATALOGUE[name]
    lso = jr.loss_scale_optimizer(case.make(), jr.DynamicLossScale(2.0**8))
    wrapped = _train(lso, case, ("ok", "inf", "ok"), scaled=True, jit=True)
    bare = _train(case.make(), case, ("ok", "ok"), scaled=False, jit=False)

    (p1, u1, s1), (p2, u2, s2), (p3, _, s3) = wrapped
    assert [bool(s.last_step_applied) for s in (s1, s2, s3)] == [True, False, True]
    assert int(s3.skipped_steps) == 1 and int(s3.applied_steps) == 2
    # The skipped step: zero updates shaped like the applied ones, nothing moved.
    assert jax.tree.structure(u2) == jax.tree.structure(u1)
    for zero, applied in zip(jax.tree.leaves(u2), jax.tree.leaves(u1), strict=True):
        assert zero.shape == applied.shape and zero.dtype == applied.dtype
        assert not np.any(np.asarray(zero))
    chex.assert_trees_all_equal(s2.inner_state, s1.inner_state)
    chex.assert_trees_all_equal(p2, p1)
    # The applied steps follow the bare optimizer.
    moved = jax.tree.map(lambda a, b: np.any(np.asarray(a) != np.asarray(b)), p3, PARAMS)
    assert any(jax.tree.leaves(moved)), f"{name} did not train"
    chex.assert_trees_all_close(p1, bare[0][0], rtol=1e-5, atol=1e-7)
    chex.assert_trees_all_close(p3, bare[1][0], rtol=1e-5, atol=1e-7)
