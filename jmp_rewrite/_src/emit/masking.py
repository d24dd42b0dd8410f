"""Where a constant put a big value beyond the half range, and with which sign.

A *big* value (``Origin.big``: a mask fill beyond the half range, the bias built from it,
the scores it was added to, what keeps their magnitude downstream) holds, in half
precision, the half type's largest finite value with the constant's sign wherever the
constant put it out of range: ``s + (1 - m) * finfo(float32).min`` is ``-65504`` in float16
at every masked element, whatever ``s`` is there (a fully masked softmax row stays uniform,
as in float32, where a half ``s - 65504`` would round some elements to ``-inf`` and others
not); an element the constant did not put out of range is computed as written and
overflows honestly (``exp(x) + (1 - m) * -1e9`` in float16: ``inf`` where ``m = 1`` and
``exp(x)`` overflowed, ``-65504`` where ``m = 0``).

Each element's *flag* (-1, 0 or +1) says where and which way. It starts where a constant
holds a finite value beyond the range (a literal, a captured array, a frozen value: the
constant is the value), and each big equation hands it on: a sum its big operand's, a choice
or a maximum the chosen operand's, a product (or quotient, a negation, a cast) the sign of
its result where that is still beyond the range (``(1 - m) * -1e9`` is 0, and no longer
flagged, where ``m = 1``; ``(s - 65504) / 8`` is back in range), data movement moves it. A
value whose flag was not handed on (read inside another body than the one that computed it:
a loop body, a call) is flagged where it is beyond the range (for a half value: at its
largest finite value, the saturated elements). A ``cond`` hands its big outputs' flags out of
its branches (``Flags.of_output``): an output that is a fill in one branch and ``exp(x)``
in the other is pinned only where the fill was taken.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src.trace.equations import is_float
from jmp_rewrite._src.trace.higher_order import bind

#: A sum holds its big operand's value (``sub`` negates its second operand's flag).
_SUMS = frozenset({"add", "sub", "add_any"})
#: Flagged where the result is still beyond the range, with the result's sign.
_SCALINGS = frozenset({"mul", "div", "neg", "convert_element_type"})
_SCALINGS |= {"reduce_precision", "abs", "floor", "ceil", "round"}
_SCALINGS |= {"integer_pow", "square", "reduce_sum", "cumsum"}
#: Data movement of the first operand (the others are indices or shapes): the flag moves so.
MOVES_FIRST = frozenset(
    {"reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim", "rev", "slice"}
    | {"dynamic_slice", "gather", "stop_gradient", "copy", "copy_p"}
)
#: Results whose flagged elements can differ from the half type's largest finite value:
#: only these are pinned (a choice, a move or a maximum hands on pinned elements as they are).
_PINNED = _SUMS | _SCALINGS
#: Equations whose derivative reads no operand's magnitude (sums, choices, moves): a
#: saturated operand changes only their value. Every other half equation reading a
#: saturated operand takes its derivative from the operand's float32 value
#: (``tangents.float32_tangents``): ``d(m * -1e9)/dm`` is ``-1e9``, not the ``-65504`` that
#: half holds, and overflows honestly, for loss scaling to see.
SCALE_FREE_TANGENTS = _SUMS | MOVES_FIRST | {"select_n", "max", "min", "concatenate", "pad"}
SCALE_FREE_TANGENTS |= {"convert_element_type", "reduce_precision", "reduce_sum", "cumsum"}
SCALE_FREE_TANGENTS |= {"reduce_max", "reduce_min", "dynamic_update_slice"}


class Flags:
    """The flags of the big values of one program run, computed only when asked."""

    def __init__(self, half: Any):
        self.half = np.dtype(half)
        self.limit = float(jnp.finfo(half).max)
        self._lazy: dict[int, tuple[Any, Callable[[], Any]]] = {}
        self._done: dict[int, tuple[Any, Any]] = {}

    def beyond(self, value: Any) -> Any:
        """The sign of ``value`` where it is finite and beyond the half range or at its
        largest finite value (a saturated element), 0 elsewhere."""
        v = jnp.asarray(value)
        a = jnp.abs(v)
        return jnp.where(jnp.isfinite(v) & (a >= self.limit), jnp.sign(v), 0).astype(np.int8)

    def known(self, value: Any) -> bool:
        """Whether ``value`` is a big equation's result (its flag handed on)."""
        return id(value) in self._lazy or id(value) in self._done

    def adopt(self, value: Any, flag: Any) -> None:
        """``value`` holds ``flag`` (handed out of the body that computed it)."""
        self._done[id(value)] = (value, flag)

    def of_output(self, scope: Any, env: dict[Any, Any], atom: Any, big: Any) -> Any:
        """The flag of a body's output ``atom`` (``env`` its values, ``big`` the painting's big
        nodes), to hand out of the body with it: the one its equation handed on; none (zeros)
        where an equation that keeps no constant's magnitude computed it (``exp(x)`` in one
        branch, a fill in the other: the computed branch overflows honestly); else wherever
        it is beyond the range (a value from outside the body: its flag did not come in)."""
        if jc.is_literal(atom):
            return jnp.broadcast_to(self.beyond(jc.literal_value(atom)), atom.aval.shape)
        val = env[atom]
        if self.known(val):
            return jnp.broadcast_to(self.of(val), jnp.shape(val))
        rec = next(
            (r for e, r in zip(scope.jaxpr.eqns, scope.eqns, strict=True) if atom in e.outvars),
            None,
        )
        if rec is not None and rec.kind == "leaf" and rec.node not in big:
            return jnp.zeros(jnp.shape(val), np.int8)
        return self.beyond(val)

    def of(self, value: Any) -> Any:
        """``value``'s flag: the one its equation handed on, else :meth:`beyond`."""
        key = id(value)
        if key not in self._done:
            flag = self._lazy[key][1]() if key in self._lazy else self.beyond(value)
            self._done[key] = (value, flag)
        return self._done[key][1]

    def record(
        self, eqn: Any, invals: Sequence[Any], big: Sequence[bool], out: Any
    ) -> Callable[[], Any]:
        """The flag of ``eqn``'s result ``out`` from its big operands' (a thunk)."""
        name = eqn.primitive.name
        shape = jnp.shape(out)

        def operand_flags() -> list[Any]:
            return [
                jnp.broadcast_to(self.of(v), jnp.shape(v))
                if b and is_float(jnp.result_type(v))
                else None
                for v, b in zip(invals, big, strict=True)
            ]

        def zero_if_none(f: Any, like_shape: Any = shape) -> Any:
            return jnp.zeros(like_shape, np.int8) if f is None else f

        def thunk() -> Any:
            flags = operand_flags()
            if name in _SUMS:
                got = [
                    (-f if name == "sub" and i == 1 else f)
                    for i, f in enumerate(flags)
                    if f is not None
                ]
                if not got:
                    return self.beyond(out)
                flag = jnp.broadcast_to(got[0], shape)
                for f in got[1:]:  # opposite signs cancel (``x - max(x)`` of a masked row)
                    f = jnp.broadcast_to(f, shape)
                    flag = jnp.where(flag == 0, f, jnp.where(f == -flag, 0, flag))
                return flag.astype(np.int8)
            if name in _SCALINGS:
                flagged = [jnp.broadcast_to(f != 0, shape) for f in flags if f is not None]
                if not flagged or name in ("reduce_sum", "cumsum"):
                    return self.beyond(out)
                any_flag = flagged[0]
                for f in flagged[1:]:
                    any_flag = any_flag | f
                return jnp.where(any_flag, self.beyond(out), 0).astype(np.int8)
            if name in ("max", "min") and len(invals) == 2:
                f0, f1 = (jnp.broadcast_to(zero_if_none(f), shape) for f in flags)
                return jnp.where(out == jnp.broadcast_to(invals[0], shape), f0, f1)
            if name == "select_n":
                cases = [jnp.broadcast_to(zero_if_none(f), shape) for f in flags[1:]]
                return lax.select_n(invals[0], *cases)
            if name in MOVES_FIRST and flags[0] is not None:
                return bind(eqn, [flags[0], *invals[1:]], eqn.params)[0]
            if name in ("reduce_max", "reduce_min") and flags[0] is not None:
                axes = tuple(eqn.params["axes"])
                # a row's maximum is a negative fill only where every element is one
                lo, hi = jnp.all(flags[0] < 0, axis=axes), jnp.any(flags[0] > 0, axis=axes)
                if name == "reduce_min":
                    lo, hi = jnp.any(flags[0] < 0, axis=axes), jnp.all(flags[0] > 0, axis=axes)
                return jnp.where(hi, 1, jnp.where(lo, -1, 0)).astype(np.int8)
            return self.beyond(out)  # not handed on: wherever it is beyond the range

        return thunk

    def pinned(self, eqn: Any, invals: Sequence[Any], big: Sequence[bool], out: Any) -> Any:
        """A big equation's result ``out``; in half precision, its flagged elements at the
        half type's largest finite value with their flag's sign (see the module docstring)."""
        if any(out is v for v in invals):  # handed on as it is: its flag too
            return out
        thunk = self.record(eqn, invals, big, out)
        if jnp.result_type(out) != self.half or eqn.primitive.name not in _PINNED:
            self._lazy[id(out)] = (out, thunk)
            return out
        flag = thunk()
        pinned = pin(out, flag, self.limit)
        self._done[id(pinned)] = (pinned, flag)
        return pinned

    def in_range(self, value: Any) -> Any:
        """A float32 big ``value`` ready for its cast into half: its flagged elements at the
        half type's largest finite value with their flag's sign, the rest as they are."""
        return pin(value, self.of(value), self.limit)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def pin(value: Any, flag: Any, limit: float) -> Any:
    """``value`` at ``flag * limit`` where ``flag`` is not 0."""
    return jnp.where(flag != 0, (flag * limit).astype(jnp.result_type(value)), value)


# Why: a big value may be differentiated (a float mask's gradient through its bias); pinning
# changes where its value is read in half, not its derivative, which stays float32's (a
# constant's would be zero where it is pinned).
pin.defjvp(lambda limit, primals, tangents: (pin(*primals, limit), tangents[0]))
