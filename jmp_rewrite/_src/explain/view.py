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
from jmp_rewrite._src.lists.op_lists import REASONS
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


@dataclasses.dataclass(frozen=True)
class Finding:
    """One lint finding of :func:`lint`.

    Attributes:
      kind: ``tensor_cores`` (a half matmul/conv dimension not a multiple of 8),
        ``deny_chain`` (one list change would run more equations in half precision),
        ``half_carry`` (a loop carry in half precision that adds to itself every iteration),
        ``gradient_underflow`` (float16 backward matmuls with no loss scaling) or
        ``float8_shape`` (under ``fp8=True``, a weight GEMM left bfloat16 only because of its
        shape), ``float8_none`` (under ``fp8=True``, no matmul runs in float8) or
        ``attention_unfused`` (under ``fuse_attention=True``, an attention left as written,
        with the reason) or ``attention_tpu_unfused`` (a fused attention that a TPU runs as
        written: JAX's TPU kernel cannot take it, the reason given).
      message: one line for a person.
      scope: the model scope of (the first of) the equations concerned.
      source: their user source line (``file:line``), or ``""``.
      equations: paths of the equations concerned.
      flops: their matmul/conv FLOPs (``tensor_cores``).
      bytes: float32 bytes that would become half precision (``deny_chain``).
      change: what to change.
      risk: what the change risks, or ``""``.
    """

    kind: str
    message: str
    scope: str
    source: str
    equations: tuple[str, ...]
    flops: int = 0
    bytes: int = 0
    change: str = ""
    risk: str = ""

    def __str__(self) -> str:
        """``[kind] message``, then the change and its risk on an indented second line."""
        line = f"[{self.kind}] {self.message}"
        if self.kind == "tensor_cores":
            line += " (tensor cores need multiples of 8 in half precision)"
        return f"{line}\n    change: {self.change}" + (f"; risk: {self.risk}" if self.risk else "")


class Findings(list):
    """:func:`lint`'s findings: a list of :class:`Finding`; ``print`` shows each as text."""

    def __str__(self) -> str:
        return "\n".join(map(str, self)) if self else "no findings: nothing to change"


def _shape(shape: tuple[int, ...], dtype: str) -> str:
    short = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}.get(dtype, dtype)
    return f"{short}[{','.join(map(str, shape))}]"


def _where(scope: str, source: str) -> str:
    where = f" at {si.short_path(source.rpartition(':')[0])}:{source.rpartition(':')[2]}"
    return (where if source else "") + (f" ({scope})" if scope else "")


def lint(report: ReportData) -> Findings:
    """Findings for ``report``; see :meth:`jmp_rewrite.Report.lint`."""
    findings: list[Finding] = []
    odd: dict[tuple[Any, ...], list[EquationReport]] = {}
    for e in report.equations:
        if not e.half or not e.tensor_dims:
            continue
        # A symbolic dimension (a batch, a sequence) may be any multiple: not flagged.
        bad = tuple(
            (n, d)
            for n, d in e.tensor_dims
            if shape_lib.multiple_of(d, TENSOR_CORE_MULTIPLE) is False
        )
        if bad:
            odd.setdefault((e.scope, e.source, e.primitive, e.phase, bad), []).append(e)
    for (scope, source, prim, phase, bad), eqs in odd.items():
        e = eqs[0]
        dims = ", ".join(f"{name} {d}" for name, d in bad)
        shapes = " x ".join(_shape(s, d) for s, d in zip(e.in_shapes, e.in_dtypes_after))
        count = f" ({len(eqs)} equations)" if len(eqs) > 1 else ""
        fix = " and ".join(
            f"{name} {d} -> {-(-d // TENSOR_CORE_MULTIPLE) * TENSOR_CORE_MULTIPLE}"
            for name, d in bad
        )
        findings.append(
            Finding(
                kind="tensor_cores",
                message=(
                    f"{phase} {prim} {shapes}{_where(scope, source)}{count}: {dims} not a "
                    f"multiple of {TENSOR_CORE_MULTIPLE}"
                ),
                scope=scope,
                source=source,
                equations=tuple(x.path for x in eqs),
                flops=sum(x.flops for x in eqs),
                change=f"pad or resize: {fix}",
            )
        )
    findings.sort(key=lambda f: shape_lib.descending(f.flops))
    released: dict[str, list[EquationReport]] = collections.defaultdict(list)
    for e in report.equations:
        for key in e.released_by:
            released[key].append(e)
    chains = []
    for key, eqs in released.items():
        seeds = [e for e in eqs if e.key == key] or eqs
        if len(seeds) == len(eqs):
            continue  # only the deny ops themselves: no chain kept float32 by them
        size = sum(produced_bytes(e)[0] for e in eqs)
        where = _where(seeds[0].scope, seeds[0].source)
        more = f" and {len(seeds) - 1} more places" if len(seeds) > 1 else ""
        risk = REASONS.get(key, "")
        if report.dtype == "float16":
            risk += "; float16 overflows above 65504 and loses precision in long sums"
        chains.append(
            Finding(
                kind="deny_chain",
                message=(
                    f"{key} (deny){where}{more} keeps {_plural(len(eqs), 'equation')} "
                    f"float32; on the infer list they would run in {report.dtype} "
                    f"({_fmt_bytes(size)} less float32 output)"
                ),
                scope=seeds[0].scope,
                source=seeds[0].source,
                equations=tuple(e.path for e in eqs),
                bytes=size,
                change=f'lists.move("{key}", to="infer")',
                risk=risk.strip("; "),
            )
        )
    chains.sort(key=lambda f: shape_lib.descending(f.bytes))
    return Findings(
        _gradient_underflow(report)
        + _half_carries(report)
        + findings
        + _float8_none(report)
        + _float8_shapes(report)
        + _unfused_attention(report)
        + chains
    )


