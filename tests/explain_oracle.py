"""Issue 29: an independent count of what ``explain`` reports about matmuls and convolutions.

``explain`` counts FLOPs per equation (``2 * prod(out.shape) * K`` for a ``dot_general``,
``2 * prod(out.shape) * C_in * window`` for a convolution), multiplies them by the product of
the enclosing ``scan`` lengths, and derives shares (half precision, float8, float32). This
module counts the same things another way, from the jaxpr alone:

* FLOPs from the operand shapes: ``2 * batch * M * N * K`` for a ``dot_general`` (M and N the
  free dimensions of each operand), ``2 * N * spatial_out * C_out * (C_in / groups) * window``
  for a convolution (read through its dimension numbers, output channels from the kernel);
  ``tests/test_explain_oracles.py`` checks this count against XLA's own
  (``jax.jit(f).lower(...).cost_analysis()``);
* trip counts by walking the jaxpr's bodies (written here, not with the painting graph):
  a ``scan`` body runs ``length`` times, nested scans multiply; a ``while`` body is counted
  once, as explain documents (its trip count is not static), and so does XLA, which counts
  every loop body once;
* shares from the equations' colours and float8 formats, the summary's percentages parsed
  from its text;
* fused attentions (``fuse_attention=True``, issue 36): each unit's bytes saved are shown on
  one row, its values matmul (a forward ``dot_general`` reading the logits-sized
  probabilities, not writing them), and lie between the bytes of its logits-sized
  intermediates and those of all its equations' outputs, each at the size the rewrite gives
  it (half: 2 bytes); the summary's count and total are those of the rows.

:func:`problems` lists every disagreement; the painting goldens run it on every painting of
the corpus (``tests/test_goldens.py``).
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np

MATMULS = ("dot_general", "conv_general_dilated")

#: Higher-order primitives whose bodies run as part of the program, and the params that hold
#: them (written here independently of ``jmp_rewrite._src.trace.higher_order``). Equations holding
#: other jaxprs (``custom_linear_solve``, a ``pallas_call``) are opaque to explain.
_BODIES = {
    "jit": ("jaxpr",),
    "pjit": ("jaxpr",),
    "closed_call": ("call_jaxpr",),
    "core_call": ("call_jaxpr",),
    "remat2": ("jaxpr",),
    "checkpoint": ("jaxpr",),
    "custom_jvp_call": ("call_jaxpr",),
    "custom_vjp_call": ("call_jaxpr",),
    "custom_vjp_call_jaxpr": ("fun_jaxpr",),
    "shard_map": ("jaxpr",),
    "cond": ("branches",),
    "while": ("cond_jaxpr", "body_jaxpr"),
    "scan": ("jaxpr",),
}


def _open(j: Any) -> Any:
    return j.jaxpr if hasattr(j, "jaxpr") and hasattr(j.jaxpr, "eqns") else j


def dot_flops(lhs: tuple[int, ...], rhs: tuple[int, ...], dims: Any) -> int:
    """``2 * batch * M * N * K`` of ``dot_general(lhs, rhs, dims)`` from the operand shapes."""
    (lc, rc), (lb, rb) = dims
    batch = math.prod(lhs[i] for i in lb)
    k = math.prod(lhs[i] for i in lc)
    assert k == math.prod(rhs[i] for i in rc), (lhs, rhs, dims)
    m = math.prod(d for i, d in enumerate(lhs) if i not in lc and i not in lb)
    n = math.prod(d for i, d in enumerate(rhs) if i not in rc and i not in rb)
    return 2 * batch * m * n * k


def conv_flops(eqn: Any) -> int:
    """``2 * N * C_out * C_in_per_group * taps`` of a convolution: each output
    element of each output channel sums ``C_in / groups`` products per kernel tap that reads
    an input element (XLA's count: taps on the padding or on the zeros an ``lhs_dilation``
    inserts are not multiplications), found by laying the window over a mask of the padded,
    dilated input."""
    p = eqn.params
    dn = p["dimension_numbers"]
    lhs, rhs = (tuple(a.aval.shape) for a in eqn.invars[:2])
    out = tuple(eqn.outvars[0].aval.shape)
    spatial = len(dn.rhs_spec) - 2
    lhs_dilation = p.get("lhs_dilation") or (1,) * spatial
    rhs_dilation = p.get("rhs_dilation") or (1,) * spatial
    taps = 1
    for j in range(spatial):
        size, k, n = lhs[dn.lhs_spec[2 + j]], rhs[dn.rhs_spec[2 + j]], out[dn.out_spec[2 + j]]
        low, high = p["padding"][j]
        padded = (size - 1) * lhs_dilation[j] + 1 + low + high
        mask = np.zeros(max(padded, 0), bool)
        at = low + lhs_dilation[j] * np.arange(size)
        mask[at[(at >= 0) & (at < padded)]] = True
        window = p["window_strides"][j] * np.arange(n)[:, None] + rhs_dilation[j] * np.arange(k)
        taps *= int(mask[window].sum())
    batch, c_out = out[dn.out_spec[0]], rhs[dn.rhs_spec[0]]
    assert c_out == out[dn.out_spec[1]], (out, rhs, dn)
    # taps: per spatial dimension, the (output position, kernel tap) pairs reading an input
    return 2 * batch * c_out * rhs[dn.rhs_spec[1]] * taps


def eqn_flops(eqn: Any) -> int:
    name = eqn.primitive.name
    if name == "dot_general":
        lhs, rhs = (tuple(a.aval.shape) for a in eqn.invars[:2])
        return dot_flops(lhs, rhs, eqn.params["dimension_numbers"])
    if name == "conv_general_dilated":
        return conv_flops(eqn)
    return 0


def matmuls(jaxpr: Any, trips: int = 1) -> Iterator[tuple[str, int, int]]:
    """``(primitive, FLOPs of one run, trips)`` of every matmul/conv of ``jaxpr`` and its
    bodies, in program order (a scan body's trips times its ``length``)."""
    for eqn in _open(jaxpr).eqns:
        name = eqn.primitive.name
        if name in MATMULS:
            yield name, eqn_flops(eqn), trips
        inner = trips * int(eqn.params["length"]) if name == "scan" else trips
        for param in _BODIES.get(name, ()):
            value = eqn.params[param]
            for body in value if isinstance(value, tuple | list) else (value,):
                yield from matmuls(body, inner)


_FLOAT8_LINE = re.compile(r"float8 / \w+ / float32: ([\d.]+)% / ([\d.]+)% / ([\d.]+)%")
_SHARE_LINE = re.compile(r"FLOPs in half precision: ([\d.]+)% of ([\d,]+)")


def problems(closed: Any, report: Any) -> list[str]:
    """Where ``report`` (explain's, for ``closed``) disagrees with the independent count."""
    out: list[str] = []
    counted = list(matmuls(closed))
    want = sorted((p, f * t, t) for p, f, t in counted)
    got = sorted(
        (e.primitive, e.flops, e.trips) for e in report.equations if e.primitive in MATMULS
    )
    if want != got:
        missing = collections.Counter(want) - collections.Counter(got)
        extra = collections.Counter(got) - collections.Counter(want)
        out.append(
            f"matmul FLOPs/trips: counted {sorted(missing.elements())[:4]} not in explain's "
            f"{sorted(extra.elements())[:4]}"
        )
    total = sum(f for _, f, _ in want)
    if report.matmul_flops != total:
        out.append(f"explain's matmul FLOPs {report.matmul_flops} != {total} counted")
    half = sum(e.flops for e in report.equations if e.colour == "allow")
    float8 = sum(e.flops for e in report.equations if e.float8)
    if any(e.float8 and e.colour != "allow" for e in report.equations):
        out.append("a float8 matmul is not painted half precision")
    if not report.changed and (half or float8):
        out.append("an unchanged program has matmuls in half precision")
    if total:
        expected = (half / total, float8 / total)
        got_shares = (report.half_flops_share, report.float8_flops_share)
        if any(abs(a - b) > 1e-12 for a, b in zip(expected, got_shares, strict=True)):
            out.append(f"shares (half, float8) {got_shares} != {expected} counted")
    summary = report.summary()
    m = _SHARE_LINE.search(summary)
    if total and report.changed:
        if m is None:
            out.append(f"no FLOPs line in the summary:\n{summary}")
        else:
            pct, count = float(m.group(1)), int(m.group(2).replace(",", ""))
            if count != total or abs(pct - 100 * half / total) > 0.051:
                out.append(
                    f"summary says {pct}% of {count}, counted {100 * half / total}% of {total}"
                )
    m = _FLOAT8_LINE.search(summary)
    if float8:
        if m is None:
            out.append(f"float8 FLOPs but no float8 line in the summary:\n{summary}")
        else:
            shares = [float(g) for g in m.groups()]
            counted = [
                100 * float8 / total,
                100 * (half - float8) / total,
                100 * (total - half) / total,
            ]
            if abs(sum(shares) - 100) > 0.15 or any(
                abs(a - b) > 0.051 for a, b in zip(shares, counted, strict=True)
            ):
                out.append(f"float8/half/float32 shares {shares} (counted {counted})")
    elif m is not None:
        out.append("a float8 line in the summary of a program without float8 FLOPs")
    out += _fused_attention_problems(report)
    for by in ("scope", "primitive"):
        groups = report.groups(by)
        if sum(g.total.flops for g in groups) != total:
            out.append(f"groups by {by}: FLOPs do not sum to the program's")
        for g in groups:
            split = g.total.flops_split()
            if split is not None and (sum(split) != g.total.flops or min(split) < 0):
                out.append(
                    f"group {g.key!r} by {by}: float8/half/float32 split {split} of {g.total.flops}"
                )
    return out


_FUSED_LINE = re.compile(r"fused attention: (\d+) \(([\d,]+) bytes")


def _itemsize(dtype: str) -> int:
    return int(np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype).itemsize)


