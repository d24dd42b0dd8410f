"""How a rewritten function takes its arguments.

* ``static_argnums`` / ``static_argnames`` work as in ``jax.jit``: each is mapped to the other
  through the function's signature, so a static argument may be passed by position or by
  keyword, and an index or name the function cannot take is an error when ``rewrite`` is
  called.
* Every other argument is a pytree whose leaves follow Equinox's filter convention
  (``eqx.filter_jit``): array leaves (``jax.Array``, tracers, NumPy arrays and scalars,
  ``jax.ShapeDtypeStruct``) are traced; every other leaf -- Python numbers and bools,
  strings, functions, ``None``-like objects -- is static: passed to the function as it is
  and part of the trace-cache key (compared by type and value, so it must be hashable).
  Python numbers are static rather than traced (``jax.jit`` traces them) so that wrapping a
  function in ``rewrite`` never makes a value traced that the caller passed concretely:
  ``eqx.filter_jit`` hands Python numbers and flags through as they are, and models use them
  in Python control flow (``eqx.nn.Dropout``'s ``inference``). A number that changes on every
  call therefore re-traces on every call; a warning says so after a few times.
* Flax NNX objects (modules, optimizers, ``Rngs``, variables) are split into structure and
  state as ``nnx.jit`` does, and updated in place after the call (see ``nnx_support``).
* Outputs follow the same convention: array leaves come out of the traced program, the others
  are returned as the trace produced them (as ``eqx.filter_jit`` does).
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src import nnx_support

_JAX_ARRAYS = (jax.Array, jax.ShapeDtypeStruct)
_NUMPY_ARRAYS = (np.ndarray, np.generic)


def is_array(x: Any) -> bool:
    """Whether a leaf is traced: a JAX array (or tracer), a ``jax.ShapeDtypeStruct``, or a
    NumPy array or scalar of numbers (NumPy strings and objects are static)."""
    if isinstance(x, _JAX_ARRAYS):
        return True
    return isinstance(x, _NUMPY_ARRAYS) and x.dtype.kind in "biufc"


#: Marks a static leaf in a cache key (array leaves are keyed by their aval).
_STATIC = object()

#: After this many traces that differ only in the values of static Python numbers: warn.
CHURN_WARNING_AFTER = 8

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def aval_key(x: Any) -> tuple[Any, ...]:
    """What a trace depends on: shape, dtype, weak type, sharding, varying manual axes."""
    return jc.abstract_key(jax.typeof(x))


@dataclasses.dataclass(frozen=True)
class StaticArgs:
    """The static arguments of a function, by position and by name (each mapped to the
    other through the signature, as ``jax.jit`` does)."""

    argnums: frozenset[int]
    negative_argnums: tuple[int, ...]  # only for functions taking *args: resolved per call
    argnames: frozenset[str]

    def positions(self, n_args: int) -> set[int]:
        nums = {i for i in self.argnums if i < n_args}
        nums.update(i + n_args for i in self.negative_argnums if i + n_args >= 0)
        return nums


def _as_ints(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, int) else value
    try:
        items = tuple(items)
        if any(isinstance(i, bool) for i in items):
            raise TypeError
        return tuple(operator.index(i) for i in items)
    except TypeError:
        raise TypeError(
            f"static_argnums must be an int or a sequence of ints; got {value!r}"
        ) from None


def _as_strs(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, str) else value
    try:
        items = tuple(items)
    except TypeError:
        items = (value,)
    if not all(isinstance(s, str) for s in items):
        raise TypeError(f"static_argnames must be a str or a sequence of strs; got {value!r}")
    return items


def _signature(fun: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fun)
    except (TypeError, ValueError):  # some builtins have none; jax.jit then skips the checks
        return None


def resolve_static(
    fun: Callable[..., Any], static_argnums: Any, static_argnames: Any
) -> StaticArgs:
    """Validates ``static_argnums``/``static_argnames`` against ``fun`` and completes each
    from the other.

    Raises:
      TypeError: if either is not an int/str or a sequence of them.
      ValueError: if an index is out of range for ``fun``'s positional parameters, or a name
        is not a parameter of ``fun`` (or is positional-only).
    """
    nums = _as_ints(static_argnums)
    names = _as_strs(static_argnames)
    name = getattr(fun, "__name__", type(fun).__name__)
    sig = _signature(fun) if nums or names else None
    if sig is None:
        return StaticArgs(
            frozenset(i for i in nums if i >= 0), tuple(i for i in nums if i < 0), frozenset(names)
        )
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in _POSITIONAL]
    takes_varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    takes_varkw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    n = len(positional)
    if not takes_varargs:
        bad = [i for i in nums if not -n <= i < n]
        if bad:
            listed = f": {', '.join(p.name for p in positional)}" if n else ""
            raise ValueError(
                f"static_argnums={static_argnums!r} is out of range: {name}{sig} takes "
                f"{n} positional argument{'s' if n != 1 else ''}{listed} (index {bad[0]} "
                f"is not in [{-n}, {n}))"
            )
        nums = tuple(i + n if i < 0 else i for i in nums)
    keyword_names = {p.name for p in params if p.kind in _KEYWORD}
    for s in names:
        if s in keyword_names:
            continue
        if any(p.name == s for p in positional):
            raise ValueError(
                f"static_argnames={static_argnames!r} names {s!r}, a positional-only "
                f"parameter of {name}{sig}; use static_argnums="
                f"{[p.name for p in positional].index(s)} for it"
            )
        if not takes_varkw:
            raise ValueError(
                f"static_argnames={static_argnames!r} names {s!r}, which is not a parameter "
                f"of {name}{sig}"
            )
    by_name = {p.name: i for i, p in enumerate(positional) if p.kind in _KEYWORD}
    all_nums = set(nums) | {by_name[s] for s in names if s in by_name}
    all_names = set(names) | {s for s, i in by_name.items() if i in all_nums}
    return StaticArgs(
        frozenset(i for i in all_nums if i >= 0),
        tuple(i for i in all_nums if i < 0),
        frozenset(all_names),
    )


# -- calls ---------------------------------------------------------------------------------


class CallKey(NamedTuple):
    """Everything about a call but its array values (hashable: the trace-cache key)."""

    n_args: int
    static_args: tuple[tuple[int, type, Any], ...]  # (index, type, value)
    static_kwargs: tuple[tuple[str, type, Any], ...]  # (name, type, value)
    treedef: Any  # of (dynamic args, dynamic kwargs), NNX objects as leaves
    node_slots: tuple[int, ...]  # which of those leaves are NNX objects
    graphdef: Any  # their nnx.GraphDef (None without NNX objects)
    state_tree: Any  # the treedef of their state
    leaves: tuple[Any, ...]  # per leaf (args', then the NNX state's): its aval, or static


@dataclasses.dataclass
class Call:
    """One call's arguments: ``key``, ``dynamic`` (the array leaves, the traced program's
    inputs) and the NNX objects to update afterwards."""

    key: CallKey
    dynamic: list[Any]
    nodes: tuple[Any, ...]


def split_call(
    spec: StaticArgs, args: tuple[Any, ...], kwargs: dict[str, Any], fun_name: str
) -> Call:
    """Splits a call's arguments into the cache key, the traced leaves and NNX objects."""
    positions = spec.positions(len(args)) if (spec.argnums or spec.negative_argnums) else ()
    if positions:
        static_args = tuple((i, type(args[i]), args[i]) for i in sorted(positions))
        dyn_args = tuple(a for i, a in enumerate(args) if i not in positions)
    else:
        static_args, dyn_args = (), args
    if spec.argnames and kwargs:
        static_kwargs = tuple(
            (k, type(v), v) for k, v in sorted(kwargs.items()) if k in spec.argnames
        )
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in spec.argnames}
    else:
        static_kwargs, dyn_kwargs = (), kwargs
    is_node = nnx_support.graph_node_test()
    leaves, treedef = jax.tree.flatten((dyn_args, dyn_kwargs), is_leaf=is_node)
    node_slots: tuple[int, ...] = ()
    nodes: tuple[Any, ...] = ()
    graphdef = state_tree = None
    if is_node is not None:
        if static_args or static_kwargs:
            _check_no_static_nodes(static_args, static_kwargs, is_node, fun_name)
        node_slots = tuple(i for i, x in enumerate(leaves) if is_node(x))
        if node_slots:
            nodes = tuple(leaves[i] for i in node_slots)
            graphdef, state = nnx_support.split(nodes)
            state_leaves, state_tree = jax.tree.flatten(state)
            slots = set(node_slots)
            leaves = [x for i, x in enumerate(leaves) if i not in slots] + state_leaves
    dynamic = []
    leaf_keys = []
    for x in leaves:
        if is_array(x):
            dynamic.append(x)
            leaf_keys.append(aval_key(x))
        else:
            leaf_keys.append((_STATIC, type(x), x))
    key = CallKey(
        len(args),
        static_args,
        static_kwargs,
        treedef,
        node_slots,
        graphdef,
        state_tree,
        tuple(leaf_keys),
    )
    return Call(key, dynamic, nodes)


