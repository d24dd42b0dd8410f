"""The painting passes jmp_rewrite adds to TF's (:mod:`jmp_rewrite._src.paint.passes` runs them).

TF keeps some values float32 by means a jaxpr does not have: stateful ops on no list
(``AssignMovingAvg``), fused kernels computing their statistics in float32 (``FusedBatchNorm``'s
``U``), fetch nodes never painted, functional loops crossing their boundary in float32. These
passes keep the same values float32 (or, for a deny op whose value cannot overflow harmfully,
release it) so that the rest of the program is painted as TF would paint it. Each says what
it reproduces or why it differs from TF on purpose.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
from jax import lax

from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src.paint.painting import ALLOW, CLEAR, DENY, Painting, _dfs, _fanin, _fanout
from jmp_rewrite._src.trace.equations import is_f32, sealed
from jmp_rewrite._src.trace.graph import Graph, Node
from jmp_rewrite._src.trace.origins import (
    COMBINES,
    SCATTER_COMBINES,
    carries_magnitude,
    updates_state,
)


def _keep_float32(g: Graph, p: Painting, ids: Iterable[int], why: str) -> None:
    """Takes nodes out of painting: they are never painted allow and block allow's spread,
    but keep their list for TF's deny propagation (a float32 Sum still spreads deny), so
    the rest of the program is painted as TF would paint it."""
    for i in ids:
        if p.processes(g.nodes[i]):
            p.kept[i] = why
            p.painted_by[i] = why


def _walk_up(g: Graph, roots: Iterable[int], enter: Callable[[Node], bool]) -> list[int]:
    """Nodes reached from ``roots`` (included) going to inputs, through nodes ``enter`` takes."""
    return _dfs(roots, _fanin, g.nodes, lambda v, r: v.id == r or enter(v))


def keep_output_copies_float32(g: Graph, p: Painting) -> None:
    """An output that is a copy of an input comes back bit-exact.

    TF never paints a fetch node (``nodes_to_preserve`` fail ``ShouldProcess``). Here outputs
    may come from half-precision producers (the logits' matmul), but an output that is an
    input handed on -- unchanged through calls and loop carries, or reshaped, transposed,
    sliced (clear ops of it alone) -- keeps float32 along that chain: module state returned
    by ``nnx.remat``/``nnx.jit`` helpers must not come back rounded.
    """
    roots = [s for s, o, _ in g.outputs if s is not None and o.copy_of is not None]
    ids = _walk_up(g, roots, lambda v: v.origin.copy_of is not None)
    _keep_float32(g, p, ids, "keep_output_copies_float32")


def keep_unrun_loop_carries_float32(g: Graph, p: Painting) -> None:
    """A loop that runs zero times hands its initial carries on unrounded.

    Our addition (TF's loops are never known to run zero times when painting): a scan of
    length 0 (``fori_loop(0, 0, ...)``, a scan over empty ``xs``) or a ``while`` whose
    condition is false on literal initial values returns its initial carries. Painted half
    for the body's sake, a carry would round a float32 value on its way through a loop that
    never runs; kept float32, it is handed on exact and its half readers cast after it.
    """
    _keep_float32(g, p, g.unrun_carries, "keep_unrun_loop_carries_float32")


def _asks_float32(eqn: object) -> bool:
    """``precision=HIGHEST``, or an explicit dot algorithm (``DotAlgorithmPreset.F32_F32_F32``,
    a ``DotAlgorithm``): the caller chose the operand and accumulation types itself."""
    precision = getattr(eqn, "params", {}).get("precision")
    if isinstance(precision, lax.DotAlgorithm):
        return True
    if isinstance(precision, lax.DotAlgorithmPreset):
        return precision != lax.DotAlgorithmPreset.DEFAULT
    values = precision if isinstance(precision, tuple) else (precision,)
    return any(v == lax.Precision.HIGHEST for v in values if isinstance(v, lax.Precision))


def keep_highest_precision_float32(g: Graph, p: Painting) -> None:
    """A matmul or convolution that asks for ``precision=HIGHEST`` stays float32.

    Our addition (TF's ops have no precision attribute): ``Precision.HIGHEST`` is the
    caller's explicit request for float32 accuracy on every backend, as diffrax asks for it
    when it combines a Runge-Kutta method's stages with its Butcher tableau
    (``tensordot(a, ks, precision=HIGHEST)``). Painted allow, the tableau's coefficients
    were rounded to half and the step lost the method's order. An explicit dot algorithm
    (``precision=DotAlgorithmPreset.F32_F32_F32``, ``BF16_BF16_F32``, a ``DotAlgorithm``)
    names the operand types itself: it runs as written too. The default precision
    (``None``, ``DotAlgorithmPreset.DEFAULT``) and lower ones are painted by the lists.
    """
    keep = [n.id for n in g.nodes if n.eqn is not None and p.processes(n) and _asks_float32(n.eqn)]
    _keep_float32(g, p, keep, "keep_highest_precision_float32")


def keep_kernels_as_written(g: Graph, p: Painting) -> None:
    """A kernel runs as written: an equation holding a body that is no program of arrays
    (a Pallas kernel over Refs, ``run_state``, a loop writing a ``jax.new_ref`` array: see
    ``equations.sealed``). Our addition (TF has no kernels in its graphs): its body is its
    author's precision decision and is never re-emitted, and its operands are cast back to
    the dtypes it was traced with. Recorded so that ``explain`` says why."""
    keep = [n.id for n in g.nodes if n.eqn is not None and p.processes(n) and sealed(n.eqn)]
    _keep_float32(g, p, keep, "keep_kernels_as_written")


#: Structural vertices a state chain runs through: an inner loop's result linear in the state,
#: a ``cond`` choosing between new and old, a scan's slices of a stacked state and the stacked
#: updates (a scan over layers with each layer's running statistics).
_STATE_VERTICES = ("<carry>", "<cond-output>", "<xs>", "<ys>")


#: Keys of the increment's linear tail (``- lr * g``, ``dt / 6 * (k1 + 2 * k2 + ...)``).
_INCREMENT_KEYS = frozenset(
    {"add", "sub", "add_any", "neg", "mul", "div", "convert_element_type", "select_n"}
)


def state_chain(
    g: Graph, states: frozenset[int], roots: list[int], owns: frozenset[int] = frozenset()
) -> list[int]:
    """The chain carrying ``states`` to ``roots``: the nodes linear in them on the way up from
    ``roots`` (``owns``: the loop carries holding them)."""

    def in_chain(v: Node) -> bool:
        linear = bool(states & v.origin.derived) and (v.eqn is not None or v.key in _STATE_VERTICES)
        return v.id in owns or linear

    return _walk_up(g, roots, in_chain)


def recurrence_chains(g: Graph) -> list[list[int]]:
    """Per float32 loop carry the body updates from itself (``LoopState.recurrent``), the
    chain from the carries of its cycle to its next value."""
    carries = {ls.state: ls.carry for ls in g.loop_states}
    return [
        state_chain(g, ls.cycle, [ls.root], frozenset(carries[s] for s in ls.cycle))
        for ls in g.loop_states
        if ls.recurrent and g.nodes[ls.carry].float32
    ]


def _keep_state_chain(g: Graph, p: Painting, chain: list[int]) -> None:
    """Keeps float32 a state's ``chain`` (see :func:`state_chain`) and the linear tail of
    what is added to it."""
    members = set(chain)
    starts = [f for i in chain for f in g.nodes[i].fanin if f not in members]

    def in_tail(v: Node) -> bool:
        if v.eqn is None or v.key not in _INCREMENT_KEYS or not v.float32:
            return False
        return not (v.key in ("mul", "div") and _products(v) > 1)

    tail = _dfs(starts, _fanin, g.nodes, lambda v, r: in_tail(v))
    _keep_float32(g, p, chain + tail, "keep_state_updates_float32")


def _products(n: Node) -> int:
    """How many operands of a product or quotient are arrays (not literals, not scalars):
    ``lr * g`` is a scaling, ``mean * mean`` a product."""
    return sum(1 for a in n.eqn.invars if not jc.is_literal(a) and getattr(a.aval, "shape", ()))


#: What a step size reaches an increment through, above it: casts, sign, data movement.
_STEP_PASSES = frozenset(
    {"convert_element_type", "neg", "copy", "copy_p", "broadcast_in_dim", "reshape"}
    | {"squeeze", "expand_dims"}
)


def stepped(g: Graph, state: int, root: int, rank: int) -> bool:
    """Whether ``root`` (a node of ``g``, linear in and updating ``state``, of rank
    ``rank``) updates it by a *step*: scaled by a step size.

    Asked of an output with leading axes over its state (see ``origins.updates_state``), where a
    bias broadcast onto activations is as linear as a batched step. A step size is a factor
    constant over the state's axes (:func:`_step_factor`: a literal, a scalar, a value per
    batch element), and it scales the update *at its top*, on the chain from the state to
    ``root``, either

    * the increment an addition adds to the chain (through :data:`_STEP_PASSES`), or a
      factor of that product (``- lr * g``, ``- 0.01 * mu / (sqrt(nu) + eps)``,
      ``(1 - m) * stat``, ``dt / 6 * (k1 + ...)``, ``(g - c) / 100``); or
    * the chain itself, by a literal or scalar (``m * old`` in an EMA or a momentum
      buffer, AdamW's ``- lr * (d + wd * p)``).

    A bias is added to activations whose top factor spans its axes (batch norm's
    ``(x - mean) * inv * scale + b``, layer norm's, ``x @ w + b``): no step. Not told apart
    from a step: an output that is a bias plus activations scaled by such a factor
    (``0.5 * x + b``, ``(x - mean) * rsqrt(var) + b`` with no scale, ``mean(x, 1) + b``),
    kept float32 as a state though none (that add and scaling only; no accuracy is lost).
    """
    nodes = g.nodes
    chain = set(_walk_up(g, [root], lambda v: state in v.origin.derived))  # linear in state
    for i in chain:
        n = nodes[i]
        name = n.eqn.primitive.name if n.eqn is not None else None
        if name in ("mul", "div") and _step_factor(n, nodes, rank, chain, per_row=False):
            return True
        if name in COMBINES or name in SCATTER_COMBINES:
            if any(_scaled(nodes, f, rank) for f in n.fanin if f not in chain):
                return True
    return False


def _scaled(nodes: list[Node], i: int, rank: int, top: bool = True) -> bool:
    """Whether node ``i`` is, through :data:`_STEP_PASSES`, a product or quotient by a step
    size (:func:`_step_factor`), or ``top``, one by a product by a scalar (``0.01 * mu / d``:
    a quotient of a scaled ``mu``). Below the top, a value per row is no step size: layer
    norm's ``(x - mean) * (rsqrt(var) * scale)`` is a product by a per-row factor too."""
    n = nodes[i]
    while n.eqn is not None and n.eqn.primitive.name in _STEP_PASSES and len(n.fanin) == 1:
        n = nodes[n.fanin[0]]
    if n.eqn is None or n.eqn.primitive.name not in ("mul", "div"):
        return False
    if _step_factor(n, nodes, rank, per_row=top):
        return True
    return top and any(_scaled(nodes, f, rank, top=False) for f in n.fanin)


def _step_factor(
    n: Node,
    nodes: list[Node],
    rank: int,
    skip: frozenset[int] | set[int] = frozenset(),
    per_row=True,
) -> bool:
    """Whether product or quotient ``n`` (a divisor only, for a quotient) has a step size for
    a factor: a literal or scalar (``lr``), or, ``per_row``, a value constant over the
    trailing ``rank`` axes (a state's): one per leading index (``vmap`` over learning rates:
    ``[B, 1]``, or ``[B]`` broadcast). Nodes ``skip`` (the state's chain) are no factor."""
    out = n.eqn.outvars[0].aval.shape
    div = n.eqn.primitive.name == "div"
    for a in n.eqn.invars[1:] if div else n.eqn.invars:
        shape = getattr(a.aval, "shape", None)
        if shape == () or (per_row and _constant_over(shape, out, rank)):
            return True
    for f in () if div else n.fanin:  # an operand broadcast to the full shape first
        b = nodes[f]
        if f in skip or b.eqn is None or b.eqn.primitive.name != "broadcast_in_dim":
            continue
        shape, dims = b.eqn.invars[0].aval.shape, b.eqn.params["broadcast_dimensions"]
        lead = len(b.eqn.outvars[0].aval.shape) - rank
        if shape == () or (per_row and all(k == 1 for k, d in zip(shape, dims) if d >= lead)):
            return True
    return False


def _constant_over(shape: tuple[int, ...] | None, out: tuple[int, ...], rank: int) -> bool:
    """Whether an elementwise operand of shape ``shape`` (broadcast to ``out`` by its size-1
    axes) takes one value along the trailing ``rank`` axes: ``[B, 1]`` against ``[B, D]``."""
    if shape is None or len(shape) != len(out):
        return False
    return all(size == 1 for size in shape[max(len(shape) - rank, 0) :])


def keep_state_updates_float32(g: Graph, p: Painting) -> None:
    """State is updated in float32: across steps (program outputs) and across iterations.

    Our addition; TF keeps float32 what its stateful ops update (``AssignMovingAvg``, fused
    batch norm's running statistics are on no list), and its functional ``While`` (on no
    float16 list) crosses its loop boundary in float32. Two kinds of state:

    * an output computed from the input of its shape (or of it with leading axes added,
      ``origins.updates_state``, when a step size scales the update, :func:`stepped`)
      linearly, combined with something else
      (``new = m * old + (1 - m) * stat``: a running average, an EMA, an SGD step): it would
      be re-rounded to half every step and drift. An output reached from the input through a
      nonlinear function (``tanh(x @ w) + sigmoid(y)``) is no state update: TF's colours;
    * a loop carry whose next value the body computes linearly from the carry itself
      (``y + dt / 6 * (k1 + 2 k2 + 2 k3 + k4)``, ``p - lr * g``, ``where(ok, new, old)``,
      ``m * ema + (1 - m) * x``): as TF's v2 loop variables, it stays float32, instead of
      being rounded every iteration (the carry and its chain in the body; see
      :class:`~jmp_rewrite._src.trace.graph.LoopState`).

    The chain from the state to the new value keeps float32, and so does the linear tail of
    the increment (sums and scalings by constants: ``- 3e-3 * g``, ``dt / 6 * (...)``), so
    that a learning rate or a step size is not rounded either; what flows into it (``g``,
    the ``k``: matmuls, activations) is still computed in half.
    """
    roots_by_input: dict[int, list[int]] = {}
    for src, _, aval in g.outputs:
        if src is None or not is_f32(aval.dtype):
            continue
        for j in g.nodes[src].origin.updates:
            inp = g.input_avals[j] if j < len(g.input_avals) else None
            if inp is None or not is_f32(inp.dtype) or not updates_state(inp.shape, aval.shape):
                continue
            if inp.shape == aval.shape or stepped(g, j, src, len(inp.shape)):
                roots_by_input.setdefault(j, []).append(src)
    for j, roots in roots_by_input.items():
        _keep_state_chain(g, p, state_chain(g, frozenset({j}), roots))
    for chain in recurrence_chains(g):
        _keep_state_chain(g, p, chain)


def half_accumulating_carries(g: Graph, p: Painting) -> dict[int, tuple[int, ...]]:
    """Loop carries painted half precision whose next value adds to them: carry id -> the
    nodes on the elementwise path from the carry through an addition to its next value.

    The state pass keeps a carry float32 when the body computes it *linearly* from itself;
    one that adds to itself through a nonlinear op (``tanh(c + x)``, ``norm(h + f(h))``, an
    unknown primitive) is left to TF's colours and is rounded to half every iteration.
    ``explain``'s lint and ``compare`` name these, in case one of them is state.
    """
    found = {}
    for ls in g.loop_states:
        n = g.nodes[ls.carry]
        if ls.carry not in p.allow or not n.float32 or ls.root is None or ls.root == ls.carry:
            continue
        body = set(ls.body)

        def elementwise(v: Node, r: int, body: set[int] = body) -> bool:
            return v.id in body and v.listed_kind != ALLOW

        # From the carry forward, and back from its next value (a matmul's result is none:
        # an RNN's ``h @ w``, its backward pass's ``ct @ w.T``, reach it through the matmul).
        ahead = set(_dfs([ls.carry], _fanout, g.nodes, lambda v, r: v.id == r or elementwise(v, r)))
        path = [i for i in _dfs([ls.root], _fanin, g.nodes, elementwise) if i in ahead]
        if any(g.nodes[i].key in COMBINES for i in path):
            found[ls.carry] = tuple(sorted(path))
    return found


#: Keys a normalization statistic is computed through above its reductions: the squares of
#: ``E[x**2]`` or ``E[(x - mean)**2]`` and the mean they centre on are taken in float32 too,
#: as Flax casts for them.
_STATISTIC_INPUTS = frozenset(
    {"square", "integer_pow", "mul", "sub", "div", "convert_element_type", "broadcast_in_dim"}
    | {"reshape", "squeeze", "expand_dims"}
)


_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "cumsum"})


def keep_normalization_statistics_float32(g: Graph, p: Painting) -> None:
    """Normalization statistics -- mean, variance and their ``rsqrt`` -- stay float32, and
    spread no deny.

    TF's ``FusedBatchNorm*`` computes them in float32 whatever ``T`` is (its ``U``
    attribute), and Flax casts to float32 for them; in a float32 program that cast is a
    no-op that never reaches the jaxpr, so without this pass the bfloat16 lists (Sum, Rsqrt
    infer) compute ``E[x**2] - E[x]**2`` in half. From every ``rsqrt``, the chain back to
    the reductions (and, past them, the squares and centring they sum) keeps float32; allow
    ops (the matmul or conv producing ``x``) and any other op past a reduction stop it.

    The fused op is *infer* on TF's float16 list (Keras's ``LayerNormalization`` runs
    through it too): its statistics, float32 inside, never make the normalized activations
    float32. Decomposed, the float16 lists' ``reduce_sum`` (TF ``Sum``/``Mean``) is deny, and
    kept float32 here it would still spread deny through the normalization, the residual add
    and the ReLU, storing the residual stream in float32 beside its half copy (ResNet-50
    float16: +1.10 GiB on an H200). So the statistics kept float32 are unlisted: float32,
    spreading nothing, as inside TF's fused op.
    """

    def eligible(n: Node) -> bool:  # kept float32 by another pass or not, as long as paintable
        return n.eqn is not None and n.unit is None and not n.region and n.listed_kind != ALLOW

    # Below the reductions: the nodes between an rsqrt and the reductions it reads. An
    # rsqrt that no reduction feeds is no statistic and is left to the lists.
    leads: dict[int, bool] = {}  # node -> a reduction is reachable upwards through eligibles

    def reaches_reduction(v: int) -> bool:
        stack, order = [v], []
        while stack:
            u = stack.pop()
            if u in leads:
                continue
            leads[u] = False  # provisional (cycles through loop carries are not eligible)
            order.append(u)
            n = g.nodes[u]
            if n.key not in _REDUCTIONS:
                stack.extend(f for f in n.fanin if eligible(g.nodes[f]))
        for u in reversed(order):
            n = g.nodes[u]
            leads[u] = n.key in _REDUCTIONS or any(leads.get(f, False) for f in n.fanin)
        return leads[v]

    keep: list[int] = []
    reductions: list[int] = []
    for root in (n.id for n in g.nodes if n.key == "rsqrt" and eligible(n)):
        if not reaches_reduction(root):
            continue
        for v in _walk_up(g, [root], lambda n: eligible(n) and leads.get(n.id, False)):
            keep.append(v)
            if g.nodes[v].key in _REDUCTIONS:
                reductions.append(v)
    # Above the reductions: the squares and the centring they sum.
    keep += _walk_up(
        g,
        reductions,
        lambda n: eligible(n) and (n.key in _STATISTIC_INPUTS or n.key in _REDUCTIONS),
    )
    _keep_float32(g, p, keep, "keep_normalization_statistics_float32")
    for i in keep:
        if p.kind_of(g.nodes[i]) == DENY:
            p.released[i] = "keep_normalization_statistics_float32"


#: Functions whose limit at +-Inf is finite and exact (``tanh(inf) == 1``).
_SATURATING = frozenset({"tanh", "logistic", "erf"})


#: Powers TF calls ``Pow`` (deny in float16): they overflow half before their input does.
_POWERS = frozenset({"integer_pow", "polynomial"})


_CHAIN_LIMIT = 8


def _saturates(g: Graph, v: int) -> bool:
    """Whether ``v``'s value only ever reaches a saturating function, unshared and with an
    infinity kept infinite on the way: each step is the one reader of the last, and is a
    product with a nonzero literal or a sum or difference with one other operand."""
    for _ in range(_CHAIN_LIMIT):
        n = g.nodes[v]
        if len(n.fanout) != 1 or n.feeds_output:
            return False
        c = g.nodes[n.fanout[0]]
        if c.key in _SATURATING:
            return True
        if c.eqn is None or c.fanin.count(v) != 1:
            return False
        if c.key == "mul":
            literals = [a for a in c.eqn.invars if jc.is_literal(a)]
            if len(c.fanin) != 1 or len(literals) != len(c.eqn.invars) - 1:
                return False
            if not all(np.all(np.asarray(jc.literal_value(a)) != 0) for a in literals):
                return False
        elif c.key not in ("add", "sub"):
            return False
        v = c.id
    return False


def release_saturated_powers(g: Graph, p: Painting) -> None:
    """A power that only feeds a saturating function spreads no deny.

    No TF pass; TF has no GELU op. The tanh-GELU, ``0.5 x (1 + tanh(c (x + 0.044715
    x**3)))``, holds an ``x**3``: TF ``Pow``, deny on the float16 list, as it overflows half
    for |x| > 40. Deny spread from it keeps the whole GELU float32, forward and backward, and
    its float32 tanh is stored for the backward pass beside the half activations (GPT-2
    small, float16: +2.25 GiB on an H200 over the hand-written model). But the power's value
    reaches only the tanh, through a scaling and a sum, and there an overflow is harmless:
    an infinite argument gives ``tanh = +-1`` exactly, GELU's own limit (``x`` or ``0``),
    which is what a hand-written float16 GELU computes. Such a power is unlisted instead:
    computed in float32, spreading nothing; the rest of the GELU follows its neighbours.
    A power whose value is read anywhere else (or an output) stays deny.
    """
    for n in g.nodes:
        if p.kind_of(n) == DENY and n.key in _POWERS and p.processes(n) and _saturates(g, n.id):
            p.released[n.id] = "release_saturated_powers"
            p.painted_by[n.id] = "release_saturated_powers"


def keep_float32_reads_unrounded(g: Graph, p: Painting) -> None:
    """A float32 value read in float32 is never a round trip through half precision.

    Differs from TF on purpose. Pass 5 paints a clear op half when a half op is next to it,
    either way: the ``broadcast_in_dim`` of a LayerNorm scale, shared by the forward float32
    ``mul`` and the backward half ``mul``, becomes half, and TF's
    ``ChangeTypeAttrsAndAddCasts`` would cast the float32 parameter to half before it and
    back to float32 for the float32 reader: a silent rounding of a float32 computation
    (GPT-2's first LayerNorm). Here a clear op painted half with no half input -- data
    movement of float32 values -- stays float32 when a float32 op (or an output) reads it,
    with the clear ops above it that have no half input either; its half readers cast after
    it instead. As many casts, nothing rounded that was not rounded before.

    A clear op moves half values when a half value reaches it through clear ops painted half
    from an op computing in half; found by reachability, not in graph order (a ``cond``
    output's node precedes its branches' nodes, a loop carry its body's). A ``cond`` output
    moves half values only when every branch hands it one: ``y = cond(flag, lambda h: h,
    lambda h: h @ w2, exp(x))`` is ``exp(x)`` itself when ``flag`` holds, so read in float32
    it stays float32 (the matmul's branch casts up, exactly) instead of coming back rounded.
    A branch handing on a program input or a constant as is (``lambda s: s`` beside an
    update computed in half) hands on a float32 value too (``Graph.outside_handoffs``).

    A ``select_n`` chooses as a ``cond`` does, element by element: ``where(ok, update(s),
    s)``, ``lax.select``, ``select_n`` of several cases, and a ``cond`` of a batched predicate
    under ``vmap``, which JAX runs as both branches and a ``select_n`` of their results. It
    moves half values only when every case that is a value hands it one: a case that is a
    program input, or a float32 value (a copy of an input, a loop carry handed on, a value
    computed in float32), is one of the values it hands on, and read in float32 the select
    stays float32 (the half cases cast up, exactly). Its constant cases (``Origin.frozen``:
    a mask's fill in ``where(m, scores, -1e9)``) are no values here: they take the select's
    type, as a literal does, so a masked score stays half beside its matmul.
    """
    copies = _moves_float32(g, p)  # clear ops painted half that move float32 values
    read_in_float32 = [
        v
        for v in copies
        if g.nodes[v].feeds_output or any(c not in p.allow for c in g.nodes[v].fanout)
    ]
    for v in _walk_up(g, read_in_float32, lambda n: n.id in copies):
        p.allow.discard(v)
        p.painted_by[v] = "keep_float32_reads_unrounded"


#: Clear vertices whose value is one of their inputs': a ``cond``'s output (a branch's
#: result) and ``select_n`` (``where``, ``lax.select``, a ``cond`` of a batched predicate
#: under ``vmap``, which runs both branches and selects their results).
_CHOICES = ("<cond-output>", "select_n")


def _all_half(g: Graph, n: Node, half: set[int]) -> bool:
    """Whether every value choice ``n`` picks from is a half value; a select's constant cases
    (a mask's fill: ``Graph.choice_cases``) take its type, as a literal does."""
    return all(f in half for f in g.choice_cases.get(n.id, n.fanin))


def _moves_float32(g: Graph, p: Painting) -> set[int]:
    """The clear ops painted half that no half value reaches (see
    :func:`keep_float32_reads_unrounded`): a worklist from the ops computing in half, through
    clear ops painted half; a ``cond`` output is reached once all its inputs are."""
    half_clear = {n.id for n in g.nodes if n.id in p.allow and p.kind_of(n) == CLEAR}
    half = {n.id for n in g.nodes if n.id in p.allow and p.kind_of(n) != CLEAR}
    todo = list(half)
    while todo:
        for c in g.nodes[todo.pop()].fanout:
            n = g.nodes[c]
            if c not in half_clear or c in half:
                continue
            if n.key in _CHOICES and (c in g.outside_handoffs or not _all_half(g, n, half)):
                continue  # some branch or case hands on a float32 value (an input, a constant)
            half.add(c)
            todo.append(c)
    return half_clear - half


def inherit_unit_colours(g: Graph, p: Painting) -> None:
    """A fused unit (``jit:log_softmax``...) runs in the colour of its node.

    Its deny pieces (the ``exp`` and ``reduce_sum`` of a log-softmax) keep float32 even when
    the unit is half precision: TF's fused half kernels accumulate in float32 too.
    """
    for n in g.nodes:
        if n.unit is not None and n.float32 and n.unit in p.allow and n.listed_kind != DENY:
            p.allow.add(n.id)
            p.painted_by[n.id] = p.painted_by.get(n.unit, "unit")


def find_big_values(g: Graph, p: Painting) -> None:
    """Records the nodes holding *big* values, for the emitter to saturate; paints nothing.

    Differs from TF on purpose (TF clamps nothing: a ``-1e9`` mask is ``-inf`` in its half
    ``Add``). A mask fill beyond the half range (``finfo(float32).min``, ``-1e9`` in
    float16), the bias built from it (``(1 - m) * fill``, ``where(m, 0, fill)``, a
    relative-position or ALiBi bias plus it), the scores it is added to and what keeps
    their magnitude downstream -- a scaling, the softmax's row maximum and ``x - max`` --
    are *big* (``Origin.big``): the forward nodes reached from a big one through ops that
    keep an operand's magnitude (``origins.carries_magnitude``; loop carries and ``cond``
    outputs included, so a mask crossing any boundary stays big). They are painted by TF's
    rules; where one runs in half, the elements a constant put out of range hold the half
    type's largest finite value, with the constant's sign (``masking``). Backward
    (transposed) nodes are never big: a gradient overflows honestly.
    """
    seeds = [n.id for n in g.nodes if n.origin.big and not n.backward]
    big = _dfs(
        seeds,
        _fanout,
        g.nodes,
        lambda v, r: v.id == r or (not v.backward and carries_magnitude(v.key)),
    )
    p.big.update(big)
