"""The loss-scale optimizer's state, and helpers that find it in any optimizer state.

:func:`get_loss_scale_state` finds the one :class:`LossScaleOptimizerState` inside optax
containers, ``flax.nnx.Optimizer`` objects and other pytrees; :func:`scale_loss`,
:func:`value_and_grad`, :func:`get_loss_scale`, :func:`last_step_applied` and
:func:`non_finite_leaves` use it.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_rewrite._src import nnx_support
from jmp_rewrite._src.loss_scale.finite import LossScaleDebugState

ArrayTree = Any


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


def _state_nodes(tree: Any) -> list[tuple[Any, Any]]:
    """(path, node) of every loss-scale state node in ``tree``."""
    found, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_state_node)
    return [(path, node) for path, node in found if _is_state_node(node)]


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
    matches = _state_nodes(opt_state)
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


class UnscaledGradientsWarning(UserWarning):
    """A loss-scale optimizer's ``update`` was traced where its loss scale was never read.

    Gradients of an unscaled loss (``jax.grad(loss)`` instead of :func:`value_and_grad` or
    :func:`scale_loss`) would be divided by the loss scale (32768 at first): training looks
    fine and barely moves. Said once per process. If the loss is scaled in another traced
    function (a separate ``jax.jit`` for the gradients, a ``scan`` over micro-batches that
    carries the optimizer state), the warning is wrong: silence it with
    ``warnings.filterwarnings("ignore", category=jmp_rewrite.UnscaledGradientsWarning)``.
    """


# ids of the loss-scale values :func:`scale_loss` read while tracing (ids only: holding the
# tracers would leak them). A stale id can only hide a warning, never cause one.
_SCALED_IDS: set[int] = set()
_WARNED_UNSCALED: list[bool] = [False]


# Packages between a train step and ``update``: JAX's tracing, optax's combinators and Flax's
# optimizers (``nnx.Optimizer.update``); a warning points past them, at the user's line.
_CALLING_PACKAGES = ("jmp_rewrite", "jax", "jaxlib", "numpy", "optax", "flax")


def _user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, from its caller, of the innermost frame outside
    :data:`_CALLING_PACKAGES` (those imported) and Python's wrappers: the user's call."""
    dirs = tuple(
        os.path.dirname(os.path.abspath(m.__file__)) + os.sep
        for m in map(sys.modules.get, _CALLING_PACKAGES)
        if getattr(m, "__file__", None)
    )
    wrappers = {os.path.abspath(m.__file__) for m in (functools, contextlib)}
    frame, level = sys._getframe(2), 2
    while frame is not None and (
        frame.f_code.co_filename.startswith(dirs) or frame.f_code.co_filename in wrappers
    ):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def check_loss_was_scaled(state: Any, rule: Any) -> None:
    """Warns (:class:`UnscaledGradientsWarning`, once) when ``update`` is traced with a loss
    scale that :func:`scale_loss` never read in this program.

    Only traced calls are checked (a train step under ``jax.jit`` or ``rewrite``): there the
    loss scale is a tracer, and :func:`scale_loss`, called in the same program on the same
    optimizer state, has seen that very tracer. Eager calls (tests of an optimizer with
    made-up gradients) are not checked, nor is a fixed scale of 1.
    """
    if _WARNED_UNSCALED[0] or not isinstance(state, LossScaleOptimizerState):
        return
    scale = _leaf_value(state.loss_scale)
    if not isinstance(scale, jax.core.Tracer) or id(scale) in _SCALED_IDS:
        return
    if getattr(rule, "loss_scale_value", None) == 1.0:
        return
    _WARNED_UNSCALED[0] = True
    warnings.warn(
        "loss_scale_optimizer's update is traced in a program where scale_loss never read "
        "its loss scale: if the gradients come from jax.grad(loss), every update is divided "
        "by the loss scale (32768 at first). Differentiate jmp_rewrite.scale_loss(loss, "
        "opt_state), or use jmp_rewrite.value_and_grad(loss)(opt_state, ...). If the loss is "
        "scaled in another traced function, ignore this: warnings.filterwarnings('ignore', "
        "category=jmp_rewrite.UnscaledGradientsWarning)",
        UnscaledGradientsWarning,
        stacklevel=_user_stacklevel(),
    )


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
    raw = get_loss_scale_state(opt_state).loss_scale
    if isinstance(raw, jax.core.Tracer):
        if len(_SCALED_IDS) > 100_000:  # ids of long-gone traces; keep the set small
            _SCALED_IDS.clear()
        _SCALED_IDS.add(id(raw))
    scale = jnp.asarray(raw, jnp.float32)
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

    Flax NNX objects (modules, ``nnx.Optimizer``, ``nnx.Rngs``, variables) anywhere in
    ``args`` or ``kwargs`` are handled as ``nnx.value_and_grad`` handles them (it does the
    differentiating then): the gradient of a module in ``argnums`` is an ``nnx.State`` of its
    ``nnx.Param`` variables (``nnx.DiffState(argnum, filter)`` in ``argnums`` picks others),
    and what ``fun`` sets on any of the objects (BatchNorm's statistics, Dropout's RNG
    counts, a ``Variable`` of your own) is on them after the call, eager or under
    ``nnx.jit`` and :func:`jmp_rewrite.rewrite` in either order. So
    ``jmp_rewrite.value_and_grad(loss_fn)(optimizer, model)`` is
    ``nnx.value_and_grad`` of ``scale_loss(loss_fn(model), optimizer)`` with the loss
    unscaled. (``jax.jit`` copies NNX objects: jit an NNX step with ``nnx.jit``.)

    Args:
      fun: the loss function; returns a scalar, or ``(scalar, aux)`` with ``has_aux``.
      argnums: which positional argument(s) of ``fun`` to differentiate (counted in ``args``,
        i.e. not counting ``opt_state``); with Flax NNX, also ``nnx.DiffState`` entries.
        Keyword arguments are never differentiated.
      has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
      A function ``(opt_state, *args, **kwargs) -> (value, scaled_grads)``, or
      ``((value, aux), scaled_grads)`` with ``has_aux``. ``value`` is ``fun``'s own output,
      unscaled, in its own dtype; the gradients of NNX objects are ``nnx.State`` objects.

    Raises:
      TypeError: if ``fun`` is not callable; (when called) if the first argument holds no
        loss-scale state, as when called with ``jax.value_and_grad``'s convention
        ``(params, *args)``.
      ValueError: (when called) if ``opt_state`` holds more than one loss-scale state.

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
        if not _state_nodes(opt_state):
            name = getattr(fun, "__name__", "fun")
            raise TypeError(
                f"jmp_rewrite.value_and_grad({name})(...) takes the optimizer state first: "
                f"call it as value_and_grad({name})(opt_state, *args), with opt_state the "
                "state of a jmp_rewrite.loss_scale_optimizer (or an object holding it, such "
                "as flax.nnx.Optimizer), and args what jax.value_and_grad would get. Its "
                f"first argument, a {type(opt_state).__name__}, holds no "
                "LossScaleOptimizerState: was it called with jax.value_and_grad's "
                "convention (params, ...)?"
            )

        def scaled_fun(*args: Any, **kwargs: Any) -> tuple[jax.Array, Any]:
            out = fun(*args, **kwargs)
            loss, aux = out if has_aux else (out, None)
            return scale_loss(loss, opt_state), (loss, aux)

        if nnx_support.holds_graph_nodes((args, kwargs)) or _any_diff_state(argnums):
            grads_of = functools.partial(nnx_support.value_and_grad, scaled_fun, argnums)
            (_, (loss, aux)), grads = grads_of(args, kwargs)
        else:
            grad_fn = jax.value_and_grad(scaled_fun, argnums=argnums, has_aux=True)
            (_, (loss, aux)), grads = grad_fn(*args, **kwargs)
        return ((loss, aux) if has_aux else loss), grads

    return wrapped


def _any_diff_state(argnums: Any) -> bool:
    items = argnums if isinstance(argnums, Sequence) else (argnums,)
    return any(nnx_support.is_diff_state(a) for a in items)


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
