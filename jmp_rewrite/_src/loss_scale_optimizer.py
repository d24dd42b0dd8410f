"""Loss scaling as an optax transformation: TF1's ``MixedPrecisionLossScaleOptimizer``.

:func:`loss_scale_optimizer` wraps any optax transformation. Its ``update`` receives the
gradients of ``loss * loss_scale`` (see :func:`scale_loss` and :func:`value_and_grad`),
unscales them in float32 with the scale that was in force when the loss was scaled, checks that
they are all finite and then, through ``jax.lax.cond``, either runs the inner optimizer or
returns zero updates with the inner state untouched, so Adam's step count and moments, and any
schedule inside, do not advance on a skipped step (TF: "nor is ``global_step`` incremented").
Finally the loss scale is adjusted (:class:`jmp_rewrite.DynamicLossScale`).

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

References:
  Micikevicius et al., `Mixed Precision Training <https://arxiv.org/abs/1710.03740>`_, 2018.
  TensorFlow, ``tf.compat.v1.train.experimental.MixedPrecisionLossScaleOptimizer``.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_rewrite._src.loss_scale import DynamicLossScale, FixedLossScale, LossScale
from jmp_rewrite._src.regions import float32_region

ArrayTree = Any
AxisName = Hashable | Sequence[Hashable]

_INT32_MAX = int(np.iinfo(np.int32).max)
#: Attribute set on the ``update`` function of every transformation built here.
_MARKER = "_jmp_rewrite_loss_scale"


class LossScaleDebugState(NamedTuple):
    """Which gradient leaves were non-finite at the last step (opt in with ``debug=True``).

    Leaves are numbered in ``jax.tree.leaves`` order of the gradients; see
    :func:`non_finite_leaves` for a readable report.

    Attributes:
      leaf_has_nan: bool vector, one entry per gradient leaf: the leaf held a NaN.
      leaf_has_inf: bool vector, one entry per gradient leaf: the leaf held +Inf or -Inf.
    """

    leaf_has_nan: jax.Array
    leaf_has_inf: jax.Array


class LossScaleOptimizerState(NamedTuple):
    """State of :func:`loss_scale_optimizer`.

    Attributes:
      inner_state: state of the wrapped transformation; unchanged by skipped steps.
      loss_scale: float32 scalar; the scale to multiply the *next* loss by.
      good_steps: int32 scalar; consecutive finite steps since the last change of scale
        (TF's ``good_steps``; always 0 for a fixed scale).
      applied_steps: int32 scalar; steps whose update was applied (saturates at 2**31 - 1).
      skipped_steps: int32 scalar; steps skipped for non-finite gradients (saturates).
      last_step_applied: bool scalar; whether the last update was applied (``True`` at init).
      debug: a :class:`LossScaleDebugState` when built with ``debug=True``, else ``()``.
    """

    inner_state: Any
    loss_scale: jax.Array
    good_steps: jax.Array
    applied_steps: jax.Array
    skipped_steps: jax.Array
    last_step_applied: jax.Array
    debug: LossScaleDebugState | tuple[()] = ()


_STATE_FIELDS = frozenset(LossScaleOptimizerState._fields)
# Fields that always hold a leaf; ``nnx.state`` drops the others when they are empty.
_SCALAR_FIELDS = _STATE_FIELDS - {"inner_state", "debug"}


# --------------------------------------------------------------------------------------------
# Small tree helpers.


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def _to_float32(tree: ArrayTree) -> ArrayTree:
    """Float leaves cast to float32 (other leaves, and ``None``, as they are)."""
    if tree is None:
        return None
    return jax.tree.map(lambda x: x.astype(jnp.float32) if _is_float(x) else x, tree)


def _unscale(grads: ArrayTree, inv_scale: jax.Array) -> ArrayTree:
    """Float leaves in float32 multiplied by ``1 / loss_scale`` (TF multiplies too)."""
    return jax.tree.map(lambda g: g.astype(jnp.float32) * inv_scale if _is_float(g) else g, grads)


def _cast_like(tree: ArrayTree, like: ArrayTree) -> ArrayTree:
    """``tree``'s array leaves cast to the dtypes of the matching leaves of ``like``."""

    def cast(ref: Any, x: Any) -> Any:
        if hasattr(ref, "dtype") and hasattr(x, "dtype") and x.dtype != ref.dtype:
            return x.astype(ref.dtype)
        return x

    return jax.tree.map(cast, like, tree)


def _zeros_like(tree: ArrayTree) -> ArrayTree:
    return jax.tree.map(jnp.zeros_like, tree)


def _static_bool(x: jax.Array) -> bool | None:
    """``bool(x)`` when ``x`` is a concrete value, ``None`` when it is traced."""
    try:
        return bool(x)
    except jax.errors.ConcretizationTypeError:
        return None


def _saturating_increment(count: jax.Array) -> jax.Array:
    return jnp.where(count < _INT32_MAX, count + 1, count)


def all_finite(tree: ArrayTree) -> jax.Array:
    """Whether every element of every floating-point leaf of ``tree`` is finite.

    NaN, +Inf and -Inf all count as non-finite. Integer and boolean leaves are ignored; an
    empty tree is finite.

    Args:
      tree: a pytree of arrays.

    Returns:
      A bool scalar array.

    Example:
      >>> import jax.numpy as jnp
      >>> import jmp_rewrite
      >>> bool(jmp_rewrite.all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}))
      False
    """
    checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if _is_float(x)]
    if not checks:
        return jnp.array(True)
    return jnp.all(jnp.stack(checks))


