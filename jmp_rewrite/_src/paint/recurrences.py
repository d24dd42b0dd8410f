"""The coefficients of linear recurrences stay float32 (a pass :mod:`paint` runs after the
state pass of :mod:`jmp_rewrite._src.paint.additions`).

A gated linear recurrence ``h_t = a_t * h_{t-1} + b_t`` -- a gated RNN (minGRU, HGRN), a
state-space model (Mamba's ``exp(softplus(.) * A)``, an LRU's decay), an RWKV time decay --
multiplies its state by its coefficient ``a`` at every step, so ``h_T`` holds the products
``a_T ... a_{t+1}``: a relative error ``u`` in every ``a`` (its rounding to half) compounds to
``T u`` in the products, far more than rounding the state once. Gates near 1 are the rule
(``sigmoid(x @ w + 4)`` lies in 0.95-0.999, where bfloat16's spacing is 2^-8), and the
window the recurrence remembers is ``1 / (1 - a)`` steps long. The state pass keeps the
carry and its update float32; this pass keeps its coefficients float32 too, back to the
matmuls that feed them (which stay half), as a careful hand-written model computes its
gates. TF paints them by its lists (``Sigmoid`` infer, half after a matmul): a deliberate
departure.
"""

from __future__ import annotations

from typing import Any

from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src.paint.additions import _keep_float32, recurrence_chains, state_chain
from jmp_rewrite._src.paint.painting import ALLOW, Painting, _dfs, _fanin
from jmp_rewrite._src.trace.graph import Graph, Node
from jmp_rewrite._src.trace.origins import LINEAR_OR_MOVING, LoopState

#: Element selections a piece of a value is cut out by (``a[1::2]``, ``a[t]``, a shift);
#: with the value-preserving steps around them.
_CUTS = frozenset({"slice", "dynamic_slice", "gather", "rev", "pad"})
_PIECE_STEPS = _CUTS | {"convert_element_type", "copy", "copy_p", "reshape", "squeeze"}
_PIECE_STEPS |= {"expand_dims"}
#: Products along an axis: each result multiplies coefficients together.
_RUNNING_PRODUCTS = ("cumprod", "reduce_prod")


def _piece(g: Graph, i: int) -> tuple[Any, tuple[Any, ...]] | None:
    """``(source, cuts)`` when node ``i`` is a piece cut out of ``source`` (a node id, or the
    program input a cut reads: an input has no node) through :data:`_PIECE_STEPS`, at least
    one a cut: ``a[1::2]`` is ``(a, (slice ...))``. ``cuts`` names the elements: two pieces
    of one source with different cuts hold different elements."""
    cuts: list[Any] = []
    n = g.nodes[i]
    while n.eqn is not None and n.key in _PIECE_STEPS and len(n.fanin) <= 1:
        if n.key in _CUTS:
            operands = tuple(
                ("literal", repr(jc.literal_value(a))) if jc.is_literal(a) else a
                for a in n.eqn.invars[1:]
            )
            cuts.append((n.key, repr(sorted(n.eqn.params.items())), operands))
        if not n.fanin:  # cut from a program input
            return (n.eqn.invars[0], tuple(cuts)) if cuts else None
        n = g.nodes[n.fanin[0]]
    return (n.id, tuple(cuts)) if cuts else None


def _coefficients(g: Graph) -> set[int]:
    """The nodes holding coefficients of a linear recurrence, recognised by what reads them:

    * a factor of a product (or a divisor) on the chain carrying a recurrent loop carry to
      its next value, not itself linear in the carry (``a_t`` in ``a_t * h + b_t``): it
      multiplies a value holding the earlier steps' coefficients;
    * a value a piece of which multiplies another piece of it (``a[1::2] * a[0::2]``, the
      combine step of ``lax.associative_scan``, which has no loop carry), with every piece
      cut from it, and the operand of a running product (``cumprod``, ``reduce_prod``): a
      product of coefficients along an axis.
    """
    found: set[int] = set()
    for chain in recurrence_chains(g):
        members = set(chain)
        for i in chain:
            n = g.nodes[i]
            if n.key in ("mul", "div"):  # a quotient on the chain divides the carry
                found.update(f for f in n.fanin if f not in members)
    pieces = {n.id: _piece(g, n.id) for n in g.nodes if n.key in _CUTS}
    pieces = {i: pc for i, pc in pieces.items() if pc is not None}
    sources: set[Any] = set()
    for n in g.nodes:
        if n.key in _RUNNING_PRODUCTS:
            found.update(n.fanin)
        elif n.key == "mul" and len(n.fanin) == 2 and n.fanin[0] != n.fanin[1]:
            a, b = (_piece(g, f) for f in n.fanin)
            if a is not None and b is not None and a[0] == b[0] and a[1] != b[1]:
                sources.add(a[0])
    found.update(s for s in sources if isinstance(s, int))
    found.update(i for i, (source, _) in pieces.items() if source in sources)
    return found


