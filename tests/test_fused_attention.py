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
from jmp_rewrite._src import attention_emit

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
        seen.append(kwargs.get("implementation"))
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

    ref = jax.jit(vg())(params, batch)
    hand = jax.jit(vg(BF16))(params, batch)
    step = jmp_rewrite.rewrite(vg(), dtype=BF16, fuse_attention=True)
    sel = _selection(step, params, batch)
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


def _region(q, k, v, m):
    return jmp_rewrite.float32_region(lambda *a: _out(jax.nn.softmax(_einsum(*a[:2])), a[2]))(
        q, k, v
    )


BAIL_OUTS = {
    "dropout": (_dropout, "dropout on the weights?", 16),
    "naive": (_naive, "without their row maximum subtracted", 16),
    "fill_100": (_fill_100, "set to -100, which does not zero their weights", 16),
    "bias_after_mask": (_bias_after_mask, "a bias is added after the mask", 16),
    "computed_scale": (_computed_scale, "scaled by a computed value", 16),
    "float32_region": (_region, "inside a float32_region", 16),
    "head_dim_60": (lambda q, k, v, m: _out(jax.nn.softmax(_einsum(q, k)), v), "head dim 60", 60),
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
