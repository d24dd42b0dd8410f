"""``rewrite(..., fuse_attention=True)``: attention replaced by ``jax.nn.dot_product_attention``.

Which attentions are fused (each mask spelling, forward and backward of a differentiated
program), what the fused call computes against float32 and hand-written bfloat16 (on CPU,
JAX's own attention: the cuDNN branch is only lowered for CUDA; its figures come from the
deviceless compile of ``benchmarks/gpu_memory.py``), the float32 value of rows left without
keys, and every case left as written with the reason ``explain(...).lint()`` gives.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_models import MODELS, gpt

import jmp_rewrite
from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src.emit import attention as attention_emit

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

BF16 = jnp.bfloat16
B, T, H, D = 2, 8, 2, 16
FMIN = jnp.finfo(jnp.float32).min


def _rel(a, b) -> float:
    a = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(a)])
    b = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(b)])
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _selection(fn, *args):
    entry, _ = fn.trace(*args)
    return entry.painting.attention


@pytest.fixture
def calls(monkeypatch):
    """Counts the ``jax.nn.dot_product_attention`` calls the rewrite emits."""
    attention_emit.cudnn_traceable()  # its probe (cached) is no call of the program's
    seen = []
    real = jax.nn.dot_product_attention

    def counting(*args, **kwargs):
        seen.append((kwargs.get("implementation"), *(tuple(a.shape) for a in args[:2])))
        return real(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", counting)
    return seen


# -- the models, both orders ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_fuse_forward_and_backward_within_hand_written_error(name, calls):
    """rewrite(grad(f)) replaces forward and backward (one call per attention, its VJP
    reused); grad(rewrite(f)) the forward, which JAX differentiates. Both within bfloat16's
    tolerance of float32 and no further from it than the hand-written bfloat16 model (the
    same model with Flax's ``dtype=bfloat16``)."""
    loss, params, batch = MODELS[name]()

    def vg(dtype=None):
        return jax.value_and_grad(lambda p, b: loss(p, b, dtype))

    step = jmp_rewrite.rewrite(vg(), dtype=BF16, fuse_attention=True)
    sel = _selection(step, params, batch)
    if name == "t5":  # its learned bias plus the padding: a bias of batch 3, differentiated
        inner = jmp_rewrite.rewrite(loss, dtype=BF16, fuse_attention=True)
        for left in (sel, _selection(inner, params, batch)):
            assert not left.fused and left.left
            assert all("for batch 1 only (jax issue 30593)" in r for r in left.left.values())
        return
    ref = jax.jit(vg())(params, batch)
    hand = jax.jit(vg(BF16))(params, batch)
    assert sel.fused and not sel.left
    assert all(f.backward_at is not None for f in sel.fused)
    calls.clear()
    fused = jax.jit(step)(params, batch)
    assert len(calls) == len(sel.fused)  # the backward is the forward call's VJP

    inner = jmp_rewrite.rewrite(loss, dtype=BF16, fuse_attention=True)
    forward_only = _selection(inner, params, batch)
    assert len(forward_only.fused) == len(sel.fused)
    assert all(f.backward_at is None for f in forward_only.fused)
    outer = jax.jit(jax.value_and_grad(inner))(params, batch)

    err_hand = _rel(hand[1], ref[1])
    for got in (fused, outer):
        err = _rel(got[1], ref[1])
        assert err < 5e-2  # bfloat16's tolerance (compare's default)
        assert err <= 1.1 * err_hand, (err, err_hand)
        assert abs(float(got[0]) - float(ref[0])) <= 2e-2 * abs(float(ref[0]))
        assert jax.tree.map(lambda a: a.dtype, got[1]) == jax.tree.map(lambda a: a.dtype, ref[1])


# -- mask spellings -----------------------------------------------------------------------


def _qkv(seed=0, heads=H):
    rng = np.random.default_rng(seed)
    return tuple(
        jnp.asarray(rng.standard_normal((B, T, h, D)), jnp.float32) for h in (H, heads, heads)
    )


PAD = jnp.asarray(np.arange(T)[None, :] < np.array([T, 5])[:, None], jnp.int32)
TRIL = jnp.tril(jnp.ones((T, T), bool))


def _einsum(q, k):
    return jnp.einsum("bthd,bshd->bhts", q, k)


def _out(p, v):
    return jnp.einsum("bhts,bshd->bthd", p, v)


def _keys_first(q, k):  # the logits' dot_general(k, q): (b, h, s, t), then transposed
    return jnp.swapaxes(k.transpose(0, 2, 1, 3) @ q.transpose(0, 2, 3, 1), -1, -2)


SPELLINGS = {
    # the benchmark GPT's: where(tril, s, finfo.min), scale after the logits
    "tril_where": (
        lambda q, k, v, m: _out(jax.nn.softmax(jnp.where(TRIL, _einsum(q, k) * D**-0.5, FMIN)), v),
        "causal",
    ),
    # matmul, heads first, an iota comparison, -inf, the scale after the mask
    "iota_matmul_inf": (
        lambda q, k, v, m: (
            jax.nn.softmax(
                jnp.where(
                    jnp.arange(T)[:, None] >= jnp.arange(T)[None, :],
                    q.transpose(0, 2, 1, 3) @ k.transpose(0, 2, 3, 1),
                    -jnp.inf,
                )
                / math.sqrt(D)
            )
            @ v.transpose(0, 2, 1, 3)
        ).transpose(0, 2, 1, 3),
        "causal",
    ),
    # Hugging Face BERT: an additive mask from the data, the scale on the queries
    "additive_finfo": (
        lambda q, k, v, m: _out(
            jax.nn.softmax(_einsum(q / math.sqrt(D), k) + (1.0 - m[:, None, None, :]) * FMIN), v
        ),
        "bias",
    ),
    # the scale computed in the program from constants (Flax and T5X write jnp.sqrt(depth)):
    # a constant, as math.sqrt's number is
    "jnp_sqrt_on_logits": (
        lambda q, k, v, m: _out(
            jax.nn.softmax(
                _einsum(q, k) / jnp.sqrt(q.shape[-1]) + (1.0 - m[:, None, None, :]) * FMIN
            ),
            v,
        ),
        "bias",
    ),
    "rsqrt_times_logits": (
        lambda q, k, v, m: _out(
            jax.nn.softmax(
                jnp.where(TRIL, _einsum(q, k) * jax.lax.rsqrt(jnp.float32(q.shape[-1])), FMIN)
            ),
            v,
        ),
        "causal",
    ),
    # where(mask, s, -1e9) with the mask from the data
    "where_data": (
        lambda q, k, v, m: _out(
            jax.nn.softmax(jnp.where(m[:, None, None, :] > 0, _einsum(q, k), -1e9)), v
        ),
        "mask",
    ),
    # where(~mask, fill, s): the logits are the second case
    "where_inverted": (
        lambda q, k, v, m: _out(
            jax.nn.softmax(jnp.where(m[:, None, None, :] == 0, FMIN, _einsum(q, k))), v
        ),
        "mask",
    ),
    # a constant mask that is not causal (a local window): a mask tensor, no guard
    "window": (
        lambda q, k, v, m: _out(
            jax.nn.softmax(
                jnp.where(jnp.abs(jnp.arange(T)[:, None] - jnp.arange(T)) <= 2, _einsum(q, k), FMIN)
            ),
            v,
        ),
        "mask",
    ),
    # causal and padding together, the softmax in float32 of bfloat16-rounded logits
    "causal_and_padding": (
        lambda q, k, v, m: _out(
            jax.nn.softmax(
                jnp.where(TRIL & (m[:, None, None, :] > 0), _einsum(q, k), FMIN)
                .astype(BF16)
                .astype(jnp.float32)
            ),
            v,
        ),
        "causal+mask",
    ),
    # a bias from the data, then the scale: the bias is scaled too
    "bias_then_scale": (
        lambda q, k, v, m: _out(
            jax.nn.softmax((_einsum(q, k) + m[:, None, None, :] * 2.0) * 0.25), v
        ),
        "bias",
    ),
    # the keys as the logits matmul's first operand ((k q^T)^T; einsum would put the queries
    # first): fused with the queries as queries (taken the other way round: error 0.32)
    "keys_first": (
        lambda q, k, v, m: _out(jax.nn.softmax(jnp.where(TRIL, _keys_first(q, k), FMIN)), v),
        "causal",
    ),
    # GQA: one key/value head repeated for both query heads
    "gqa_repeat": (
        lambda q, k, v, m: _out(
            jax.nn.softmax(jnp.where(TRIL, _einsum(q, jnp.repeat(k, H, 2)), FMIN)),
            jnp.repeat(v, H, 2),
        ),
        "causal",
    ),
}


def _hand(att, q, k, v, m):
    """The same attention hand-written in bfloat16: queries, keys, values and the logits in
    bfloat16 (the softmax as the spelling promotes it), its output bfloat16, as Flax's
    attention with ``dtype=bfloat16`` returns it."""
    return att(q.astype(BF16), k.astype(BF16), v.astype(BF16), m).astype(BF16).astype(jnp.float32)


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_each_mask_spelling_fuses_with_its_meaning(spelling):
    att, kind = SPELLINGS[spelling]
    q, k, v = _qkv(1, heads=1 if spelling == "gqa_repeat" else H)

    def loss(q, k, v, m):
        return jnp.sum(jnp.tanh(att(q, k, v, m)) * jnp.arange(D))

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
    step = jmp_rewrite.rewrite(grad, dtype=BF16, fuse_attention=True)
    sel = _selection(step, q, k, v, PAD)
    assert len(sel.fused) == 1 and not sel.left, sel.left
    core = sel.fused[0].core
    assert sel.fused[0].backward_at is not None
    assert core.causal == ("causal" in kind)
    assert bool(core.masks) == ("mask" in kind)
    assert bool(core.biases) == ("bias" in kind)
    assert core.guard_mask == (kind in ("mask", "causal+mask") and spelling != "window")

    # Eagerly (the spellings share their shapes: JAX's per-primitive compilations are reused).
    ref = grad(q, k, v, PAD)
    got = step(q, k, v, PAD)
    hand_loss = lambda *a: jnp.sum(jnp.tanh(_hand(att, *a)) * jnp.arange(D))  # noqa: E731
    hand = jax.value_and_grad(hand_loss, argnums=(0, 1, 2))(q, k, v, PAD)
    unfused = jmp_rewrite.rewrite(grad, dtype=BF16)(q, k, v, PAD)
    err = _rel(got[1], ref[1])
    assert err <= 1.1 * max(_rel(hand[1], ref[1]), _rel(unfused[1], ref[1]))
    out = jmp_rewrite.rewrite(att, dtype=BF16, fuse_attention=True)(q, k, v, PAD)
    want = att(q, k, v, PAD)
    plain = jmp_rewrite.rewrite(att, dtype=BF16)(q, k, v, PAD)
    assert out.dtype == jnp.float32 and out.shape == want.shape
    assert _rel(out, want) <= 1.1 * max(_rel(_hand(att, q, k, v, PAD), want), _rel(plain, want))


def test_custom_jvp_softmax_fuses_in_both_orders():
    """``jax_softmax_custom_jvp``: softmax is a ``custom_jvp_call`` (forward) and its rule's
    transpose (backward); both are found."""
    att = SPELLINGS["tril_where"][0]
    q, k, v = _qkv(2)

    def loss(q, k, v):
        return jnp.sum(jnp.tanh(att(q, k, v, PAD)))

    with _custom_jvp_softmax():
        grad = jax.grad(loss, argnums=(0, 1, 2))
        step = jmp_rewrite.rewrite(grad, dtype=BF16, fuse_attention=True)
        sel = _selection(step, q, k, v)
        inner = jmp_rewrite.rewrite(loss, dtype=BF16, fuse_attention=True)
        assert [f.core.causal for f in _selection(inner, q, k, v).fused] == [True]
        ref = grad(q, k, v)
        assert _rel(jax.jit(step)(q, k, v), ref) < 2e-2
        assert _rel(jax.jit(jax.grad(inner, argnums=(0, 1, 2)))(q, k, v), ref) < 2e-2
    assert len(sel.fused) == 1 and sel.fused[0].backward_at is not None


class _custom_jvp_softmax:
    def __enter__(self):
        self.old = jax.config.jax_softmax_custom_jvp
        jax.config.update("jax_softmax_custom_jvp", True)

    def __exit__(self, *exc):
        jax.config.update("jax_softmax_custom_jvp", self.old)


# -- grouped-query attention as MaxText and Gemma write it -----------------------------------

KV = 2


def _grouped(q, k, v, m):
    """Queries reshaped to (kv heads, group), no repeat of the keys and values (MaxText's
    ``BTKGD,BSKD->BKGTS``, Gemma's grouped einsum), a causal mask and a padding mask."""
    b, t, h, d = q.shape
    s = jnp.einsum("btkgd,bskd->bkgts", q.reshape(b, t, KV, h // KV, d), k) * d**-0.5
    s = jnp.where(TRIL & (m[:, None, None, None, :] > 0), s, FMIN)
    return jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(s), v).reshape(b, t, h, d)


@pytest.mark.parametrize("dtype", [BF16, jnp.float16], ids=["bf16", "f16"])
def test_grouped_query_attention_as_a_grouped_einsum_fuses_with_fewer_kv_heads(dtype, calls):
    """GQA without ``repeat``: one fused call, given the keys and values with their own two
    heads for the queries' four (``jax.nn.dot_product_attention`` takes GQA natively), forward
    and backward, within the unfused rewrite's error of float32."""
    rng = np.random.default_rng(16)
    q = jnp.asarray(rng.standard_normal((B, T, 2 * KV, D)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, T, KV, D)), jnp.float32) for _ in range(2))
    fn = jmp_rewrite.rewrite(_grouped, dtype=dtype, fuse_attention=True)
    sel = _selection(fn, q, k, v, PAD)
    assert len(sel.fused) == 1 and not sel.left, sel.left
    core = sel.fused[0].core
    assert core.group == 2 and core.causal and core.masks and core.guard_mask
    calls.clear()
    jax.make_jaxpr(fn)(q, k, v, PAD)  # the traced program calls it, K/V with their 2 heads
    assert calls == [(None, (B, T, 2 * KV, D), (B, T, KV, D))]
    want = _grouped(q, k, v, PAD)
    got = jax.jit(fn)(q, k, v, PAD)
    plain = jmp_rewrite.rewrite(_grouped, dtype=dtype)(q, k, v, PAD)
    assert got.dtype == jnp.float32 and got.shape == want.shape
    assert _rel(got, want) <= 1.1 * _rel(plain, want) + 1e-3

    grad = jax.grad(lambda *a: jnp.sum(jnp.tanh(_grouped(*a)) * jnp.arange(D)), argnums=(0, 1, 2))
    step = jmp_rewrite.rewrite(grad, dtype=dtype, fuse_attention=True)
    sel = _selection(step, q, k, v, PAD)
    assert len(sel.fused) == 1 and sel.fused[0].backward_at is not None, sel.left
    ref = grad(q, k, v, PAD)
    plain = jmp_rewrite.rewrite(grad, dtype=dtype)(q, k, v, PAD)
    assert _rel(jax.jit(step)(q, k, v, PAD), ref) <= 1.1 * _rel(plain, ref) + 1e-3


