"""A fused attention on a TPU: JAX's Pallas flash-attention kernel (forward and backward).

``jax.experimental.pallas.ops.tpu.flash_attention`` (the same in jax 0.10.2 and 0.12.0.1)
takes ``(batch, heads, length, head dim)`` arrays of one head count, ``causal``,
``sm_scale``, a bias ``ab`` of the logits' full size, added *before* the scale, and
``SegmentIds`` (a query attends a key where their ids are equal); its block sizes must
divide the lengths, its key blocks be multiples of 128. So here:

* queries, keys and values move to ``(B, N, L, D)``; grouped keys and values (GQA) are
  repeated to the query heads (JAX sums their gradients back); float16 runs in float32;
* the query length is padded to a multiple of 8 (up to 128: one block) or of 128, the key
  length to a multiple of 128; padded keys get segment id 0, which no query has, padded
  query rows are dropped;
* masks per query token and per key token become segment ids: a query kept has id 1, one
  masked -1, a key kept 1, one masked 0 (equal only when both are kept);
* a bias is divided by the scale (the kernel adds it before scaling), clipped to a finite
  range the kernel's own mask value (``-0.7 * finfo(float32).max``) cannot overflow, and cast
  to the half dtype (as cuDNN gets it). One of the logits' full size is the kernel's ``ab``;
  one per key (Hugging Face's additive padding mask) or per query is one more head dim of
  the keys (queries) against ones in the queries' (keys'), zeros in the values'
  (:mod:`~jmp_rewrite._src.attention.tpu` refuses other biases). A row whose bias is
  ``-inf`` throughout is NaN, as float32 makes it.

Rows a mask leaves without keys are set from outside the kernel, as on CUDA
(``attention._guard``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
import numpy as np

from jmp_rewrite._src.attention.match import Core
from jmp_rewrite._src.attention.tpu import LANES, padded_lengths, round_up

_F32_MAX = float(np.finfo(np.float32).max)


def _flash_module() -> Any:
    from jax.experimental.pallas.ops.tpu import flash_attention

    return flash_attention


@functools.lru_cache(maxsize=1)
def tpu_traceable() -> bool:
    """Whether the TPU kernel can be traced here (JAX's Pallas TPU ops import)."""
    try:
        _flash_module()
    except Exception:  # noqa: BLE001 - no Pallas TPU support in this jax(lib)
        return False
    return True


def _pad(x: Any, axis: int, n: int, value: Any = 0) -> Any:
    if x.shape[axis] == n:
        return x
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, n - x.shape[axis])
    return jnp.pad(x, pads, constant_values=value)


def _keep(sides: list[Any], batch: int, n: int) -> Any:
    """The ``and`` of ``(B|1, n|1)`` masks as ``(B, n)``, or None."""
    keep = None
    for x in sides:
        keep = x if keep is None else keep & x
    return None if keep is None else jnp.broadcast_to(keep, (batch, n))


def _token_bias(q: Any, k: Any, v: Any, scaled: Any) -> tuple[Any, Any, Any]:
    """A bias per key ``(B|1, N|1, 1, S)`` (or per query, ``(B|1, N|1, T, 1)``) as one more
    head dim: the keys' (queries') holds it, the other side's is 1, the values' 0. The head
    dim is padded to a multiple of 128 above 128 (what the kernel takes)."""
    b, n, t, d = q.shape
    s = k.shape[2]
    per_query = scaled.shape[2] > 1
    if per_query:
        column = jnp.broadcast_to(scaled[..., 0], (b, n, t))[..., None]
        q = jnp.concatenate([q, column], -1)
        k = jnp.concatenate([k, jnp.ones((b, n, s, 1), k.dtype)], -1)
    else:
        column = jnp.broadcast_to(scaled[..., 0, :], (b, n, s))[..., None]
        q = jnp.concatenate([q, jnp.ones((b, n, t, 1), q.dtype)], -1)
        k = jnp.concatenate([k, column], -1)
    v = jnp.concatenate([v, jnp.zeros((b, n, s, 1), v.dtype)], -1)
    if d + 1 > LANES:
        q, k, v = (_pad(x, 3, round_up(d + 1, LANES)) for x in (q, k, v))
    return q, k, v


