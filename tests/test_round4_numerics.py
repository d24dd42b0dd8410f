"""Issue 21, items 1, 2 and 8: values the rewrite rounded or overflowed where float32 did not.

1. **Padded attention masks.** ``s + (1.0 - mask) * finfo(float32).min`` with the mask built
   from an integer or boolean array: the bias is finite in float32 and overflowed to ``-inf``
   on its cast into the half-precision ``add``, so a fully padded row's softmax was NaN (its
   gradient too: with the loss-scale optimizer every padded batch was skipped). A value no
   float input reaches -- computed from constants and integer or boolean values only
   (``Origin.frozen``) -- is clamped to the half range when cast, as constants were; a
   computed value (an activation, a gradient) still overflows, so the loss-scale optimizer
   still skips a step whose gradient overflows. With the mask a float32 *argument* the bias
   is *big* (``origins.big_seed``: a fill beyond the half range reaches it), pinned to the
   half range where the fill put it out of it (``masking``, issue 28); a product by a
   constant within the range still overflows.
2. **Loops that run zero times** hand their initial carries on exact (a scan of length 0, a
   scan over empty ``xs``, ``fori_loop(0, 0, ...)``, a ``while`` false at once).
8. **A float32 value leaving a ``cond``** comes back exact when some branch hands it on
   unrounded, whatever control flow it passed through.

Every test runs in float16 and bfloat16, and where a gradient applies in both orders,
``jax.grad(rewrite(f))`` and ``rewrite(jax.grad(f))``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jaxpr_walk import emitted, float_in_dtypes, prims, runs_in_half

import jmp_rewrite as jr

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

F32 = np.dtype(np.float32)
HALF = pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
F32_MIN = float(np.finfo(np.float32).min)
B, T, D = 4, 6, 8
# rows: full, half padded, one valid token, fully padded
ATTENTION_MASK = np.array(
    [[1] * T, [1] * (T // 2) + [0] * (T // 2), [1] + [0] * (T - 1), [0] * T], np.int32
)
FULLY_PADDED = 3


def _rand(*shape: int, seed: int = 0, scale: float = 0.3) -> jax.Array:
    return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


# -- 1. padded attention masks ------------------------------------------------------------


def _bias_finfo(s, am):
    return s + (1.0 - am[:, None, :].astype(jnp.float32)) * jnp.finfo(jnp.float32).min


def _bias_hf(s, am):  # Hugging Face Flax: the int mask itself in the arithmetic
    return s + (1.0 - am[:, None, :]) * jnp.finfo(jnp.float32).min


def _bias_1e9(s, am):
    return s + (1.0 - am[:, None, :].astype(jnp.float32)) * -1e9


def _bias_3e38(s, am):
    return s + (1.0 - am[:, None, :].astype(jnp.float32)) * -3.4e38


def _bias_bool(s, am):
    return s + jnp.where(am[:, None, :] > 0, 0.0, jnp.finfo(jnp.float32).min)


def _bias_full_select(s, am):  # HF Flax BERT: lax.select of two jnp.full arrays
    keep = jnp.broadcast_to(am[:, None, :] > 0, s.shape)
    zeros, big = jnp.full(s.shape, 0.0), jnp.full(s.shape, jnp.finfo(jnp.float32).min)
    return s + lax.select(keep, zeros, big)


def _bias_times_full(s, am):  # no literal to call a sentinel: frozen, from the int mask
    big = jnp.full((B, 1, T), jnp.finfo(jnp.float32).min)
    return s + (1.0 - am[:, None, :].astype(jnp.float32)) * big


def _bias_before_scaling(s, am):
    return _bias_finfo(s, am) / np.sqrt(D)


def _bias_after_scaling(s, am):
    return _bias_finfo(s / np.sqrt(D), am)


def _bias_float_mask(s, am):  # a float mask computed in the program from the int one
    m = (am > 0).astype(jnp.float32)
    return s + (1.0 - m[:, None, :]) * jnp.finfo(jnp.float32).min


SPELLINGS = {
    "finfo": _bias_finfo,
    "hf_int_mask": _bias_hf,
    "minus_1e9": _bias_1e9,
    "minus_3.4e38": _bias_3e38,
    "where_bool": _bias_bool,
    "full_select": _bias_full_select,
    "times_full": _bias_times_full,
    "before_scaling": _bias_before_scaling,
    "after_scaling": _bias_after_scaling,
    "float_mask": _bias_float_mask,
}


def _attention(spelling):
    def f(wq, wk, x, am):
        s = jnp.einsum("btd,bsd->bts", x @ wq, x @ wk)
        return jax.nn.softmax(SPELLINGS[spelling](s, am), axis=-1)

    return f


def _attention_args():
    return _rand(D, D, seed=1), _rand(D, D, seed=2), _rand(B, T, D, seed=3, scale=1.0)


@HALF
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_padded_rows_are_uniform_as_in_float32(dtype, jit, spelling):
    _check_pads_as_float32(_attention(spelling), ATTENTION_MASK, dtype, jit)


def _check_pads_as_float32(f, mask, dtype, jit):
    """Fully padded rows uniform as in float32, the rest within half tolerance, and the
    scores' matmuls in half precision (the bias and what it is added to are big, kept
    float32: ``paint_additions.keep_masked_values_float32``)."""
    wq, wk, x = _attention_args()
    rewritten = jr.rewrite(f, dtype=dtype)
    out = np.asarray((jax.jit(rewritten) if jit else rewritten)(wq, wk, x, mask))
    ref = np.asarray(f(wq, wk, x, mask))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[FULLY_PADDED], np.full((T, T), 1 / T), rtol=1e-2)
    np.testing.assert_allclose(out, ref, atol=2e-2)
    dots = prims(emitted(rewritten, wq, wk, x, mask), "dot_general")
    assert any(runs_in_half(e) and e.outvars[0].aval.shape == (B, T, T) for e in dots)


@HALF
@pytest.mark.parametrize("order", ["grad_of_rewrite", "rewrite_of_grad"])
@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_padded_rows_have_float32_gradients(dtype, order, spelling):
    f = _attention(spelling)
    wq, wk, x = _attention_args()
    v = _rand(B, T, T, seed=4, scale=1.0)

    def loss(fun):
        return lambda wq, wk: jnp.sum(fun(wq, wk, x, ATTENTION_MASK) * v)

    grad = jax.grad(loss(f), argnums=(0, 1))
    if order == "grad_of_rewrite":
        got = jax.grad(loss(jr.rewrite(f, dtype=dtype)), argnums=(0, 1))(wq, wk)
    else:
        got = jr.rewrite(grad, dtype=dtype)(wq, wk)
    for g, r in zip(got, grad(wq, wk), strict=True):
        assert g.dtype == F32 and np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(g, r, atol=0.05 * float(jnp.max(jnp.abs(r))))


@pytest.mark.parametrize("mask_dtype", [np.int32, np.float32], ids=["int_mask", "float_mask"])
def test_computed_values_still_overflow(mask_dtype):
    """Only frozen values and sentinels are clamped: scores that overflow float16 (as in a
    hand-written float16 model) stay infinite, the padding bias added to them or not, its
    mask an integer or a float argument. (Float16 only: bfloat16's range is float32's to
    within 0.4%.)"""
    dtype = jnp.float16
    am = ATTENTION_MASK.astype(mask_dtype)
    big = float(jnp.finfo(dtype).max)

    def f(w, x, am):
        s = (x @ w) * 4.0  # overflows in half: x @ w is near the half maximum
        return _bias_finfo(s[:, None, :] * jnp.ones((1, T, 1)), am)

    w = jnp.full((D, T), big / D)
    x = jnp.ones((B, D))
    scores = np.asarray(jr.rewrite(f, dtype=dtype)(w, x, am))
    ref = np.asarray(f(w, x, am))
    assert np.isfinite(ref).all()  # finite in float32
    assert np.isposinf(scores[0]).all()  # the unpadded row: inf in half, as by hand
    assert np.isposinf(scores[1]).all()  # inf plus the clamped bias: inf, as by hand


# -- 1. a float mask passed in as an argument ---------------------------------------------
# The graph cannot tell a float32 argument from data, so these biases are not frozen; each is
# a product by a constant beyond the half range (a *sentinel*: ``origins.sentinel_scaled``).


def _fbias_finfo(s, m):
    return s + (1.0 - m[:, None, :]) * jnp.finfo(jnp.float32).min


def _fbias_1e9(s, m):
    return s + (1.0 - m[:, None, :]) * -1e9


def _fbias_3e38(s, m):
    return s + (1.0 - m[:, None, :]) * -3.4e38


def _fbias_pad_times(s, m):  # ``pad * -1e9``, broadcast after the product
    pad = 1.0 - m
    return s + (pad * -1e9)[:, None, :]


def _fbias_m_minus_1(s, m):
    return s + (m[:, None, :] - 1.0) * 1e9


def _fbias_sum(s, m):  # ``m * 1e9 - 1e9``: a sentinel minus a constant
    return s + (m[:, None, :] * jnp.finfo(jnp.float32).max - jnp.finfo(jnp.float32).max)


def _fbias_div_tiny(s, m):
    return s + (1.0 - m[:, None, :]) / -1e-30


FLOAT_SPELLINGS = {
    "finfo": _fbias_finfo,
    "minus_1e9": _fbias_1e9,
    "minus_3.4e38": _fbias_3e38,
    "pad_times_minus_1e9": _fbias_pad_times,
    "m_minus_1_times_1e9": _fbias_m_minus_1,
    "sum_with_constant": _fbias_sum,
    "div_tiny": _fbias_div_tiny,
    "before_scaling": lambda s, m: _fbias_finfo(s, m) / np.sqrt(D),
    "after_scaling": lambda s, m: _fbias_1e9(s / np.sqrt(D), m),
}
FLOAT_MASK = ATTENTION_MASK.astype(np.float32)


def _float_mask_attention(spelling):
    def f(wq, wk, x, m):
        s = jnp.einsum("btd,bsd->bts", x @ wq, x @ wk)
        return jax.nn.softmax(FLOAT_SPELLINGS[spelling](s, m), axis=-1)

    return f


@HALF
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("spelling", list(FLOAT_SPELLINGS))
def test_a_float_mask_argument_pads_as_in_float32(dtype, jit, spelling):
    _check_pads_as_float32(_float_mask_attention(spelling), FLOAT_MASK, dtype, jit)


@HALF
@pytest.mark.parametrize("order", ["grad_of_rewrite", "rewrite_of_grad"])
@pytest.mark.parametrize("spelling", list(FLOAT_SPELLINGS))
def test_a_float_mask_argument_has_float32_gradients(dtype, order, spelling):
    """Gradients with respect to the weights, and to the float mask itself (the clamp
    keeps float32's derivative: a clip's would be zero at the padded positions)."""
    f = _float_mask_attention(spelling)
    wq, wk, x = _attention_args()
    v = _rand(B, T, T, seed=4, scale=1.0)

    def loss(fun):
        return lambda wq, wk, m: jnp.sum(fun(wq, wk, x, m) * v)

    argnums = (0, 1) if spelling in ("finfo", "minus_3.4e38", "sum_with_constant") else (0, 1, 2)
    grad = jax.grad(loss(f), argnums=argnums)
    if order == "grad_of_rewrite":
        got = jax.grad(loss(jr.rewrite(f, dtype=dtype)), argnums=argnums)(wq, wk, FLOAT_MASK)
    else:
        got = jr.rewrite(grad, dtype=dtype)(wq, wk, FLOAT_MASK)
    for g, r in zip(got, grad(wq, wk, FLOAT_MASK), strict=True):
        assert g.dtype == F32 and np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(g, r, atol=0.05 * float(jnp.max(jnp.abs(r))))


def test_a_product_by_a_constant_within_range_still_overflows():
    """A sentinel is a product by a constant the half type cannot hold: ``pad * -1e3`` (1e3
    fits float16) that overflows is a computed value, infinite on its cast as by hand (the
    padded row's softmax is NaN); ``pad * -1e5`` (beyond float16's 65504) is the user's
    sentinel, clamped."""
    wq, wk, x = _attention_args()
    pad = 100.0 * (1.0 - FLOAT_MASK)  # a float argument: not frozen

    def attention(c):
        def f(wq, wk, x, pad):
            s = jnp.einsum("btd,bsd->bts", x @ wq, x @ wk)
            return jax.nn.softmax(s + pad[:, None, :] * c, axis=-1)

        return f

    for c, finite in ((-1e3, False), (-1e5, True)):
        f = attention(c)
        assert np.isfinite(np.asarray(f(wq, wk, x, pad))).all()  # finite in float32
        out = np.asarray(jr.rewrite(f, dtype=jnp.float16)(wq, wk, x, pad))
        assert np.isfinite(out[FULLY_PADDED]).all() == finite, c
        assert np.isfinite(out[0]).all()  # the unpadded row: no bias, finite either way


# -- 1. a padded batch trains like float32 ------------------------------------------------

VOCAB, HID, CLASSES, BATCH, SEQ = 16, 16, 3, 8, 6
PAD = 0


def _encoder_params(seed: int = 0) -> dict[str, jax.Array]:
    ks = jax.random.split(jax.random.key(seed), 8)
    n = lambda k, *s: 0.2 * jax.random.normal(k, s, jnp.float32)  # noqa: E731
    return {
        "emb": n(ks[0], VOCAB, HID),
        "pos": n(ks[1], SEQ, HID),
        "wq": n(ks[2], HID, HID),
        "wk": n(ks[3], HID, HID),
        "wv": n(ks[4], HID, HID),
        "w1": n(ks[5], HID, 2 * HID),
        "w2": n(ks[6], 2 * HID, HID),
        "wc": n(ks[7], HID, CLASSES),
    }


def _encoder_batch(seed: int = 1, mask_dtype=np.int32):
    """Half the rows padded: 4 full rows, 2 partly padded, 2 fully padded; the attention
    mask in ``mask_dtype`` (a float32 mask is data to the graph: see ``sentinel_scaled``)."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    lengths = np.array([SEQ] * 4 + [SEQ // 2, 1] + [0, 0])
    am = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.int32)
    tokens = jax.random.randint(k1, (BATCH, SEQ), 1, VOCAB) * am
    labels = jax.random.randint(k2, (BATCH,), 0, CLASSES)
    return tokens.astype(jnp.int32), jnp.asarray(am.astype(mask_dtype)), labels


