"""Loss scales: the static configuration and pure update rule of TF1's loss scaling.

Loss scaling (Micikevicius et al., "Mixed Precision Training", ICLR 2018) multiplies the loss
by a factor *S* before differentiation, so that small gradients survive in float16, and divides
the gradients by *S* afterwards. This module holds the two kinds of scale TF1 offered:

* :class:`DynamicLossScale`: TF1 ``tf.compat.v1.mixed_precision.DynamicLossScale``. The scale
  grows by ``multiplier`` after ``increment_period`` consecutive finite steps and shrinks by it
  (never below ``min_loss_scale``, 1 by default) on every step whose gradients hold a NaN or an
  Inf; such steps are skipped.
* :class:`FixedLossScale`: TF1 ``FixedLossScale``. The scale never changes and, as in TF, every
  step is applied (opt into skipping non-finite steps with ``skip_non_finite=True``).

Both are frozen dataclasses holding *static* configuration only. They are deliberately not
pytrees: the values that change (the current scale and the good-step counter) live in the
optimizer state, :class:`jmp_rewrite.LossScaleOptimizerState`, so that nothing can be dropped by a
hand-written ``tree_flatten`` (the bug of jmp's ``min_loss_scale``, jmp PR #44) and a checkpoint
of the state is complete.

The update rule is a pure function of ``(loss_scale, good_steps, grads_finite)`` written with
``jnp.where`` (no Python branching), so it runs unchanged under ``jax.jit``, ``vmap`` and
``shard_map``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_F32_MAX = float(np.finfo(np.float32).max)
_INT32_MAX = int(np.iinfo(np.int32).max)


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _as_real(owner: str, name: str, value: Any, allowed: str) -> float:
    """``value`` as a Python float, or a ValueError naming the argument and what is allowed."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise ValueError(f"{owner}: {name} must be {allowed}; got {_describe(value)}")
    result = float(value)
    if math.isnan(result):
        raise ValueError(f"{owner}: {name} must be {allowed}; got {_describe(value)}")
    return result


