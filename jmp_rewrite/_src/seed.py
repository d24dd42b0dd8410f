"""TF1's seed API: ``enable_mixed_precision_graph_rewrite`` / ``disable_...``.

TF's function wraps the optimizer in a ``LossScaleOptimizer`` and switches grappler's
``auto_mixed_precision`` option on for every graph built afterwards. The JAX analogue of "every
graph" is every function decorated with :func:`jmp_rewrite.rewrite` that does not pin its own
``dtype``: they read the switch each time they are traced or called eagerly, so programs
traced after ``enable`` are rewritten and programs traced after ``disable`` are not. A program
an enclosing ``jax.jit`` has already compiled keeps its rewrite until ``jax.jit`` retraces,
as a TF graph keeps the rewrite it was optimised with.
"""

from __future__ import annotations

import warnings
from typing import Any

import optax

from jmp_rewrite._src import settings
from jmp_rewrite._src.loss_scale.optimizer import is_loss_scale_optimizer, loss_scale_optimizer
from jmp_rewrite._src.loss_scale.scale import LossScale

#: The keyword arguments of :func:`jmp_rewrite.rewrite` the switch may carry.
REWRITE_OPTIONS = ("dtype", "lists", "level", "infer_follows_allow")


def enable_mixed_precision_graph_rewrite(
    opt: optax.GradientTransformation,
    loss_scale: str | float | LossScale = "dynamic",
    **rewrite_options: Any,
) -> optax.GradientTransformationExtraArgs:
    """Enables the mixed-precision rewrite process-wide and wraps ``opt`` with loss scaling.

    Mirrors ``tf.compat.v1.train.experimental.enable_mixed_precision_graph_rewrite``:

    * returns ``loss_scale_optimizer(opt, loss_scale)``;
    * switches the rewrite on for functions decorated with :func:`jmp_rewrite.rewrite`
      without their own ``dtype``, for programs traced from now on. With ``dtype`` omitted
      here too, the dtype follows the platform as in TF (float16 on CUDA GPUs of compute
      capability >= 7.0, bfloat16 on TPUs, nothing on CPU); pass ``dtype=jnp.float16`` to
      force it (e.g. to try it on CPU).

    "Gradients only through the returned optimizer" means, in JAX: differentiate
    ``jmp_rewrite.scale_loss(loss, opt_state)`` (or use :func:`jmp_rewrite.value_and_grad`)
    and pass those gradients to the returned transformation's ``update``, which unscales
    them; plain ``jax.grad(loss)`` gradients would be divided by the loss scale.

    Args:
      opt: the optax transformation to wrap.
      loss_scale: ``'dynamic'``, a positive number (fixed scale), or a
        :class:`jmp_rewrite.DynamicLossScale` / :class:`jmp_rewrite.FixedLossScale`.
      **rewrite_options: defaults for the switched-on rewrite: ``dtype``, ``lists``,
        ``level``, ``infer_follows_allow`` (as in :func:`jmp_rewrite.rewrite`).

    Returns:
      The loss-scale optimizer wrapping ``opt``.

    Raises:
      TypeError: if ``opt`` is not an optax transformation, or an option is unknown.
      ValueError: if ``opt`` already is a loss-scale optimizer (TF refuses to wrap a
        ``LossScaleOptimizer`` twice), or ``loss_scale``/an option value is invalid. An
        ``opt`` that only contains one (``optax.chain(clip, loss_scale_optimizer(adam))``)
        is refused by the returned optimizer's ``init``, which alone sees its state.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import jmp_rewrite
      >>> tx = jmp_rewrite.enable_mixed_precision_graph_rewrite(
      ...     optax.adam(1e-3), dtype=jnp.float16)
      >>> jmp_rewrite.is_loss_scale_optimizer(tx)
      True
      >>> jmp_rewrite.disable_mixed_precision_graph_rewrite()
    """
    if not (callable(getattr(opt, "init", None)) and callable(getattr(opt, "update", None))):
        raise TypeError(
            "opt must be an optax transformation (with init and update), "
            f"got {type(opt).__name__}: {opt!r}"
        )
    if is_loss_scale_optimizer(opt):
        raise ValueError(
            '"opt" must not already be a loss-scale optimizer: '
            "enable_mixed_precision_graph_rewrite wraps it itself"
        )
    unknown = sorted(set(rewrite_options) - set(REWRITE_OPTIONS))
    if unknown:
        raise TypeError(
            f"unknown rewrite option(s) {', '.join(unknown)}; allowed: {', '.join(REWRITE_OPTIONS)}"
        )
    # Validate now (bad dtype, lists or level), not at the first traced program.
    dtype = rewrite_options.get("dtype")
    settings.validate_dtype(dtype)
    if dtype is not None:
        settings.resolve_config(
            dtype,
            rewrite_options.get("lists"),
            rewrite_options.get("level"),
            rewrite_options.get("infer_follows_allow", True),
        )
    wrapped = loss_scale_optimizer(opt, loss_scale)
    with settings.GLOBAL.lock:
        if settings.GLOBAL.enabled:
            warnings.warn(
                "enable_mixed_precision_graph_rewrite was already on; its options are replaced",
                stacklevel=2,
            )
        settings.GLOBAL.enabled = True
        settings.GLOBAL.options = dict(rewrite_options)
    return wrapped


def disable_mixed_precision_graph_rewrite() -> None:
    """Switches off what :func:`enable_mixed_precision_graph_rewrite` switched on.

    Programs traced afterwards are no longer rewritten (unless their :func:`jmp_rewrite.rewrite`
    pins a ``dtype``). Optimizers already wrapped keep their loss scaling, as in TF.

    Example:
      >>> import jmp_rewrite
      >>> jmp_rewrite.disable_mixed_precision_graph_rewrite()
      >>> jmp_rewrite.mixed_precision_graph_rewrite_enabled()
      False
    """
    with settings.GLOBAL.lock:
        settings.GLOBAL.enabled = False
        settings.GLOBAL.options = {}


def mixed_precision_graph_rewrite_enabled() -> bool:
    """Whether :func:`enable_mixed_precision_graph_rewrite` is on.

    Returns:
      True between an ``enable`` and the next ``disable``.

    Example:
      >>> import jmp_rewrite
      >>> jmp_rewrite.mixed_precision_graph_rewrite_enabled()
      False
    """
    return settings.GLOBAL.enabled