def encoder_loss(params, tokens, am, labels):
    """Embedding, one attention layer with a Hugging Face-style padding bias, an MLP, a
    classifier on the mean of the valid positions (all positions for an empty row)."""
    h = params["emb"][tokens] + params["pos"][None]
    q, k, v = h @ params["wq"], h @ params["wk"], h @ params["wv"]
    s = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(HID)
    s = s + (1.0 - am[:, None, :]) * jnp.finfo(jnp.float32).min
    h = h + jax.nn.softmax(s, axis=-1) @ v
    h = h + jax.nn.gelu(h @ params["w1"]) @ params["w2"]
    weights = jnp.where(am.sum(1, keepdims=True) > 0, am, 1) / jnp.maximum(am.sum(1), 1)[:, None]
    pooled = jnp.einsum("bt,btd->bd", weights, h)
    logits = pooled @ params["wc"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _train(dtype, loss_scaled: bool, mask_dtype=np.int32, steps: int = 20, lr: float = 1e-2):
    inner = optax.adam(lr)
    tx = jr.loss_scale_optimizer(inner) if loss_scaled else inner

    def step(params, opt_state, tokens, am, labels):
        if loss_scaled:
            value, grads = jr.value_and_grad(encoder_loss)(opt_state, params, tokens, am, labels)
        else:
            value, grads = jax.value_and_grad(encoder_loss)(params, tokens, am, labels)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    step = jax.jit(step if dtype is None else jr.rewrite(step, dtype=dtype))
    params, batch = _encoder_params(), _encoder_batch(mask_dtype=mask_dtype)
    opt_state = tx.init(params)
    losses = []
    for _ in range(steps):
        params, opt_state, value = step(params, opt_state, *batch)
        losses.append(float(value))
    skipped = int(jr.get_loss_scale_state(opt_state).skipped_steps) if loss_scaled else 0
    return np.array(losses), skipped


MASK_DTYPES = pytest.mark.parametrize(
    "mask_dtype", [np.int32, np.float32], ids=["int_mask", "float_mask"]
)


@HALF
@MASK_DTYPES
@pytest.mark.parametrize("loss_scaled", [False, True], ids=["plain", "loss_scaled"])
def test_padded_batch_trains_like_float32(dtype, loss_scaled, mask_dtype):
    ref, _ = _train(None, loss_scaled, mask_dtype)
    losses, skipped = _train(dtype, loss_scaled, mask_dtype)
    assert np.isfinite(losses).all()
    assert skipped == 0  # no step skipped for the padding
    assert ref[-1] < 0.5 * ref[0]  # it does learn
    tol = 0.005 if dtype == jnp.float16 else 0.02  # measured: 2e-4 and 2e-3 of the first loss
    np.testing.assert_allclose(losses, ref, atol=tol * ref[0])


@HALF
@MASK_DTYPES
def test_an_overflowing_gradient_still_skips_with_padding(dtype, mask_dtype):
    """The padding bias is clamped, the scaled gradient is not: with a loss scale too large
    for the half dtype the first step is skipped, the scale backs off, and the parameters
    stay as they were."""
    # the scaled gradients overflow in half (in bfloat16, whose range is float32's to within
    # 0.4%, they overflow float32 too: a loss 16 times larger)
    scale = float(jnp.finfo(dtype).max) * 4 if dtype == jnp.float16 else 2.0**127
    amplify = 1.0 if dtype == jnp.float16 else 16.0
    tx = jr.loss_scale_optimizer(optax.adam(1e-2), jr.DynamicLossScale(initial_loss_scale=scale))

    def loss(*args):
        return encoder_loss(*args) * amplify

    def step(params, opt_state, tokens, am, labels):
        _, grads = jr.value_and_grad(loss)(opt_state, params, tokens, am, labels)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, grads

    params = _encoder_params()
    opt_state = tx.init(params)
    new, opt_state, grads = jax.jit(jr.rewrite(step, dtype=dtype))(
        params, opt_state, *_encoder_batch(mask_dtype=mask_dtype)
    )
    state = jr.get_loss_scale_state(opt_state)
    assert int(state.skipped_steps) == 1 and not bool(state.last_step_applied)
    assert float(state.loss_scale) == scale / 2
    assert not all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)


