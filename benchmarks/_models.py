"""Benchmark models in plain JAX: a decoder-only transformer and a CIFAR-style ResNet-18.

Plain functions of parameter pytrees (no framework), written dtype-agnostically so that the
same code is the float32 model, the input to ``jmp_rewrite.rewrite`` and -- with parameters
and inputs cast once at the top -- the hand-written bfloat16 baseline. Parameters are drawn
with NumPy, so building a model compiles nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jmp_rewrite

Params = Any


def _normal(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape) / np.sqrt(fan_in), jnp.float32)


# ------------------------------------------------------------------------------------------
# Transformer
# ------------------------------------------------------------------------------------------


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = 1e-6) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps) * scale + bias


def init_transformer(
    seed: int = 0, *, layers: int = 12, d_model: int = 256, vocab: int = 1024, mlp_ratio: int = 4
) -> Params:
    rng = np.random.default_rng(seed)
    d, f = d_model, mlp_ratio * d_model
    ones, zeros = (lambda n: jnp.ones((n,), jnp.float32)), (lambda n: jnp.zeros((n,), jnp.float32))
    blocks = [
        {
            "ln1": {"scale": ones(d), "bias": zeros(d)},
            "wq": _normal(rng, (d, d), d),
            "wk": _normal(rng, (d, d), d),
            "wv": _normal(rng, (d, d), d),
            "wo": _normal(rng, (d, d), d),
            "ln2": {"scale": ones(d), "bias": zeros(d)},
            "w1": _normal(rng, (d, f), d),
            "b1": zeros(f),
            "w2": _normal(rng, (f, d), f),
            "b2": zeros(d),
        }
        for _ in range(layers)
    ]
    return {
        "embed": _normal(rng, (vocab, d), 1),
        "blocks": blocks,
        "ln_f": {"scale": ones(d), "bias": zeros(d)},
        "head": _normal(rng, (d, vocab), d),
    }


def transformer_logits(params: Params, tokens: jax.Array, heads: int = 4) -> jax.Array:
    """Pre-LN causal decoder: embedding, blocks of attention + gelu MLP, tied-free head."""
    x = params["embed"][tokens]  # (B, T, D)
    b, t, d = x.shape
    dh = d // heads
    causal = jnp.tril(jnp.ones((t, t), bool))
    for blk in params["blocks"]:
        h = layer_norm(x, **blk["ln1"])
        q, k, v = (jnp.reshape(h @ blk[w], (b, t, heads, dh)) for w in ("wq", "wk", "wv"))
        logits = jnp.einsum("bthd,bshd->bhts", q, k) * float(dh**-0.5)  # weak: keeps dtype
        logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
        attn = jax.nn.softmax(logits, axis=-1)
        o = jnp.einsum("bhts,bshd->bthd", attn, v).reshape(b, t, d)
        x = x + o @ blk["wo"]
        h = layer_norm(x, **blk["ln2"])
        x = x + jax.nn.gelu(h @ blk["w1"] + blk["b1"]) @ blk["w2"] + blk["b2"]
    return layer_norm(x, **params["ln_f"]) @ params["head"]


def transformer_batch(
    seed: int = 1, *, batch: int = 8, seq: int = 128, vocab: int = 1024
) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, seq + 1)), jnp.int32)
    return tokens[:, :-1], tokens[:, 1:]


# ------------------------------------------------------------------------------------------
# ResNet-18 (CIFAR stem: 3x3 conv, no max pool), batch norm in training mode
# ------------------------------------------------------------------------------------------

_STAGES = ((64, 1), (128, 2), (256, 2), (512, 2))


def _conv_params(rng, kh, kw, cin, cout):
    return _normal(rng, (kh, kw, cin, cout), kh * kw * cin)


def _bn(c: int) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    params = {"scale": jnp.ones((c,), jnp.float32), "bias": jnp.zeros((c,), jnp.float32)}
    stats = {"mean": jnp.zeros((c,), jnp.float32), "var": jnp.ones((c,), jnp.float32)}
    return params, stats


def init_resnet18(seed: int = 0, *, classes: int = 10) -> tuple[Params, Any]:
    """Parameters and batch-norm running statistics of a CIFAR-style ResNet-18 (11.2M)."""
    rng = np.random.default_rng(seed)
    params: dict[str, Any] = {"stem": _conv_params(rng, 3, 3, 3, 64)}
    stats: dict[str, Any] = {}
    params["stem_bn"], stats["stem_bn"] = _bn(64)
    cin = 64
    blocks_p, blocks_s = [], []
    for cout, stride in _STAGES:
        for i in range(2):
            s = stride if i == 0 else 1
            p: dict[str, Any] = {
                "conv1": _conv_params(rng, 3, 3, cin, cout),
                "conv2": _conv_params(rng, 3, 3, cout, cout),
            }
            st: dict[str, Any] = {}
            p["bn1"], st["bn1"] = _bn(cout)
            p["bn2"], st["bn2"] = _bn(cout)
            if s != 1 or cin != cout:
                p["proj"] = _conv_params(rng, 1, 1, cin, cout)
                p["proj_bn"], st["proj_bn"] = _bn(cout)
            blocks_p.append(p)
            blocks_s.append(st)
            cin = cout
    params["blocks"], stats["blocks"] = blocks_p, blocks_s
    params["fc"] = {"w": _normal(rng, (512, classes), 512), "b": jnp.zeros((classes,))}
    return params, stats


def _conv(x: jax.Array, w: jax.Array, stride: int) -> jax.Array:
    return lax.conv_general_dilated(
        x, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def batch_norm(x, params, stats, momentum=0.9, eps=1e-5):
    """Training-mode batch norm: normalise with batch statistics, update running ones."""
    mean = jnp.mean(x, axis=(0, 1, 2))
    var = jnp.mean(jnp.square(x - mean), axis=(0, 1, 2))
    y = (x - mean) * lax.rsqrt(var + eps) * params["scale"] + params["bias"]
    new_stats = {
        "mean": momentum * stats["mean"] + (1 - momentum) * lax.stop_gradient(mean),
        "var": momentum * stats["var"] + (1 - momentum) * lax.stop_gradient(var),
    }
    return y, new_stats


def resnet18_logits(params: Params, stats: Any, x: jax.Array) -> tuple[jax.Array, Any]:
    new: dict[str, Any] = {}
    h = _conv(x, params["stem"], 1)
    h, new["stem_bn"] = batch_norm(h, params["stem_bn"], stats["stem_bn"])
    h = jax.nn.relu(h)
    new["blocks"] = []
    strides = [s if i == 0 else 1 for _, s in _STAGES for i in range(2)]
    for p, st, stride in zip(params["blocks"], stats["blocks"], strides):
        ns: dict[str, Any] = {}
        y = _conv(h, p["conv1"], stride)
        y, ns["bn1"] = batch_norm(y, p["bn1"], st["bn1"])
        y = jax.nn.relu(y)
        y = _conv(y, p["conv2"], 1)
        y, ns["bn2"] = batch_norm(y, p["bn2"], st["bn2"])
        if "proj" in p:
            sc = _conv(h, p["proj"], stride)
            sc, ns["proj_bn"] = batch_norm(sc, p["proj_bn"], st["proj_bn"])
        else:
            sc = h
        h = jax.nn.relu(y + sc)
        new["blocks"].append(ns)
    h = jnp.mean(h, axis=(1, 2))
    return h @ params["fc"]["w"] + params["fc"]["b"], new


def resnet_batch(seed: int = 1, *, batch: int = 8, size: int = 32) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((batch, size, size, 3)), jnp.float32)
    return x, jnp.asarray(rng.integers(0, 10, batch), jnp.int32)


# ------------------------------------------------------------------------------------------
# Train steps
# ------------------------------------------------------------------------------------------


def _cast(tree: Any, dtype: Any) -> Any:
    return jax.tree.map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
    )


@dataclasses.dataclass
class Workload:
    """A train step factory and its arguments.

    ``make_step(hand_dtype=None)`` returns a *fresh* step function each call (JAX caches
    traces per function object). With ``hand_dtype`` it is the hand-written mixed-precision
    baseline: parameters and inputs cast to that dtype once at the top of the loss, the loss
    itself in float32, the optimizer in float32.
    """

    name: str
    make_step: Callable[..., Callable[..., Any]]
    args: tuple[Any, ...]


def _step_factory(loss_fn: Callable[..., Any], opt: optax.GradientTransformation):
    def make_step(hand_dtype: Any = None) -> Callable[..., Any]:
        def loss(params, state, inputs, labels):
            if hand_dtype is not None:
                params, inputs = _cast(params, hand_dtype), _cast(inputs, hand_dtype)
            logits, new_state = loss_fn(params, state, inputs)
            xent = optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), labels
            )
            return jnp.mean(xent), _cast(new_state, jnp.float32)

        @jmp_rewrite.float32_region
        def update(grads, opt_state, params):
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        def step(params, state, opt_state, inputs, labels):
            (loss_value, new_state), grads = jax.value_and_grad(loss, has_aux=True)(
                params, state, inputs, labels
            )
            params, opt_state = update(grads, opt_state, params)
            return params, new_state, opt_state, loss_value

        return step

    return make_step


def transformer_workload(
    *, layers: int = 12, d_model: int = 256, heads: int = 4, seq: int = 128, batch: int = 8
) -> Workload:
    params = init_transformer(layers=layers, d_model=d_model)
    tokens, labels = transformer_batch(batch=batch, seq=seq)
    opt = optax.adam(1e-3)

    def apply(params, state, tokens):
        return transformer_logits(params, tokens, heads=heads), state

    return Workload(
        f"transformer L={layers} d={d_model} h={heads} T={seq} B={batch}",
        _step_factory(apply, opt),
        (params, {}, opt.init(params), tokens, labels),
    )


def resnet_workload(*, batch: int = 8, size: int = 32) -> Workload:
    params, stats = init_resnet18()
    x, y = resnet_batch(batch=batch, size=size)
    opt = optax.adam(1e-3)
    return Workload(
        f"ResNet-18 {size}x{size} B={batch}",
        _step_factory(resnet18_logits, opt),
        (params, stats, opt.init(params), x, y),
    )


def chain(n_blocks: int, width: int = 8) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """A generated program of ``n_blocks`` ``tanh(h @ w + b)`` blocks (3 equations each)."""

    def f(w, b, x):
        h = x
        for _ in range(n_blocks):
            h = lax.tanh(lax.add(lax.dot(h, w), b))
        return h

    rng = np.random.default_rng(0)
    w = _normal(rng, (width, width), width)
    b = jnp.zeros((4, width), jnp.float32)
    x = _normal(rng, (4, width), 1)
    return f, (w, b, x)
