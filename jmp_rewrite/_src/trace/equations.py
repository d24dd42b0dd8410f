"""What the painter knows of one equation: its list key, its float types, the jaxprs it holds.

TF's per-node questions, asked of a jaxpr equation: which list entry it is (``op_key``: a
primitive name, or a virtual key such as ``square``, ``outer_product`` or a fused
``jit:log_softmax``), whether it is TF's ``IsFloat32``, whether it belongs to a backward
pass, and whether the jaxprs it holds contain ops to paint.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src.lists.op_lists import dot_general_key, integer_pow_key
from jmp_rewrite._src.trace import higher_order as ho

#: Leaf primitives whose params hold a dtype-specific jaxpr (a reduction region) but that
#: jmp_rewrite knows how to re-emit at another dtype through a public ``jax.lax`` function.
SCATTER_REBUILDERS = ("scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max")
SCATTER_FUNS = {
    "scatter-add": lax.scatter_add,
    "scatter-sub": getattr(lax, "scatter_sub", None),
    "scatter-mul": lax.scatter_mul,
    "scatter-min": lax.scatter_min,
    "scatter-max": lax.scatter_max,
}


def rebuild_scatter(eqn: Any, invals: list[Any]) -> Any:
    """A painted scatter re-emitted in its operands' dtypes (its ``update_jaxpr`` was traced
    at the original ones)."""
    fun = SCATTER_FUNS.get(eqn.primitive.name)
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


_UNIT_NAME = re.compile(r"^(?:\w+\()*([A-Za-z_][\w]*)\)*$")


def is_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def is_f32(dtype: Any) -> bool:
    return is_float(dtype) and np.dtype(dtype) == np.float32


def is_complex(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.complexfloating)


def touches_complex(eqn: Any) -> bool:
    """Whether an equation reads or gives a complex value. JAX shares ``abs``,
    ``convert_element_type`` and ``dot_general`` between real and complex values; TF's
    complex ops (ComplexAbs, Real, a Cast from complex) are on no list: there is no half
    complex type, and a float32 part of a complex value is never rounded on its own."""
    return any(is_complex(a.aval.dtype) for a in [*eqn.invars, *eqn.outvars])


def unit_name(jit_name: str) -> str:
    """``transpose(jvp(log_softmax))`` -> ``log_softmax``."""
    match = _UNIT_NAME.match(jit_name or "")
    return match.group(1) if match else (jit_name or "")


def in_backward_pass(outer: bool, eqn: Any) -> bool:
    """Whether ``eqn`` belongs to a backward pass, ``outer`` telling whether the equation
    holding its jaxpr does: JAX names the transposed equations ``transpose(...)`` in their
    name stack, and a rematerialised forward inside the backward ``rematted_computation``."""
    stack = jc.name_stack(eqn)
    return (outer or "transpose(" in stack) and "rematted_computation" not in stack


def op_key(eqn: Any, lists: Any, backward: bool = False) -> str:
    """The list key of an equation: its primitive name, or a virtual key.

    ``integer_pow`` is split by exponent, as TF has separate Reciprocal, Square and Pow ops;
    a ``dot_general`` that contracts nothing is an ``outer_product`` (TF Mul, infer);
    a ``jit`` whose name is on a list (``jit:softplus``) is one fused op. Its transpose (JAX
    keeps the name ``log_softmax`` under a ``transpose(jvp())`` name stack: ``backward``) is
    not: TF's gradients of fused ops are separate ops (LogSoftmax's is Exp, Sum, Mul, Sub,
    with Exp deny), so the backward pass is painted primitive by primitive.
    """
    name = eqn.primitive.name
    if name == "integer_pow":
        return integer_pow_key(eqn.params["y"])
    if name == "dot_general":
        return dot_general_key(eqn.params["dimension_numbers"])
    if ho.jit_name(eqn) and not backward and "transpose(" not in ho.jit_name(eqn):
        unit = "jit:" + unit_name(ho.jit_name(eqn))
        if lists.kind(unit) != "unlisted":
            return unit
    return name


def _float_atoms(atoms: Any) -> list[Any]:
    return [a for a in atoms if is_float(a.aval.dtype)]


def eqn_is_float32(eqn: Any) -> bool:
    """TF's ``IsFloat32``: every float value in or out is float32, there is one, and no
    complex value is (see :func:`touches_complex`)."""
    dtypes = [a.aval.dtype for a in _float_atoms([*eqn.invars, *eqn.outvars])]
    return bool(dtypes) and all(is_f32(d) for d in dtypes) and not touches_complex(eqn)


def has_jaxpr_param(eqn: Any) -> bool:
    """Whether an equation holds a jaxpr in its params (directly or in a tuple)."""
    return bool(ho.held_jaxprs(eqn))


def sealed(eqn: Any) -> bool:
    """Whether an equation holds a body that is no program of arrays: one that takes, gives
    or closes over a mutable Ref (a Pallas kernel, ``run_state``, a loop or ``jit`` writing a
    ``jax.new_ref`` array), a token or another abstract value. JAX runs such a body against
    state (a kernel's grid, its buffers), not as a function of values, so it cannot be traced
    again at other dtypes; and a kernel is its author's precision decision. The equation
    runs as written, its operands in the dtypes it was traced with."""
    return any(not jc.is_array_aval(v.aval) for b in ho.held_jaxprs(eqn) for v in _boundary(b))


def reads_refs(eqn: Any) -> bool:
    """Whether an equation reads a Ref (or another value that is no array, a token): what it
    reads is whatever was last written there, which the graph's dataflow does not follow."""
    return any(not jc.is_array_aval(a.aval) for a in eqn.invars)


def _boundary(body: Any) -> list[Any]:
    inner = jc.open_jaxpr(body)
    return [*inner.constvars, *inner.invars, *inner.outvars]


def holds_allow_ops(eqn: Any, lists: Any) -> bool:
    """Whether the jaxprs ``eqn`` holds (at any depth) contain a float32 allowlist op that
    the rewrite would paint (none in a :func:`sealed` equation)."""
    if sealed(eqn):
        return False
    for body in ho.held_jaxprs(eqn):
        for inner in jc.open_jaxpr(body).eqns:
            if lists.kind(op_key(inner, lists)) == "allow" and eqn_is_float32(inner):
                return True
            if holds_allow_ops(inner, lists):
                return True
    return False


def false_at_once(layout: Any, atoms: list[Any]) -> bool:
    """Whether a ``while`` loop's condition is false on its initial values, known when they
    are literals (``while_loop(lambda c: c[0] < n, body, (0, x))`` with a literal ``n``).

    What the condition reads (an operand of its equations, or an output: ``lambda c: c[0]``)
    must be a literal; a carry it does not read -- an activation, a PRNG key, a token, one of
    a symbolic shape -- is passed as ``None``, which no equation looks at (a placeholder of
    the carry's dtype cannot be made for a key or a token)."""
    cond = layout.body("cond")
    inner = jc.open_jaxpr(cond)
    read = {a for e in inner.eqns for a in e.invars if not jc.is_literal(a)}
    read |= {a for a in inner.outvars if not jc.is_literal(a)}
    args = []
    for var, atom in zip(inner.invars, atoms, strict=True):
        if jc.is_literal(atom):
            args.append(jc.literal_value(atom))
        elif var in read:
            return False
        else:
            args.append(None)
    with jax.ensure_compile_time_eval():  # concrete, also while a jit traces the program
        (keep_going,) = jc.eval_jaxpr(cond, *args)
        return not np.asarray(keep_going).any()