def _float_bytes(e: Any) -> int:
    return sum(
        math.prod(shape) * _itemsize(dtype)
        for shape, dtype in zip(e.out_shapes, e.out_dtypes_after, strict=True)
        if dtype.startswith(("float", "bfloat"))
    )


def _fused_attention_problems(report: Any) -> list[str]:
    """Explain's bytes saved by each fused attention against a count of its rows."""
    out: list[str] = []
    units: dict[str, list[Any]] = collections.defaultdict(list)
    for e in report.equations:
        if e.attention:
            units[e.attention].append(e)
        elif e.attention_saved:
            out.append(f"{e.path}: bytes saved on a row of no fused attention")
    total = 0
    for name, rows in units.items():
        shown = [e for e in rows if e.attention_saved]
        if len(shown) != 1:
            out.append(f"{name}: bytes saved shown on {len(shown)} rows, not one")
            continue
        row, saved = shown[0], shown[0].attention_saved
        total += saved
        qk = next((e for e in rows if e.primitive == "dot_general"), None)
        logits = math.prod(qk.out_shapes[0]) if qk is not None else 0
        if (
            row.primitive != "dot_general"
            or row.phase != "forward"
            or row is qk
            or not any(math.prod(s) == logits for s in row.in_shapes)
        ):
            out.append(f"{name}: bytes saved shown on {row.path}, not its values matmul")
        everything = sum(_float_bytes(e) for e in rows if e is not row)
        big = sum(
            _float_bytes(e)
            for e in rows
            if e is not row and any(math.prod(s) == logits for s in e.out_shapes)
        )
        if not big <= saved <= everything:
            out.append(
                f"{name}: {saved} bytes saved, not between its logits-sized intermediates' "
                f"{big} and its equations' {everything} (at their painted sizes)"
            )
    m = _FUSED_LINE.search(report.summary())
    if units and (
        m is None or (int(m.group(1)), int(m.group(2).replace(",", ""))) != (len(units), total)
    ):
        out.append(f"summary's fused attention line, counted {len(units)} ({total} bytes)")
    return out
