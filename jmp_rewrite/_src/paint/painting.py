"""The record of a painting and the graph walks its passes share.

:class:`Painting` holds every per-node decision of :func:`jmp_rewrite._src.paint.passes.paint`'s
passes (colour, kept float32, kind override, float8 choice); the passes read the graph and
write the painting, never the graph. The walks are TF's ``DfsTypeTraversal`` and its uses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from jmp_rewrite._src.attention.select import AttentionSelection
from jmp_rewrite._src.fp8 import Fp8Selection
from jmp_rewrite._src.trace.graph import Node

ALLOW, INFER, DENY, CLEAR, UNLISTED = "allow", "infer", "deny", "clear", "unlisted"


@dataclasses.dataclass
class Painting:
    """The outcome of painting a graph: every per-node decision. No pass changes the graph;
    what a pass decides about a node beyond its colour is recorded here too, and the passes
    read a node's kind and TF's ``ShouldProcess`` through :meth:`kind_of` and
    :meth:`processes`, so painting a graph twice gives equal paintings.

    Attributes:
      allow: ids of the nodes that run in half precision.
      deny: ids of the nodes painted deny by pass 2.
      painted_by: node id -> name of the pass that last decided its colour.
      changed: False when TF's "No allowlist ops found, nothing to do" applies.
      fp8: the matmuls run in float8 (a :class:`~jmp_rewrite._src.fp8.Fp8Selection`), or
        None without ``fp8=True``.
      attention: the attentions fused (an
        :class:`~jmp_rewrite._src.attention.select.AttentionSelection`), or None without
        ``fuse_attention=True``.
      kept: node id -> the pass that took it out of painting (kept float32; see
        ``paint_additions._keep_float32``): no longer processed, whatever its list.
      released: node id -> the pass that made it unlisted (a deny op that spreads nothing).
      as_infer: deny nodes painted as if on the infer list (``paint.deny_releases``' what-ifs).
      big: ids of the nodes holding big values (``Origin.big``: a constant beyond the half
        range reaches them; ``paint_additions.keep_masked_values_float32``).
    """

    allow: set[int]
    deny: set[int]
    painted_by: dict[int, str]
    changed: bool
    fp8: Fp8Selection | None = None
    attention: AttentionSelection | None = None
    kept: dict[int, str] = dataclasses.field(default_factory=dict)
    released: dict[int, str] = dataclasses.field(default_factory=dict)
    as_infer: frozenset[int] = frozenset()
    big: set[int] = dataclasses.field(default_factory=set)

    def colour(self, node_id: int) -> str:
        if node_id in self.allow:
            return ALLOW
        return DENY if node_id in self.deny else "float32"

    def kind_of(self, n: Node) -> str:
        """The kind the passes paint ``n`` by: its graph kind, unless released or asked as
        infer."""
        if n.id in self.released:
            return UNLISTED
        return INFER if n.id in self.as_infer else n.kind

    def processes(self, n: Node) -> bool:
        """TF's ``ShouldProcess`` for ``n``: the graph's, unless a pass kept it float32."""
        return n.process and n.id not in self.kept


def _dfs(
    roots: Iterable[int],
    edges: Callable[[Node], Iterable[int]],
    nodes: list[Node],
    enter: Callable[[Node, int], bool],
) -> list[int]:
    """TF's ``DfsTypeTraversal``: from each root, visit nodes satisfying ``enter(v, root)``."""
    seen: set[int] = set()
    order: list[int] = []
    for root in roots:
        stack = [root]
        while stack:
            v = stack.pop()
            if v in seen or not enter(nodes[v], root):
                continue
            seen.add(v)
            order.append(v)
            stack.extend(edges(nodes[v]))
    return order


def _fanin(n: Node) -> list[int]:
    return n.fanin


def _fanout(n: Node) -> list[int]:
    return n.fanout
