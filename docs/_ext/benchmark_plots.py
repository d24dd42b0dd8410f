"""The plots of the Benchmarks page (and the float8 guide), drawn from their own tables.

The tables in ``benchmarks.md`` and ``guides/float8.md`` are the data: each plot finds its
table by the text of the table's first header cell (and a column it needs), so a figure changed
in a table changes its plot on the next build, and a table that is renamed or reshaped fails
the build here instead of leaving a stale plot.

Run alone: ``python docs/_ext/benchmark_plots.py`` writes the SVGs into ``docs/_generated``.
"""

from __future__ import annotations

import os
import re
import textwrap

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt  # noqa: E402

PAGES = ("benchmarks.md", os.path.join("guides", "float8.md"))
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?", re.I)
COLOURS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3"]


def tables(text: str) -> list[list[list[str]]]:
    """Every Markdown table of ``text``: its header row, then its body rows."""
    found, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("|") and i + 1 < len(lines) and set(lines[i + 1].strip()) <= set("|-: "):
            rows = []
            while i < len(lines) and lines[i].strip().startswith("|"):
                if not set(lines[i].strip()) <= set("|-: "):
                    rows.append([c.strip() for c in re.split(r"(?<!\\)\|", lines[i].strip())[1:-1]])
                i += 1
            found.append(rows)
            continue
        i += 1
    return found


def table(found: list, first_cell: str, column: str | None = None) -> list[list[str]]:
    """The one table whose first header cell is ``first_cell`` (and with ``column``)."""
    matches = [t for t in found if t[0][0] == first_cell and (column is None or column in t[0])]
    if len(matches) != 1:
        raise KeyError(
            f"{', '.join(PAGES)}: {len(matches)} tables whose first header cell is {first_cell!r}"
            + (f" with a column {column!r}" if column else "")
            + "; the plot expects one"
        )
    return matches[0]


def numbers(cell: str) -> list[float]:
    """The numbers of a cell (``108.8 / 110.4`` -> both; ``41.38 -> 39.13`` -> both), code
    spans and remarks in parentheses left out (``7.9% (`nnx.Embed(dtype=bf16)`)`` -> 7.9)."""
    cell = re.sub(r"`[^`]*`", "", cell.replace(",", ""))
    cell = re.sub(r"\([^()]*\)", "", re.sub(r"\([^()]*\)", "", cell))
    return [float(n) for n in _NUMBER.findall(cell)]


def first(cell: str) -> float | None:
    found = numbers(cell)
    return found[0] if found and cell.strip() not in ("-", "") else None


def _save(fig, out: str, name: str) -> None:
    fig.tight_layout()
    fig.savefig(os.path.join(out, name), metadata={"Date": None})
    plt.close(fig)


def _bars(ax, groups: list[str], series: dict[str, list[float | None]]) -> None:
    width = 0.8 / len(series)
    for k, (label, values) in enumerate(series.items()):
        xs = [g + (k - (len(series) - 1) / 2) * width for g in range(len(groups))]
        kept = [(x, v) for x, v in zip(xs, values) if v is not None]
        ax.bar(
            [x for x, _ in kept],
            [v for _, v in kept],
            width,
            label=label,
            color=COLOURS[k % len(COLOURS)],
        )
    ax.set_xticks(range(len(groups)), groups)
    ax.grid(axis="y", alpha=0.3)


