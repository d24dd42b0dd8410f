"""The demo's options and the record of one training run (no flax needed to import them)."""

from __future__ import annotations

import dataclasses
import importlib
import math
import os

import numpy as np

import jmp_rewrite

#: The models the demo can train.
MODELS: tuple[str, ...] = ("cnn", "mlp")
#: Half-precision dtypes the demo can rewrite to.
DTYPES: tuple[str, ...] = ("float16", "bfloat16")
#: What the demo needs beyond jmp_rewrite's own dependencies (the ``demo`` extra).
DEPENDENCIES: tuple[str, ...] = ("flax", "matplotlib", "tqdm")


def check_dependencies() -> None:
    """Raises ImportError, naming ``pip install 'jmp_rewrite[demo]'``, if one is missing.

    Raises:
      ImportError: if flax, matplotlib or tqdm cannot be imported.
    """
    missing = []
    for name in DEPENDENCIES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ImportError(
            f"the jmp_rewrite demo needs {', '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed; install the demo's "
            "dependencies with: pip install 'jmp_rewrite[demo]'"
        )


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