def test_grouped_query_rows_without_keys_get_the_mean_of_their_own_kv_heads_values():
    """GQA (4 query heads, 2 key/value heads: query head ``n`` reads kv head ``n // 2``),
    a finite fill (``-1e9``) and a batch whose keys are all padded: float32 gives each of
    its rows the mean of its own kv head's values; so does the fused call (its guard), the
    kv heads' values far apart (a mean of the other kv head's is off by about 3)."""
    rng = np.random.default_rng(23)
    q = jnp.asarray(rng.standard_normal((B, T, 2 * KV, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, T, KV, D)), jnp.float32)
    v = rng.standard_normal((B, T, KV, D)) + 3.0 * np.arange(KV)[:, None]  # heads apart
    v = jnp.asarray(v, jnp.float32)
    m = jnp.asarray([[1] * T, [0] * T], jnp.int32)

    def att(q, k, v, m):
        b, t, h, d = q.shape
        s = jnp.einsum("btkgd,bskd->bkgts", q.reshape(b, t, KV, h // KV, d), k) * d**-0.5
        s = jnp.where(m[:, None, None, None, :] > 0, s, -1e9)
        return jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(s), v).reshape(b, t, h, d)

    fn = jmp_rewrite.rewrite(att, dtype=BF16, fuse_attention=True)
    sel = _selection(fn, q, k, v, m)
    assert len(sel.fused) == 1 and not sel.left, sel.left
    core = sel.fused[0].core
    assert core.group == 2 and core.guard_mask and core.fill == -1e9
    want, got = att(q, k, v, m), jax.jit(fn)(q, k, v, m)
    own = jnp.repeat(v[1].mean(0), 2, axis=0)  # (query heads, D): kv head n // 2's mean
    np.testing.assert_allclose(want[1], jnp.broadcast_to(own, want[1].shape), atol=1e-5)
    assert got.dtype == jnp.float32 and got.shape == want.shape
    np.testing.assert_allclose(got[1], want[1], atol=2e-2)
    np.testing.assert_allclose(got[0], want[0], atol=3e-2)


def test_a_mask_that_differs_between_the_heads_of_a_group_is_left():
    rng = np.random.default_rng(17)
    q = jnp.asarray(rng.standard_normal((B, T, 2 * KV, D)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, T, KV, D)), jnp.float32) for _ in range(2))
    per_head = jnp.asarray(rng.random((KV, 2, T, T)) > 0.2)

    def att(q, k, v):
        s = jnp.einsum("btkgd,bskd->bkgts", q.reshape(B, T, KV, 2, D), k)
        p = jax.nn.softmax(jnp.where(per_head, s, FMIN))
        return jnp.einsum("bkgts,bskd->btkgd", p, v).reshape(B, T, 2 * KV, D)

    sel = _selection(jmp_rewrite.rewrite(att, dtype=BF16, fuse_attention=True), q, k, v)
    assert not sel.fused and ["query heads of a group" in r for r in sel.left.values()] == [True]


