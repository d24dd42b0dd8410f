"""Small attention models for ``test_fused_attention.py``, each written once with a
Flax-style compute ``dtype`` (None: the float32 model the rewrite takes; ``jnp.bfloat16``:
the hand-written mixed-precision baseline, float32 parameters, softmax as Flax runs it).

``MODELS[name]() -> (loss, params, batch)`` with ``loss(params, batch, dtype=None)``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _gpu_models  # noqa: E402

FMIN = jnp.finfo(jnp.float32).min


def _cast(x: Any, dtype: Any) -> Any:
    return x if dtype is None else x.astype(dtype)


def _normal(rng, shape, std):
    return jnp.asarray(rng.standard_normal(shape) * std, jnp.float32)


def _flax_like(rng, path, shape):
    """Flax's default initial values, drawn with NumPy (running Flax's init costs seconds):
    LeCun-normal kernels, N(0, 1/features) embeddings, unit scales, zero biases."""
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    name = next(n for n in reversed(names) if n != "value")  # NNX: a Param's value
    if name in ("kernel", "embedding"):
        fan_in = shape[-1] if name == "embedding" else math.prod(shape[:-1])
        if len(shape) == 3 and name == "kernel" and shape[0] > shape[1]:
            fan_in = shape[0]  # attention's query/key/value kernels: (features, heads, dim)
        return _normal(rng, shape, fan_in**-0.5)
    return jnp.ones(shape, jnp.float32) if name == "scale" else jnp.zeros(shape, jnp.float32)


def gpt(layers: int = 1):
    """The GPU benchmark's GPT (einsum, ``where(tril, s, finfo.min)``) at toy sizes."""
    m = _gpu_models.gpt_model(layers=layers, d_model=64, heads=2, seq=16, vocab=128, batch=2)
    params = jax.tree.map(jnp.asarray, m.params)
    batch = (jnp.asarray(m.inputs), jnp.asarray(m.labels))

    def loss(params, batch, dtype=None):
        return m.make_loss(dtype)(params, {}, *batch)[0]

    return loss, params, batch


def vit():
    """The GPU benchmark's Flax Linen ViT (``nn.MultiHeadDotProductAttention``, 5 tokens)."""
    m = _gpu_models.vit_model(**_gpu_models.SMOKE_SIZES["vit"])
    params = jax.tree.map(jnp.asarray, m.params)
    batch = (jnp.asarray(m.inputs), jnp.asarray(m.labels))

    def loss(params, batch, dtype=None):
        return m.make_loss(dtype)(params, {}, *batch)[0]

    return loss, params, batch


# -- a BERT-style encoder with padding (Hugging Face's additive mask) ------------------------

B, T, D, H = 3, 16, 64, 4
LENGTHS = (16, 11, 6)


def _encoder_params(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "emb": _normal(rng, (50, D), 0.5),
        "qkv": _normal(rng, (D, 3 * D), D**-0.5),
        "out": _normal(rng, (D, D), D**-0.5),
        "head": _normal(rng, (D, 5), D**-0.5),
        "rel": _normal(rng, (2 * T - 1, H), 0.5),  # T5: a bias per relative position and head
    }


