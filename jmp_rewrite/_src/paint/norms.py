"""Normalizations computed as TF's fused op and Flax compute them: in float32, rounded once.

:func:`~jmp_rewrite._src.paint.additions.keep_normalization_statistics_float32` keeps a
normalization's statistics float32 and unlisted. This pass, run after TF's passes, does the
same for the normalization itself: the centring ``x - mean(x)``, the product by the float32
statistic ``(x - mean) * rsqrt(var + eps)`` (or ``x * rsqrt(mean(x**2) + eps)``) and the
per-feature affine directly after it (``* scale + bias``) compute in float32 from the half
activations, and the normalized output is rounded to half once for its half readers.
"""

from __future__ import annotations

import math

from jmp_rewrite._src.paint.painting import ALLOW, Painting
from jmp_rewrite._src.trace.graph import Graph, Node

#: What a statistic reaches its product through: data movement and casts.
_MOVES = frozenset(
    {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "convert_element_type"}
)

_STATISTICS = "keep_normalization_statistics_float32"
_WHY = "compute_normalizations_float32"


def _size(n: Node) -> int:
    shape = getattr(n.eqn.outvars[0].aval, "shape", ()) if n.eqn is not None else ()
    return math.prod(shape)


def _through_moves(g: Graph, i: int) -> int:
    """The node ``i`` reads through casts and data movement."""
    n = g.nodes[i]
    while n.eqn is not None and n.key in _MOVES and len(n.fanin) == 1:
        n = g.nodes[n.fanin[0]]
    return n.id


def _statistic_users(g: Graph, root: int) -> set[int]:
    """``root`` (an rsqrt) and the values of its size or smaller computed from it alone or with
    parameters through products and moves (``rsqrt(var) * scale``, its broadcast)."""
    small = _size(g.nodes[root])
    found, todo = {root}, [root]
    while todo:
        for c in g.nodes[todo.pop()].fanout:
            n = g.nodes[c]
            if c in found or n.eqn is None or n.backward:
                continue
            if n.key in _MOVES or (n.key == "mul" and _size(n) <= small):
                found.add(c)
                todo.append(c)
    return found


def _statistic_inputs(g: Graph, p: Painting, root: int) -> tuple[set[int], set[int]]:
    """The statistic's own nodes above ``root`` (kept by the statistics pass) and the values
    it is computed from (read through moves): its ``x``."""
    own, inputs, todo = set(), set(), [root]
    while todo:
        i = todo.pop()
        if i in own:
            continue
        own.add(i)
        for f in g.nodes[i].fanin:
            if p.kept.get(f) == _STATISTICS:
                todo.append(f)
            else:
                inputs.add(_through_moves(g, f))
    return own, inputs


def compute_normalizations_float32(g: Graph, p: Painting) -> None:
    """A normalization's centring, product by its statistic and affine run in float32.

    Our addition: TF's ``FusedBatchNorm*``/``LayerNorm`` compute the normalized output in
    float32 inside and round it once; Flax's ``LayerNorm``/``RMSNorm``/``BatchNorm``/
    ``GroupNorm(dtype=half)`` cast their input to float32 for the whole normalization. Found
    by values, not spelling: a product (``mul``) of an activation-sized ``a`` by a float32
    statistic (an ``rsqrt`` the statistics pass kept, or a value of its size computed from it:
    ``rsqrt(var) * scale``, moved or broadcast), where ``a`` is one of the values the
    statistic is computed from (``x``: RMSNorm) or ``x - m`` with ``m`` one of its statistics
    (``x - mean(x)``: LayerNorm, BatchNorm over the batch axis, GroupNorm over a reshape).
    The product, that centring, and the products and sums directly after the product by
    values no larger than a feature vector (``* scale + bias``) are taken out of half: run
    after TF's passes, so every other node keeps TF's colour (pass 3 painted the normalized
    activations' neighbours with these nodes on the path), and nothing is spread. Their half
    readers read one cast of the last of them.
    """
    roots = [n.id for n in g.nodes if n.key == "rsqrt" and p.kept.get(n.id) == _STATISTICS]
    chosen: set[int] = set()
    for root in roots:
        chosen |= _normalization(g, p, root)
    for i in sorted(chosen):
        if i in p.allow:
            p.allow.discard(i)
            p.painted_by[i] = _WHY


