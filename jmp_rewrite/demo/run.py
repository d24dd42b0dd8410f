"""The whole demo: both runs, the explain report, the comparison and the files."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import TextIO

import jax
import jax.numpy as jnp
from flax import nnx

import jmp_rewrite
from jmp_rewrite.demo.config import DemoConfig, RunResult
from jmp_rewrite.demo.data import CLASS_NAMES, make_dataset
from jmp_rewrite.demo.report import (
    comparison_table,
    fmt_scale,
    half_primitives,
    machine,
    plot,
    scale_events,
    trajectory_text,
    write_html,
)
from jmp_rewrite.demo.training import make_model, train


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
            f"dynamic loss scaling from {fmt_scale(rule.initial_loss_scale)}, "
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
    say(f"measured {machine()}, jax {jax.__version__}, {config.steps} steps, seed {config.seed}")

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
