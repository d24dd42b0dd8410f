"""The painting diagram of the guide "How painting works", drawn from a real painting.

The model is the one the guide shows: its first python block that defines ``model`` and
``args``, executed here as the tests execute it. :func:`jmp_rewrite.paint` gives every
equation's list, precision and deciding pass; :func:`jax.make_jaxpr` gives the edges between
them. The drawing is a layered graph in SVG (no Graphviz: nothing outside Python is needed).
The report of the explain guide's example (its block that assigns ``report``) is written as
HTML, for that guide to embed.

Run alone: ``python docs/_ext/painting_diagram.py`` writes into ``docs/_generated``.
"""

from __future__ import annotations

import contextlib
import html
import io
import os
import re
import sys

import jax
import jax.extend.core
import jax.numpy as jnp

import jmp_rewrite
from jmp_rewrite._src.explain import html as explain_html

GUIDE = os.path.join("guides", "how_it_works.md")
EXPLAIN_GUIDE = os.path.join("guides", "explain.md")
_BLOCK = re.compile(r"^```python\n(?P<code>.*?)^```", re.S | re.M)

#: The colours of ``explain(...).to_html()``'s legend (taken from it: the diagram and the
#: report agree by construction).
LIST_COLOURS, HALF_COLOUR = explain_html.LIST_COLOURS, explain_html.HALF_COLOUR
FLOAT32_COLOUR = "#555555"

#: The pass that decided, as the guide numbers them.
PASSES = {
    "add_allowlist_ops": "pass 1",
    "propagate_deny_forward_through_clear_and_infer": "pass 2",
    "add_clear_and_infer_to_allow_if_between_allow": "pass 3",
    "add_infer_to_allow_if_follow_allow": "pass 4",
    "propagate_allow_through_clear": "pass 5",
    "remove_allow_without_float32": "pass 6",
    "make_casts_allow_if_all_outputs_allow": "cast pass",
}

W, H, DX, DY, PAD, LEFT = 178, 42, 206, 64, 16, 48


def guide_example(docs: str, page: str, marker: str) -> dict:
    """Runs the first python block of ``page`` that contains ``marker``; its globals."""
    with open(os.path.join(docs, page), encoding="utf-8") as f:
        text = f.read()
    code = next(m["code"] for m in _BLOCK.finditer(text) if marker in m["code"])
    scope: dict = {"__name__": "docs_example"}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code, page, "exec"), scope)  # noqa: S102 - the page's own example
    return scope


def graph(model, args) -> tuple[list[dict], list[tuple[int, int]]]:
    """Nodes (inputs, equations with their painting, the output) and edges between them."""
    closed = jax.make_jaxpr(model)(*args)
    painting = jmp_rewrite.paint(model, *args, dtype=jnp.float16)
    eqns = closed.jaxpr.eqns
    if len(painting) != len(eqns) or any(
        e.primitive != q.primitive.name for e, q in zip(painting, eqns)
    ):
        raise RuntimeError("the guide's model must be a flat program (no jit, no loops)")
    leaves = jax.tree_util.tree_flatten_with_path(args)[0]
    names = {0: "params", 1: "x", 2: "y"}
    nodes, producer, edges = [], {}, []
    for var, (path, _) in zip(closed.jaxpr.invars, leaves):
        label = names.get(path[0].idx, "arg") + "".join(str(k) for k in path[1:])
        producer[var] = len(nodes)
        nodes.append({"kind": "input", "label": label})
    for eqn, paint in zip(eqns, painting):
        me = len(nodes)
        for v in eqn.invars:
            if not isinstance(v, jax.extend.core.Literal) and v in producer:
                edges.append((producer[v], me))
        for v in eqn.outvars:
            producer[v] = me
        nodes.append({"kind": "eqn", "paint": paint})
    for v in closed.jaxpr.outvars:
        edges.append((producer[v], len(nodes)))
        nodes.append({"kind": "output", "label": "loss (float32)"})
    return nodes, edges


def layout(nodes, edges) -> dict[int, tuple[float, float]]:
    """Layers by longest path; an input sits just above its first reader."""
    parents = {i: [a for a, b in edges if b == i] for i in range(len(nodes))}
    children = {i: [b for a, b in edges if a == i] for i in range(len(nodes))}
    depth: dict[int, int] = {}
    for i, n in enumerate(nodes):
        if n["kind"] != "input":
            depth[i] = 1 + max((depth.get(p, 0) for p in parents[i]), default=0)
    for i, n in enumerate(nodes):
        if n["kind"] == "input":
            depth[i] = min(depth[c] for c in children[i]) - 1
    layers: dict[int, list[int]] = {}
    for i in sorted(depth, key=lambda i: (depth[i], nodes[i]["kind"] == "input", i)):
        layers.setdefault(depth[i], []).append(i)
    column: dict[int, float] = {}
    for d in sorted(layers):
        taken: set[int] = set()
        for i in layers[d]:
            ps = [column[p] for p in parents[i] if p in column]
            want = round(min(ps)) if ps else (1 if nodes[i]["kind"] == "input" else 0)
            while want in taken:
                want += 1
            taken.add(want)
            column[i] = want
    left, top = min(column.values()), min(depth.values())
    return {i: (LEFT + (column[i] - left) * DX, PAD + (depth[i] - top) * DY) for i in depth}