# -- cuDNN's known traps, guarded in the emitted program (its cuDNN branch traced on CPU) -----


@pytest.fixture
def cudnn_args(monkeypatch):
    """The arguments of each ``implementation='cudnn'`` call the rewrite emits: the cuDNN
    branch of its ``lax.platform_dependent`` is traced as if a CUDA plugin were installed
    (the call itself is JAX's own attention here, with the same arguments)."""
    monkeypatch.setattr(attention_emit, "cudnn_traceable", lambda: True)
    seen = []
    real = jax.nn.dot_product_attention

    def recording(q, k, v, bias=None, mask=None, **kw):
        if kw.pop("implementation", None) == "cudnn":
            seen.append(dict(q=q, k=k, v=v, bias=bias, mask=mask, **kw))
        return real(q, k, v, bias=bias, mask=mask, **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    return seen


def _traced(att, *args, argnums=None):
    fn = att if argnums is None else jax.grad(lambda *a: jnp.sum(att(*a)), argnums=argnums)
    return jax.make_jaxpr(jmp_rewrite.rewrite(fn, dtype=BF16, fuse_attention=True))(*args)


def test_cudnn_gets_a_bias_of_the_queries_dtype(cudnn_args):
    """A float32 bias with bfloat16 queries gives NaN gradients in cuDNN (jax issue 32242):
    the bias is handed over in the queries' dtype."""
    q, k, v = _qkv(18)
    att = SPELLINGS["additive_finfo"][0]
    _traced(att, q, k, v, PAD.astype(jnp.float32), argnums=(0, 1, 2))
    (call,) = cudnn_args
    assert call["q"].dtype == BF16 and call["bias"].dtype == BF16 and call["mask"] is None


def test_cudnn_gets_a_padding_mask_at_both_sequence_lengths(cudnn_args):
    """A ``(B, 1, 1, S)`` padding mask without a bias is refused by cuDNN ("Bias must have
    same seq length", jax issue 28974): it is broadcast to ``(B, 1, T, S)``."""
    q, k, v = _qkv(19)
    _traced(SPELLINGS["where_data"][0], q, k, v, PAD)
    (call,) = cudnn_args
    assert call["bias"] is None and call["mask"].shape == (B, 1, T, T)


@pytest.mark.parametrize(
    "t, masked, padded",
    [(64, True, 128), (192, True, 256), (64, False, 64), (96, True, 96), (9, True, 10)],
    ids=["64-masked", "192-masked", "64-causal", "96-masked", "odd"],
)
def test_cudnn_lengths_64_mod_128_with_a_mask_are_padded_to_128(cudnn_args, t, masked, padded):
    """NaN query gradients when ``T % 128 == 64`` with an explicit mask (pytorch issue
    196678): such lengths are padded to a multiple of 128 (the padded keys masked by their
    sequence length, the padded queries dropped), as odd ones are padded to even; a causal
    attention without a mask tensor keeps its length."""
    rng = np.random.default_rng(20)
    q, k, v = (jnp.asarray(rng.standard_normal((1, t, 1, 8)), jnp.float32) for _ in range(3))
    m = jnp.asarray(np.arange(t) < t - 3, jnp.int32)[None]
    tril = jnp.tril(jnp.ones((t, t), bool))

    def att(q, k, v, m):
        keep = (m[:, None, None, :] > 0) if masked else tril
        return _out(jax.nn.softmax(jnp.where(keep, _einsum(q, k), FMIN)), v)

    closed = _traced(att, q, k, v, m, argnums=(0, 1, 2))
    (call,) = cudnn_args
    assert call["q"].shape[1] == call["k"].shape[1] == padded
    assert call["is_causal"] == (not masked)
    if padded != t:
        assert call["mask"].shape[-2:] == (padded, padded)
        assert call["key_value_seq_lengths"].shape == (1,)  # one length per batch
    else:
        assert call["key_value_seq_lengths"] is None
    assert [a.aval.shape for a in closed.jaxpr.outvars] == [(1, t, 1, 8)] * 3


def test_a_bias_gradient_of_batch_above_one_is_left_with_the_reason():
    """cuDNN computes a bias's gradient for batch 1 only (jax issue 30593): a differentiated
    bias of batch 2 is left as written, one of batch 1 (T5's relative positions) fused."""
    q, k, v = _qkv(21)
    rng = np.random.default_rng(21)

    def att(q, k, v, b):
        return _out(jax.nn.softmax(_einsum(q, k) + b), v)

    for batch, fused in ((B, False), (1, True)):
        b = jnp.asarray(rng.standard_normal((batch, H, T, T)), jnp.float32)
        grad = jax.grad(lambda *a: jnp.sum(jnp.tanh(att(*a))), argnums=(0, 1, 2, 3))
        sel = _selection(jmp_rewrite.rewrite(grad, dtype=BF16, fuse_attention=True), q, k, v, b)
        assert len(sel.fused) == fused, sel.left
        if not fused:
            (why,) = sel.left.values()
            assert "bias of batch 2: cuDNN computes a bias's gradient for batch 1 only" in why
        # forward only (grad(rewrite(f)): JAX differentiates the call): a float bias input
        # of batch 2 may be differentiated; one made from an integer mask cannot be
        forward = jmp_rewrite.rewrite(att, dtype=BF16, fuse_attention=True)
        assert len(_selection(forward, q, k, v, b).fused) == fused
    # a padding mask (over batch and keys only), from an integer or a float mask: fused
    padding = jmp_rewrite.rewrite(
        lambda q, k, v, m: att(q, k, v, (1.0 - m[:, None, None, :]) * FMIN),
        dtype=BF16,
        fuse_attention=True,
    )
    for m in (PAD, PAD.astype(jnp.float32)):
        assert len(_selection(padding, q, k, v, m).fused) == 1


def test_a_bias_over_batch_and_heads_of_batch_above_one_is_left_with_the_reason():
    """ALiBi-like slopes learned per batch and head (a float argument): the bias is
    ``(batch, heads, 1, keys)``, over no query dim, but its heads make it a learned bias and
    JAX may differentiate it (``grad(rewrite(f))`` differentiates the fused call): batch 2
    is left as written, with the reason; batch 1 fused. Unfused, the gradient of the slopes
    is the rewrite's own, near float32's."""
    q, k, v = _qkv(22)
    rng = np.random.default_rng(22)

    def att(q, k, v, slopes):
        bias = slopes[:, :, None, None] * jnp.arange(T, dtype=jnp.float32)  # (b, h, 1, s)
        return _out(jax.nn.softmax(_einsum(q, k) + bias), v)

    for batch, fused in ((B, False), (1, True)):
        slopes = jnp.asarray(0.3 * rng.standard_normal((batch, H)), jnp.float32)
        forward = jmp_rewrite.rewrite(att, dtype=BF16, fuse_attention=True)
        sel = _selection(forward, q, k, v, slopes)
        assert len(sel.fused) == fused, sel.left
        if fused:
            assert sel.fused[0].core.biases and not sel.left
            continue
        (why,) = sel.left.values()
        assert "its bias of batch 2 is computed from the function's float inputs" in why
        assert "for batch 1 only (jax issue 30593)" in why

        def loss(f):
            return lambda *a: jnp.sum(jnp.tanh(f(*a)) * jnp.arange(D))

        ref = jax.grad(loss(att), argnums=3)(q, k, v, slopes)
        got = jax.jit(jax.grad(loss(forward), argnums=3))(q, k, v, slopes)
        assert got.dtype == jnp.float32 and got.shape == (B, H)
        assert _rel(got, ref) < 5e-2


# -- rows left without keys -------------------------------------------------------------


@pytest.mark.parametrize(
    "fill, spelling",
    [(FMIN, "where"), (-1e9, "where"), (FMIN, "additive"), (-jnp.inf, "where")],
    ids=["finfo-where", "1e9-where", "finfo-additive", "inf-where"],
)
def test_rows_without_keys_get_float32s_value(fill, spelling):
    """A batch whose keys are all padded: float32 gives uniform weights (the mean of the
    values) for a finite fill and NaN for -inf; the fused call gives the same, there and
    nowhere else, and float32's gradients: through a selection none reaches the queries of
    that batch, through an additive mask float32's differentiation passes one (the logits
    still add to the rounded sum)."""
    q, k, v = _qkv(3)
    m = jnp.asarray([[1] * T, [0] * T], jnp.int32)

    def att(q, k, v, m):
        s = _einsum(q, k)
        if spelling == "where":
            s = jnp.where(m[:, None, None, :] > 0, s, fill)
        else:
            s = s + (1.0 - m[:, None, None, :]) * fill
        return _out(jax.nn.softmax(s), v)

    want = att(q, k, v, m)
    fn = jmp_rewrite.rewrite(att, dtype=BF16, fuse_attention=True)
    sel = _selection(fn, q, k, v, m)
    assert len(sel.fused) == 1 and sel.fused[0].core.guard_mask == (spelling == "where")
    got = jax.jit(fn)(q, k, v, m)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[0], want[0], atol=3e-2)
    if math.isinf(fill):
        assert np.isnan(want[1]).all() and not np.isnan(want[0]).any()
        return
    np.testing.assert_allclose(got[1], jnp.broadcast_to(v[1].mean(0), got[1].shape), atol=2e-2)

    def loss(f):
        return lambda *a: jnp.sum(jnp.tanh(f(*a)) * jnp.arange(D))

    ref = jax.grad(loss(att), argnums=(0, 1, 2))(q, k, v, m)
    grads = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(q, k, v, m)
    for g, r in zip(grads, ref, strict=True):
        assert bool(jnp.isfinite(g).all()) and _rel(g, r) < 1e-2
    if spelling == "where":
        np.testing.assert_array_equal(ref[0][1], 0.0)  # no key: dq is zero there
        np.testing.assert_allclose(grads[0][1], 0.0, atol=1e-6)
    else:
        assert float(jnp.abs(ref[0][1]).max()) > 1e-3  # float32's own, through the rounding