def _count_non_finite(
    leaves: list[Any], inv_scale: jax.Array, *, scale_at_least_one: bool, method: str = "auto"
) -> jax.Array:
    """Number of float leaves holding a NaN or an Inf after unscaling (int32 scalar).

    Two exact formulations:

    * ``"elementwise"``: ``any(~isfinite(g * inv_scale))``. XLA:GPU/TPU fuse the predicate
      into the reduction (one pass over ``g``), but XLA:CPU writes the boolean array and
      reduces it in a second pass.
    * ``"dot"``: ``sum(g @ z)`` for a vector ``z`` of zeros computed at run time: each term is
      ``g_ij * 0``, which is 0 for a finite ``g_ij`` and NaN for a NaN or an Inf, so the sum is
      0 exactly when the leaf is finite (it cannot overflow). A matrix-vector product reads
      ``g`` once with no intermediate; on CPU it is ~3x faster than the elementwise check and
      costs 2/3 of its bytes. It checks the *scaled* values, which is exact only when the
      scale is >= 1 (then ``g * inv_scale`` cannot overflow), and it only pays off for
      float32/float64 leaves (XLA:CPU converts half-precision dot operands first).

    ``"auto"`` uses ``"dot"`` on the CPU backend for float32/float64 leaves of rank >= 1 when
    ``scale_at_least_one``, and ``"elementwise"`` otherwise.
    """
    if method not in ("auto", "elementwise", "dot"):
        raise ValueError(f"method must be 'auto', 'elementwise' or 'dot'; got {method!r}")
    use_dot = method == "dot" or (
        method == "auto" and scale_at_least_one and jax.default_backend() == "cpu"
    )
    # A zero the compiler cannot constant-fold (the scale is positive in every valid state),
    # so that no algebraic simplification can drop the product.
    zero = jnp.where(inv_scale > 0, jnp.float32(0), jnp.float32(1))
    flags = []
    for g in leaves:
        if not _is_float(g):
            continue
        if use_dot and g.ndim >= 1 and g.dtype in (jnp.float32, jnp.float64):
            matrix = g.reshape(-1, g.shape[-1])
            z = jnp.broadcast_to(zero.astype(g.dtype), (g.shape[-1],))
            rows = jnp.dot(matrix, z, precision=jax.lax.Precision.HIGHEST)
            flags.append(jnp.logical_not(jnp.isfinite(jnp.sum(rows))))
        else:
            unscaled = g.astype(jnp.float32) * inv_scale
            flags.append(jnp.logical_not(jnp.all(jnp.isfinite(unscaled))))
    if not flags:
        return jnp.zeros([], jnp.int32)
    return jnp.sum(jnp.stack(flags).astype(jnp.int32))


