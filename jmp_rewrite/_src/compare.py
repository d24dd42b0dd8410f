"""``compare``: the numerics debugger. Runs a program in float32 and rewritten, side by side.

The program is traced and painted exactly as :func:`jmp_rewrite.rewrite` would, then evaluated
twice on the same concrete inputs by an interpreter over the painting graph:

* once with an empty painting: the float32 reference, every equation in its original dtype;
* once with the real painting: each equation runs in half precision or float32 as the
  rewritten program runs it (the same casts, inserted by the same
  :class:`~jmp_rewrite._src.emit.Emitter` code).

Values inside ``jax.make_jaxpr``-traced bodies are tracers and cannot be looked at, so the
interpreter does not re-bind higher-order equations: call bodies (``jit``, ``closed_call``,
``checkpoint``, custom derivative wrappers, fused units such as ``jit:log_softmax``) are run
inline, a ``cond`` runs the branch its concrete index selects, and ``while``/``scan`` loops run
in Python (``scan``'s ``reverse`` honoured). Straight-line stretches of equations are compiled
as one ``jax.jit`` each that returns every intermediate value (compiling each equation on its
own would cost far more than running it), so values are rounded as XLA rounds them. Every
equation's float outputs are recorded per execution; the half run is compared with the
reference execution by execution and the results are aggregated per equation (largest error,
summed counts). Equations whose bodies the painter does not see through (``shard_map``, other
equations holding jaxprs) run whole, without detail inside.

Errors are *accumulated*: an equation's half-precision output is compared with the float32
output of the same equation in the float32 run, so an error made upstream shows downstream
too. That is why the suggestions (see :func:`compare`) blame only the equations where a
problem *starts*.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src import op_lists as op_lists_lib
from jmp_rewrite._src import rewrite as rewrite_lib
from jmp_rewrite._src.emit import ACCUMULATING, Emitter, bind, cast
from jmp_rewrite._src.graph import (
    CALL_BODIES,
    EqnRec,
    Graph,
    Node,
    ScopeRec,
    has_jaxpr_param,
    is_float,
)
from jmp_rewrite._src.paint import Painting
from jmp_rewrite._src.regions import FLOAT32_REGION_SCOPE, in_float32_region

#: Default tolerance on the relative error, per half-precision dtype: 20 (float16) or 13
#: (bfloat16) units of roundoff, room for a few roundings to accumulate.
DEFAULT_TOLERANCE = {"float16": 1e-2, "bfloat16": 5e-2}

#: Suggestion targets: a list change, or a float32 region (when lists cannot help).
TO_DENY = "deny"
TO_REGION = "float32_region"

_TINY = float(np.finfo(np.float32).tiny)
_MOVABLE = ("allow", "infer", "clear")


# -- public records ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EquationComparison:
    """How one equation's outputs differ between the float32 and the rewritten run.

    Attributes:
      path: location in the program, e.g. ``scan/body/reduce_sum`` (``<output 0>`` for the
        program's outputs).
      primitive: the primitive (``<carry>``, ``<cond-output>``, ``<xs>``, ``<ys>``,
        ``<const>`` for loop carries, ``cond`` outputs, ``scan`` streams and loop constants;
        ``jit:NAME`` for a fused unit).
      key: the list key (``reciprocal`` for ``integer_pow`` with ``y=-1``...).
      list: the list the key is on for this dtype (``unlisted`` if on none); inside a fused
        unit (``jit:log_softmax``...), the unit's list, which decides its colour.
      colour: ``allow`` (ran in half precision), ``deny`` or ``float32`` (for the program's
        outputs: their dtype).
      scope: the equation's name stack (``jax.named_scope`` / module names), or ``""``.
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

    path: str
    primitive: str
    key: str
    list: str
    colour: str
    scope: str
    rel_error: float
    norm_error: float
    overflow: int
    underflow: int
    nan: int
    max_abs_f32: float
    count: int
    size: int
    exceeds: bool

    @property
    def half(self) -> bool:
        """Whether the equation ran in half precision."""
        return self.colour == "allow"


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
            f"max relative error: {_fmt(self.max_rel_error)}; overflow: {self.overflow}, "
            f"underflow: {sum(e.underflow for e in self.equations)}, "
            f"NaN: {sum(e.nan for e in self.equations)}",
        ]
        first = self.first_exceeding
        lines.append(
            "first exceeding tolerance: "
            + (f"{first.path} ({first.key}, error {_fmt(first.rel_error)})" if first else "none")
        )
        if self.outputs:
            errs = ", ".join(_fmt(o.rel_error) for o in self.outputs[:8])
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
                    _fmt(e.rel_error),
                    _fmt(e.norm_error),
                    str(e.overflow),
                    str(e.underflow),
                    str(e.nan),
                    _fmt(e.max_abs_f32),
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