def test_a_constant_mask_with_some_rows_without_keys_gives_them_float32s_value():
    """A constant mask (a window shifted past the first queries) leaving some query rows,
    not all, without keys: those rows get float32's uniform weights (the values' mean), the
    others the fused attention's."""
    q, k, v = _qkv(4)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    keep = jnp.asarray((j - i >= 2) & (j - i <= 4))  # the last two queries see no key

    def att(q, k, v):
        return _out(jax.nn.softmax(jnp.where(keep, _einsum(q, k), FMIN)), v)

    fn = jmp_rewrite.rewrite(att, dtype=BF16, fuse_attention=True)
    sel = _selection(fn, q, k, v)
    assert len(sel.fused) == 1 and sel.fused[0].core.guard_mask
    want, got = att(q, k, v), jax.jit(fn)(q, k, v)
    empty = ~np.asarray(keep).any(-1)
    assert empty.sum() == 2
    mean = jnp.broadcast_to(v.mean(1, keepdims=True), v.shape)
    np.testing.assert_allclose(want[:, empty], mean[:, empty], atol=1e-5)
    np.testing.assert_allclose(got[:, empty], want[:, empty], atol=2e-2)
    np.testing.assert_allclose(got[:, ~empty], want[:, ~empty], atol=3e-2)


