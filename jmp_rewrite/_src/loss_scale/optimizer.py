"""Loss scaling as an optax transformation: TF1's ``MixedPrecisionLossScaleOptimizer``.

:func:`loss_scale_optimizer` wraps any optax transformation. Its ``update`` receives the
gradients of ``loss * loss_scale`` (see :func:`scale_loss` and :func:`value_and_grad`) and,
in three pieces shaped like ``optax.apply_if_finite``:

1. checks that they are all finite after unscaling with the scale that was in force when the
   loss was scaled (:func:`jmp_rewrite._src.loss_scale.finite.check_finite`);
2. runs the inner optimizer on the unscaled float32 gradients, or returns zero updates with
   the inner state untouched (:func:`_apply_or_skip`), so Adam's step count and moments, and
   any schedule inside, do not advance on a skipped step (TF: "nor is ``global_step``
   incremented");
3. adjusts the loss scale (:class:`jmp_rewrite.DynamicLossScale`) and the step counters
   (:func:`_next_state`).

How it can be misused:

* Put it **outermost**. A transformation placed before it (e.g. ``clip_by_global_norm``) would
  see scaled gradients, and one that mixes values across leaves turns one Inf into NaN
  everywhere. Transformations inside it see unscaled float32 gradients.
* Differentiate ``scale_loss(loss, opt_state)``, not ``loss``, using the state you will pass
  to ``update``; gradients of an unscaled loss would be divided by the scale.
* Parameters updated outside the returned updates (e.g. an EMA, a learning-rate schedule
  stepped by hand, ``nnx.Optimizer.step``) still advance on skipped steps unless they are gated
  on :func:`last_step_applied`.
* Wrap :class:`optax.MultiSteps`, do not put this inside it (see :func:`loss_scale_optimizer`).
* One per optimizer: ``init`` refuses a loss-scale optimizer anywhere inside this one (it would
  unscale a second time), and ``update`` refuses a state its ``init`` does not make
  (:mod:`jmp_rewrite._src.loss_scale.checks`).

References:
  Micikevicius et al., `Mixed Precision Training <https://arxiv.org/abs/1710.03740>`_, 2018.
  TensorFlow, ``tf.compat.v1.train.experimental.MixedPrecisionLossScaleOptimizer``.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_rewrite._src.loss_scale.checks import check_state, refuse_nested
from jmp_rewrite._src.loss_scale.finite import (
    AxisName,
    LossScaleDebugState,
    all_finite,
    check_finite,
    unscale,
)
from jmp_rewrite._src.loss_scale.scale import DynamicLossScale, FixedLossScale, LossScale
from jmp_rewrite._src.loss_scale.state import (
    LossScaleOptimizerState,
    UnscaledGradientsWarning,
    check_loss_was_scaled,
    get_loss_scale,
    get_loss_scale_state,
    last_step_applied,
    non_finite_leaves,
    scale_loss,
    value_and_grad,
)
from jmp_rewrite._src.trace.regions import float32_region

# The public names of loss scaling, imported by ``jmp_rewrite`` from this module.
__all__ = [
    "LossScaleDebugState",
    "LossScaleOptimizerState",
    "MixedPrecisionLossScaleOptimizer",
    "UnscaledGradientsWarning",
    "all_finite",
    "get_loss_scale",
    "get_loss_scale_state",
    "is_loss_scale_optimizer",
    "last_step_applied",
    "loss_scale_optimizer",
    "non_finite_leaves",
    "scale_loss",
    "value_and_grad",
]

ArrayTree = Any

#: Attribute set on the ``update`` function of every transformation built here.
_MARKER = "_jmp_rewrite_loss_scale"


# --------------------------------------------------------------------------------------------
# Dtypes.


def _to_float32(tree: ArrayTree) -> ArrayTree:
    """Real floating leaves cast to float32 (other leaves, and ``None``, as they are)."""
    if tree is None:
        return None

    def cast(x: Any) -> Any:
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(jnp.float32)
        return x

    return jax.tree.map(cast, tree)


def _cast_like(tree: ArrayTree, like: ArrayTree) -> ArrayTree:
    """``tree``'s array leaves cast to the dtypes of the matching leaves of ``like``."""

    def cast(ref: Any, x: Any) -> Any:
        if hasattr(ref, "dtype") and hasattr(x, "dtype") and x.dtype != ref.dtype:
            return x.astype(ref.dtype)
        return x

    return jax.tree.map(cast, like, tree)


