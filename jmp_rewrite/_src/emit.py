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
keep being used. Equations holding other jaxprs keep their signature and are rewritten inside
as separate programs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src.graph import (
    CALL_BODIES,
    SCATTER_REBUILDERS,
    EqnRec,
    Graph,
    ScopeRec,
    is_f32,
    is_float,
)
from jmp_rewrite._src.paint import Painting, paint
from jmp_rewrite._src.regions import FLOAT32_REGION_SCOPE, in_float32_region

_SCATTER_FUNS = {
    "scatter-add": lax.scatter_add,
    "scatter-sub": getattr(lax, "scatter_sub", None),
    "scatter-mul": lax.scatter_mul,
    "scatter-min": lax.scatter_min,
    "scatter-max": lax.scatter_max,
}
_DTYPE_PARAMS = ("preferred_element_type",)
#: Sums painted half precision still accumulate in float32 (cast, sum, cast back when read
#: in half), as ``jnp.sum`` does for half inputs and TF's fused half kernels do: a bfloat16
#: accumulator stalls once the sum outgrows its 8 bits of mantissa.
ACCUMULATING = ("reduce_sum", "cumsum", "reduce_window_sum")


def _avals_like(template_vars: Sequence[Any], values: Sequence[Any]) -> list[Any]:
    """ShapeDtypeStructs with the template vars' shapes and the values' dtypes/weak types."""
    out = []
    for var, val in zip(template_vars, values, strict=True):
        aval, t = var.aval, jax.typeof(val)
        out.append(jax.ShapeDtypeStruct(aval.shape, t.dtype, weak_type=t.weak_type))
    return out