def _fmt(x: float) -> str:
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return "0" if x == 0 else f"{x:.2e}"


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def _record_dict(e: EquationComparison) -> dict[str, Any]:
    d = dataclasses.asdict(e)
    for k in ("rel_error", "norm_error", "max_abs_f32"):
        d[k] = _json_float(d[k])
    return d


# -- statistics ---------------------------------------------------------------------------------


@dataclasses.dataclass
class _Stats:
    """Aggregated differences of one node over its executions."""

    rel_error: float = 0.0
    norm_error: float = 0.0
    overflow: int = 0
    underflow: int = 0
    nan: int = 0
    max_abs: float = 0.0
    count: int = 0
    size: int = 0
    #: execution index (in the half run) of the first execution exceeding the tolerance,
    #: and of the first one overflowing or producing NaN.
    first_exceed: int | None = None
    first_bad: int | None = None

    def update(self, refs: list[np.ndarray], vals: list[Any], seq: int, tol: float) -> None:
        rel = norm = 0.0
        bad = False
        for r, h in zip(refs, vals, strict=True):
            r = np.asarray(r).astype(np.float64)
            h = np.asarray(h).astype(np.float64)
            if r.shape != h.shape:  # pragma: no cover - the rewrite keeps shapes
                continue
            r_fin, h_fin = np.isfinite(r), np.isfinite(h)
            overflow = int(np.count_nonzero(r_fin & np.isinf(h)))
            nan = int(np.count_nonzero(np.isnan(h) & ~np.isnan(r)))
            self.overflow += overflow
            self.nan += nan
            self.underflow += int(np.count_nonzero(r_fin & (r != 0) & (h == 0)))
            self.size += r.size
            both = r_fin & h_fin
            diff = np.where(both, np.abs(h - r), 0.0)
            r_abs = np.where(r_fin, np.abs(r), 0.0)
            scale = float(r_abs.max()) if r.size else 0.0
            self.max_abs = max(self.max_abs, scale)
            if overflow or nan or np.any(r_fin & ~h_fin):
                bad = bad or bool(overflow or nan)
                rel = norm = math.inf
                continue
            if r.size:
                rel = max(rel, float(diff.max()) / (scale + _TINY))
                norm = max(
                    norm, float(np.linalg.norm(diff)) / (float(np.linalg.norm(r_abs)) + _TINY)
                )
        self.count += 1
        self.rel_error = max(self.rel_error, rel)
        self.norm_error = max(self.norm_error, norm)
        if rel > tol and self.first_exceed is None:
            self.first_exceed = seq
        if bad and self.first_bad is None:
            self.first_bad = seq


# -- the eager interpreter -----------------------------------------------------------------------


_EMPTY = Painting(allow=set(), deny=set(), painted_by={}, changed=False)