def _cast_updates_back(updates: ArrayTree, grads: ArrayTree, params: ArrayTree) -> ArrayTree:
    """The inner optimizer's updates in the dtypes of the leaves they stand for.

    Updates usually mirror the gradients and are cast like them. Some wrappers return updates
    shaped like the parameters instead (``optax.lookahead``: ``LookaheadParams``); those are
    cast like the parameters. Any other structure is returned as the inner optimizer made it.
    """
    structure = jax.tree.structure(updates)
    if structure == jax.tree.structure(grads):
        return _cast_like(updates, grads)
    if params is not None and structure == jax.tree.structure(params):
        return _cast_like(updates, params)
    return updates


# --------------------------------------------------------------------------------------------
# Apply or skip, and the next state.


def _applied_update(
    inner: optax.GradientTransformationExtraArgs,
    inv_scale: jax.Array,
    extra_args: dict[str, Any],
    params: ArrayTree,
    grads: ArrayTree,
    inner_state: Any,
    params32: ArrayTree,
) -> tuple[ArrayTree, Any]:
    """An applied step: ``inner.update`` on the unscaled gradients, dtypes cast back."""
    unscaled = jax.tree.map(lambda g: unscale(g, inv_scale), grads)
    updates, new_inner = inner.update(unscaled, inner_state, params32, **extra_args)
    return _cast_updates_back(updates, grads, params), _cast_like(new_inner, inner_state)


def _no_update_like(tree: ArrayTree) -> ArrayTree:
    """Updates that change nothing: ``-0.0`` for floats, the one ``x`` for which ``p + x`` is
    ``p`` bit for bit for every ``p`` (``-0.0 + 0.0`` is ``+0.0``: a parameter at ``-0.0``
    would come back as ``+0.0`` after a skipped step), zeros otherwise."""

    def leaf(u: Any) -> jax.Array:
        # zeros_like keeps what ``u`` (a ShapeDtypeStruct too) says of shardings and varying
        # manual axes; negating it gives -0.0 (complex: -0.0 - 0.0j).
        zeros = jnp.zeros_like(u)
        return -zeros if jnp.issubdtype(u.dtype, jnp.inexact) else zeros

    return jax.tree.map(leaf, tree)


def _skipped_update(
    applied: Callable[..., tuple[ArrayTree, Any]],
    grads: ArrayTree,
    inner_state: Any,
    params32: ArrayTree,
) -> tuple[ArrayTree, Any]:
    """A skipped step: no-op updates (see :func:`_no_update_like`) shaped like ``applied``'s;
    ``inner_state`` unchanged."""
    # Whatever structure the inner optimizer returns (e.g. per-example gradients in, batch-free
    # updates out), found by tracing it without running it.
    updates_like, _ = jax.eval_shape(applied, grads, inner_state, params32)
    return _no_update_like(updates_like), inner_state


def _static_bool(x: jax.Array) -> bool | None:
    """``bool(x)`` when ``x`` is a concrete value, ``None`` when it is traced."""
    try:
        return bool(x)
    except jax.errors.ConcretizationTypeError:
        return None