# -- left as written, with the reason ---------------------------------------------------------


def _dropout(q, k, v, m):
    p = jax.nn.softmax(_einsum(q, k))
    keep = jax.random.bernoulli(jax.random.key(0), 0.9, p.shape)
    return _out(jnp.where(keep, p / 0.9, 0.0), v)


def _naive(q, k, v, m):
    e = jnp.exp(_einsum(q, k))
    return _out(e / e.sum(-1, keepdims=True), v)


def _fill_100(q, k, v, m):
    return _out(jax.nn.softmax(jnp.where(m[:, None, None, :] > 0, _einsum(q, k), -100.0)), v)


def _bias_after_mask(q, k, v, m):
    s = jnp.where(TRIL, _einsum(q, k), FMIN) + (1.0 - m[:, None, None, :]) * -1e9
    return _out(jax.nn.softmax(s), v)


def _computed_scale(q, k, v, m):
    return _out(jax.nn.softmax(_einsum(q, k) * jnp.sum(m) / 100.0), v)


def _soft_capped(q, k, v, m):  # Gemma 2: tanh(s / c) * c before the mask
    s = jnp.tanh(_einsum(q, k) * D**-0.5 / 50.0) * 50.0
    return _out(jax.nn.softmax(jnp.where(TRIL, s, FMIN)), v)


