"""What is known of one painted equation: the record ``paint``, ``explain`` and ``compare``
share.

:class:`EquationPaint` holds the facts every view of the painting needs (where the equation
sits, its list, its colour, the pass that set it, its scope); :func:`equation_facts` computes
them once per graph vertex (:class:`PaintResult`, what ``paint`` returns, holds them all),
and :func:`dtypes_after` says which dtypes the rewritten equation runs on. ``explain``'s
:class:`~jmp_rewrite.EquationReport` and ``compare``'s
:class:`~jmp_rewrite.EquationComparison` extend the record with their own columns.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src.emit.emitter import accumulates_in_float32
from jmp_rewrite._src.paint.painting import Painting
from jmp_rewrite._src.trace.equations import is_f32, is_float
from jmp_rewrite._src.trace.graph import Graph, Node
from jmp_rewrite._src.trace.regions import FLOAT32_REGION_SCOPE
from jmp_rewrite._src.trace.source_info import split_name_stack


@dataclasses.dataclass(frozen=True)
class EquationPaint:
    """How one equation (or structural vertex) of a program was painted.

    Attributes:
      path: where it sits, e.g. ``while/body/dot_general`` (sub-jaxprs joined by ``/``).
      primitive: the primitive name (``<carry>``, ``<cond-output>``, ``<xs>``, ``<ys>``,
        ``<const>`` for loop carries, ``cond`` outputs, ``scan`` streams and loop constants;
        ``jit:NAME`` for a fused unit).
      key: the list key (``reciprocal``, ``jit:log_softmax``... for virtual keys).
      list: ``allow``/``infer``/``deny``/``clear``/``unlisted`` for this dtype's lists.
      colour: ``allow`` (runs in half precision), ``deny`` or ``float32``.
      painted_by: the TF pass that decided the colour (None: never painted).
      float32: TF's ``IsFloat32``: whether the equation computes on float32 values.
      in_float32_region: inside :func:`jmp_rewrite.float32_region`.
      scope: the user's name scopes (``jax.named_scope``, Flax/Haiku module paths) with
        transformation wrappers removed, or ``""``.
      float8: under ``fp8=True``, the float8 formats of a matmul run in float8
        (``"e4m3 x e4m3"``; ``"e5m2 x e4m3"`` for a gradient GEMM), else ``""``.
      attention: under ``fuse_attention=True``, for an equation replaced by a fused
        attention call, which one (``"fused attention 0: h_0/attn (forward and backward,
        causal)"``), else ``""``.
    """

    path: str
    primitive: str
    key: str
    list: str
    colour: str
    painted_by: str | None
    float32: bool
    in_float32_region: bool
    scope: str = ""
    float8: str = ""
    attention: str = ""

    @property
    def half(self) -> bool:
        """Whether the equation runs in half precision."""
        return self.colour == "allow"


@dataclasses.dataclass(frozen=True)
class PaintResult:
    """The painting of a whole program: one :class:`EquationPaint` per vertex, in order."""

    equations: tuple[EquationPaint, ...]
    dtype: np.dtype | None
    changed: bool

    def __len__(self) -> int:
        return len(self.equations)

    def __iter__(self):
        return iter(self.equations)

    def __getitem__(self, index: int) -> EquationPaint:
        return self.equations[index]

    def find(self, primitive: str) -> list[EquationPaint]:
        """All vertices of ``primitive`` (or whose path ends with it), in program order."""
        return [
            e
            for e in self.equations
            if e.primitive == primitive or e.key == primitive or e.path.endswith(primitive)
        ]

    def colours(self, primitive: str) -> list[str]:
        """The colours of every ``primitive`` vertex, in program order."""
        return [e.colour for e in self.find(primitive)]

    @property
    def half(self) -> list[EquationPaint]:
        """The vertices that run in half precision."""
        return [e for e in self.equations if e.colour == "allow"]

    def __str__(self) -> str:
        rows = [("path", "list", "colour", "pass")]
        rows += [(e.path, e.list, e.colour, e.painted_by or "") for e in self.equations]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        return "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        )


def paint_result(graph: Graph | None, painting: Painting | None, dtype: Any) -> PaintResult:
    """The :class:`PaintResult` of a painted program (empty when nothing was painted)."""
    if graph is None or painting is None:
        return PaintResult((), None, False)
    eqs = [EquationPaint(**equation_facts(graph, painting, n)) for n in graph.nodes]
    return PaintResult(tuple(eqs), dtype, painting.changed)


def equation_facts(graph: Graph, painting: Painting, node: Node) -> dict[str, Any]:
    """The :class:`EquationPaint` fields of one vertex (a dict, to extend)."""
    changed = painting.changed
    eqn = node.eqn
    if eqn is None or node.key.startswith("jit:"):
        primitive = node.key
    else:
        primitive = eqn.primitive.name
    return {
        "path": node.path,
        "primitive": primitive,
        "key": node.key,
        "list": node.listed_kind,
        "colour": painting.colour(node.id) if changed else "float32",
        "painted_by": painting.painted_by.get(node.id) if changed else None,
        "float32": node.float32,
        "in_float32_region": node.region,
        "scope": user_scope(eqn),
        "float8": _float8(painting, node.id) if changed else "",
        "attention": _attention(painting, node.id) if changed else "",
    }


def _attention(painting: Painting, node_id: int) -> str:
    chosen = painting.attention
    fused = chosen.of_node(node_id) if chosen is not None else None
    return "" if fused is None else f"fused attention {fused.number}: {fused.label}"


def _float8(painting: Painting, node_id: int) -> str:
    fp8 = painting.fp8
    choice = fp8.dots.get(node_id) if fp8 is not None else None
    return choice.describe() if choice is not None else ""


def dtypes_after(node: Node, colour: str, half: str) -> dict[str, tuple[str, ...]]:
    """Float input dtypes and output dtypes of a vertex, before and as the rewrite runs it.

    A retargeted cast takes its input as it is and a half sum accumulates in float32 (see
    :func:`~jmp_rewrite._src.emit.emitter.accumulates_in_float32`): their inputs keep their dtypes.
    """
    to_half = colour == "allow"
    if node.eqn is None:  # structural vertex: a carry, cond output or scan stream
        dt = "float32" if node.float32 else "float"
        after = half if to_half else dt
        return {"in": (dt,), "in_after": (after,), "out": (dt,), "out_after": (after,)}
    eqn = node.eqn
    ins = [a.aval.dtype for a in eqn.invars if is_float(a.aval.dtype)]
    outs = [v.aval.dtype for v in eqn.outvars]

    def after(d: Any) -> str:
        return half if to_half and is_f32(d) else str(d)

    keeps_inputs = eqn.primitive.name == "convert_element_type" or accumulates_in_float32(
        eqn, to_half
    )
    return {
        "in": tuple(str(d) for d in ins),
        "in_after": tuple(str(d) if keeps_inputs and to_half else after(d) for d in ins),
        "out": tuple(str(d) for d in outs),
        "out_after": tuple(after(d) for d in outs),
    }


def user_scope(eqn: Any) -> str:
    """The user's name scopes of an equation: ``transpose(jvp(loss))`` -> ``loss``."""
    stack = jc.name_stack(eqn) if eqn is not None else ""
    if FLOAT32_REGION_SCOPE in stack:
        return ""
    return "/".join(split_name_stack(stack)[0])