def _check_no_static_nodes(static_args, static_kwargs, is_node, fun_name: str) -> None:
    for where, value in [(f"argument {i}", v) for i, _, v in static_args] + [
        (f"argument {k!r}", v) for k, _, v in static_kwargs
    ]:
        if any(is_node(x) for x in jax.tree.leaves(value, is_leaf=is_node)):
            raise ValueError(nnx_support.STATIC_NODE_MESSAGE.format(where=where, fun=fun_name))


def rebuild(key: CallKey, dynamic: Any) -> tuple[tuple[Any, ...], dict[str, Any], Any, Any]:
    """The arguments of the call ``key`` describes, with ``dynamic`` (traced values) for its
    array leaves; NNX objects are merged afresh. Returns ``(args, kwargs, nodes, before)``,
    ``before`` being the NNX state's values as given (see ``nnx_support.changed_state``)."""
    n_args, static_args, static_kwargs, treedef, node_slots, graphdef, state_tree, leaf_keys = key
    values = iter(dynamic)
    leaves = [k[2] if k[0] is _STATIC else next(values) for k in leaf_keys]
    nodes: tuple[Any, ...] = ()
    before = None
    if node_slots:
        n_arg_leaves = treedef.num_leaves - len(node_slots)
        state = jax.tree.unflatten(state_tree, leaves[n_arg_leaves:])
        before = nnx_support.snapshot(state)
        nodes = tuple(nnx_support.merge(graphdef, state))
        leaves = leaves[:n_arg_leaves]
        for slot, node in zip(node_slots, nodes, strict=True):
            leaves.insert(slot, node)
    dyn_args, dyn_kwargs = jax.tree.unflatten(treedef, leaves)
    if static_args:
        fixed = {i: v for i, _, v in static_args}
        rest = iter(dyn_args)
        args = tuple(fixed[i] if i in fixed else next(rest) for i in range(n_args))
    else:
        args = tuple(dyn_args)
    kwargs = dict(dyn_kwargs)
    kwargs.update((k, v) for k, _, v in static_kwargs)
    return args, kwargs, nodes, before


