"""The demo's text report, plot and HTML page."""

from __future__ import annotations

import datetime
import html
import math
import os
import platform
from collections.abc import Sequence

import numpy as np

import jmp_rewrite
from jmp_rewrite.demo.config import RunResult


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


def fmt_scale(value: float) -> str:
    exponent = math.log2(value) if value > 0 else float("nan")
    if exponent == int(exponent):
        return f"2^{int(exponent)}"
    return f"{value:g}"


def machine() -> str:
    """Today's date and this machine, for figures quoted elsewhere: ``2026-11-26, Intel(R)
    Xeon(R) ... (2 CPUs), Linux, Python 3.11.7``."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"{datetime.date.today().isoformat()}, {cpu} ({os.cpu_count()} CPUs), "
        f"{platform.system()}, Python {platform.python_version()}"
    )


def trajectory_text(result: RunResult, limit: int = 14) -> str:
    """A one-paragraph description of the loss-scale trajectory of ``result``."""
    events = scale_events(result)
    if not events:
        return "no loss scaling"
    parts = []
    for step, scale, why in events:
        parts.append(f"{fmt_scale(scale)}" + ("" if why == "initial" else f" @{step} ({why})"))
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
            fmt_scale(mixed.final_scale) if mixed.final_scale is not None else "-",
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
        scale_title = "dynamic loss scale"
        if mixed.skipped_steps:
            sk = np.asarray(mixed.skipped_steps)
            ax.plot(sk + 1, np.asarray(mixed.scales)[sk], "rx")
            # In the title, not a legend box: a legend sat on the trace.
            scale_title += f" (x: {len(sk)} skipped steps)"
        ax.set(xlabel="step", ylabel="loss scale", title=scale_title, yscale="log")
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
