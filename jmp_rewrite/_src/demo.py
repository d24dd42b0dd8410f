"""The demo behind ``make demo`` / ``python -m jmp_rewrite demo``.

It trains one small but real model twice on the same data, in the same order, from the same
initialisation: once in float32 and once with the whole jitted train step rewritten to mixed
precision by :func:`jmp_rewrite.rewrite` (float16 with dynamic loss scaling by default; on a
CPU the rewrite is forced, since TF would only pick float16 on a GPU). It then prints what the
rewrite did (:func:`jmp_rewrite.explain` of the train step), the final figures side by side,
the skipped steps and the loss-scale trajectory, and writes a plot, the HTML explain report and
the metrics as JSON to the output directory.

The data set is generated procedurally, so nothing is downloaded: ten classes of noisy
grey-scale shapes and textures (:data:`CLASS_NAMES`) with random position, size, rotation,
contrast and brightness. It is genuinely learnable but not trivial: at 16x16 pixels with
noise, a disk and a filled square, or a ring and a frame, take a convolutional network a few
hundred steps to tell apart.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jmp_rewrite

#: The ten classes of the synthetic data set, in label order.
CLASS_NAMES: tuple[str, ...] = (
    "disk",
    "ring",
    "square",
    "frame",
    "plus",
    "cross",
    "h-stripes",
    "v-stripes",
    "triangle",
    "checkers",
)
#: The models the demo can train.
MODELS: tuple[str, ...] = ("cnn", "mlp")
#: Half-precision dtypes the demo can rewrite to.
DTYPES: tuple[str, ...] = ("float16", "bfloat16")


# --------------------------------------------------------------------------------------------
# Data.


def make_dataset(
    n: int, *, size: int = 16, seed: int = 0, noise: float = 0.2
) -> tuple[np.ndarray, np.ndarray]:
    """Generates ``n`` labelled images of the ten synthetic classes.

    Each image holds one shape or texture of class ``label`` (see :data:`CLASS_NAMES`) at a
    random position, size, rotation (+-17 degrees), stripe frequency and phase, contrast and
    brightness, plus Gaussian pixel noise.

    Args:
      n: number of images.
      size: height and width in pixels.
      seed: seed of the NumPy generator; the same seed gives the same images.
      noise: standard deviation of the pixel noise (the shapes have contrast 0.5 to 1).

    Returns:
      ``(images, labels)``: float32 ``[n, size, size, 1]`` and int32 ``[n]``.

    Example:
      >>> images, labels = make_dataset(8, seed=0)
      >>> images.shape, images.dtype, labels.dtype
      ((8, 16, 16, 1), dtype('float32'), dtype('int32'))
    """
    if n < 1 or size < 4:
        raise ValueError(f"need n >= 1 and size >= 4; got n={n}, size={size}")
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(CLASS_NAMES), n)
    grid = np.linspace(-1.0, 1.0, size, dtype=np.float32)
    yy, xx = np.meshgrid(grid, grid, indexing="ij")

    def draw(lo: float, hi: float) -> np.ndarray:
        return rng.uniform(lo, hi, (n, 1, 1)).astype(np.float32)

    cx, cy, radius, angle = draw(-0.35, 0.35), draw(-0.35, 0.35), draw(0.35, 0.6), draw(-0.3, 0.3)
    freq, phase = draw(2.5, 4.0) * np.pi, draw(0.0, 2.0 * np.pi)
    contrast, brightness = draw(0.5, 1.0), draw(-0.3, 0.3)
    width = 0.12  # stroke width of rings, frames, plus and cross
    images = np.zeros((n, size, size), np.float32)
    for label in range(len(CLASS_NAMES)):
        s = np.flatnonzero(labels == label)
        dx, dy = xx - cx[s], yy - cy[s]
        cos, sin = np.cos(angle[s]), np.sin(angle[s])
        u, v = cos * dx + sin * dy, cos * dy - sin * dx
        r, f, p = radius[s], freq[s], phase[s]
        name = CLASS_NAMES[label]
        if name == "disk":
            mask = np.hypot(u, v) < r
        elif name == "ring":
            mask = np.abs(np.hypot(u, v) - r) < width
        elif name == "square":
            mask = np.maximum(np.abs(u), np.abs(v)) < 0.85 * r
        elif name == "frame":
            mask = np.abs(np.maximum(np.abs(u), np.abs(v)) - 0.85 * r) < width
        elif name in ("plus", "cross"):
            if name == "cross":
                u, v = (u + v) / np.sqrt(2.0), (u - v) / np.sqrt(2.0)
            au, av = np.abs(u), np.abs(v)
            mask = ((au < width) & (av < r)) | ((av < width) & (au < r))
        elif name == "h-stripes":
            mask = np.sin(f * v + p) > 0
        elif name == "v-stripes":
            mask = np.sin(f * u + p) > 0
        elif name == "triangle":
            mask = (v < 0.6 * r) & (v > -r) & (np.abs(u) < 0.6 * (v + r))
        else:  # checkers
            mask = np.sin(0.8 * f * u + p) * np.sin(0.8 * f * v + p) > 0
        images[s] = mask
    images = images * contrast + brightness
    images += rng.normal(0.0, noise, images.shape).astype(np.float32)
    return images[..., None], labels.astype(np.int32)


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


# --------------------------------------------------------------------------------------------
# Training.


@dataclasses.dataclass
class DemoConfig:
    """Options of the demo (the command line's, with the same defaults).

    Attributes:
      model: ``"cnn"`` or ``"mlp"``.
      dtype: ``"float16"`` or ``"bfloat16"``: the half precision of the mixed run.
      steps: optimizer steps per run.
      batch_size: images per step.
      lr: peak learning rate of Adam (cosine decay to 0 over ``steps``).
      seed: seed of the data, the initialisation and the batch order.
      out: output directory.
      train_size: training images.
      test_size: held-out test images.
      image_size: image height and width.
      loss_scale: ``"dynamic"``, ``"none"`` or a number (a fixed scale); None: dynamic for
        float16, none for bfloat16 (it has float32's exponent range).
      initial_scale: initial dynamic loss scale.
      increment_period: finite steps before the dynamic scale doubles (TF's default, 2000,
        is longer than the whole demo).
      eval_every: steps between test-set evaluations (0: about 8 per run).
      progress: show tqdm progress bars.
    """

    model: str = "cnn"
    dtype: str = "float16"
    steps: int = 400
    batch_size: int = 128
    lr: float = 3e-3
    seed: int = 0
    out: str = os.path.join("runs", "demo")
    train_size: int = 12000
    test_size: int = 2000
    image_size: int = 16
    loss_scale: str | None = None
    initial_scale: float = 2.0**15
    increment_period: int = 50
    eval_every: int = 0
    progress: bool = True

    def validate(self) -> None:
        """Raises ValueError with a readable message for an inconsistent configuration."""
        if self.model not in MODELS:
            raise ValueError(f"--model must be one of {', '.join(MODELS)}; got {self.model!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        for name in ("steps", "batch_size", "train_size", "test_size", "increment_period"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.image_size < 4 or self.image_size % 4:
            raise ValueError(f"--image-size must be a multiple of 4, >= 4; got {self.image_size}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0; got {self.lr}")
        if self.eval_every < 0:
            raise ValueError("--eval-every must be >= 0")
        if not (math.isfinite(self.initial_scale) and self.initial_scale >= 1):
            raise ValueError(
                f"--initial-scale must be a finite number >= 1; got {self.initial_scale}"
            )
        self.loss_scale_rule()

    def loss_scale_rule(self) -> jmp_rewrite.DynamicLossScale | float | None:
        """The loss scale of the mixed run: a dynamic rule, a fixed number, or None (none)."""
        choice = self.loss_scale
        if choice is None:
            choice = "dynamic" if self.dtype == "float16" else "none"
        if choice == "none":
            return None
        if choice == "dynamic":
            return jmp_rewrite.DynamicLossScale(
                initial_loss_scale=self.initial_scale, increment_period=self.increment_period
            )
        try:
            value = float(choice)
        except ValueError:
            raise ValueError(
                f"--loss-scale must be 'dynamic', 'none' or a positive number; got {choice!r}"
            ) from None
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"--loss-scale must be a positive finite number; got {choice!r}")
        return value


@dataclasses.dataclass
class RunResult:
    """What one training run produced.

    Attributes:
      name: ``"float32"`` or ``"mixed float16"`` (or bfloat16).
      losses: training loss of every step (as computed by the step itself).
      scales: loss scale in force at every step (empty without loss scaling).
      applied: whether each step's update was applied (all True without loss scaling).
      eval_steps: steps after which the test set was evaluated.
      test_losses: test loss at those steps.
      test_accuracies: test accuracy at those steps.
      final_scale: loss scale after the last step (None without loss scaling).
      compile_seconds: wall time of the first step (tracing, rewriting, compiling).
      seconds: wall time of the whole run, evaluation included.
    """

    name: str
    losses: list[float]
    scales: list[float]
    applied: list[bool]
    eval_steps: list[int]
    test_losses: list[float]
    test_accuracies: list[float]
    final_scale: float | None
    compile_seconds: float
    seconds: float

    @property
    def skipped_steps(self) -> list[int]:
        """Indices of the steps skipped for non-finite gradients."""
        return [i for i, ok in enumerate(self.applied) if not ok]

    def final_train_loss(self, window: int = 20) -> float:
        """Mean training loss over the last ``window`` steps."""
        tail = self.losses[-window:]
        return float(np.mean(tail))

    @property
    def steps_per_second(self) -> float:
        """Training throughput after the first (compiling) step."""
        steady = self.seconds - self.compile_seconds
        return (len(self.losses) - 1) / steady if steady > 0 and len(self.losses) > 1 else 0.0


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
      progress_file: where tqdm writes (default: stderr).

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
    bar = tqdm(
        _batches(config),
        desc=f"{name:>14}",
        unit="step",
        disable=not config.progress,
        file=progress_file if progress_file is not None else sys.stderr,
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
    bar.close()
    result.seconds = time.perf_counter() - start
    if scale_rule is not None:
        result.final_scale = float(jmp_rewrite.get_loss_scale(opt_state))
    return result, train_step, example


# --------------------------------------------------------------------------------------------
# Reporting.


def scale_events(result: RunResult) -> list[tuple[int, float, str]]:
    """The loss-scale trajectory as change points: ``(step, scale, why)``, 1-based steps.

    The first entry is the initial scale; then one entry per step at which the scale in force
    changed, with ``why`` ``"overflow"`` (the previous step was skipped) or ``"growth"``.
    """
    if not result.scales:
        return []
    events = [(1, result.scales[0], "initial")]
    for i in range(1, len(result.scales)):
        if result.scales[i] != result.scales[i - 1]:
            why = "overflow" if not result.applied[i - 1] else "growth"
            events.append((i + 1, result.scales[i], why))
    return events


def _fmt_scale(value: float) -> str:
    exponent = math.log2(value) if value > 0 else float("nan")
    if exponent == int(exponent):
        return f"2^{int(exponent)}"
    return f"{value:g}"


def trajectory_text(result: RunResult, limit: int = 14) -> str:
    """A one-paragraph description of the loss-scale trajectory of ``result``."""
    events = scale_events(result)
    if not events:
        return "no loss scaling"
    parts = []
    for step, scale, why in events:
        parts.append(f"{_fmt_scale(scale)}" + ("" if why == "initial" else f" @{step} ({why})"))
    if len(parts) > limit:
        parts = parts[: limit // 2] + [f"... {len(parts) - limit} more ..."] + parts[-limit // 2 :]
    return " -> ".join(parts)


def comparison_table(f32: RunResult, mixed: RunResult) -> str:
    """The final figures of both runs side by side, as aligned text."""

    def pct(x: float) -> str:
        return f"{100 * x:.1f}%"

    skipped = mixed.skipped_steps
    rows = [
        ("", f32.name, mixed.name),
        (
            "train loss (last 20 steps)",
            f"{f32.final_train_loss():.4f}",
            f"{mixed.final_train_loss():.4f}",
        ),
        ("test loss", f"{f32.test_losses[-1]:.4f}", f"{mixed.test_losses[-1]:.4f}"),
        ("test accuracy", pct(f32.test_accuracies[-1]), pct(mixed.test_accuracies[-1])),
        ("skipped steps", "-", str(len(skipped)) if mixed.scales else "- (no loss scaling)"),
        (
            "final loss scale",
            "-",
            _fmt_scale(mixed.final_scale) if mixed.final_scale is not None else "-",
        ),
        (
            "first step (trace+compile)",
            f"{f32.compile_seconds:.1f} s",
            f"{mixed.compile_seconds:.1f} s",
        ),
        ("steps/s after compile", f"{f32.steps_per_second:.1f}", f"{mixed.steps_per_second:.1f}"),
        ("wall time", f"{f32.seconds:.1f} s", f"{mixed.seconds:.1f} s"),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [
        f"{r[0].ljust(widths[0])}  {r[1].rjust(widths[1])}  {r[2].rjust(widths[2])}" for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _ema(values: Sequence[float], decay: float = 0.9) -> np.ndarray:
    out, acc = [], values[0] if len(values) else 0.0
    for v in values:
        acc = decay * acc + (1 - decay) * v
        out.append(acc)
    return np.asarray(out)


def plot(f32: RunResult, mixed: RunResult, path: str, title: str) -> None:
    """Writes the loss curves, test accuracy and loss-scale trajectory to ``path`` (PNG).

    Uses matplotlib's Agg canvas directly, so no GUI backend or global pyplot state is
    touched.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    has_scale = bool(mixed.scales)
    fig = Figure(figsize=(11, 4.2 if has_scale else 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3 if has_scale else 2)
    steps = np.arange(1, len(f32.losses) + 1)
    ax = axes[0]
    for run, colour in ((f32, "tab:blue"), (mixed, "tab:orange")):
        ax.plot(steps, run.losses, color=colour, alpha=0.2, linewidth=0.8)
        ax.plot(steps, _ema(run.losses), color=colour, label=run.name)
    if mixed.skipped_steps:
        sk = np.asarray(mixed.skipped_steps)
        ax.plot(sk + 1, np.asarray(mixed.losses)[sk], "rx", label="skipped step")
    ax.set(xlabel="step", ylabel="training loss", title="training loss", yscale="log")
    ax.legend()
    ax = axes[1]
    for run, colour in ((f32, "tab:blue"), (mixed, "tab:orange")):
        ax.plot(
            run.eval_steps,
            100 * np.asarray(run.test_accuracies),
            "o-",
            color=colour,
            label=f"{run.name}: {100 * run.test_accuracies[-1]:.1f}%",
        )
    ax.set(xlabel="step", ylabel="test accuracy (%)", title="test accuracy")
    ax.legend(loc="lower right")
    if has_scale:
        ax = axes[2]
        ax.step(steps, mixed.scales, where="post", color="tab:orange")
        if mixed.skipped_steps:
            sk = np.asarray(mixed.skipped_steps)
            ax.plot(sk + 1, np.asarray(mixed.scales)[sk], "rx", label=f"{len(sk)} skipped steps")
            ax.legend(loc="lower right")
        ax.set(xlabel="step", ylabel="loss scale", title="dynamic loss scale", yscale="log")
        ax.set_yscale("log", base=2)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)


def write_html(
    report: jmp_rewrite.Report, path: str, title: str, table: str, plot_name: str | None
) -> None:
    """Writes a stand-alone HTML page: the run's figures, the plot and the explain report."""
    image = (
        f'<p><img src="{html.escape(plot_name)}" style="max-width:100%"></p>' if plot_name else ""
    )
    page = (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title></head>"
        "<body style='font-family:sans-serif'>"
        f"<h1>{html.escape(title)}</h1>"
        f"<pre>{html.escape(table)}</pre>{image}"
        "<h2>What the rewrite did to the train step (jmp_rewrite.explain)</h2>"
        f"{report._repr_html_()}</body></html>\n"
    )
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)


def half_primitives(report: jmp_rewrite.Report, limit: int = 8) -> str:
    """``conv_general_dilated x5, dot_general x6, reshape x7, ...``: what runs in half.

    Convolutions and matmuls first, then the other primitives by count (at most ``limit``
    entries in all).
    """
    counts = [
        (p, c["half"])
        for p, c in report.per_primitive().items()
        if c["half"] and not p.startswith("<")
    ]
    counts.sort(key=lambda pc: (pc[0] not in ("conv_general_dilated", "dot_general"), -pc[1]))
    text = ", ".join(f"{p} x{n}" for p, n in counts[:limit])
    if len(counts) > limit:
        text += f", and {len(counts) - limit} more kinds"
    return text or "none"


# --------------------------------------------------------------------------------------------
# The demo.


@dataclasses.dataclass
class DemoResult:
    """Both runs, the explain report of the mixed train step and the files written."""

    float32: RunResult
    mixed: RunResult
    report: jmp_rewrite.Report
    files: dict[str, str]


def run_demo(config: DemoConfig, stream: TextIO | None = None) -> DemoResult:
    """Runs the whole demo, printing to ``stream`` (default: stdout).

    Args:
      config: the demo configuration (validated here).
      stream: where the text output goes; progress bars go to stderr.

    Returns:
      A :class:`DemoResult`.

    Raises:
      ValueError: for an invalid configuration.
    """
    config.validate()
    out = stream if stream is not None else sys.stdout

    def say(text: str = "") -> None:
        print(text, file=out, flush=True)

    total_start = time.perf_counter()
    x_train, y_train = make_dataset(config.train_size, size=config.image_size, seed=config.seed)
    x_test, y_test = make_dataset(
        config.test_size, size=config.image_size, seed=config.seed + 10_000
    )
    data = (x_train, y_train, x_test, y_test)
    rule = config.loss_scale_rule()
    if isinstance(rule, jmp_rewrite.DynamicLossScale):
        scaling = (
            f"dynamic loss scaling from {_fmt_scale(rule.initial_loss_scale)}, "
            f"x2 every {rule.increment_period} finite steps"
        )
    elif rule is None:
        scaling = "no loss scaling"
    else:
        scaling = f"fixed loss scale {rule:g}"
    say(
        f"jmp_rewrite {jmp_rewrite.__version__} demo on {jax.devices()[0].platform.upper()} "
        f"(jax {jax.__version__})"
    )
    say(
        f"data: {config.train_size} training / {config.test_size} test images, "
        f"{config.image_size}x{config.image_size}, {len(CLASS_NAMES)} synthetic classes "
        f"({', '.join(CLASS_NAMES)})"
    )
    model = make_model(config.model, config.image_size, config.seed)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    summary = type(model).__doc__.splitlines()[0].rstrip(".")
    say(f"model: {config.model} ({summary}), {n_params:,} parameters")
    say(
        f"training {config.steps} steps of {config.batch_size}, Adam {config.lr:g} with cosine "
        f"decay, twice: float32, then the jitted train step rewritten to {config.dtype} "
        f"({scaling})"
    )
    if jax.devices()[0].platform == "cpu":
        say(
            "(on CPU the rewrite is forced with dtype=jnp."
            + config.dtype
            + "; half precision is emulated here, so expect it to be slower, not faster)"
        )
    say()
    f32, _, _ = train(config, data, model, mixed=False)
    mixed, step, example = train(config, data, model, mixed=True)

    report = jmp_rewrite.explain(step, *example, dtype=jnp.dtype(config.dtype))
    say()
    say(f"what the rewrite did to the train step (jmp_rewrite.explain, {config.dtype}):")
    for line in report.summary().splitlines():
        say(f"  {line}")
    say(f"  in half precision: {half_primitives(report)}")
    say()
    table = comparison_table(f32, mixed)
    say(table)
    say()
    if mixed.scales:
        skipped = mixed.skipped_steps
        listed = ", ".join(str(s + 1) for s in skipped[:20]) + (" ..." if len(skipped) > 20 else "")
        say(f"skipped steps ({len(skipped)}): {listed or 'none'}")
        say(f"loss-scale trajectory: {trajectory_text(mixed)}")
    else:
        say("loss scaling off: no steps skipped")
    delta = 100 * (mixed.test_accuracies[-1] - f32.test_accuracies[-1])
    say(f"test accuracy, mixed - float32: {delta:+.1f} points")

    os.makedirs(config.out, exist_ok=True)
    title = f"jmp_rewrite demo: {config.model}, float32 vs mixed {config.dtype}"
    files = {
        "plot": os.path.join(config.out, "training.png"),
        "html": os.path.join(config.out, "explain.html"),
        "metrics": os.path.join(config.out, "metrics.json"),
    }
    plot(f32, mixed, files["plot"], title)
    write_html(report, files["html"], title, table, os.path.basename(files["plot"]))
    with open(files["metrics"], "w", encoding="utf-8") as f:
        json.dump(
            {
                "config": dataclasses.asdict(config),
                "runs": {r.name: dataclasses.asdict(r) for r in (f32, mixed)},
                "skipped_steps": [s + 1 for s in mixed.skipped_steps],
                "loss_scale_events": scale_events(mixed),
                "explain": report.to_dict()["totals"],
            },
            f,
            indent=1,
        )
    say()
    say(
        f"wrote {files['plot']}, {files['html']} and {files['metrics']} "
        f"(total {time.perf_counter() - total_start:.0f} s)"
    )
    return DemoResult(f32, mixed, report, files)
