"""The HTML view of an :func:`jmp_rewrite.explain` report: a collapsible tree by scope.

Each equation shows its list (coloured), the precision the rewrite gave it, the reason in
plain words (:func:`reason`: which of TF's passes decided, and what that means) and the
user's source line. A legend explains the lists and the colours.
"""

from __future__ import annotations

import dataclasses
import html

from jmp_rewrite._src.explain.lint import Finding, _shape, lint
from jmp_rewrite._src.explain.report import EquationReport, ReportData
from jmp_rewrite._src.explain.view import (
    _ABBR,
    _KIND_TITLES,
    _LONG_TABLE,
    _OUTPUTS,
    _PRECISION_STYLES,
    Group,
    GroupStats,
    _fmt_bytes,
    _fmt_flops,
    _pct,
    _plural,
    _short_sources,
    groups,
    phase_totals,
)
from jmp_rewrite._src.trace import source_info as si

#: Colours of the HTML report, one per list (and a strong tint for half precision).
LIST_COLOURS = {
    "allow": "#b7e1a1",
    "infer": "#fff2a8",
    "deny": "#f4a6a6",
    "clear": "#cfe2f3",
    "unlisted": "#e6e6e6",
}
HALF_COLOUR = "#6aa84f"
#: Matmuls run in float8 (``fp8=True``): a colour of their own, apart from half precision.
FLOAT8_COLOUR = "#7b3fa0"
FLOAT8_STYLE = f"background:{FLOAT8_COLOUR};color:#fff;font-weight:600"
#: Equations replaced by a fused attention call (``fuse_attention=True``): their own colour.
ATTENTION_COLOUR = "#0b7285"
ATTENTION_STYLE = f"background:{ATTENTION_COLOUR};color:#fff;font-weight:600"

#: TF's four lists (and "unlisted"), in words.
LIST_MEANINGS = {
    "allow": "always half precision: matmuls and convolutions, where tensor cores pay off",
    "infer": "half precision when its neighbours are (add, mul, tanh, log, ...)",
    "deny": "float32, and float32 spreads forward from it through infer and clear ops "
    "(exp, pow, float16 sums: numerically unsafe in half precision)",
    "clear": "either precision, following its neighbours (reshape, max, gather, ...)",
    "unlisted": "on no TF list: never converted, and it stops half precision from spreading",
}

#: Why an equation got its precision: TF's pass (or ours) that decided, in words.
PASS_WORDS = {
    "add_allowlist_ops": "on the allow list",
    "propagate_deny_forward_through_clear_and_infer": "fed by a deny-list op (float32 spreads)",
    "add_clear_and_infer_to_allow_if_between_allow": "between half-precision ops",
    "add_infer_to_allow_if_follow_allow": "follows a half-precision op",
    "propagate_allow_through_clear": "data movement next to half-precision ops",
    "remove_allow_without_float32": "computes on no float32 value",
    "make_casts_allow_if_all_outputs_allow": "a cast whose every reader is half precision",
    "keep_output_copies_float32": "an output copied from an input stays bit-exact",
    "keep_state_updates_float32": "a state update (running average, optimizer step)",
    "keep_recurrence_coefficients_float32": "a recurrence's coefficient (a gate on a state)",
    "keep_ranked_scores_float32": "a running score a selection ranks (beam search)",
    "keep_normalization_statistics_float32": "normalization statistics stay float32",
    "keep_kernels_as_written": "a kernel (Pallas, run_state): runs as written, in its dtypes",
    "unit": "part of a fused unit",
}


def reason(e: EquationReport) -> str:
    """Why an equation runs in the precision it does, in a few plain words."""
    if e.in_float32_region:
        return "inside a float32 region (float32 on request)"
    if e.painted_by:
        return PASS_WORDS.get(e.painted_by, e.painted_by.replace("_", " "))
    if e.list == "deny":
        return "on the deny list"
    if e.list == "unlisted":
        return "on no list: never converted"
    if not e.float32:
        return "computes on no float32 value"
    return "no half-precision neighbour"