def trace_avals(dynamic: list[Any]) -> list[jax.ShapeDtypeStruct]:
    """Abstract values to trace at: everything JAX knows of each value (shardings under an
    Explicit mesh, varying manual axes inside ``shard_map``), so the traced program is typed
    as the caller's."""
    return [jc.abstract_value(jax.typeof(x)) for x in dynamic]


# -- outputs -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Outputs:
    """Where a traced function's array outputs go in its result; the other leaves as traced."""

    treedef: Any
    statics: tuple[Any, ...]  # _STATIC for an array leaf, else the leaf itself

    def unflatten(self, arrays: list[Any]) -> Any:
        it = iter(arrays)
        return jax.tree.unflatten(
            self.treedef, [next(it) if s is _STATIC else s for s in self.statics]
        )


def flatten_outputs(result: Any) -> tuple[list[Any], Outputs]:
    leaves, treedef = jax.tree.flatten(result)
    statics = tuple(_STATIC if is_array(x) else x for x in leaves)
    arrays = [x for x, s in zip(leaves, statics, strict=True) if s is _STATIC]
    return arrays, Outputs(treedef, statics)


# -- errors and warnings -------------------------------------------------------------------


def _leaf_names(spec: StaticArgs, args, kwargs, fun: Callable[..., Any]) -> list[str]:
    """A readable name for each entry of a call's ``leaf_keys``, in the same order."""
    params = _signature(fun)
    pos_names = [
        p.name for p in (params.parameters.values() if params else ()) if p.kind in _POSITIONAL
    ]
    positions = spec.positions(len(args)) if (spec.argnums or spec.negative_argnums) else set()
    dyn_index = [i for i in range(len(args)) if i not in positions]
    dyn_args = tuple(args[i] for i in dyn_index)
    dyn_kwargs = {k: v for k, v in kwargs.items() if k not in spec.argnames}
    is_node = nnx_support.graph_node_test()
    flat, _ = jax.tree_util.tree_flatten_with_path((dyn_args, dyn_kwargs), is_leaf=is_node)
    names, nodes = [], []
    for path, leaf in flat:
        if is_node is not None and is_node(leaf):
            nodes.append(leaf)
            continue
        first, rest = path[0].idx, path[1:]
        if first == 0:
            i = dyn_index[rest[0].idx]
            label = f"argument {i}" + (f" ({pos_names[i]})" if i < len(pos_names) else "")
            names.append(label + jax.tree_util.keystr(rest[1:]))
        else:
            names.append(f"argument {rest[0].key!r}" + jax.tree_util.keystr(rest[1:]))
    if nodes:
        _, state = nnx_support.split(tuple(nodes))
        for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
            names.append("the flax.nnx state " + jax.tree_util.keystr(path))
    return names


