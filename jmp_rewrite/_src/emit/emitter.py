"""Re-emitting a painted jaxpr: TF's ``ChangeTypeAttrsAndAddCasts``, by re-interpretation.

The program is evaluated equation by equation under whatever trace is current (so the result
composes with ``jit``/``grad``/``vmap`` around it). A half-precision equation gets its float32
inputs cast to half; any other equation gets half inputs cast back to their original dtype.
Casts are made lazily and cached per (value, dtype), so each value is cast at most once per
dtype, on the consumer side; float32 literals are converted in place (no cast equation).

Higher-order equations are re-bound with rewritten bodies: call bodies and control-flow
bodies take the dtypes their operands now have; loop carries, ``cond`` outputs and ``scan``
streams take the dtype of their structural node, so carries stay type-consistent. Custom
derivative wrappers are re-wrapped with ``jax.custom_jvp``/``jax.custom_vjp`` whose rules call
the *original* rule in float32, so ``jax.nn.relu``'s gradient at 0 or a user's backward pass
keep being used. Equations holding other jaxprs (``custom_linear_solve``'s ``matvec`` and
``solve`` bodies, held in a named tuple) keep their signature and are rewritten inside as
separate programs; kernels (bodies over Refs: Pallas, ``run_state``) run as written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src import fp8 as fp8_lib
from jmp_rewrite._src.emit.attention import Fusion
from jmp_rewrite._src.emit.clamping import _fits, clamp, literal
from jmp_rewrite._src.emit.custom_rules import cast, rewrap
from jmp_rewrite._src.emit.masking import Flags
from jmp_rewrite._src.emit.tangents import (
    Unsaturated,
    float32_tangents,
    reads_magnitude,
    transpose_accumulates,
)
from jmp_rewrite._src.paint.painting import Painting
from jmp_rewrite._src.paint.passes import paint
from jmp_rewrite._src.trace import higher_order as ho
from jmp_rewrite._src.trace.equations import (
    SCATTER_REBUILDERS,
    is_f32,
    is_float,
    rebuild_scatter,
    sealed,
)
from jmp_rewrite._src.trace.graph import EqnRec, Graph, ScopeRec
from jmp_rewrite._src.trace.graph_records import sums_over_trips
from jmp_rewrite._src.trace.higher_order import bind
from jmp_rewrite._src.trace.regions import FLOAT32_REGION_SCOPE, in_float32_region

_DTYPE_PARAMS = ("preferred_element_type",)
#: Sums painted half precision still accumulate in float32 (cast, sum, cast back when read
#: in half), as ``jnp.sum`` does for half inputs and TF's fused half kernels do: a bfloat16
#: accumulator stalls once the sum outgrows its 8 bits of mantissa.
#: The same holds for every accumulating primitive: a scatter-add (embedding gradients: the
#: row of a token seen 4096 times), a cross-device sum.
ACCUMULATING = (
    "reduce_sum",
    "cumsum",
    "reduce_window_sum",
    "scatter-add",
    "scatter-sub",
    "psum",
    "psum_invariant",
    "reduce_scatter",
)


class Hooks:
    """What an interpreter of the painted program is told as it runs (no-ops here).

    ``explain`` logs casts; ``compare`` records values. Both run the one equation loop of
    :class:`Emitter`.
    """

    def value(self, em: Emitter, eqn: Any, rec: EqnRec, outs: list[Any]) -> None:
        """A leaf, opaque or fused-unit equation produced ``outs``."""

    def cast(self, where: str, what: str, src: Any, dst: Any) -> None:
        """A cast of ``what`` (a shape) from ``src`` to ``dst`` was inserted at ``where``."""


class Staged:
    """How higher-order equations execute: re-bound with rewritten bodies (the rewrite).

    ``compare`` subclasses it to run control flow eagerly in Python. One method per kind of
    :mod:`~jmp_rewrite._src.trace.higher_order` primitive; each gets the operands already read in
    the dtypes the painting wants (see :meth:`Emitter.operands`).
    """

    def execute(self, em: Emitter, scope: ScopeRec, env: dict[Any, Any], read: Any) -> None:
        """Runs a scope's equations (``compare`` groups them into compiled segments)."""
        em.execute(scope, env, read, 0, len(scope.eqns))

    def call(self, em: Emitter, eqn: Any, rec: EqnRec, invals: list[Any]) -> list[Any]:
        layout = rec.layout
        body = layout.body()
        closed = em.trace(rec.subs["body"], jc.consts_of(body), em.avals(layout.inner(), invals))
        return ho.rebind(eqn, invals, {"body": jc.same_form(body, closed, eqn.primitive.name)})

    unit = call

    def custom_jvp(self, em: Emitter, eqn: Any, rec: EqnRec, invals: list[Any]) -> list[Any]:
        return em.custom(eqn, rec, invals)

    custom_vjp = custom_jvp

    def shard_map(self, em: Emitter, eqn: Any, rec: EqnRec, invals: list[Any]) -> list[Any]:
        fun = jax.shard_map(
            lambda *args: tuple(em.run_traced(rec.subs["body"], [], args)),
            **ho.shard_map_options(eqn),
        )
        with em.staging():
            return list(fun(*invals))

    def cond(self, em: Emitter, eqn: Any, rec: EqnRec, invals: list[Any]) -> list[Any]:
        layout = rec.layout
        out_dtypes = em.carry_dtypes(rec.carries, [v.aval for v in eqn.outvars])
        args = layout.split(invals)["args"]
        flagged = em.big_outputs(rec)
        branches = tuple(
            em.trace(scope, jc.consts_of(b), em.avals(jc.open_jaxpr(b), args), out_dtypes, flagged)
            for b, scope in zip(layout.body("cases"), rec.subs["cases"], strict=True)
        )
        outs = ho.rebind(eqn, invals, {"cases": branches})
        return em.adopt_flags(outs, flagged)

    def while_loop(self, em: Emitter, eqn: Any, rec: EqnRec, invals: list[Any]) -> list[Any]:
        layout = rec.layout
        ops = layout.split(invals)  # carries already in their nodes' dtypes (rec.operands)
        dtypes = [jnp.result_type(v) for v in ops["carry"]]
        cj, bj = layout.body("cond"), layout.body("body")
        cond = em.trace(
            rec.subs["cond"],
            jc.consts_of(cj),
            em.avals(jc.open_jaxpr(cj), ops["cond_consts"] + ops["carry"]),
        )
        body = em.trace(
            rec.subs["body"],
            jc.consts_of(bj),
            em.avals(jc.open_jaxpr(bj), ops["body_consts"] + ops["carry"]),
            dtypes,
        )
        return ho.rebind(eqn, invals, {"cond": cond, "body": body})

    def scan(self, em: Emitter, eqn: Any, rec: EqnRec, invals: list[Any]) -> list[Any]:
        layout = rec.layout
        ops = layout.split(invals)  # consts, carries and xs in their nodes' dtypes
        carry_dtypes = [jnp.result_type(v) for v in ops["carry"]]
        y_dtypes = em.carry_dtypes(rec.ys, [v.aval for v in eqn.outvars[layout.size("carry") :]])
        # xs slices: the body's invars' shapes, the stacked operands' dtypes
        in_avals = em.avals(layout.inner(), ops["consts"] + ops["carry"] + ops["xs"])
        body = layout.body()
        new_body = em.trace(rec.subs["body"], jc.consts_of(body), in_avals, carry_dtypes + y_dtypes)
        return ho.rebind(eqn, invals, {"body": new_body})


