"""The demo's models and training loop (needs flax: the ``demo`` extra)."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jmp_rewrite
from jmp_rewrite.demo.config import MODELS, DemoConfig, RunResult
from jmp_rewrite.demo.data import CLASS_NAMES

# --------------------------------------------------------------------------------------------
# Models.


class CNN(nnx.Module):
    """Two 3x3 conv + BatchNorm + ReLU + 2x2 max-pool blocks, then a 2-layer MLP head."""

    def __init__(self, size: int, num_classes: int, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, (3, 3), rngs=rngs)
        self.bn2 = nnx.BatchNorm(32, momentum=0.9, rngs=rngs)
        self.fc1 = nnx.Linear((size // 4) ** 2 * 32, 64, rngs=rngs)
        self.fc2 = nnx.Linear(64, num_classes, rngs=rngs)

    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = nnx.relu(self.bn1(self.conv1(x), use_running_average=not train))
        x = nnx.max_pool(x, (2, 2), (2, 2))
        x = nnx.relu(self.bn2(self.conv2(x), use_running_average=not train))
        x = nnx.max_pool(x, (2, 2), (2, 2))
        x = x.reshape(x.shape[0], -1)
        return self.fc2(nnx.relu(self.fc1(x)))


class MLP(nnx.Module):
    """Flatten, then Linear + BatchNorm + ReLU twice, then a linear classifier."""

    def __init__(self, size: int, num_classes: int, *, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(size * size, 256, rngs=rngs)
        self.bn1 = nnx.BatchNorm(256, momentum=0.9, rngs=rngs)
        self.fc2 = nnx.Linear(256, 128, rngs=rngs)
        self.bn2 = nnx.BatchNorm(128, momentum=0.9, rngs=rngs)
        self.fc3 = nnx.Linear(128, num_classes, rngs=rngs)

    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.bn1(self.fc1(x), use_running_average=not train))
        x = nnx.relu(self.bn2(self.fc2(x), use_running_average=not train))
        return self.fc3(x)


def make_model(name: str, size: int, seed: int) -> nnx.Module:
    """A model ``name`` (one of :data:`MODELS`) for ``size`` x ``size`` images.

    The parameters are drawn on the host with NumPy, from the distributions of nnx's
    defaults (LeCun-normal kernels, zero biases, unit BatchNorm scales and variances): on a
    CPU, compiling JAX's random initialisers shape by shape takes longer than the whole
    float32 training run of the demo.

    Args:
      name: ``"cnn"`` or ``"mlp"``.
      size: image height and width (a multiple of 4).
      seed: seed of the initialisation.

    Returns:
      The initialised ``nnx.Module``.

    Raises:
      ValueError: for an unknown model name.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
    cls = CNN if name == "cnn" else MLP
    abstract = nnx.eval_shape(lambda: cls(size, len(CLASS_NAMES), rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(seed)

    def init(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> jax.Array:
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        shape = leaf.shape
        if "kernel" in names:
            fan_in = math.prod(shape[:-1])
            value = rng.normal(0.0, 1.0 / math.sqrt(fan_in), shape)
        elif "scale" in names or "var" in names:
            value = np.ones(shape)
        else:  # biases, BatchNorm shifts and means
            value = np.zeros(shape)
        return jnp.asarray(value, leaf.dtype)

    state = jax.tree_util.tree_map_with_path(init, state)
    return nnx.merge(graphdef, state)


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def build_steps(
    graphdef: Any,
    tx: optax.GradientTransformation,
    *,
    loss_scaled: bool,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The (un-jitted, un-rewritten) train step and evaluation function of a model.

    ``train_step(params, batch_stats, opt_state, images, labels)`` returns
    ``(params, batch_stats, opt_state, metrics)`` where ``metrics`` holds the step's
    ``loss``, the loss ``scale`` it used and whether its update was ``applied``.
    ``evaluate(params, batch_stats, images, labels)`` returns ``(loss, accuracy)``.
    """

    def loss_fn(params: Any, batch_stats: Any, images: jax.Array, labels: jax.Array) -> Any:
        model = nnx.merge(graphdef, params, batch_stats, copy=True)
        logits = model(images, train=True)
        return _cross_entropy(logits, labels), nnx.state(model, nnx.BatchStat)

    def train_step(
        params: Any, batch_stats: Any, opt_state: Any, images: jax.Array, labels: jax.Array
    ) -> tuple[Any, Any, Any, dict[str, jax.Array]]:
        if loss_scaled:
            scale = jmp_rewrite.get_loss_scale(opt_state)
            grad_fn = jmp_rewrite.value_and_grad(loss_fn, has_aux=True)
            (loss, new_stats), grads = grad_fn(opt_state, params, batch_stats, images, labels)
        else:
            scale = jnp.float32(1.0)
            grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
            (loss, new_stats), grads = grad_fn(params, batch_stats, images, labels)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if loss_scaled:
            # BatchNorm statistics are updated outside the optimizer: a skipped step must not
            # advance them either.
            applied = jmp_rewrite.last_step_applied(opt_state)
            new_stats = jax.tree.map(
                lambda new, old: jnp.where(applied, new, old), new_stats, batch_stats
            )
        else:
            applied = jnp.array(True)
        metrics = {"loss": loss, "scale": scale, "applied": applied}
        return params, new_stats, opt_state, metrics

    def evaluate(
        params: Any, batch_stats: Any, images: jax.Array, labels: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        model = nnx.merge(graphdef, params, batch_stats, copy=True)
        logits = model(images, train=False)
        accuracy = jnp.mean((jnp.argmax(logits, -1) == labels).astype(jnp.float32))
        return _cross_entropy(logits, labels), accuracy

    return train_step, evaluate


def _optimizer(config: DemoConfig) -> optax.GradientTransformation:
    schedule = optax.cosine_decay_schedule(config.lr, config.steps)
    return optax.adam(schedule)


def _batches(config: DemoConfig) -> np.ndarray:
    """Indices of the training images of every step: the same for both runs."""
    rng = np.random.default_rng(config.seed + 1)
    return rng.integers(0, config.train_size, (config.steps, config.batch_size))


def _eval_points(config: DemoConfig) -> set[int]:
    every = config.eval_every or max(1, config.steps // 8)
    return {s for s in range(every, config.steps + 1, every)} | {config.steps}


def train(
    config: DemoConfig,
    data: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    model: nnx.Module,
    *,
    mixed: bool,
    progress_file: TextIO | None = None,
) -> tuple[RunResult, Callable[..., Any], tuple[Any, ...]]:
    """Trains one run; returns its result, its un-rewritten train step and example arguments.

    Args:
      config: the demo configuration.
      data: ``(train_images, train_labels, test_images, test_labels)``.
      model: the initialised model (left untouched: both runs start from it).
      mixed: rewrite the train step (and evaluation) to ``config.dtype`` with the configured
        loss scaling; otherwise train in float32.
      progress_file: where the progress goes (default: stderr): a tqdm bar on a terminal,
        else (a log file, a pipe, CI) a plain line every tenth of the run.

    Returns:
      ``(result, train_step, example_args)``: ``train_step`` un-jitted and un-rewritten, so
      that :func:`jmp_rewrite.explain` can be run on it with ``example_args``.
    """
    from tqdm import tqdm

    x_train, y_train, x_test, y_test = data
    graphdef, params, batch_stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    scale_rule = config.loss_scale_rule() if mixed else None
    tx = _optimizer(config)
    if scale_rule is not None:
        tx = jmp_rewrite.loss_scale_optimizer(tx, scale_rule)
    opt_state = tx.init(params)
    train_step, evaluate = build_steps(graphdef, tx, loss_scaled=scale_rule is not None)
    if mixed:
        dtype = jnp.dtype(config.dtype)
        step_fn = jax.jit(jmp_rewrite.rewrite(train_step, dtype=dtype))
        eval_fn = jax.jit(jmp_rewrite.rewrite(evaluate, dtype=dtype))
        name = f"mixed {config.dtype}"
    else:
        step_fn, eval_fn = jax.jit(train_step), jax.jit(evaluate)
        name = "float32"
    example = (
        params,
        batch_stats,
        opt_state,
        x_train[: config.batch_size],
        y_train[: config.batch_size],
    )

    result = RunResult(name, [], [], [], [], [], [], None, 0.0, 0.0)
    eval_points = _eval_points(config)
    start = time.perf_counter()
    out = progress_file if progress_file is not None else sys.stderr
    terminal = bool(getattr(out, "isatty", lambda: False)())
    # A bar redraws itself many times a second: on a terminal only. A log gets plain lines.
    lines_every = max(1, config.steps // 10) if config.progress and not terminal else 0
    bar = tqdm(
        _batches(config),
        desc=f"{name:>14}",
        unit="step",
        disable=not (config.progress and terminal),
        file=out,
        dynamic_ncols=True,
        leave=True,
    )
    for step, idx in enumerate(bar, start=1):
        params, batch_stats, opt_state, metrics = step_fn(
            params, batch_stats, opt_state, x_train[idx], y_train[idx]
        )
        metrics = jax.device_get(metrics)
        if step == 1:
            result.compile_seconds = time.perf_counter() - start
        result.losses.append(float(metrics["loss"]))
        result.applied.append(bool(metrics["applied"]))
        if scale_rule is not None:
            result.scales.append(float(metrics["scale"]))
        if step in eval_points:
            test_loss, test_acc = jax.device_get(eval_fn(params, batch_stats, x_test, y_test))
            result.eval_steps.append(step)
            result.test_losses.append(float(test_loss))
            result.test_accuracies.append(float(test_acc))
        postfix = {"loss": f"{result.losses[-1]:.3f}"}
        if result.test_accuracies:
            postfix["test acc"] = f"{result.test_accuracies[-1]:.1%}"
        if scale_rule is not None:
            postfix["scale"] = f"{result.scales[-1]:g}"
            postfix["skipped"] = len(result.skipped_steps)
        bar.set_postfix(postfix, refresh=False)
        if lines_every and (step % lines_every == 0 or step == config.steps):
            shown = ", ".join(f"{k} {v}" for k, v in postfix.items())
            print(f"{name:>14}: step {step}/{config.steps}, {shown}", file=out, flush=True)
    bar.close()
    result.seconds = time.perf_counter() - start
    if scale_rule is not None:
        result.final_scale = float(jmp_rewrite.get_loss_scale(opt_state))
    return result, train_step, example
