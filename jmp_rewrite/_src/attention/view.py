"""A jaxpr scope seen through its calls: the dataflow the attention matcher walks.

JAX wraps ``jnp.where`` (``jit _where``), ``jnp.tril`` and ``jax.nn.softmax`` (a
``custom_jvp_call`` when ``jax_softmax_custom_jvp`` is on) in calls, so the chain from the
logits to the probabilities crosses call boundaries. A :class:`View` follows a value to the
equation that computes it, inside calls too, and remembers for every equation it reaches
which equation of the scope holds it (the *top* index: what the emitter skips).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src.trace import higher_order as ho

#: Elementwise primitives folded when every operand is a scalar constant: ``s /
#: jnp.sqrt(d)``, ``s * lax.rsqrt(jnp.float32(d))`` scale by a constant, as ``math.sqrt`` does.
FOLDED = frozenset({"sqrt", "rsqrt", "exp", "log", "neg", "abs", "integer_pow", "pow"})
FOLDED |= {"add", "sub", "mul", "div", "max", "min"}

#: Call kinds the view looks into (their bodies run once per call, operands as arguments).
_SEE_THROUGH = (ho.CALL, ho.CUSTOM_JVP)


@dataclasses.dataclass(eq=False)
class Ctx:
    """One jaxpr instance on the way: the scope itself (``parent`` None) or a call's body."""

    jaxpr: Any
    parent: Ctx | None = None
    #: the call's operands (atoms of ``parent``), one per invar of ``jaxpr``
    operands: tuple[Any, ...] = ()
    #: index, in the scope, of the equation holding this body (None for the scope)
    top: int | None = None
    producers: dict[Any, tuple[int, Any]] = dataclasses.field(default_factory=dict)
    children: dict[int, Ctx] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for i, eqn in enumerate(self.jaxpr.eqns):
            for j, v in enumerate(eqn.outvars):
                if not jc.is_drop_var(v):
                    self.producers[v] = (i, j)


@dataclasses.dataclass(frozen=True, eq=False)
class Val:
    """A value in the view: an atom of one jaxpr instance."""

    atom: Any
    ctx: Ctx

    def key(self) -> tuple[int, int]:
        return (id(self.atom), id(self.ctx))

    @property
    def aval(self) -> Any:
        return self.atom.aval

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self.atom.aval, "shape", ()))


@dataclasses.dataclass(frozen=True, eq=False)
class At:
    """An equation reached in the view, with the scope equation holding it."""

    eqn: Any
    ctx: Ctx
    top: int  # index of the scope equation (itself, or the call holding it)

    @property
    def name(self) -> str:
        return self.eqn.primitive.name

    def operand(self, i: int) -> Val:
        return Val(self.eqn.invars[i], self.ctx)


class View:
    """A scope's equations, seen through calls (see the module docstring)."""

    def __init__(self, scope: Any):
        self.scope = scope
        self.root = Ctx(scope.jaxpr)
        #: scope var -> indices of the scope equations reading it
        self.readers: dict[Any, list[int]] = {}
        for i, eqn in enumerate(scope.jaxpr.eqns):
            for a in eqn.invars:
                if not jc.is_literal(a):
                    self.readers.setdefault(a, []).append(i)
        self.outvars = {a for a in scope.jaxpr.outvars if not jc.is_literal(a)}

    def val(self, atom: Any) -> Val:
        return Val(atom, self.root)

    def _child(self, ctx: Ctx, index: int, eqn: Any, layout: Any) -> Ctx:
        child = ctx.children.get(index)
        if child is None:
            body = jc.open_jaxpr(layout.body())
            n_consts = len(body.constvars)
            if n_consts:  # closed-over arrays of the body: nothing to follow them to
                return None  # type: ignore[return-value]
            top = index if ctx.parent is None else ctx.top
            child = ctx.children[index] = Ctx(body, ctx, tuple(eqn.invars), top)
        return child

    def resolve(self, val: Val) -> Val:
        """The value itself, or what a body's parameter is bound to outside (up to the
        scope)."""
        while val.ctx.parent is not None and not jc.is_literal(val.atom):
            try:
                i = val.ctx.jaxpr.invars.index(val.atom)
            except ValueError:
                return val
            val = Val(val.ctx.operands[i], val.ctx.parent)
        return val

    def producer(self, val: Val) -> At | None:
        """The non-call equation computing ``val`` (looking into calls), or None for a
        literal, an input of the scope, or a value a call computes in a way not followed."""
        val = self.resolve(val)
        while not jc.is_literal(val.atom):
            hit = val.ctx.producers.get(val.atom)
            if hit is None:
                return None
            index, out = hit
            eqn = val.ctx.jaxpr.eqns[index]
            layout = ho.describe(eqn)
            top = index if val.ctx.parent is None else val.ctx.top
            if layout is None or layout.kind not in _SEE_THROUGH:
                return At(eqn, val.ctx, top)
            child = self._child(val.ctx, index, eqn, layout)
            if child is None:
                return None
            val = self.resolve(Val(child.jaxpr.outvars[out], child))
        return None

    def scope_atom(self, val: Val) -> Any:
        """The scope's own atom for ``val`` (resolved out of calls), or None when ``val``
        is computed inside a call."""
        val = self.resolve(val)
        return val.atom if val.ctx.parent is None else None

    def literal(self, val: Val) -> float | None:
        """The value of a scalar constant: a literal, a broadcast or cast of one, or an
        elementwise function of such (:data:`FOLDED`), else None."""
        val = self.resolve(val)
        if jc.is_literal(val.atom):
            return float(jc.literal_value(val.atom))
        at = self.producer(val)
        if at is not None and at.name in ("broadcast_in_dim", "convert_element_type", "reshape"):
            x = self.literal(at.operand(0))  # a broadcast of a broadcast of a scalar...
            if x is not None and at.name == "convert_element_type":
                return float(jc.to_numpy_dtype(x, at.eqn.params["new_dtype"]))
            return x
        if at is not None and at.name in FOLDED:
            xs = [self.literal(at.operand(i)) for i in range(len(at.eqn.invars))]
            if any(x is None for x in xs):
                return None
            args = [np.asarray(x, v.aval.dtype) for x, v in zip(xs, at.eqn.invars, strict=True)]
            with jax.ensure_compile_time_eval():  # a number now, not an equation of a trace
                return float(np.asarray(at.eqn.primitive.bind(*args, **at.eqn.params)))
        return None