# -- 2. loops that run zero times ---------------------------------------------------------

W4 = 0.5 * jnp.eye(4)


def _body(c):
    return jnp.tanh(c @ W4)


ZERO_TRIP = {
    "scan_empty_xs": lambda h: lax.scan(lambda c, x: (_body(c) + x, c), h, jnp.zeros((0, 4)))[0],
    "scan_length_0": lambda h: lax.scan(lambda c, _: (_body(c), None), h, None, length=0)[0],
    "fori_loop_0_0": lambda h: lax.fori_loop(0, 0, lambda i, c: _body(c), h),
    "while_false": lambda h: lax.while_loop(
        lambda ic: ic[0] < 0, lambda ic: (ic[0] + 1, _body(ic[1])), (0, h)
    )[1],
}


@HALF
@pytest.mark.parametrize("loop", list(ZERO_TRIP))
def test_a_loop_that_runs_zero_times_hands_its_init_on_exactly(dtype, loop):
    def f(x):
        h = jnp.exp(x)  # float32 (deny), beyond the float16 range and not a bfloat16 value
        c = ZERO_TRIP[loop](h)
        return c, c @ W4  # read by a half matmul too

    x = jnp.full((4, 4), 12.0) + 0.01 * jnp.arange(4.0)
    c, _ = jr.rewrite(f, dtype=dtype)(x)
    np.testing.assert_array_equal(c, jnp.exp(x))
    mm = prims(emitted(jr.rewrite(f, dtype=dtype), x), "dot_general")
    assert mm and runs_in_half(mm[-1])  # the matmul after the loop still runs in half


