"""Derivatives of half-precision equations taken in float32.

The rewrite emits a half equation; ``jax.grad(rewrite(f))`` differentiates what it emitted.
Two kinds of half equation get their derivative from float32 instead (``float32_tangents``):

* one whose transpose accumulates (:data:`TRANSPOSE_ACCUMULATES`): summed in half, an
  embedding's or a bias's gradient would stall;
* one reading an operand that its way into half saturated (a literal ``-1e9`` clamped to
  ``-65504``, a big value pinned: see ``masking``): its derivative reads the operand's
  float32 value, as the program's does. ``d(m * -1e9)/dm`` is ``-1e9`` times the cotangent,
  beyond the half range: it overflows, as ``rewrite(grad(f))`` does, and loss scaling sees
  it; a zero cotangent stays 0. :class:`Unsaturated` knows those float32 values.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src.emit.custom_rules import cast
from jmp_rewrite._src.emit.masking import MOVES_FIRST, SCALE_FREE_TANGENTS
from jmp_rewrite._src.trace import higher_order as ho
from jmp_rewrite._src.trace import shapes
from jmp_rewrite._src.trace.equations import is_float
from jmp_rewrite._src.trace.origins import beyond

#: Leaf primitives whose transpose accumulates: a gather's is a scatter-add (an embedding
#: gradient), an expanding broadcast's a sum (a bias gradient), and so is an elementwise op's
#: whose operand broadcasts implicitly (a size-1 dimension: ``x @ w + b`` adds a ``[1, n]``
#: bias). Differentiating the rewritten program (``jax.grad(rewrite(f))``) would accumulate
#: them in half precision.
TRANSPOSE_ACCUMULATES = ("gather", "broadcast_in_dim", "add", "sub", "mul", "div", "max", "min")


#: Equations whose result, where an operand saturated, stands for the same equation of the
#: operands' float32 values (see :meth:`Unsaturated.hand_on`): casts, moves and choices of
#: elements, whichever operand moved (``concatenate``, ``pad``, ``select_n`` read several).
HANDS_ON = MOVES_FIRST | {"convert_element_type", "concatenate", "pad", "select_n", "tile"}
HANDS_ON |= {"dynamic_update_slice"}


def transpose_accumulates(eqn: Any, const: Sequence[bool]) -> bool:
    """Whether ``eqn`` (operands constant where ``const``) is one of
    :data:`TRANSPOSE_ACCUMULATES` whose transpose accumulates here."""
    if eqn.primitive.name not in TRANSPOSE_ACCUMULATES:
        return False
    if eqn.primitive.name == "gather":
        return not const[0]
    out = eqn.outvars[0].aval.shape
    return any(
        is_float(a.aval.dtype) and not const[i] and shapes.size_less(a.aval.shape, out)
        for i, a in enumerate(eqn.invars)
    )


class Unsaturated:
    """The float32 values of the operands that half saturated, for their readers'
    derivatives: a literal beyond the range, a big float32 value cast into half, and what a
    half cast or move of one stands for (``(1 - m) * jnp.full(s, -1e9)`` casts the fill)."""

    def __init__(self, half: Any):
        self.limit = float(jnp.finfo(half).max)
        #: id(half value) -> (it, its float32 value or a function computing it)
        self._of: dict[int, tuple[Any, Any]] = {}

    def value(self, atom: Any, raw: Any, saturating: bool, narrowed: bool) -> Any:
        """The float32 value of operand ``atom`` (held as ``raw``: a literal's value, the
        value in the environment) where its way into half saturated it, else None; a
        function computing it where a cast or move stands for it (see :func:`forced`).
        ``saturating``: it is clamped or pinned when cast (frozen or big); ``narrowed``:
        ``raw`` is cast into half on the way."""
        if not saturating or not is_float(atom.aval.dtype):
            return None
        if jc.is_literal(atom):
            return raw if beyond(raw, self.limit) else None
        if id(raw) in self._of:  # a function computing it, when a derivative reads it
            return self._of[id(raw)][1]
        return raw if narrowed else None

    def hand_on(self, eqn: Any, outs: Sequence[Any], invals: Sequence[Any], saturated: Any) -> None:
        """A half cast, move or choice ``eqn`` (:data:`HANDS_ON`, or a call of only those) of
        operands ``invals``, of float32 values ``saturated`` where half saturated them (None
        elsewhere; None: none did): its half outputs ``outs`` stand for the same equation of
        the float32 values, its other float operands cast back to the program's dtypes (a
        ``concatenate`` of a fill and a computed value, a ``pad`` by a fill, ``jnp.flip``'s
        call)."""
        if not saturated or all(s is None for s in saturated) or not hands_on(eqn):
            return

        def up(atom: Any, v: Any, s: Any) -> Any:  # in the program's dtype (a call's body's)
            if s is not None:
                return forced(s)
            return cast(v, atom.aval.dtype) if is_float(jnp.result_type(v)) else v

        bound: list[Any] = []

        def value(k: int) -> Any:  # not bound unless read: most casts are never differentiated
            if not bound:
                ups = [up(*t) for t in zip(eqn.invars, invals, saturated, strict=True)]
                bound.extend(ho.bind(eqn, ups, eqn.params))
            return bound[k]

        for k, out in enumerate(outs):
            if is_float(jnp.result_type(out)) and jnp.result_type(out) != np.float32:
                self._of[id(out)] = (out, functools.partial(value, k))


def forced(value: Any) -> Any:
    """A float32 value :meth:`Unsaturated.value` gave: computed now if it was held as the
    function computing it (a forward pass that no derivative reads binds none of them)."""
    return value() if callable(value) else value


def hands_on(eqn: Any) -> bool:
    """Whether ``eqn`` is one of :data:`HANDS_ON` or a call whose body is only those."""
    name = eqn.primitive.name
    if name in HANDS_ON:
        return True
    layout = ho.describe(eqn)
    return layout is not None and layout.kind == ho.CALL and all(map(hands_on, layout.inner().eqns))


def reads_magnitude(eqn: Any) -> bool:
    """Whether ``eqn``'s derivative reads its operands' values (not a sum, choice, move)."""
    return eqn.primitive.name not in SCALE_FREE_TANGENTS


def float32_tangents(
    eqn: Any, invals: list[Any], params: dict[str, Any], saturated: Any = None
) -> list[Any]:
    """Binds a half-precision equation whose derivative runs in float32: the primal is
    computed in half, tangents (and so, transposed, the cotangents that accumulate) in
    float32, cast to half at the end. Forward and reverse mode both work. Every operand is
    an argument (indices too: a closure over tracers would leak them into the jaxpr).

    ``saturated``: per operand, its float32 value where half saturated it (None elsewhere);
    the derivative reads that value (see the module docstring)."""
    n = len(invals)
    true = [i for i, s in enumerate(saturated or ()) if s is not None]

    def call(*args: Any) -> Any:
        return ho.bind(eqn, list(args[:n]), params)[0]

    def call32(*args: Any) -> Any:  # the program's own equation, in float32
        return ho.bind(eqn, list(args), eqn.params)[0]

    fun = jax.custom_jvp(call)

    @fun.defjvp
    def fun_jvp(primals, tangents):
        out = fun(*primals)
        values = dict(zip(true, primals[n:], strict=True))
        up = [cast(values.get(i, v), np.float32) for i, v in enumerate(primals[:n])]
        t_up = [
            cast(t, np.float32) if is_float(jnp.result_type(p)) else t
            for p, t in zip(primals[:n], tangents[:n], strict=True)
        ]
        _, t_out = jax.jvp(call32, up, t_up)
        return out, cast(t_out, jnp.result_type(out))

    return [fun(*invals, *(jnp.asarray(forced(saturated[i]), np.float32) for i in true))]
