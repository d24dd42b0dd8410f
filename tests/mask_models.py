"""Tiny encoders whose attention adds a computed bias to a mask fill (issue 28 item 2).

A T5X-style encoder (learned relative-position bias per head plus the padding bias,
``pos + where(m, 0, fill)``) and an ALiBi one (``-slope_h * |i - j|`` plus the padding bias),
two layers each, written once and run in float32, rewritten, or by hand in half precision
(``dtype``: every parameter and activation in that dtype, the fill ``finfo(dtype).min``, as
a careful hand-written model does). Padding leaves the last query rows fully masked.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

B, T, D, H, V = 3, 6, 16, 2, 32
LENGTHS = np.array([6, 4, 2])  # tokens per row; the rest is padding
TOKENS = np.random.default_rng(7).integers(0, V, (B, T)).astype(np.int32)
MASK = (np.arange(T)[None, :] < LENGTHS[:, None]).astype(np.int32)  # HF's attention_mask


def init(seed: int = 0, layers: int = 2) -> dict[str, Any]:
    """Float32 parameters, small enough that a fully masked row is the only hazard."""
    k = iter(jax.random.split(jax.random.key(seed), 4 + 6 * layers))
    n = lambda *s, scale=1.0: scale * jax.random.normal(next(k), s, jnp.float32)  # noqa: E731
    return {
        "embed": n(V, D),
        "rel": n(2 * T - 1, H, scale=0.5),  # a bias per head and relative distance
        "layers": [
            {
                "qkv": n(D, 3 * D, scale=D**-0.5),
                "out": n(D, D, scale=D**-0.5),
                "up": n(D, 2 * D, scale=D**-0.5),
                "down": n(2 * D, D, scale=(2 * D) ** -0.5),
                "norm": 1.0 + n(D, scale=0.1),
            }
            for _ in range(layers)
        ],
        "head": n(D, V, scale=D**-0.5),
    }


def _position_bias(p: dict[str, Any], kind: str, dtype: Any) -> jax.Array:
    """[H, T, T]: T5's learned relative-position bias or ALiBi's linear one."""
    dist = jnp.arange(T)[None, :] - jnp.arange(T)[:, None]
    if kind == "t5":
        return jnp.transpose(p["rel"][dist + T - 1], (2, 0, 1)).astype(dtype)
    slopes = 2.0 ** (-8.0 * jnp.arange(1, H + 1) / H)
    return (-slopes[:, None, None] * jnp.abs(dist)[None]).astype(dtype)


def encoder(
    p: dict[str, Any],
    tokens: Any,
    mask: Any,
    *,
    kind: str = "t5",
    fill: Any = None,
    dtype: Any = jnp.float32,
) -> jax.Array:
    """Per-token logits ``[B, T, V]``; ``fill`` defaults to ``finfo(dtype).min``."""
    fill = jnp.finfo(dtype).min if fill is None else fill
    p = jax.tree.map(lambda a: a.astype(dtype), p)
    pair = mask[:, None, :] * mask[:, :, None]  # [B, T, T]: padded queries fully masked
    bias = _position_bias(p, kind, dtype)[None] + jnp.where(pair[:, None] > 0, 0.0, fill).astype(
        dtype
    )
    h = p["embed"][tokens]
    for lp in p["layers"]:
        x = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * lp["norm"]
        q, k, v = jnp.split(x @ lp["qkv"], 3, axis=-1)
        q, k, v = (a.reshape(B, T, H, D // H) for a in (q, k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) + bias  # T5: no 1/sqrt(d) scaling
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).reshape(B, T, D)
        h = h + a @ lp["out"]
        h = h + jax.nn.relu(h @ lp["up"]) @ lp["down"]
    return (h @ p["head"]).astype(jnp.float32)


def loss(p: dict[str, Any], tokens: Any, mask: Any, **kw: Any) -> jax.Array:
    """Mean squared logits over every position (padding included, as a careless loss
    would: a NaN in a padded row reaches it)."""
    logits = encoder(p, tokens, mask, **kw)
    return jnp.mean(jnp.square(logits)) + 0.0 * jnp.sum(mask)