def _heads(x, dtype):
    b, t, _ = x.shape
    return _cast(x, dtype).reshape(b, t, H, D // H)


def bert():
    """One encoder layer: ``q k^T / sqrt(d) + (1 - mask) * finfo.min`` (BERT in Hugging
    Face), a padded batch (lengths 16, 11, 6); the loss over the real tokens."""
    params = _encoder_params(0)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 50, (B, T)), jnp.int32)
    mask = jnp.asarray(np.arange(T)[None, :] < np.array(LENGTHS)[:, None], jnp.int32)
    labels = jnp.asarray(rng.integers(0, 5, (B, T)), jnp.int32)

    def loss(params, batch, dtype=None):
        tokens, mask, labels = batch
        x = params["emb"][tokens]
        q, k, v = (
            _heads(h, dtype)
            for h in jnp.split(_cast(x, dtype) @ _cast(params["qkv"], dtype), 3, -1)
        )
        s = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(D // H)
        bias = (1.0 - mask[:, None, None, :].astype(s.dtype)) * jnp.finfo(s.dtype).min
        p = jax.nn.softmax(s + bias, axis=-1)
        o = jnp.einsum("bhts,bshd->bthd", p, v).reshape(B, T, D)
        h = _cast(x, dtype) + o @ _cast(params["out"], dtype)
        logits = (h @ _cast(params["head"], dtype)).astype(jnp.float32)
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return jnp.sum(per_token * mask) / jnp.sum(mask)

    return loss, params, (tokens, mask, labels)


def t5():
    """T5-style self-attention: no scale, a learned bias per relative position and head
    (gathered, differentiated) plus the padding mask added to it, as T5 does."""
    params = _encoder_params(2)
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, 50, (B, T)), jnp.int32)
    mask = jnp.asarray(np.arange(T)[None, :] < np.array(LENGTHS)[:, None], jnp.int32)
    labels = jnp.asarray(rng.integers(0, 5, (B, T)), jnp.int32)
    rel = jnp.arange(T)[None, :] - jnp.arange(T)[:, None] + T - 1  # (T, S) in [0, 2T-2]

    def loss(params, batch, dtype=None):
        tokens, mask, labels = batch
        x = params["emb"][tokens]
        q, k, v = (
            _heads(h, dtype)
            for h in jnp.split(_cast(x, dtype) @ _cast(params["qkv"], dtype), 3, -1)
        )
        position_bias = params["rel"][rel].transpose(2, 0, 1)[None]  # (1, H, T, S)
        position_bias = position_bias + (1.0 - mask[:, None, None, :]) * FMIN
        s = jnp.einsum("bthd,bshd->bhts", q, k)
        p = jax.nn.softmax(s.astype(jnp.float32) + position_bias, axis=-1).astype(q.dtype)
        o = jnp.einsum("bhts,bshd->bthd", p, v).reshape(B, T, D)
        h = _cast(x, dtype) + o @ _cast(params["out"], dtype)
        logits = (h @ _cast(params["head"], dtype)).astype(jnp.float32)
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return jnp.sum(per_token * mask) / jnp.sum(mask)

    return loss, params, (tokens, mask, labels)


# -- Flax Linen and NNX transformers -------------------------------------------------------


class LinenBlock(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(50, D, dtype=self.dtype)(tokens)
        mask = nn.make_causal_mask(tokens)
        y = nn.MultiHeadDotProductAttention(num_heads=H, dtype=self.dtype)(
            nn.LayerNorm(dtype=self.dtype)(x), mask=mask
        )
        x = x + y
        x = x + nn.Dense(D, dtype=self.dtype)(nn.gelu(nn.Dense(2 * D, dtype=self.dtype)(x)))
        return nn.Dense(50, dtype=self.dtype)(x).astype(jnp.float32)


def linen():
    """A causal Linen decoder block (``nn.make_causal_mask``) predicting the next token."""
    rng = np.random.default_rng(4)
    tokens = jnp.asarray(rng.integers(0, 50, (B, T + 1)), jnp.int32)
    # Flax's shapes, NumPy's numbers (running init op by op costs seconds)
    shapes = jax.eval_shape(LinenBlock().init, jax.random.key(0), tokens[:, :-1])["params"]
    params = jax.tree_util.tree_map_with_path(lambda p, a: _flax_like(rng, p, a.shape), shapes)

    def loss(params, batch, dtype=None):
        logits = LinenBlock(dtype=dtype).apply({"params": params}, batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    return loss, params, tokens


class NnxBlock(nnx.Module):
    def __init__(self, dtype, rngs):
        self.embed = nnx.Embed(50, D, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(H, D, decode=False, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(D, 5, dtype=dtype, rngs=rngs)

    def __call__(self, tokens, valid):
        x = self.embed(tokens)
        x = x + self.attn(x, mask=nnx.make_attention_mask(valid, valid))
        return self.head(x).astype(jnp.float32)


def nnx_model():
    """An NNX encoder block with a padding mask (``nnx.make_attention_mask``): the padded
    queries' rows are fully masked (their weights uniform in float32)."""
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, 50, (B, T)), jnp.int32)
    valid = jnp.asarray(np.arange(T)[None, :] < np.array(LENGTHS)[:, None])
    labels = jnp.asarray(rng.integers(0, 5, (B, T)), jnp.int32)
    graphdefs, params = {}, None
    for dtype in (None, jnp.bfloat16):  # the structure only: nothing computed
        gd, shapes = nnx.split(nnx.eval_shape(lambda d=dtype: NnxBlock(d, nnx.Rngs(0))), nnx.Param)
        graphdefs[dtype] = gd
        if params is None:
            params = jax.tree_util.tree_map_with_path(
                lambda p, a: _flax_like(rng, p, a.shape), shapes
            )

    def loss(params, batch, dtype=None):
        tokens, valid, labels = batch
        model = nnx.merge(graphdefs[dtype], params)
        logits = model(tokens, valid)
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return jnp.sum(per_token * valid) / jnp.sum(valid)

    return loss, params, (tokens, valid, labels)


MODELS = {"gpt": gpt, "vit": vit, "bert": bert, "t5": t5, "linen": linen, "nnx": nnx_model}
