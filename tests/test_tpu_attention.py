"""``fuse_attention=True`` on a TPU: JAX's Pallas flash-attention kernel, or the attention as
written where the kernel cannot take it.

No TPU here: the kernel's numerics run in Pallas' TPU interpret mode
(``pltpu.force_tpu_interpret_mode``) with the CPU's branch set to the TPU's
(``attention.BRANCHES``); a cross-platform ``jax.export(..., platforms=["tpu"])`` shows the
Mosaic kernel in the StableHLO; each case the kernel cannot take has its reason in
``lint()`` and, on a TPU, the rewrite's own equations. At these toy lengths the kernel would
keep more than the written-out attention (its tiles are 128 wide), so the tests that run it
switch that rule off (``kernel_at_any_length``); the rule has tests of its own, and the
memory a deviceless TPU compile (libtpu only: ``.venv-tpu``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import jmp_rewrite
from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src.attention import tpu as tpu_lib
from jmp_rewrite._src.emit import attention as attention_emit
from jmp_rewrite._src.emit import tpu_attention

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

BF16 = jnp.bfloat16
B, T, H, D = 2, 16, 2, 16
FMIN = jnp.finfo(jnp.float32).min
RNG = np.random.default_rng(37)


def _rel(a, b) -> float:
    a = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(a)])
    b = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(b)])
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _normal(*shape):
    return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


def _logits(q, k):
    return jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))


def _out(s, v):
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


def _plain(q, k, v, m):
    return _out(_logits(q, k), v)


def _causal(q, k, v, m):
    t = q.shape[1]
    return _out(jnp.where(jnp.tril(jnp.ones((t, t), bool)), _logits(q, k), FMIN), v)


def _padded_causal(q, k, v, m):  # keys padded per batch (m: (B, S)); row 0 of batch 0 empty
    s = jnp.where(jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)), _logits(q, k), FMIN)
    return _out(jnp.where(m[:, None, None, :], s, FMIN), v)


def _query_mask(q, k, v, m):  # m: (B, T), queries masked: rows without keys
    return _out(jnp.where(m[:, None, :, None], _logits(q, k), -1e9), v)


def _grouped(q, k, v, m):  # GQA as MaxText writes it: one key/value head per group of H
    b, t, h, d = q.shape
    s = jnp.einsum("btkgd,bskd->bkgts", q.reshape(b, t, 1, h, d), k[:, :, :1]) * d**-0.5
    o = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(s, axis=-1), v[:, :, :1])
    return o.reshape(b, t, h, d)


def _full_bias(q, k, v, m):  # m: (1, H, T, S), the logits' full size (batch 1)
    return _out(_logits(q, k) + m, v)


def _key_bias(q, k, v, m):  # Hugging Face's additive padding mask; m: (B, S), row 1 empty
    return _out(_logits(q, k) + (1.0 - m[:, None, None, :]) * FMIN, v)


CASES = {  # name: (attention, its mask or bias, batch)
    "causal_t24": (_causal, None, B),
    "padded_causal": (_padded_causal, "keys", B),
    "query_mask": (_query_mask, "queries", B),
    "gqa": (_grouped, None, B),
    "full_bias": (_full_bias, "bias", 1),
    "key_bias": (_key_bias, "padding", B),
}


def _inputs(name):
    att, side, b = CASES[name]
    t = 24 if name == "causal_t24" else T  # not a multiple of 8: padded to 24, keys to 128
    q, k, v = (_normal(b, t, H, D) for _ in range(3))
    m = {
        None: jnp.zeros(()),
        "keys": jnp.ones((b, t), bool).at[0, 0].set(False).at[1, 11:].set(False),
        "queries": jnp.ones((b, t), bool).at[1, 3:5].set(False),
        "bias": _normal(1, H, t, t),
        "padding": jnp.ones((b, t)).at[0, 12:].set(0.0).at[1].set(0.0),
    }[side]
    return att, (q, k, v, m)


@pytest.fixture
def kernel_at_any_length(monkeypatch):
    """The kernel taken at any length (toy lengths here; see the module docstring)."""
    monkeypatch.setattr(tpu_lib, "_keeps_more", lambda core, d: "")


def _steps(att):
    def loss(q, k, v, m):
        return jnp.sum(jnp.tanh(att(q, k, v, m)) * jnp.arange(D))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    return {
        "rewrite(grad)": jmp_rewrite.rewrite(grad, dtype=BF16, fuse_attention=True),
        "grad(rewrite)": jax.grad(
            jmp_rewrite.rewrite(loss, dtype=BF16, fuse_attention=True), argnums=(0, 1, 2)
        ),
    }, grad


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.usefixtures("kernel_at_any_length")
def test_kernel_in_interpret_mode_against_float32(name, monkeypatch):
    """Forward and gradients through the TPU kernel (interpret mode) within bfloat16's error
    of float32, no further from it than JAX's own attention (the CPU's fused call), rows
    without keys float32's (finite here, a finite fill); both orders of rewrite and grad."""
    att, args = _inputs(name)
    steps, grad = _steps(att)
    ref = grad(*args)
    cpu = {order: jax.jit(f)(*args) for order, f in steps.items()}
    seen = []
    real = tpu_attention.flash
    monkeypatch.setattr(tpu_attention, "flash", lambda *a: seen.append(1) or real(*a))
    monkeypatch.setitem(attention_emit.BRANCHES, "default", "tpu")
    steps, _ = _steps(att)
    with pltpu.force_tpu_interpret_mode():
        tpu = {order: jax.jit(f)(*args) for order, f in steps.items()}
        out = jax.jit(jmp_rewrite.rewrite(att, dtype=BF16, fuse_attention=True))(*args)
    assert len(seen) == 3, seen  # traced once per order and for the forward alone
    assert _rel(out, att(*args)) < 0.01
    for order in steps:
        assert all(bool(jnp.isfinite(g).all()) for g in tpu[order]), order
        err, xla = _rel(tpu[order], ref), _rel(cpu[order], ref)
        assert err < 0.015 and err <= 1.25 * xla + 1e-3, (order, err, xla)