# --------------------------------------------------------------------------------------------
# The transformation.

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
    otherwise (e.g. ``mu_dtype``). ``opt`` always sees float32 gradients and parameters. Each
    returned update is cast back to the dtype of the corresponding gradient leaf (float32,
    bfloat16 or float16), the dtype ``optax.apply_updates`` expects for parameters of that
    dtype. A state leaf whose dtype ``opt.update`` changes is cast back to its initial dtype.

    ``use_select`` (where each wins): ``jax.lax.cond`` (default) runs only the branch taken,
    so a NaN never enters the inner optimizer and a skipped step costs almost nothing. Its
    outputs are materialised, so the update cannot fuse with ``optax.apply_updates``: one
    extra write and read of the updates, plus one read of the gradients for the check. On
    GPU an XLA conditional may also need its predicate on the host (a device-to-host sync
    per step). ``use_select=True`` computes the inner update every step and keeps or discards
    it with ``jnp.where`` (jmp's ``select_tree`` style): no conditional, no sync, and the update
    fuses with ``apply_updates``, at the price of computing a discarded update on skipped
    steps and of keeping the old state alive next to the new one. Measured on XLA:CPU
    (``benchmarks/loss_scale_overhead.py``, adam on 9M parameters, bytes accessed relative
    to plain adam): cond 1.30x with params and state donated, 1.70x without; select 1.20x
    without donation but 1.60x with it, because XLA then copies the old state to keep it for
    the select, which is also several times slower in wall time. So keep the default on CPU
    and TPU (whose conditionals run on device) and wherever buffers are donated; try
    ``use_select`` on GPU when a profile shows the conditional's host synchronisation. Under
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
        string or a bad number, or ``axis_name``, ``use_select`` or ``debug`` is invalid.

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
    use_select = bool(use_select)
    debug = bool(debug)
    # A fixed scale that never skips needs no finiteness check unless debugging asks for it.
    needs_check = scale_rule.skips_non_finite or debug
    # With a scale >= 1, the unscaled gradients are finite exactly when the scaled ones are.
    if isinstance(scale_rule, DynamicLossScale):
        scale_at_least_one = scale_rule.min_loss_scale >= 1.0
    else:
        scale_at_least_one = scale_rule.loss_scale_value >= 1.0

    def init_fn(params: ArrayTree) -> LossScaleOptimizerState:
        loss_scale_value, good_steps = scale_rule.init()
        debug_state: LossScaleDebugState | tuple[()] = ()
        if debug:
            n = len(jax.tree.leaves(params))
            debug_state = LossScaleDebugState(jnp.zeros([n], jnp.bool_), jnp.zeros([n], jnp.bool_))
        return LossScaleOptimizerState(
            inner_state=inner.init(_to_float32(params)),
            loss_scale=loss_scale_value,
            good_steps=good_steps,
            applied_steps=jnp.zeros([], jnp.int32),
            skipped_steps=jnp.zeros([], jnp.int32),
            last_step_applied=jnp.array(True),
            debug=debug_state,
        )

    def check(grads: ArrayTree, inv_scale: jax.Array) -> tuple[jax.Array, Any]:
        """(all finite across devices, debug state) of the unscaled gradients."""
        leaves = jax.tree.leaves(grads)
        if debug:
            # Recomputed here rather than shared with the update, so that XLA fuses the
            # unscaling into each consumer and never materialises an unscaled copy.
            unscaled = [g.astype(jnp.float32) * inv_scale if _is_float(g) else None for g in leaves]
            no = jnp.array(False)
            nan_flags = [no if u is None else jnp.any(jnp.isnan(u)) for u in unscaled]
            inf_flags = [no if u is None else jnp.any(jnp.isinf(u)) for u in unscaled]
            empty = jnp.zeros([0], jnp.bool_)
            has_nan = jnp.stack(nan_flags) if nan_flags else empty
            has_inf = jnp.stack(inf_flags) if inf_flags else empty
            if axis_name is not None:
                has_nan = jax.lax.pmax(has_nan.astype(jnp.int32), axis_name) > 0
                has_inf = jax.lax.pmax(has_inf.astype(jnp.int32), axis_name) > 0
            n_bad = jnp.sum((has_nan | has_inf).astype(jnp.int32))
            debug_state: Any = LossScaleDebugState(has_nan, has_inf)
        else:
            n_bad = _count_non_finite(leaves, inv_scale, scale_at_least_one=scale_at_least_one)
            if axis_name is not None:
                n_bad = jax.lax.psum(n_bad, axis_name)
            debug_state = ()
        return n_bad == 0, debug_state

    @float32_region
    def update_fn(
        updates: ArrayTree,
        state: LossScaleOptimizerState,
        params: ArrayTree | None = None,
        **extra_args: Any,
    ) -> tuple[ArrayTree, LossScaleOptimizerState]:
        grads = updates
        loss_scale_value = jnp.asarray(state.loss_scale, jnp.float32)
        inv_scale = jnp.float32(1.0) / loss_scale_value
        params32 = _to_float32(params)
        if debug and len(jax.tree.leaves(grads)) != state.debug.leaf_has_nan.shape[0]:
            raise ValueError(
                f"the gradients have {len(jax.tree.leaves(grads))} leaves but the state was "
                f"initialised for {state.debug.leaf_has_nan.shape[0]}; pass gradients with "
                "the structure of the params given to init"
            )

        if needs_check:
            finite, debug_state = check(grads, inv_scale)
        else:
            finite, debug_state = jnp.array(True), ()
        new_scale, new_good, apply = scale_rule.update(loss_scale_value, state.good_steps, finite)

        def do_update(grads: ArrayTree, inner_state: Any, params32: ArrayTree) -> Any:
            new_updates, new_inner = inner.update(
                _unscale(grads, inv_scale), inner_state, params32, **extra_args
            )
            return _cast_like(new_updates, grads), _cast_like(new_inner, inner_state)

        def skip_update(grads: ArrayTree, inner_state: Any, params32: ArrayTree) -> Any:
            del params32
            return _zeros_like(grads), inner_state

        if not scale_rule.skips_non_finite:
            new_updates, new_inner = do_update(grads, state.inner_state, params32)
        elif use_select:
            applied_updates, applied_inner = do_update(grads, state.inner_state, params32)
            new_updates = jax.tree.map(
                lambda u: jnp.where(apply, u, jnp.zeros_like(u)), applied_updates
            )
            new_inner = jax.tree.map(
                lambda new, old: jnp.where(apply, new, old), applied_inner, state.inner_state
            )
        else:
            static_apply = _static_bool(apply)
            if static_apply is None:
                new_updates, new_inner = jax.lax.cond(
                    apply, do_update, skip_update, grads, state.inner_state, params32
                )
            else:  # Not traced (eager call): take the branch in Python, as TF's smart_cond.
                branch = do_update if static_apply else skip_update
                new_updates, new_inner = branch(grads, state.inner_state, params32)

        new_state = LossScaleOptimizerState(
            inner_state=new_inner,
            loss_scale=new_scale,
            good_steps=new_good,
            applied_steps=jnp.where(
                apply, _saturating_increment(state.applied_steps), state.applied_steps
            ),
            skipped_steps=jnp.where(
                apply, state.skipped_steps, _saturating_increment(state.skipped_steps)
            ),
            last_step_applied=apply,
            debug=debug_state if debug else (),
        )
        return new_updates, new_state

    init_fn = float32_region(init_fn)
    setattr(update_fn, _MARKER, scale_rule)
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


#: TF1's name for :func:`loss_scale_optimizer`.
MixedPrecisionLossScaleOptimizer = loss_scale_optimizer


# --------------------------------------------------------------------------------------------
# Finding the state and using it.


def _is_state_node(x: Any) -> bool:
    if isinstance(x, LossScaleOptimizerState):
        return True
    # nnx.state(...) turns NamedTuples into mappings keyed by field name (and drops fields
    # without leaves, such as an empty inner state or debug field).
    return isinstance(x, Mapping) and _SCALAR_FIELDS <= set(x.keys()) <= _STATE_FIELDS


def _leaf_value(x: Any) -> Any:
    """The array held by ``x`` (unwraps ``flax.nnx.Variable``-like boxes)."""
    if isinstance(x, jax.Array | np.ndarray | np.generic | numbers.Number):
        return x
    get_value = getattr(x, "get_value", None)
    if callable(get_value):
        return get_value()
    if hasattr(x, "value"):
        return x.value
    return x


def get_loss_scale_state(opt_state: Any) -> LossScaleOptimizerState:
    """The one :class:`LossScaleOptimizerState` inside a (possibly nested) optimizer state.

    Searches optax containers (``chain`` tuples, ``named_chain`` dicts,
    ``inject_hyperparams``, ``MultiSteps`` states), ``flax.nnx.Optimizer`` objects (and the
    ``nnx.State`` of one) and any other pytree (e.g. a Flax ``TrainState``). Values boxed in
    ``nnx.Variable`` objects are unwrapped.

    Args:
      opt_state: an optimizer state, or an object holding one.

    Returns:
      The :class:`LossScaleOptimizerState` (its scalar fields unwrapped to arrays).

    Raises:
      ValueError: if ``opt_state`` contains no loss-scale state, or more than one.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import jmp_rewrite
      >>> tx = optax.chain(jmp_rewrite.loss_scale_optimizer(optax.sgd(0.1)))
      >>> state = tx.init({"w": jnp.ones(2)})
      >>> int(jmp_rewrite.get_loss_scale_state(state).skipped_steps)
      0
    """
    found, _ = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_state_node)
    matches = [(path, node) for path, node in found if _is_state_node(node)]
    if not matches:
        raise ValueError(
            "no LossScaleOptimizerState found in the given "
            f"{type(opt_state).__name__}; pass the state returned by the init/update of a "
            "transformation built with jmp_rewrite.loss_scale_optimizer (or an object such "
            "as flax.nnx.Optimizer that holds it)"
        )
    if len(matches) > 1:
        paths = ", ".join(jax.tree_util.keystr(path) or "<root>" for path, _ in matches)
        raise ValueError(
            f"found {len(matches)} LossScaleOptimizerStates (at {paths}); there must be "
            "exactly one. Use a single loss_scale_optimizer, outermost, or pass the sub-state "
            "you mean."
        )
    node = matches[0][1]
    if not isinstance(node, LossScaleOptimizerState):
        node = LossScaleOptimizerState(**{f: node.get(f, ()) for f in _STATE_FIELDS})
    return node._replace(
        loss_scale=_leaf_value(node.loss_scale),
        good_steps=_leaf_value(node.good_steps),
        applied_steps=_leaf_value(node.applied_steps),
        skipped_steps=_leaf_value(node.skipped_steps),
        last_step_applied=_leaf_value(node.last_step_applied),
    )