class _Recorder(Emitter):
    """An :class:`Emitter` that evaluates eagerly and records every equation's float outputs.

    Leaf equations run through the Emitter's own code (same dtypes, same casts). Calls run
    their bodies inline, ``cond`` the selected branch, loops are unrolled in Python, so every
    value is concrete and can be recorded. In ``reference`` mode the outputs are stored; else
    they are compared with the stored reference as they are produced.
    """

    def __init__(
        self,
        graph: Graph,
        painting: Painting,
        dtype: Any,
        options: dict[str, Any],
        *,
        reference: dict[int, list[list[np.ndarray]]] | None,
        tolerance: float,
        loop_limits: dict[int, int] | None = None,
    ):
        super().__init__(graph, painting, dtype, options)
        self.is_reference = reference is None
        self.store: dict[int, list[list[np.ndarray]]] = collections.defaultdict(list)
        self.reference = reference or {}
        self.tolerance = tolerance
        self.stats: dict[int, _Stats] = {}
        self.runs: collections.Counter[int] = collections.Counter()
        #: while-loop iterations run, per loop (its EqnRec): bounds the half run's loops.
        self.iterations: collections.Counter[int] = collections.Counter()
        self.loop_limits = loop_limits
        self.notes: list[str] = []
        self.seq = 0
        self._tracing = 0
        #: While a straight-line segment is traced: the (node, values) recorded so far.
        self._pending: list[tuple[int, list[Any]]] | None = None
        self._plans: dict[int, list[Any]] = {}
        self._segments: dict[Any, Any] = {}
        self._segment_nodes: dict[tuple[int, int], list[int]] = {}

    @contextlib.contextmanager
    def _traced(self) -> Iterator[None]:
        """Delegates to the Emitter's tracing code (values are tracers: nothing recorded)."""
        self._tracing += 1
        try:
            yield
        finally:
            self._tracing -= 1

    # -- recording --------------------------------------------------------------------------

    def _record(self, node: int | None, values: Sequence[Any]) -> None:
        if node is None or self._tracing or not values:
            return
        if self._pending is not None:  # inside a traced segment: returned as outputs
            self._pending.append((node, list(values)))
            return
        k = self.runs[node]
        self.runs[node] += 1
        if self.is_reference:
            self.store[node].append([np.asarray(v) for v in values])
            return
        refs = self.reference.get(node, [])
        self.seq += 1
        if k < len(refs):
            stats = self.stats.setdefault(node, _Stats())
            stats.update(refs[k], list(values), self.seq, self.tolerance)

    def _record_nodes(self, nodes: Sequence[int | None], values: Sequence[Any]) -> None:
        for n, v in zip(nodes, values, strict=True):
            self._record(n, [v])

    # -- scopes: straight-line segments are jitted ----------------------------------------------

    def run(self, scope: ScopeRec, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        """Evaluates a scope on concrete values.

        Maximal runs of equations without control flow are traced and compiled as one
        ``jax.jit`` segment (recorded values returned as extra outputs): compiling every
        equation on its own would cost far more than running it. Control-flow equations run
        one at a time, eagerly. Inside a segment (or under the Emitter's own tracing), this
        is the Emitter's plain interpretation.
        """
        if self._tracing or self._pending is not None:
            return super().run(scope, consts, args)
        jaxpr = scope.jaxpr
        env: dict[Any, Any] = dict(
            zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *args], strict=True)
        )
        for step in self._plan(scope):
            if isinstance(step, int):
                eqn, rec = jaxpr.eqns[step], scope.eqns[step]
                self._where = self._path(scope, eqn, rec)
                _write(env, eqn.outvars, self._eqn(eqn, rec, _reader(self, env)))
                continue
            start, _end, in_vars, out_vars = step
            invals = [env[v] for v in in_vars]
            key = (id(scope), start)
            ckey = (key, tuple(_aval_key(v) for v in invals))
            fun = self._segments.get(ckey)
            if fun is None:
                lowered = jax.jit(self._segment_fun(scope, step, key)).lower(*invals)
                fun = self._segments[ckey] = _compile(lowered)
            outs, recorded = fun(*invals)
            _write(env, out_vars, outs)
            for node, values in zip(self._segment_nodes[key], recorded, strict=True):
                self._record(node, values)
        read = _reader(self, env)
        return [read(a) for a in jaxpr.outvars]

    def _segment_fun(self, scope: ScopeRec, step: tuple[Any, ...], key: tuple[int, int]):
        start, end, in_vars, out_vars = step
        jaxpr = scope.jaxpr

        def segment(*invals: Any) -> tuple[list[Any], list[list[Any]]]:
            env = dict(zip(in_vars, invals, strict=True))
            read = _reader(self, env)
            self._pending = []
            try:
                for i in range(start, end):
                    eqn, rec = jaxpr.eqns[i], scope.eqns[i]
                    self._where = self._path(scope, eqn, rec)
                    region = in_float32_region(jc.name_stack(eqn))
                    cm = jax.named_scope(FLOAT32_REGION_SCOPE) if region else _NULL
                    with cm:
                        _write(env, eqn.outvars, self._eqn(eqn, rec, read))
                pending = self._pending
            finally:
                self._pending = None
            self._segment_nodes[key] = [node for node, _ in pending]
            return [env[v] for v in out_vars], [values for _, values in pending]

        return segment

    def _plan(self, scope: ScopeRec) -> list[Any]:
        """The scope's equations as steps: an index (run alone, eagerly) or a segment
        ``(start, end, in_vars, out_vars)`` of consecutive flat equations."""
        plan = self._plans.get(id(scope))
        if plan is not None:
            return plan
        jaxpr = scope.jaxpr
        flat = [_flat(eqn, rec) for eqn, rec in zip(jaxpr.eqns, scope.eqns, strict=True)]
        plan = []
        i = 0
        while i < len(flat):
            if not flat[i]:
                plan.append(i)
                i += 1
                continue
            j = i
            while j < len(flat) and flat[j]:
                j += 1
            defined: set[Any] = set()
            in_vars: dict[Any, None] = {}  # ordered set
            for eqn in jaxpr.eqns[i:j]:
                for a in eqn.invars:
                    if not jc.is_literal(a) and a not in defined:
                        in_vars[a] = None
                defined.update(v for v in eqn.outvars if not jc.is_drop_var(v))
            later = {a for eqn in jaxpr.eqns[j:] for a in eqn.invars if not jc.is_literal(a)}
            later.update(a for a in jaxpr.outvars if not jc.is_literal(a))
            out_vars = [
                v
                for eqn in jaxpr.eqns[i:j]
                for v in eqn.outvars
                if not jc.is_drop_var(v) and v in later
            ]
            plan.append((i, j, list(in_vars), out_vars))
            i = j
        self._plans[id(scope)] = plan
        return plan

    # -- equations ----------------------------------------------------------------------------

    def _eqn(self, eqn: Any, rec: EqnRec, read: Any) -> list[Any]:
        outs = super()._eqn(eqn, rec, read)
        if rec.kind in ("leaf", "opaque", "unit"):
            floats = [o for o, v in zip(outs, eqn.outvars, strict=True) if is_float(v.aval.dtype)]
            if eqn.primitive.name in ACCUMULATING and self._is_half(rec.node):
                # a half sum accumulates in float32; its readers see it cast to half
                floats = [cast(f, self.half) for f in floats]
            self._record(rec.node, floats)
        return outs

    def _opaque(self, eqn: Any, read: Any) -> list[Any]:
        if not self.is_reference:
            return super()._opaque(eqn, read)
        # The float32 reference runs the equation as written (bodies not rewritten).
        return bind(eqn, [read(a) for a in eqn.invars], eqn.params)

    def _call(self, eqn: Any, rec: EqnRec, invals: list[Any]) -> list[Any]:
        name = eqn.primitive.name
        if self._tracing or name == "shard_map":
            if not self._tracing and not self.is_reference:
                self.notes.append(f"{self._where}: run whole, no per-equation detail inside")
            with self._traced():
                return super()._call(eqn, rec, invals)
        # Inline (in a segment: traced into it; else eagerly, segment by segment).
        body = eqn.params[CALL_BODIES.get(name, "jaxpr")]
        return self.run(rec.subs["body"], jc.consts_of(body), invals)

    def _cond(self, eqn: Any, rec: EqnRec, invals: list[Any]) -> list[Any]:
        if self._tracing or self._pending is not None:
            with self._traced():
                return super()._cond(eqn, rec, invals)
        branches = eqn.params["branches"]
        index = int(np.clip(int(np.asarray(invals[0])), 0, len(branches) - 1))
        branch = branches[index]
        outs = self.run(rec.subs["branches"][index], jc.consts_of(branch), invals[1:])
        dtypes = self._carry_dtypes(rec.carries, [v.aval for v in eqn.outvars])
        outs = [cast(o, d) for o, d in zip(outs, dtypes, strict=True)]
        self._record_nodes(rec.carries, outs)
        return outs

    def _loop_consts(self, rec: EqnRec, invals: list[Any], n: int) -> None:
        operands = list(getattr(rec, "operands", None) or [])
        if operands:
            self._record_nodes(operands[:n], invals[:n])

    def _while(self, eqn: Any, rec: EqnRec, invals: list[Any]) -> list[Any]:
        if self._tracing or self._pending is not None:
            with self._traced():
                return super()._while(eqn, rec, invals)
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        dtypes = self._carry_dtypes(rec.carries, [v.aval for v in eqn.invars[nc + nb :]])
        self._loop_consts(rec, invals, nc + nb)
        cconsts, bconsts = invals[:nc], invals[nc : nc + nb]
        carry = [cast(v, d) for v, d in zip(invals[nc + nb :], dtypes, strict=True)]
        self._record_nodes(rec.carries, carry)
        cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
        where = next(
            (self.graph.nodes[n].path for n in rec.carries if n is not None), "while"
        ).removesuffix("/carry")
        limit = None if self.loop_limits is None else 2 * self.loop_limits.get(id(rec), 0) + 100
        done = 0
        while bool(np.asarray(self.run(rec.subs["cond"], jc.consts_of(cj), cconsts + carry)[0])):
            if limit is not None and done >= limit:
                self.notes.append(
                    f"the while loop at {where} did not stop in the {self.half.name} run; "
                    f"stopped after {done} iterations"
                )
                break
            outs = self.run(rec.subs["body"], jc.consts_of(bj), bconsts + carry)
            carry = [cast(o, d) for o, d in zip(outs, dtypes, strict=True)]
            self._record_nodes(rec.carries, carry)
            done += 1
        self.iterations[id(rec)] += done
        return carry

    def _scan(self, eqn: Any, rec: EqnRec, invals: list[Any]) -> list[Any]:
        if self._tracing or self._pending is not None:
            with self._traced():
                return super()._scan(eqn, rec, invals)
        p = eqn.params
        nconst, ncarry, length = p["num_consts"], p["num_carry"], p["length"]
        body = p["jaxpr"]
        carry_dtypes = self._carry_dtypes(
            rec.carries, [v.aval for v in eqn.invars[nconst : nconst + ncarry]]
        )
        x_dtypes = self._carry_dtypes(rec.xs, [v.aval for v in eqn.invars[nconst + ncarry :]])
        y_avals = [v.aval for v in eqn.outvars[ncarry:]]
        y_dtypes = self._carry_dtypes(rec.ys, y_avals)
        self._loop_consts(rec, invals, nconst)
        consts = invals[:nconst]
        carry = [
            cast(v, d) for v, d in zip(invals[nconst : nconst + ncarry], carry_dtypes, strict=True)
        ]
        xs = [cast(v, d) for v, d in zip(invals[nconst + ncarry :], x_dtypes, strict=True)]
        self._record_nodes(rec.carries, carry)
        self._record_nodes(rec.xs, xs)
        ys: list[dict[int, Any]] = [{} for _ in y_avals]
        slices = [_unstack(x) for x in xs]  # one compiled split, not one slice per index
        order = range(length - 1, -1, -1) if p.get("reverse", False) else range(length)
        for i in order:
            x_i = [x[i] for x in slices]
            outs = self.run(rec.subs["body"], jc.consts_of(body), consts + carry + x_i)
            carry = [cast(o, d) for o, d in zip(outs[:ncarry], carry_dtypes, strict=True)]
            for slot, o, d in zip(ys, outs[ncarry:], y_dtypes, strict=True):
                slot[i] = cast(o, d)
            self._record_nodes(rec.carries, carry)
        stacked = [
            _stack([slot[i] for i in range(length)]) if length else jnp.zeros(aval.shape, d)
            for slot, aval, d in zip(ys, y_avals, y_dtypes, strict=True)
        ]
        self._record_nodes(rec.ys, stacked)
        return carry + stacked


