"""Half precision's range for values the program did not compute.

A constant, a literal or a frozen value (``jnp.finfo(jnp.float32).min`` as an attention
mask, a mask bias built from an integer mask: see ``origins.Origin``) is clamped to the half
dtype's largest finite value when a forward equation casts it to half, instead of becoming
infinite (an infinite mask turns a fully masked softmax row into NaN); a big value, where the
constant put it out of range (``masking``). Computed values are not clamped: they overflow
honestly, so that loss scaling sees the overflow.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _fits(src: Any, dtype: Any) -> bool:
    """Whether every finite value of dtype ``src`` lies in the range of float ``dtype``."""
    src = np.dtype(src)
    if src == np.bool_:
        return True
    info = jnp.iinfo(src) if jnp.issubdtype(src, jnp.integer) else jnp.finfo(src)
    half = jnp.finfo(dtype)
    return float(info.max) <= float(half.max) and float(info.min) >= float(half.min)


def clamp(value: Any, dtype: Any) -> Any:
    """A frozen value's finite values (a constant's, a mask bias's: see ``Origin.frozen``)
    clamped to the range of the half ``dtype`` (infinities and NaN kept), in its own dtype.
    A concrete constant (a captured array) is checked and clamped now, once, so nothing is
    added to the program when it is in range; nor is anything for a dtype within the range
    (a boolean, an int16)."""
    if _fits(jnp.result_type(value), dtype):
        return value
    info = jnp.finfo(dtype)
    lo, hi = float(info.min), float(info.max)
    if isinstance(value, jax.core.Tracer):  # computed inside the program
        if jnp.issubdtype(jnp.result_type(value), jnp.integer):  # clipped as an integer
            d = jnp.result_type(value)
            return lax.clamp(np.asarray(int(lo), d), value, np.asarray(int(hi), d))
        return saturate(value, lo, hi)
    with jax.ensure_compile_time_eval():
        if isinstance(value, jax.Array):
            big = jnp.isfinite(value) & ((value < lo) | (value > hi))
            if not bool(jnp.any(big)):
                return value
            return jnp.where(big, jnp.clip(value, lo, hi), value)
    value = np.asarray(value)
    return np.where(np.isfinite(value), np.clip(value, lo, hi), value).astype(value.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def saturate(value: Any, lo: float, hi: float) -> Any:
    return jnp.where(jnp.isfinite(value), jnp.clip(value, lo, hi), value)


# Why: a big value (``(1.0 - m) * -1e9``, see ``origins.big_seed``) may be differentiated
# (a float mask's gradient); saturating changes where its value is read in half, not its
# derivative, which stays float32's (a clip's would be zero where it clips).
saturate.defjvp(lambda lo, hi, primals, tangents: (saturate(primals[0], lo, hi), tangents[0]))


def literal(value: Any, dtype: Any, clamped: bool = True) -> Any:
    """A float literal in ``dtype``, converted in place. A finite literal beyond the range of
    ``dtype`` read by a forward equation (``clamped``) is clamped to its largest finite value
    rather than becoming infinite: such constants are mask fills (``jnp.finfo(
    jnp.float32).min``), and an infinite mask turns a fully masked softmax row into NaN. In a
    backward equation it is a cotangent's factor, and overflows honestly."""
    value = np.asarray(value)
    return np.asarray(clamp(value, dtype) if clamped else value, dtype=dtype)