def _box(x, y, node) -> str:
    if node["kind"] != "eqn":
        return (
            f'<rect x="{x}" y="{y + 8}" width="{W}" height="{H - 16}" rx="13" fill="#ffffff" '
            f'stroke="#999" stroke-dasharray="4 3"/><text x="{x + W / 2}" y="{y + H / 2 + 4}" '
            f'text-anchor="middle" class="io">{html.escape(node["label"])}</text>'
        )
    e = node["paint"]
    half = e.colour == "allow"
    stroke, width = (HALF_COLOUR, 4) if half else (FLOAT32_COLOUR, 1.5)
    precision = "float16" if half else "float32"
    if e.list == "deny" and not half:
        why = "deny list"
    else:
        why = PASSES.get(e.painted_by or "", e.painted_by or "its list")
    return (
        f'<rect x="{x}" y="{y}" width="{W}" height="{H}" rx="6" '
        f'fill="{LIST_COLOURS[e.list]}" stroke="{stroke}" stroke-width="{width}"/>'
        f'<text x="{x + 8}" y="{y + 17}" class="op">{html.escape(e.primitive)}</text>'
        f'<text x="{x + W - 8}" y="{y + 17}" text-anchor="end" class="list">{e.list}</text>'
        f'<text x="{x + 8}" y="{y + 34}" class="why">{precision} · {html.escape(why)}</text>'
    )


def _edge(a, b) -> str:
    (x1, y1), (x2, y2) = a, b
    x1, x2, y1 = x1 + W / 2, x2 + W / 2, y1 + H
    if abs(x1 - x2) < 1 and y2 - y1 > DY:  # skip edges bend out to the left
        bend = x1 - W / 2 - 14 - 3 * (y2 - y1) / DY
        path = f"M{x1 - W / 2 + 12},{y1} C{bend},{y1 + 20} {bend},{y2 - 20} {x2 - W / 2 + 12},{y2}"
    else:
        mid = (y1 + y2) / 2
        path = f"M{x1},{y1} C{x1},{mid} {x2},{mid} {x2},{y2}"
    return f'<path d="{path}" class="edge" marker-end="url(#arrow)"/>'


def _legend(x: float) -> str:
    rows, y = [], PAD
    for name in ("allow", "infer", "deny", "clear"):
        rows.append(
            f'<rect x="{x}" y="{y}" width="26" height="16" rx="3" fill="{LIST_COLOURS[name]}" '
            f'stroke="#888"/><text x="{x + 34}" y="{y + 13}" class="why">{name} list</text>'
        )
        y += 24
    for colour, width, text in (
        (HALF_COLOUR, 4, "runs in float16"),
        (FLOAT32_COLOUR, 1.5, "runs in float32"),
    ):
        rows.append(
            f'<rect x="{x}" y="{y}" width="26" height="16" rx="3" fill="#fff" '
            f'stroke="{colour}" stroke-width="{width}"/>'
            f'<text x="{x + 34}" y="{y + 13}" class="why">{text}</text>'
        )
        y += 24
    return "".join(rows)


def svg(nodes, edges) -> str:
    pos = layout(nodes, edges)
    right = max(x for x, _ in pos.values()) + W + PAD
    width, height = right + 160, max(y for _, y in pos.values()) + H + PAD
    body = "".join(_edge(pos[a], pos[b]) for a, b in edges)
    body += "".join(_box(*pos[i], n) for i, n in enumerate(nodes))
    style = (
        "text{font-family:DejaVu Sans,Arial,sans-serif}.op{font-size:13px;font-weight:600}"
        ".list{font-size:11px;fill:#333}.why{font-size:11px;fill:#222}.io{font-size:12px}"
        ".edge{fill:none;stroke:#777;stroke-width:1.2}"
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="painting of the example model">'
        f"<style>{style}</style><defs><marker id='arrow' viewBox='0 0 8 8' refX='8' refY='4' "
        "markerWidth='7' markerHeight='7' orient='auto'><path d='M0,0 L8,4 L0,8 z' "
        f"fill='#777'/></marker></defs>{body}{_legend(right + 8)}</svg>\n"
    )


def main(docs: str, out: str) -> None:
    example = guide_example(docs, GUIDE, "def model(")
    model, args = example["model"], example["args"]
    nodes, edges = graph(model, args)
    with open(os.path.join(out, "painting.svg"), "w", encoding="utf-8") as f:
        f.write(svg(nodes, edges))
    report = guide_example(docs, EXPLAIN_GUIDE, "report = ")["report"]
    with open(os.path.join(out, "explain_report.html"), "w", encoding="utf-8") as f:
        f.write(f"<div class='jmp-report'>{report.to_html()}</div>\n")


if __name__ == "__main__":
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.makedirs(os.path.join(here, "_generated"), exist_ok=True)
    main(here, os.path.join(here, "_generated"))
    sys.exit(0)
