"""Flax NNX objects among the arguments of a rewritten function, handled as ``nnx.jit`` does.

An NNX step mutates its modules and optimizer in place. The rewrite traces the function on
abstract values, so calling it on the caller's objects would write tracers into them. Instead
the graph nodes among the arguments are split into a structure (``GraphDef``, part of the
cache key) and a state (traced like any array); the traced function merges fresh objects,
calls the user's function and returns their new state with its outputs, and after the call
the caller's objects are updated in place with ``nnx.update``.

Flax stays optional: nothing here imports it unless ``flax.nnx`` is already imported, which
it must be for an argument to be an NNX object.
"""

from __future__ import annotations

import sys
from typing import Any

import jax


def nnx_module() -> Any:
    """``flax.nnx`` if the program has imported it, else None (never imports it)."""
    return sys.modules.get("flax.nnx")


_TEST: list[Any] = [None, None]  # [flax.nnx module, its predicate]


def graph_node_test() -> Any:
    """A predicate for NNX graph nodes (modules, optimizers, ``Rngs``, variables), or None
    when ``flax.nnx`` is not imported (then no argument can be one)."""
    nnx = nnx_module()
    if nnx is None:
        return None
    if _TEST[0] is not nnx:
        types = tuple(getattr(nnx, n) for n in ("Pytree", "Variable") if hasattr(nnx, n))
        known: dict[type, bool] = {}

        # Runs on every node of every argument of every call, and isinstance against NNX's
        # metaclasses costs about 1 us: decide once per type.
        def is_graph_node(x: Any) -> bool:
            t = type(x)
            found = known.get(t)
            if found is None:
                found = known[t] = issubclass(t, types)
            return found

        _TEST[:] = [nnx, is_graph_node]
    return _TEST[1]


def split(nodes: tuple[Any, ...]) -> tuple[Any, Any]:
    """``(graphdef, state)`` of ``nodes`` together, so references shared between arguments
    (one module held by two of them) stay shared when merged."""
    return nnx_module().split(nodes)


def merge(graphdef: Any, state: Any) -> tuple[Any, ...]:
    return nnx_module().merge(graphdef, state)


def _flat(state: Any) -> list[tuple[Any, Any]]:
    nnx = nnx_module()
    to_flat = getattr(nnx, "to_flat_state", None)
    return list(to_flat(state) if to_flat else state.flat_state())


def _unflat(items: list[tuple[Any, Any]]) -> Any:
    nnx = nnx_module()
    from_flat = getattr(nnx, "from_flat_state", None)
    return from_flat(items) if from_flat else nnx.State.from_flat_path(items)


def snapshot(state: Any) -> dict[Any, tuple[Any, ...]]:
    """The values in ``state`` by path, before the call (the variables themselves may be
    the ones the call mutates, so their values are kept, not the variables)."""
    return {path: tuple(jax.tree.leaves(var)) for path, var in _flat(state)}


def changed_state(
    graphdef: Any, nodes: tuple[Any, ...], before: dict[Any, tuple[Any, ...]], fun_name: str
) -> Any:
    """The variables of ``nodes`` that the call set (None if none): only these are written
    back, so a function that mutates nothing (e.g. one given ``nnx.State`` pytrees under
    ``jax.grad``) leaves its arguments alone, and one that does updates only what it set.

    Raises:
      ValueError: if the function added or removed variables or submodules, or changed a
        static attribute: only new values can be written back to the caller's objects.
    """
    new_graphdef, state = nnx_module().split(nodes)
    if new_graphdef != graphdef:
        raise ValueError(
            f"{fun_name} changed the structure of its flax.nnx arguments (added or removed a "
            "Variable or submodule, or set a non-Variable attribute); rewrite writes back new "
            "Variable values only. Create every attribute before the call (e.g. in __init__) "
            "and store changing values in nnx.Variable objects."
        )
    changed = []
    for path, var in _flat(state):
        old = before.get(path)
        new = jax.tree.leaves(var)
        if old is None or len(old) != len(new) or any(a is not b for a, b in zip(old, new)):
            changed.append((path, var))
    return _unflat(changed) if changed else None


def write_back(nodes: tuple[Any, ...], state: Any) -> None:
    """Updates the caller's objects in place, as ``nnx.jit`` does after its call."""
    if state is not None:
        nnx_module().update(nodes, state)


STATIC_NODE_MESSAGE = (
    "{where} of {fun} is a flax.nnx object declared static; it would be mutated with traced "
    "values. Do not declare it static: rewrite splits NNX objects into structure and state "
    "as nnx.jit does and updates them in place after the call."
)
