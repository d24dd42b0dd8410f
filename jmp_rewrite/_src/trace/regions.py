"""Float32 regions: code the mixed-precision painter never converts.

TF escapes painting its optimizer updates only because its optimizers are fused ops that are
on no list. In JAX an optax update is a handful of ``mul``/``add``/``sqrt``/``div``
equations, all *infer* ops, so TF's pass 4 would paint Adam's moments half precision when the
update follows a weight-gradient matmul. A float32 region is the escape hatch: every equation
traced inside it (including bodies of the calls it makes) keeps its float32 dtype, and float
inputs that arrive in half precision are cast back to float32 on entry. This is the analogue
of ``torch.autocast(enabled=False)``.

Regions are marked with a ``jax.named_scope`` (the marker, then the function's name, which
``explain`` shows as ``float32_region(NAME)``); outside a rewrite they cost nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax

#: Name-stack marker recognised by the painter.
FLOAT32_REGION_SCOPE = "jmp_rewrite_float32_region"

F = TypeVar("F", bound=Callable[..., Any])


def float32_region(fun: F) -> F:
    """Marks ``fun`` as a float32 region that :func:`jmp_rewrite.rewrite` never converts.

    Every equation ``fun`` traces (including those inside the ``jit``, ``cond`` and loop
    calls it makes) runs in its original dtype in the rewritten program; half-precision values
    flowing in are cast to float32 at the boundary. Outside a rewrite the wrapper is a no-op.

    Args:
      fun: any callable that traces JAX operations, e.g. an optax ``update`` function.

    Returns:
      A callable with the same signature and results as ``fun``.

    Raises:
      TypeError: if ``fun`` is not callable.

    Example:
      >>> import jax.numpy as jnp
      >>> import jmp_rewrite
      >>> @jmp_rewrite.float32_region
      ... def adam_like(m, g):
      ...   return 0.9 * m + 0.1 * g
      >>> adam_like(jnp.zeros(2), jnp.ones(2)).dtype
      dtype('float32')
    """
    if not callable(fun):
        raise TypeError(f"float32_region expects a callable, got {type(fun).__name__}: {fun!r}")

    name = getattr(fun, "__name__", None) or type(fun).__name__

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with jax.named_scope(FLOAT32_REGION_SCOPE), jax.named_scope(name):
            return fun(*args, **kwargs)

    return wrapped  # type: ignore[return-value]


def region_names(names: tuple[str, ...]) -> tuple[str, ...]:
    """Scope components with each region marker and the function name after it joined into
    one readable component: ``(FLOAT32_REGION_SCOPE, "update")`` -> ``("float32_region(update)",)``.
    """
    out: list[str] = []
    i = 0
    while i < len(names):
        if names[i] == FLOAT32_REGION_SCOPE:
            fn = names[i + 1] if i + 1 < len(names) else "?"
            out.append(f"float32_region({fn})")
            i += 2
        else:
            out.append(names[i])
            i += 1
    return tuple(out)


def in_float32_region(name_stack: str) -> bool:
    """Whether an equation's name stack places it inside a float32 region."""
    return FLOAT32_REGION_SCOPE in name_stack
