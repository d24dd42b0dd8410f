"""``explain``: what the rewrite did to a program, equation by equation.

TF offered a VLOG dump and ``paintbuckets_*.txt``; this is the readable version: for every
equation (sub-jaxprs included) the list it is on, the colour it was painted, the pass that
painted it, its dtypes before and after, the casts inserted and where, and totals (equations
converted, casts, the share of matmul/conv FLOPs in half precision, the bytes of values saved
for the backward pass).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.typing import DTypeLike

from jmp_rewrite._src import rewrite as rewrite_lib
from jmp_rewrite._src import settings as settings_lib
from jmp_rewrite._src.emit import attention as attention_emit
from jmp_rewrite._src.emit.emitter import Emitter, Hooks
from jmp_rewrite._src.emit.facts import dtypes_after, equation_facts
from jmp_rewrite._src.explain import html as explain_html
from jmp_rewrite._src.explain import lint as explain_lint
from jmp_rewrite._src.explain import view as explain_view
from jmp_rewrite._src.explain.html import HALF_COLOUR, LIST_COLOURS  # noqa: F401 - re-exported
from jmp_rewrite._src.explain.report import CastReport, EquationReport, ReportData
from jmp_rewrite._src.fp8 import Fp8Rules
from jmp_rewrite._src.lists.op_lists import OpLists
from jmp_rewrite._src.paint.additions import half_accumulating_carries
from jmp_rewrite._src.paint.passes import deny_releases
from jmp_rewrite._src.trace import shapes, source_info
from jmp_rewrite._src.trace.equations import is_float
from jmp_rewrite._src.trace.graph import Graph, Node
from jmp_rewrite._src.trace.graph_records import walk_scopes

_MATMUL_PRIMITIVES = ("dot_general", "conv_general_dilated", "ragged_dot_general")


@dataclasses.dataclass(frozen=True)
class Report(ReportData):
    """The result of :func:`explain`.

    Attributes:
      dtype: the half-precision dtype of the rewrite (``"none"`` when it is off).
      changed: False when the program has no allowlist op and is left unchanged, or the
        rewrite is off.
      equations: one :class:`EquationReport` per vertex, in program order (none when the
        rewrite is off).
      casts: the casts inserted (:class:`CastReport`), in program order.
      residual_bytes_float32: bytes of values saved for the backward pass by the original
        program (None when the function is not differentiable in its float inputs).
      residual_bytes_rewritten: the same for the rewritten program.
      explained: what was explained, when it is not simply the function given (e.g. the
        function inside ``jax.jit(rewrite(f))``, with that rewrite's dtype and lists).
      off_reason: why the rewrite is off on this machine's default device (``dtype=None``
        on a platform without fast half precision, as :func:`jmp_rewrite.rewrite` decides),
        else ``""``.
      fp8_none: under ``fp8=True``, why no matmul runs in float8 (what
        :class:`jmp_rewrite.Fp8NoneSelectedWarning` says), else ``""``.
      lowered: with ``dtype=None`` (decided where the program is lowered), the dtype each
        lowering platform runs, ``(("tpu", "bfloat16"), ("cuda", "float16"))`` (``"none"``:
        unchanged); every other platform runs the function unchanged. The report itself
        shows the program of this machine's default device. ``()`` when a dtype is given.
    """

    def groups(self, by: str = "scope") -> list[explain_view.Group]:
        """The equations grouped by where they come from, with totals per group and phase.

        Args:
          by: ``"scope"`` (model scope: Flax/Haiku module path, ``jax.named_scope``, or the
            attributes NNX/Equinox modules are called through), ``"line"`` (the user's
            source line) or ``"primitive"``.

        Returns:
          :class:`~jmp_rewrite._src.explain.view.Group`\\ s in program order, each with
          ``total`` and ``phases`` (forward/backward/optimizer) statistics: equations,
          share in half precision, casts, matmul/conv FLOPs in half, bytes produced in
          float32 and in half precision after the rewrite.

        Raises:
          ValueError: if ``by`` is not one of ``scope``, ``line``, ``primitive``.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> import jmp_rewrite
          >>> def f(w, x):
          ...   with jax.named_scope("dense"):
          ...     h = x @ w
          ...   return jnp.exp(h).sum()
          >>> r = jmp_rewrite.explain(f, jnp.ones((8, 8)), jnp.ones((2, 8)), dtype=jnp.float16)
          >>> [(g.key, g.total.equations, g.total.half) for g in r.groups("scope")]
          [('dense', 1, 1), ('', 2, 0)]
        """
        return explain_view.groups(self, by)

    def lint(self) -> list[explain_lint.Finding]:
        """What to change: loop carries in half precision that add to themselves (an
        accumulator the rewrite did not recognise as state), half-precision matmuls/convs
        with a contracting or output dimension that is not a multiple of 8 (tensor cores need
        them), and deny-list ops whose move to the infer list alone would run more equations
        in half precision, with the change and its risk.

        Returns:
          A list of findings (the *Finding* type of the API reference: ``kind``,
          ``message``, ``change``, ``risk``, ...): half carries first, then tensor-core
          findings (most FLOPs first), then deny chains (most bytes first). ``print`` shows
          one finding per line, with its change and risk below it.

        Example:
          >>> import jax.numpy as jnp
          >>> import jmp_rewrite
          >>> r = jmp_rewrite.explain(lambda w, x: (x @ w).sum(), jnp.ones((8, 100)),
          ...                         jnp.ones((4, 8)), dtype=jnp.float16)
          >>> [f.kind for f in r.lint()]
          ['tensor_cores']
          >>> print(r.lint())
          [tensor_cores] forward dot_general f16[4,8] x f16[8,100]... not a multiple of 8 ...
              change: pad or resize: output features 100 -> 104
        """
        return explain_lint.lint(self)

    def format(self, by: str = "scope") -> str:
        """The report as text: totals, one line per group and phase, then the lint.

        Args:
          by: ``"scope"``, ``"line"`` or ``"primitive"``, as in :meth:`groups`.

        Returns:
          A table with, per group and phase, the equations, the share in half precision,
          the casts, the matmul/conv FLOPs and their share in half precision, the bytes
          produced in float32 and in half precision and where the group comes from; then
          :meth:`lint`'s findings with the change to make.

        Raises:
          ValueError: if ``by`` is not one of ``scope``, ``line``, ``primitive``.

        Example:
          >>> import jax.numpy as jnp
          >>> import jmp_rewrite
          >>> r = jmp_rewrite.explain(lambda w, x: (x @ w).sum(), jnp.ones((8, 16)),
          ...                         jnp.ones((4, 8)), dtype=jnp.float16)
          >>> text = r.format("primitive")
          >>> next(row for row in text.splitlines() if row.startswith("dot_general")).split()[:4]
          ['dot_general', 'forward', '1', '100%']
        """
        return explain_view.format_groups(self, by, explain_lint.lint(self))

    def to_html(self) -> str:
        """The report as an HTML fragment (what a notebook displays).

        Returns:
          Self-contained HTML (its own scoped ``<style>``): the totals per phase, a legend
          of the lists and colours, the lint, and a collapsible tree by scope
          (``<details>``) with every equation, its list colour, its precision, the reason
          in words (the pass's name on hover) and its source line. Wrap it in
          ``<html><body>...</body></html>`` for a stand-alone page.

        Example:
          >>> import jax.numpy as jnp
          >>> import jmp_rewrite
          >>> r = jmp_rewrite.explain(lambda w, x: (x @ w).sum(), jnp.ones((8, 16)),
          ...                         jnp.ones((4, 8)), dtype=jnp.float16)
          >>> r.to_html().count('<tr class="eq"') == len(r.equations)
          True
        """
        return explain_html.to_html(self)

    def _repr_html_(self) -> str:
        return self.to_html()


def _short(dtype: Any) -> str:
    return str(dtype)


def _flops(eqn: Any) -> int:
    name = eqn.primitive.name
    if name not in _MATMUL_PRIMITIVES:
        return 0
    out = eqn.outvars[0].aval
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval
        dn = eqn.params["dimension_numbers"]  # specs: (batch/out feature, feature, spatial...)
        per_tap = out.shape[dn.out_spec[0]] * out.shape[dn.out_spec[1]] * rhs.shape[dn.rhs_spec[1]]
        return 2 * per_tap * _conv_taps(eqn)
    lhs = eqn.invars[0].aval
    (contract, _), _ = eqn.params["dimension_numbers"]
    return 2 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in contract)


def _conv_taps(eqn: Any) -> Any:
    """The (output position, kernel tap) pairs of a convolution whose tap reads an input
    element -- not the padding, nor a zero an ``lhs_dilation`` inserts (a strided
    convolution's input gradient) --, over all spatial positions: XLA's count. Counting every
    tap, the input gradient of a stride-2 convolution cost 4x its forward (a VALID 3x3 one's
    1.8x). Along a symbolic dimension every tap counts."""
    p = eqn.params
    lhs, rhs, out = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape, eqn.outvars[0].aval.shape
    dn = p["dimension_numbers"]
    pairs = 1
    for j in range(len(dn.rhs_spec) - 2):
        size, k, n = lhs[dn.lhs_spec[2 + j]], rhs[dn.rhs_spec[2 + j]], out[dn.out_spec[2 + j]]
        if not all(shapes.is_static(d) for d in (size, k, n)):
            pairs *= n * k
            continue
        stride, (low, _) = p["window_strides"][j], p["padding"][j]
        lhs_dilation = p["lhs_dilation"][j] if p.get("lhs_dilation") else 1
        rhs_dilation = p["rhs_dilation"][j] if p.get("rhs_dilation") else 1
        length = (size - 1) * lhs_dilation + 1  # the dilated input, before padding
        pairs *= sum(
            1
            for o in range(n)
            for t in range(k)
            if 0 <= (at := o * stride + t * rhs_dilation - low) < length and at % lhs_dilation == 0
        )
    return pairs


def _trip_counts(graph: Graph) -> dict[int, int]:
    """Node id -> product of enclosing scan lengths."""
    counts: dict[int, int] = {}

    def step(mult: int, eqn: Any, rec: Any) -> int:
        if rec.node is not None:
            counts[rec.node] = mult
        return mult * (rec.layout.length if rec.layout is not None else 1)

    walk_scopes(graph.top, 1, step)
    return counts


def _tensor_dims(eqn: Any) -> tuple[tuple[str, int], ...]:
    """The GEMM dimensions tensor cores want multiples of 8 (contracting and output)."""
    name = eqn.primitive.name
    rhs = eqn.invars[1].aval
    if name == "conv_general_dilated":
        spec = eqn.params["dimension_numbers"].rhs_spec  # (out feature, in feature, spatial...)
        grouped = eqn.params.get("feature_group_count", 1) > 1
        out = (("output channels", rhs.shape[spec[0]]),)
        return out if grouped else (("input channels", rhs.shape[spec[1]]), *out)
    if name != "dot_general":
        return ()
    lhs = eqn.invars[0].aval
    (lc, rc), (_, rb) = eqn.params["dimension_numbers"]
    free = [d for d in range(rhs.ndim) if d not in (*rc, *rb)]
    return (
        ("contracting", math.prod(lhs.shape[d] for d in lc)),
        ("output features", math.prod(rhs.shape[d] for d in free)),
    )


def _equation(
    graph: Graph,
    painting: Any,
    n: Node,
    half: str,
    trips: int,
    origin: Any = None,
    released: tuple[str, ...] = (),
    accumulates: tuple[Node, ...] = (),
) -> EquationReport:
    facts = equation_facts(graph, painting, n)
    if origin is not None:  # the model scope and source line (source_info)
        facts["scope"] = origin.scope
    d = dtypes_after(n, facts["colour"], half)
    eqn = n.eqn
    extra: dict[str, Any] = {}
    fp8 = painting.fp8
    if fp8 is not None and n.id in fp8.dots:  # the operands as the float8 GEMM takes them
        d["in_after"] = tuple(str(f) for f in fp8.dots[n.id].formats)

    if eqn is not None:
        extra = {
            "flops": _flops(eqn) * trips,
            "in_shapes": tuple(tuple(a.aval.shape) for a in eqn.invars if is_float(a.aval.dtype)),
            "out_shapes": tuple(tuple(v.aval.shape) for v in eqn.outvars),
            "tensor_dims": _tensor_dims(eqn) if eqn.primitive.name in _MATMUL_PRIMITIVES else (),
        }
    if fp8 is not None and n.id in fp8.left:
        extra["float8_left"] = fp8.left[n.id]
    chosen = painting.attention
    if chosen is not None and n.id in chosen.left:
        extra["attention_left"] = chosen.left[n.id]
    fused = chosen.of_node(n.id) if chosen is not None else None
    if fused is not None and n.id == fused.scope.eqns[fused.core.pv].node:
        extra["attention_saved"] = fused.saved_bytes
        extra["attention_tpu"] = fused.tpu
    if accumulates:  # a half carry adding to itself: named by its addition's line
        extra["accumulates_through"] = tuple(dict.fromkeys(a.key for a in accumulates))
    return EquationReport(
        **facts,
        in_dtypes=d["in"],
        in_dtypes_after=d["in_after"],
        out_dtypes=d["out"],
        out_dtypes_after=d["out_after"],
        source=origin.source if origin is not None else "",
        phase=origin.phase if origin is not None else "forward",
        trips=trips,
        released_by=released,
        **extra,
    )


class _CastLog(Hooks):
    """Hears of every cast the emitter inserts."""

    def __init__(self) -> None:
        self.casts: list[CastReport] = []

    def cast(self, where: str, what: str, src: Any, dst: Any) -> None:
        self.casts.append(CastReport(where, what, str(src), str(np.dtype(dst))))


def _residual_bytes(fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict) -> int | None:
    def residuals(*a: Any) -> Any:
        _, vjp_fn = jax.vjp(lambda *d: fun(*d, **kwargs), *a)
        return jax.tree.leaves(vjp_fn)

    try:
        leaves = jax.eval_shape(residuals, *args)
    except Exception:  # not differentiable (ints, a whole train step, ...): no figure
        return None
    return shapes.dim(sum(shapes.size(s.shape) * np.dtype(s.dtype).itemsize for s in leaves))


def explain(
    fun: Callable[..., Any],
    *args: Any,
    dtype: DTypeLike | None = None,
    lists: OpLists | None = None,
    level: str | None = None,
    infer_follows_allow: bool | None = None,
    residuals: bool = True,
    fp8: bool | Fp8Rules | None = None,
    fuse_attention: bool | None = None,
    **kwargs: Any,
) -> Report:
    """Explains what :func:`jmp_rewrite.rewrite` does to ``fun`` at these arguments.

    Nothing is executed: the function is traced (``args`` may be ``jax.ShapeDtypeStruct``),
    painted and re-emitted abstractly.

    ``fun`` may be the function itself or a rewritten one, ``rewrite(f)`` or a jit of it
    (``jax.jit``, ``nnx.jit``, ``eqx.filter_jit``): then ``f`` is explained with that
    rewrite's ``dtype``, lists, level and static arguments (arguments given here override
    them), and the report's first line says so. A rewritten function called *inside*
    ``fun`` (e.g. ``jax.grad(rewrite(f))``) shows as it runs, already rewritten; the report
    notes it.

    Args:
      fun: the function, as for :func:`jmp_rewrite.rewrite`, or a rewritten function.
      *args: example arguments (Flax NNX objects are traced on copies of their state and
        left as they are).
      dtype: ``jnp.float16`` or ``jnp.bfloat16``; None decides as :func:`jmp_rewrite.rewrite`
        does (the rewrite's own dtype, else the seed API's, else where the program is
        lowered: the report shows this machine's default device's program -- none on a
        CPU, where it says the rewrite is off here and why -- and ``Report.lowered``
        what a TPU or CUDA lowering runs; pass that dtype to see its painting).
      lists: a :class:`jmp_rewrite.OpLists` (default: TF's lists for ``dtype``).
      level: as in :func:`jmp_rewrite.rewrite`.
      infer_follows_allow: as in :func:`jmp_rewrite.rewrite` (default True).
      residuals: measure the bytes saved for the backward pass of ``fun`` (traces its VJP
        twice; a fused attention as the default backend runs it). Skipped anyway when
        ``fun`` already contains a backward pass (a train step), where the figure would
        describe differentiating the optimizer.
      fp8: as in :func:`jmp_rewrite.rewrite` (None: the rewrite's own, else off); float8
        matmuls show with their formats (``EquationReport.float8``) and the summary splits
        the FLOPs into float8 / bfloat16 / float32.
      fuse_attention: as in :func:`jmp_rewrite.rewrite` (None: the rewrite's own, else
        off); each fused attention's equations show it (``EquationReport.attention``), the
        summary counts them and the bytes they do not write, and ``lint()`` names each
        attention left as written and why.
      **kwargs: example keyword arguments.

    Returns:
      A :class:`Report`: ``print`` it for a table, display it in a notebook for a coloured
      program, or ``report.to_dict()`` for JSON.

    Raises:
      ValueError: if ``dtype`` is not float16, bfloat16 or None.

    Example:
      >>> import jax.numpy as jnp
      >>> import jmp_rewrite
      >>> r = jmp_rewrite.explain(lambda w, x: jnp.tanh(x @ w).sum(), jnp.ones((4, 4)),
      ...                         jnp.ones((2, 4)), dtype=jnp.float16)
      >>> len(r.converted), r.total, r.half_flops_share
      (2, 3, 1.0)
    """
    settings_lib.validate_fp8(dtype, fp8)
    settings_lib.validate_dtype(dtype)
    if fuse_attention is not None:
        settings_lib.validate_fuse_attention(fuse_attention)
    target, jits = rewrite_lib.find_rewritten(fun)
    explained, static = "", None
    if target is not None:
        fun, static = target.fun, target.static
        dtype = target.dtype if dtype is None else dtype
        lists = target.lists if lists is None else lists
        level = target.level if level is None else level
        if infer_follows_allow is None:
            infer_follows_allow = target.infer_follows_allow
        fp8 = target.fp8 if fp8 is None else fp8
        if fuse_attention is None:
            fuse_attention = target.fuse_attention
        dtype_words = "dtype=None" if target.dtype is None else f"dtype={target.dtype}"
        wrapper = f"rewrite({target._name}, {dtype_words})"
        wrapper = "jit(" * jits + wrapper + ")" * jits
        explained = f"{target._name}, the function inside {wrapper}, with its settings"
    follow = True if infer_follows_allow is None else infer_follows_allow
    settings = settings_lib.effective_settings(
        dtype, lists, level, follow, fp8 or False, bool(fuse_attention)
    )
    lowered = tuple((p, "none" if d is None else np.dtype(d).name) for p, d in settings.lowered)
    if settings.dtype is None:
        off = settings.off_reason
        return Report("none", False, (), (), None, None, explained, off, lowered=lowered)
    fn = rewrite_lib.rewritten_with(fun, settings, static)
    with rewrite_lib.recording_calls() as inner:
        entry, flat = fn.trace(*args, **kwargs)
    if inner:
        names = ", ".join(sorted({f"rewrite({r._name})" for r in inner}))
        note = (
            f"{names} inside it shows as already rewritten (its matmuls are not float32 "
            "here); explain the inner function, or the rewritten function itself, to see "
            "its painting"
        )
        explained = f"{explained}; {note}" if explained else note
    report = dataclasses.replace(report_of(entry, explained), lowered=lowered)
    # A program that already differentiates something (a train step): no residual figure.
    has_backward = any(e.phase == source_info.BACKWARD for e in report.equations)
    if not residuals or has_backward:
        return report
    before = _residual_bytes(fun, args, kwargs)
    with attention_emit.one_platform(jax.default_backend()):  # this platform's attention
        after = _residual_bytes(fn, args, kwargs) if before is not None else None
    return dataclasses.replace(
        report, residual_bytes_float32=before, residual_bytes_rewritten=after
    )


def report_of(
    entry: rewrite_lib.Rewritten, explained: str = "", emitter: type[Emitter] = Emitter
) -> Report:
    """The :class:`Report` of a traced, painted program (``rewrite``'s cache entry), without
    the residual figures: what :func:`explain` reports once it has traced the function.
    ``emitter``: the emitter class that re-emits it to hear its casts (the goldens' names
    the vertex of a cast in ``CastReport.where``)."""
    half = _short(entry.config.dtype)
    graph, painting = entry.graph, entry.painting
    trips = _trip_counts(graph)
    origins = source_info.origins(graph)
    released = deny_releases(graph, painting, entry.config.options)
    accumulating = half_accumulating_carries(graph, painting) if painting.changed else {}
    equations = []
    for n in graph.nodes:
        path = [graph.nodes[i] for i in accumulating.get(n.id, ())]
        combine = next((a.id for a in path if a.key in ("add", "sub", "add_any")), n.id)
        equations.append(
            _equation(
                graph,
                painting,
                n,
                half,
                trips.get(n.id, 1),
                origins.get(combine),
                released.get(n.id, ()),
                tuple(a for a in path if a.eqn is not None),
            )
        )
    log = _CastLog()
    if painting.changed:  # re-emitted abstractly: the hook hears every cast
        emitter(graph, painting, entry.config.dtype, entry.config.options, hooks=log).trace_program(
            entry.closed
        )
    return Report(
        dtype=half,
        changed=painting.changed,
        equations=tuple(equations),
        casts=tuple(log.casts),
        residual_bytes_float32=None,
        residual_bytes_rewritten=None,
        explained=explained,
        fp8_none=rewrite_lib.no_fp8_reason(painting, entry.config),
    )