_NULL = contextlib.nullcontext()

#: Segments are compiled once and run a few times, and return every intermediate value, which
#: makes them slow to compile (most equations become kernels of their own). XLA options that
#: compile them several times faster on CPU; results can differ from a default compilation in
#: the last bit of float32 (both runs of a comparison are compiled alike). Dropped one by one
#: where this XLA does not know them.
_FAST_COMPILE = {
    "xla_cpu_use_fusion_emitters": False,
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}
_compile_options: dict[str, Any] = dict(_FAST_COMPILE)


def _compile(lowered: Any) -> Any:
    while True:
        try:
            return lowered.compile(compiler_options=dict(_compile_options))
        except Exception as e:  # an option this XLA does not have: drop it, retry
            unknown = [k for k in _compile_options if k in str(e)]
            if not unknown or "compile option" not in str(e):
                raise
            del _compile_options[unknown[0]]


@jax.jit
def _unstack(x: Any) -> list[Any]:
    return [x[i] for i in range(x.shape[0])]


_stack = jax.jit(jnp.stack)


def _aval_key(x: Any) -> Any:
    t = jax.typeof(x)
    return (t.shape, str(t.dtype), t.weak_type)  # str: PRNG key dtypes are not NumPy's


_CONTROL_FLOW = ("cond", "while", "scan")