@HALF
@pytest.mark.parametrize("order", ["grad_of_rewrite", "rewrite_of_grad"])
@pytest.mark.parametrize("loop", [k for k in ZERO_TRIP if k != "while_false"])  # no vjp
def test_zero_trip_loops_in_both_orders(dtype, order, loop):
    def f(x):
        c = ZERO_TRIP[loop](jnp.exp(x))
        return jnp.sum(jnp.tanh(c @ W4)), c

    x = 0.5 + 0.01 * jnp.arange(16.0).reshape(4, 4)
    vg = jax.value_and_grad(f, has_aux=True)
    (ref_v, ref_c), ref_g = vg(x)
    if order == "grad_of_rewrite":
        (v, c), g = jax.value_and_grad(jr.rewrite(f, dtype=dtype), has_aux=True)(x)
    else:
        (v, c), g = jr.rewrite(vg, dtype=dtype)(x)
    np.testing.assert_array_equal(c, ref_c)  # handed on exact
    np.testing.assert_allclose(v, ref_v, rtol=2e-2)
    np.testing.assert_allclose(g, ref_g, rtol=3e-2, atol=1e-2)


@HALF
def test_a_loop_that_runs_keeps_its_half_carry(dtype):
    """Only loops known to run zero times are kept float32: the same scan with length 3, or
    a while loop whose bound is an argument, still carries half values."""

    def f(x, n):
        h = x @ W4
        a = lax.scan(lambda c, _: (_body(c), None), h, None, length=3)[0]
        b = lax.while_loop(lambda ic: ic[0] < n, lambda ic: (ic[0] + 1, _body(ic[1])), (0, h))
        return a, b[1]

    jaxpr = emitted(jr.rewrite(f, dtype=dtype), jnp.ones((4, 4)), 2)
    for name in ("scan", "while"):
        (loop,) = prims(jaxpr, name)
        carried = [v.aval.dtype for v in loop.outvars if v.aval.shape == (4, 4)]
        assert carried == [np.dtype(dtype)]