#: The default control: the rewrite itself.
STAGED = Staged()
_METHODS = {ho.WHILE: "while_loop"}


class Emitter:
    """Evaluates painted jaxpr scopes, inserting casts (see the module docstring).

    The one interpreter loop of the project: :meth:`run` / :meth:`execute` / :meth:`step`.
    ``control`` decides how higher-order equations execute (staged by default) and
    ``hooks`` hears of values and casts.
    """

    def __init__(
        self,
        graph: Graph,
        painting: Painting,
        dtype: Any,
        options: dict[str, Any],
        trace_cache: dict[Any, Any] | None = None,
        *,
        hooks: Hooks | None = None,
        control: Staged | None = None,
    ):
        self.graph = graph
        self.painting = painting
        self.half = np.dtype(dtype)
        self.options = options
        #: Rewritten bodies by (scope, input avals, output dtypes): reusing the same jaxpr
        #: object lets ``jit`` hit its compilation cache on repeated eager calls.
        self.trace_cache = trace_cache
        self.hooks = hooks if hooks is not None else Hooks()
        self.control = control if control is not None else STAGED
        #: > 0 while a body is being traced for re-binding (values are tracers there).
        self.depth = 0
        self.where = ""
        #: fused attentions (``fuse_attention=True``): run at their equations, or None
        chosen = painting.attention
        self.fusion = Fusion(chosen) if chosen is not None and chosen.fused else None
        #: which elements of big values a constant put out of range (see ``masking``).
        self.flags = Flags(self.half)
        #: the float32 values of operands half saturated, for derivatives (``tangents``).
        self.unsaturated = Unsaturated(self.half)

    # -- dtype decisions -----------------------------------------------------------------

    def is_half(self, node: int | None) -> bool:
        return node is not None and node in self.painting.allow

    def target(self, node: int | None, dtype: Any) -> Any:
        """The dtype a value of original ``dtype`` takes at a node painted as ``node``."""
        return self.half if self.is_half(node) and is_f32(dtype) else dtype

    def carry_dtypes(self, nodes: list[int | None], avals: Sequence[Any]) -> list[Any]:
        return [self.target(n, a.dtype) for n, a in zip(nodes, avals, strict=True)]

    def _wanted(self, atom: Any, nodes: list[int]) -> Any:
        """The dtype every reader of a call operand wants, or None (pass it as it is)."""
        wanted = {self.target(n, atom.aval.dtype) for n in nodes}
        return wanted.pop() if len(wanted) == 1 else None

    # -- the interpreter loop ------------------------------------------------------------

    def run(
        self,
        scope: ScopeRec,
        consts: Sequence[Any],
        args: Sequence[Any],
        out_dtypes: Sequence[Any] | None = None,
        flagged: Sequence[int] = (),
    ) -> list[Any]:
        """Evaluates one jaxpr instance on ``consts + args`` in the current trace.

        With ``out_dtypes``, outputs are cast to them (through the same cast cache as the
        equations, so a value cast for a consumer is not cast again for the output). With
        ``flagged`` (output positions), the flags of those outputs follow the outputs
        (``Flags.of_output``: a ``cond`` branch hands its outputs' flags out).
        """
        jaxpr = scope.jaxpr
        env = dict(zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *args], strict=True))
        read = self.reader(env)
        self.controller().execute(self, scope, env, read)
        self.where = f"{scope.path}<outputs>"
        big = self.painting.big
        flags = [self.flags.of_output(scope, env, jaxpr.outvars[i], big) for i in flagged]
        for i, flag in zip(flagged, flags, strict=True):  # cast at the boundary by them too
            if not jc.is_literal(jaxpr.outvars[i]):
                self.flags.adopt(env[jaxpr.outvars[i]], flag)
        if out_dtypes is None:
            return [read(a) for a in jaxpr.outvars] + flags
        return [  # a big result cast at the boundary (a branch's, a loop body's) as inside
            read(a, d, False, not jc.is_literal(a) and (self.flags.known(env[a]) or b))
            for a, d, b in zip(jaxpr.outvars, out_dtypes, scope.big_outputs, strict=True)
        ] + flags

    def big_outputs(self, rec: EqnRec) -> list[int]:
        """The positions of a ``cond``'s big float outputs (``Origin.big``)."""
        return [i for i, n in enumerate(rec.carries) if n is not None and n in self.painting.big]

    def adopt_flags(self, outs: list[Any], flagged: Sequence[int]) -> list[Any]:
        """``outs`` less the flags :meth:`run` appended for ``flagged``, which the outputs
        they belong to now hold."""
        n = len(outs) - len(flagged)
        for i, flag in zip(flagged, outs[n:], strict=True):
            self.flags.adopt(outs[i], flag)
        return outs[:n]

    def controller(self) -> Staged:
        """The control in force: bodies traced for re-binding are always staged."""
        return self.control if self.depth == 0 else STAGED

    def execute(
        self, scope: ScopeRec, env: dict[Any, Any], read: Any, start: int, end: int
    ) -> None:
        """Runs equations ``start:end`` of a scope, writing their outputs into ``env``."""
        jaxpr = scope.jaxpr
        for i in range(start, end):
            eqn, rec = jaxpr.eqns[i], scope.eqns[i]
            self.where = self._path(scope, eqn, rec)
            if self.fusion is not None and self.fusion.step(self, scope, i, env, read):
                continue
            if in_float32_region(jc.name_stack(eqn)):
                with jax.named_scope(FLOAT32_REGION_SCOPE):
                    outs = self.step(eqn, rec, read)
            else:
                outs = self.step(eqn, rec, read)
            for var, val in zip(eqn.outvars, outs, strict=True):
                if not jc.is_drop_var(var):
                    env[var] = val

    def step(self, eqn: Any, rec: EqnRec, read: Any) -> list[Any]:
        """One equation: operands read in the painted dtypes, then executed."""
        if rec.kind == "leaf":
            outs = self._leaf(eqn, rec, read)
        elif rec.kind == "opaque":
            outs = self._opaque(eqn, read)
        else:
            control = self.controller()
            method = getattr(control, _METHODS.get(rec.kind, rec.kind))
            outs = method(self, eqn, rec, ins := self.operands(eqn, rec, read))
            if rec.kind == ho.CALL:  # a call of moves (``jnp.flip``): float32 values too
                self.unsaturated.hand_on(eqn, outs, ins, self._saturated(eqn, rec, read, ins))
        if rec.node is not None:
            self.hooks.value(self, eqn, rec, outs)
        return outs

    def operands(self, eqn: Any, rec: EqnRec, read: Any) -> list[Any]:
        """A higher-order equation's operands in the dtypes its painting wants: a fused
        unit's in its colour; loop operands in their structural nodes' dtypes; a call's in
        the dtype all its inner readers want (one cast, outside)."""
        if rec.kind == "unit":
            wanted = [self.target(rec.node, a.aval.dtype) for a in eqn.invars]
        elif rec.operands:
            wanted = [
                None if n is None else self.target(n, a.aval.dtype)
                for a, n in zip(eqn.invars, rec.operands, strict=True)
            ]
        elif rec.operand_consumers:
            wanted = [
                self._wanted(a, nodes)
                for a, nodes in zip(eqn.invars, rec.operand_consumers, strict=True)
            ]
        else:
            wanted = [None] * len(eqn.invars)
        if rec.kind != "unit" and sums_over_trips(rec):
            wanted = self._handed_in(eqn, rec, wanted, read)
        return [
            read(a, d, _clamped(rec, i), self._big(rec, i))
            for i, (a, d) in enumerate(zip(eqn.invars, wanted, strict=True))
        ]

    def _handed_in(self, eqn: Any, rec: EqnRec, wanted: list[Any], read: Any) -> list[Any]:
        """``wanted`` less casts into half of float32 values a loop or ``shard_map`` (or a body
        holding one) reads as they are: cast at their readers (XLA hoists it), cotangents not
        summed in half over trips. Per-trip operands, literals and clamped constants are cast
        outside; a big value is pinned inside (``ScopeRec.big_outputs``)."""
        per_trip = set(ho.per_trip_positions(rec.layout))
        out = list(wanted)
        for i, (a, d) in enumerate(zip(eqn.invars, wanted, strict=True)):
            if d is None or i in per_trip or not is_f32(a.aval.dtype) or is_f32(d):
                continue
            if not (_clamped(rec, i) or jc.is_literal(a)) and is_f32(jnp.result_type(read(a))):
                out[i] = None  # handed in as it is; cast inside by its readers
        return out

    def as_read(self, eqn: Any, rec: EqnRec, outs: Sequence[Any]) -> list[Any]:
        """An equation's float outputs as its half-precision readers see them: a half sum
        accumulates in float32 and is read cast to half."""
        floats = [o for o, v in zip(outs, eqn.outvars, strict=True) if is_float(v.aval.dtype)]
        if accumulates_in_float32(eqn, self.is_half(rec.node)):
            floats = [cast(f, self.half) for f in floats]
        return floats

    def reader(self, env: dict[Any, Any]) -> Any:
        """``read(atom, dtype=None)`` over ``env``: the atom's value, cast to ``dtype`` at most
        once per (value, dtype); float literals are converted in place."""
        casts: dict[tuple[int, Any], Any] = {}
        keep: list[Any] = []  # keeps cast sources alive, so ids stay unique

        def read(atom: Any, dtype: Any = None, const: bool = False, big: bool = False) -> Any:
            if jc.is_literal(atom):
                val = jc.literal_value(atom)
                if dtype is not None and is_float(dtype) and dtype != atom.aval.dtype:
                    return literal(val, dtype, const or big)
                return val
            val = env[atom]
            if dtype is None or not is_float(atom.aval.dtype):
                return val
            dtype = np.dtype(dtype)
            if jnp.result_type(val) == dtype:
                return val
            key = (id(val), dtype, const, big)
            if key not in casts:
                keep.append(val)
                casts[key] = lax.convert_element_type(self._in_range(val, dtype, const, big), dtype)
                self.hooks.cast(self.where, _describe(atom), jnp.result_type(val), dtype)
            return casts[key]

        return read

    def _big(self, rec: EqnRec, i: int) -> bool:
        """Whether operand ``i`` of a forward equation is big (``Origin.big``; the painting's
        closure through loop carries included)."""
        if rec.big_operands and rec.big_operands[i]:
            return True
        return bool(rec.operand_nodes) and rec.operand_nodes[i] in self.painting.big

    def _saturated(self, eqn: Any, rec: EqnRec, read: Any, invals: list[Any]) -> Any:
        """Per operand of a half equation, its float32 value where its way into half
        saturated it (a literal clamped, a big value pinned: ``tangents.Unsaturated``), else
        None; None when there is none."""
        out = []
        for i, (a, v) in enumerate(zip(eqn.invars, invals, strict=True)):
            raw = read(a)  # as the program holds it
            saturating = self._big(rec, i) or (jc.is_literal(a) and _clamped(rec, i))
            narrowed = jnp.result_type(raw) != jnp.result_type(v)
            out.append(self.unsaturated.value(a, raw, saturating, narrowed))
        return out if any(o is not None for o in out) else None

    def _in_range(self, val: Any, dtype: Any, const: bool, big: bool) -> Any:
        """``val`` ready for its cast to ``dtype``: a frozen value (a constant, a mask) is
        clamped to its range, a big one saturated where a constant put it out of range
        (``masking``); computed values are left to overflow honestly."""
        if big and not _fits(jnp.result_type(val), dtype):
            return self.flags.in_range(val)
        return clamp(val, dtype) if const else val

    # -- staging bodies --------------------------------------------------------------------

    @contextlib.contextmanager
    def staging(self) -> Iterator[None]:
        """While bodies are traced for re-binding (values are tracers, control is staged)."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def run_traced(self, scope: ScopeRec, consts: Sequence[Any], args: Sequence[Any], **kw):
        """:meth:`run` as the function of a trace of its own (a body's ``make_jaxpr``, a
        ``shard_map``, a custom rule): with flags and float32 values of its own, dropped
        before the trace ends. The outer trace's (computed there, or left lazy) would be
        captured by the body's jaxpr as constants, and kept, its tracers would leak."""
        with self.own_flags():
            return self.run(scope, consts, args, **kw)

    @contextlib.contextmanager
    def own_flags(self) -> Iterator[None]:
        """Fresh flags and float32 values for a trace of its own (see :meth:`run_traced`)."""
        outer = self.flags, self.unsaturated
        self.flags, self.unsaturated = Flags(self.half), Unsaturated(self.half)
        try:
            yield
        finally:
            self.flags, self.unsaturated = outer

    def avals(self, inner: Any, values: Sequence[Any]) -> list[Any]:
        """Abstract values for the invars of ``inner`` taking ``values``: the invars' shapes,
        shardings and manual axes, the values' dtypes and weak types."""
        out = []
        for var, val in zip(inner.invars, values, strict=True):
            t = jax.typeof(val)
            out.append(jc.abstract_value(var.aval, t.dtype, t.weak_type))
        return out

    def trace(
        self,
        scope: ScopeRec,
        consts: Sequence[Any],
        in_avals: Sequence[Any],
        out_dtypes: Sequence[Any] | None = None,
        flagged: Sequence[int] = (),
    ) -> Any:
        """A closed jaxpr for ``scope`` at ``in_avals``; outputs cast to ``out_dtypes``, then
        the flags of the ``flagged`` outputs (see :meth:`run`)."""

        def fun(*args: Any) -> list[Any]:
            return self.run_traced(scope, consts, args, out_dtypes=out_dtypes, flagged=flagged)

        def make() -> Any:
            with self.staging():
                return jax.make_jaxpr(fun)(*in_avals)

        if self.trace_cache is None:
            return make()
        key = (
            id(scope),
            tuple(jc.abstract_key(a) for a in in_avals),
            None if out_dtypes is None else tuple(str(d) for d in out_dtypes),
            tuple(flagged),
        )
        if key not in self.trace_cache:
            self.trace_cache[key] = make()
        return self.trace_cache[key]

    def trace_program(self, closed: Any, out_dtypes: Sequence[Any] | None = None) -> Any:
        """The whole painted program re-emitted as a closed jaxpr at ``closed``'s own input
        avals (outputs in their original dtypes unless ``out_dtypes`` says otherwise)."""
        inner = jc.open_jaxpr(closed)
        if out_dtypes is None:
            out_dtypes = [v.aval.dtype for v in inner.outvars]
        in_avals = [jc.abstract_value(v.aval) for v in inner.invars]
        return self.trace(self.graph.top, jc.consts_of(closed), in_avals, out_dtypes)

    def _path(self, scope: ScopeRec, eqn: Any, rec: EqnRec) -> str:
        if rec.node is not None:
            return self.graph.nodes[rec.node].path
        return f"{scope.path}{eqn.primitive.name}"

    # -- leaf equations ---------------------------------------------------------------------

    def _leaf(self, eqn: Any, rec: EqnRec, read: Any) -> list[Any]:
        node = rec.node
        half = self.is_half(node)
        name = eqn.primitive.name
        fp8 = self.painting.fp8
        if fp8 is not None and node in fp8.dots:
            # Operands as they are (a float32 parameter is quantized from float32, not from
            # a bfloat16 copy); the result in the dtype the bfloat16 rewrite gives it.
            out = self.target(node, eqn.outvars[0].aval.dtype)
            return fp8_lib.emit(eqn, [read(a) for a in eqn.invars], fp8.dots[node], out)
        if name == "convert_element_type":
            # TF's Cast rule: the operand is taken as it is (no cast before a cast); a cast to
            # float32 whose consumers are all half casts to half instead.
            params = dict(eqn.params)
            operand = raw = read(eqn.invars[0])
            if not half:
                return bind(eqn, [operand], params)
            params["new_dtype"] = self.half
            clamped, big = _clamped(rec, 0), self._big(rec, 0)
            operand = self._in_range(operand, self.half, clamped, big)
            outs = bind(eqn, [operand], params)
            narrowed = is_float(jnp.result_type(raw)) and not _fits(jnp.result_type(raw), self.half)
            true = self.unsaturated.value(eqn.invars[0], raw, clamped or big, narrowed)
            self.unsaturated.hand_on(eqn, outs, [operand], [true])
            return outs
        if accumulates_in_float32(eqn, half):
            # The float32 sum is kept: half-precision readers cast it (once), float32
            # readers and outputs get it exactly.
            return bind(eqn, [read(a, a.aval.dtype) for a in eqn.invars], eqn.params)
        invals = [
            read(a, self.target(node, a.aval.dtype), _clamped(rec, i), self._big(rec, i))
            for i, a in enumerate(eqn.invars)
        ]
        params = dict(eqn.params)
        outs = None
        if half:
            for key in _DTYPE_PARAMS:
                if key in params and params[key] is not None and is_f32(params[key]):
                    params[key] = self.half
            saturated = self._saturated(eqn, rec, read, invals)
            const = [_const(rec, i) for i in range(len(eqn.invars))]
            if name in SCATTER_REBUILDERS and eqn.params.get("update_jaxpr") is not None:
                outs = [rebuild_scatter(eqn, invals)]
            elif saturated and reads_magnitude(eqn) or transpose_accumulates(eqn, const):
                outs = float32_tangents(eqn, invals, params, saturated)
        outs = bind(eqn, invals, params) if outs is None else outs
        if node in self.painting.big and len(outs) == 1 and is_float(jnp.result_type(outs[0])):
            big = [self._big(rec, i) for i in range(len(eqn.invars))]
            outs = [self.flags.pinned(eqn, invals, big, outs[0])]  # see ``masking``
        if half and saturated:
            self.unsaturated.hand_on(eqn, outs, invals, saturated)
        return outs

    def _opaque(self, eqn: Any, read: Any) -> list[Any]:
        """An equation holding jaxprs we do not see through: same signature, bodies
        rewritten as programs of their own (run as written when nothing is painted, and
        always when a body is no program of arrays: a kernel, see ``equations.sealed``)."""
        invals = [read(a, a.aval.dtype) for a in eqn.invars]
        if not self.painting.changed or sealed(eqn):
            return bind(eqn, invals, eqn.params)
        params = {k: ho.map_held(v, self._rewrite_same_signature) for k, v in eqn.params.items()}
        return bind(eqn, invals, params)

    def _rewrite_same_signature(self, value: Any) -> Any:
        if not jc.is_any_jaxpr(value):
            return value
        inner = jc.open_jaxpr(value)
        if jc.is_open_jaxpr(value) and inner.constvars and not jc.consts_of(value):
            return value  # constvars bound elsewhere: leave such bodies alone
        new = rewrite_closed(
            jc.make_closed(inner, jc.consts_of(value)),
            self.half,
            self.graph.lists,
            None,
            {**self.options, "fp8_check": False},
        )
        return jc.same_form(value, new, eqn_name="opaque body")

    # -- custom derivatives ------------------------------------------------------------------

    def custom(self, eqn: Any, rec: EqnRec, invals: list[Any]) -> list[Any]:
        """Re-wraps a custom derivative so its rule runs as written (see
        :func:`~jmp_rewrite._src.emit.custom_rules.rewrap`)."""
        return rewrap(self, eqn, rec, invals)