def _flat(eqn: Any, rec: EqnRec) -> bool:
    """Whether an equation runs without control flow (it can join a jitted segment)."""
    if rec.kind in _CONTROL_FLOW or eqn.primitive.name == "shard_map":
        return False
    if rec.kind in ("call", "unit"):
        body = rec.subs["body"]
        return all(_flat(e, r) for e, r in zip(body.jaxpr.eqns, body.eqns, strict=True))
    return True


def _write(env: dict[Any, Any], outvars: Sequence[Any], values: Sequence[Any]) -> None:
    for var, val in zip(outvars, values, strict=True):
        if not jc.is_drop_var(var):
            env[var] = val


def _reader(emitter: Emitter, env: dict[Any, Any]) -> Callable[..., Any]:
    """The Emitter's ``read``: a value, cast once per (value, dtype) when asked."""
    return emitter.reader(env)


# -- suggestions ------------------------------------------------------------------------------


def _has_float_output(n: Node) -> bool:
    return n.eqn is None or any(is_float(v.aval.dtype) for v in n.eqn.outvars)


def _origins(graph: Graph, stats: dict[int, _Stats], attr: str) -> list[tuple[int, int]]:
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


_TRANSFORM = re.compile(r"\b\w+\(")


def _user_scope(eqn: Any) -> str:
    """The user's name scopes of an equation: ``transpose(jvp(loss))`` -> ``loss``."""
    stack = jc.name_stack(eqn) if eqn is not None else ""
    if FLOAT32_REGION_SCOPE in stack:
        return ""
    return "/".join(p for p in _TRANSFORM.sub("", stack).replace(")", "").split("/") if p)