class Emitter:
    """Evaluates painted jaxpr scopes, inserting casts (see the module docstring)."""

    def __init__(
        self,
        graph: Graph,
        painting: Painting,
        dtype: Any,
        options: dict[str, Any],
        trace_cache: dict[Any, Any] | None = None,
    ):
        self.graph = graph
        self.painting = painting
        self.half = np.dtype(dtype)
        self.options = options
        #: Rewritten bodies by (scope, input avals, output dtypes): reusing the same jaxpr
        #: object lets ``jit`` hit its compilation cache on repeated eager calls.
        self.trace_cache = trace_cache
        #: When a list, every cast inserted is recorded as (where, value, from, to).
        self.cast_log: list[tuple[str, str, str, str]] | None = None
        self._where = ""

    def _log(self, where: str, what: str, src: Any, dst: Any) -> None:
        if self.cast_log is not None:
            self.cast_log.append((where, what, str(src), str(np.dtype(dst))))

    # -- dtype decisions -----------------------------------------------------------------

    def _is_half(self, node: int | None) -> bool:
        return node is not None and node in self.painting.allow

    def _target(self, node: int | None, dtype: Any) -> Any:
        """The dtype a value of original ``dtype`` takes at a node painted as ``node``."""
        return self.half if self._is_half(node) and is_f32(dtype) else dtype

    # -- evaluation ----------------------------------------------------------------------

    def run(
        self,
        scope: ScopeRec,
        consts: Sequence[Any],
        args: Sequence[Any],
        out_dtypes: Sequence[Any] | None = None,
    ) -> list[Any]:
        """Evaluates one jaxpr instance on ``consts + args`` in the current trace.

        With ``out_dtypes``, outputs are cast to them (through the same cast cache as the
        equations, so a value cast for a consumer is not cast again for the output).
        """
        jaxpr = scope.jaxpr
        env: dict[Any, Any] = {}
        for var, val in zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *args], strict=True):
            env[var] = val
        read = self.reader(env)

        for eqn, rec in zip(jaxpr.eqns, scope.eqns, strict=True):
            region = in_float32_region(jc.name_stack(eqn))
            scope_cm = jax.named_scope(FLOAT32_REGION_SCOPE) if region else contextlib.nullcontext()
            self._where = self._path(scope, eqn, rec)
            with scope_cm:
                outs = self._eqn(eqn, rec, read)
            for var, val in zip(eqn.outvars, outs, strict=True):
                if not jc.is_drop_var(var):
                    env[var] = val
        self._where = f"{scope.path}<outputs>"
        if out_dtypes is None:
            return [read(a) for a in jaxpr.outvars]
        return [read(a, d) for a, d in zip(jaxpr.outvars, out_dtypes, strict=True)]

    def reader(self, env: dict[Any, Any]) -> Any:
        """``read(atom, dtype=None)`` over ``env``: the atom's value, cast to ``dtype`` at most
        once per (value, dtype); float literals are converted in place."""
        casts: dict[tuple[int, Any], Any] = {}
        keep: list[Any] = []  # keeps cast sources alive, so ids stay unique

        def read(atom: Any, dtype: Any = None) -> Any:
            if jc.is_literal(atom):
                val = jc.literal_value(atom)
                if dtype is not None and is_float(dtype) and dtype != atom.aval.dtype:
                    return _literal(val, dtype)
                return val
            val = env[atom]
            if dtype is None or not is_float(atom.aval.dtype):
                return val
            dtype = np.dtype(dtype)
            if jnp.result_type(val) == dtype:
                return val
            key = (id(val), dtype)
            if key not in casts:
                keep.append(val)
                casts[key] = lax.convert_element_type(val, dtype)
                self._log(self._where, _describe(atom), jnp.result_type(val), dtype)
            return casts[key]

        return read

    def trace(
        self,
        scope: ScopeRec,
        consts: Sequence[Any],
        in_avals: Sequence[Any],
        out_dtypes: Sequence[Any] | None = None,
    ) -> Any:
        """A closed jaxpr for ``scope`` at ``in_avals``; outputs cast to ``out_dtypes``."""

        def fun(*args: Any) -> list[Any]:
            return self.run(scope, consts, args, out_dtypes)

        if self.trace_cache is None or self.cast_log is not None:
            return jax.make_jaxpr(fun)(*in_avals)
        key = (
            id(scope),
            tuple((a.shape, str(a.dtype), a.weak_type) for a in in_avals),
            None if out_dtypes is None else tuple(str(d) for d in out_dtypes),
        )
        if key not in self.trace_cache:
            self.trace_cache[key] = jax.make_jaxpr(fun)(*in_avals)
        return self.trace_cache[key]

    def _wanted(self, atom: Any, nodes: list[int]) -> Any:
        """The dtype every reader of a call operand wants, or None (pass it as it is)."""
        wanted = {self._target(n, atom.aval.dtype) for n in nodes}
        return wanted.pop() if len(wanted) == 1 else None

    def _path(self, scope: ScopeRec, eqn: Any, rec: EqnRec) -> str:
        if rec.node is not None:
            return self.graph.nodes[rec.node].path
        return f"{scope.path}{eqn.primitive.name}"

    # -- one equation ---------------------------------------------------------------------

    def _eqn(self, eqn: Any, rec: EqnRec, read: Any) -> list[Any]:
        if rec.kind == "leaf":
            return self._leaf(eqn, rec.node, read)
        if rec.kind == "opaque":
            return self._opaque(eqn, read)
        if rec.kind == "unit":
            invals = [read(a, self._target(rec.node, a.aval.dtype)) for a in eqn.invars]
            return self._call(eqn, rec, invals)
        if rec.operands:
            invals = [
                read(a) if n is None else read(a, self._target(n, a.aval.dtype))
                for a, n in zip(eqn.invars, rec.operands, strict=True)
            ]
        elif rec.operand_consumers:
            invals = [
                read(a, self._wanted(a, nodes))
                for a, nodes in zip(eqn.invars, rec.operand_consumers, strict=True)
            ]
        else:
            invals = [read(a) for a in eqn.invars]
        if rec.kind == "call":
            return self._call(eqn, rec, invals)
        return getattr(self, "_" + rec.kind)(eqn, rec, invals)

    def _leaf(self, eqn: Any, node: int | None, read: Any) -> list[Any]:
        half = self._is_half(node)
        name = eqn.primitive.name
        if name == "convert_element_type":
            # TF's Cast rule: the operand is taken as it is (no cast before a cast); a cast to
            # float32 whose consumers are all half casts to half instead.
            params = dict(eqn.params)
            if half:
                params["new_dtype"] = self.half
            return bind(eqn, [read(eqn.invars[0])], params)
        if half and name in ACCUMULATING:
            # The float32 sum is kept: half-precision readers cast it (once), float32
            # readers and outputs get it exactly.
            return bind(eqn, [read(a, a.aval.dtype) for a in eqn.invars], eqn.params)
        invals = [read(a, self._target(node, a.aval.dtype)) for a in eqn.invars]
        params = dict(eqn.params)
        if half:
            for key in _DTYPE_PARAMS:
                if key in params and params[key] is not None and is_f32(params[key]):
                    params[key] = self.half
            if name in SCATTER_REBUILDERS and eqn.params.get("update_jaxpr") is not None:
                return [self._scatter(eqn, invals)]
        return bind(eqn, invals, params)

    def _scatter(self, eqn: Any, invals: list[Any]) -> Any:
        fun = _SCATTER_FUNS.get(eqn.primitive.name)
        if fun is None:  # pragma: no cover - graph.py only paints rebuildable scatters
            raise NotImplementedError(f"cannot re-emit {eqn.primitive.name} in half precision")
        p = eqn.params
        operand, indices, updates = invals
        return fun(
            operand,
            indices,
            updates,
            p["dimension_numbers"],
            indices_are_sorted=p["indices_are_sorted"],
            unique_indices=p["unique_indices"],
            mode=p["mode"],
        )

    def _opaque(self, eqn: Any, read: Any) -> list[Any]:
        """An equation holding jaxprs we do not see through: same signature, bodies
        rewritten as programs of their own."""
        invals = [read(a, a.aval.dtype) for a in eqn.invars]
        params = {}
        for key, value in eqn.params.items():
            if type(value) is tuple:
                params[key] = tuple(self._rewrite_same_signature(v) for v in value)
            else:
                params[key] = self._rewrite_same_signature(value)
        return bind(eqn, invals, params)

    def _rewrite_same_signature(self, value: Any) -> Any:
        if not jc.is_any_jaxpr(value):
            return value
        inner = jc.open_jaxpr(value)
        if jc.is_open_jaxpr(value) and inner.constvars and not jc.consts_of(value):
            return value  # constvars bound elsewhere: leave such bodies alone
        if any(not hasattr(v.aval, "shape") for v in [*inner.invars, *inner.outvars]):
            return value  # tokens, refs: leave such bodies alone
        new = rewrite_closed(
            jc.make_closed(inner, jc.consts_of(value)),
            self.half,
            self.graph.lists,
            None,
            self.options,
        )
        return jc.same_form(value, new, eqn_name="opaque body")

    # -- calls ------------------------------------------------------------------------------

    def _call(self, eqn: Any, rec: EqnRec, invals: list[Any]) -> list[Any]:
        name = eqn.primitive.name
        param = CALL_BODIES.get(name, "jaxpr")
        body = eqn.params[param]
        scope = rec.subs["body"]
        consts = jc.consts_of(body)
        if name in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"):
            return self._custom(eqn, scope, consts, invals)
        if name == "shard_map":
            return self._shard_map(eqn, scope, invals)
        closed = self.trace(scope, consts, _avals_like(jc.open_jaxpr(body).invars, invals))
        return bind(eqn, invals, {**eqn.params, param: jc.same_form(body, closed, name)})

    def _custom(self, eqn: Any, scope: ScopeRec, consts: list[Any], invals: list[Any]):
        """Re-wraps a custom derivative so its rule runs as written, in the original dtypes."""
        orig_in = [a.aval.dtype for a in eqn.invars]

        def body(*args: Any) -> tuple[Any, ...]:
            return tuple(self.run(scope, consts, args))

        body.__name__ = jc.function_name(jc.open_jaxpr(eqn.params[CALL_BODIES[eqn.primitive.name]]))

        def original(*args: Any) -> list[Any]:
            return bind(eqn, list(args), eqn.params)

        def to_original(values: Sequence[Any]) -> list[Any]:
            return [cast(v, d) for v, d in zip(values, orig_in, strict=True)]

        if eqn.primitive.name == "custom_jvp_call":
            fun = jax.custom_jvp(body)

            @fun.defjvp
            def fun_jvp(primals, tangents):
                out = body(*primals)
                tangents = [
                    t if not is_float(d) else cast(t, d)
                    for t, d in zip(tangents, orig_in, strict=True)
                ]
                _, tout = jax.jvp(original, to_original(primals), tangents)
                return out, tuple(_cast_like(t, o) for t, o in zip(tout, out, strict=True))

            return list(fun(*invals))

        fun = jax.custom_vjp(body)
        in_dtypes = [jnp.result_type(v) for v in invals]

        def fwd(*primals):
            out = body(*primals)
            _, vjp_fn = jax.vjp(original, *to_original(primals))
            return out, vjp_fn

        def bwd(vjp_fn, cts):
            orig_out = [v.aval.dtype for v in eqn.outvars]
            grads = vjp_fn([cast(c, d) for c, d in zip(cts, orig_out, strict=True)])
            return tuple(
                cast(g, d) if is_float(d) else None for g, d in zip(grads, in_dtypes, strict=True)
            )

        fun.defvjp(fwd, bwd)
        return list(fun(*invals))

    def _shard_map(self, eqn: Any, scope: ScopeRec, invals: list[Any]) -> list[Any]:
        p = eqn.params
        axis_names = p.get("newly_manual_axes", p.get("manual_axes"))
        kwargs: dict[str, Any] = {}
        if axis_names is not None:
            kwargs["axis_names"] = set(axis_names)
        if "check_vma" in p:
            kwargs["check_vma"] = p["check_vma"]
        fun = jax.shard_map(
            lambda *args: tuple(self.run(scope, [], args)),
            mesh=p["mesh"],
            in_specs=tuple(p["in_specs"]),
            out_specs=tuple(p["out_specs"]),
            **kwargs,
        )
        return list(fun(*invals))

    # -- control flow -----------------------------------------------------------------------

    def _carry_dtypes(self, nodes: list[int | None], avals: Sequence[Any]) -> list[Any]:
        return [self._target(n, a.dtype) for n, a in zip(nodes, avals, strict=True)]

    def _cond(self, eqn: Any, rec: EqnRec, invals: list[Any]) -> list[Any]:
        out_dtypes = self._carry_dtypes(rec.carries, [v.aval for v in eqn.outvars])
        branches = []
        for branch, scope in zip(eqn.params["branches"], rec.subs["branches"], strict=True):
            inner = jc.open_jaxpr(branch)
            branches.append(
                self.trace(
                    scope, jc.consts_of(branch), _avals_like(inner.invars, invals[1:]), out_dtypes
                )
            )
        return bind(eqn, invals, {**eqn.params, "branches": tuple(branches)})

    def _while(self, eqn: Any, rec: EqnRec, invals: list[Any]) -> list[Any]:
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        carry_avals = [v.aval for v in eqn.invars[nc + nb :]]
        dtypes = self._carry_dtypes(rec.carries, carry_avals)
        init = invals[nc + nb :]  # already in the carries' dtypes (rec.operands)
        cconsts, bconsts = invals[:nc], invals[nc : nc + nb]
        cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
        cond = self.trace(
            rec.subs["cond"],
            jc.consts_of(cj),
            _avals_like(jc.open_jaxpr(cj).invars, cconsts + init),
        )
        body = self.trace(
            rec.subs["body"],
            jc.consts_of(bj),
            _avals_like(jc.open_jaxpr(bj).invars, bconsts + init),
            dtypes,
        )
        return bind(eqn, cconsts + bconsts + init, {**p, "cond_jaxpr": cond, "body_jaxpr": body})

    def _scan(self, eqn: Any, rec: EqnRec, invals: list[Any]) -> list[Any]:
        p = eqn.params
        nconst, ncarry = p["num_consts"], p["num_carry"]
        body = p["jaxpr"]
        inner = jc.open_jaxpr(body)
        carry_dtypes = self._carry_dtypes(
            rec.carries, [v.aval for v in eqn.invars[nconst : nconst + ncarry]]
        )
        x_dtypes = self._carry_dtypes(rec.xs, [v.aval for v in eqn.invars[nconst + ncarry :]])
        y_dtypes = self._carry_dtypes(rec.ys, [v.aval for v in eqn.outvars[ncarry:]])
        consts = invals[:nconst]
        init, xs = invals[nconst : nconst + ncarry], invals[nconst + ncarry :]
        x_slices = [
            jax.ShapeDtypeStruct(a.shape, d)
            for a, d in zip(
                [v.aval for v in inner.invars[nconst + ncarry :]], x_dtypes, strict=True
            )
        ]
        in_avals = _avals_like(inner.invars[: nconst + ncarry], consts + init) + x_slices
        new_body = self.trace(
            rec.subs["body"], jc.consts_of(body), in_avals, carry_dtypes + y_dtypes
        )
        return bind(eqn, consts + init + xs, {**p, "jaxpr": new_body})