_CSS = """
.jmpx{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;font-size:13px;color:#111;
 background:#fff;padding:8px;line-height:1.45}
.jmpx table{border-collapse:collapse;margin:4px 0 8px 0}
.jmpx th,.jmpx td{padding:3px 10px;border-bottom:1px solid #ddd;text-align:left;
 vertical-align:top;white-space:nowrap}
.jmpx th{background:#f3f3f3;font-weight:600}
.jmpx td.num,.jmpx th.num{text-align:right;font-variant-numeric:tabular-nums}
.jmpx code,.jmpx td.mono{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px}
.jmpx details{margin:2px 0 2px 18px}
.jmpx details.root{margin-left:0}
.jmpx summary{cursor:pointer;padding:2px 4px;border-radius:3px}
.jmpx summary:hover{background:#f0f4fa}
.jmpx .name{font-weight:600;font-family:ui-monospace,Menlo,Consolas,monospace}
.jmpx .chip{display:inline-block;margin-left:10px;color:#333}
.jmpx .muted{color:#666}
.jmpx .bar{display:inline-block;width:70px;height:9px;background:#e3e3e3;margin:0 4px;
 vertical-align:middle;border-radius:2px;overflow:hidden}
.jmpx .bar span{display:block;height:100%}
.jmpx .tag{padding:1px 6px;border-radius:3px;color:#111}
.jmpx .legend .tag{margin-right:6px}
.jmpx .lint li{margin:3px 0}
"""


def _bar(share: float, colour: str) -> str:
    return (
        f'<span class="bar" title="{100 * share:.0f}% of the equations in half precision">'
        f'<span style="width:{100 * share:.0f}%;background:{colour}"></span></span>'
    )


def _chips(s: GroupStats, phases: dict[str, GroupStats], half_colour: str) -> str:
    e = html.escape
    parts = [
        f'<span class="chip">{_plural(s.equations, "equation")} {_bar(s.half_share, half_colour)}'
        f"{_pct(s.half_share)} half</span>",
        f'<span class="chip">{_plural(s.casts, "cast")}</span>',
    ]
    if s.flops:
        words = f"{_fmt_flops(s.flops)} FLOPs, {_pct(s.half_flops_share)} half"
        if s.float8_flops:
            f8, half, f32 = (_pct(n / s.flops) for n in s.flops_split())
            words += (
                f' (<span style="color:{FLOAT8_COLOUR};font-weight:600">{f8} float8</span> / '
                f"{half} / {f32} float32)"
            )
        parts.append(f'<span class="chip">{words}</span>')
    parts.append(
        f'<span class="chip" title="bytes produced after the rewrite">out: '
        f"{_fmt_bytes(s.bytes_float32)} f32 / {_fmt_bytes(s.bytes_half)} half</span>"
    )
    split = " · ".join(f"{_ABBR[p]} {v.equations}" for p, v in phases.items() if v.equations)
    if len(phases) > 1:
        parts.append(f'<span class="chip muted">{e(split)}</span>')
    return "".join(parts)


def _source_cell(source: str) -> str:
    if not source:
        return '<td class="mono muted">-</td>'
    path, _, line = source.rpartition(":")
    title = html.escape(f"{source}\n{si.source_text(source)}")
    return f'<td class="mono" title="{title}">{html.escape(si.short_path(path))}:{line}</td>'