def _reason(st: _Stats, dtype: np.dtype, tol: float) -> str:
    if st.overflow:
        return (
            f"overflows in {dtype.name}: {st.overflow} finite float32 values became inf "
            f"(max |float32| {st.max_abs:.3g}; {dtype.name} max {float(jnp.finfo(dtype).max):.5g})"
        )
    if st.nan:
        return f"produces NaN in {dtype.name} ({st.nan} values not NaN in float32)"
    text = f"relative error {_fmt(st.rel_error)} exceeds the tolerance {tol:g}"
    if st.underflow:
        text += (
            f"; {st.underflow} non-zero values became zero (for gradients, loss scaling is "
            "the usual fix)"
        )
    return text


def _suggest(
    graph: Graph,
    painting: Painting,
    stats: dict[int, _Stats],
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
        scope = _user_scope(n.eqn)
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


# -- the entry point ------------------------------------------------------------------------------


def _check_args(flat: Sequence[Any]) -> None:
    for x in flat:
        if isinstance(x, jax.ShapeDtypeStruct):
            raise TypeError(
                "compare runs the program: pass concrete arrays, not jax.ShapeDtypeStruct "
                "(use jmp_rewrite.explain to inspect a program without running it)"
            )
        if isinstance(x, jax.core.Tracer):
            raise TypeError(
                "compare runs eagerly on concrete values and cannot be called inside a JAX "
                "transformation (jax.jit, jax.grad, jax.vmap...); call it outside"
            )


def _tolerance(tolerance: float | None, dtype: np.dtype) -> float:
    if tolerance is None:
        return DEFAULT_TOLERANCE[dtype.name]
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float | np.floating):
        raise TypeError(f"tolerance must be a number, got {type(tolerance).__name__}")
    if not (math.isfinite(tolerance) and tolerance > 0):
        raise ValueError(f"tolerance must be a positive finite number, got {tolerance!r}")
    return float(tolerance)


def _records(
    graph: Graph,
    painting: Painting,
    ref_runs: dict[int, int],
    half: _Recorder,
    tol: float,
) -> tuple[list[EquationComparison], int | None, list[str]]:
    records, notes = [], []
    first: tuple[int, int] | None = None
    for n in graph.nodes:
        runs_f32, runs_half = ref_runs.get(n.id, 0), half.runs.get(n.id, 0)
        if not _has_float_output(n) or not (runs_f32 or runs_half):
            continue
        if runs_f32 != runs_half:
            notes.append(
                f"{n.path} ran {runs_f32} times in float32 and {runs_half} times in "
                f"{half.half.name}: the control flow diverged; {min(runs_f32, runs_half)} "
                "executions compared"
            )
        st = half.stats.get(n.id, _Stats())
        if st.first_exceed is not None and (first is None or st.first_exceed < first[0]):
            first = (st.first_exceed, len(records))
        owner = graph.nodes[n.unit] if n.unit is not None else n
        records.append(
            _make_record(
                path=n.path,
                primitive=n.key
                if n.eqn is None or n.key.startswith("jit:")
                else n.eqn.primitive.name,
                key=n.key,
                listed=owner.listed_kind,
                colour=painting.colour(n.id) if painting.changed else "float32",
                scope=_user_scope(n.eqn),
                st=st,
                tol=tol,
            )
        )
    return records, None if first is None else first[1], notes