def _region(q, k, v, m):
    return jmp_rewrite.float32_region(lambda *a: _out(jax.nn.softmax(_einsum(*a[:2])), a[2]))(
        q, k, v
    )


def _queries_axis(q, k, v, m):  # normalised over the queries: not attention (error 0.32 fused)
    return _out(jax.nn.softmax(_einsum(q, k), axis=-2), v)


def _bias_minus_logits(q, k, v, m):  # softmax(bias - s): fused as s - bias, error 1.49
    return _out(jax.nn.softmax(m[:, None, None, :] * 2.0 - _einsum(q, k)), v)


def _highest(q, k, v, m):  # the program asks float32 logits: painted float32, never fused
    s = jnp.einsum("bthd,bshd->bhts", q, k, precision=jax.lax.Precision.HIGHEST)
    return _out(jax.nn.softmax(s), v)


def _plain(q, k, v, m):
    return _out(jax.nn.softmax(_einsum(q, k)), v)


BAIL_OUTS = {
    "dropout": (_dropout, "dropout on the weights?", 16),
    "naive": (_naive, "without their row maximum subtracted", 16),
    "fill_100": (_fill_100, "set to -100, which does not zero their weights", 16),
    "bias_after_mask": (_bias_after_mask, "a bias is added after the mask", 16),
    "computed_scale": (_computed_scale, "scaled by a computed value", 16),
    "float32_region": (_region, "inside a float32_region", 16),
    "head_dim_60": (_plain, "head dim 60", 60),
    "head_dim_136": (_plain, "head dim 136: cuDNN's flash attention takes", 136),
    "queries_axis": (_queries_axis, "softmax runs over axis 2 of the logits, not", 16),
    "bias_minus_logits": (_bias_minus_logits, "the logits are subtracted from a value", 16),
    "precision_highest": (_highest, "its matmuls are not painted half precision", 16),
    "soft_capped": (_soft_capped, "soft-capped (tanh(s / c) * c, Gemma 2's): cuDNN's", 16),
}


@pytest.mark.parametrize("name", sorted(BAIL_OUTS))
def test_unfusable_attention_is_left_as_written_with_the_reason(name, calls):
    att, reason, d = BAIL_OUTS[name]
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, H, d)), jnp.float32) for _ in range(3))

    def loss(q, k, v, m):  # a matmul of its own: the program is rewritten around it
        return jnp.sum(jnp.tanh(att(q, k, v, m).reshape(B * T, -1) @ jnp.ones((H * d, 4))))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    report = jmp_rewrite.explain(grad, q, k, v, PAD, dtype=BF16, fuse_attention=True)
    findings = [f for f in report.lint() if f.kind == "attention_unfused"]
    assert len(findings) == 1 and reason in findings[0].message, [f.message for f in findings]
    assert not report.fused_attention and "1 left as written" in report.summary()
    calls.clear()
    fn = jmp_rewrite.rewrite(grad, dtype=BF16, fuse_attention=True)
    np.testing.assert_array_equal(
        jax.jit(fn)(q, k, v, PAD)[0],
        jax.jit(jmp_rewrite.rewrite(grad, dtype=BF16))(q, k, v, PAD)[0],
    )
    assert calls == []


def test_weights_read_elsewhere_stay_as_written():
    """The probabilities are also an output (returned, sown): the fused call would not
    compute them, so nothing is replaced."""
    q, k, v = _qkv(5)

    def att(q, k, v):
        p = jax.nn.softmax(_einsum(q, k))
        return _out(p, v), p

    def loss(*a):
        o, p = att(*a)
        return jnp.sum(o) + jnp.sum(p**2)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    for fn in (att, grad):
        sel = _selection(jmp_rewrite.rewrite(fn, dtype=BF16, fuse_attention=True), q, k, v)
        assert not sel.fused and len(sel.left) >= 1
        assert any("used elsewhere" in r or "leaves the function" in r for r in sel.left.values())


@pytest.mark.parametrize("d", [128, 136])
def test_head_dim_boundary(d):
    """Head dim 128 is cuDNN's limit without a Hopper card detected: fused; 136 left."""
    assert jc.cuda_attention_target() is None  # no card here
    rng = np.random.default_rng(10)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 4, 1, d)), jnp.float32) for _ in range(3))
    fn = jmp_rewrite.rewrite(_plain, dtype=BF16, fuse_attention=True)
    sel = _selection(fn, q, k, v, None)
    assert len(sel.fused) == (d <= 128), sel.left
    if d > 128:
        assert [f"head dim {d}" in r for r in sel.left.values()] == [True]
    want = _plain(q, k, v, None)
    plain = jmp_rewrite.rewrite(_plain, dtype=BF16)(q, k, v, None)
    assert _rel(fn(q, k, v, None), want) <= 1.5 * _rel(plain, want) + 1e-3


