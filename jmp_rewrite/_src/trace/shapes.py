"""Decisions taken from shapes, safe with symbolic dimensions (``jax.export``).

A shape-polymorphic program (``jax.export.symbolic_shape("b, 16")``) has dimensions that are
symbolic expressions. JAX decides ``<``/``>=`` between them only when the answer holds for
every value of the symbols (each at least 1) and raises ``InconclusiveDimensionOperation``
otherwise: ``64 < 64*b`` fails because it is false at ``b = 1``. ``==`` never raises (it is
syntactic: ``b == 1`` is False), so equal-shape tests are left as they are. Every other
decision the painter, the emitter and ``explain`` take from shapes -- a broadcast operand, a
zero-trip loop, a trip count, a tensor-core multiple, a share of FLOPs, a sort by size --
goes through these helpers, which answer from the structure when a comparison is
inconclusive, never by raising. Counts (sizes, FLOPs, bytes) stay symbolic expressions
(``4096*b + 64``): exact, printed as such.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import jax

#: A dimension or a count: an ``int`` or a symbolic expression of ``jax.export``.
Dim = Any

_INCONCLUSIVE = jax.errors.InconclusiveDimensionOperation


def is_static(d: Dim) -> bool:
    """Whether ``d`` is a known integer (not a symbolic expression)."""
    return not jax.export.is_symbolic_dim(d)


def dim(d: Any) -> Dim:
    """``d`` as an ``int`` when it is known (``np.int64``, ...), else the symbolic expression."""
    return int(d) if is_static(d) else d


def size(shape: Iterable[Dim]) -> Dim:
    """The number of elements of ``shape``: an ``int``, or a symbolic expression."""
    return math.prod(shape)


def static_size(shape: Iterable[Dim]) -> int | None:
    """The number of elements of ``shape`` when every dimension is known, else None."""
    n = size(shape)
    return int(n) if is_static(n) else None


def is_zero(d: Dim) -> bool:
    """Whether ``d`` is certainly 0 (a zero-trip loop, an empty array). A symbolic expression
    is never certainly 0: an expression that is 0 for every value of its symbols normalises
    to the ``int`` 0."""
    return is_static(d) and int(d) == 0


def _less(a: Dim, b: Dim) -> bool | None:
    """``a < b`` when it is decided, None when it is inconclusive."""
    try:
        return bool(a < b)
    except _INCONCLUSIVE:
        return None


def size_less(a: Sequence[Dim], b: Sequence[Dim]) -> bool:
    """Whether shape ``a`` has fewer elements than shape ``b`` (an operand broadcast into an
    elementwise op's output). Inconclusive (``[1, 64]`` against ``[b, 64]``): dimension by
    dimension from the right, as broadcasting aligns them; ``a`` is smaller when one of its
    dimensions is 1 (or smaller) where ``b``'s is symbolic (or larger), and none is larger.
    At ``b = 1`` that broadcast is trivial, but the decision it feeds (a float32 tangent
    rule) is harmless there, while missing a real one would accumulate a bias gradient in
    half precision."""
    decided = _less(size(a), size(b))
    if decided is not None:
        return decided
    smaller = len(a) < len(b)
    for x, y in zip(reversed(a), reversed(b), strict=False):
        if x == y:
            continue
        if _is_one(x) or _less(x, y):
            smaller = True
        else:  # larger, or neither decided (b against t): not certainly smaller
            return False
    return smaller


def _is_one(d: Dim) -> bool:
    return is_static(d) and int(d) == 1


def multiple_of(d: Dim, k: int) -> bool | None:
    """Whether ``d`` is a multiple of ``k``; None when it depends on the symbols (``b``
    against 8, while ``8*b`` is one)."""
    rem = d % k
    return int(rem) == 0 if is_static(rem) else None


def ratio(part: Dim, whole: Dim) -> float | None:
    """``part / whole`` as a number; None when ``whole`` is 0 or the ratio depends on the
    symbols. Exact where the structure decides it: all of it (``part == whole``) is 1.0,
    none of it 0.0."""
    if is_static(whole) and int(whole) == 0:
        return None
    if is_static(part) and is_static(whole):
        return int(part) / int(whole)
    if part == whole:
        return 1.0
    if is_static(part) and int(part) == 0:
        return 0.0
    return None


def descending(n: Dim) -> tuple[int, Any]:
    """A sort key putting larger counts first: symbolic counts (which grow with the batch or
    sequence length) before known ones, among themselves by their text."""
    return (1, -int(n)) if is_static(n) else (0, str(n))


def fmt(n: Dim) -> str:
    """A count for a person: ``1,048,576``, or the expression, ``4096*b + 64``."""
    return f"{int(n):,}" if is_static(n) else str(n)


def jsonable(value: Any) -> Any:
    """``value`` with every symbolic expression (nested in tuples, lists and dicts) as its
    text, for JSON."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(jsonable(v) for v in value)
    return value if is_static(value) else str(value)
