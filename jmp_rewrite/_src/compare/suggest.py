"""``compare``'s suggestions: where a numerical problem starts, and the list change (or
float32 region) that would remove it. The rules are :func:`jmp_rewrite.compare`'s."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from jmp_rewrite._src.compare.eager import Stats
from jmp_rewrite._src.emit.facts import user_scope
from jmp_rewrite._src.paint.painting import Painting
from jmp_rewrite._src.trace.equations import has_jaxpr_param
from jmp_rewrite._src.trace.graph import Graph

#: Suggestion targets: a list change, or a float32 region (when lists cannot help).
TO_DENY = "deny"
TO_REGION = "float32_region"

_MOVABLE = ("allow", "infer", "clear")


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """A proposed change, found by :func:`compare`.

    Attributes:
      key: the op key to move (a primitive name or a virtual key such as ``jit:softmax``).
      path: the equation where the problem was first seen.
      to_list: ``"deny"`` (a list change; :meth:`Comparison.apply` can try it), or
        ``"float32_region"`` when no list change can help (level ``UNSAFE_FORCE_ALL``
        ignores the lists): wrap the code in :func:`jmp_rewrite.float32_region`.
      reason: why, in words (e.g. ``overflows in float16: ...``).
      scope: the equation's name stack when it has one (a ``jax.named_scope`` or module
        name): wrapping that code in :func:`jmp_rewrite.float32_region` is the narrower fix.
    """

    key: str
    path: str
    to_list: str
    reason: str
    scope: str = ""

    def __str__(self) -> str:
        where = f"{self.scope}/{self.path}" if self.scope else self.path
        if self.to_list == TO_REGION:
            return f"wrap `{self.key}` at `{where}` in jmp_rewrite.float32_region: {self.reason}"
        return f"move `{self.key}` at `{where}` to {self.to_list}: {self.reason}"


def fmt_error(x: float) -> str:
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return "0" if x == 0 else f"{x:.2e}"


def _origins(graph: Graph, stats: dict[int, Stats], attr: str) -> list[tuple[int, int]]:
    """(first execution, node) of the nodes where a problem starts: it shows there at
    execution ``s`` and in none of the node's inputs before ``s``."""
    found = []
    for node, st in stats.items():
        s = getattr(st, attr)
        if s is None:
            continue
        earlier = (
            stats.get(f) is not None
            and getattr(stats[f], attr) is not None
            and getattr(stats[f], attr) < s
            for f in graph.nodes[node].fanin
        )
        if not any(earlier):
            found.append((s, node))
    return found


def _reason(st: Stats, dtype: np.dtype, tol: float) -> str:
    if st.overflow:
        return (
            f"overflows in {dtype.name}: {st.overflow} finite float32 values became inf "
            f"(max |float32| {st.max_abs:.3g}; {dtype.name} max {float(jnp.finfo(dtype).max):.5g})"
        )
    if st.nan:
        return f"produces NaN in {dtype.name} ({st.nan} values not NaN in float32)"
    text = f"relative error {fmt_error(st.rel_error)} exceeds the tolerance {tol:g}"
    if st.underflow:
        text += (
            f"; {st.underflow} non-zero values became zero (for gradients, loss scaling is "
            "the usual fix)"
        )
    return text


def suggest(
    graph: Graph,
    painting: Painting,
    stats: dict[int, Stats],
    dtype: np.dtype,
    tol: float,
    force_all: bool,
) -> tuple[list[Suggestion], list[str]]:
    """The suggestion rules (see :func:`compare`)."""
    origins = sorted(
        set(_origins(graph, stats, "first_bad") + _origins(graph, stats, "first_exceed"))
    )
    suggestions: list[Suggestion] = []
    notes: list[str] = []
    seen: set[str] = set()
    for _, node_id in origins:
        n = graph.nodes[node_id]
        st = stats[node_id]
        reason = _reason(st, dtype, tol)
        if n.eqn is None:
            notes.append(
                f"{n.path} ({n.key}): {reason}; it is a loop carry, cond output or scan "
                "stream taken in half precision: deny the equation that produces it"
            )
            continue
        if node_id not in painting.allow:
            if has_jaxpr_param(n.eqn):
                why = "an equation holding jaxprs, whose bodies are rewritten separately"
            elif not n.fanin:
                why = (
                    "its inputs are not floats; they come from comparisons of half-precision "
                    "values, which rounding can flip (often harmless, e.g. argmax masks)"
                )
            else:
                deny = " (deny)" if painting.colour(node_id) == "deny" else ""
                why = f"it ran in float32{deny}: the error comes from its half-precision inputs"
            notes.append(f"{n.path} ({n.key}): {reason}; {why}")
            continue
        owner = graph.nodes[n.unit] if n.unit is not None else n
        key, listed = owner.key, owner.listed_kind
        scope = user_scope(n.eqn)
        fp8 = painting.fp8
        if fp8 is not None and node_id in fp8.dots:  # float8's rounding, not the lists'
            name = f"Fp8Rules(exclude=({scope!r},))" if scope else "Fp8Rules(exclude=...)"
            notes.append(
                f"{n.path} ({key}, float8 {fp8.dots[node_id].describe()}): {reason}; it ran "
                f"in float8: keep it bfloat16 with jmp_rewrite.{name} if that matters"
            )
            continue
        if fp8 is not None and any(f in fp8.dots for f in n.fanin):
            notes.append(
                f"{n.path} ({key}): {reason}; it reads a float8 matmul's result, whose "
                "rounding (a few %) it inherits: no list change applies"
            )
            continue
        if force_all:
            to_list = TO_REGION
            reason += "; level UNSAFE_FORCE_ALL ignores the lists"
        elif listed in _MOVABLE:
            to_list = TO_DENY
            if scope:
                reason += (
                    f"; or wrap the code of scope `{scope}` in jmp_rewrite.float32_region "
                    f"to keep other `{key}` equations in half precision"
                )
        else:
            notes.append(
                f"{n.path} ({key}, {listed}): {reason}; no list change applies to it "
                "(wrap the code in jmp_rewrite.float32_region)"
            )
            continue
        if key in seen:
            continue
        seen.add(key)
        suggestions.append(Suggestion(key, n.path, to_list, reason, scope))
    return suggestions, notes
