"""TF's painting passes, run on the flat graph of :mod:`jmp_rewrite._src.trace.graph`.

Each pass is a function named after, and citing, the grappler pass it reproduces
(``tensorflow/core/grappler/optimizers/auto_mixed_precision.cc``, TF 2.21). They run in TF's
order, with the passes jmp_rewrite adds (:mod:`jmp_rewrite._src.paint.additions`) first (but
:mod:`jmp_rewrite._src.paint.norms`, after them, and the read/unit/big passes at the end); the
result, a :class:`~jmp_rewrite._src.paint.painting.Painting`, records for every node whether it is
painted half precision ("allow") and which pass decided that. No pass changes the graph.
"""

from __future__ import annotations

import collections

from jmp_rewrite._src import fp8 as fp8_lib
from jmp_rewrite._src.attention import select as attention_lib
from jmp_rewrite._src.paint.additions import (
    find_big_values,
    inherit_unit_colours,
    keep_float32_reads_unrounded,
    keep_highest_precision_float32,
    keep_kernels_as_written,
    keep_normalization_statistics_float32,
    keep_output_copies_float32,
    keep_state_updates_float32,
    keep_unrun_loop_carries_float32,
    release_saturated_powers,
)
from jmp_rewrite._src.paint.norms import compute_normalizations_float32
from jmp_rewrite._src.paint.painting import (
    ALLOW,
    CLEAR,
    DENY,
    INFER,
    Painting,
    _dfs,
    _fanin,
    _fanout,
)
from jmp_rewrite._src.paint.recurrences import (
    keep_ranked_increments_float32,
    keep_recurrence_coefficients_float32,
)
from jmp_rewrite._src.trace.graph import Graph, Node


def add_allowlist_ops(g: Graph, p: Painting, force_all: bool) -> None:
    """Pass 1, TF ``AddAllowlistOps``: every processable allowlist op is painted allow.

    Under ``UNSAFE_FORCE_ALL`` every processable node is (TF's ``CanForceFP16``: casts and
    ops that cannot hold half precision excluded).
    """
    for n in g.nodes:
        forced = force_all and n.float32 and not n.is_cast
        if p.processes(n) and (p.kind_of(n) == ALLOW or forced):
            p.allow.add(n.id)
            p.painted_by[n.id] = "add_allowlist_ops"


def propagate_deny_forward_through_clear_and_infer(g: Graph, p: Painting) -> None:
    """Pass 2, TF ``PropagateDenyFwdThroughClearAndInfer``.

    Deny flows forward through infer ops unconditionally, and through clear ops only while a
    clear-only path leads on to another deny or infer op. TF's example:
    ``deny -> infer -> clear -> infer -> clear -> allow -> infer`` gives
    ``deny deny deny deny clear allow infer``.
    """
    upstream: set[int] = set()  # U: deny/infer ops and clear ops leading to one
    for r in (n.id for n in g.nodes if p.kind_of(n) in (DENY, INFER)):
        for v in _dfs(
            [r],
            _fanin,
            g.nodes,
            lambda v, r: v.id == r or (v.id not in upstream and p.kind_of(v) == CLEAR),
        ):
            upstream.add(v)
    reached: set[int] = set()
    for r in (n.id for n in g.nodes if p.kind_of(n) == DENY):
        if r in reached:
            continue
        for v in _dfs(
            [r],
            _fanout,
            g.nodes,
            lambda v, r: v.id == r or (v.id not in reached and v.id in upstream),
        ):
            reached.add(v)
            if p.processes(g.nodes[v]):  # nodes kept float32 by an earlier pass keep that reason
                p.deny.add(v)
                p.painted_by[v] = "propagate_deny_forward_through_clear_and_infer"


def _eligible(n: Node, p: Painting) -> bool:
    return p.processes(n) and n.float32 and n.id not in p.deny


def add_clear_and_infer_to_allow_if_between_allow(g: Graph, p: Painting) -> None:
    """Pass 3, TF ``AddClearAndInferToAllowIfBetweenAllow``.

    Clear and infer ops on an ``allow -> ... -> allow`` path made only of eligible clear/infer
    ops become allow: no casting back and forth between two half-precision matmuls.
    """
    roots = [n.id for n in g.nodes if p.processes(n) and p.kind_of(n) == ALLOW]
    downstream = set(
        _dfs(
            roots,
            _fanout,
            g.nodes,
            lambda v, r: v.id == r or (p.kind_of(v) in (CLEAR, INFER) and _eligible(v, p)),
        )
    )
    for v in _dfs(roots, _fanin, g.nodes, lambda v, r: v.id == r or v.id in downstream):
        if v not in p.allow:
            p.allow.add(v)
            p.painted_by[v] = "add_clear_and_infer_to_allow_if_between_allow"


def add_infer_to_allow_if_follow_allow(g: Graph, p: Painting) -> None:
    """Pass 4, TF ``AddInferToAllowIfFollowAllow`` (every mode since TF 2.20).

    One sweep in graph order: an infer op with an allow input and no deny input becomes
    allow. The set is updated in place, so a chain ``allow -> infer -> infer`` is painted
    whole; but it runs before pass 5, so ``matmul -> relu -> tanh`` leaves tanh float32
    (relu is not allow yet).
    """
    for n in g.nodes:
        if p.kind_of(n) != INFER or not _eligible(n, p) or n.id in p.allow:
            continue
        if any(s in p.deny for s in n.fanin):
            continue
        if any(s in p.allow for s in n.fanin):
            p.allow.add(n.id)
            p.painted_by[n.id] = "add_infer_to_allow_if_follow_allow"