def _apply_or_skip(
    applied: Callable[..., tuple[ArrayTree, Any]],
    apply: jax.Array,
    grads: ArrayTree,
    inner_state: Any,
    params32: ArrayTree,
    *,
    use_select: bool,
) -> tuple[ArrayTree, Any]:
    """``applied(grads, inner_state, params32)`` if ``apply``, else zero updates and the state.

    With ``use_select`` both are computed and chosen leaf by leaf with ``jnp.where``;
    otherwise ``jax.lax.cond`` runs one, or Python picks it when ``apply`` is concrete (an
    eager call, like TF's ``smart_cond``).
    """
    if use_select:
        new_updates, new_inner = applied(grads, inner_state, params32)
        new_updates = jax.tree.map(
            lambda u, none: jnp.where(apply, u, none), new_updates, _no_update_like(new_updates)
        )
        new_inner = jax.tree.map(lambda n, o: jnp.where(apply, n, o), new_inner, inner_state)
        return new_updates, new_inner
    skipped = functools.partial(_skipped_update, applied)
    static_apply = _static_bool(apply)
    if static_apply is None:
        return jax.lax.cond(apply, applied, skipped, grads, inner_state, params32)
    return (applied if static_apply else skipped)(grads, inner_state, params32)


def _next_state(
    state: LossScaleOptimizerState,
    inner_state: Any,
    loss_scale: jax.Array,
    good_steps: jax.Array,
    apply: jax.Array,
    debug: LossScaleDebugState | tuple[()],
) -> LossScaleOptimizerState:
    """The state after a step: new inner state and scale, counters advanced (saturating)."""
    applied, skipped = state.applied_steps, state.skipped_steps
    return LossScaleOptimizerState(
        inner_state=inner_state,
        loss_scale=loss_scale,
        good_steps=good_steps,
        applied_steps=jnp.where(apply, optax.safe_increment(applied), applied),
        skipped_steps=jnp.where(apply, skipped, optax.safe_increment(skipped)),
        last_step_applied=apply,
        debug=debug,
    )


# --------------------------------------------------------------------------------------------
# The transformation.


class _Options(NamedTuple):
    """What :func:`loss_scale_optimizer` was built with (validated)."""

    inner: optax.GradientTransformationExtraArgs
    scale_rule: LossScale
    axis_name: AxisName | None
    use_select: bool
    debug: bool

    @property
    def scale_at_least_one(self) -> bool:
        """The scale never drops below 1: scaled gradients are finite iff unscaled ones are."""
        rule = self.scale_rule
        if isinstance(rule, DynamicLossScale):
            return rule.min_loss_scale >= 1.0
        return rule.loss_scale_value >= 1.0


def _init(options: _Options, params: ArrayTree) -> LossScaleOptimizerState:
    loss_scale, good_steps = options.scale_rule.init()
    debug: LossScaleDebugState | tuple[()] = ()
    if options.debug:
        n = len(jax.tree.leaves(params))
        debug = LossScaleDebugState(jnp.zeros([n], jnp.bool_), jnp.zeros([n], jnp.bool_))
    inner_state = options.inner.init(_to_float32(params))
    refuse_nested(inner_state)
    return LossScaleOptimizerState(
        inner_state=inner_state,
        loss_scale=loss_scale,
        good_steps=good_steps,
        applied_steps=jnp.zeros([], jnp.int32),
        skipped_steps=jnp.zeros([], jnp.int32),
        last_step_applied=jnp.array(True),
        debug=debug,
    )


def _update(
    options: _Options,
    grads: ArrayTree,
    state: LossScaleOptimizerState,
    params: ArrayTree | None,
    extra_args: dict[str, Any],
) -> tuple[ArrayTree, LossScaleOptimizerState]:
    if not isinstance(state, LossScaleOptimizerState):
        raise TypeError(
            "the update of a jmp_rewrite.loss_scale_optimizer expects the state its own init "
            f"returns (a LossScaleOptimizerState); got a {type(state).__name__}, perhaps the "
            "state of the optimizer it wraps (a checkpoint saved before wrapping). Wrap that "
            "state instead: state = tx.init(params)._replace(inner_state=old_state)"
        )
    check_state(state, grads, params, inner_init=options.inner.init, debug=options.debug)
    rule = options.scale_rule
    loss_scale = jnp.asarray(state.loss_scale, jnp.float32)
    inv_scale = jnp.float32(1.0) / loss_scale
    # A fixed scale that never skips needs no finiteness check unless debugging asks for it.
    if rule.skips_non_finite or options.debug:
        finite, debug = check_finite(
            grads,
            inv_scale,
            axis_name=options.axis_name,
            debug=options.debug,
            scale_at_least_one=options.scale_at_least_one,
        )
    else:
        finite, debug = jnp.array(True), ()
    new_scale, new_good, apply = rule.update(loss_scale, state.good_steps, finite)

    applied = functools.partial(_applied_update, options.inner, inv_scale, extra_args, params)
    params32 = _to_float32(params)
    if rule.skips_non_finite:
        updates, inner_state = _apply_or_skip(
            applied, apply, grads, state.inner_state, params32, use_select=options.use_select
        )
    else:
        updates, inner_state = applied(grads, state.inner_state, params32)
    return updates, _next_state(state, inner_state, new_scale, new_good, apply, debug)


