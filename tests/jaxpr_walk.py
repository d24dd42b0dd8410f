"""Small helpers for tests that inspect emitted jaxprs (recursing into sub-jaxprs)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def sub_jaxprs(eqn: Any) -> Iterator[Any]:
    for value in eqn.params.values():
        for v in value if isinstance(value, tuple) else (value,):
            if hasattr(v, "eqns"):
                yield v
            elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                yield v.jaxpr


def all_eqns(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` (closed or open), sub-jaxprs included, in order."""
    jaxpr = jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") and hasattr(jaxpr.jaxpr, "eqns") else jaxpr
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn):
            yield from all_eqns(sub)


def scopes(jaxpr: Any) -> Iterator[Any]:
    """``jaxpr`` and every sub-jaxpr (open)."""
    jaxpr = jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") and hasattr(jaxpr.jaxpr, "eqns") else jaxpr
    yield jaxpr
    for eqn in jaxpr.eqns:
        for sub in sub_jaxprs(eqn):
            yield from scopes(sub)


def float_in_dtypes(eqn: Any) -> list[np.dtype]:
    return [
        np.dtype(a.aval.dtype) for a in eqn.invars if jnp.issubdtype(a.aval.dtype, jnp.floating)
    ]


def runs_in_half(eqn: Any) -> bool:
    dtypes = float_in_dtypes(eqn)
    return bool(dtypes) and all(d in HALF for d in dtypes)


def prims(jaxpr: Any, name: str) -> list[Any]:
    return [e for e in all_eqns(jaxpr) if e.primitive.name == name]


def casts(jaxpr: Any) -> list[Any]:
    return prims(jaxpr, "convert_element_type")


def emitted(fun: Any, *args: Any, **kwargs: Any) -> Any:
    return jax.make_jaxpr(fun)(*args, **kwargs)
