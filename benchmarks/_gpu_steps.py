"""Train steps of the GPU benchmarks, shared by ``gpu_speedup.py`` and ``gpu_memory.py``.

Each variant of a model's train step (float32, rewritten, hand-written; with or without loss
scaling) is built here once, so the speed benchmark (on a card) and the memory benchmark
(a deviceless compile) measure the same programs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from importlib import metadata
from pathlib import Path
from typing import Any

import _gpu_models
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_rewrite


@dataclasses.dataclass(frozen=True)
class Variant:
    key: str
    rewrite_dtype: Any = None  # jmp_rewrite.rewrite(step, dtype=...)
    hand_dtype: Any = None  # Flax-style compute dtype of the model itself
    loss_scale: bool = False
    use_select: bool = False
    precision: str | None = None  # jax.default_matmul_precision while tracing
    cuda_lists: bool = False  # bf16 with TF's CUDA (float16) lists instead of oneDNN's
    flax_dynamic_scale: bool = False  # flax.training.dynamic_scale.DynamicScale + jnp.where
    fp8: Any = False  # rewrite(..., fp8=True or Fp8Rules): weight GEMMs in float8
    qwix_fp8: bool = False  # hand-written: the same weight GEMMs through qwix's float8 dot
    fuse_attention: bool = False  # rewrite(..., fuse_attention=True): cuDNN flash attention

    @property
    def tf32(self) -> bool | None:
        if self.precision is None:
            return None  # half precision: TF32 does not apply
        return self.precision == "tensorfloat32" and jax.default_backend() == "gpu"


VARIANTS = {
    v.key: v
    for v in (
        Variant("f32", precision="highest"),
        Variant("rw-bf16", rewrite_dtype=jnp.bfloat16),
        Variant("hand-bf16", hand_dtype=jnp.bfloat16),
        # Issue 8 item 7: which lists bfloat16 should get on GPUs (loss error ties on CPU).
        Variant("rw-bf16-cuda-lists", rewrite_dtype=jnp.bfloat16, cuda_lists=True),
        Variant("rw-f16-lso", rewrite_dtype=jnp.float16, loss_scale=True),
        Variant("rw-f16-lso-select", rewrite_dtype=jnp.float16, loss_scale=True, use_select=True),
        Variant("f32-tf32", precision="tensorfloat32"),
        # Run only when named (--variants): float16 without loss scaling, rewritten and by
        # hand (memory and speed of the painting alone), and the Flax user's float16 baseline.
        Variant("rw-f16", rewrite_dtype=jnp.float16),
        Variant("hand-f16", hand_dtype=jnp.float16),
        Variant("hand-f16-dynscale", hand_dtype=jnp.float16, flax_dynamic_scale=True),
        # Issue 23: float8 weight GEMMs (cuBLASLt float8 on Hopper; emulated elsewhere).
        Variant("rw-fp8", rewrite_dtype=jnp.bfloat16, fp8=True),
        # Its hand-written baseline: hand-bf16 with the GEMMs rw-fp8 picks run by qwix.
        Variant("hw-fp8-qwix", hand_dtype=jnp.bfloat16, qwix_fp8=True),
        # Issue 31: attention replaced by cuDNN's flash attention (forward and backward).
        Variant("rw-bf16-fused", rewrite_dtype=jnp.bfloat16, fuse_attention=True),
        Variant(
            "rw-f16-lso-fused", rewrite_dtype=jnp.float16, loss_scale=True, fuse_attention=True
        ),
        Variant("rw-fp8-fused", rewrite_dtype=jnp.bfloat16, fp8=True, fuse_attention=True),
    )
}
#: What runs without ``--variants`` (``f32-tf32`` only with ``--tf32``).
DEFAULT_VARIANTS = (
    "f32",
    "rw-bf16",
    "hand-bf16",
    "rw-bf16-cuda-lists",
    "rw-f16-lso",
    "rw-f16-lso-select",
    "f32-tf32",
    "rw-bf16-fused",
)


class Unavailable(Exception):
    """A variant that cannot be built here (a missing package, an unsupported model); its
    message is the reason, recorded as ``skipped: <reason>``."""


def qwix_fp8_dot() -> Any:
    """``dot(x, w)``: qwix's quantized-training matmul, configured as ``rw-fp8``'s float8.

    ``qwix.QtProvider`` (with ``QtRule(weight_qtype=float8_e4m3fn, act_qtype=float8_e4m3fn,
    bwd_qtype=float8_e5m2)``) runs ``qwix._src.core.dot_general_qt.dot_general_qt`` for a
    Flax Linen/NNX module's matmuls; it finds its rule through the module being called, so
    the plain-JAX GPT here calls that function itself, with the config the provider builds
    for such a rule: operands e4m3 with current absmax scales (per tensor:
    ``disable_channelwise_axes``, as the cuBLASLt float8 GEMM needs and as ``rw-fp8``
    does), the incoming gradient e5m2 in both backward GEMMs, the forward's quantized
    operands reused there. Raises :class:`Unavailable` where qwix is not installed.
    """
    try:
        from qwix._src.core import dot_general_qt as qt
    except ImportError as err:
        raise Unavailable("qwix not installed") from err
    e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2
    config = qt.DotGeneralQtConfig(
        lhs_qtype=e4m3,
        rhs_qtype=e4m3,
        lhs_disable_channelwise_axes=True,
        rhs_disable_channelwise_axes=True,
        dlhs_grad_qtype=e5m2,
        drhs_grad_qtype=e5m2,
        dlhs_grad_disable_channelwise_axes=True,
        drhs_grad_disable_channelwise_axes=True,
    )

    def dot(x: jax.Array, w: jax.Array) -> jax.Array:
        return qt.dot_general_qt(x, w, (((x.ndim - 1,), (0,)), ((), ())), config)

    return dot


def make_step(model: _gpu_models.Model, variant: Variant) -> tuple[Any, Any]:
    """``(tx, step)`` with ``step(params, state, opt_state, inputs, labels)``.

    Raises :class:`Unavailable` for a variant that cannot be built here.
    """
    if variant.qwix_fp8:
        if not model.fp8_dot:
            raise Unavailable(f"{variant.key} is written for the GPT only, not {model.key}")
        loss_fn = model.make_loss(variant.hand_dtype, dot=qwix_fp8_dot())
    else:
        loss_fn = model.make_loss(variant.hand_dtype)
    if variant.flax_dynamic_scale:
        return _flax_dynamic_scale_step(model, loss_fn)
    if variant.loss_scale:
        tx = jmp_rewrite.loss_scale_optimizer(
            optax.adam(model.learning_rate), use_select=variant.use_select
        )

        def step(params, state, opt_state, inputs, labels):
            (loss, new_state), grads = jmp_rewrite.value_and_grad(loss_fn, has_aux=True)(
                opt_state, params, state, inputs, labels
            )
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), new_state, opt_state, loss

    else:
        tx = optax.adam(model.learning_rate)

        @jmp_rewrite.float32_region  # Adam in float32 under the rewrite; no-op otherwise
        def update(grads, opt_state, params):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        def step(params, state, opt_state, inputs, labels):
            (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                params, state, inputs, labels
            )
            params, opt_state = update(grads, opt_state, params)
            return params, new_state, opt_state, loss

    if variant.rewrite_dtype is not None:
        lists = jmp_rewrite.default_lists(jnp.float16) if variant.cuda_lists else None
        step = jmp_rewrite.rewrite(
            step,
            dtype=variant.rewrite_dtype,
            lists=lists,
            fp8=variant.fp8,
            fuse_attention=variant.fuse_attention,
        )
    return tx, step


def _flax_dynamic_scale_step(model: _gpu_models.Model, loss_fn: Any) -> tuple[Any, Any]:
    """Flax's float16 recipe (its ImageNet example): ``DynamicScale.value_and_grad``, Adam,
    and ``jnp.where`` keeping the old parameters and optimizer state on a non-finite step.
    The scale's state rides in the optimizer state: ``(adam_state, DynamicScale)``."""
    from flax.training import dynamic_scale

    adam = optax.adam(model.learning_rate)
    tx = optax.GradientTransformation(
        lambda params: (adam.init(params), dynamic_scale.DynamicScale()), None
    )

    def step(params, state, opt_state, inputs, labels):
        inner, scale = opt_state
        grad_fn = scale.value_and_grad(loss_fn, has_aux=True)
        scale, finite, (loss, new_state), grads = grad_fn(params, state, inputs, labels)
        updates, new_inner = adam.update(grads, inner, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        return keep(new_params, params), new_state, (keep(new_inner, inner), scale), loss

    return tx, step


#: The step's donated arguments: parameters, model state, optimizer state.
DONATE = (0, 1, 2)


def abstract_args(model: _gpu_models.Model, tx: Any, sharding: Any = None) -> tuple[Any, ...]:
    """``(params, state, opt_state, inputs, labels)`` of ``model`` as ``ShapeDtypeStruct``s
    (placed by ``sharding`` when given): the step's arguments, with nothing allocated."""

    def spec(a: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(np.shape(a), np.dtype(a.dtype), sharding=sharding)

    params, state = jax.tree.map(spec, model.params), jax.tree.map(spec, model.state)
    opt_state = jax.tree.map(spec, jax.eval_shape(tx.init, params))
    return params, state, opt_state, spec(model.inputs), spec(model.labels)


def xla_peak_bytes(compiled: Any) -> int | None:
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001
        return None
    if m is None:
        return None
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )


def write_json(result: dict[str, Any], path: Path | None) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, path)


def version_of(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
