"""Finiteness checks of (scaled) gradients: the first piece of the loss-scale optimizer.

:func:`check_finite` decides whether a step's gradients are all finite after unscaling,
agreeing across devices when given an ``axis_name``, and optionally records which leaves held
a NaN or an Inf (:class:`LossScaleDebugState`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

ArrayTree = Any
AxisName = Hashable | Sequence[Hashable]


class LossScaleDebugState(NamedTuple):
    """Which gradient leaves were non-finite at the last step (opt in with ``debug=True``).

    Leaves are numbered in ``jax.tree.leaves`` order of the gradients; see
    :func:`non_finite_leaves` for a readable report.

    Attributes:
      leaf_has_nan: bool vector, one entry per gradient leaf: the leaf held a NaN.
      leaf_has_inf: bool vector, one entry per gradient leaf: the leaf held +Inf or -Inf.
    """

    leaf_has_nan: jax.Array
    leaf_has_inf: jax.Array


def is_inexact(x: Any) -> bool:
    """Whether ``x`` is an array of a floating-point or complex dtype."""
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def unscale(g: Any, inv_scale: jax.Array) -> Any:
    """``g * inv_scale`` with real floating leaves in float32 (complex keeps its dtype)."""
    if not is_inexact(g):
        return g
    if jnp.issubdtype(g.dtype, jnp.floating):
        g = g.astype(jnp.float32)
    return g * inv_scale


def all_finite(tree: ArrayTree) -> jax.Array:
    """Whether every element of every floating-point leaf of ``tree`` is finite.

    NaN, +Inf and -Inf all count as non-finite. Integer and boolean leaves are ignored; an
    empty tree is finite.

    Args:
      tree: a pytree of arrays.

    Returns:
      A bool scalar array.

    Example:
      >>> import jax.numpy as jnp
      >>> import jmp_rewrite
      >>> bool(jmp_rewrite.all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}))
      False
    """
    checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if is_inexact(x)]
    if not checks:
        return jnp.array(True)
    return jnp.all(jnp.stack(checks))


def count_non_finite(
    leaves: list[Any], inv_scale: jax.Array, *, scale_at_least_one: bool, method: str = "auto"
) -> jax.Array:
    """Number of float leaves holding a NaN or an Inf after unscaling (int32 scalar).

    Two exact formulations:

    * ``"elementwise"``: ``any(~isfinite(g * inv_scale))``. XLA:GPU/TPU fuse the predicate
      into the reduction (one pass over ``g``), but XLA:CPU writes the boolean array and
      reduces it in a second pass.
    * ``"dot"``: ``sum(g @ z)`` for a vector ``z`` of zeros computed at run time: each term is
      ``g_ij * 0``, which is 0 for a finite ``g_ij`` and NaN for a NaN or an Inf, so the sum is
      0 exactly when the leaf is finite (it cannot overflow). A matrix-vector product reads
      ``g`` once with no intermediate; on CPU it is ~3x faster than the elementwise check and
      costs 2/3 of its bytes. It checks the *scaled* values, which is exact only when the
      scale is >= 1 (then ``g * inv_scale`` cannot overflow), and it only pays off for
      float32/float64 leaves (XLA:CPU converts half-precision dot operands first).

    ``"auto"`` uses ``"dot"`` on the CPU backend for float32/float64 leaves of rank >= 1 when
    ``scale_at_least_one``, and ``"elementwise"`` otherwise.
    """
    if method not in ("auto", "elementwise", "dot"):
        raise ValueError(f"method must be 'auto', 'elementwise' or 'dot'; got {method!r}")
    use_dot = method == "dot" or (
        method == "auto" and scale_at_least_one and jax.default_backend() == "cpu"
    )
    # A zero the compiler cannot constant-fold (the scale is positive in every valid state),
    # so that no algebraic simplification can drop the product.
    zero = jnp.where(inv_scale > 0, jnp.float32(0), jnp.float32(1))
    flags = []
    for g in leaves:
        if not is_inexact(g) or g.size == 0:  # an empty leaf holds nothing to check
            continue
        if use_dot and g.ndim >= 1 and g.dtype in (jnp.float32, jnp.float64):
            matrix = g.reshape(-1, g.shape[-1])
            z = jnp.broadcast_to(zero.astype(g.dtype), (g.shape[-1],))
            rows = jnp.dot(matrix, z, precision=jax.lax.Precision.HIGHEST)
            flags.append(jnp.logical_not(jnp.isfinite(jnp.sum(rows))))
        else:
            flags.append(jnp.logical_not(jnp.all(jnp.isfinite(unscale(g, inv_scale)))))
    if not flags:
        return jnp.zeros([], jnp.int32)
    return jnp.sum(jnp.stack(flags).astype(jnp.int32))


#: Most leaves one fused finiteness reduction reads: XLA:GPU fuses a concatenation into the
#: reduction reading it only up to about 90 operands (beyond, it writes the concatenation
#: out: a copy of every gradient).
LEAVES_PER_REDUCTION = 64


def any_non_finite_fused(leaves: list[Any], inv_scale: jax.Array, *, scaled: bool) -> jax.Array:
    """Whether any float leaf holds a NaN or an Inf, as a few fused reductions (bool scalar).

    The leaves of each dtype are flattened and concatenated, at most
    :data:`LEAVES_PER_REDUCTION` at a time, and ``isfinite`` is reduced over each
    concatenation: XLA:GPU fuses the concatenation into the reduction, so each gradient is
    read once and nothing is written, in a handful of kernels where one reduction per leaf
    takes one or two each (GPT-2 small: 7 kernels instead of 201). Exact: ``isfinite`` of
    each element, no arithmetic that could overflow. With ``scaled`` the scaled values are
    checked (exact when the scale is >= 1); otherwise ``g * inv_scale``.
    """
    by_dtype: dict[Any, list[Any]] = {}
    for g in leaves:
        if is_inexact(g) and g.size:
            by_dtype.setdefault(jnp.dtype(g.dtype), []).append(g)
    finite = []
    for group in by_dtype.values():
        n = -(-len(group) // LEAVES_PER_REDUCTION)  # reductions, of equal numbers of leaves
        size = -(-len(group) // n)
        for i in range(0, len(group), size):
            flat = jnp.concatenate([jnp.ravel(g) for g in group[i : i + size]])
            finite.append(jnp.all(jnp.isfinite(flat if scaled else unscale(flat, inv_scale))))
    if not finite:
        return jnp.array(False)
    return jnp.logical_not(jnp.all(jnp.stack(finite)))


def any_non_finite(
    leaves: list[Any], inv_scale: jax.Array, *, scale_at_least_one: bool, whole_leaves: bool
) -> jax.Array:
    """1 if any float leaf is non-finite after unscaling, else 0 (int32 scalar).

    Chosen per platform when the program is lowered (``lax.platform_dependent``, so a program
    lowered for a GPU gets the GPU's check on any host): XLA:CPU reduces each leaf with the
    ``"dot"`` check of :func:`count_non_finite` (about 3x faster there); other platforms use
    :func:`any_non_finite_fused` when ``whole_leaves`` -- the leaves are whole arrays, on one
    device or per device inside ``shard_map``/``pmap`` -- and one reduction per leaf
    otherwise: concatenating arrays sharded differently over several devices would gather
    them. A TPU lowering always reduces per leaf (its slice's sharding is not known here).
    """
    if not any(is_inexact(g) for g in leaves):
        return jnp.zeros([], jnp.int32)

    def per_leaf(method: str) -> jax.Array:
        n = count_non_finite(
            leaves, inv_scale, scale_at_least_one=scale_at_least_one, method=method
        )
        return (n > 0).astype(jnp.int32)

    def fused() -> jax.Array:
        bad = any_non_finite_fused(leaves, inv_scale, scaled=scale_at_least_one)
        return bad.astype(jnp.int32)

    cpu_method = "dot" if scale_at_least_one else "elementwise"
    default = fused if whole_leaves else lambda: per_leaf("elementwise")
    # A TPU program is compiled for a slice, most often several chips, and is often compiled
    # from a host that is not one (a deviceless compile sees one CPU device): concatenating
    # leaves sharded over the slice would gather every gradient onto every chip. XLA:TPU runs
    # the whole step as one program, so one reduction per leaf costs no kernel launches.
    return jax.lax.platform_dependent(
        cpu=lambda: per_leaf(cpu_method), tpu=lambda: per_leaf("elementwise"), default=default
    )


def _leaf_flags(
    leaves: list[Any], inv_scale: jax.Array, axis_name: AxisName | None
) -> LossScaleDebugState:
    """Per-leaf NaN and Inf flags of the unscaled leaves, or-reduced over ``axis_name``."""
    # Recomputed here rather than shared with the update, so that XLA fuses the unscaling into
    # each consumer and never materialises an unscaled copy.
    unscaled = [unscale(g, inv_scale) if is_inexact(g) else None for g in leaves]
    no = jnp.array(False)
    nan_flags = [no if u is None else jnp.any(jnp.isnan(u)) for u in unscaled]
    inf_flags = [no if u is None else jnp.any(jnp.isinf(u)) for u in unscaled]
    empty = jnp.zeros([0], jnp.bool_)
    has_nan = jnp.stack(nan_flags) if nan_flags else empty
    has_inf = jnp.stack(inf_flags) if inf_flags else empty
    if axis_name is not None:
        has_nan = jax.lax.pmax(has_nan.astype(jnp.int32), axis_name) > 0
        has_inf = jax.lax.pmax(has_inf.astype(jnp.int32), axis_name) > 0
    return LossScaleDebugState(has_nan, has_inf)


def check_finite(
    grads: ArrayTree,
    inv_scale: jax.Array,
    *,
    axis_name: AxisName | None,
    debug: bool,
    scale_at_least_one: bool,
) -> tuple[jax.Array, LossScaleDebugState | tuple[()]]:
    """Whether ``grads * inv_scale`` is finite on every device, and the per-leaf flags.

    Args:
      grads: the scaled gradients.
      inv_scale: ``1 / loss_scale`` (float32 scalar).
      axis_name: axes (of ``shard_map``/``pmap``) over which all devices must agree, or None.
      debug: also return which leaves held a NaN or an Inf.
      scale_at_least_one: the scale is never below 1, so the scaled gradients are finite
        exactly when the unscaled ones are (lets the check read the scaled values).

    Returns:
      ``(finite, debug_state)``: a bool scalar, and a :class:`LossScaleDebugState` with
      ``debug`` (else ``()``).
    """
    leaves = jax.tree.leaves(grads)
    with jax.named_scope("check_finite"):
        if debug:
            flags = _leaf_flags(leaves, inv_scale, axis_name)
            return ~jnp.any(flags.leaf_has_nan | flags.leaf_has_inf), flags
        whole_leaves = axis_name is not None or jax.device_count() == 1
        n_bad = any_non_finite(
            leaves, inv_scale, scale_at_least_one=scale_at_least_one, whole_leaves=whole_leaves
        )
        if axis_name is not None:
            n_bad = jax.lax.psum(n_bad, axis_name)
        return n_bad == 0, ()