def gpu_speedup(found, out) -> None:
    rows = table(found, "model", "f32 TF32")  # the GPU speed-up table (ms per step)
    header, body = rows[0], rows[1:]
    wanted = [c for c in header[2:] if "speed" not in c]
    series = {
        c.replace("`", ""): [
            (first(r[1]) / first(r[header.index(c)])) if first(r[header.index(c)]) else None
            for r in body
        ]
        for c in wanted
    }
    fig, ax = plt.subplots(figsize=(9, 3.8))
    _bars(ax, [r[0] for r in body], series)
    ax.set_ylabel("speed-up over float32 (x)")
    ax.set_title("Train step speed on an H200 (higher is better; the first run where two)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _save(fig, out, "bench_gpu_speedup.svg")


def gpu_memory(found, out) -> None:
    rows = table(found, "model", "hand bf16")  # the GPU memory table (GiB)
    header, body = rows[0], rows[1:]
    ratios = [i for i, c in enumerate(header) if c == "rw/hand"]
    names = ["bf16", "f16", "f16 + loss scale"]
    series: dict[str, list[float | None]] = {}
    for name, i in zip(names, ratios):
        series[f"{name}, before"] = [numbers(r[i])[0] for r in body]
        series[f"{name}, after"] = [numbers(r[i])[-1] for r in body]
    fig, ax = plt.subplots(figsize=(9, 3.6))
    _bars(ax, [r[0] for r in body], series)
    ax.axhline(1.0, color="#333", lw=1, ls="--")
    ax.set_ylim(0.9, max(max(v for v in s if v) for s in series.values()) + 0.05)
    ax.set_ylabel("rewrite / hand-written memory")
    ax.set_title(
        "GPU memory of the rewritten step against hand-written, before and after "
        "the memory fixes (H200 compile)",
        fontsize=10,
    )
    ax.legend(fontsize=8, ncol=3)
    _save(fig, out, "bench_gpu_memory.svg")


def rewrite_overhead(found, out) -> None:
    rows = table(found, "train step (equations), CPU seconds")
    header, body = rows[0], rows[1:]
    wanted = ["trace", "graph + paint", "emit", "compile (rewritten)"]
    series = {c: [first(r[header.index(c)]) for r in body] for c in wanted}
    fig, ax = plt.subplots(figsize=(9, 3.4))
    _bars(ax, [re.sub(r",.*\(", " (", r[0]) for r in body], series)
    ax.set_ylabel("CPU seconds")
    ax.set_title("Rewrite of a whole train step beside XLA's compilation (2-core CPU)")
    ax.legend(fontsize=8)
    _save(fig, out, "bench_rewrite_overhead.svg")


def loss_scale_overhead(found, out) -> None:
    rows = table(found, "update + apply")
    header, body = rows[0], rows[1:]
    series = {c: [first(r[i]) for r in body] for i, c in enumerate(header) if i}
    fig, ax = plt.subplots(figsize=(9, 3.4))
    _bars(ax, [r[0].replace("`", "").replace("(", "\n(", 1) for r in body], series)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_ylabel("bytes accessed / plain adam")
    ax.set_title("Loss-scale overhead of update + apply (XLA cost model)")
    ax.legend(fontsize=8)
    _save(fig, out, "bench_loss_scale_overhead.svg")


def fp8_convergence(found, out) -> None:
    rows = table(found, "loss (bf16 drop)")
    header, body = rows[0], rows[1:]
    milestones = [m[1] + "%" for c in header[1:] if (m := re.search(r"\((\d+)%\)", c))]
    steps = {r[0].replace("`", ""): [first(c) for c in r[1 : 1 + len(milestones)]] for r in body}
    if "bfloat16" not in steps:
        raise KeyError("the float8 convergence table lost its bfloat16 row")
    reference = steps["bfloat16"]
    series = {
        name: [100 * (s - b) / b for s, b in zip(values, reference)]
        for name, values in steps.items()
        if name != "bfloat16"
    }
    fig, ax = plt.subplots(figsize=(9, 3.4))
    _bars(ax, milestones, series)
    ax.axhspan(-5, 5, color="#55a868", alpha=0.08, label="within 5% (the target)")
    ax.axhline(0, color="#333", lw=1)
    ax.set_ylim(-6, 6)
    ax.set_xlabel("milestone: share of bfloat16's loss drop over 200 steps")
    ax.set_ylabel("steps to reach it vs bf16 (%)")
    ax.set_title("Float8 convergence: steps to each milestone, relative to bfloat16 (GPT)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _save(fig, out, "bench_fp8_convergence.svg")


def numerics(found, out) -> None:
    rows = table(found, "what")
    header, body = rows[0], rows[1:]
    fig, ax = plt.subplots(figsize=(9, 6.4))
    labels, y, shown = [], 0, set()
    for r in reversed(body):
        pairs = max(len(numbers(c)) for c in r[1:] if c.strip() not in ("", "-"))
        for j in range(pairs):
            label = r[0].replace("`", "").replace("\\|", "|")
            if pairs == 2:
                label = re.sub(r",?\s*\(?f16 / bf16\)?", "", label) + (" (f16)", " (bf16)")[j]
            for k, c in enumerate(r[1:]):
                got = numbers(c)
                if len(got) == pairs and got[j] > 0:
                    ax.scatter(
                        got[j],
                        y,
                        color=COLOURS[k],
                        s=28,
                        zorder=3,
                        label=None if k in shown else header[k + 1],
                    )
                    shown.add(k)
            labels.append(textwrap.fill(label, 60))
            y += 1
    ax.set_xscale("log")
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_xlabel("error against float32 (each row in its own unit; log scale)")
    ax.set_title(
        "Numerics: the rewrite before and after the fixes, against hand-written half", fontsize=9
    )
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _save(fig, out, "bench_numerics.svg")


def main(docs: str, out: str) -> None:
    plt.rcParams.update({"svg.hashsalt": "jmp_rewrite", "font.size": 9})
    found = []
    for page in PAGES:
        with open(os.path.join(docs, page), encoding="utf-8") as f:
            found += tables(f.read())
    for plot in (
        gpu_speedup,
        gpu_memory,
        rewrite_overhead,
        loss_scale_overhead,
        fp8_convergence,
        numerics,
    ):
        plot(found, out)


if __name__ == "__main__":
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.makedirs(os.path.join(here, "_generated"), exist_ok=True)
    main(here, os.path.join(here, "_generated"))
