"""The records of the painting graph (``graph``): its vertices (:class:`Node`) and how each
equation of each jaxpr instance was mapped into it (:class:`EqnRec`, :class:`ScopeRec`),
which the passes, the emitter and the reports read."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jmp_rewrite._src.trace.origins import NOWHERE, Origin


def walk_scopes(scope: ScopeRec, ctx: Any, step: Callable[[Any, Any, EqnRec], Any]) -> None:
    """Visits every equation of a scope and its sub-scopes, in program order:
    ``step(ctx, eqn, rec)`` returns the context its sub-scopes are visited with."""
    for eqn, rec in zip(scope.jaxpr.eqns, scope.eqns, strict=True):
        inner = step(ctx, eqn, rec)
        for sub in rec.subs.values():
            for s in sub if isinstance(sub, list) else [sub]:
                walk_scopes(s, inner, step)


#: Kinds whose transpose sums an operand's cotangent over trips or devices.
SUMMING_KINDS = ("scan", "while", "shard_map")


def sums_over_trips(rec: EqnRec) -> bool:
    """Whether ``rec``'s equation is, or holds at any depth, a loop or a ``shard_map``: a
    body whose transpose sums what it reads over trips or devices."""
    return rec.kind in SUMMING_KINDS or any(
        sums_over_trips(r)
        for sub in rec.subs.values()
        for s in (sub if isinstance(sub, list) else [sub])
        for r in s.eqns
    )


@dataclasses.dataclass
class Node:
    """One vertex of the painting graph.

    Attributes:
      id: index in ``Graph.nodes`` (creation order is a topological order of each jaxpr).
      key: list key (primitive name or virtual key); structural nodes use ``<carry>`` etc.
      kind: ``allow``/``infer``/``deny``/``clear``/``unlisted`` as used by the passes.
      listed_kind: the list the key is on (differs from ``kind`` inside float32 regions).
      float32: TF's ``IsFloat32`` for this vertex.
      process: TF's ``ShouldProcess``; false inside float32 regions and fused units.
      path: readable location, e.g. ``scan/body/dot_general``.
      eqn: the equation (None for structural nodes).
      is_cast: an existing ``convert_element_type`` to float32 (TF's Cast rule).
      feeds_output: the value leaves the program (a TF fetch: never retargeted).
      unit: id of the fused unit this node sits in, if any.
      region: inside a :func:`jmp_rewrite.float32_region`.
      origin: where its value comes from (see :class:`Origin`).
      backward: computed by a backward (transposed) equation.
    """

    id: int
    key: str
    kind: str
    listed_kind: str
    float32: bool
    process: bool
    path: str
    eqn: Any = None
    is_cast: bool = False
    feeds_output: bool = False
    unit: int | None = None
    region: bool = False
    origin: Origin = NOWHERE
    backward: bool = False
    fanin: list[int] = dataclasses.field(default_factory=list)
    fanout: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class EqnRec:
    """How one equation of one jaxpr instance was mapped into the graph."""

    kind: str  # leaf | opaque | unit | call | custom_jvp | custom_vjp | shard_map | cond | ...
    node: int | None = None
    #: the higher-order layout (None for leaf and opaque equations).
    layout: Any = None
    #: position among all equation records of the graph, in build order: stable across
    #: re-paintings of the same program (``compare(...).apply()`` keys loops by it).
    index: int = 0
    subs: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: while/scan: carry node per carry (None: not a float carry); cond: output nodes.
    carries: list[int | None] = dataclasses.field(default_factory=list)
    #: while/scan: per operand, the structural node whose dtype it is passed in (loop
    #: consts, carries' initial values, xs), or None to pass it as it is.
    operands: list[int | None] = dataclasses.field(default_factory=list)
    #: call/cond: per operand, the nodes inside that read it (see ``ScopeRec.consumers``).
    operand_consumers: list[list[int]] = dataclasses.field(default_factory=list)
    xs: list[int | None] = dataclasses.field(default_factory=list)
    ys: list[int | None] = dataclasses.field(default_factory=list)
    #: per operand: a constant (see :class:`Origin`).
    const_operands: tuple[bool, ...] = ()
    #: per operand, its :class:`Origin` (float8 tells parameters from activations by it).
    operand_origins: tuple[Origin, ...] = ()
    #: per operand of a forward equation (backward ones overflow honestly): frozen (see
    #: :class:`Origin`), clamped into half; big (``Origin.big``), pinned (``masking``).
    clamped_operands: tuple[bool, ...] = ()
    big_operands: tuple[bool, ...] = ()
    #: per operand of a forward equation: its source node (for ``Emitter._big``).
    operand_nodes: tuple[int | None, ...] = ()


@dataclasses.dataclass
class ScopeRec:
    """One instance of a jaxpr (the same jaxpr object may be called at several sites)."""

    path: str
    jaxpr: Any
    eqns: list[EqnRec] = dataclasses.field(default_factory=list)
    #: For each float input var of the jaxpr, the nodes that read it (looking through
    #: nested calls and conds; casts excluded, as they take any dtype). A call site passes
    #: an operand in the dtype all of them want, so the cast is made once, outside.
    consumers: dict[Any, list[int]] = dataclasses.field(default_factory=dict)
    #: Per output of a forward jaxpr, whether it is big (``Origin.big``): cast into half at
    #: the boundary, it is pinned even where no equation of the body computed it (a float32
    #: big value handed in and out, as a ``scan`` of a hoisted mask bias passes it on).
    big_outputs: tuple[bool, ...] = ()