_LOSS_SCALE_OPTIONS = (
    "'dynamic', a positive number (a fixed scale), a jmp_rewrite.DynamicLossScale or a "
    "jmp_rewrite.FixedLossScale"
)


def _as_loss_scale(loss_scale: Any) -> LossScale:
    if isinstance(loss_scale, DynamicLossScale | FixedLossScale):
        return loss_scale
    if isinstance(loss_scale, str):
        if loss_scale == "dynamic":
            return DynamicLossScale()
        raise ValueError(f"loss_scale must be {_LOSS_SCALE_OPTIONS}; got {loss_scale!r}")
    if isinstance(loss_scale, numbers.Real) and not isinstance(loss_scale, bool | np.bool_):
        return FixedLossScale(loss_scale)
    raise TypeError(
        f"loss_scale must be {_LOSS_SCALE_OPTIONS}; got {loss_scale!r} "
        f"({type(loss_scale).__name__})"
    )


def _as_extra_args_transformation(opt: Any) -> optax.GradientTransformationExtraArgs:
    if isinstance(opt, optax.GradientTransformation):
        return optax.with_extra_args_support(opt)
    # Duck-typed optimizers with init/update methods, e.g. optax.MultiSteps instances.
    if callable(getattr(opt, "init", None)) and callable(getattr(opt, "update", None)):
        return optax.GradientTransformationExtraArgs(opt.init, opt.update)
    raise TypeError(
        "loss_scale_optimizer expects an optax GradientTransformation (or an object with "
        f"init and update methods, such as optax.MultiSteps); got {opt!r} "
        f"({type(opt).__name__})"
    )


def _check_axis_name(axis_name: Any) -> None:
    if axis_name is None:
        return
    names = axis_name if isinstance(axis_name, tuple | list) else (axis_name,)
    if not names or not all(isinstance(n, Hashable) and n is not None for n in names):
        raise ValueError(
            "axis_name must be None, a hashable axis name or a non-empty tuple of them "
            f"(as bound by shard_map or pmap); got {axis_name!r}"
        )


def is_loss_scale_optimizer(tx: Any) -> bool:
    """Whether ``tx`` is a transformation returned by :func:`loss_scale_optimizer`.

    Only the transformation itself is recognised, not one that contains it (e.g. a chain).

    Args:
      tx: any object.

    Returns:
      ``True`` if ``tx`` was built by :func:`loss_scale_optimizer`.

    Example:
      >>> import optax
      >>> import jmp_rewrite
      >>> jmp_rewrite.is_loss_scale_optimizer(jmp_rewrite.loss_scale_optimizer(optax.sgd(0.1)))
      True
      >>> jmp_rewrite.is_loss_scale_optimizer(optax.sgd(0.1))
      False
    """
    update = getattr(tx, "update", None)
    return getattr(update, _MARKER, None) is not None