def _check_scale_value(owner: str, name: str, value: Any) -> float:
    allowed = f"a finite real number in (0, {_F32_MAX:.6g}] (representable in float32)"
    result = _as_real(owner, name, value, allowed)
    if not 0.0 < result <= _F32_MAX or float(np.float32(result)) == 0.0:
        raise ValueError(f"{owner}: {name} must be {allowed}; got {_describe(value)}")
    return result


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """TF1's dynamic loss scale: grow after a run of finite steps, back off on overflow.

    The update rule, applied once per optimizer step (``finite`` means every element of every
    gradient leaf is finite; NaN, +Inf and -Inf all count as non-finite)::

        if finite:
            if good_steps + 1 >= increment_period:
                new = loss_scale * multiplier
                if isfinite(new) and new <= max_loss_scale:
                    loss_scale = new            # otherwise the scale stays where it is
                good_steps = 0                  # reset even when growth was refused
            else:
                good_steps += 1
        else:
            good_steps = 0
            loss_scale = max(loss_scale / multiplier, min_loss_scale)
        should_apply = finite

    With the defaults this is exactly TF1's ``DynamicLossScale`` (floor at 1, no ceiling other
    than refusing to grow to infinity in float32). The arithmetic is float32.

    Instances are immutable static configuration, not pytrees; the current scale and counter
    are leaves of :class:`jmp_rewrite.LossScaleOptimizerState`.

    Args:
      initial_loss_scale: the scale of the first step; in ``[min_loss_scale, max_loss_scale]``.
        Powers of two keep scaling and unscaling exact.
      increment_period: number of consecutive finite steps after which the scale is multiplied;
        an integer in ``[1, 2**31 - 1]``.
      multiplier: growth and back-off factor; a finite real number > 1.
      min_loss_scale: floor of the back-off (TF1 hard-codes 1). Any finite positive float32
        value; below 1 is allowed (tensorflow#38357).
      max_loss_scale: optional ceiling. Growth that would exceed it is refused (the scale stays,
        as for growth to infinity) rather than clamped, so a power-of-two scale stays a power of
        two. ``None`` (default): only growth to a non-finite float32 value is refused.

    Raises:
      ValueError: if an argument is of the wrong type or out of range; the message names the
        argument, the bad value and the allowed range.

    Example:
      >>> import jax.numpy as jnp
      >>> import jmp_rewrite
      >>> ls = jmp_rewrite.DynamicLossScale(initial_loss_scale=8.0, increment_period=2)
      >>> scale, good = ls.init()
      >>> scale, good, apply = ls.update(scale, good, jnp.array(True))
      >>> scale, good, apply = ls.update(scale, good, jnp.array(True))
      >>> float(scale), int(good), bool(apply)
      (16.0, 0, True)
      >>> scale, good, apply = ls.update(scale, good, jnp.array(False))
      >>> float(scale), int(good), bool(apply)
      (8.0, 0, False)
    """

    initial_loss_scale: float = 2.0**15
    increment_period: int = 2000
    multiplier: float = 2.0
    min_loss_scale: float = 1.0
    max_loss_scale: float | None = None

    def __post_init__(self) -> None:
        owner = "DynamicLossScale"
        initial = _check_scale_value(owner, "initial_loss_scale", self.initial_loss_scale)
        period = self.increment_period
        if (
            isinstance(period, bool | np.bool_)
            or not isinstance(period, numbers.Integral)
            or not 1 <= int(period) <= _INT32_MAX
        ):
            raise ValueError(
                f"{owner}: increment_period must be an integer in [1, {_INT32_MAX}]; "
                f"got {_describe(period)}"
            )
        mult_allowed = "a finite real number > 1"
        multiplier = _as_real(owner, "multiplier", self.multiplier, mult_allowed)
        if not 1.0 < multiplier <= _F32_MAX:
            raise ValueError(
                f"{owner}: multiplier must be {mult_allowed}; got {_describe(self.multiplier)}"
            )
        minimum = _check_scale_value(owner, "min_loss_scale", self.min_loss_scale)
        maximum = None
        if self.max_loss_scale is not None:
            maximum = _check_scale_value(owner, "max_loss_scale", self.max_loss_scale)
            if maximum < minimum:
                raise ValueError(
                    f"{owner}: max_loss_scale must be None or >= min_loss_scale "
                    f"({minimum!r}); got {_describe(self.max_loss_scale)}"
                )
        upper = _F32_MAX if maximum is None else maximum
        if not minimum <= initial <= upper:
            raise ValueError(
                f"{owner}: initial_loss_scale must lie in [min_loss_scale, max_loss_scale] = "
                f"[{minimum!r}, {upper!r}]; got {_describe(self.initial_loss_scale)}"
            )
        # Normalise to plain Python numbers so equality and hashing are by value.
        object.__setattr__(self, "initial_loss_scale", initial)
        object.__setattr__(self, "increment_period", int(period))
        object.__setattr__(self, "multiplier", multiplier)
        object.__setattr__(self, "min_loss_scale", minimum)
        object.__setattr__(self, "max_loss_scale", maximum)

    @property
    def is_dynamic(self) -> bool:
        """Whether the scale changes with the gradients (always ``True`` here)."""
        return True

    @property
    def skips_non_finite(self) -> bool:
        """Whether a step with a non-finite gradient is skipped (always ``True`` here)."""
        return True

    def init(self) -> tuple[jax.Array, jax.Array]:
        """The initial ``(loss_scale, good_steps)``: a float32 and an int32 scalar.

        Returns:
          ``(initial_loss_scale as float32, 0 as int32)``.

        Example:
          >>> import jmp_rewrite
          >>> scale, good = jmp_rewrite.DynamicLossScale().init()
          >>> float(scale), int(good)
          (32768.0, 0)
        """
        return jnp.asarray(self.initial_loss_scale, jnp.float32), jnp.zeros([], jnp.int32)

    def update(
        self,
        loss_scale: jax.typing.ArrayLike,
        good_steps: jax.typing.ArrayLike,
        grads_finite: jax.typing.ArrayLike,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One step of TF1's rule (see the class docstring); pure and branch-free.

        Args:
          loss_scale: the scale in force for this step (float32 scalar).
          good_steps: consecutive finite steps so far (int32 scalar).
          grads_finite: whether every gradient of this step is finite (bool scalar).

        Returns:
          ``(new_loss_scale, new_good_steps, should_apply)``: float32, int32 and bool scalars.

        Example:
          >>> import jax.numpy as jnp
          >>> import jmp_rewrite
          >>> ls = jmp_rewrite.DynamicLossScale(initial_loss_scale=1.0)
          >>> scale, good, apply = ls.update(*ls.init(), jnp.array(False))
          >>> float(scale), int(good), bool(apply)  # never below min_loss_scale (1)
          (1.0, 0, False)
        """
        loss_scale = jnp.asarray(loss_scale, jnp.float32)
        good_steps = jnp.asarray(good_steps, jnp.int32)
        finite = jnp.asarray(grads_finite, jnp.bool_)
        multiplier = jnp.float32(self.multiplier)
        # good_steps < increment_period <= int32 max for every state this rule produces; the
        # clamp keeps a hand-edited state from overflowing.
        next_good = jnp.minimum(good_steps, _INT32_MAX - 1) + 1
        grow = next_good >= self.increment_period
        grown = loss_scale * multiplier
        can_grow = jnp.isfinite(grown)
        if self.max_loss_scale is not None:
            can_grow = can_grow & (grown <= jnp.float32(self.max_loss_scale))
        scale_if_finite = jnp.where(grow & can_grow, grown, loss_scale)
        good_if_finite = jnp.where(grow, jnp.zeros_like(next_good), next_good)
        scale_if_not = jnp.maximum(loss_scale / multiplier, jnp.float32(self.min_loss_scale))
        new_scale = jnp.where(finite, scale_if_finite, scale_if_not)
        new_good = jnp.where(finite, good_if_finite, jnp.zeros_like(good_steps))
        return new_scale, new_good, finite


@dataclasses.dataclass(frozen=True)
class FixedLossScale:
    """A constant loss scale (TF1 ``FixedLossScale``).

    The scale never changes. As in TF, every step is applied, even one whose gradients are
    not finite (so a NaN reaches the parameters); pass ``skip_non_finite=True`` to skip such
    steps instead, keeping parameters and inner optimizer state untouched.

    Args:
      loss_scale_value: the scale; a finite real number in ``(0, float32 max]``. Values below 1
        are allowed (TF warns about them) but rarely useful.
      skip_non_finite: if ``True``, a step with a NaN or Inf gradient is skipped (zero updates,
        inner state unchanged). Default ``False``, TF1's behaviour.

    Raises:
      ValueError: if ``loss_scale_value`` is not a finite positive real number, or
        ``skip_non_finite`` is not a bool.

    Example:
      >>> import jax.numpy as jnp
      >>> import jmp_rewrite
      >>> ls = jmp_rewrite.FixedLossScale(128)
      >>> scale, good, apply = ls.update(*ls.init(), jnp.array(False))
      >>> float(scale), bool(apply)
      (128.0, True)
    """

    loss_scale_value: float
    skip_non_finite: bool = False

    def __post_init__(self) -> None:
        value = _check_scale_value("FixedLossScale", "loss_scale_value", self.loss_scale_value)
        if not isinstance(self.skip_non_finite, bool | np.bool_):
            raise ValueError(
                "FixedLossScale: skip_non_finite must be True or False; "
                f"got {_describe(self.skip_non_finite)}"
            )
        object.__setattr__(self, "loss_scale_value", value)
        object.__setattr__(self, "skip_non_finite", bool(self.skip_non_finite))

    @property
    def is_dynamic(self) -> bool:
        """Whether the scale changes with the gradients (always ``False`` here)."""
        return False

    @property
    def skips_non_finite(self) -> bool:
        """Whether a step with a non-finite gradient is skipped (``skip_non_finite``)."""
        return self.skip_non_finite

    def init(self) -> tuple[jax.Array, jax.Array]:
        """The initial ``(loss_scale, good_steps)``; ``good_steps`` stays 0 for a fixed scale.

        Returns:
          ``(loss_scale_value as float32, 0 as int32)``.

        Example:
          >>> import jmp_rewrite
          >>> float(jmp_rewrite.FixedLossScale(4).init()[0])
          4.0
        """
        return jnp.asarray(self.loss_scale_value, jnp.float32), jnp.zeros([], jnp.int32)

    def update(
        self,
        loss_scale: jax.typing.ArrayLike,
        good_steps: jax.typing.ArrayLike,
        grads_finite: jax.typing.ArrayLike,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The scale and counter unchanged; apply always (or only when finite, if skipping).

        Args:
          loss_scale: the scale in force (float32 scalar).
          good_steps: the counter (int32 scalar), returned as is.
          grads_finite: whether every gradient of this step is finite (bool scalar).

        Returns:
          ``(loss_scale, good_steps, should_apply)``.

        Example:
          >>> import jax.numpy as jnp
          >>> import jmp_rewrite
          >>> ls = jmp_rewrite.FixedLossScale(2, skip_non_finite=True)
          >>> bool(ls.update(*ls.init(), jnp.array(False))[2])
          False
        """
        finite = jnp.asarray(grads_finite, jnp.bool_)
        apply = finite if self.skip_non_finite else jnp.ones_like(finite)
        return (
            jnp.asarray(loss_scale, jnp.float32),
            jnp.asarray(good_steps, jnp.int32),
            apply,
        )


LossScale = DynamicLossScale | FixedLossScale
"""Either kind of loss scale."""