def _literal(value: Any, dtype: Any) -> Any:
    """A float literal in ``dtype``, converted in place. A finite literal beyond the range of
    ``dtype`` is clamped to its largest finite value rather than becoming infinite: such
    constants are sentinels (``jnp.finfo(jnp.float32).min`` as an attention mask), and an
    infinite mask turns a fully masked softmax row into NaN."""
    value = np.asarray(value)
    if jnp.issubdtype(dtype, jnp.floating) and np.all(np.isfinite(value)):
        info = jnp.finfo(dtype)
        value = np.clip(value, float(info.min), float(info.max))
    return np.asarray(value, dtype=dtype)


def _describe(atom: Any) -> str:
    """A value's shape, e.g. ``[4,16]`` (its dtype is in the cast record)."""
    return "[" + ",".join(str(d) for d in getattr(atom.aval, "shape", ())) + "]"


def cast(value: Any, dtype: Any) -> Any:
    """``value`` in float ``dtype``; non-float values and dtypes pass through."""
    if not is_float(dtype) or not is_float(jnp.result_type(value)):
        return value
    if jnp.result_type(value) == np.dtype(dtype):
        return value
    return lax.convert_element_type(value, dtype)


def _cast_like(value: Any, like: Any) -> Any:
    return cast(value, jnp.result_type(like))


def bind(eqn: Any, invals: list[Any], params: dict[str, Any]) -> list[Any]:
    """Binds ``eqn``'s primitive with ``params``; always a list of outputs."""
    out = eqn.primitive.bind(*invals, **jc.bind_params(eqn, params))
    return list(out) if eqn.primitive.multiple_results else [out]


def rewrite_closed(
    closed: Any,
    dtype: Any,
    lists: Any,
    out_dtypes: Sequence[Any] | None,
    options: dict[str, Any],
) -> Any:
    """Paints and re-emits a closed jaxpr at its own input avals (a new closed jaxpr)."""
    graph = Graph(closed, lists)
    painting = paint(
        graph,
        infer_follows_allow=options.get("infer_follows_allow", True),
        force_all=options.get("force_all", False),
    )
    if not painting.changed:
        return closed
    emitter = Emitter(graph, painting, dtype, options)
    inner = jc.open_jaxpr(closed)
    in_avals = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
        for v in inner.invars
    ]
    consts = jc.consts_of(closed)
    if out_dtypes is None:
        out_dtypes = [v.aval.dtype for v in inner.outvars]
    return emitter.trace(graph.top, consts, in_avals, out_dtypes)
