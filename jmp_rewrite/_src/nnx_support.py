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

import dataclasses
import sys
from collections.abc import Callable, Sequence
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


def holds_graph_nodes(tree: Any) -> bool:
    """Whether ``tree`` (e.g. a call's ``(args, kwargs)``) holds an NNX graph node."""
    is_node = graph_node_test()
    if is_node is None:
        return False
    return any(is_node(x) for x in jax.tree.leaves(tree, is_leaf=is_node))


def is_diff_state(argnum: Any) -> bool:
    """Whether ``argnum`` is an ``nnx.DiffState`` (an argnum with a filter of its own)."""
    nnx = nnx_module()
    return nnx is not None and isinstance(argnum, getattr(nnx, "DiffState", ()))


def _positive_argnums(argnums: Any, n_args: int) -> Any:
    """``argnums`` with negative positions counted from the end of ``n_args`` (the call gets
    one more positional argument, its keywords, after them)."""

    def one(a: Any) -> Any:
        if is_diff_state(a):
            return dataclasses.replace(a, argnum=a.argnum + n_args) if a.argnum < 0 else a
        return a + n_args if isinstance(a, int) and a < 0 else a

    if isinstance(argnums, Sequence):
        return tuple(one(a) for a in argnums)
    return one(argnums)


def value_and_grad(
    fun: Callable[..., Any], argnums: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Any]:
    """``jax.value_and_grad(fun, argnums, has_aux=True)(*args, **kwargs)`` for a call whose
    arguments hold NNX graph nodes, through ``nnx.value_and_grad``: the gradients of a graph
    node are an ``nnx.State`` of its ``nnx.Param`` variables (or of an ``nnx.DiffState``'s
    filter), and what ``fun`` sets on the nodes (BatchNorm statistics, ``Rngs`` counters, any
    ``Variable``) is written back to the caller's objects, as ``nnx.value_and_grad`` does.
    Keywords are passed as one more, never differentiated, positional argument (NNX's
    transforms take positional arguments only)."""
    n_args = len(args)

    def positional(*a: Any) -> Any:
        return fun(*a[:n_args], **a[n_args])

    grad_fn = nnx_module().value_and_grad(
        positional, argnums=_positive_argnums(argnums, n_args), has_aux=True
    )
    return grad_fn(*args, dict(kwargs))


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
