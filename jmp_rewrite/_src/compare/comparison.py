"""The records :func:`jmp_rewrite.compare` returns: per equation, and for the program.

:class:`EquationComparison` (how one equation's outputs differ between the float32 and the
rewritten run) and :class:`Comparison` (all of them, the suggestions, and the queries and
renderings over them); :mod:`~jmp_rewrite._src.compare.run` runs the two programs and fills them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from jmp_rewrite._src.compare.suggest import TO_REGION, Suggestion, fmt_error
from jmp_rewrite._src.emit.facts import EquationPaint
from jmp_rewrite._src.lists import op_lists as op_lists_lib


@dataclasses.dataclass(frozen=True)
class EquationComparison(EquationPaint):
    """How one equation's outputs differ between the float32 and the rewritten run.

    The fields of :class:`jmp_rewrite.EquationPaint` (``path`` is ``<output N>`` for the
    program's outputs, whose ``colour`` is their dtype; inside a fused unit such as
    ``jit:log_softmax``, ``list`` is the unit's, which decides its colour), and:

    Attributes:
      rel_error: largest ``max|half - f32| / (max|f32| + tiny)`` over executions, computed
        over the elements finite in both runs; ``inf`` when an element finite in float32 is
        not finite in half precision.
      norm_error: largest ``||half - f32||_2 / (||f32||_2 + tiny)`` over executions (``inf``
        in the same case).
      overflow: elements finite in float32 but infinite in half precision (summed over
        executions).
      underflow: elements non-zero in float32 but zero in half precision.
      nan: elements NaN in half precision but not in float32.
      max_abs_f32: largest finite ``|value|`` in the float32 run.
      count: executions compared (loop bodies run several times; 0 when the control flow of
        the two runs diverged and the equation ran in one of them only).
      size: elements compared, over all executions.
      exceeds: ``rel_error`` is above the comparison's tolerance.
    """

    rel_error: float = 0.0
    norm_error: float = 0.0
    overflow: int = 0
    underflow: int = 0
    nan: int = 0
    max_abs_f32: float = 0.0
    count: int = 0
    size: int = 0
    exceeds: bool = False


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The result of :func:`compare`.

    Attributes:
      dtype: the half-precision dtype, e.g. ``"float16"``.
      tolerance: the relative-error tolerance used for ``exceeds`` and the suggestions.
      changed: False when the rewrite leaves the program unchanged (no allowlist op).
      lists: the op lists used (level and environment overrides applied).
      equations: one :class:`EquationComparison` per equation with float outputs that ran,
        in program order (loop carries, ``cond`` outputs and ``scan`` streams included).
      outputs: one :class:`EquationComparison` per float output of the program.
      suggestions: proposed list changes (:class:`Suggestion`), earliest problem first.
      notes: other findings (diverging control flow, problems no list change can fix...).
      first_index: the index in ``equations`` of :attr:`first_exceeding`, or None.
    """

    dtype: str
    tolerance: float
    changed: bool
    lists: op_lists_lib.OpLists
    equations: tuple[EquationComparison, ...]
    outputs: tuple[EquationComparison, ...]
    suggestions: tuple[Suggestion, ...]
    notes: tuple[str, ...] = ()
    first_index: int | None = dataclasses.field(default=None, repr=False)
    _rerun: Callable[[op_lists_lib.OpLists], Comparison] | None = dataclasses.field(
        default=None, repr=False, compare=False
    )

    # -- queries --------------------------------------------------------------------------

    @property
    def first_exceeding(self) -> EquationComparison | None:
        """The first equation, in the order the rewritten program ran them, whose relative
        error exceeds the tolerance (None if none does)."""
        return None if self.first_index is None else self.equations[self.first_index]

    @property
    def exceeding(self) -> list[EquationComparison]:
        """Every equation whose relative error exceeds the tolerance, in program order."""
        return [e for e in self.equations if e.exceeds]

    @property
    def max_rel_error(self) -> float:
        """The largest relative error of any equation (0.0 for an empty program)."""
        return max((e.rel_error for e in self.equations), default=0.0)

    @property
    def overflow(self) -> int:
        """Total elements that overflowed, over all equations."""
        return sum(e.overflow for e in self.equations)

    def find(self, name: str) -> list[EquationComparison]:
        """Equations whose primitive or key is ``name``, or whose path ends with it.

        Args:
          name: e.g. ``"reduce_sum"``, ``"jit:log_softmax"`` or ``"scan/body/dot_general"``.

        Returns:
          The matching :class:`EquationComparison` records, in program order.
        """
        return [
            e
            for e in self.equations
            if e.primitive == name or e.key == name or e.path.endswith(name)
        ]

    def worst(self, n: int = 10) -> list[EquationComparison]:
        """The ``n`` equations with the largest relative error, worst first."""
        return sorted(self.equations, key=lambda e: -e.rel_error)[:n]

    # -- acting on the suggestions ---------------------------------------------------------

    def suggested_lists(self, *suggestions: Suggestion) -> op_lists_lib.OpLists:
        """The lists used, with suggestions applied.

        Args:
          *suggestions: the suggestions to apply; all list suggestions when none is given.

        Returns:
          A new :class:`jmp_rewrite.OpLists`; pass it as ``compare(..., lists=...)`` or
          ``rewrite(..., lists=...)``.

        Raises:
          TypeError: if an argument is not a :class:`Suggestion`.
          ValueError: for a ``float32_region`` suggestion, which no list change expresses.
        """
        chosen = suggestions or tuple(s for s in self.suggestions if s.to_list != TO_REGION)
        lists = self.lists
        for s in chosen:
            if not isinstance(s, Suggestion):
                raise TypeError(f"expected a jmp_rewrite.Suggestion, got {type(s).__name__}")
            if s.to_list == TO_REGION:
                raise ValueError(
                    f"{s} is not a list change: wrap that code in jmp_rewrite.float32_region"
                )
            lists = lists.move(s.key, s.to_list)
        return lists

    def apply(self, *suggestions: Suggestion) -> Comparison:
        """Re-runs the comparison with suggestions applied to the lists.

        Args:
          *suggestions: the suggestions to apply; all list suggestions when none is given.

        Returns:
          A new :class:`Comparison` of the same function and inputs with the changed lists
          (its :attr:`lists` are the new lists).

        Raises:
          TypeError: if an argument is not a :class:`Suggestion`.
          ValueError: for a ``float32_region`` suggestion, or a comparison not made by
            :func:`compare`.

        Example:
          >>> import jax.numpy as jnp
          >>> import jmp_rewrite
          >>> lists = jmp_rewrite.default_lists(jnp.float16).move("reduce_sum", "infer")
          >>> c = jmp_rewrite.compare(lambda w, x: jnp.sum((x @ w) * 1e3), jnp.ones((64, 64)),
          ...                         jnp.ones((4, 64)), dtype=jnp.float16, lists=lists)
          >>> [s.key for s in c.suggestions], c.apply().overflow
          (['reduce_sum'], 0)
        """
        if self._rerun is None:
            raise ValueError("this Comparison was not made by jmp_rewrite.compare")
        return self._rerun(self.suggested_lists(*suggestions))

    # -- rendering --------------------------------------------------------------------------

    def summary(self) -> str:
        """A few lines: totals, the first equation exceeding the tolerance, output errors."""
        half = sum(1 for e in self.equations if e.half)
        lines = [
            f"compare: {self.dtype} vs float32, tolerance {self.tolerance:g}"
            + ("" if self.changed else " (no allowlist op: the program is unchanged)"),
            f"equations compared: {len(self.equations)} ({half} in half precision); "
            f"exceeding tolerance: {len(self.exceeding)}",
            f"max relative error: {fmt_error(self.max_rel_error)}; overflow: {self.overflow}, "
            f"underflow: {sum(e.underflow for e in self.equations)}, "
            f"NaN: {sum(e.nan for e in self.equations)}",
        ]
        float8 = [e for e in self.equations if e.float8]
        if float8:
            worst = max(float8, key=lambda e: e.rel_error)
            lines.append(
                f"float8 matmuls: {len(float8)}; largest relative error "
                f"{fmt_error(worst.rel_error)} ({worst.path}, {worst.float8})"
            )
        first = self.first_exceeding
        lines.append(
            "first exceeding tolerance: "
            + (
                f"{first.path} ({first.key}, error {fmt_error(first.rel_error)})"
                if first
                else "none"
            )
        )
        if self.outputs:
            errs = ", ".join(fmt_error(o.rel_error) for o in self.outputs[:8])
            more = ", ..." if len(self.outputs) > 8 else ""
            lines.append(f"output relative errors: {errs}{more}")
        return "\n".join(lines)

    def table(self, records: Sequence[EquationComparison] | None = None) -> str:
        """An aligned table of ``records`` (default: every equation, in program order).

        The first equation exceeding the tolerance is marked ``>>``, others exceeding ``!``.
        """
        records = self.equations if records is None else records
        first = self.first_exceeding
        head = ("", "path", "op", "list", "colour", "rel err", "norm err", "overflow")
        head += ("underflow", "nan", "max|f32|", "runs")
        scoped = any(e.scope for e in records)
        if scoped:
            head += ("scope",)
        rows = [head]
        for e in records:
            mark = ">>" if e is first else ("!" if e.exceeds else "")
            rows.append(
                (
                    mark,
                    e.path,
                    e.key,
                    e.list,
                    "half" if e.half else e.colour,
                    fmt_error(e.rel_error),
                    fmt_error(e.norm_error),
                    str(e.overflow),
                    str(e.underflow),
                    str(e.nan),
                    fmt_error(e.max_abs_f32),
                    str(e.count),
                )
                + ((e.scope,) if scoped else ())
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        right = set(range(5, 12))
        return "\n".join(
            "  ".join(
                c.rjust(w) if i in right else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip()
            for r in rows
        )

    def __str__(self) -> str:
        parts = [self.summary(), "", self.table()]
        if self.outputs:
            parts += ["", "outputs:", self.table(self.outputs)]
        parts += ["", "suggestions:"]
        parts += [f"  {s}" for s in self.suggestions] or ["  none"]
        if self.notes:
            parts += ["", "notes:"] + [f"  {n}" for n in self.notes]
        return "\n".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """The comparison as JSON-serialisable data (non-finite floats as ``"inf"``/``"nan"``)."""
        first = self.first_exceeding
        return {
            "dtype": self.dtype,
            "tolerance": self.tolerance,
            "changed": self.changed,
            "first_exceeding": first.path if first else None,
            "max_rel_error": _json_float(self.max_rel_error),
            "equations": [_record_dict(e) for e in self.equations],
            "outputs": [_record_dict(e) for e in self.outputs],
            "suggestions": [dataclasses.asdict(s) for s in self.suggestions],
            "notes": list(self.notes),
        }


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def _record_dict(e: EquationComparison) -> dict[str, Any]:
    d = dataclasses.asdict(e)
    for k in ("rel_error", "norm_error", "max_abs_f32"):
        d[k] = _json_float(d[k])
    return d
