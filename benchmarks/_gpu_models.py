"""Models for ``gpu_speedup.py``: GPT-2-style LM, ResNet-50 (plain JAX) and a Flax Linen ViT.

Each model is written once with a Flax-style ``dtype`` argument (the *compute* dtype; the
parameters stay float32, as ``param_dtype`` does in Flax):

* ``dtype=None`` is the float32 model, which is also the input to ``jmp_rewrite.rewrite``;
* ``dtype=jnp.bfloat16`` is the hand-written mixed-precision baseline exactly as Flax modules
  do it: ``Dense``/``Conv``/``Embed`` cast their inputs and parameters to ``dtype``,
  ``LayerNorm``/``BatchNorm`` compute their statistics in float32 and return ``dtype``,
  attention's softmax runs in ``dtype``, and the loss casts the logits to float32.

The GPT and ResNet are plain functions of parameter pytrees; the ViT is a ``flax.linen``
module as a Flax user writes it. No ``lax.scan``: layers are Python loops (unrolled), so every
layer is its own set of equations, as in most Flax code. Parameters are drawn with NumPy as
host arrays (nothing is compiled to build a model) and put on the device per variant, since a
donating train step consumes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

Tree = Any
#: ``make_loss(dtype)`` -> ``loss(params, state, inputs, labels) -> (loss, new_state)``
#: (``make_loss(dtype, dot=...)`` for a model with ``fp8_dot``).
LossFactory = Callable[..., Callable[..., tuple[jax.Array, Tree]]]


@dataclasses.dataclass
class Model:
    """A benchmark model: how to build its loss, its parameters and one fixed batch.

    Attributes:
      key: short name used in the JSON (``gpt``, ``resnet50``, ``vit``).
      description: human-readable shapes.
      make_loss: ``make_loss(dtype)``; ``dtype=None`` is the float32 model, a half dtype the
        hand-written Flax-style mixed-precision model (float32 parameters and loss).
      params: float32 parameters (NumPy arrays).
      state: non-trained state such as batch-norm statistics (NumPy arrays; may be ``{}``).
      inputs: one batch of inputs (NumPy).
      labels: integer labels of that batch (NumPy).
      learning_rate: Adam's learning rate.
      config: the sizes, for the JSON report.
      fp8_dot: ``make_loss(dtype, dot=...)`` runs the weight GEMMs a float8 rewrite picks
        (``Fp8Rules()``'s default) through ``dot(x, w)`` (a hand-written float8 baseline).
    """

    key: str
    description: str
    make_loss: LossFactory
    params: Tree
    state: Tree
    inputs: np.ndarray
    labels: np.ndarray
    learning_rate: float
    config: dict[str, Any]
    fp8_dot: bool = False

    @property
    def n_params(self) -> int:
        return sum(int(np.size(a)) for a in jax.tree.leaves(self.params))


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)


def _cast(x: jax.Array, dtype: Any) -> jax.Array:
    return x if dtype is None else x.astype(dtype)


def _xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    # Flax users compute the loss in float32 whatever the compute dtype.
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _dense(
    x: jax.Array, p: dict[str, jax.Array], dtype: Any, name: str = "", dot: Any = None
) -> jax.Array:
    """``flax.linen.Dense``: inputs, kernel and bias promoted to ``dtype``; ``name``: its
    scope (a Flax module's name); ``dot``: the matmul (``jnp.matmul`` by default)."""
    with jax.named_scope(name) if name else contextlib.nullcontext():
        return (dot or jnp.matmul)(_cast(x, dtype), _cast(p["w"], dtype)) + _cast(p["b"], dtype)


def _norm(x: jax.Array, mean: jax.Array, var: jax.Array, p: dict[str, jax.Array], eps: float):
    return (x - mean) * lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def layer_norm(x: jax.Array, p: dict[str, jax.Array], dtype: Any, eps: float = 1e-5):
    """``flax.linen.LayerNorm``: statistics and normalisation in float32, output ``dtype``."""
    x32 = x.astype(jnp.float32)  # a no-op for the float32 model: the rewrite decides there
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    return _cast(_norm(x32, mean, var, p, eps), dtype or x.dtype)


# ------------------------------------------------------------------------------------------
# (a) GPT-2-style decoder LM
# ------------------------------------------------------------------------------------------


def _ln_params(d: int) -> dict[str, np.ndarray]:
    return {"scale": np.ones((d,), np.float32), "bias": np.zeros((d,), np.float32)}


def _dense_params(rng: np.random.Generator, n_in: int, n_out: int, std: float):
    return {"w": _normal(rng, (n_in, n_out), std), "b": np.zeros((n_out,), np.float32)}


def init_gpt(seed: int, *, layers: int, d_model: int, seq: int, vocab: int) -> dict[str, Any]:
    """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 layers)."""
    rng = np.random.default_rng(seed)
    d, std = d_model, 0.02
    std_res = std / math.sqrt(2 * layers)
    blocks = [
        {
            "ln1": _ln_params(d),
            "qkv": _dense_params(rng, d, 3 * d, std),
            "proj": _dense_params(rng, d, d, std_res),
            "ln2": _ln_params(d),
            "fc": _dense_params(rng, d, 4 * d, std),
            "fc_proj": _dense_params(rng, 4 * d, d, std_res),
        }
        for _ in range(layers)
    ]
    return {
        "wte": _normal(rng, (vocab, d), std),
        "wpe": _normal(rng, (seq, d), 0.01),
        "blocks": blocks,
        "ln_f": _ln_params(d),
    }


def gpt_logits(
    params: Tree, tokens: jax.Array, *, heads: int, dtype: Any = None, dot: Any = None
) -> jax.Array:
    """Pre-LN causal decoder with learned positions and a head tied to the embedding.

    ``dot(x, w)``, when given, runs the blocks' weight GEMMs but the first (block 0's QKV):
    those ``rewrite(..., fp8=True)`` runs in float8 (the head and attention's activation
    products stay ``x @ y``).
    """
    b, t = tokens.shape
    wte = _cast(params["wte"], dtype)  # flax Embed casts its table to dtype
    x = wte[tokens] + _cast(params["wpe"][:t], dtype)
    d = x.shape[-1]
    dh = d // heads
    causal = jnp.tril(jnp.ones((t, t), bool))
    # Named scopes as a Flax model's module paths (h_0/attn/qkv, h_0/mlp/fc, head): what explain
    # shows and Fp8Rules patterns match; they change no computation.
    for i, blk in enumerate(params["blocks"]):
        with jax.named_scope(f"h_{i}"):
            with jax.named_scope("attn"):
                h = layer_norm(x, blk["ln1"], dtype)
                qkv = _dense(h, blk["qkv"], dtype, "qkv", dot if i else None).reshape(
                    b, t, 3, heads, dh
                )
                q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
                logits = jnp.einsum("bthd,bshd->bhts", q, k) * float(dh**-0.5)  # weak dtype
                logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
                attn = jax.nn.softmax(logits, axis=-1)  # in dtype, as flax's attention
                o = jnp.einsum("bhts,bshd->bthd", attn, v).reshape(b, t, d)
                x = x + _dense(o, blk["proj"], dtype, "proj", dot)
            with jax.named_scope("mlp"):
                h = layer_norm(x, blk["ln2"], dtype)
                h = jax.nn.gelu(_dense(h, blk["fc"], dtype, "fc", dot))
                x = x + _dense(h, blk["fc_proj"], dtype, "fc_proj", dot)
    x = layer_norm(x, params["ln_f"], dtype)
    with jax.named_scope("head"):
        return x @ wte.T  # flax Embed.attend


def gpt_model(
    *,
    layers: int = 12,
    d_model: int = 768,
    heads: int = 12,
    seq: int = 1024,
    vocab: int = 50304,
    batch: int = 16,
    seed: int = 0,
) -> Model:
    """GPT-2 small by default (124M parameters; vocabulary padded to a multiple of 128)."""
    params = init_gpt(seed, layers=layers, d_model=d_model, seq=seq, vocab=vocab)
    rng = np.random.default_rng(seed + 1)
    tokens = rng.integers(0, vocab, (batch, seq + 1), dtype=np.int32)

    def make_loss(dtype: Any, dot: Any = None) -> Callable[..., Any]:
        def loss(params, state, inputs, labels):
            logits = gpt_logits(params, inputs, heads=heads, dtype=dtype, dot=dot)
            return _xent(logits, labels), state

        return loss

    config = dict(layers=layers, d_model=d_model, heads=heads, seq=seq, vocab=vocab, batch=batch)
    return Model(
        "gpt",
        f"GPT L={layers} d={d_model} h={heads} T={seq} V={vocab} B={batch}",
        make_loss,
        params,
        {},
        tokens[:, :-1],
        tokens[:, 1:],
        3e-4,
        config,
        fp8_dot=True,
    )


# ------------------------------------------------------------------------------------------
# (b) ResNet-50 (v1.5: stride on the 3x3 conv), NHWC, batch norm in training mode
# ------------------------------------------------------------------------------------------


def _conv_w(rng: np.random.Generator, kh: int, kw: int, cin: int, cout: int) -> np.ndarray:
    return _normal(rng, (kh, kw, cin, cout), math.sqrt(2.0 / (kh * kw * cin)))  # He


def _bn_init(c: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    stats = {"mean": np.zeros((c,), np.float32), "var": np.ones((c,), np.float32)}
    return _ln_params(c), stats


def init_resnet50(
    seed: int, *, stages: tuple[int, ...], width: int, classes: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    rng = np.random.default_rng(seed)
    params: dict[str, Any] = {"stem": _conv_w(rng, 7, 7, 3, width)}
    state: dict[str, Any] = {}
    params["stem_bn"], state["stem_bn"] = _bn_init(width)
    cin = width
    params["blocks"], state["blocks"] = [], []
    for i, n_blocks in enumerate(stages):
        w = width * 2**i
        for j in range(n_blocks):
            p = {
                "conv1": _conv_w(rng, 1, 1, cin, w),
                "conv2": _conv_w(rng, 3, 3, w, w),
                "conv3": _conv_w(rng, 1, 1, w, 4 * w),
            }
            s: dict[str, Any] = {}
            for name in ("bn1", "bn2"):
                p[name], s[name] = _bn_init(w)
            p["bn3"], s["bn3"] = _bn_init(4 * w)
            if j == 0:
                p["proj"] = _conv_w(rng, 1, 1, cin, 4 * w)
                p["proj_bn"], s["proj_bn"] = _bn_init(4 * w)
            params["blocks"].append(p)
            state["blocks"].append(s)
            cin = 4 * w
    params["fc"] = _dense_params(rng, cin, classes, 1.0 / math.sqrt(cin))
    return params, state


def _conv(x: jax.Array, w: jax.Array, stride: int, dtype: Any) -> jax.Array:
    """``flax.linen.Conv(use_bias=False)``: input and kernel promoted to ``dtype``."""
    return lax.conv_general_dilated(
        _cast(x, dtype),
        _cast(w, dtype),
        (stride, stride),
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )


def batch_norm(x, p, stats, dtype, momentum=0.9, eps=1e-5):
    """``flax.linen.BatchNorm(use_running_average=False)``: float32 statistics, ``dtype`` out."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=(0, 1, 2))
    var = jnp.mean(jnp.square(x32 - mean), axis=(0, 1, 2))
    new = {
        "mean": momentum * stats["mean"] + (1 - momentum) * lax.stop_gradient(mean),
        "var": momentum * stats["var"] + (1 - momentum) * lax.stop_gradient(var),
    }
    return _cast(_norm(x32, mean, var, p, eps), dtype or x.dtype), new


def resnet50_logits(params, state, x, *, stages, dtype=None):
    new: dict[str, Any] = {"blocks": []}
    h = _conv(x, params["stem"], 2, dtype)
    h, new["stem_bn"] = batch_norm(h, params["stem_bn"], state["stem_bn"], dtype)
    h = jax.nn.relu(h)
    # flax's nn.max_pool; a Python float init lets JAX pick the differentiable max reducer.
    h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
    strides = [2 if (j == 0 and i > 0) else 1 for i, n in enumerate(stages) for j in range(n)]
    for p, s, stride in zip(params["blocks"], state["blocks"], strides):
        ns: dict[str, Any] = {}
        y = _conv(h, p["conv1"], 1, dtype)
        y, ns["bn1"] = batch_norm(y, p["bn1"], s["bn1"], dtype)
        y = _conv(jax.nn.relu(y), p["conv2"], stride, dtype)
        y, ns["bn2"] = batch_norm(y, p["bn2"], s["bn2"], dtype)
        y = _conv(jax.nn.relu(y), p["conv3"], 1, dtype)
        y, ns["bn3"] = batch_norm(y, p["bn3"], s["bn3"], dtype)
        if "proj" in p:
            sc, ns["proj_bn"] = batch_norm(
                _conv(h, p["proj"], stride, dtype), p["proj_bn"], s["proj_bn"], dtype
            )
        else:
            sc = h
        h = jax.nn.relu(y + sc)
        new["blocks"].append(ns)
    h = jnp.mean(h, axis=(1, 2))
    return _dense(h, params["fc"], dtype), new


def resnet50_model(
    *,
    batch: int = 128,
    size: int = 224,
    stages: tuple[int, ...] = (3, 4, 6, 3),
    width: int = 64,
    classes: int = 1000,
    seed: int = 0,
) -> Model:
    """ResNet-50 at ImageNet shapes by default (25.6M parameters)."""
    params, state = init_resnet50(seed, stages=stages, width=width, classes=classes)
    rng = np.random.default_rng(seed + 1)
    images = rng.standard_normal((batch, size, size, 3), dtype=np.float32)
    labels = rng.integers(0, classes, (batch,), dtype=np.int32)

    def make_loss(dtype: Any) -> Callable[..., Any]:
        def loss(params, state, inputs, labels):
            logits, new = resnet50_logits(params, state, inputs, stages=stages, dtype=dtype)
            return _xent(logits, labels), new

        return loss

    depth = 2 + 3 * sum(stages)
    config = dict(batch=batch, size=size, stages=list(stages), width=width, classes=classes)
    return Model(
        "resnet50",
        f"ResNet-{depth} {size}x{size} NHWC width={width} B={batch}",
        make_loss,
        params,
        state,
        images,
        labels,
        1e-3,
        config,
    )


# ------------------------------------------------------------------------------------------
# (c) ViT in flax.linen, written the way a Flax user writes it
# ------------------------------------------------------------------------------------------


class EncoderBlock(nn.Module):
    heads: int
    mlp_dim: int
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.LayerNorm(dtype=self.dtype)(x)
        y = nn.MultiHeadDotProductAttention(num_heads=self.heads, dtype=self.dtype)(y)
        x = x + y
        y = nn.LayerNorm(dtype=self.dtype)(x)
        y = nn.Dense(self.mlp_dim, dtype=self.dtype)(y)
        y = nn.Dense(x.shape[-1], dtype=self.dtype)(nn.gelu(y))
        return x + y


class ViT(nn.Module):
    patch: int
    hidden: int
    layers: int
    heads: int
    mlp_dim: int
    classes: int
    dtype: Any = None  # compute dtype; parameters stay float32 (param_dtype)

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        p = self.patch
        x = nn.Conv(self.hidden, (p, p), strides=(p, p), padding="VALID", dtype=self.dtype)(images)
        b, h, w, c = x.shape
        x = x.reshape(b, h * w, c)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
        x = jnp.concatenate([jnp.tile(cls, (b, 1, 1)).astype(x.dtype), x], axis=1)
        pos = self.param("pos_embedding", nn.initializers.normal(0.02), (1, h * w + 1, c))
        x = x + pos.astype(x.dtype)
        for _ in range(self.layers):
            x = EncoderBlock(self.heads, self.mlp_dim, dtype=self.dtype)(x)
        x = nn.LayerNorm(dtype=self.dtype)(x)
        return nn.Dense(self.classes, dtype=self.dtype)(x[:, 0])


def _vit_init(rng: np.random.Generator, names: list[str], shape: tuple[int, ...]) -> np.ndarray:
    """Flax's defaults: LeCun-normal kernels, zero biases, unit scales; N(0, 0.02) positions."""
    name = names[-1]
    if name == "kernel":
        # Attention's query/key/value kernels are (features, heads, head_dim): fan-in first.
        qkv = len(shape) == 3 and names[-2] in ("query", "key", "value")
        fan_in = shape[0] if qkv else math.prod(shape[:-1])
        return _normal(rng, shape, 1.0 / math.sqrt(fan_in))
    if name == "scale":
        return np.ones(shape, np.float32)
    if name == "pos_embedding":
        return _normal(rng, shape, 0.02)
    return np.zeros(shape, np.float32)  # biases, the class token


def vit_model(
    *,
    batch: int = 128,
    size: int = 224,
    patch: int = 16,
    hidden: int = 768,
    layers: int = 12,
    heads: int = 12,
    mlp_dim: int = 3072,
    classes: int = 1000,
    seed: int = 0,
) -> Model:
    """ViT-B/16 at ImageNet shapes by default (86.6M parameters)."""
    arch = dict(patch=patch, hidden=hidden, layers=layers, heads=heads, mlp_dim=mlp_dim)
    rng = np.random.default_rng(seed + 1)
    images = rng.standard_normal((batch, size, size, 3), dtype=np.float32)
    labels = rng.integers(0, classes, (batch,), dtype=np.int32)
    module = ViT(**arch, classes=classes)
    # Flax's shapes, NumPy's numbers: running (or compiling) module.init costs seconds.
    shapes = jax.eval_shape(module.init, jax.random.key(seed), jnp.asarray(images[:1]))
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: _vit_init(rng, [str(k.key) for k in path], a.shape), shapes["params"]
    )

    def make_loss(dtype: Any) -> Callable[..., Any]:
        model = ViT(**arch, classes=classes, dtype=dtype)

        def loss(params, state, inputs, labels):
            return _xent(model.apply({"params": params}, inputs), labels), state

        return loss

    config = dict(batch=batch, size=size, classes=classes, **arch)
    return Model(
        "vit",
        f"Flax Linen ViT patch={patch} d={hidden} L={layers} h={heads} {size}x{size} B={batch}",
        make_loss,
        params,
        {},
        images,
        labels,
        3e-4,
        config,
    )


#: Sizes for ``--smoke``: the same code paths at toy shapes (CPU, seconds). One layer or
#: block per stage: XLA:CPU's compile time, which dominates, grows with the equation count.
SMOKE_SIZES: dict[str, dict[str, Any]] = {
    "gpt": dict(layers=1, d_model=32, heads=2, seq=16, vocab=128, batch=2),
    "resnet50": dict(batch=2, size=32, stages=(1, 1), width=4, classes=10),
    "vit": dict(batch=2, size=16, patch=8, hidden=32, layers=1, heads=2, mlp_dim=64, classes=10),
}

BUILDERS: dict[str, Callable[..., Model]] = {
    "gpt": gpt_model,
    "resnet50": resnet50_model,
    "vit": vit_model,
}