@pytest.mark.parametrize(
    "target, fused",
    [(((9, 0), (9, 5)), True), (((9, 0), (9, 4)), False), (((8, 0), (9, 8)), False), (None, False)],
    ids=["hopper-9.5", "hopper-9.4", "ampere", "none"],
)
def test_head_dims_up_to_256_on_hopper_with_cudnn_9_5(monkeypatch, target, fused):
    """Head dim 256 (Gemma 2's 27B, some ViTs): fused only where a Hopper card with cuDNN 9.5
    or later is detected (jax's own limit there); elsewhere left, the reason saying why."""
    monkeypatch.setattr(jc, "cuda_attention_target", lambda: target)
    rng = np.random.default_rng(15)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 4, 1, 256)), jnp.float32) for _ in range(3))
    sel = _selection(jmp_rewrite.rewrite(_plain, dtype=BF16, fuse_attention=True), q, k, v, None)
    assert len(sel.fused) == fused
    if not fused:
        (why,) = sel.left.values()
        assert "head dim 256" in why and "up to 128 (256 on Hopper with cuDNN 9.5" in why


def test_gradient_of_queries_and_keys_only_with_a_float_bias_fuses_its_backward():
    """``rewrite(grad(f, argnums=(0, 1)))`` with a float bias input neither differentiated:
    forward and backward are found (the queries and keys differentiated, the values and the
    bias frozen)."""
    q, k, v = _qkv(11)
    bias = jnp.asarray(np.random.default_rng(11).standard_normal((B, 1, 1, T)), jnp.float32)

    def att(q, k, v, b):
        return _out(jax.nn.softmax(_einsum(q, k) * D**-0.5 + b), v)

    grad = jax.grad(lambda *a: jnp.sum(jnp.tanh(att(*a)) * jnp.arange(D)), argnums=(0, 1))
    step = jmp_rewrite.rewrite(grad, dtype=BF16, fuse_attention=True)
    sel = _selection(step, q, k, v, bias)
    assert len(sel.fused) == 1 and not sel.left, sel.left
    f = sel.fused[0]
    assert f.backward_at is not None and f.diff == (f.core.q, f.core.k)
    ref = grad(q, k, v, bias)
    plain = jmp_rewrite.rewrite(grad, dtype=BF16)(q, k, v, bias)
    assert _rel(jax.jit(step)(q, k, v, bias), ref) <= 1.1 * max(_rel(plain, ref), 5e-3)


def test_float16_runs_off_cuda_in_float32():
    """Off CUDA the fused call is JAX's own attention, whose float16 logits XLA:CPU refuses
    to compile (the F16_F16_F32 dot algorithm): float16 runs it in float32 there."""
    att = SPELLINGS["where_data"][0]
    q, k, v = _qkv(12)
    fn = jmp_rewrite.rewrite(att, dtype=jnp.float16, fuse_attention=True)
    assert len(_selection(fn, q, k, v, PAD).fused) == 1
    got = jax.jit(fn)(q, k, v, PAD)
    assert got.dtype == jnp.float32 and _rel(got, att(q, k, v, PAD)) < 2e-3


def test_a_mask_of_an_attention_without_heads_is_placed_on_its_batch():
    """``(B, T, S)`` logits (no heads dim) and a ``(B, T, S)`` mask of the data, T != S:
    the mask is the batch's ``(B, 1, T, S)``, not a heads' one."""
    rng = np.random.default_rng(13)
    t, s = 8, 12
    q = jnp.asarray(rng.standard_normal((B, t, D)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, s, D)), jnp.float32) for _ in range(2))
    m = jnp.asarray(rng.random((B, t, s)) > 0.3).at[:, :, 0].set(True)

    def att(q, k, v, m):
        return jax.nn.softmax(jnp.where(m, q @ jnp.swapaxes(k, -1, -2), -1e9)) @ v

    fn = jmp_rewrite.rewrite(att, dtype=BF16, fuse_attention=True)
    sel = _selection(fn, q, k, v, m)
    assert len(sel.fused) == 1 and sel.fused[0].core.batch == (B,)
    want = att(q, k, v, m)
    plain = jmp_rewrite.rewrite(att, dtype=BF16)(q, k, v, m)
    assert _rel(fn(q, k, v, m), want) <= 1.1 * _rel(plain, want)


def test_explain_counts_the_bytes_saved_at_their_painted_size_on_the_values_matmul():
    """The bytes a fused attention does not write: each replaced equation's outputs (the
    logits, the softmax's steps) at the size the rewrite gives them (half: 2 bytes, float32:
    4), the output itself (the values matmul's) excluded; shown on the values matmul's row."""
    att = SPELLINGS["where_data"][0]
    q, k, v = _qkv(14)
    report = jmp_rewrite.explain(att, q, k, v, PAD, dtype=BF16, fuse_attention=True)
    rows = [e for e in report.equations if e.attention]
    shown = [e for e in rows if e.attention_saved]
    assert len(shown) == 1 and shown[0].primitive == "dot_general"
    assert (B, H, T, T) in shown[0].in_shapes  # the probabilities' matmul, not the logits'
    counted = sum(
        math.prod(shape) * jnp.dtype(dtype).itemsize
        for e in rows
        if e is not shown[0]
        for shape, dtype in zip(e.out_shapes, e.out_dtypes_after, strict=True)
        if jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    )
    assert {d for e in rows for d in e.out_dtypes_after} >= {"bfloat16", "float32"}
    assert shown[0].attention_saved == counted


# -- the API ------------------------------------------------------------------------------


def test_off_by_default_and_checked(calls):
    q, k, v = _qkv(6)
    att = SPELLINGS["tril_where"][0]
    fn = jmp_rewrite.rewrite(att, dtype=BF16)
    entry, _ = fn.trace(q, k, v, PAD)
    assert entry.painting.attention is None
    jax.jit(fn)(q, k, v, PAD)
    assert calls == []
    with pytest.raises(TypeError, match="fuse_attention must be True or False, got 'yes'"):
        jmp_rewrite.rewrite(att, dtype=BF16, fuse_attention="yes")
    with pytest.raises(TypeError, match="fuse_attention"):
        jmp_rewrite.explain(att, q, k, v, PAD, dtype=BF16, fuse_attention=1)
    assert "fuse_attention=True" in repr(jmp_rewrite.rewrite(att, dtype=BF16, fuse_attention=True))