# -- 8. float32 values leaving a cond -----------------------------------------------------

W2 = 0.5 * jnp.eye(4)
CONDS = {
    "cond_ones": lambda flag, h: lax.cond(flag, lambda h: h, jnp.ones_like, h),
    "cond_half_branch": lambda flag, h: lax.cond(flag, lambda h: h, lambda h: h @ W2, h),
    "switch": lambda flag, h: lax.switch(
        jnp.where(flag, 0, 2), [lambda h: h, jnp.ones_like, lambda h: h @ W2], h
    ),
    "nested": lambda flag, h: lax.cond(
        flag, lambda h: lax.cond(flag, lambda h: h, lambda h: h @ W2, h), lambda h: h @ W2, h
    ),
    "in_jit_and_checkpoint": lambda flag, h: jax.checkpoint(
        jax.jit(lambda h: lax.cond(flag, lambda h: h, jnp.ones_like, h))
    )(h),
    "in_scan": lambda flag, h: lax.scan(
        lambda c, _: (c, lax.cond(flag, lambda h: h, lambda h: h @ W2, c)), h, None, length=2
    )[1][1],
    "in_while": lambda flag, h: lax.while_loop(
        lambda ic: ic[0] < 2,
        lambda ic: (ic[0] + 1, lax.cond(flag, lambda h: h, lambda h: h @ W2, ic[1])),
        (0, h),
    )[1],
}


