"""The data of an :func:`jmp_rewrite.explain` report, which its views read.

:class:`EquationReport` (one per equation), :class:`CastReport` (one per cast inserted) and
:class:`ReportData` (the report's fields, totals and plain-text form). The views
(:mod:`~jmp_rewrite._src.explain.view`, :mod:`~jmp_rewrite._src.explain.html`) import this
module; :mod:`~jmp_rewrite._src.explain.build` builds the report and gives
:class:`jmp_rewrite.Report` its view methods, so no module points back up.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

from jmp_rewrite._src.emit.facts import EquationPaint
from jmp_rewrite._src.trace import shapes


@dataclasses.dataclass(frozen=True)
class EquationReport(EquationPaint):
    """One equation (or loop carry / cond output / scan stream) of an explained program.

    The fields of :class:`jmp_rewrite.EquationPaint` (path, primitive, key, list, colour,
    painted_by, float32, in_float32_region, scope), and:

    Attributes:
      in_dtypes: float input dtypes before the rewrite.
      in_dtypes_after: float input dtypes as the rewritten equation runs.
      out_dtypes: output dtypes before.
      out_dtypes_after: output dtypes after.
      flops: multiply-add FLOPs x2 for dot_general / conv equations (times the enclosing
        ``scan`` lengths), else 0.
      source: ``file:line`` of the user's code that created the equation, ``""`` if unknown.
      phase: ``forward``, ``backward`` (JAX's transpose) or ``optimizer`` (Optax, nnx's
        Optimizer, the loss-scale optimizer).
      in_shapes: shapes of the float inputs (as ``in_dtypes``).
      out_shapes: shapes of the outputs (as ``out_dtypes``).
      trips: product of the enclosing ``scan`` lengths.
      tensor_dims: for matmuls/convs, the named dimensions tensor cores want multiples of 8.
      released_by: deny-list keys whose move to infer alone would run it in half precision.
      accumulates_through: for a loop carry run in half precision whose next value adds to
        it, the keys of the ops on the way (``("add", "max")``; its ``source`` is then the
        line of that addition), else ``()``: it is rounded to half every iteration.
      float8_left: under ``fp8=True``, why a half-precision matmul stays bfloat16 (``shape:
        ...`` when only its shape kept it), else ``""``.
      attention_left: under ``fuse_attention=True``, for the values matmul of an attention
        left as written, why (a sentence), else ``""``.
      attention_saved: for the values matmul of a fused attention, the bytes of the
        intermediates (logits, probabilities, their cotangents) the fused call does not
        write, else 0.
      attention_tpu: for the values matmul of a fused attention that JAX's TPU
        flash-attention kernel cannot take, why (a sentence: on a TPU it runs as written),
        else ``""``.

    ``scope`` here is the model scope, ``/``-separated: the Flax/Haiku module path and
    ``jax.named_scope`` names, or, for Flax NNX and Equinox (which add no names), the
    attributes their modules are called through; ``""``: top level.
    """

    in_dtypes: tuple[str, ...] = ()
    in_dtypes_after: tuple[str, ...] = ()
    out_dtypes: tuple[str, ...] = ()
    out_dtypes_after: tuple[str, ...] = ()
    flops: int = 0
    source: str = ""
    phase: str = "forward"
    in_shapes: tuple[tuple[int, ...], ...] = ()
    out_shapes: tuple[tuple[int, ...], ...] = ()
    trips: int = 1
    tensor_dims: tuple[tuple[str, int], ...] = ()
    released_by: tuple[str, ...] = ()
    accumulates_through: tuple[str, ...] = ()
    float8_left: str = ""
    attention_left: str = ""
    attention_saved: int = 0
    attention_tpu: str = ""


@dataclasses.dataclass(frozen=True)
class CastReport:
    """A cast the rewrite inserted: where (the consumer), of what, from and to which dtype."""

    where: str
    value: str
    from_dtype: str
    to_dtype: str


@dataclasses.dataclass(frozen=True)
class ReportData:
    """The data of a :class:`jmp_rewrite.Report`: its fields, totals and plain-text form (the
    views of :mod:`~jmp_rewrite._src.explain.view` and :mod:`~jmp_rewrite._src.explain.html`
    read it; see :class:`jmp_rewrite.Report` for the fields)."""

    dtype: str
    changed: bool
    equations: tuple[EquationReport, ...]
    casts: tuple[CastReport, ...]
    residual_bytes_float32: int | None
    residual_bytes_rewritten: int | None
    explained: str = ""
    off_reason: str = ""
    fp8_none: str = ""
    lowered: tuple[tuple[str, str], ...] = ()

    # -- totals ---------------------------------------------------------------------------

    @property
    def converted(self) -> list[EquationReport]:
        """Equations (not structural vertices) that run in half precision."""
        return [e for e in self.equations if e.half and not e.primitive.startswith("<")]

    @property
    def total(self) -> int:
        """Equations (not structural vertices) in the program."""
        return sum(1 for e in self.equations if not e.primitive.startswith("<"))

    @property
    def matmul_flops(self) -> int:
        """dot_general/conv FLOPs of the program (times the enclosing ``scan`` lengths)."""
        return sum(e.flops for e in self.equations)

    @property
    def region_flops(self) -> int:
        """The part of :attr:`matmul_flops` inside float32 regions (float32 on request)."""
        return sum(e.flops for e in self.equations if e.in_float32_region)

    @property
    def half_flops_share(self) -> float | None:
        """Share of all dot_general/conv FLOPs that run in half precision; None without any.

        Matmuls inside float32 regions count, as float32: they run in float32
        (:attr:`region_flops` says how much of the rest that is).
        """
        return shapes.ratio(sum(e.flops for e in self.equations if e.half), self.matmul_flops)

    @property
    def float8_flops_share(self) -> float | None:
        """Share of all dot_general/conv FLOPs run in float8 (``fp8=True``; part of
        :attr:`half_flops_share`); None without any matmul."""
        return shapes.ratio(sum(e.flops for e in self.equations if e.float8), self.matmul_flops)

    @property
    def float8_added_bytes(self) -> int:
        """Bytes the float8 matmuls add (``fp8=True``): per float8 matmul equation (a loop
        body's: per iteration), its operands' quantized copies (a byte an element) and their
        two float32 scales."""
        return sum(
            sum(math.prod(s) for s in e.in_shapes[:2]) + 8 for e in self.equations if e.float8
        )

    @property
    def fused_attention(self) -> list[str]:
        """The fused attentions (``fuse_attention=True``), in program order."""
        return list(dict.fromkeys(e.attention for e in self.equations if e.attention))

    def per_primitive(self) -> dict[str, dict[str, int]]:
        """``{primitive: {"half": n, "float32": m}}`` for every primitive in the program."""
        out: dict[str, dict[str, int]] = collections.defaultdict(lambda: {"half": 0, "float32": 0})
        for e in self.equations:
            out[e.primitive]["half" if e.half else "float32"] += 1
        return dict(sorted(out.items()))

    def summary(self) -> str:
        """A few lines of totals (what was explained first, when it needs saying)."""
        lines = [f"explained: {self.explained}"] if self.explained else []
        if self.lowered:
            lines.append(f"dtype=None, decided where the program is lowered: {self.lowered_words}")
        if self.off_reason:
            return "\n".join([*lines, f"rewrite off (runs unchanged): {self.off_reason}"])
        lines += [
            f"dtype: {self.dtype}" + ("" if self.changed else " (no allowlist op: unchanged)"),
            f"equations in half precision: {len(self.converted)} / {self.total}",
            f"casts inserted: {len(self.casts)}",
            f"matmul/conv FLOPs in half precision: {self._flops_words()}",
        ]
        if self.float8_flops_share:
            f8, half = self.float8_flops_share, self.half_flops_share or 0.0
            lines.append(
                f"matmul FLOPs in float8 / {self.dtype} / float32: {100 * f8:.1f}% / "
                f"{100 * (half - f8):.1f}% / {100 * (1 - half):.1f}%; float8 adds "
                f"{self.float8_added_bytes:,} bytes (quantized operands and scales)"
            )
        if self.fp8_none:
            lines.append(f"float8: no matmul under fp8=True: {self.fp8_none}")
        fused = self.fused_attention
        left = sum(1 for e in self.equations if e.attention_left)
        if fused or left:
            saved = sum(e.attention_saved for e in self.equations)
            lines.append(
                f"fused attention: {len(fused)} ({shapes.fmt(saved)} bytes of logits, "
                f"probabilities and their gradients not written)"
                + (f"; {left} left as written (see lint)" if left else "")
            )
        if self.residual_bytes_float32 is not None:
            lines.append(
                "bytes saved for the backward pass: "
                f"{shapes.fmt(self.residual_bytes_float32)} (float32) -> "
                f"{shapes.fmt(self.residual_bytes_rewritten)} (rewritten)"
            )
        return "\n".join(lines)

    @property
    def lowered_words(self) -> str:
        """:attr:`lowered` in words (``""`` when a dtype was given)."""
        if not self.lowered:
            return ""
        each = ", ".join(f"{p} {d}" for p, d in self.lowered)
        return (
            f"{each}, any other platform float32 (unchanged); this report shows the default "
            "device's program (explain with dtype= for another's)"
        )

    def _flops_words(self) -> str:
        share, total, region = self.half_flops_share, self.matmul_flops, self.region_flops
        if shapes.is_zero(total):
            return "none (no matmul or convolution)"
        if share is None:  # a share that depends on symbolic dimensions: both counts
            half = sum(e.flops for e in self.equations if e.half)
            words = f"{shapes.fmt(half)} of {shapes.fmt(total)}"
            words += " (the share depends on the symbolic dimensions)"
        else:
            pct = f"{100 * share:.1f}"
            if pct == "100.0" and share < 1:  # not all of it: say how much is missing
                pct = f"{100 * share:.3f}".rstrip("0")
            words = f"{pct}% of {shapes.fmt(total)}"
        if not shapes.is_zero(region):
            words += f" ({shapes.fmt(region)} in float32 regions, float32 on request)"
        return words

    # -- rendering ------------------------------------------------------------------------

    def _rows(self) -> list[tuple[str, ...]]:
        rows = [("path", "list", "colour", "pass", "dtypes in", "dtypes out")]
        for e in self.equations:
            rows.append(
                (
                    e.path,
                    e.list,
                    "half" if e.half else e.colour,
                    e.painted_by or "",
                    _arrow(e.in_dtypes, e.in_dtypes_after),
                    _arrow(e.out_dtypes, e.out_dtypes_after),
                )
            )
        return rows

    def __str__(self) -> str:
        rows = self._rows()
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        table = "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        )
        casts = "\n".join(
            f"  {c.where}: {c.value} {c.from_dtype} -> {c.to_dtype}" for c in self.casts
        )
        if self.off_reason:
            return self.summary()
        return f"{self.summary()}\n\n{table}\n\ncasts inserted:\n{casts or '  none'}"

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON-serialisable data."""
        return {
            "dtype": self.dtype,
            "changed": self.changed,
            "explained": self.explained,
            "off_reason": self.off_reason,
            "fp8_none": self.fp8_none,
            "lowered": dict(self.lowered),
            "totals": {
                "equations": self.total,
                "converted": len(self.converted),
                "casts": len(self.casts),
                "half_flops_share": self.half_flops_share,
                "float8_flops_share": self.float8_flops_share,
                "fused_attention": len(self.fused_attention),
                "residual_bytes_float32": shapes.jsonable(self.residual_bytes_float32),
                "residual_bytes_rewritten": shapes.jsonable(self.residual_bytes_rewritten),
            },
            "per_primitive": self.per_primitive(),
            "equations": [shapes.jsonable(dataclasses.asdict(e)) for e in self.equations],
            "casts": [dataclasses.asdict(c) for c in self.casts],
        }


def _arrow(before: tuple[str, ...], after: tuple[str, ...]) -> str:
    b, a = ",".join(before), ",".join(after)
    return b if a == b else f"{b} -> {a}"