@pytest.mark.parametrize("jit", [False, True])
def test_eager_and_jitted_calls_agree(jit):
    att = SPELLINGS["where_data"][0]
    q, k, v = _qkv(7)
    fn = jmp_rewrite.rewrite(att, dtype=BF16, fuse_attention=True)
    fn = jax.jit(fn) if jit else fn
    got = fn(q, k, v, PAD)
    assert got.dtype == jnp.float32 and _rel(got, att(q, k, v, PAD)) < 1e-2


def test_rewrite_jaxpr_and_paint_take_the_option():
    att = SPELLINGS["tril_where"][0]
    q, k, v = _qkv(8)
    closed = jax.make_jaxpr(att)(q, k, v, PAD)
    new = jmp_rewrite.rewrite_jaxpr(closed, dtype=BF16, fuse_attention=True)
    assert [a.aval for a in new.jaxpr.outvars] == [a.aval for a in closed.jaxpr.outvars]
    out = jc.eval_jaxpr(new, q, k, v, PAD)[0]
    assert _rel(out, att(q, k, v, PAD)) < 1e-2
    plain = jmp_rewrite.rewrite_jaxpr(closed, dtype=BF16)
    assert str(new.jaxpr) != str(plain.jaxpr)
    painted = jmp_rewrite.paint(att, q, k, v, PAD, dtype=BF16, fuse_attention=True)
    fused = [e for e in painted if e.attention]
    assert fused and all(e.attention.startswith("fused attention 0: ") for e in fused)
    assert {e.primitive for e in fused} >= {"dot_general", "exp", "reduce_max", "div"}
    assert not any(e.attention for e in jmp_rewrite.paint(att, q, k, v, PAD, dtype=BF16))


def test_explain_shows_each_fused_attention_and_the_bytes_it_saves():
    loss, params, batch = gpt(layers=2)
    grad = jax.value_and_grad(lambda p, b: loss(p, b))
    fn = jax.jit(jmp_rewrite.rewrite(grad, dtype=BF16, fuse_attention=True))
    report = jmp_rewrite.explain(fn, params, batch)  # the rewrite's own setting
    assert report.fused_attention == [
        "fused attention 0: h_0/attn (forward and backward, causal)",
        "fused attention 1: h_1/attn (forward and backward, causal)",
    ]
    saved = sum(e.attention_saved for e in report.equations)
    # per layer at least the logits, the probabilities and their cotangents (B*H*T*T each)
    assert saved >= 2 * 4 * (2 * 2 * 16 * 16) * 2
    assert f"fused attention: 2 ({saved:,} bytes" in report.summary()
    assert report.to_dict()["totals"]["fused_attention"] == 2
    assert report.to_html().count(">fused attention</td>") == sum(
        1 for e in report.equations if e.attention
    )
    off = jmp_rewrite.explain(fn, params, batch, fuse_attention=False)
    assert not off.fused_attention and "fused attention" not in off.summary()


def test_compare_checks_the_fused_outputs_not_the_equations_replaced():
    att = SPELLINGS["where_data"][0]
    q, k, v = _qkv(9)
    grad = jax.grad(lambda *a: jnp.sum(jnp.tanh(att(*a))), argnums=(0, 1, 2))
    c = jmp_rewrite.compare(grad, q, k, v, PAD, dtype=BF16, fuse_attention=True)
    assert not any("diverged" in n for n in c.notes)
    fused = [e for e in c.equations if e.attention]
    # the values matmul (the call's output) and the three cotangents it hands back
    assert len(fused) == 4 and all(e.count == 1 and 0 < e.rel_error < 2e-2 for e in fused)
    assert not any(e.primitive in ("exp", "reduce_max") for e in c.equations)
    plain = jmp_rewrite.compare(grad, q, k, v, PAD, dtype=BF16)
    assert any(e.primitive == "exp" for e in plain.equations)


def test_cudnn_masks_the_key_added_to_an_odd_length_by_its_sequence_length(cudnn_args):
    """ViT's 197 tokens: cuDNN gets keys padded to 198 with key lengths ``[197, 197]``, so
    the added zero key is masked and the output is the unpadded attention's (the cuDNN
    branch called eagerly; the recorder runs JAX's own attention on its arguments)."""
    import types

    rng = np.random.default_rng(23)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 197, 2, 16)), BF16) for _ in range(3))
    core = types.SimpleNamespace(scale=0.25, causal=False)
    out = attention_emit._dpa("cudnn", core, BF16, q, k, v, None, None)
    (call,) = cudnn_args
    assert call["k"].shape == (2, 198, 2, 16)
    np.testing.assert_array_equal(np.asarray(call["key_value_seq_lengths"]), [197, 197])
    assert out.shape == q.shape and out.dtype == BF16
    ref = jax.nn.dot_product_attention(q, k, v, scale=0.25)
    assert _rel(out, ref) < 1e-2


def test_causal_attention_with_a_minus_inf_fill_and_left_padding_gives_float32s_nan_rows():
    """Causal attention, ``-inf`` fill, sequence 1 left-padded by 3: its first three query
    rows have no key (their causal keys are all padding). float32 gives NaN there and only
    there; so does the fused attention (the guard combines the mask with the causal one)."""
    q, k, v = _qkv(24)
    pad = jnp.ones((B, T), bool).at[1, :3].set(False)

    def att(q, k, v, pad):
        keep = TRIL[None, None] & pad[:, None, None, :]
        return _out(jax.nn.softmax(jnp.where(keep, _einsum(q, k) / 4.0, -jnp.inf)), v)

    ref = jax.jit(att)(q, k, v, pad)
    got = jax.jit(jmp_rewrite.rewrite(att, dtype=BF16, fuse_attention=True))(q, k, v, pad)
    rows = lambda o: sorted(zip(*np.nonzero(np.isnan(np.asarray(o, np.float32)).any((2, 3)))))  # noqa: E731
    assert rows(ref) == [(1, 0), (1, 1), (1, 2)]
    assert rows(got) == rows(ref)
    keep = ~np.isnan(np.asarray(ref))
    assert _rel(np.asarray(got, np.float32)[keep], np.asarray(ref)[keep]) < 2e-2