def _equation_rows(eqs: list[EquationReport], colours: dict[str, str], half: str) -> str:
    head = (
        "<tr><th>phase</th><th>equation</th><th>list</th><th>precision</th><th>why</th>"
        "<th>dtypes in</th><th>dtypes out</th><th>shape out</th><th>source</th></tr>"
    )
    rows = []
    for e in eqs:
        title = html.escape(f"{e.list} op, painted by {e.painted_by or 'no pass'}")
        why = html.escape(reason(e))
        floats = e.in_dtypes or any(d.startswith(("float", "bfloat")) for d in e.out_dtypes)
        precision = "half" if e.half else e.colour if floats else "no floats"
        style = "half" if e.half else "deny" if e.colour == "deny" else "float32"
        p_style = _PRECISION_STYLES[style if floats else "none"].format(half=half, **colours)
        if e.attention:  # replaced: the fused call computes it (never written out)
            precision, p_style = "fused attention", ATTENTION_STYLE
            title = html.escape(e.attention)
        elif e.float8:
            precision, p_style = f"float8 {e.float8}", FLOAT8_STYLE
        elif e.float8_left:  # the reason a matmul stays half precision under fp8=True
            title = html.escape(f"{e.list} op, not float8: {e.float8_left}")
        shape = ", ".join(_shape(s, d) for s, d in zip(e.out_shapes, e.out_dtypes_after))
        rows.append(
            f'<tr class="eq" title="{title}"><td>{e.phase}</td>'
            f'<td class="mono">{html.escape(e.path)}</td>'
            f'<td><span class="tag" style="background:{colours.get(e.list, "#fff")}">'
            f"{html.escape(e.list)}</span></td>"
            f'<td style="{p_style}" title="{title}">{precision}</td><td>{why}</td>'
            f'<td class="mono">{html.escape(_arrow(e.in_dtypes, e.in_dtypes_after))}</td>'
            f'<td class="mono">{html.escape(_arrow(e.out_dtypes, e.out_dtypes_after))}</td>'
            f'<td class="mono">{html.escape(shape)}</td>{_source_cell(e.source)}</tr>'
        )
    return f"<table>{head}{''.join(rows)}</table>"


def _arrow(before: tuple[str, ...], after: tuple[str, ...]) -> str:
    b, a = ",".join(before), ",".join(after)
    return b if a == b else f"{b} → {a}"


@dataclasses.dataclass
class _Node:
    name: str
    stats: GroupStats = dataclasses.field(default_factory=GroupStats)
    phases: dict[str, GroupStats] = dataclasses.field(default_factory=dict)
    children: dict[str, _Node] = dataclasses.field(default_factory=dict)
    own: Group | None = None


def _tree(report: ReportData) -> _Node:
    root = _Node("")
    for g in groups(report, "scope"):
        if g.key == _OUTPUTS:
            continue
        path = g.key.split("/") if g.key else []
        node, chain = root, [root]
        for part in path:
            node = node.children.setdefault(part, _Node(part))
            chain.append(node)
        node.own = g
        for n in chain:
            n.stats.add(g.total)
            for p, s in g.phases.items():
                n.phases.setdefault(p, GroupStats()).add(s)
    if root.own is not None:  # equations outside any scope: a last entry of their own
        root.children["(top level)"] = _Node("(top level)", root.own.total, root.own.phases)
        root.children["(top level)"].own = root.own
    return root


def _render(node: _Node, colours: dict[str, str], half: str, depth: int) -> str:
    body = "".join(_render(c, colours, half, depth + 1) for c in node.children.values())
    if node.own is not None and node.own.equations:
        own = node.own
        rows = _equation_rows(own.equations, colours, half)
        if node.children:  # the scope's own equations, beside its sub-scopes
            where = _short_sources(own.sources, 3)
            label = _plural(own.total.equations, "equation") + " directly here"
            label += f" ({where})" if where else ""
            rows = f"<details><summary class='muted'>{html.escape(label)}</summary>{rows}</details>"
        body += rows
    phases = {p: node.phases[p] for p in si.PHASES if p in node.phases}
    # Top-level scopes open: their sub-scopes' summaries show; a long table stays closed.
    long = not node.children and node.stats.equations > _LONG_TABLE
    opened = " open" if depth < 1 and not long else ""
    return (
        f"<details{opened}><summary><span class='name'>{html.escape(node.name)}</span>"
        f"{_chips(node.stats, phases, half)}</summary>{body}</details>"
    )