def _float8_none(report: ReportData) -> list[Finding]:
    """Under ``fp8=True``: no matmul runs in float8 (``Fp8NoneSelectedWarning``'s reason)."""
    if not report.fp8_none:
        return []
    return [
        Finding(
            kind="float8_none",
            message=f"fp8=True runs no matmul in float8: {report.fp8_none}",
            scope="",
            source="",
            equations=tuple(e.path for e in report.equations if e.float8_left),
            change=(
                "name the matmuls in jmp_rewrite.Fp8Rules(include=...), lower min_dim, or "
                "set keep_first/keep_last=False; or drop fp8=True"
            ),
            risk="a small GEMM's quantization may cost more than float8 saves",
        )
    ]


def _unfused_attention(report: ReportData) -> list[Finding]:
    """Under ``fuse_attention=True``: each attention left as written, and why; each fused
    one that a TPU runs as written (its kernel cannot take it), and why."""
    kinds = [
        (
            "attention_unfused",
            "is not fused (its {} values matmul stays as written): ",
            "write it as softmax(scale * q k^T + bias, masked) v, or leave it as it is",
            "none: an attention left as written computes what it did",
        ),
        (
            "attention_tpu_unfused",
            "is fused on CUDA and elsewhere, but a TPU runs it as written (its {} values "
            "matmul as without fuse_attention): ",
            "none needed; the kernel takes causal and per-token masks, per-token or full-size "
            "biases, and keeps less from about 1024 tokens",
            "none: on a TPU it computes what the unfused rewrite computes",
        ),
    ]
    return [
        Finding(
            kind=kind,
            message=f"attention{_where(e.scope, e.source)} {what.format(e.phase)}{why}",
            scope=e.scope,
            source=e.source,
            equations=(e.path,),
            flops=e.flops,
            change=change,
            risk=risk,
        )
        for kind, what, change, risk in kinds
        for e in report.equations
        if (why := e.attention_left if kind == "attention_unfused" else e.attention_tpu)
    ]


def _float8_shapes(report: ReportData) -> list[Finding]:
    """Under ``fp8=True``: weight GEMMs left bfloat16 only because of their shape."""
    out = []
    for e in report.equations:
        if not e.float8_left.startswith("shape:"):
            continue
        out.append(
            Finding(
                kind="float8_shape",
                message=(
                    f"{e.phase} {e.primitive}{_where(e.scope, e.source)} stays "
                    f"{report.dtype} under fp8=True only because of its {e.float8_left}"
                ),
                scope=e.scope,
                source=e.source,
                equations=(e.path,),
                flops=e.flops,
                change=(
                    "resize it, or name it in jmp_rewrite.Fp8Rules(include=...) "
                    "(or lower min_dim) to run it in float8 anyway"
                ),
                risk="a small GEMM's quantization may cost more than float8 saves",
            )
        )
    return out


def _gradient_underflow(report: ReportData) -> list[Finding]:
    """A float16 backward pass whose matmuls run in half with no loss scaling in sight:
    their cotangent inputs are rounded to float16, and gradients below 6e-8 become zero
    (TF needs its loss-scale optimizer in float16 for the same reason)."""
    if report.dtype != "float16" or any(_LOSS_SCALE_SCOPE in e.scope for e in report.equations):
        return []
    eqs = [e for e in report.equations if e.phase == "backward" and e.half and e.flops]
    if not eqs:
        return []
    return [
        Finding(
            kind="gradient_underflow",
            message=(
                f"{_plural(len(eqs), 'backward matmul/conv')} run in float16 without loss "
                "scaling: gradients smaller than 6e-8 become zero and those below 6e-5 lose "
                "precision (jmp_rewrite.compare counts them as underflow)"
            ),
            scope=eqs[0].scope,
            source=eqs[0].source,
            equations=tuple(e.path for e in eqs),
            flops=sum(e.flops for e in eqs),
            change=(
                "scale the loss: tx = jmp_rewrite.loss_scale_optimizer(tx) and "
                "jmp_rewrite.value_and_grad(loss)(opt_state, ...)"
            ),
            risk="none: a step whose scaled gradients overflow is skipped",
        )
    ]


def _half_carries(report: ReportData) -> list[Finding]:
    """Loop carries in half precision whose next value adds to them (an accumulator the
    rewrite did not recognise as state: its update is not linear in it)."""
    out = []
    for e in report.equations:
        if not e.accumulates_through:
            continue
        through = ", ".join(e.accumulates_through)
        shapes = " x ".join(_shape(s, d) for s, d in zip(e.out_shapes, e.out_dtypes_after))
        out.append(
            Finding(
                kind="half_carry",
                message=(
                    f"loop carry {e.path}{' ' + shapes if shapes else ''}"
                    f"{_where(e.scope, e.source)} is carried in {report.dtype} and adds to "
                    f"itself ({through}): it is rounded to {report.dtype} at every iteration"
                ),
                scope=e.scope,
                source=e.source,
                equations=(e.path,),
                change=(
                    "if it is state (an accumulator, a solver's solution), update it linearly "
                    "(new = old + step, where(ok, new, old)), which the rewrite keeps float32, "
                    "or run the loop in a jmp_rewrite.float32_region"
                ),
                risk="a float32 carry is cast to half for each half-precision reader",
            )
        )
    return out


# --------------------------------------------------------------------------------------------
# Text.


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


def format_groups(report: ReportData, by: str = "scope") -> str:
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
    found = lint(report)
    text = [report.summary(), "", *lines, "", f"lint ({_plural(len(found), 'finding')}):"]
    text += [textwrap.indent(str(f), "  ") for f in found]
    if not found:
        text.append("  nothing to change")
    return "\n".join(text)
