"""Every higher-order primitive the rewrite sees through, described once.

A higher-order equation holds jaxprs in its params and splits its operands into groups (a
``cond``'s index and branch operands; a ``while``'s cond consts, body consts and carries; a
``scan``'s consts, carries and scanned ``xs``). The painting graph, the emitter, ``compare``
and ``explain`` all read that layout from here, so JAX's parameter names (``num_consts``,
``cond_nconsts``, ``branches``, ``ft_in``...) appear in this module and nowhere else, and a
JAX release that changes one touches one entry (jet's rule tables are the model).

Adding a primitive is one entry in :data:`PRIMITIVES`: its kind, the params that hold its
bodies (by role) and a function from its params to its operand groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src.trace import shapes

#: Kinds: how the rewrite treats the equation.
CALL = "call"  # a function call: the body is inlined into the painting graph
CUSTOM_JVP = "custom_jvp"  # a call whose derivative rule must keep running as written
CUSTOM_VJP = "custom_vjp"
SHARD_MAP = "shard_map"  # a call under a mesh: re-emitted through jax.shard_map
COND = "cond"
WHILE = "while"
SCAN = "scan"

Groups = tuple[tuple[str, int], ...]


@dataclasses.dataclass(frozen=True)
class HigherOrder:
    """How one higher-order primitive holds its bodies and splits its operands.

    Attributes:
      kind: one of the kinds above.
      bodies: ``(role, param)`` pairs: the params holding jaxprs. A role whose param holds
        a tuple (``cond``'s branches) stands for all of them.
      groups: params, operand count -> the operand groups ``((name, size), ...)`` in order.
      length: params -> trip count of the body (``scan``'s length; 1 otherwise).
      reverse: params -> whether a ``scan`` runs backwards.
    """

    kind: str
    bodies: tuple[tuple[str, str], ...]
    groups: Callable[[dict[str, Any], int], Groups]
    length: Callable[[dict[str, Any]], int] = lambda p: 1
    reverse: Callable[[dict[str, Any]], bool] = lambda p: False


def _all_args(p: dict[str, Any], n: int) -> Groups:
    return (("args", n),)


def _custom_groups(p: dict[str, Any], n: int) -> Groups:
    # The body's closed-over values (odeint's Runge-Kutta tableau, an array a custom_vjp
    # closes over) come first: JAX never differentiates a custom rule with respect to them.
    nc = int(p.get("num_consts", 0))
    return (("consts", nc), ("args", n - nc))


def _cond_groups(p: dict[str, Any], n: int) -> Groups:
    return (("index", 1), ("args", n - 1))


def _while_groups(p: dict[str, Any], n: int) -> Groups:
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    return (("cond_consts", nc), ("body_consts", nb), ("carry", n - nc - nb))


def _scan_groups(p: dict[str, Any], n: int) -> Groups:
    if "num_consts" in p:  # JAX <= 0.11
        nc, nk = p["num_consts"], p["num_carry"]
    else:  # JAX >= 0.12: ft_in is a flat tree (consts, carry, xs), one leaf per operand
        nc, nk, _ = (len(t) for t in p["ft_in"].unpack())
    return (("consts", nc), ("carry", nk), ("xs", n - nc - nk))


def _call(param: str, kind: str = CALL) -> HigherOrder:
    groups = _all_args if kind in (CALL, SHARD_MAP) else _custom_groups
    return HigherOrder(kind, (("body", param),), groups)


#: The table. Equations of other primitives holding jaxprs are opaque to the painter.
PRIMITIVES: dict[str, HigherOrder] = {
    "jit": _call("jaxpr"),
    "pjit": _call("jaxpr"),
    "closed_call": _call("call_jaxpr"),
    "core_call": _call("call_jaxpr"),
    "remat2": _call("jaxpr"),
    "checkpoint": _call("jaxpr"),
    "custom_jvp_call": _call("call_jaxpr", CUSTOM_JVP),
    "custom_vjp_call": _call("call_jaxpr", CUSTOM_VJP),
    "custom_vjp_call_jaxpr": _call("fun_jaxpr", CUSTOM_VJP),
    "shard_map": _call("jaxpr", SHARD_MAP),
    "cond": HigherOrder(COND, (("cases", "branches"),), _cond_groups),
    "while": HigherOrder(WHILE, (("cond", "cond_jaxpr"), ("body", "body_jaxpr")), _while_groups),
    "scan": HigherOrder(
        SCAN,
        (("body", "jaxpr"),),
        _scan_groups,
        length=lambda p: shapes.dim(p["length"]),
        reverse=lambda p: bool(p.get("reverse", False)),
    ),
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """One higher-order equation seen through its :class:`HigherOrder` entry.

    Attributes:
      kind: the primitive's kind.
      bodies: role -> jaxpr (closed or open, as held); a tuple for ``cond``'s branches.
      groups: operand groups ``((name, size), ...)`` covering every operand in order.
      length: trip count of the body (``scan``), else 1.
      reverse: a ``scan`` running backwards.
      n_carry: outputs that are loop carries (``scan``: then ``ys``; ``while``: all).
    """

    kind: str
    bodies: dict[str, Any]
    groups: Groups
    length: int = 1  # a symbolic expression for a scan over a symbolic dimension
    reverse: bool = False

    def split(self, values: Sequence[Any]) -> dict[str, list[Any]]:
        """``values`` (one per operand) split into the named groups."""
        out, i = {}, 0
        for name, size in self.groups:
            out[name] = list(values[i : i + size])
            i += size
        if i != len(values):  # pragma: no cover - a JAX change this table does not know
            raise NotImplementedError(f"{self.kind}: {len(values)} operands, groups {self.groups}")
        return out

    def size(self, name: str) -> int:
        return dict(self.groups).get(name, 0)

    def body(self, role: str = "body") -> Any:
        return self.bodies[role]

    def inner(self, role: str = "body") -> Any:
        """The bare jaxpr of a body (eqns, invars, outvars)."""
        return jc.open_jaxpr(self.bodies[role])


#: Operand groups a body takes a new slice or value of on each trip: a carry's type is fixed
#: by the loop, a ``scan``'s ``xs`` are sliced per trip. Every other operand is read as it
#: is on every trip (a loop's consts) or once (a call's, a branch's).
PER_TRIP = ("carry", "xs")


def per_trip_positions(layout: Layout | None) -> list[int]:
    """The operand positions of :data:`PER_TRIP` groups (none for a call or ``cond``)."""
    if layout is None:
        return []
    out, i = [], 0
    for name, size in layout.groups:
        if name in PER_TRIP:
            out.extend(range(i, i + size))
        i += size
    return out


def describe(eqn: Any) -> Layout | None:
    """The layout of a higher-order equation, or None for any other equation."""
    entry = PRIMITIVES.get(eqn.primitive.name)
    if entry is None:
        return None
    p = eqn.params
    if any(param not in p for _, param in entry.bodies):
        return None  # an older form of the primitive, without its body: opaque
    return Layout(
        kind=entry.kind,
        bodies={role: p[param] for role, param in entry.bodies},
        groups=entry.groups(p, len(eqn.invars)),
        length=entry.length(p),
        reverse=entry.reverse(p),
    )


def with_bodies(eqn: Any, bodies: dict[str, Any]) -> dict[str, Any]:
    """``eqn``'s params with the given bodies (by role) put back under their param names."""
    params = dict(eqn.params)
    for role, param in PRIMITIVES[eqn.primitive.name].bodies:
        if role in bodies:
            params[param] = bodies[role]
    return params


def rebind(eqn: Any, invals: Sequence[Any], bodies: dict[str, Any]) -> list[Any]:
    """Binds ``eqn``'s primitive on ``invals`` with new bodies (by role)."""
    return bind(eqn, list(invals), with_bodies(eqn, bodies))


def bind(eqn: Any, invals: list[Any], params: dict[str, Any]) -> list[Any]:
    """Binds ``eqn``'s primitive with ``params``; always a list of outputs."""
    out = eqn.primitive.bind(*invals, **jc.bind_params(eqn, params))
    return list(out) if eqn.primitive.multiple_results else [out]


def shard_map_options(eqn: Any) -> dict[str, Any]:
    """``jax.shard_map`` keyword arguments that re-create a ``shard_map`` equation."""
    p = eqn.params
    kwargs: dict[str, Any] = {
        "mesh": p["mesh"],
        "in_specs": tuple(p["in_specs"]),
        "out_specs": tuple(p["out_specs"]),
    }
    axis_names = p.get("newly_manual_axes", p.get("manual_axes"))
    if axis_names is not None:
        kwargs["axis_names"] = set(axis_names)
    if "check_vma" in p:
        kwargs["check_vma"] = p["check_vma"]
    return kwargs


def jit_name(eqn: Any) -> str:
    """The name a ``jit`` equation was given (``log_softmax``...), or ``""``."""
    return str(eqn.params.get("name", "")) if eqn.primitive.name in ("jit", "pjit") else ""


def held_jaxprs(eqn: Any) -> list[Any]:
    """Every jaxpr an equation holds in its params (directly, or in a tuple or named tuple:
    ``custom_linear_solve`` holds its ``matvec``/``vecmat``/``solve``/``transpose_solve``)."""
    found = []
    for value in eqn.params.values():
        for v in value if isinstance(value, tuple) else (value,):
            if jc.is_any_jaxpr(v):
                found.append(v)
    return found


def map_held(value: Any, fun: Callable[[Any], Any]) -> Any:
    """A param value with ``fun`` applied to it, or to each item of a (named) tuple."""
    if not isinstance(value, tuple):
        return fun(value)
    items = [fun(v) for v in value]
    return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
