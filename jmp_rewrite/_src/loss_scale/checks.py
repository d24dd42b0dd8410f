"""What the loss-scale optimizer refuses: a loss-scale optimizer inside it, and a state that
is not the one its ``init`` makes.

Every check here reads only the structure of the state and the gradients (pytree structure,
leaf counts, the shapes of the debug flags), all static under ``jax.jit``, so a mismatch is a
``ValueError`` when the update is traced, never a silent change of what is computed.

* **Nesting** (:func:`refuse_nested`): an inner loss-scale optimizer, anywhere in a chain,
  ``multi_transform``, ``inject_hyperparams``, ``MultiSteps`` or other wrapper, would unscale
  gradients the outer one has already unscaled (divided by both scales: Adam's update
  -8.5e-5 instead of -1e-3). TF refuses to wrap a ``LossScaleOptimizer``; its state is what
  shows one wherever it sits.
* **Another optimizer's state** (:func:`check_state`): ``debug`` on/off, another inner
  optimizer, gradients of another structure than the state was made for.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jmp_rewrite._src.loss_scale.finite import LossScaleDebugState
from jmp_rewrite._src.loss_scale.state import LossScaleOptimizerState, _state_nodes

ArrayTree = Any

#: Longest description of a pytree structure an error message quotes.
_MAX_STRUCTURE_CHARS = 300


def _describe_structure(treedef: Any) -> str:
    text = str(treedef)
    if len(text) > _MAX_STRUCTURE_CHARS:
        text = text[: _MAX_STRUCTURE_CHARS - 3] + "..."
    n = treedef.num_leaves
    return f"{text} ({n} lea{'f' if n == 1 else 'ves'})"


def refuse_nested(inner_state: Any) -> None:
    """Raises if ``inner_state`` (a loss-scale optimizer's inner state) holds another
    loss-scale optimizer's state, naming where it sits."""
    found = _state_nodes(inner_state)
    if not found:
        return
    paths = ", ".join("inner_state" + jax.tree_util.keystr(path) for path, _ in found)
    raise ValueError(
        "loss_scale_optimizer wraps an optimizer that contains another loss-scale optimizer "
        f"(its state is at {paths} of this optimizer's state): the gradients would be "
        "unscaled by both scales, so every update would be divided by the inner scale "
        "(32768 at first). TF refuses to wrap a LossScaleOptimizer too. Use one "
        "loss_scale_optimizer, outermost: loss_scale_optimizer(optax.chain(clip, adam)), "
        "not loss_scale_optimizer(optax.chain(clip, loss_scale_optimizer(adam)))."
    )


def _aval_key(x: Any) -> tuple[Any, ...]:
    """Shape and dtype of a leaf, floats as float32 (what ``init`` is given)."""
    dtype = jnp.result_type(x)
    if jnp.issubdtype(dtype, jnp.floating):
        dtype = jnp.dtype(jnp.float32)
    return tuple(jnp.shape(x)), dtype


#: ``init`` -> {(structure, avals) of what it was given: structure of its state}. Weak keys:
#: an ``init`` that closes over tracers (an optimizer built inside a traced function) must not
#: outlive its trace here.
_INIT_STRUCTURES: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()


def _init_structure(init: Callable[..., Any], like: ArrayTree) -> Any | None:
    """The structure of ``init(like)``'s state, traced, not run (``None`` if ``init`` does
    not take ``like``, e.g. ``optax.lookahead`` given plain gradients). Each ``init`` is
    traced once per structure, shapes and dtypes of ``like``."""
    try:
        leaves, treedef = jax.tree.flatten(like)
        key = treedef, tuple(_aval_key(x) for x in leaves)
        try:
            cache = _INIT_STRUCTURES.setdefault(init, {})
        except TypeError:  # not weakly referenceable: no cache
            cache = {}
        if key not in cache:
            avals = [jax.ShapeDtypeStruct(s, d) for s, d in key[1]]
            cache[key] = jax.tree.structure(jax.eval_shape(init, treedef.unflatten(avals)))
        return cache[key]
    except Exception:  # any failure only means "cannot tell": no check
        return None


def check_state(
    state: LossScaleOptimizerState,
    grads: ArrayTree,
    params: ArrayTree | None,
    *,
    inner_init: Callable[[ArrayTree], Any],
    debug: bool,
) -> None:
    """Raises a ``ValueError`` naming both sides when ``state`` is not one this optimizer's
    ``init`` makes for ``grads`` (and ``params``). Static: only structures are compared.

    Args:
      state: the state passed to ``update``.
      grads: the gradients passed to ``update``.
      params: the parameters passed to ``update``, or ``None``.
      inner_init: the wrapped optimizer's ``init`` (on float32 parameters).
      debug: whether this optimizer was built with ``debug=True``.
    """
    refuse_nested(state.inner_state)
    held = state.debug
    if debug and not isinstance(held, LossScaleDebugState):
        raise ValueError(
            "this loss_scale_optimizer was built with debug=True, so its state holds a "
            f"LossScaleDebugState in state.debug; the state given holds {held!r} there: it "
            "comes from a loss_scale_optimizer built with debug=False. Use the state this "
            "optimizer's init returns (or build both with the same debug)."
        )
    if not debug and held != ():
        raise ValueError(
            "this loss_scale_optimizer was built with debug=False, so its state holds () in "
            f"state.debug; the state given holds a {type(held).__name__} there: it comes "
            "from a loss_scale_optimizer built with debug=True. Use the state this "
            "optimizer's init returns (or build both with the same debug)."
        )
    if debug:
        n_grads = len(jax.tree.leaves(grads))
        n_state = jnp.shape(held.leaf_has_nan)[0]
        if n_grads != n_state:
            raise ValueError(
                f"the gradients have {n_grads} leaves but the state's debug flags were made "
                f"for {n_state} (the params given to init); pass gradients with the structure "
                "of those params (debug=True cannot be used with an inner optimizer whose "
                "params differ from its gradients, such as optax.lookahead)"
            )
    # The gradients decide (their structure is the params' for every optimizer but those,
    # such as optax.lookahead, whose init does not take them); then the params.
    actual = jax.tree.structure(state.inner_state)
    for name, like in (("gradients", grads), ("params", params)):
        if like is None:
            continue
        expected = _init_structure(inner_init, like)
        if expected is None:
            continue
        if expected == actual:
            return
        raise ValueError(
            "the state's inner_state does not fit the optimizer this loss_scale_optimizer "
            f"wraps and these {name}: it holds {_describe_structure(actual)}, but the wrapped "
            f"optimizer's init, given these {name} "
            f"({_describe_structure(jax.tree.structure(like))}), makes "
            f"{_describe_structure(expected)}. Was the state made by another optimizer, or "
            "for parameters of another structure? Use the state this optimizer's init "
            "returns for these parameters."
        )
