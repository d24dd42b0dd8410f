"""Custom derivative rules kept through the rewrite, by re-wrapping.

A painted ``custom_jvp_call``/``custom_vjp_call`` runs its body rewritten, but its derivative
is the *original* rule, evaluated in float32: ``jax.nn.relu``'s gradient at 0, a user's
backward pass, odeint's adjoint. The re-wrapped rule is asked what the original would be
asked, no more: only about the arguments that are perturbed (symbolic zeros), never about
the body's closed-over values (odeint's Runge-Kutta tableau: JAX refuses to differentiate a
``custom_vjp`` by them) nor about arguments a rule asserts are not perturbed (Equinox's
``filter_custom_vjp``). Every value is an argument: the rules close over no tracer.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.dtypes import float0

from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src.trace import higher_order as ho
from jmp_rewrite._src.trace import shapes
from jmp_rewrite._src.trace.graph import is_float
from jmp_rewrite._src.trace.higher_order import bind


def rewrap(em: Any, eqn: Any, rec: Any, invals: list[Any]) -> list[Any]:
    """Re-wraps a custom derivative so its rule runs as written, in the original dtypes.

    The original rule is asked about the arguments that are perturbed, no more (symbolic
    zeros): never about the body's closed-over values (the ``consts`` group: odeint's
    Runge-Kutta tableau, an array a ``custom_vjp`` closes over), which JAX refuses to
    differentiate a ``custom_vjp`` by (``CustomVJPException``), nor about arguments a
    rule asserts are not perturbed (Equinox's ``filter_custom_vjp``). Every value is an
    argument: the rules close over no tracer."""
    scope = rec.subs["body"]
    consts = jc.consts_of(rec.layout.body())
    n_closed = rec.layout.size("consts")
    orig_in = [a.aval.dtype for a in eqn.invars]

    def body(*args: Any) -> tuple[Any, ...]:
        return tuple(em.run_traced(scope, consts, args))

    name = body.__name__ = jc.function_name(rec.layout.inner())

    def original(*args: Any) -> list[Any]:
        return bind(eqn, list(args), eqn.params)

    def to_original(values: Sequence[Any]) -> list[Any]:
        return [cast(v, d) for v, d in zip(values, orig_in, strict=True)]

    if rec.kind == ho.CUSTOM_JVP:
        fun = jax.custom_jvp(body)

        def fun_jvp(primals, tangents):
            out = body(*primals)
            orig = to_original(primals)
            live = [i for i, t in enumerate(tangents) if not _is_zero(t)]
            tangents = [cast(tangents[i], orig_in[i]) for i in live]
            _, tout = jax.jvp(_partial_in(original, orig, live), [orig[i] for i in live], tangents)
            return out, tuple(_cast_like(t, o) for t, o in zip(tout, out, strict=True))

        fun.defjvp(fun_jvp, symbolic_zeros=True)
    else:
        fun = jax.custom_vjp(body)
        in_dtypes = [jnp.result_type(v) for v in invals]
        orig_out = [v.aval.dtype for v in eqn.outvars]

        def fwd(*primals):
            values = [p.value for p in primals]
            live = tuple(i for i, p in enumerate(primals) if p.perturbed)
            if live and live[0] < n_closed:
                raise _closed_over_error(name)
            out = body(*values)
            orig = to_original(values)
            try:
                _, vjp_fn = jax.vjp(_partial_in(original, orig, live), *[orig[i] for i in live])
            except jax.errors.UnexpectedTracerError as e:
                raise _closure_error(name) from e
            # the perturbed positions ride along as static data of the residual
            return out, jax.tree_util.Partial(functools.partial(_spread, live, len(values)), vjp_fn)

        def bwd(spread, cts):
            cts = [cast(_instantiate(c), d) for c, d in zip(cts, orig_out, strict=True)]
            try:
                grads = spread(cts)
            except jax.errors.UnexpectedTracerError as e:
                raise _closure_error(name) from e
            return tuple(
                cast(g, d) if g is not None and is_float(d) else None
                for g, d in zip(grads, in_dtypes, strict=True)
            )

        fun.defvjp(fwd, bwd, symbolic_zeros=True)
    with em.staging():
        return list(fun(*invals))


def _is_zero(t: Any) -> bool:
    return isinstance(t, SymbolicZero)


def _instantiate(ct: Any) -> Any:
    """A cotangent with a symbolic zero made an array (float0 for an integer output)."""
    if not _is_zero(ct):
        return ct
    if ct.aval.dtype != float0:
        return jnp.zeros(ct.aval.shape, ct.aval.dtype)
    if all(shapes.is_static(d) for d in ct.aval.shape):
        return np.zeros(ct.aval.shape, float0)
    # no numpy array has a symbolic shape: broadcast a float0 scalar, as JAX's own zeros do
    return lax.broadcast(np.zeros((), float0), ct.aval.shape)


def _partial_in(fun: Any, values: Sequence[Any], live: Sequence[int]) -> Any:
    """``fun`` of the arguments at positions ``live``, the others fixed at ``values``."""

    def part(*live_values: Any) -> Any:
        full = list(values)
        for i, v in zip(live, live_values, strict=True):
            full[i] = v
        return fun(*full)

    return part


def _spread(live: tuple[int, ...], n: int, vjp_fn: Any, cts: Any) -> list[Any]:
    """The cotangents of all ``n`` arguments: ``vjp_fn``'s at ``live``, None elsewhere."""
    grads: list[Any] = [None] * n
    for i, g in zip(live, vjp_fn(cts), strict=True):
        grads[i] = g
    return grads


def _closed_over_error(name: str) -> Exception:
    return ValueError(
        f"the custom_vjp function {name!r} closes over a value that is being differentiated; "
        "JAX refuses this for the original function too (CustomVJPException). Pass the value "
        "to the custom_vjp function as an argument"
    )


def _closure_error(name: str) -> Exception:
    return ValueError(
        f"the custom_vjp rule of {name!r} reads a value computed inside the rewritten function "
        "(a closure over an intermediate array), which JAX cannot run once that function has "
        "been traced: jax.grad(jax.extend.core.jaxpr_as_fun(jax.make_jaxpr(f)(...))) fails the "
        "same way. Pass the value to the custom_vjp function as an argument (odeint does, "
        "through jax.closure_convert), or differentiate first: jmp_rewrite.rewrite(jax.grad(f))"
    )


def cast(value: Any, dtype: Any) -> Any:
    """``value`` in float ``dtype``; non-float values and dtypes pass through."""
    if not is_float(dtype) or not is_float(jnp.result_type(value)):
        return value
    if jnp.result_type(value) == np.dtype(dtype):
        return value
    return lax.convert_element_type(value, dtype)


def _cast_like(value: Any, like: Any) -> Any:
    return cast(value, jnp.result_type(like))