def propagate_allow_through_clear(g: Graph, p: Painting) -> None:
    """Pass 5, TF ``PropagateAllowThroughClear``: allow spreads through clear ops, both ways.

    Upstream too: ``param -> reshape -> transpose -> matmul`` casts once, right after the
    parameter, and reshapes/transposes the half-precision copy.
    """
    roots = [n for n in sorted(p.allow) if p.processes(g.nodes[n])]

    def enter(v: Node, r: int) -> bool:
        return v.id == r or (v.id not in p.allow and p.kind_of(v) == CLEAR and _eligible(v, p))

    for v in _dfs(roots, lambda n: [*n.fanin, *n.fanout], g.nodes, enter):
        if v not in p.allow:
            p.allow.add(v)
            p.painted_by[v] = "propagate_allow_through_clear"


def remove_allow_without_float32(g: Graph, p: Painting) -> None:
    """Pass 6, TF ``RemoveAllowsetWithFp32``: allowlist ops that cannot hold half go back."""
    for n in g.nodes:
        if n.id in p.allow and p.kind_of(n) == ALLOW and not n.float32:
            p.allow.discard(n.id)
            p.painted_by[n.id] = "remove_allow_without_float32"


def make_casts_allow_if_all_outputs_allow(g: Graph, p: Painting) -> None:
    """TF ``MakeCastsAllowIfAllOutputsAllow``: a user's cast to float32 feeding only
    half-precision consumers casts to half instead (``bool -> f32 -> matmul`` becomes
    ``bool -> f16``), saving a cast."""
    for n in g.nodes:
        if n.is_cast and p.processes(n) and n.fanout and not n.feeds_output:
            if all(c in p.allow for c in n.fanout):
                p.allow.add(n.id)
                p.painted_by[n.id] = "make_casts_allow_if_all_outputs_allow"


def paint(
    g: Graph,
    *,
    infer_follows_allow: bool = True,
    force_all: bool = False,
    fp8: fp8_lib.Fp8Rules | None = None,
    fp8_check: bool = True,
    as_infer: frozenset[int] = frozenset(),
    attention: bool = False,
) -> Painting:
    """Runs TF's passes, in TF's order, on ``g`` (which no pass changes).

    Args:
      g: the painting graph.
      infer_follows_allow: run pass 4 (TF >= 2.20 in every mode; before that only in bf16).
      force_all: TF's ``UNSAFE_FORCE_ALL`` level.
      fp8: the :class:`~jmp_rewrite._src.fp8.Fp8Rules` choosing the float8 matmuls of a
        changed painting, or None.
      fp8_check: an ``fp8`` pattern matching no matmul is an error.
      as_infer: deny nodes to paint as if they were on the infer list.
      attention: choose the attentions to fuse (``fuse_attention=True``).

    Returns:
      The :class:`Painting`.

    Raises:
      ValueError: if ``fp8_check`` and a pattern of ``fp8`` matches no matmul.
    """
    p = Painting(allow=set(), deny=set(), painted_by={}, changed=True, as_infer=as_infer)
    keep_output_copies_float32(g, p)
    keep_unrun_loop_carries_float32(g, p)
    keep_state_updates_float32(g, p)
    keep_recurrence_coefficients_float32(g, p)
    keep_ranked_increments_float32(g, p)
    keep_normalization_statistics_float32(g, p)
    release_saturated_powers(g, p)
    keep_highest_precision_float32(g, p)
    keep_kernels_as_written(g, p)
    add_allowlist_ops(g, p, force_all)
    if not p.allow and not g.opaque_allow:  # TF: "No allowlist ops found, nothing to do"
        p.changed = False
        return p
    if not force_all:
        propagate_deny_forward_through_clear_and_infer(g, p)
    add_clear_and_infer_to_allow_if_between_allow(g, p)
    if infer_follows_allow:
        add_infer_to_allow_if_follow_allow(g, p)
    propagate_allow_through_clear(g, p)
    remove_allow_without_float32(g, p)
    compute_normalizations_float32(g, p)
    keep_float32_reads_unrounded(g, p)
    make_casts_allow_if_all_outputs_allow(g, p)
    inherit_unit_colours(g, p)
    find_big_values(g, p)
    if not any(g.nodes[n].float32 for n in p.allow) and not g.opaque_allow:
        p.changed = False
    if fp8 is not None and p.changed:
        p.fp8 = fp8_lib.select(g, p, fp8, check_patterns=fp8_check)
    if attention and p.changed:
        p.attention = attention_lib.select(g, p)
    return p


def deny_releases(graph: Graph, painting: Painting, options: dict) -> dict[int, tuple[str, ...]]:
    """Node id -> the deny-list keys whose move to *infer* alone would paint it half.

    Repaints the graph once per deny key present, its nodes of that key painted as infer
    (``paint``'s ``as_infer``; nothing is traced again, the graph is not changed). A node of
    that key the painting released (unlisted: a normalization statistic, a saturated power)
    stays released: the what-if asks about the deny spread, not about those nodes.
    """
    if not painting.changed or options.get("force_all"):
        return {}
    deny = [n for n in graph.nodes if painting.processes(n) and painting.kind_of(n) == DENY]
    keys = sorted({n.key for n in deny if n.id in painting.deny})
    out: dict[int, list[str]] = collections.defaultdict(list)
    for key in keys:
        moved = frozenset(n.id for n in graph.nodes if n.key == key and painting.kind_of(n) == DENY)
        p = paint(
            graph,
            infer_follows_allow=bool(options.get("infer_follows_allow", True)),
            as_infer=moved,
        )
        for i in sorted(p.allow - painting.allow):
            if graph.nodes[i].eqn is not None:
                out[i].append(key)
    return {i: tuple(v) for i, v in out.items()}
