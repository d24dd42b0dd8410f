"""Flax models written the way users write them, trained in several precisions (issue 8).

Shared by ``tests/test_user_models_numerics.py`` (few steps, thresholds) and
``benchmarks/numerics_vs_handwritten.py`` (the issue's step counts, a table). Every model is
built by a ``make(dtype)`` function: ``dtype=None`` is the float32 model, which is also what
:func:`jmp_rewrite.rewrite` gets; ``dtype=jnp.bfloat16`` / ``float16`` is the hand-written
mixed-precision model (Flax's ``dtype=`` with float32 parameters: half-precision compute,
float32 statistics and master weights).

A *run* is one of

* ``"float32"``: the float32 model, as written;
* ``"rewrite"``: the float32 model's train step through ``jmp_rewrite.rewrite(dtype=...)``
  (``lists=`` passed on);
* ``"hand"``: the hand-written half-precision model, not rewritten;
* ``"float32_perm"``: the float32 model with each batch's rows in another order. Every loss,
  gradient and batch statistic here is a mean over the batch, so this run computes the same
  function as ``"float32"``, only summed in another order: its distance from ``"float32"``
  is the float32 noise floor (float32 rounding, amplified by training as any rounding is).

Initialisation runs under one ``jax.jit`` with an ``rbg`` key (threefry takes seconds to
compile per shape on 2 CPU cores); data are drawn with NumPy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jmp_rewrite

RUNS = ("float32", "rewrite", "hand", "float32_perm")


def _init_key() -> jax.Array:
    return jax.random.key(0, impl="rbg")


def rel(a: Any, b: Any) -> float:
    """``||a - b|| / ||b||`` over all leaves of two pytrees of float arrays."""
    la = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(a)]
    lb = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(b)]
    da, db = np.concatenate(la), np.concatenate(lb)
    return float(np.linalg.norm(da - db) / np.linalg.norm(db))


def _check_run(run: str) -> None:
    if run not in RUNS:
        raise ValueError(f"run must be one of {RUNS}, got {run!r}")


def _permute(batch: tuple[np.ndarray, ...], seed: int) -> tuple[np.ndarray, ...]:
    perm = np.random.default_rng(seed).permutation(len(batch[0]))
    return tuple(a[perm] for a in batch)


def _compile_step(step: Callable[..., Any], run: str, dtype: Any, lists: Any) -> Callable:
    if run == "rewrite":
        step = jmp_rewrite.rewrite(step, dtype=dtype, lists=lists)
    return jax.jit(step)


# ------------------------------------------------------------------------------------------
# Flax NNX: remat, jit helpers, scan over layers, nnx.Optimizer
# ------------------------------------------------------------------------------------------


class Block(nnx.Module):
    def __init__(self, din: int, dout: int, *, dtype: Any, rngs: nnx.Rngs):
        self.linear = nnx.Linear(din, dout, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return nnx.gelu(self.linear(x))


@nnx.jit
def _features(body: nnx.Module, x: jax.Array) -> jax.Array:
    """A user's ``nnx.jit`` helper, called inside the train step (nnx.jit returns the
    module's state beside the result, to propagate updates)."""
    return body(x)


class NnxNet(nnx.Module):
    """16 -> 32 -> 32 -> 32 -> 4 MLP of :class:`Block` s; ``pattern`` is how the blocks run:

    * ``remat``: each block through ``nnx.remat`` (a ``jax.checkpoint`` whose outputs include
      the block's parameters);
    * ``jit``: the blocks through the ``nnx.jit`` helper :func:`_features`;
    * ``scan``: the blocks stacked with ``nnx.vmap`` and run with ``nnx.scan``.
    """

    def __init__(self, pattern: str, *, dtype: Any = None, rngs: nnx.Rngs):
        self.pattern = pattern
        self.inp = nnx.Linear(16, 32, dtype=dtype, rngs=rngs)
        if pattern == "scan":

            @nnx.split_rngs(splits=3)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stack(rngs: nnx.Rngs) -> Block:
                return Block(32, 32, dtype=dtype, rngs=rngs)

            self.body = stack(rngs)
        else:
            self.body = nnx.List([Block(32, 32, dtype=dtype, rngs=rngs) for _ in range(3)])
        self.head = nnx.Linear(32, 4, dtype=dtype, rngs=rngs)

    def run_body(self, h: jax.Array) -> jax.Array:
        if self.pattern == "scan":

            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def step(block: Block, h: jax.Array) -> jax.Array:
                return block(h)

            return step(self.body, h)
        if self.pattern == "jit":
            for block in self.body:
                h = _features(block, h)
            return h
        for block in self.body:
            h = nnx.remat(lambda b, h: b(h))(block, h)
        return h

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(self.run_body(nnx.gelu(self.inp(x))))