def _products(g: Graph, coefficients: set[int]) -> tuple[list[int], list[int]]:
    """The products by a coefficient (quotients by one), and the values they scale."""
    products, scaled = [], []
    for n in g.nodes:
        if n.key == "mul" and any(f in coefficients for f in n.fanin):
            factors = [f for f in n.fanin if f not in coefficients]
        elif (
            n.key == "div"
            and not jc.is_literal(n.eqn.invars[1])
            and set(n.fanin[-1:]) & coefficients
        ):
            factors = [f for f in n.fanin[:-1] if f not in coefficients]
        else:
            continue
        products.append(n.id)
        scaled += factors
    return products, scaled


def keep_recurrence_coefficients_float32(g: Graph, p: Painting) -> None:
    """The coefficients of a linear recurrence, and what they multiply, stay float32.

    Our addition (TF paints a gate by its lists: ``Sigmoid`` is infer, half after the
    matmul that feeds it). A coefficient (see :func:`_coefficients`) is kept float32 with
    everything it is computed from back to the matmuls (or convolutions) and program
    inputs that feed it: the sigmoid and its bias, Mamba's ``exp(softplus(x @ w + b) * A)``,
    an LRU's ``exp(-exp(nu))``, the ``<xs>`` stream a ``scan`` reads it through; the matmul
    itself stays half, and its result is cast up once, as by hand. So are the products by a
    coefficient and the linear chain of the values they scale (a cast into a half product
    would round the coefficient again): in ``lax.associative_scan`` the partial results the
    next level reads, in a loop the carry's chain (kept already by the state pass).
    Not told apart: the pieces of one value multiplied together that are no recurrence
    (``x[:, :d] * x[:, d:]`` of a bilinear layer written with slices) are kept float32 too.
    """
    coefficients = _coefficients(g)
    if not coefficients:
        return

    def computes(v: Node, r: int) -> bool:  # not the matmuls, not another loop's carry
        return v.listed_kind != ALLOW and v.key != "<carry>"

    def linear(v: Node, r: int) -> bool:
        return v.eqn is not None and v.key in LINEAR_OR_MOVING and v.listed_kind != ALLOW

    products, scaled = _products(g, coefficients)
    keep = _dfs(coefficients, _fanin, g.nodes, computes)
    keep += _dfs(scaled, _fanin, g.nodes, linear) + products
    _keep_float32(g, p, keep, "keep_recurrence_coefficients_float32")


#: Selections that rank the values they read against each other: what they pick depends on
#: the order of those values (``top_k`` of a beam search's scores, ``sort``, a maximum).
_RANKINGS = frozenset({"top_k", "approx_top_k", "sort", "reduce_max", "reduce_min"})
_RANKINGS |= {"cummax", "cummin", "argmax", "argmin"}


def _ranked(g: Graph, ls: LoopState, chain: list[int]) -> bool:
    """Whether a selection in loop state ``ls``'s body ranks values of its ``chain``: one of
    :data:`_RANKINGS` reading a value linear in the carries of its cycle (the ``top_k`` or
    ``argsort`` whose indices a gather of the scores takes, an ``argmax``), or a
    ``max``/``min`` of two values of the chain (``maximum(s0 + a, s1 + b)``, not a clip)."""
    members = set(chain)
    for i in ls.body:
        n = g.nodes[i]
        if n.key in _RANKINGS and any(ls.cycle & g.nodes[f].origin.derived for f in n.fanin):
            return True
        if n.key in ("max", "min") and len([f for f in n.fanin if f in members]) >= 2:
            return True
    return False


def keep_ranked_increments_float32(g: Graph, p: Painting) -> None:
    """What a ranked running score adds each step is computed float32 from the matmuls.

    Our addition. A loop carry updated from itself through a selection that ranks it (beam
    search's ``top_k(scores[:, None] + log_probs)``, ``sort``, a running ``max``) is state,
    kept float32 with its chain by the state pass; but the choice of beams compares sums of
    increments over every step, where a half-precision rounding of each log-probability
    (``u |log p|``, 2e-3 in float16 for ``log p = -4``) adds up to more than the gaps between
    near-tied candidates, and one flipped choice changes the rest of the search. The state
    pass keeps only the increment's linear tail float32 (sums and scalings), which stops at
    the first other op: a ``log_softmax`` (a fused unit), ``log(softmax(.))``, the bias add
    behind it. Here the increment is kept float32 with everything it is computed from, back
    to the matmuls (which stay half, their results cast up once) and the loop's carries, as
    a hand-written search computes its scores, whatever the spelling.
    """

    def computes(v: Node, r: int) -> bool:
        return v.float32 and v.listed_kind != ALLOW and v.key != "<carry>"

    carries = {ls.state: ls.carry for ls in g.loop_states}
    for ls in g.loop_states:
        if not ls.recurrent or not g.nodes[ls.carry].float32:
            continue
        chain = state_chain(g, ls.cycle, [ls.root], frozenset(carries[s] for s in ls.cycle))
        if not _ranked(g, ls, chain):
            continue
        members = set(chain)
        starts = [f for i in chain for f in g.nodes[i].fanin if f not in members]
        _keep_float32(g, p, _dfs(starts, _fanin, g.nodes, computes), "keep_ranked_scores_float32")