def _const(rec: EqnRec, i: int) -> bool:
    return bool(rec.const_operands) and rec.const_operands[i]


def _clamped(rec: EqnRec, i: int) -> bool:
    return bool(rec.clamped_operands) and rec.clamped_operands[i]


def _describe(atom: Any) -> str:
    """A value's shape, e.g. ``[4,16]`` (its dtype is in the cast record)."""
    return "[" + ",".join(str(d) for d in getattr(atom.aval, "shape", ())) + "]"


def accumulates_in_float32(eqn: Any, half: bool) -> bool:
    """Whether a half-painted equation is a sum kept in float32 (see :data:`ACCUMULATING`)."""
    return half and eqn.primitive.name in ACCUMULATING


def rewrite_closed(
    closed: Any,
    dtype: Any,
    lists: Any,
    out_dtypes: Sequence[Any] | None,
    options: dict[str, Any],
) -> Any:
    """Paints and re-emits a closed jaxpr at its own input avals (a new closed jaxpr)."""
    graph = Graph(closed, lists, dtype)
    painting = paint(
        graph,
        infer_follows_allow=options.get("infer_follows_allow", True),
        force_all=options.get("force_all", False),
        fp8=options.get("fp8"),
        fp8_check=options.get("fp8_check", True),
        attention=options.get("fuse_attention", False),
    )
    if not painting.changed:
        return closed
    return Emitter(graph, painting, dtype, options).trace_program(closed, out_dtypes)
