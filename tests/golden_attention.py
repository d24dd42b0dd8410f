"""Issue 36: the fused-attention family of the painting goldens (``fuse_attention=True``).

Each attention is written here once (not imported from the tests, so that the goldens move only
when the rewrite does), painted in float16 and bfloat16 with ``fuse_attention=True``: the
spellings fused (forward, and as ``rewrite(grad(f))``: forward and backward) beside the
spellings that must stay as written, each with its reason on its values matmul's line
(``att-left``) and in lint. The fused equations carry ``att#N``, the values matmul the bytes
the fused call does not write.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from golden_text import Case, Config

F32 = jnp.float32
B, T, H, D, KV = 2, 8, 4, 16, 2
FMIN = jnp.finfo(F32).min
TRIL = jnp.tril(jnp.ones((T, T), bool))
FUSED = (Config("float16", fuse_attention=True), Config("bfloat16", fuse_attention=True))


def _sds(*shape: int, dtype: Any = F32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def _logits(q, k, **kw):
    return jnp.einsum("bthd,bshd->bhts", q, k, **kw)


def _out(p, v):
    return jnp.einsum("bhts,bshd->bthd", p, v)


def _grouped(q, k, v, m):  # MaxText/Gemma: queries as (kv heads, group), no repeat
    qg = q.reshape(B, T, KV, H // KV, D)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k) * D**-0.5
    p = jax.nn.softmax(jnp.where(TRIL, s, FMIN))
    return jnp.einsum("bkgts,bskd->btkgd", p, v).reshape(B, T, H, D)


def _soft_capped(q, k, v, m):  # Gemma 2: tanh(s / c) * c before the mask
    s = _logits(q, k) * D**-0.5
    s = jnp.tanh(s / 50.0) * 50.0
    return _out(jax.nn.softmax(jnp.where(TRIL, s, FMIN)), v)


#: name -> (attention(q, k, v, m), key/value heads, head dim)
SPELLINGS = {
    "causal-where": (
        lambda q, k, v, m: _out(jax.nn.softmax(jnp.where(TRIL, _logits(q, k), FMIN)), v),
        H,
        D,
    ),
    "padding-additive": (
        lambda q, k, v, m: _out(
            jax.nn.softmax(_logits(q, k) + (1.0 - m[:, None, None, :]) * FMIN), v
        ),
        H,
        D,
    ),
    "keys-first": (
        lambda q, k, v, m: _out(
            jax.nn.softmax(jnp.swapaxes(k.transpose(0, 2, 1, 3) @ q.transpose(0, 2, 3, 1), -1, -2)),
            v,
        ),
        H,
        D,
    ),
    "gqa-repeat": (
        lambda q, k, v, m: _out(
            jax.nn.softmax(_logits(q, jnp.repeat(k, H // KV, 2))), jnp.repeat(v, H // KV, 2)
        ),
        KV,
        D,
    ),
    "gqa-grouped": (_grouped, KV, D),
    "head-dim-128": (lambda q, k, v, m: _out(jax.nn.softmax(_logits(q, k)), v), H, 128),
    # left as written, each with its reason
    "queries-axis": (lambda q, k, v, m: _out(jax.nn.softmax(_logits(q, k), axis=-2), v), H, D),
    "bias-minus-logits": (
        lambda q, k, v, m: _out(jax.nn.softmax(m[:, None, None, :] * 2.0 - _logits(q, k)), v),
        H,
        D,
    ),
    "head-dim-136": (lambda q, k, v, m: _out(jax.nn.softmax(_logits(q, k)), v), H, 136),
    "precision-highest": (
        lambda q, k, v, m: _out(
            jax.nn.softmax(_logits(q, k, precision=jax.lax.Precision.HIGHEST)), v
        ),
        H,
        D,
    ),
    "soft-capped": (_soft_capped, H, D),
}


def attention() -> list[Case]:
    cases: list[Case] = []
    for name, (att, kv, d) in SPELLINGS.items():
        mask = _sds(B, T, dtype=jnp.int32)  # padding from the data
        args = (_sds(B, T, H, d), _sds(B, T, kv, d), _sds(B, T, kv, d), mask)
        cases.append(Case(f"attention/{name}", att, args, FUSED))

        def loss(q, k, v, m, att=att):
            return jnp.sum(jnp.tanh(att(q, k, v, m)))

        if name in ("causal-where", "padding-additive", "gqa-grouped", "keys-first"):
            grad = jax.grad(loss, argnums=(0, 1, 2))
            cases.append(Case(f"attention/{name}-grad", grad, args, FUSED))
    return cases