def flash(core: Core, q: Any, k: Any, v: Any, bias: Any, q_keep: list[Any], k_keep: list[Any]):
    """The attention on the TPU kernel, in ``jax.nn.dot_product_attention``'s layout.

    Args:
      core: what it computes (scale, causal, GQA group).
      q: ``(B, T, N, D)``; k, v: ``(B, S, K, D)``, in the half dtype.
      bias: float32 ``(B|1, N|1, T|1, S|1)``, the term added to the scaled logits: of their
        full size, or per key or per query; or None.
      q_keep, k_keep: boolean masks per query (``(B|1, T|1)``) and per key (``(B|1, S|1)``).

    Returns:
      ``(B, T, N, D)`` in ``q``'s dtype.
    """
    fa = _flash_module()
    b, t, n, d = q.shape
    s = k.shape[1]
    tp, sp = padded_lengths(t, s)
    if core.group > 1:
        k, v = (jnp.repeat(x, core.group, axis=2) for x in (k, v))
    half = q.dtype
    run = jnp.float32 if half == jnp.float16 else half
    q, k, v = (jnp.swapaxes(x, 1, 2).astype(run) for x in (q, k, v))  # (B, N, L, D)
    ab = None
    if bias is not None:  # added before the kernel's scale; finite where its mask adds to it
        # clipped before the division: XLA folds (x * c) / scale into x * (c / scale), which
        # overflows for Hugging Face's (1 - m) * finfo.min and makes 0 * -inf a NaN
        limit = min(0.25 * _F32_MAX, 0.5 * _F32_MAX * core.scale)
        scaled = (jnp.clip(bias, -limit, limit) / np.float32(core.scale)).astype(run)
        if bias.shape[2] > 1 and bias.shape[3] > 1:
            ab = _pad(_pad(jnp.broadcast_to(scaled, (b, n, t, s)), 2, tp), 3, sp)
        else:
            q, k, v = _token_bias(q, k, v, scaled)
    q, k, v = _pad(q, 2, tp), _pad(k, 2, sp), _pad(v, 2, sp)
    qk, kk = _keep(q_keep, b, t), _keep(k_keep, b, s)
    segments = None
    if qk is not None or kk is not None or sp > s:
        q_ids = jnp.ones((b, t), jnp.int32) if qk is None else jnp.where(qk, 1, -1)
        kv_ids = jnp.ones((b, s), jnp.int32) if kk is None else kk.astype(jnp.int32)
        segments = fa.SegmentIds(q=_pad(q_ids, 1, tp, 1), kv=_pad(kv_ids, 1, sp, 0))
    bq, bk = min(tp, LANES), LANES
    blocks = fa.BlockSizes(
        block_q=bq,
        block_k_major=bk,
        block_k=bk,
        block_b=1,
        block_q_major_dkv=bq,
        block_k_major_dkv=bk,
        block_k_dkv=bk,
        block_q_dkv=bq,
        block_k_major_dq=bk,
        block_k_dq=bk,
        block_q_dq=bq,
    )
    out = fa.flash_attention(
        q, k, v, ab, segments, causal=core.causal, sm_scale=float(core.scale), block_sizes=blocks
    )
    out = jnp.swapaxes(out[:, :, :t, :d], 1, 2).astype(half)
    if bias is not None:  # a row of -inf bias: float32's NaN (the clip made it uniform)
        dead = jnp.all(bias == -jnp.inf, axis=-1)  # (B|1, N|1, T|1)
        dead = jnp.broadcast_to(jnp.swapaxes(dead, 1, 2)[..., None], out.shape)
        out = jnp.where(dead, jnp.nan, out)
    return out