@pytest.mark.usefixtures("kernel_at_any_length")
def test_rows_without_keys_are_float32s_minus_inf_fill(monkeypatch):
    """A ``-inf`` fill leaves a key-less row NaN in float32: the kernel's row is replaced by
    NaN from outside it (the kernel's own mask value would make it uniform), the others are
    untouched."""

    def att(q, k, v, m):
        return _out(jnp.where(m[:, None, None, :], _logits(q, k), -jnp.inf), v)

    q, k, v = (_normal(B, T, H, D) for _ in range(3))
    m = jnp.ones((B, T), bool).at[1].set(False)
    monkeypatch.setitem(attention_emit.BRANCHES, "default", "tpu")
    with pltpu.force_tpu_interpret_mode():
        out = jax.jit(jmp_rewrite.rewrite(att, dtype=BF16, fuse_attention=True))(q, k, v, m)
    want = att(q, k, v, m)
    assert bool(jnp.isnan(out[1]).all()) and bool(jnp.isnan(want[1]).all())
    assert _rel(out[0], want[0]) < 0.01


def _export(fn, args, platform):
    return jax.export.export(jax.jit(fn), platforms=[platform])(*args).mlir_module()


@pytest.mark.parametrize("order", ["rewrite(grad)", "grad(rewrite)"])
@pytest.mark.usefixtures("kernel_at_any_length")
def test_tpu_export_holds_the_mosaic_kernel_and_other_platforms_do_not(order):
    """``jax.export(..., platforms=["tpu"])`` on this CPU host: the forward kernel and its
    two backward kernels (dK/dV, dQ) are Mosaic custom calls in the StableHLO; the CPU's and
    CUDA's exports of the same function hold none (the branch not taken is not lowered)."""
    att, args = _inputs("padded_causal")
    steps, _ = _steps(att)
    fn = steps[order]
    assert _export(fn, args, "tpu").count("tpu_custom_call") == 3
    for platform in ("cpu", "cuda"):
        assert "tpu_custom_call" not in _export(fn, args, platform), platform


