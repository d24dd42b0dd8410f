"""Readable views of an :func:`jmp_rewrite.explain` report: by scope, source line or primitive.

* :func:`groups`: equations grouped by model scope (Flax/Haiku module path, named scope, or
  NNX attribute path, see :mod:`jmp_rewrite._src.trace.source_info`), by the user's source line or
  by primitive; per group and per phase (forward, backward, optimizer) the equations, the
  share in half precision, the casts, the matmul/conv FLOPs in half precision and the bytes
  the equations produce in float32 and in half precision after the rewrite.
* :func:`lint`: what to change. Half-precision matmuls/convs whose contracting or output
  feature dimensions are not multiples of 8 (NVIDIA's tensor cores need them in float16 and
  bfloat16; the guidance TF's mixed-precision guide cites), and deny-list ops whose deny
  chain keeps equations float32 that one list change would release, with the risk.
* :func:`format_groups` (text); the HTML tree lives in :mod:`jmp_rewrite._src.explain.html`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import textwrap
from typing import Any

from jmp_rewrite._src.emit.emitter import ACCUMULATING
from jmp_rewrite._src.explain.report import EquationReport, ReportData
from jmp_rewrite._src.trace import shapes as shape_lib
from jmp_rewrite._src.trace import source_info as si

BY = ("scope", "line", "primitive")
#: Tensor cores take float16/bfloat16 GEMMs whose dimensions are multiples of this.
TENSOR_CORE_MULTIPLE = 8
_HALF_DTYPES = ("float16", "bfloat16")
_OUTPUTS = "(program outputs)"
_PRECISION_STYLES = {
    "half": "background:{half};color:#fff;font-weight:600",
    "deny": "background:{deny}",
    "float32": "background:#eeeeee",
    "none": "color:#888",
}
_LONG_TABLE = 40  # equations: a longer table starts closed
_ABBR = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}
_KIND_TITLES = {
    "half_carry": "Half-precision loop carries that add to themselves (rounded every iteration)",
    "tensor_cores": (
        f"Tensor cores: half-precision matmuls/convs with a dimension not a multiple of "
        f"{TENSOR_CORE_MULTIPLE} (they run on slower paths)"
    ),
    "deny_chain": "Deny chains: float32 only because of one deny-list op",
    "gradient_underflow": "Gradient underflow: a float16 backward pass without loss scaling",
}
#: The loss-scale optimizer's update, as explain shows its float32 region.
_LOSS_SCALE_SCOPE = "float32_region(loss_scale_optimizer_update)"


# --------------------------------------------------------------------------------------------
# Per-equation figures.


def _is_equation(e: EquationReport) -> bool:
    return not e.primitive.startswith("<")


def produced_bytes(e: EquationReport) -> tuple[int, int]:
    """(float32 bytes, half bytes) of the float values ``e`` produces as it runs rewritten,
    times the enclosing ``scan`` lengths. A fused unit (``jit:log_softmax``) counts zero: its
    pieces are equations of their own."""
    if not _is_equation(e) or e.primitive.startswith("jit:"):
        return 0, 0
    f32 = half = 0
    for shape, dtype in zip(e.out_shapes, e.out_dtypes_after, strict=False):
        size = math.prod(shape) * e.trips
        if dtype in _HALF_DTYPES:
            half += size * 2
        elif dtype == "float32":
            f32 += size * 4
    return f32, half


# --------------------------------------------------------------------------------------------
# Groups.


@dataclasses.dataclass
class GroupStats:
    """Totals of a set of equations (structural vertices are not counted as equations).

    Attributes:
      equations: equations.
      half: equations that run in half precision.
      casts: casts inserted for them.
      flops: matmul/conv FLOPs (times ``scan`` lengths).
      half_flops: of which run in half precision (float8 included).
      float8_flops: of which run in float8 (``fp8=True``).
      bytes_float32: bytes they produce in float32 after the rewrite.
      bytes_half: bytes they produce in half precision after the rewrite.
    """

    equations: int = 0
    half: int = 0
    casts: int = 0
    flops: int = 0
    half_flops: int = 0
    float8_flops: int = 0
    bytes_float32: int = 0
    bytes_half: int = 0

    @property
    def half_share(self) -> float:
        return self.half / self.equations if self.equations else 0.0

    @property
    def half_flops_share(self) -> float | None:
        """None when there are no matmul/conv FLOPs."""
        return shape_lib.ratio(self.half_flops, self.flops)

    def flops_split(self) -> tuple[int, int, int] | None:
        """Matmul/conv FLOPs in float8, in the half dtype (not float8) and in float32; None
        when there are none."""
        if not self.flops:
            return None
        half = self.half_flops - self.float8_flops
        return self.float8_flops, half, self.flops - self.half_flops

    def add(self, other: GroupStats) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def _stats(e: EquationReport, casts: int) -> GroupStats:
    eq = _is_equation(e)
    f32, half = produced_bytes(e)
    return GroupStats(
        equations=int(eq),
        half=int(eq and e.half),
        casts=casts,
        flops=e.flops,
        half_flops=e.flops if e.half else 0,
        float8_flops=e.flops if e.float8 else 0,
        bytes_float32=f32,
        bytes_half=half,
    )


@dataclasses.dataclass
class Group:
    """Equations sharing a scope, a source line or a primitive.

    Attributes:
      key: the scope (``""``: top level), ``file:line`` (``""``: unknown) or primitive.
      total: :class:`GroupStats` of the whole group.
      phases: ``{"forward"|"backward"|"optimizer": GroupStats}`` for the phases present.
      equations: the group's :class:`EquationReport`\\ s, in program order.
      sources: distinct source lines of the group, in program order.
      scopes: distinct scopes of the group, in program order.
    """

    key: str
    total: GroupStats = dataclasses.field(default_factory=GroupStats)
    phases: dict[str, GroupStats] = dataclasses.field(default_factory=dict)
    equations: list[EquationReport] = dataclasses.field(default_factory=list)
    sources: list[str] = dataclasses.field(default_factory=list)
    scopes: list[str] = dataclasses.field(default_factory=list)

    def _add(self, e: EquationReport, stats: GroupStats) -> None:
        self.total.add(stats)
        self.phases.setdefault(e.phase, GroupStats()).add(stats)
        self.equations.append(e)
        if e.source and e.source not in self.sources:
            self.sources.append(e.source)
        if e.scope not in self.scopes:
            self.scopes.append(e.scope)


def _fits_cast(e: EquationReport, to_half: bool) -> bool:
    """Whether ``e`` can be the consumer of a cast to half (``to_half``) or to float32."""
    if to_half:
        return e.half
    return not e.half or e.primitive in ("convert_element_type", *ACCUMULATING)


def cast_owners(report: ReportData) -> list[int | None]:
    """For each cast of ``report``, the index of the equation it feeds (None: an output).

    Casts name their consumer by path, which repeats (every top-level ``dot_general`` is
    ``dot_general``); they are matched in program order to an equation with that path (or
    inside that call) whose precision fits the cast's direction.
    """
    by_path: dict[str, list[int]] = collections.defaultdict(list)
    for i, e in enumerate(report.equations):
        by_path[e.path].append(i)
        parts = e.path.split("/")
        for k in range(1, len(parts)):
            by_path["/".join(parts[:k])].append(i)
    owners: list[int | None] = []
    pointer = 0
    for c in report.casts:
        candidates = sorted(by_path.get(c.where, ()))
        to_half = c.to_dtype == report.dtype
        good = [i for i in candidates if _fits_cast(report.equations[i], to_half)] or candidates
        after = [i for i in good if i >= pointer]
        owner = (after or good or [None])[0]
        owners.append(owner)
        pointer = owner if owner is not None else pointer
    return owners


def _key(e: EquationReport, by: str) -> str:
    return e.scope if by == "scope" else e.source if by == "line" else e.primitive


def groups(report: ReportData, by: str = "scope") -> list[Group]:
    """Groups the equations of ``report``; see :meth:`jmp_rewrite.Report.groups`."""
    if by not in BY:
        raise ValueError(f"by={by!r}: expected one of {', '.join(BY)}")
    out: dict[str, Group] = {}
    casts = collections.Counter(cast_owners(report))
    for i, e in enumerate(report.equations):
        key = _key(e, by)
        out.setdefault(key, Group(key))._add(e, _stats(e, casts.get(i, 0)))
    if casts.get(None):
        group = out.setdefault(_OUTPUTS, Group(_OUTPUTS))
        group.total.casts += casts[None]
    for g in out.values():
        g.phases = {p: g.phases[p] for p in si.PHASES if p in g.phases}
    return list(out.values())


def phase_totals(report: ReportData) -> dict[str, GroupStats]:
    """:class:`GroupStats` per phase of the whole program."""
    out: dict[str, GroupStats] = {}
    casts = collections.Counter(cast_owners(report))
    for i, e in enumerate(report.equations):
        out.setdefault(e.phase, GroupStats()).add(_stats(e, casts.get(i, 0)))
    return {p: out[p] for p in si.PHASES if p in out}


# --------------------------------------------------------------------------------------------
# Lint.


def _fmt_bytes(n: float) -> str:
    if not shape_lib.is_static(n):  # symbolic shapes: the expression
        return f"{n} B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""  # pragma: no cover


def _fmt_flops(n: float) -> str:
    if not shape_lib.is_static(n):
        return str(n)
    for unit in ("", "k", "M", "G", "T"):
        if n < 1000 or unit == "T":
            return f"{n:.0f}" if not unit else f"{n:.1f}{unit}"
        n /= 1000
    return ""  # pragma: no cover


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _label(key: str, by: str) -> str:
    if key == _OUTPUTS:
        return key
    if by == "scope":
        return key or "(top level)"
    if by == "line":
        path, _, line = key.rpartition(":")
        return f"{si.short_path(path)}:{line}" if key else "(no source line)"
    return key


def _short_sources(sources: list[str], limit: int = 2) -> str:
    shown = [_label(s, "line") for s in sources[:limit]]
    return ", ".join(shown) + (f" +{len(sources) - limit}" if len(sources) > limit else "")


def format_groups(report: ReportData, by: str = "scope", found: list[Any] = ()) -> str:
    """A text table of :func:`groups`, one row per group and phase, then the lint."""
    rows = [
        (by, "phase", "eqns", "half", "casts", "FLOPs", "half", "f32 out", "half out", "where"),
    ]
    for g in groups(report, by):
        label = _label(g.key, by)
        where = ", ".join(s or "(top level)" for s in g.scopes[:2]) if by == "line" else ""
        where = where or _short_sources(g.sources)
        phases = g.phases.items() if g.phases else [("", g.total)]
        for i, (phase, s) in enumerate(phases):
            rows.append(
                (
                    label if i == 0 else "",
                    phase,
                    str(s.equations),
                    _pct(s.half_share) if s.equations else "-",
                    str(s.casts),
                    _fmt_flops(s.flops) if s.flops else "-",
                    _pct(s.half_flops_share),
                    _fmt_bytes(s.bytes_float32),
                    _fmt_bytes(s.bytes_half),
                    where if i == 0 else "",
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = {2, 3, 4, 5, 6, 7, 8}
    lines = [
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]
    text = [report.summary(), "", *lines, "", f"lint ({_plural(len(found), 'finding')}):"]
    text += [textwrap.indent(str(f), "  ") for f in found]
    if not found:
        text.append("  nothing to change")
    return "\n".join(text)