def _make_record(
    path: str,
    primitive: str,
    key: str,
    listed: str,
    colour: str,
    scope: str,
    st: _Stats,
    tol: float,
) -> EquationComparison:
    return EquationComparison(
        path=path,
        primitive=primitive,
        key=key,
        list=listed,
        colour=colour,
        scope=scope,
        rel_error=st.rel_error,
        norm_error=st.norm_error,
        overflow=st.overflow,
        underflow=st.underflow,
        nan=st.nan,
        max_abs_f32=st.max_abs,
        count=st.count,
        size=st.size,
        exceeds=st.rel_error > tol,
    )


def _output_records(
    closed: Any, ref_outs: list[Any], half_outs: list[Any], tol: float
) -> list[EquationComparison]:
    records = []
    for i, (v, r, h) in enumerate(
        zip(jc.open_jaxpr(closed).outvars, ref_outs, half_outs, strict=True)
    ):
        if not is_float(v.aval.dtype):
            continue
        st = _Stats()
        st.update([np.asarray(r)], [h], 0, tol)
        name = f"<output {i}>"
        dtype = str(np.dtype(v.aval.dtype))
        records.append(_make_record(name, "<output>", "<output>", "", dtype, "", st, tol))
    return records


def compare(
    fun: Callable[..., Any],
    *args: Any,
    dtype: Any = None,
    lists: op_lists_lib.OpLists | None = None,
    level: str | None = None,
    tolerance: float | None = None,
    infer_follows_allow: bool = True,
    **kwargs: Any,
) -> Comparison:
    """Runs ``fun`` in float32 and rewritten side by side, equation by equation.

    ``fun`` is traced and painted as :func:`jmp_rewrite.rewrite` would, then run twice,
    eagerly, on these concrete arguments: as written (the float32 reference) and with the
    rewrite's dtypes and casts. Each equation's float outputs are compared (loop bodies at
    every iteration; call bodies such as ``jit`` inline, with paths like ``scan/body/...``)
    and reported with their relative error, overflow, underflow and NaN counts. Errors
    accumulate: an equation's error includes what it inherits from its inputs.

    Suggestion rules (a problem *starts* at an equation when it shows there and in none of
    its inputs earlier; only such equations are blamed):

    1. an equation that ran in half precision, whose key is on the allow, infer or clear
       list, and that overflows (finite float32 values become inf) or produces NaN: move its
       key to deny;
    2. such an equation whose relative error exceeds ``tolerance``: move its key to deny
       (the reason mentions underflow when non-zero values became zero: for gradients, loss
       scaling is the usual fix);
    3. an equation inside a fused unit (``jit:log_softmax``...) is blamed on the unit's key;
    4. at level ``UNSAFE_FORCE_ALL`` the lists are ignored, so the suggestion is to wrap the
       code in :func:`jmp_rewrite.float32_region` instead (``to_list="float32_region"``);
       when the equation has a name scope, its reason also proposes that narrower fix;
    5. problems starting at equations that ran in float32, at loop carries / ``cond``
       outputs / ``scan`` streams, or at keys that no list holds (casts), are reported in
       :attr:`Comparison.notes`, not as suggestions.

    One suggestion per key, earliest problem first. :meth:`Comparison.apply` re-runs the
    comparison with suggestions applied; :meth:`Comparison.suggested_lists` gives the lists.

    Straight-line stretches of the program are compiled (one ``jax.jit`` per stretch, with
    every intermediate value as an output), so each equation's value is rounded as XLA
    rounds it in the rewritten program; control flow runs in Python on concrete values.
    ``shard_map`` bodies and other equations holding jaxprs the painter does not see into
    run whole (no detail inside). The float32 run is reused by :meth:`Comparison.apply`.

    Args:
      fun: the function, as for :func:`jmp_rewrite.rewrite`: a forward pass, a loss or a
        whole train step (a ``jax.jit``-decorated function is looked into as well).
      *args: concrete example arguments (arrays or pytrees of arrays).
      dtype: ``jnp.float16`` or ``jnp.bfloat16``; None picks by platform and falls back to
        float16 where the platform has no fast half precision (e.g. a CPU).
      lists: a :class:`jmp_rewrite.OpLists` (default: TF's lists for ``dtype``, with the
        ``JMP_REWRITE_*`` environment overrides).
      level: as in :func:`jmp_rewrite.rewrite`.
      tolerance: relative-error tolerance (default ``1e-2`` for float16, ``5e-2`` for
        bfloat16).
      infer_follows_allow: as in :func:`jmp_rewrite.rewrite`.
      **kwargs: keyword arguments for ``fun``.

    Returns:
      A :class:`Comparison`: ``print`` it for a table, or look at ``.equations``,
      ``.first_exceeding``, ``.suggestions``; ``.apply()`` tries the suggestions.

    Raises:
      TypeError: if ``fun`` is not callable, ``lists`` is not an OpLists, or an argument is
        abstract (``jax.ShapeDtypeStruct``) or a tracer (compare was called under ``jit``).
      ValueError: if ``dtype`` is not float16, bfloat16 or None, or ``tolerance`` is not a
        positive number.

    Example:
      >>> import jax.numpy as jnp
      >>> import jmp_rewrite
      >>> lists = jmp_rewrite.default_lists(jnp.float16).move("reduce_sum", "infer")
      >>> c = jmp_rewrite.compare(lambda w, x: jnp.sum((x @ w) * 1e3), jnp.ones((64, 64)),
      ...                         jnp.ones((4, 64)), dtype=jnp.float16, lists=lists)
      >>> c.first_exceeding.path, c.suggestions[0].to_list
      ('reduce_sum', 'deny')
    """
    if not callable(fun):
        raise TypeError(f"compare expects a callable, got {type(fun).__name__}: {fun!r}")
    dt = rewrite_lib.validate_dtype(dtype)
    if dt is None:
        dt = rewrite_lib.platform_dtype() or np.dtype(jnp.float16)
    tol = _tolerance(tolerance, dt)
    _check_args(jax.tree.leaves((args, kwargs)))
    return _compare(fun, args, kwargs, dt, lists, level, tol, infer_follows_allow, None)