def unhashable_error(
    call: Call, spec: StaticArgs, args, kwargs, fun: Callable[..., Any], fun_name: str
) -> TypeError:
    """The error for a call whose static values cannot key the trace cache."""
    fix = (
        "make it hashable (a tuple, a frozen dataclass), or bind it with "
        f"functools.partial({fun_name}, ...) so that it is not an argument"
    )
    static_args, static_kwargs, leaf_keys = call.key[1], call.key[2], call.key.leaves
    for where, value in [(f"argument {i}", v) for i, _, v in static_args] + [
        (f"argument {k!r}", v) for k, _, v in static_kwargs
    ]:
        try:
            hash(value)
        except TypeError as e:
            return TypeError(
                f"{fun_name}: {where} is declared static but is not hashable ({e}); {fix}"
            )
    names = _leaf_names(spec, args, kwargs, fun)
    for name, k in zip(names, leaf_keys, strict=False):
        if k[0] is _STATIC:
            try:
                hash(k[2])
            except TypeError as e:
                return TypeError(
                    f"{fun_name}: {name} is a {type(k[2]).__name__}, not an array, so rewrite "
                    "treats it as static (part of the trace-cache key, as eqx.filter_jit "
                    f"does) and needs it hashable ({e}). Pass data to trace as arrays; "
                    f"otherwise {fix}"
                )
    return TypeError(f"{fun_name}: the arguments cannot key the trace cache (not hashable)")


def churn_key(key: CallKey) -> CallKey:
    """``key`` with the values of static Python numbers left out."""
    return key._replace(
        leaves=tuple(
            (_STATIC, k[1], None) if k[0] is _STATIC and k[1] in (int, float, complex) else k
            for k in key.leaves
        )
    )


def warn_churn(first: CallKey, key: CallKey, spec: StaticArgs, args, kwargs, fun, fun_name) -> None:
    """Warns that ``fun`` keeps re-tracing because static Python numbers change."""
    names = _leaf_names(spec, args, kwargs, fun)
    varying = [
        n
        for n, a, b in zip(names, first.leaves, key.leaves, strict=False)
        if a[0] is _STATIC and a != b
    ]
    warnings.warn(
        f"rewrite({fun_name}) has traced {CHURN_WARNING_AFTER} times for the same arrays "
        f"because Python numbers among its arguments changed ({', '.join(varying) or '?'}): "
        "non-array leaves are static, as in eqx.filter_jit. Pass numbers that change "
        "between calls as arrays (jnp.asarray(value)), or call under jax.jit, which traces "
        "them.",
        stacklevel=5,  # the caller of the rewritten function
    )