def _mask_2d(q, k, v, m):  # m: (B, T, S): a mask over queries and keys, not causal
    return _out(jnp.where(m[:, None], _logits(q, k), FMIN), v)


def _head_mask(q, k, v, m):  # m: (H, S): per head and key
    return _out(jnp.where(m[None, :, None, :], _logits(q, k), FMIN), v)


def _broadcast_bias(q, k, v, m):  # m: (H, T, S), broadcast over the batch
    return _out(_logits(q, k) + m, v)


def _grouped_bias(q, k, v, m):  # m: (T, S) over grouped queries
    b, t, h, d = q.shape
    s = jnp.einsum("btkgd,bskd->bkgts", q.reshape(b, t, 1, h, d), k[:, :, :1]) * d**-0.5
    s = s + m
    o = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(s, axis=-1), v[:, :, :1])
    return o.reshape(b, t, h, d)


REFUSED = {  # name: (attention, its mask or bias, head dim, the reason's words)
    "mask_2d": (_mask_2d, (B, T, T), D, "a mask over both queries and keys that is not causal"),
    "head_mask": (_head_mask, (H, T), D, "a mask differs between heads"),
    "broadcast_bias": (_broadcast_bias, (H, T, T), D, "a bias over queries and keys broadcast"),
    "grouped_bias": (_grouped_bias, (T, T), D, "a bias over queries and keys under grouped-"),
    "head_dim_192": (_causal, (), 192, "head dim 192: the TPU kernel takes head dims up to 128"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
@pytest.mark.usefixtures("kernel_at_any_length")
def test_what_the_kernel_cannot_take_runs_as_written_on_a_tpu(name, monkeypatch):
    """Fused elsewhere, but on a TPU the attention's own equations as the rewrite paints
    them (JAX's XLA attention there costs more memory than they do): lint says why, the TPU
    export holds no kernel, and the TPU's branch (run here on the CPU) computes what the
    rewrite without ``fuse_attention`` computes -- exactly, where JAX differentiates it."""
    if name == "head_dim_192":  # above 128 only where a Hopper card with cuDNN 9.5 is seen
        monkeypatch.setattr(jc, "cuda_attention_target", lambda: ((9, 0), (9, 5)))
    att, shape, d, reason = REFUSED[name]
    q, k, v = (_normal(B, T, H, d) for _ in range(3))
    m = jnp.asarray(RNG.random(shape) < 0.8) if "mask" in name else _normal(*shape)
    args = (q, k, v, m)
    loss = lambda *a: jnp.sum(jnp.tanh(att(*a)))  # noqa: E731
    grad = jax.grad(loss, argnums=(0, 1, 2))
    report = jmp_rewrite.explain(grad, *args, dtype=BF16, fuse_attention=True)
    assert len(report.fused_attention) == 1, [f.message for f in report.lint()]
    found = [f for f in report.lint() if f.kind == "attention_tpu_unfused"]
    assert len(found) == 1 and reason in found[0].message, [f.message for f in found]
    assert "a TPU runs it as written" in found[0].message
    fused = jmp_rewrite.rewrite(grad, dtype=BF16, fuse_attention=True)
    assert "tpu_custom_call" not in _export(fused, args, "tpu")
    plain = jax.jit(jax.grad(jmp_rewrite.rewrite(loss, dtype=BF16), argnums=(0, 1, 2)))(*args)
    monkeypatch.setitem(attention_emit.BRANCHES, "default", "tpu")
    inner = jmp_rewrite.rewrite(loss, dtype=BF16, fuse_attention=True)
    written = jax.jit(jax.grad(inner, argnums=(0, 1, 2)))(*args)
    for a, b in zip(written, plain, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    joint = jax.jit(jmp_rewrite.rewrite(grad, dtype=BF16, fuse_attention=True))(*args)
    assert _rel(joint, grad(*args)) <= 1.25 * _rel(plain, grad(*args)) + 1e-3


@pytest.mark.usefixtures("kernel_at_any_length")
def test_taken_attentions_have_no_tpu_finding():
    """An attention the kernel takes (causal, per-token masks, GQA) has no TPU finding."""
    att, args = _inputs("padded_causal")
    report = jmp_rewrite.explain(att, *args, dtype=BF16, fuse_attention=True)
    assert len(report.fused_attention) == 1
    assert not [f for f in report.lint() if f.kind.startswith("attention")]
    assert all(e.attention_tpu == "" for e in report.equations)


def test_padded_lengths():
    """Queries up to 128 are one block (a multiple of 8); longer ones and every key length
    are padded to multiples of the kernel's 128 lanes."""
    assert tpu_attention.padded_lengths(16, 16) == (16, 128)
    assert tpu_attention.padded_lengths(197, 197) == (256, 256)
    assert tpu_attention.padded_lengths(1, 1024) == (8, 1024)
    assert tpu_attention.padded_lengths(128, 129) == (128, 256)


@pytest.mark.parametrize(
    "t, d, taken", [(1024, 64, True), (1024, 128, True), (512, 64, False), (197, 64, False)]
)
def test_the_kernel_is_taken_where_it_keeps_less_than_the_written_out_attention(t, d, taken):
    """The kernel keeps queries, keys, values and output in 128-wide tiles for the backward
    pass, the written-out attention its probabilities: at 1024 tokens the kernel keeps half,
    at 512 as much, at ViT's 197 (padded to 256) 3.4x. Where it keeps as much or more a TPU
    runs the attention as written."""
    spec = jax.ShapeDtypeStruct((1, t, 1, d), jnp.float32)
    fn = jmp_rewrite.rewrite(_causal, dtype=BF16, fuse_attention=True)
    entry, _ = fn.trace(spec, spec, spec, jax.ShapeDtypeStruct((), jnp.float32))
    (fused,) = entry.painting.attention.fused
    assert (fused.tpu == "") == taken, fused.tpu
    if not taken:
        assert f"at {t} queries and {t} keys the TPU kernel keeps more" in fused.tpu


def _has_libtpu() -> bool:
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


@pytest.mark.skipif(not _has_libtpu(), reason="a TPU compile needs libtpu (.venv-tpu)")
def test_deviceless_v5p_compile_keeps_less_with_the_kernel():
    """XLA:TPU compiles the kernel for a v5p on this CPU host (no TPU): ``rewrite(grad(f))``
    of four attentions in a row at T1024 holds three Mosaic calls each and keeps
    less than the rewrite without ``fuse_attention`` (what each layer keeps for the backward
    pass adds up; the kernel's own temporaries do not); four the kernel refuses (a (B, T, S)
    mask) keep the same."""
    import os

    from jax.experimental import topologies

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    device = topologies.get_topology_desc(platform="tpu", topology_name="v5p:1x1x1").devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    spec = jax.ShapeDtypeStruct((2, 1024, 2, 64), jnp.float32, sharding=sharding)
    results = {}
    for name, att, m in (
        ("plain", _plain, jax.ShapeDtypeStruct((), jnp.float32, sharding=sharding)),
        ("mask_2d", _mask_2d, jax.ShapeDtypeStruct((2, 1024, 1024), bool, sharding=sharding)),
    ):

        def loss(q, k, v, m, att=att):
            for i in range(4):  # keys and values of their own (a layer's projections)
                q = att(q, k * (1.0 + i / 4), v * (1.0 - i / 8), m)
            return jnp.sum(jnp.tanh(q))

        grad = jax.grad(loss, argnums=(0, 1, 2))
        for fuse in (False, True):
            fn = jax.jit(jmp_rewrite.rewrite(grad, dtype=BF16, fuse_attention=fuse))
            compiled = fn.trace(spec, spec, spec, m).lower(lowering_platforms=("tpu",)).compile()
            results[name, fuse] = (
                compiled.memory_analysis().temp_size_in_bytes,
                compiled.as_text().count('custom_call_target="tpu_custom_call"'),
            )
    assert results["plain", True][1] == 12 and results["plain", False][1] == 0
    assert results["plain", True][0] < 0.7 * results["plain", False][0], results
    assert results["mask_2d", True] == results["mask_2d", False], results