def nnx_batch(seed: int = 0, n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 16)).astype(np.float32)
    y = (np.argmax(x[:, :4] + 0.5 * rng.standard_normal((n, 4)), axis=1)).astype(np.int32)
    return x, y


@dataclasses.dataclass
class NnxTraining:
    """What :func:`train_nnx` returns (parameters as ``nnx.State`` of float32 arrays)."""

    init: Any
    final: Any
    losses: list[float]
    frozen: Any  # parameters after ``frozen_steps`` steps at learning rate 0 from ``init``


def _zero_learning_rate(state: Any) -> Any:
    def leaf(path: Any, v: Any) -> Any:
        return jnp.zeros_like(v) if "learning_rate" in jax.tree_util.keystr(path) else v

    return jax.tree_util.tree_map_with_path(leaf, state)


def train_nnx(
    pattern: str,
    run: str,
    *,
    dtype: Any = jnp.bfloat16,
    steps: int = 30,
    lr: float = 1e-3,
    lists: Any = None,
    frozen_steps: int = 0,
) -> NnxTraining:
    """Trains :class:`NnxNet` ``steps`` Adam steps (``nnx.Optimizer``) on one fixed batch.

    The train step is a user's: ``nnx.merge``, ``nnx.value_and_grad``, ``opt.update`` and
    the post-update accuracy on the batch (a forward pass outside the gradient, through the
    model's remat / jit helper / scan). The learning rate is an optimizer hyperparameter
    (``optax.inject_hyperparams``), so the same compiled step also runs ``frozen_steps``
    steps from the initial state with it set to 0: a step that must not move anything.
    """
    _check_run(run)
    model_dtype = dtype if run == "hand" else None
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=lr)

    def make():
        model = NnxNet(pattern, dtype=model_dtype, rngs=nnx.Rngs(_init_key()))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    graphdef = nnx.graphdef(nnx.eval_shape(make))
    state0 = jax.jit(lambda: nnx.state(make()))()

    def params_of(state):
        return nnx.state(nnx.merge(graphdef, state, copy=True)[0], nnx.Param)

    def train_step(state, x, y):
        model, opt = nnx.merge(graphdef, state, copy=True)

        def loss_fn(model):
            logits = model(x).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        # Post-update accuracy, outside the gradient: the body's remat / jit helper / scan
        # hands the module's state back, and NNX writes it into ``model``.
        accuracy = jnp.mean(jnp.argmax(model(x), axis=-1) == y)
        return nnx.state((model, opt)), loss, accuracy

    step = _compile_step(train_step, run, dtype, lists)
    x, y = nnx_batch()
    losses, state = [], state0
    for i in range(steps):
        xb, yb = _permute((x, y), i) if run == "float32_perm" else (x, y)
        state, loss, _ = step(state, xb, yb)
        losses.append(float(loss))
    frozen = _zero_learning_rate(state0)
    for _ in range(frozen_steps):
        frozen = step(frozen, x, y)[0]
    return NnxTraining(params_of(state0), params_of(state), losses, params_of(frozen))


def param_change_error(init: Any, final: Any, init_ref: Any, final_ref: Any) -> float:
    """``||dp - dp_ref|| / ||dp_ref||`` with ``dp = final - init`` over all parameters."""
    sub = lambda a, b: jax.tree.map(lambda u, v: np.asarray(u) - np.asarray(v), a, b)
    return rel(sub(final, init), sub(final_ref, init_ref))