def get_loss_scale(opt_state: Any) -> jax.Array:
    """The current loss scale (float32 scalar) of the loss-scale optimizer in ``opt_state``.

    Args:
      opt_state: an optimizer state containing exactly one :class:`LossScaleOptimizerState`
        (see :func:`get_loss_scale_state` for where it is searched).

    Returns:
      A float32 scalar array: the scale to multiply the next loss by.

    Raises:
      ValueError: if ``opt_state`` contains no loss-scale state, or more than one.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import jmp_rewrite
      >>> tx = jmp_rewrite.loss_scale_optimizer(optax.adam(1e-3), loss_scale=128)
      >>> float(jmp_rewrite.get_loss_scale(tx.init({"w": jnp.ones(2)})))
      128.0
    """
    return jnp.asarray(get_loss_scale_state(opt_state).loss_scale, jnp.float32)


def last_step_applied(opt_state: Any) -> jax.Array:
    """Whether the last ``update`` was applied (``False``: skipped for non-finite gradients).

    Use it to gate anything that must not advance on a skipped step: an EMA of the
    parameters, a learning-rate schedule kept outside the optimizer, logging of the step.

    Args:
      opt_state: an optimizer state containing exactly one :class:`LossScaleOptimizerState`.

    Returns:
      A bool scalar array (``True`` right after ``init``).

    Raises:
      ValueError: if ``opt_state`` contains no loss-scale state, or more than one.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import jmp_rewrite
      >>> tx = jmp_rewrite.loss_scale_optimizer(optax.sgd(0.1))
      >>> state = tx.init({"w": jnp.ones(2)})
      >>> _, state = tx.update({"w": jnp.array([jnp.nan, 0.0])}, state)
      >>> bool(jmp_rewrite.last_step_applied(state))
      False
    """
    return jnp.asarray(get_loss_scale_state(opt_state).last_step_applied, jnp.bool_)