@dataclasses.dataclass
class _Reference:
    """A float32 run, reusable by :meth:`Comparison.apply` while the graph is the same."""

    signature: tuple[Any, ...]
    store: dict[int, list[list[np.ndarray]]]
    runs: dict[int, int]
    iterations: dict[int, int]
    outs: list[Any]


def _signature(graph: Graph) -> tuple[Any, ...]:
    return tuple((n.path, n.key, n.unit, tuple(n.fanin)) for n in graph.nodes)


def _compare(
    fun: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dt: np.dtype,
    lists: op_lists_lib.OpLists | None,
    level: str | None,
    tol: float,
    infer_follows_allow: bool,
    previous: _Reference | None,
) -> Comparison:
    fn = rewrite_lib.rewrite(
        fun, dtype=dt, lists=lists, level=level, infer_follows_allow=infer_follows_allow
    )
    entry, flat = fn.trace(*args, **kwargs)
    graph, config = entry.graph, entry.config
    painting = entry.painting if entry.painting.changed else _EMPTY
    consts = jc.consts_of(entry.closed)

    signature = _signature(graph)
    if previous is not None and previous.signature == signature:
        reference = previous  # same program, same inputs: the float32 run is the same
    else:
        ref = _Recorder(graph, _EMPTY, dt, config.options, reference=None, tolerance=tol)
        outs = ref.run(graph.top, consts, flat)
        reference = _Reference(signature, ref.store, dict(ref.runs), dict(ref.iterations), outs)
    half = _Recorder(
        graph,
        painting,
        dt,
        config.options,
        reference=reference.store,
        tolerance=tol,
        loop_limits=reference.iterations,
    )
    # The rewrite casts outputs back to their dtypes; exact, so compared without the cast.
    half_outs = half.run(graph.top, consts, flat)

    records, first, notes = _records(graph, painting, reference.runs, half, tol)
    suggestions, more_notes = _suggest(graph, painting, half.stats, dt, tol, config.force_all)

    def rerun(new_lists: op_lists_lib.OpLists) -> Comparison:
        return _compare(
            fun, args, kwargs, dt, new_lists, level, tol, infer_follows_allow, reference
        )

    return Comparison(
        dtype=dt.name,
        tolerance=tol,
        changed=bool(entry.painting.changed),
        lists=config.lists,
        equations=tuple(records),
        outputs=tuple(_output_records(entry.closed, reference.outs, half_outs, tol)),
        suggestions=tuple(suggestions),
        notes=tuple(dict.fromkeys(half.notes + notes + more_notes)),
        first_index=first,
        _rerun=rerun,
    )