def loss_scale_optimizer(
    opt: optax.GradientTransformation | Any,
    loss_scale: str | float | LossScale = "dynamic",
    *,
    axis_name: AxisName | None = None,
    use_select: bool = False,
    debug: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``opt`` with loss scaling, TF1's ``MixedPrecisionLossScaleOptimizer`` for optax.

    ``update(scaled_grads, state, params=None, **extra_args)`` expects the gradients of
    ``loss * state.loss_scale`` (use :func:`scale_loss` or :func:`value_and_grad`). It

    1. unscales them in float32 with the scale in force (``grads * (1 / loss_scale)``),
    2. checks that every element is finite (NaN, +Inf and -Inf count alike); with
       ``axis_name`` the check is reduced over the named devices so all of them agree,
    3. runs ``opt.update`` on the unscaled float32 gradients if the step is applied, and
       otherwise returns zero updates with ``opt``'s state unchanged (chosen with
       ``jax.lax.cond``, or ``jnp.where`` when ``use_select``),
    4. adjusts the scale and counters for the next step (see :class:`DynamicLossScale`).

    Steps 1-3 run inside :func:`jmp_rewrite.float32_region`, so when a whole train step is
    rewritten to half precision the optimizer arithmetic and state stay float32.

    Dtypes: ``opt`` is initialised on float32 copies of the float parameters, so its state
    (e.g. Adam's moments) is float32 whatever the parameter dtype, unless ``opt`` chooses
    otherwise (e.g. ``mu_dtype``). ``opt`` always sees float32 gradients and parameters
    (complex leaves keep their dtype). Each returned update is cast back to the dtype of the
    corresponding gradient leaf (float32, bfloat16 or float16), the dtype
    ``optax.apply_updates`` expects for parameters of that dtype. Updates that ``opt`` returns
    in the structure of the parameters rather than the gradients (``optax.lookahead``) are
    cast like the parameters, and any other structure is returned as ``opt`` made it; a
    skipped step returns zeros of that same structure. A state leaf whose dtype ``opt.update``
    changes is cast back to its initial dtype.

    ``use_select``: ``jax.lax.cond`` (default) runs only the branch taken, so a NaN never
    enters the inner optimizer and a skipped step costs almost nothing; ``use_select=True``
    computes the inner update every step and keeps or discards it with ``jnp.where`` (jmp's
    ``select_tree`` style), which avoids an XLA conditional (on GPU it may synchronise with
    the host) at the price of a discarded update on skipped steps. Keep the default wherever
    buffers are donated; the documentation's Benchmarks page has the measurements. Under
    ``jax.vmap`` a ``cond`` becomes a select anyway. Outside ``jit`` (eager calls) the branch
    is chosen in Python, like TF's ``smart_cond``.

    Composition:

    * ``optax.chain``: put this transformation outermost, e.g.
      ``loss_scale_optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)))``:
      clipping then sees unscaled gradients.
    * ``optax.MultiSteps``: wrap it, ``loss_scale_optimizer(optax.MultiSteps(adam, k))``. Every
      micro-batch is unscaled with the scale in force when it was computed and checked on its
      own; a non-finite micro-batch is dropped (MultiSteps' accumulator and mini-step counter
      untouched, like ``optax.skip_not_finite``) and the scale backs off at once, so the
      window closes after ``k`` accepted micro-batches. ``good_steps``, ``applied_steps`` and
      ``last_step_applied`` count micro-batches. The reverse nesting,
      ``MultiSteps(loss_scale_optimizer(adam), k)``, keeps the scale fixed over a window and
      decides once per window on the accumulated gradients, but optax's MultiSteps resets its
      accumulator by multiplying it with zero, so a single Inf micro-batch leaves NaN in the
      accumulator for good (optax 0.2.8) and every later window is skipped: avoid it.
    * ``optax.inject_hyperparams``, ``optax.named_chain``, ``flax.nnx.Optimizer`` and
      ``jax.jit``: supported; :func:`get_loss_scale` finds the state inside any of them.
    * Another loss-scale optimizer inside ``opt`` (in a chain, ``multi_transform``,
      ``MultiSteps``, any wrapper) would unscale the gradients a second time: ``init``
      refuses it, naming where its state sits (TF refuses to wrap a ``LossScaleOptimizer``).
    * Sharding: under SPMD ``jax.jit`` with sharded gradients the finiteness check is a global
      reduction, so every device makes the same decision with no extra code. Inside
      ``shard_map`` or ``pmap`` pass ``axis_name`` (the axes the gradients are sharded or
      replicated over); the number of non-finite leaves is ``psum``-reduced over them.

    Args:
      opt: the optax transformation to wrap (a ``GradientTransformation``, with or without
        extra-args support, or an object with ``init``/``update`` such as
        :class:`optax.MultiSteps`).
      loss_scale: ``'dynamic'`` (TF1 defaults: ``DynamicLossScale()``), a positive number (a
        :class:`FixedLossScale`), or a :class:`DynamicLossScale` / :class:`FixedLossScale`.
      axis_name: for use inside ``shard_map``/``pmap``: the axis name (or tuple of names) over
        which all devices must agree on skipping. ``None`` (default) for ``jax.jit``.
      use_select: choose applied/skipped results with ``jnp.where`` instead of
        ``jax.lax.cond`` (see above).
      debug: record, per gradient leaf, whether the last step held a NaN or an Inf, in
        ``state.debug`` (:class:`LossScaleDebugState`); read it with
        :func:`non_finite_leaves`. Costs a second reduction over the gradients.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`LossScaleOptimizerState`.

    Raises:
      TypeError: if ``opt`` is not an optax transformation, or ``loss_scale`` is of an
        unsupported type.
      ValueError: if ``opt`` is already a loss-scale optimizer, ``loss_scale`` is an unknown
        string or a bad number, or ``axis_name``, ``use_select`` or ``debug`` is invalid;
        (from ``init``) if ``opt`` contains a loss-scale optimizer; (from ``update``, when
        traced) if the state is not one this ``init`` makes for these gradients: built with
        the other ``debug``, by another inner optimizer, or for gradients of another
        structure (a ``TypeError`` if it is no :class:`LossScaleOptimizerState` at all).

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> import jmp_rewrite
      >>> tx = jmp_rewrite.loss_scale_optimizer(optax.sgd(0.1))
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
      >>> loss, grads = jmp_rewrite.value_and_grad(loss_fn)(state, params)
      >>> updates, state = tx.update(grads, state, params)
      >>> optax.apply_updates(params, updates)["w"]
      Array([0.8, 0.8, 0.8], dtype=float32)
      >>> float(jmp_rewrite.get_loss_scale(state)), bool(jmp_rewrite.last_step_applied(state))
      (32768.0, True)
    """
    if is_loss_scale_optimizer(opt):
        raise ValueError(
            "opt is already a loss-scale optimizer (built by loss_scale_optimizer); wrapping "
            "it again would scale twice. Pass the inner optimizer instead."
        )
    inner = _as_extra_args_transformation(opt)
    scale_rule = _as_loss_scale(loss_scale)
    _check_axis_name(axis_name)
    for name, flag in (("use_select", use_select), ("debug", debug)):
        if not isinstance(flag, bool | np.bool_):
            raise ValueError(f"{name} must be True or False; got {flag!r}")
    options = _Options(inner, scale_rule, axis_name, bool(use_select), bool(debug))

    # Named for explain, which shows the regions as float32_region(NAME).
    @float32_region
    def loss_scale_optimizer_init(params: ArrayTree) -> LossScaleOptimizerState:
        return _init(options, params)

    @float32_region
    def loss_scale_optimizer_update(
        updates: ArrayTree,
        state: LossScaleOptimizerState,
        params: ArrayTree | None = None,
        **extra_args: Any,
    ) -> tuple[ArrayTree, LossScaleOptimizerState]:
        return _update(options, updates, state, params, extra_args)

    def update_fn(
        updates: ArrayTree,
        state: LossScaleOptimizerState,
        params: ArrayTree | None = None,
        **extra_args: Any,
    ) -> tuple[ArrayTree, LossScaleOptimizerState]:
        check_loss_was_scaled(state, scale_rule)
        return loss_scale_optimizer_update(updates, state, params, **extra_args)

    init_fn = loss_scale_optimizer_init

    setattr(update_fn, _MARKER, scale_rule)
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


#: TF1's name for :func:`loss_scale_optimizer`.
MixedPrecisionLossScaleOptimizer = loss_scale_optimizer