def scale_loss(loss: jax.typing.ArrayLike, opt_state: Any) -> jax.Array:
    """``loss`` multiplied by the current loss scale; differentiate this, not ``loss``.

    The product is computed in float32 (or wider, if ``loss`` is float64), so a float16 loss
    cannot overflow when scaled; gradients flowing back into half-precision code still carry
    the full scale.

    Args:
      loss: the loss (usually a scalar).
      opt_state: an optimizer state containing exactly one :class:`LossScaleOptimizerState`.

    Returns:
      ``loss * loss_scale`` as an array of dtype ``promote_types(loss.dtype, float32)``.

    Raises:
      ValueError: if ``opt_state`` contains no loss-scale state, or more than one.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import jmp_rewrite
      >>> state = jmp_rewrite.loss_scale_optimizer(optax.sgd(0.1), 8).init(jnp.ones(2))
      >>> float(jmp_rewrite.scale_loss(jnp.float16(0.5), state))
      4.0
    """
    scale = get_loss_scale(opt_state)
    loss = jnp.asarray(loss)
    dtype = jnp.promote_types(loss.dtype, jnp.float32)
    return loss.astype(dtype) * scale.astype(dtype)


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, ArrayTree]]:
    """Like ``jax.value_and_grad``, but of the scaled loss; takes the optimizer state first.

    ``value_and_grad(fun, argnums, has_aux)(opt_state, *args, **kwargs)`` differentiates
    ``scale_loss(fun(*args, **kwargs), opt_state)`` and returns the true (unscaled) value of
    ``fun`` together with the scaled gradients, ready for the loss-scale optimizer's
    ``update``.

    Args:
      fun: the loss function; returns a scalar, or ``(scalar, aux)`` with ``has_aux``.
      argnums: which positional argument(s) of ``fun`` to differentiate (counted in ``args``,
        i.e. not counting ``opt_state``).
      has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
      A function ``(opt_state, *args, **kwargs) -> (value, scaled_grads)``, or
      ``((value, aux), scaled_grads)`` with ``has_aux``. ``value`` is ``fun``'s own output,
      unscaled, in its own dtype.

    Raises:
      TypeError: if ``fun`` is not callable.
      ValueError: (when called) if ``opt_state`` holds no loss-scale state or more than one.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import jmp_rewrite
      >>> state = jmp_rewrite.loss_scale_optimizer(optax.sgd(0.1), 4).init(jnp.ones(2))
      >>> loss, grads = jmp_rewrite.value_and_grad(lambda w: jnp.sum(w**2))(state, jnp.ones(2))
      >>> float(loss), grads
      (2.0, Array([8., 8.], dtype=float32))
    """
    if not callable(fun):
        raise TypeError(f"value_and_grad expects a callable fun; got {fun!r}")

    def wrapped(opt_state: Any, *args: Any, **kwargs: Any) -> tuple[Any, ArrayTree]:
        def scaled_fun(*args: Any, **kwargs: Any) -> tuple[jax.Array, Any]:
            out = fun(*args, **kwargs)
            loss, aux = out if has_aux else (out, None)
            return scale_loss(loss, opt_state), (loss, aux)

        (_, (loss, aux)), grads = jax.value_and_grad(scaled_fun, argnums=argnums, has_aux=True)(
            *args, **kwargs
        )
        return ((loss, aux) if has_aux else loss), grads

    return wrapped


