"""The eager side of ``compare``: the emitter's loop run on concrete values, recorded.

:class:`Recorder` is the :class:`~jmp_rewrite._src.emit.emitter.Emitter`'s control and hooks at
once: the emitter's one interpreter loop reads operands, inserts casts and runs leaf equations as
the rewrite does; the recorder decides how higher-order equations execute (call bodies
inline, a ``cond``'s selected branch, loops unrolled in Python, so every value is concrete)
and records every painted vertex's float outputs. Straight-line stretches are compiled as one
``jax.jit`` each returning every intermediate value (compiling each equation alone would cost
far more than running it). In reference mode the outputs are stored; else they are compared
with the stored reference as they are produced.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src.emit.emitter import Emitter, Hooks, Staged, cast
from jmp_rewrite._src.paint.painting import Painting
from jmp_rewrite._src.trace import higher_order as ho
from jmp_rewrite._src.trace.graph import EqnRec, Graph, ScopeRec

_TINY = float(np.finfo(np.float32).tiny)

#: The float32 reference: nothing painted.
EMPTY = Painting(allow=set(), deny=set(), painted_by={}, changed=False)


@dataclasses.dataclass
class Stats:
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


class Recorder(Staged, Hooks):
    """Eager control and recording hooks for one run of ``compare`` (see the module doc).

    Args:
      reference: the float32 run's stored values (None: this is that run, store them).
      tolerance: the relative-error tolerance of the comparison.
      loop_limits: while-loop iterations of the reference run, by the loop's equation index
        (:attr:`EqnRec.index`, stable when the same program is painted with other lists):
        bounds the half run's loops.
    """

    def __init__(
        self,
        *,
        reference: dict[int, list[list[np.ndarray]]] | None,
        tolerance: float,
        loop_limits: dict[int, int] | None = None,
    ):
        self.is_reference = reference is None
        self.store: dict[int, list[list[np.ndarray]]] = collections.defaultdict(list)
        self.reference = reference or {}
        self.tolerance = tolerance
        self.stats: dict[int, Stats] = {}
        self.runs: collections.Counter[int] = collections.Counter()
        self.iterations: collections.Counter[int] = collections.Counter()
        self.loop_limits = loop_limits
        self.notes: list[str] = []
        self.seq = 0
        #: While a straight-line segment is traced: the (node, values) recorded so far.
        self.pending: list[tuple[int, list[Any]]] | None = None
        self._plans: dict[Any, list[Any]] = {}
        self._segments: dict[Any, Any] = {}
        #: per segment: the nodes it records, and the outputs whose flags (``masking``) it
        #: hands out (known once it is traced)
        self._segment_outs: dict[Any, tuple[list[int], list[int]]] = {}

    def emitter(self, graph: Graph, painting: Painting, dtype: Any, options: dict) -> Emitter:
        return Emitter(graph, painting, dtype, options, hooks=self, control=self)

    # -- hooks: recording ------------------------------------------------------------------

    def value(self, em: Emitter, eqn: Any, rec: EqnRec, outs: list[Any]) -> None:
        if em.depth == 0:
            self.record(rec.node, em.as_read(eqn, rec, outs))

    def record(self, node: int | None, values: Sequence[Any]) -> None:
        if node is None or not values:
            return
        if self.pending is not None:  # inside a traced segment: returned as outputs
            self.pending.append((node, list(values)))
            return
        k = self.runs[node]
        self.runs[node] += 1
        if self.is_reference:
            self.store[node].append([np.asarray(v) for v in values])
            return
        refs = self.reference.get(node, [])
        self.seq += 1
        if k < len(refs):
            self.stats.setdefault(node, Stats()).update(
                refs[k], list(values), self.seq, self.tolerance
            )

    def record_nodes(self, nodes: Sequence[int | None], values: Sequence[Any]) -> None:
        for n, v in zip(nodes, values, strict=True):
            self.record(n, [v])

    # -- control: scopes as compiled straight-line segments -------------------------------

    def execute(self, em: Emitter, scope: ScopeRec, env: dict[Any, Any], read: Any) -> None:
        if self.pending is not None:  # already inside a segment being traced
            return super().execute(em, scope, env, read)
        for step in self._plan(scope, em):
            if isinstance(step, int):
                em.execute(scope, env, read, step, step + 1)
                continue
            start, _end, in_vars, out_vars = step
            invals = [env[v] for v in in_vars]
            # big values' flags (``masking``) cross the segment's boundary with them, so the
            # comparison pins and overflows where the rewrite does
            known = tuple(k for k, v in enumerate(invals) if em.flags.known(v))
            in_flags = [em.flags.of(invals[k]) for k in known]
            key = (id(scope), start, known)
            args = [*invals, *in_flags]
            ckey = (key, tuple(jc.abstract_key(jax.typeof(v)) for v in args))
            fun = self._segments.get(ckey)
            if fun is None:
                lowered = jax.jit(self._segment_fun(em, scope, step, key, known)).lower(*args)
                fun = self._segments[ckey] = _compile(lowered)
            outs, out_flags, recorded = fun(*args)
            _write(env, out_vars, outs)
            nodes, flagged = self._segment_outs[key]
            for k, flag in zip(flagged, out_flags, strict=True):
                em.flags.adopt(outs[k], flag)
            for node, values in zip(nodes, recorded, strict=True):
                self.record(node, values)

    def _segment_fun(
        self, em: Emitter, scope: ScopeRec, step: tuple[Any, ...], key: Any, known: tuple[int, ...]
    ):
        start, end, in_vars, out_vars = step

        def segment(*args: Any) -> tuple[list[Any], list[Any], list[list[Any]]]:
            invals = args[: len(in_vars)]
            env = dict(zip(in_vars, invals, strict=True))
            self.pending = []
            try:
                with em.own_flags():  # a segment is a trace of its own
                    for k, flag in zip(known, args[len(in_vars) :], strict=True):
                        em.flags.adopt(invals[k], flag)
                    em.execute(scope, env, em.reader(env), start, end)
                    outs = [env[v] for v in out_vars]
                    flagged = [k for k, v in enumerate(outs) if em.flags.known(v)]
                    out_flags = [
                        jnp.broadcast_to(em.flags.of(outs[k]), jnp.shape(outs[k])) for k in flagged
                    ]
                pending = self.pending
            finally:
                self.pending = None
            self._segment_outs[key] = ([node for node, _ in pending], flagged)
            return outs, out_flags, [values for _, values in pending]

        return segment

    def _plan(self, scope: ScopeRec, em: Emitter) -> list[Any]:
        """The scope's equations as steps: an index (run alone, eagerly) or a segment
        ``(start, end, in_vars, out_vars)`` of consecutive flat equations."""
        key = (id(scope), em.fusion is not None)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        jaxpr = scope.jaxpr
        # What each equation reads and writes as it runs (a fused attention's differ).
        io = [
            em.fusion.io(scope, k, e) if em.fusion is not None else (e.invars, e.outvars)
            for k, e in enumerate(jaxpr.eqns)
        ]
        flat = [_flat(rec) for rec in scope.eqns]
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
            for reads, writes in io[i:j]:
                for a in reads:
                    if not jc.is_literal(a) and a not in defined:
                        in_vars[a] = None
                defined.update(v for v in writes if not jc.is_drop_var(v))
            later = {a for reads, _ in io[j:] for a in reads if not jc.is_literal(a)}
            later.update(a for a in jaxpr.outvars if not jc.is_literal(a))
            out_vars = [
                v for _, writes in io[i:j] for v in writes if not jc.is_drop_var(v) and v in later
            ]
            plan.append((i, j, list(in_vars), out_vars))
            i = j
        self._plans[key] = plan
        return plan

    # -- control: higher-order equations -----------------------------------------------------

    def call(self, em: Emitter, eqn: Any, rec: EqnRec, invals: list[Any]) -> list[Any]:
        """Inline (in a segment: traced into it; else eagerly, segment by segment)."""
        return em.run(rec.subs["body"], jc.consts_of(rec.layout.body()), invals)

    unit = custom_jvp = custom_vjp = call

    def shard_map(self, em: Emitter, eqn: Any, rec: EqnRec, invals: list[Any]) -> list[Any]:
        if not self.is_reference:
            self.notes.append(f"{em.where}: run whole, no per-equation detail inside")
        return super().shard_map(em, eqn, rec, invals)

    def cond(self, em: Emitter, eqn: Any, rec: EqnRec, invals: list[Any]) -> list[Any]:
        if self.pending is not None:
            return _staged(super().cond, em, eqn, rec, invals)
        branches = rec.layout.body("cases")
        ops = rec.layout.split(invals)
        index = int(np.clip(int(np.asarray(ops["index"][0])), 0, len(branches) - 1))
        flagged = em.big_outputs(rec)
        outs = em.run(
            rec.subs["cases"][index], jc.consts_of(branches[index]), ops["args"], None, flagged
        )
        dtypes = em.carry_dtypes(rec.carries, [v.aval for v in eqn.outvars])
        n = len(eqn.outvars)
        outs = [cast(o, d) for o, d in zip(outs[:n], dtypes, strict=True)] + outs[n:]
        outs = em.adopt_flags(outs, flagged)
        self.record_nodes(rec.carries, outs)
        return outs

    def while_loop(self, em: Emitter, eqn: Any, rec: EqnRec, invals: list[Any]) -> list[Any]:
        if self.pending is not None:
            return _staged(super().while_loop, em, eqn, rec, invals)
        layout = rec.layout
        ops = layout.split(invals)
        n_consts = layout.size("cond_consts") + layout.size("body_consts")
        self.record_nodes(rec.operands[:n_consts], invals[:n_consts])
        carry = ops["carry"]  # already in the carries' dtypes
        dtypes = [jnp.result_type(v) for v in carry]
        self.record_nodes(rec.carries, carry)
        cj, bj = layout.body("cond"), layout.body("body")
        where = next(
            (em.graph.nodes[n].path for n in rec.carries if n is not None), "while"
        ).removesuffix("/carry")
        limit = None
        if self.loop_limits is not None:
            limit = 2 * self.loop_limits.get(rec.index, 0) + 100
        done = 0
        while bool(
            np.asarray(em.run(rec.subs["cond"], jc.consts_of(cj), ops["cond_consts"] + carry)[0])
        ):
            if limit is not None and done >= limit:
                self.notes.append(
                    f"the while loop at {where} did not stop in the {em.half.name} run; "
                    f"stopped after {done} iterations"
                )
                break
            outs = em.run(rec.subs["body"], jc.consts_of(bj), ops["body_consts"] + carry)
            carry = [cast(o, d) for o, d in zip(outs, dtypes, strict=True)]
            self.record_nodes(rec.carries, carry)
            done += 1
        self.iterations[rec.index] += done
        return carry

    def scan(self, em: Emitter, eqn: Any, rec: EqnRec, invals: list[Any]) -> list[Any]:
        if self.pending is not None:
            return _staged(super().scan, em, eqn, rec, invals)
        layout = rec.layout
        ops = layout.split(invals)  # consts, carries and xs in their nodes' dtypes
        ncarry, length = layout.size("carry"), layout.length
        y_avals = [v.aval for v in eqn.outvars[ncarry:]]
        y_dtypes = em.carry_dtypes(rec.ys, y_avals)
        self.record_nodes(rec.operands[: layout.size("consts")], ops["consts"])
        carry, xs = ops["carry"], ops["xs"]
        carry_dtypes = [jnp.result_type(v) for v in carry]
        self.record_nodes(rec.carries, carry)
        self.record_nodes(rec.xs, xs)
        ys: list[dict[int, Any]] = [{} for _ in y_avals]
        slices = [_unstack(x) for x in xs]  # one compiled split, not one slice per index
        consts = jc.consts_of(layout.body())
        for i in range(length - 1, -1, -1) if layout.reverse else range(length):
            outs = em.run(rec.subs["body"], consts, ops["consts"] + carry + [x[i] for x in slices])
            carry = [cast(o, d) for o, d in zip(outs[:ncarry], carry_dtypes, strict=True)]
            for slot, o, d in zip(ys, outs[ncarry:], y_dtypes, strict=True):
                slot[i] = cast(o, d)
            self.record_nodes(rec.carries, carry)
        stacked = [
            _stack([slot[i] for i in range(length)]) if length else jnp.zeros(aval.shape, d)
            for slot, aval, d in zip(ys, y_avals, y_dtypes, strict=True)
        ]
        self.record_nodes(rec.ys, stacked)
        return carry + stacked


def _staged(method: Any, em: Emitter, eqn: Any, rec: EqnRec, invals: list[Any]) -> list[Any]:
    """Control flow inside a segment being traced: staged, nothing recorded inside."""
    with em.staging():
        return method(em, eqn, rec, invals)


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

_CONTROL_FLOW = (ho.COND, ho.WHILE, ho.SCAN, ho.SHARD_MAP)


def _flat(rec: EqnRec) -> bool:
    """Whether an equation runs without control flow (it can join a jitted segment)."""
    if rec.kind in _CONTROL_FLOW:
        return False
    if rec.layout is not None:  # calls and units: flat when their bodies are
        return all(_flat(r) for r in rec.subs["body"].eqns)
    return True


def _write(env: dict[Any, Any], outvars: Sequence[Any], values: Sequence[Any]) -> None:
    for var, val in zip(outvars, values, strict=True):
        if not jc.is_drop_var(var):
            env[var] = val
