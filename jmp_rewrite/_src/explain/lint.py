"""``lint()``: findings of an :func:`jmp_rewrite.explain` report -- what to change to run more
in half precision, or more safely (tensor-core shapes, deny chains, half carries, gradient
underflow, float8 shapes, attention left unfused, a rewrite off on this machine).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from jmp_rewrite._src.explain.report import EquationReport, ReportData
from jmp_rewrite._src.explain.view import (
    _LOSS_SCALE_SCOPE,
    TENSOR_CORE_MULTIPLE,
    _fmt_bytes,
    _plural,
    produced_bytes,
)
from jmp_rewrite._src.lists.op_lists import REASONS
from jmp_rewrite._src.trace import shapes as shape_lib
from jmp_rewrite._src.trace import source_info as si


@dataclasses.dataclass(frozen=True)
class Finding:
    """One lint finding of :func:`lint`.

    Attributes:
      kind: ``tensor_cores`` (a half matmul/conv dimension not a multiple of 8),
        ``deny_chain`` (one list change would run more equations in half precision),
        ``half_carry`` (a loop carry in half precision that adds to itself every iteration),
        ``gradient_underflow`` (float16 backward matmuls with no loss scaling) or
        ``float8_shape`` (under ``fp8=True``, a weight GEMM left bfloat16 only because of its
        shape), ``float8_none`` (under ``fp8=True``, no matmul runs in float8),
        ``attention_unfused`` (under ``fuse_attention=True``, an attention left as written,
        with the reason), ``attention_tpu_unfused`` (a fused attention that a TPU runs as
        written: JAX's TPU kernel cannot take it, the reason given) or ``off_here``
        (``dtype=None`` runs the function unchanged on this machine, while a TPU or CUDA
        lowering rewrites it: lint that program).
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
        + _off_here(report)  # an off report has no other finding
    )


def _off_here(report: ReportData) -> list[Finding]:
    """``dtype=None`` off on this machine: the lowerings that rewrite have their own lint."""
    half = [(p, d) for p, d in report.lowered if d != "none"]
    if not report.off_reason or not half:
        return []
    where = ", ".join(f"{p} runs {d}" for p, d in half)
    dtypes = " or ".join(f"dtype=jnp.{d}" for d in dict.fromkeys(d for _, d in half))
    return [
        Finding(
            kind="off_here",
            message=f"the rewrite is off on this machine's default device; lowered, {where}",
            scope="",
            source="",
            equations=(),
            change=f"explain(..., {dtypes}).lint() lints the program those lowerings run",
        )
    ]


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