def non_finite_leaves(opt_state: Any, tree: ArrayTree) -> list[tuple[str, str]]:
    """Host-side report of the gradient leaves that were non-finite at the last step.

    Needs a transformation built with ``debug=True``. Call it outside ``jit`` (it reads
    concrete values), e.g. when ``last_step_applied`` is ``False``.

    Args:
      opt_state: an optimizer state containing exactly one :class:`LossScaleOptimizerState`.
      tree: any pytree with the structure of the gradients (e.g. the params), used for the
        leaf names.

    Returns:
      ``[(path, kind), ...]`` for each non-finite leaf, in leaf order; ``path`` is
      ``jax.tree_util.keystr`` of the leaf and ``kind`` is ``'nan'``, ``'inf'`` or
      ``'nan+inf'``. Empty when the last step was finite.

    Raises:
      ValueError: if the optimizer was not built with ``debug=True``, or ``tree`` has a
        different number of leaves.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import jmp_rewrite
      >>> tx = jmp_rewrite.loss_scale_optimizer(optax.sgd(0.1), debug=True)
      >>> params = {"a": jnp.ones(2), "b": jnp.ones(2)}
      >>> _, state = tx.update({"a": jnp.ones(2), "b": jnp.array([1.0, -jnp.inf])},
      ...                      tx.init(params))
      >>> jmp_rewrite.non_finite_leaves(state, params)
      [("['b']", 'inf')]
    """
    state = get_loss_scale_state(opt_state)
    info = state.debug
    if isinstance(info, Mapping):  # nnx.State form
        info = LossScaleDebugState(info["leaf_has_nan"], info["leaf_has_inf"])
    if not isinstance(info, LossScaleDebugState):
        raise ValueError(
            "non_finite_leaves needs a loss_scale_optimizer built with debug=True; this "
            "state has no debug information"
        )
    has_nan = np.asarray(_leaf_value(info.leaf_has_nan))
    has_inf = np.asarray(_leaf_value(info.leaf_has_inf))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    if len(paths) != has_nan.shape[0]:
        raise ValueError(
            f"tree has {len(paths)} leaves but the debug state records {has_nan.shape[0]}; "
            "pass a tree with the structure of the gradients"
        )
    report = []
    for path, nan, inf in zip(paths, has_nan, has_inf, strict=True):
        if nan or inf:
            report.append((path, "nan+inf" if nan and inf else ("nan" if nan else "inf")))
    return report