def _cond_program(kind):
    def f(x, w, flag):
        h = jnp.exp(x)  # float32 (deny): 162754.8 overflows float16
        y = CONDS[kind](flag, h)
        return y @ w, y

    return f


@HALF
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("kind", list(CONDS))
def test_a_float32_value_leaving_a_cond_comes_back_exact(dtype, jit, kind):
    f = _cond_program(kind)
    x, w = jnp.full((4, 4), 12.0) + 0.01 * jnp.arange(4.0), jnp.eye(4)
    rewritten = jr.rewrite(f, dtype=dtype)
    mm, y = (jax.jit(rewritten) if jit else rewritten)(x, w, True)
    np.testing.assert_array_equal(y, jnp.exp(x))
    assert y.dtype == F32
    dots = prims(emitted(rewritten, x, w, True), "dot_general")
    assert runs_in_half(dots[-1])  # y @ w still in half: the cast comes after the cond
    # the other branch's value, computed in half, comes back as half computed it
    _, y_other = rewritten(x * 0.5, w, False)
    assert np.isfinite(np.asarray(y_other)).all()
    np.testing.assert_allclose(y_other, f(x * 0.5, w, False)[1], rtol=1e-2)


@HALF
@pytest.mark.parametrize("order", ["grad_of_rewrite", "rewrite_of_grad"])
@pytest.mark.parametrize("kind", ["cond_half_branch", "switch", "nested", "in_scan"])
def test_cond_outputs_in_both_orders(dtype, order, kind):
    f = _cond_program(kind)
    x, w = jnp.full((4, 4), 12.0) + 0.01 * jnp.arange(4.0), jnp.eye(4)

    def loss(x):
        mm, y = f(x, w, True)
        return jnp.sum(mm) * 1e-6, y

    vg = jax.value_and_grad(loss, has_aux=True)
    (ref_v, ref_y), ref_g = vg(x)
    if order == "grad_of_rewrite":
        (v, y), g = jax.value_and_grad(jr.rewrite(loss, dtype=dtype), has_aux=True)(x)
    else:
        (v, y), g = jr.rewrite(vg, dtype=dtype)(x)
    np.testing.assert_array_equal(y, ref_y)  # the aux output: exp(x), exact
    assert np.isfinite(np.asarray(g)).all()
    np.testing.assert_allclose(g, ref_g, rtol=2e-2)


def _fill_or_exp(x, w, flag):
    y = lax.cond(flag, jnp.exp, lambda x: jnp.full_like(x, 1e30), x)
    return y @ w, y  # y float32 (an output), cast for the half matmul


def _overflow_across_segments(x, w, m, flag):
    s = jnp.exp(x) + (1 - m) * -1e9  # big where m = 0; exp(12) overflows float16 where m = 1
    z = lax.cond(flag, jnp.sin, jnp.cos, x)  # control flow: compare runs s and s @ w apart
    return s @ w + z.sum()


_WRAPS = {
    "eager": lambda f: jr.rewrite(f, dtype=jnp.float16),
    "jit(rewrite)": lambda f: jax.jit(jr.rewrite(f, dtype=jnp.float16)),
    "rewrite(jit)": lambda f: jr.rewrite(jax.jit(f), dtype=jnp.float16),
}


