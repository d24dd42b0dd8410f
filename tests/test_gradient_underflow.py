"""Float16 without loss scaling: which backward values underflow, and who says so (issue 21, 6).

Flash-style attention (blockwise softmax with a running max and sum in a ``scan``) and a
PPO loss (ratio of probabilities, clipped surrogate, value loss, entropy) are differentiated
in float16. Judged against float32, the rewrite's query/key weight gradients are as far off
as a hand-written float16 model's that rounds its cotangents to float16 (1.6% here), and
further than a hand-written model that asks its matmuls for float32 results
(``preferred_element_type=jnp.float32``: 0.17%). The values that model holds in float32 are
the cotangents entering the backward matmuls, and so the backward matmuls themselves: JAX's
transpose of a half x half -> float32 matmul multiplies the float32 cotangent by the half
operand upcast to float32, i.e. runs the backward matmuls, two thirds of a training step's
matmul FLOPs, in float32. TF paints them allow (its gradient MatMuls are MatMuls) and so
does the rewrite; the fix for float16 is TF's, loss scaling, with which the rewrite is as
close to float32 as that model (0.09% vs 0.17%). ``compare`` names the underflow and
``explain(...).lint()`` the missing loss scale, both pointing to the loss-scale optimizer.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jmp_rewrite

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

F16, BF16 = jnp.float16, jnp.bfloat16
T, D, BLOCK = 256, 64, 64
SCALE = 2.0**15  # TF's initial dynamic loss scale
FACTOR, NOISE = 1.5, 1e-5  # as tests/test_state_in_loops.py


def f32(seed: int, *shape: int, scale: float = 1.0) -> jax.Array:
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def rel(got: Any, ref: Any) -> float:
    g = np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in jax.tree.leaves(got)])
    r = np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in jax.tree.leaves(ref)])
    return float(np.linalg.norm(g - r) / np.linalg.norm(r))


def _matmul(half: Any) -> Any:
    """By hand: operands in ``half``, the product asked for in float32 (the careful way)."""
    if half is None:
        return jnp.matmul
    return lambda a, b: jnp.matmul(
        a.astype(half), b.astype(half), preferred_element_type=jnp.float32
    )


def flash_loss(p: dict[str, jax.Array], x: jax.Array, y: jax.Array, half: Any = None) -> Any:
    mm = _matmul(half)
    q, k, v = mm(x, p["wq"]), mm(x, p["wk"]), mm(x, p["wv"])

    def block(carry, kv):
        m, total, acc = carry
        kj, vj = kv
        s = mm(q, kj.T) / np.sqrt(D)
        m_new = jnp.maximum(m, s.max(-1))
        pj = jnp.exp(s - m_new[:, None])
        corr = jnp.exp(m - m_new)
        return (m_new, total * corr + pj.sum(-1), acc * corr[:, None] + mm(pj, vj)), None

    init = (jnp.full((T,), -jnp.inf), jnp.zeros((T,)), jnp.zeros((T, D)))
    blocks = (k.reshape(T // BLOCK, BLOCK, D), v.reshape(T // BLOCK, BLOCK, D))
    (_, total, acc), _ = lax.scan(block, init, blocks)
    return jnp.mean((mm(acc / total[:, None], p["wo"]) - y) ** 2)


def flash_args() -> tuple[Any, ...]:
    p = {n: f32(i, D, D, scale=D**-0.5) for i, n in enumerate(("wq", "wk", "wv", "wo"))}
    return p, f32(5, T, D), f32(6, T, D, scale=0.5)


B, OBS, ACT, HID = 256, 16, 6, 64


def ppo_loss(p, obs, act, logp_old, adv, ret, half=None):
    mm = _matmul(half)
    h = jnp.tanh(mm(jnp.tanh(mm(obs, p["w1"])), p["w2"]))
    logits, value = mm(h, p["wpi"]), mm(h, p["wv"])[:, 0]
    logp_all = jax.nn.log_softmax(logits)
    logp = jnp.take_along_axis(logp_all, act[:, None], -1)[:, 0]
    ratio = jnp.exp(logp - logp_old)
    a = (adv - adv.mean()) / (adv.std() + 1e-8)
    surrogate = -jnp.minimum(ratio * a, jnp.clip(ratio, 0.8, 1.2) * a).mean()
    entropy = -(jnp.exp(logp_all) * logp_all).sum(-1).mean()
    return surrogate + 0.25 * ((value - ret) ** 2).mean() - 0.01 * entropy


def ppo_args() -> tuple[Any, ...]:
    p = {
        "w1": f32(11, OBS, HID, scale=OBS**-0.5),
        "w2": f32(12, HID, HID, scale=HID**-0.5),
        "wpi": f32(13, HID, ACT, scale=0.01),
        "wv": f32(14, HID, 1, scale=HID**-0.5),
    }
    act = jnp.asarray(np.random.default_rng(20).integers(0, ACT, B), jnp.int32)
    logp_old = jnp.log(jnp.full((B,), 1.0 / ACT)) + f32(22, B, scale=0.05)
    return p, f32(21, B, OBS), act, logp_old, f32(23, B), f32(24, B)


MODELS = {"flash_attention": (flash_loss, flash_args), "ppo": (ppo_loss, ppo_args)}


def _underflow_notes(c: Any) -> list[str]:
    return [n for n in c.notes if n.startswith("gradient underflow")]


def test_compare_names_gradient_underflow_in_float16_only():
    loss, make = MODELS["flash_attention"]
    args = make()
    c = jmp_rewrite.compare(jax.grad(loss), *args, dtype=F16)
    (note,) = _underflow_notes(c)
    assert "loss_scale_optimizer" in note, note
    underflows = sum(e.underflow for e in c.equations)
    assert underflows > 500, c.summary()
    # the same program with its loss scaled as the loss-scale optimizer does: not named
    scaled = jax.grad(lambda *a: loss(*a) * SCALE)
    assert not _underflow_notes(jmp_rewrite.compare(scaled, *args, dtype=F16))
    assert not _underflow_notes(jmp_rewrite.compare(jax.grad(loss), *args, dtype=BF16))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_lint_names_a_float16_backward_pass_without_loss_scaling(jit):
    loss, make = MODELS["flash_attention"]
    p, x, y = make()
    grad = jax.jit(jax.grad(loss)) if jit else jax.grad(loss)
    (finding,) = [
        f
        for f in jmp_rewrite.explain(grad, p, x, y, dtype=F16).lint()
        if f.kind == "gradient_underflow"
    ]
    assert "loss_scale_optimizer" in finding.change and finding.flops > 0
    lint = jmp_rewrite.explain(grad, p, x, y, dtype=BF16).lint()
    assert not [f for f in lint if f.kind == "gradient_underflow"]
    # a train step with the loss-scale optimizer: nothing to say
    tx = jmp_rewrite.loss_scale_optimizer(optax.sgd(1e-2))

    def step(p, s, x, y):
        grads = jmp_rewrite.value_and_grad(loss)(s, p, x, y)[1]
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    lint = jmp_rewrite.explain(step, p, tx.init(p), x, y, dtype=F16).lint()
    assert not [f for f in lint if f.kind == "gradient_underflow"]


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("order", ["rewrite(grad)", "grad(rewrite)"])
def test_with_the_loss_scale_optimizer_float16_is_as_careful_as_by_hand(model, order):
    """One SGD step through the loss-scale optimizer, against float32 and against the
    hand-written float16 model that keeps its cotangents float32."""
    loss, make = MODELS[model]
    p, *data = make()
    tx = jmp_rewrite.loss_scale_optimizer(optax.sgd(1e-2))
    state = tx.init(p)

    def step(p, s, *data):
        grads = jmp_rewrite.value_and_grad(loss)(s, p, *data)[1]
        return tx.update(grads, s, p)[0]

    if order == "rewrite(grad)":
        got = jax.jit(jmp_rewrite.rewrite(step, dtype=F16))(p, state, *data)
    else:

        def step_rewritten(p, s, *data):
            half_loss = jmp_rewrite.rewrite(loss, dtype=F16)
            grads = jax.grad(lambda p: jmp_rewrite.scale_loss(half_loss(p, *data), s))(p)
            return tx.update(grads, s, p)[0]

        got = jax.jit(step_rewritten)(p, state, *data)
    ref = jax.tree.map(lambda g: -1e-2 * g, jax.grad(loss)(p, *data))
    hand = jax.tree.map(lambda g: -1e-2 * g, jax.grad(loss)(p, *data, half=F16))
    e_got, e_hand = rel(got, ref), rel(hand, ref)
    assert e_got <= FACTOR * e_hand + NOISE, f"rewrite {e_got:.3g}, by hand {e_hand:.3g}"