# ------------------------------------------------------------------------------------------
# Batch norm: Linen and NNX, running statistics after N training steps
# ------------------------------------------------------------------------------------------


class LinenBNNet(nn.Module):
    """Dense -> BatchNorm -> relu -> Dense -> BatchNorm -> relu -> Dense (Flax defaults:
    momentum 0.99, ``force_float32_reductions``). No bias before a batch norm, as usual: its
    true gradient is zero, and Adam turns the rounding noise of a zero gradient into full
    ``lr`` steps, which the running mean would track (noise, in float32 too)."""

    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        for width in (32, 32):
            x = nn.Dense(width, use_bias=False, dtype=self.dtype)(x)
            x = nn.BatchNorm(use_running_average=not train, dtype=self.dtype)(x)
            x = nn.relu(x)
        return nn.Dense(4, dtype=self.dtype)(x)


class NnxBNNet(nnx.Module):
    """The same network in NNX (``nnx.BatchNorm``, momentum 0.99)."""

    def __init__(self, *, dtype: Any = None, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(16, 32, use_bias=False, dtype=dtype, rngs=rngs)
        self.bn1 = nnx.BatchNorm(32, dtype=dtype, rngs=rngs)
        self.l2 = nnx.Linear(32, 32, use_bias=False, dtype=dtype, rngs=rngs)
        self.bn2 = nnx.BatchNorm(32, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(32, 4, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.bn1(self.l1(x)))
        x = nnx.relu(self.bn2(self.l2(x)))
        return self.head(x)


def bn_batches(steps: int, seed: int = 1, n: int = 64) -> list[tuple[np.ndarray, np.ndarray]]:
    """A fresh batch per step: 16 features with scales 0.5..2 (so the first layer's running
    variances move away from their initial 1), labels from the first four features."""
    rng = np.random.default_rng(seed)
    scale = np.linspace(0.5, 2.0, 16, dtype=np.float32)
    out = []
    for _ in range(steps):
        x = (rng.standard_normal((n, 16)) * scale).astype(np.float32)
        y = np.argmax(x[:, :4] / scale[:4] + 0.5 * rng.standard_normal((n, 4)), 1)
        out.append((x, y.astype(np.int32)))
    return out


def _xent(logits: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def train_bn(
    framework: str,
    run: str,
    *,
    dtype: Any = jnp.bfloat16,
    steps: int = 100,
    lr: float = 1e-3,
    lists: Any = None,
) -> tuple[dict[str, np.ndarray], list[float]]:
    """Trains the Linen or NNX batch-norm net ``steps`` Adam steps on fresh batches.

    Returns:
      ``({"mean": ..., "var": ...}`` running statistics of both BatchNorm layers,
      concatenated, losses``)``.
    """
    _check_run(run)
    model_dtype = dtype if run == "hand" else None
    tx = optax.adam(lr)
    if framework == "linen":
        net = LinenBNNet(dtype=model_dtype)
        variables = jax.jit(lambda: net.init(_init_key(), jnp.zeros((2, 16)), train=False))()
        state = (variables["params"], variables["batch_stats"], tx.init(variables["params"]))

        def train_step(state, x, y):
            params, stats, opt_state = state

            def loss_fn(params):
                logits, new = net.apply(
                    {"params": params, "batch_stats": stats},
                    x,
                    train=True,
                    mutable=["batch_stats"],
                )
                return _xent(logits, y), new["batch_stats"]

            (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), stats, opt_state), loss

        def stats_of(state):
            return state[1]

    elif framework == "nnx":

        def make():
            model = NnxBNNet(dtype=model_dtype, rngs=nnx.Rngs(_init_key()))
            return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

        graphdef = nnx.graphdef(nnx.eval_shape(make))
        state = jax.jit(lambda: nnx.state(make()))()

        def train_step(state, x, y):
            model, opt = nnx.merge(graphdef, state, copy=True)
            loss, grads = nnx.value_and_grad(lambda m: _xent(m(x), y))(model)
            opt.update(model, grads)
            return nnx.state((model, opt)), loss

        def stats_of(state):
            model = nnx.merge(graphdef, state, copy=True)[0]
            return nnx.state(model, nnx.BatchStat)

    else:
        raise ValueError(f"framework must be 'linen' or 'nnx', got {framework!r}")

    step = _compile_step(train_step, run, dtype, lists)
    losses = []
    for i, batch in enumerate(bn_batches(steps)):
        x, y = _permute(batch, i) if run == "float32_perm" else batch
        state, loss = step(state, x, y)
        losses.append(float(loss))
    stats = stats_of(state)
    out = {}
    for name in ("mean", "var"):
        leaves = [
            np.asarray(v, np.float64)
            for path, v in jax.tree_util.tree_leaves_with_path(stats)
            if name in jax.tree_util.keystr(path)
        ]
        out[name] = np.concatenate(leaves)
    return out, losses


# ------------------------------------------------------------------------------------------
# Embedding model: the gradient row of a frequent token
# ------------------------------------------------------------------------------------------


class EmbedNet(nnx.Module):
    """``nnx.Embed`` -> ``nnx.Linear`` -> gelu -> ``nnx.Linear`` next-token logits.

    ``gather_float32``: look the table up in float32 and cast the rows to ``dtype`` after
    (hand-written alternative whose gradient scatter-adds in float32).
    """

    def __init__(
        self,
        vocab: int,
        width: int,
        *,
        dtype: Any = None,
        gather_float32: bool = False,
        rngs: nnx.Rngs,
    ):
        self.cast = dtype if gather_float32 else None
        self.embed = nnx.Embed(vocab, width, dtype=None if gather_float32 else dtype, rngs=rngs)
        self.hidden = nnx.Linear(width, width, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(width, vocab, dtype=dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        x = x if self.cast is None else x.astype(self.cast)
        return self.out(nnx.gelu(self.hidden(x)))


@dataclasses.dataclass(frozen=True)
class EmbeddingGrad:
    """The embedding gradient of one Zipf batch, and how often each token occurs in it."""

    grad: np.ndarray  # (vocab, width) float32
    counts: np.ndarray  # (vocab,)


def zipf_tokens(seed: int = 2, *, batch: int = 16, seq: int = 256, vocab: int = 256):
    """A batch of token ids with Zipf(1.1) frequencies (token 0 most frequent)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, vocab + 1) ** 1.1
    return rng.choice(vocab, size=(batch, seq + 1), p=p / p.sum()).astype(np.int32)


def embedding_grad(
    run: str, *, dtype: Any = jnp.bfloat16, lists: Any = None, gather_float32: bool = False
) -> EmbeddingGrad:
    """The gradient of the next-token loss w.r.t. the embedding table, for one Zipf batch
    (16 x 256 tokens, vocabulary 256: the most frequent token occurs 858 times)."""
    _check_run(run)
    vocab, width = 256, 32
    model_dtype = dtype if run == "hand" else None

    def make():
        return EmbedNet(
            vocab,
            width,
            dtype=model_dtype,
            gather_float32=gather_float32,
            rngs=nnx.Rngs(_init_key()),
        )

    graphdef = nnx.graphdef(nnx.eval_shape(make))
    params = jax.jit(lambda: nnx.state(make()))()
    tokens = zipf_tokens(vocab=vocab)
    if run == "float32_perm":
        tokens = _permute((tokens,), 0)[0]

    def grad_fn(params, tokens):
        def loss_fn(model):
            logits = model(tokens[:, :-1]).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        grads = nnx.grad(loss_fn)(nnx.merge(graphdef, params, copy=True))
        return jax.tree.leaves(nnx.state(grads, nnx.Param)["embed"])[0]

    grad = _compile_step(grad_fn, run, dtype, lists)(params, tokens)
    counts = np.bincount(np.asarray(tokens)[:, :-1].ravel(), minlength=vocab)
    return EmbeddingGrad(np.asarray(grad), counts)


def frequent_token_errors(g: EmbeddingGrad, ref: EmbeddingGrad, top: int = 1) -> list[float]:
    """Relative errors of the gradient rows of the ``top`` most frequent tokens."""
    order = np.argsort(-ref.counts)[:top]
    return [rel(g.grad[t], ref.grad[t]) for t in order]