@pytest.mark.parametrize("wrap", _WRAPS)
def test_a_cond_output_constant_in_one_branch_only_still_overflows(wrap):
    """A ``cond`` output constant in one branch and computed in the other is no constant: the
    computed branch's float32 value overflows on its way into a half matmul, as it would by
    hand, where the constant is pinned (the branches hand out which elements the fill put
    out of range). (Float16 only: bfloat16's range is float32's to within 0.4%.)"""
    x, w = jnp.full((4, 4), 12.0), jnp.full((4, 4), 0.25)
    rewritten = _WRAPS[wrap](_fill_or_exp)
    mm, y = rewritten(x, w, True)
    assert np.isposinf(np.asarray(mm)).all()  # exp(12) > 65504
    np.testing.assert_array_equal(y, jnp.exp(x))
    assert np.isfinite(np.asarray(_fill_or_exp(x, w, True)[0])).all()
    mm, y = rewritten(x, w, False)  # the fill's branch: pinned, as a constant is
    np.testing.assert_allclose(mm, 65504.0)
    np.testing.assert_array_equal(y, np.float32(1e30))
    both = lambda x, w, flag: (
        lax.cond(flag, lambda x: jnp.full_like(x, 1e30), jnp.zeros_like, x) @ w
    )  # noqa: E731
    np.testing.assert_allclose(_WRAPS[wrap](both)(x, w, True), 65504.0)


@pytest.mark.parametrize("flag", [True, False])
def test_compare_overflows_where_the_rewrite_does_across_control_flow(flag):
    """``compare`` runs the program in compiled segments split at control flow; a big
    value's flags cross the segments' and the branches' boundaries with it, so compare counts
    the overflows the rewrite has (it counted none: the value was pinned after the cond)."""
    x, w = jnp.full((4, 4), 12.0), jnp.full((4, 4), 0.25)
    m = jnp.array([[1.0] * 4, [0.0] * 4, [1.0] * 4, [0.0] * 4])
    for f, args in ((_fill_or_exp, (x, w, flag)), (_overflow_across_segments, (x, w, m, flag))):
        out = np.asarray(jax.tree.leaves(jr.rewrite(f, dtype=jnp.float16)(*args))[0])
        compared = jr.compare(f, *args, dtype=jnp.float16).outputs[0]
        assert compared.overflow == np.isinf(out).sum(), f.__name__
    assert compared.overflow == 8  # rows with m = 1: exp(12) in float16


def _layers_scanned(ws, x, am):
    bias = (1.0 - am[:, None, :]) * jnp.finfo(jnp.float32).min  # a scan const in the body

    def layer(h, w):
        return jax.nn.softmax(jnp.einsum("btd,bsd->bts", h @ w, h) + bias, -1) @ h, None

    return lax.scan(layer, x, ws)[0]


def _layers_carried(ws, x, am):
    bias = (1.0 - am[:, None, :]) * jnp.finfo(jnp.float32).min  # a carry handed on unchanged

    def layer(i, hb):
        h, b = hb
        return jax.nn.softmax(jnp.einsum("btd,bsd->bts", h @ ws[i], h) + b, -1) @ h, b

    return lax.fori_loop(0, 2, layer, (x, bias))[0]


@HALF
@pytest.mark.parametrize("model", [_layers_scanned, _layers_carried], ids=["const", "carry"])
def test_a_padding_bias_inside_a_loop_over_layers(dtype, model):
    wq, wk, x = _attention_args()
    ws = jnp.stack([wq, wk])
    out = np.asarray(jr.rewrite(model, dtype=dtype)(ws, x, ATTENTION_MASK))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, model(ws, x, ATTENTION_MASK), atol=3e-2)


# A value the untaken branch hands on with no node of its own (a program input, a constant the
# branch closes over), beside a branch that computes in half: ``s * s + hh[0]`` is no state
# update (not linear in ``s``), so only the cond rule keeps ``s`` exact; ``sq(s)`` is
# ``s * s + v @ w``, its add painted half after the matmul.
S0 = np.linspace(0.5, 1.5, 4, dtype=np.float32) + np.float32(1e-3)  # not representable in half