def _summary_table(report: ReportData) -> str:
    head = ["equations", "half", "casts", "matmul/conv FLOPs", "in half", "float32 out"]
    rows = ["<tr><th>phase</th>" + "".join(f"<th class='num'>{h}</th>" for h in head)]
    rows[0] += "<th class='num'>half out</th></tr>"
    totals = phase_totals(report)
    float8 = any(s.float8_flops for s in totals.values())
    if float8:
        rows[0] = rows[0].replace("in half</th>", "in half</th><th class='num'>in float8</th>")
    for p, s in totals.items():
        cells = [s.equations, _pct(s.half_share), s.casts, _fmt_flops(s.flops)]
        cells += [_pct(s.half_flops_share)]
        cells += [_pct(s.float8_flops / s.flops if s.flops else None)] if float8 else []
        cells += [_fmt_bytes(s.bytes_float32), _fmt_bytes(s.bytes_half)]
        rows.append(f"<tr><td>{p}</td>" + "".join(f"<td class='num'>{c}</td>" for c in cells))
    return f"<table>{''.join(rows)}</table>"


def _lint_html(found: list[Finding]) -> str:
    if not found:
        return "<p class='muted'>Lint: nothing to change.</p>"
    sections = []
    for kind, title in _KIND_TITLES.items():
        items = []
        for f in (f for f in found if f.kind == kind):
            risk = f"<br><span class='muted'>risk: {html.escape(f.risk)}</span>" if f.risk else ""
            items.append(
                f"<li>{html.escape(f.message)}<br>change: <code>{html.escape(f.change)}</code>"
                f"{risk}</li>"
            )
        if items:
            sections.append(f"<div>{html.escape(title)}<ul>{''.join(items)}</ul></div>")
    return (
        f"<details open class='lint root'><summary><b>Lint: {_plural(len(found), 'finding')}</b>"
        f"</summary>{''.join(sections)}</details>"
    )


def _legend() -> str:
    """What the lists and colours mean, in words."""
    rows = "".join(
        f"<tr><td><span class='tag' style='background:{LIST_COLOURS[k]}'>{k}</span></td>"
        f"<td>{html.escape(LIST_MEANINGS[k])}</td></tr>"
        for k in LIST_COLOURS
    )
    half = _PRECISION_STYLES["half"].format(half=HALF_COLOUR)
    deny = _PRECISION_STYLES["deny"].format(deny=LIST_COLOURS["deny"])
    f32 = _PRECISION_STYLES["float32"]
    precision = (
        f"<p>The <b>list</b> column is the TF list the op is on (its colour above). The "
        f"<b>precision</b> column is what the rewrite decided: <span class='tag' "
        f"style='{half}'>half</span> runs in half precision, <span class='tag' "
        f"style='{FLOAT8_STYLE}'>float8</span> a matmul with float8 operands (fp8=True; "
        "e4m3 forward, e5m2 cotangents; bfloat16 result), <span class='tag' "
        f"style='{ATTENTION_STYLE}'>fused attention</span> an equation replaced by a fused "
        "attention call (fuse_attention=True; cuDNN flash attention on CUDA), <span class='tag' "
        f"style='{deny}'>deny</span> is kept float32 by a deny-list op, <span class='tag' "
        f"style='{f32}'>float32</span> is left float32 (nothing made it half). The <b>why</b> "
        "column says which of TF's passes decided it, in words; hover a row for the pass's "
        "name, a source cell for your code.</p>"
    )
    return (
        "<details class='legend root'><summary><b>Legend: lists and colours</b></summary>"
        f"<table>{rows}</table>{precision}</details>"
    )


def to_html(report: ReportData) -> str:
    """The report as an HTML fragment: totals per phase, a legend of the lists and colours,
    the lint and the tree of scopes (``<details>``), each with its equations (list colour,
    precision, the reason in words, source)."""
    summary = html.escape(report.summary()).replace("\n", "<br>")
    if report.off_reason:
        return f"<div class='jmpx'><style>{_CSS}</style><p>{summary}</p></div>"
    top = "".join(_render(c, LIST_COLOURS, HALF_COLOUR, 0) for c in _tree(report).children.values())
    return (
        f"<div class='jmpx'><style>{_CSS}</style><p>{summary}</p>{_summary_table(report)}"
        f"{_legend()}{_lint_html(lint(report))}<div class='tree'>{top}</div></div>"
    )