def _normalization(g: Graph, p: Painting, root: int) -> set[int]:
    """The nodes of the normalization by statistic ``root`` to compute in float32: forward,
    the centring, the product and the affine after it; backward (``rewrite(grad(f))``),
    their transposes (see :func:`_backward`)."""
    own, xs = _statistic_inputs(g, p, root)
    users = _statistic_users(g, root)
    forward: set[int] = set()
    params: set[int] = set()  # the affine's scale and bias (through moves)
    for u in users:
        for c in g.nodes[u].fanout:
            n = g.nodes[c]
            if n.key != "mul" or c in users or n.backward or not n.float32:
                continue
            others = [f for f in n.fanin if f not in users]
            if len(others) != 1:
                continue
            a = _through_moves(g, others[0])
            centring = _centring(g, p, a, xs, own)
            if a not in xs and centring is None:
                continue
            forward.add(c)
            if centring is not None and p.kept.get(centring) is None:
                forward.add(centring)
            for i in _affine(g, c):
                forward.add(i)
                params.update(_through_moves(g, f) for f in g.nodes[i].fanin)
    if not forward:
        return forward
    params -= forward
    return forward | _backward(g, users | params, xs | forward, _size(g.nodes[root]))


def _backward(g: Graph, factors: set[int], values: set[int], small: int) -> set[int]:
    """The normalization's backward pass in a program holding it (``rewrite(grad(f))``),
    found from what it reads: the cotangent's products by the statistic or the affine's
    parameters (``factors``: ``ct * rsqrt``, ``ct * scale``), the products of what they lead
    to (through no allowlist op) by the normalized values (``values``: ``x`` or ``x - mean``,
    ``sum(x * ct')`` towards the statistic's cotangent), the nodes between those (the
    statistic's cotangent: its reductions, ``-0.5 * rsqrt / v``, the broadcast back) and the
    sums of their contributions to ``x``'s cotangent. That cotangent is rounded once, after
    the last sum, as the transpose of Flax's cast to float32 rounds it."""

    def reads(n: Node, ids: set[int]) -> bool:
        return any(f in ids or _through_moves(g, f) in ids for f in n.fanin)

    def product(n: Node) -> bool:
        return n.backward and n.key == "mul" and n.float32 and _size(n) > small

    entries = {n.id for n in g.nodes if product(n) and reads(n, factors)}
    ahead: set[int] = set()
    todo = list(entries)
    while todo:
        for c in g.nodes[todo.pop()].fanout:
            n = g.nodes[c]
            if c not in ahead and n.backward and n.eqn is not None and n.listed_kind != ALLOW:
                ahead.add(c)
                todo.append(c)
    entries |= {i for i in ahead if product(g.nodes[i]) and reads(g.nodes[i], values)}
    # Between the entries: what lies ahead of one and leads to another.
    between: set[int] = set()
    todo = [f for i in entries for f in g.nodes[i].fanin if f in ahead]
    while todo:
        i = todo.pop()
        if i in between or i in entries:
            continue
        between.add(i)
        todo.extend(f for f in g.nodes[i].fanin if f in ahead)
    chosen = entries | between
    grew = True
    while grew:  # the sums of their contributions
        sums = {
            i
            for i in ahead - chosen
            if g.nodes[i].key in ("add_any", "add") and all(f in chosen for f in g.nodes[i].fanin)
        }
        chosen |= sums
        grew = bool(sums)
    return {i for i in chosen if g.nodes[i].float32}


def _centring(g: Graph, p: Painting, a: int, xs: set[int], own: set[int]) -> int | None:
    """``a`` if it is ``x - m``, ``x`` one of the statistic's inputs and ``m`` one of its own
    statistics (through moves), else None."""
    n = g.nodes[a]
    if n.key != "sub" or len(n.fanin) != 2:
        return None
    x, m = (_through_moves(g, f) for f in n.fanin)
    stat = p.kept.get(m) == _STATISTICS
    return a if (x in xs or p.kept.get(x) == _STATISTICS) and stat and (m in own or stat) else None


def _affine(g: Graph, product: int) -> list[int]:
    """The products and sums directly after ``product`` by values no larger than a feature
    vector (its only forward reader each time): ``* scale``, ``+ bias``."""
    out, v = [], product
    for _ in range(2):
        n = g.nodes[v]
        ahead = [c for c in n.fanout if not g.nodes[c].backward]
        if len(ahead) != 1 or n.feeds_output:
            break
        c = g.nodes[ahead[0]]
        if c.key not in ("mul", "add") or c.backward or not c.float32 or len(c.fanin) != 2:
            break
        other = next((f for f in c.fanin if f != v), None)
        if other is None or _size(g.nodes[_through_moves(g, other)]) >= _size(n):
            break
        out.append(c.id)
        v = c.id
    return out