STATE_CONDS = {
    "cond": lambda flag, s, sq: lax.cond(flag, lambda s: s, lambda s: sq(s), s),
    "switch": lambda flag, s, sq: lax.switch(
        jnp.where(flag, 1, 0), [lambda s: sq(s), lambda s: s, jnp.zeros_like], s
    ),
    "nested": lambda flag, s, sq: lax.cond(
        flag,
        lambda s: lax.cond(flag, lambda s: s, lambda s: sq(s), s),
        lambda s: sq(s),
        s,
    ),
    "constant": lambda flag, s, sq: lax.cond(flag, lambda s: jnp.asarray(S0), lambda s: sq(s), s),
    "in_jit_and_checkpoint": lambda flag, s, sq: jax.checkpoint(
        jax.jit(lambda s: lax.cond(flag, lambda s: s, lambda s: sq(s), s))
    )(s),
    "in_scan": lambda flag, s, sq: lax.scan(
        lambda c, _: (c, lax.cond(flag, lambda s: s, lambda s: sq(s), s)),
        0.0,
        None,
        length=2,
    )[1][1],
    "in_fori": lambda flag, s, sq: lax.fori_loop(
        0, 3, lambda i, c: lax.cond(flag, lambda c: c, lambda c: sq(c), c), s
    ),
}


@HALF
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("kind", list(STATE_CONDS))
def test_an_input_handed_on_by_an_untaken_branch_comes_back_exact(dtype, jit, kind):
    """Issue 21 item 8 (found by the program generator in bfloat16): ``cond(p, update,
    identity, s)`` with ``p`` false returned ``s`` rounded through half when the update
    branch ran in half, since an input handed on had no node among the output's sources."""

    def f(s, x, w, flag):
        return STATE_CONDS[kind](flag, s, lambda s: s * s + x[0] @ w)

    s = jnp.asarray(S0)
    x, w = _rand(4, 4), _rand(4, 4, seed=1)
    rewritten = jr.rewrite(f, dtype=dtype)
    run = jax.jit(rewritten) if jit else rewritten
    y = run(s, x, w, True)
    assert y.dtype == F32
    np.testing.assert_array_equal(y, S0)
    # the branch that computes still runs in half, as painted, and rounds as such
    adds = [a for a in prims(emitted(rewritten, s, x, w, True), "add") if float_in_dtypes(a)]
    assert adds and all(runs_in_half(a) for a in adds)
    y_other = run(s, x, w, False)
    np.testing.assert_allclose(y_other, f(s, x, w, False), rtol=3e-2, atol=3e-2)


@HALF
@pytest.mark.parametrize("order", ["grad_of_rewrite", "rewrite_of_grad"])
@pytest.mark.parametrize("kind", ["cond", "switch", "nested", "in_fori"])
def test_an_input_handed_on_by_an_untaken_branch_in_both_orders(dtype, order, kind):
    s, x, w = jnp.asarray(S0), _rand(4, 4), _rand(4, 4, seed=1)

    def loss(w, s):
        flag = jnp.sum(w) < 1e6  # traced: true
        y = STATE_CONDS[kind](flag, s, lambda s: s * s + x[0] @ w)
        return jnp.sum(x @ w), y  # the state, handed on: an aux output

    vg = jax.value_and_grad(loss, has_aux=True)
    (_, y), g = (
        jax.value_and_grad(jr.rewrite(loss, dtype=dtype), has_aux=True)(w, s)
        if order == "grad_of_rewrite"
        else jr.rewrite(vg, dtype=dtype)(w, s)
    )
    np.testing.assert_array_equal(y, S0)
    np.testing.assert_allclose(g, vg(w, s)[1], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("wrap", _WRAPS)
def test_a_switch_hands_out_each_branchs_flags(wrap):
    """``lax.switch`` over a fill, a computed value and a mask bias computed outside and
    handed through: each branch's elements are pinned only where a constant put them out of
    range (the fill; the bias where ``m = 0``), and a computed overflow stays ``inf``."""

    def f(i, x, w, m):
        bias = (1.0 - m) * -1e9
        y = lax.switch(
            i,
            (lambda x, b: jnp.full_like(x, 1e30), lambda x, b: jnp.exp(x), lambda x, b: b),
            x,
            bias,
        )
        return y @ w

    x, w = jnp.full((4, 4), 12.0), jnp.full((4, 4), 0.25)
    m = jnp.array([[1.0] * 4, [0.0] * 4, [1.0] * 4, [0.0] * 4])
    g = _WRAPS[wrap](f)
    np.testing.assert_allclose(g(0, x, w, m), 65504.0)  # the fill: pinned
    assert np.isposinf(np.asarray(g(1, x, w, m))).all()  # exp(12): overflows
    got = np.asarray(g(2, x, w, m))  # the bias: -65504 where masked, 0 elsewhere
    np.testing.assert_allclose(got[[1, 3]], -65504.0)
    np.testing.assert_array_equal(got[[0, 2]], 0.0)
    assert np.isfinite(np.asarray(f(1, x, w, m))).all()  # float32 has no overflow
