"""Where values come from, as the painting graph tracks it: copies, constants, state.

A value no float input reaches (computed from constants and integer or boolean values: a
padding bias built from an ``attention_mask``) is *frozen*, and clamped to the half range when
cast, as a constant is (see :attr:`Origin.frozen`). A value a constant beyond the half range
reaches forward through ops that keep its magnitude (a mask fill ``-1e9`` or
``finfo(float32).min``, the bias built from it and the scores it is added to) is *big*
(:attr:`Origin.big`, :func:`big_seed`): the painter keeps it float32
(``paint_additions.keep_masked_values_float32``) and its casts into half saturate where the
constant put it out of range (``masking``).

A program input is a *state* when an output of its shape is computed from it linearly and
combined with something else (``new = m * old + (1 - m) * stat``: an EMA, an SGD step), or
of its shape with leading axes added (:func:`updates_state`: the update batched by
``rewrite(vmap(f))`` or stacked by a scan, the state unbatched) when a step size scales
the update at its top (``paint_additions.stepped``: a bias broadcast onto activations is
none); a loop carry is one inside its body (:class:`LoopState`). :class:`Origin` records, per
value, the input it copies, and the states it is linear in and updates; the painter keeps such
chains float32 (``paint_additions.keep_state_updates_float32``) and outputs that copy an input exact
(``paint.keep_output_copies_float32``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from jmp_rewrite._src.lists.op_lists import ANNOTATIONS


def _is_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


@dataclasses.dataclass(frozen=True)
class Origin:
    """What the graph knows of where a value comes from.

    Attributes:
      const: a constant: a literal, a jaxpr const, or computed from constants only.
      frozen: computed from constants and integer or boolean values only: no float input
        (parameter, activation, loss scale, cotangent) reaches it, so nothing differentiates
        through it and no gradient is one. Such a value is a constant, a mask or a bias
        built from one (``(1.0 - mask) * finfo(float32).min``, ``where(keep, 0.0, -1e9)``),
        positions, a one-hot: it is clamped to the half range when cast, never turned into
        infinity (see ``emit.clamp``), while computed values overflow honestly.
      copy_of: the program input this value is an exact copy of (through calls, loop carries
        passed on unchanged and clear ops of it alone: reshape, transpose, ...), or None.
      derived: states (program inputs, then loop carries: see :class:`LoopState`) this value
        is a *linear* function of, or holds elements of: through additions, subtractions,
        negations, casts and products or quotients by values not derived from the same state
        (``m * old``, ``-lr * g``), through data movement (reshapes, transposes, slices,
        concatenations, scatters: ``ravel_pytree``) and through selections, which pick
        elements by data (``where(ok, new, old)``, ``top_k``, ``sort``, ``max``, clips). A
        nonlinear function (``tanh(old)``, ``old * old``, ``0.5 / old``) is not state
        handed on.
      updates: those of ``derived`` that an addition or subtraction has combined with
        something else on the way (``new = a * old + b * f(x)``: a state update); a value
        moved or selected from an update is one still (``clip(p - lr * g, -c, c)``, a
        projected step; ``top_k(scores[:, None] + log_probs)``, a beam search's scores).
      big: a forward value a constant beyond the half range reaches through ops that keep
        its magnitude (see :func:`big_seed`): a mask fill, a bias built from it, scores the
        bias is added to; kept float32, saturated where a cast into half must take it.
    """

    const: bool = False
    frozen: bool = False
    copy_of: int | None = None
    derived: frozenset[int] = frozenset()
    updates: frozenset[int] = frozenset()
    big: bool = False


NOWHERE = Origin()
CONST = Origin(const=True, frozen=True)
#: A constant holding a finite value beyond the half range (a mask fill).
BIG_CONST = Origin(const=True, frozen=True, big=True)
#: Primitives that combine an old value with a new one in a state update.
COMBINES = ("add", "sub", "add_any")
#: Elementwise primitives whose result is linear in each operand of its shape (a product or
#: quotient only in an operand the other factor is not derived from: see ``Origin.derived``).
_LINEAR = frozenset(
    {*COMBINES, "neg", "mul", "div", "convert_element_type", "copy", "copy_p"}
    | {"reduce_precision", "nonbatchable"}
)


#: Data movement: each element of the result is an element of a float operand (or a fill
#: value), so the result is linear in every state its operands are, whatever the shapes:
#: ``ravel_pytree``'s flat vector, an ODE state updated as ``y.T + dt * k.T`` or in slices
#: (``dynamic_update_slice``, ``concatenate``). Placing a value is no update: a KV cache
#: written with ``dynamic_update_slice`` is not state that accumulates (see ``LoopState``).
_MOVES = frozenset(
    {"reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim", "rev", "slice"}
    | {"dynamic_slice", "dynamic_update_slice", "gather", "scatter", "concatenate", "pad", "split"}
    | set(ANNOTATIONS)
    | {"stack", "unstack", "tile", "broadcast_to", "all_gather", "all_gather_invariant"}
    | {"sharding_constraint", "layout_constraint", "optimization_barrier"}
)
#: Selection: each element of the result is an element of a float operand (or a constant)
#: *picked by data*, as a gather by computed indices is: ``top_k``'s values and ``sort`` (beam
#: search's ``top_k(scores[:, None] + log_probs)``), ``max``/``min``/``reduce_max``/``cummax``,
#: ``where`` (``select_n``), clips (``clamp``). Picking moves values as placing does, so a
#: selection hands on the states its operands hold, and an update stays one (``top_k`` of an
#: accumulation, ``clip(p - lr * g, lo, hi)``, ``where(ok, new, old)``); a selection alone
#: adds nothing, so a running maximum (``max(m, x)``) is no update (see ``leaf_origin``).
#: A multi-operand ``sort`` is taken whole: each output is said to hold every operand's states.
_SELECTIONS = frozenset(
    {"select_n", "select_if_vmap", "max", "min", "clamp", "reduce_max", "reduce_min"}
    | {"cummax", "cummin", "top_k", "approx_top_k", "sort", "scatter-max", "scatter_max"}
    | {"scatter-min", "scatter_min", "reduce_window_max", "reduce_window_min", "pmax", "pmin"}
)
#: ``operand.at[i].add(updates)``: an addition, placed.
SCATTER_COMBINES = frozenset({"scatter-add", "scatter_add", "scatter-sub", "scatter_sub"})
#: Primitives whose result is linear in (or holds elements of) the states of its operands.
LINEAR_OR_MOVING = _LINEAR | _MOVES | _SELECTIONS | SCATTER_COMBINES


@dataclasses.dataclass(frozen=True)
class LoopState:
    """A float carry of a ``while``/``scan`` loop seen from inside its body.

    The body reads the carry as a state (its id ``state`` in :attr:`Origin.derived`, after the
    program inputs' ids) and hands ``root`` back as its next value, of origin ``origin``.
    When the body updates the carry from itself (``state`` in ``origin.updates``, directly or
    through other carries: :func:`recurrent_states`), it is a recurrence (an accumulator, an
    ODE state, parameters trained in the loop): rounding it to half precision every
    iteration would compound, so the painter keeps it float32 (see
    ``paint.keep_state_updates_float32``). A carry the body only places values into (a KV
    cache) or hands on is no recurrence: each value is rounded once, as by hand.

    Attributes:
      state: the carry's state id.
      carry: its ``<carry>`` node.
      root: the source node of the body's result for it (None: a literal or a non-node).
      origin: the origin of that result.
      body: the ids of the nodes of the loop's bodies.
      cycle: the states of the carries on the cycle through which the body updates this
        carry from itself (with ``state``; see :func:`recurrent_states`), empty if none.
    """

    state: int
    carry: int
    root: int | None
    origin: Origin
    body: range
    cycle: frozenset[int] = frozenset()

    @property
    def recurrent(self) -> bool:
        return bool(self.cycle) and self.root is not None and self.root != self.carry


def updates_state(state: tuple[int, ...], output: tuple[int, ...]) -> bool:
    """Whether an output of shape ``output`` that updates (see :attr:`Origin.updates`) an
    input of shape ``state`` is a new value of that state: of its shape, or of its shape with
    leading axes added, an array state broadcast or stacked along with its update
    (``vmap(step)`` with the state unbatched: ``[D] -> [B, D]``; a scan's ``ys`` stacking
    per-iteration updates: ``[D] -> [T, D]``). Each element is still the state's value
    updated, and rounding it loses what rounding the state would. A scalar input is no
    state of a larger output: a learning rate or a step size scales every element."""
    if output == state:
        return True
    return len(state) > 0 and len(output) > len(state) and output[-len(state) :] == state


def recurrent_states(states: list[int | None], results: list[Origin]) -> dict[int, frozenset[int]]:
    """The carries a loop's body updates from themselves, each with the states of its cycle.

    Carry ``t``'s next value is linear in carry ``s`` when ``s`` is in its ``derived``, an
    update of it when in its ``updates``. A carry is recurrent when it lies on a cycle of
    such links with an update on it: ``y' = y + dt * k`` (a cycle of one), or a two-step
    method's ``(a, b) -> (b, a + 2 h f(b))``, whose ``b`` is an update of ``a`` and ``a`` a
    copy of ``b``: rounding either every iteration compounds.
    """
    local = [s for s in states if s is not None]
    derived = {s: o.derived for s, o in zip(states, results, strict=True) if s is not None}
    updates = {s: o.updates for s, o in zip(states, results, strict=True) if s is not None}
    # reach[s]: the carries whose next value is linear in s, through any chain of carries
    succ: dict[int, list[int]] = {s: [] for s in local}
    for t in local:
        for s in derived[t]:
            if s in succ:
                succ[s].append(t)
    reach = {}
    for s in local:
        seen, todo = {s}, [s]
        while todo:
            for t in succ[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        reach[s] = seen
    cycles: dict[int, set[int]] = {}
    for t in local:
        for s in updates[t] & set(local):  # t's next value updates s; a cycle if t leads to s
            if s in reach[t]:
                on_cycle = {u for u in reach[t] if s in reach[u]}
                for u in on_cycle:
                    cycles.setdefault(u, set()).update(on_cycle)
    return {s: frozenset(c) for s, c in cycles.items()}


def select_origin(origins: list[Origin]) -> Origin:
    """The origin of a value that is one of several (a ``cond``'s branches' results)."""
    copies = {o.copy_of for o in origins}
    derived = frozenset().union(*(o.derived for o in origins))
    return Origin(
        const=all(o.const for o in origins),
        frozen=all(o.frozen for o in origins),  # a constant in one branch only is none
        copy_of=copies.pop() if len(copies) == 1 else None,
        big=any(o.big for o in origins),
        derived=derived,
        updates=frozenset().union(*(o.updates for o in origins)) & derived,
    )


def leaf_origin(eqn: Any, listed: str, ins: list[Origin]) -> Origin:
    """The origin of the outputs of a leaf equation on list ``listed`` whose operands have
    origins ``ins``."""
    const = all(o.const for o in ins)
    frozen = all(o.frozen for o in ins)  # integer and boolean values are (graph._scope)
    floats = [o for a, o in zip(eqn.invars, ins, strict=True) if _is_float(a.aval.dtype)]
    copies = {o.copy_of for o in floats}
    copy_of = copies.pop() if listed == "clear" and len(copies) == 1 and floats else None
    derived: frozenset[int] = frozenset()
    updates: frozenset[int] = frozenset()
    name = eqn.primitive.name
    if (name in _MOVES or name in _SELECTIONS or name in SCATTER_COMBINES) and eqn.outvars:
        per = [o.derived for a, o in zip(eqn.invars, ins, strict=True) if _is_float(a.aval.dtype)]
        derived = frozenset().union(*per)
        updates = frozenset().union(*(o.updates for o in ins)) & derived
        if name in SCATTER_COMBINES:
            updates |= frozenset(j for j in derived if any(j not in d for d in per))
        return Origin(const=const, frozen=frozen, copy_of=copy_of, derived=derived, updates=updates)
    if name in _LINEAR and eqn.outvars:
        shape = getattr(eqn.outvars[0].aval, "shape", None)
        # per operand, the states it hands on (an operand of another shape: none)
        per = [
            o.derived
            if _is_float(a.aval.dtype) and _spans(getattr(a.aval, "shape", None), shape)
            else frozenset()
            for a, o in zip(eqn.invars, ins, strict=True)
        ]
        if name == "mul" and len(per) == 2:
            derived = per[0] ^ per[1]  # old * old is not linear in old
        elif name == "div" and len(per) == 2:
            derived = per[0] - per[1]  # nor is 1 / old
        else:
            derived = frozenset().union(*per)
        updates = frozenset().union(*(o.updates for o in ins)) & derived
        if name in COMBINES:
            # old + something else: every state of ``derived`` some operand lacks
            updates |= frozenset(j for j in derived if any(j not in d for d in per))
    return Origin(const=const, frozen=frozen, copy_of=copy_of, derived=derived, updates=updates)


def _spans(operand: tuple[int, ...] | None, out: tuple[int, ...] | None) -> bool:
    """Whether an elementwise operand of shape ``operand`` covers a result of shape ``out``:
    of its shape, or of its rank with axes of size one broadcast (``vmap`` of ``old - lr * g``
    with ``old`` unbatched: ``sub(old[None], lr * g)``, ``[1, D]`` against ``[B, D]``). A
    scalar (``lr * g``) is a factor, not a value the result is linear in."""
    if operand is None or out is None or len(operand) != len(out):
        return False
    return all(a in (b, 1) for a, b in zip(operand, out, strict=True))


def loop_result_origins(
    states: list[int | None], outer: list[Origin], results: list[Origin]
) -> list[Origin]:
    """The origins of a loop's results, seen from outside, from the body's ``results`` for
    carries that entered with origins ``outer`` and were read as ``states`` inside.

    A carry the body hands on unchanged stays a copy of what entered; one the body computes
    linearly from the carries is linear in what entered them, and an update of it when the
    body combined it with something else (``y + dt * k`` is an update of ``y0``).
    """
    local = frozenset(s for s in states if s is not None)
    out = []
    for state, o_in, o_out in zip(states, outer, results, strict=True):
        if o_in.copy_of is not None and o_out.copy_of == o_in.copy_of:
            o = o_in
        elif state is not None and state in o_out.derived:
            o = _seen_from_outside(o_out, states, outer, local)
        else:
            o = NOWHERE
        out.append(dataclasses.replace(o, big=o_in.big or o_out.big))
    return out


def stacked_origins(
    states: list[int | None], outer: list[Origin], carried: list[Origin], results: list[Origin]
) -> list[Origin]:
    """The origins of a scan's stacked outputs (``ys``), seen from outside, from the body's
    ``results`` for them (``carried``: its results for the carries): a copy of what was
    scanned, of a loop constant or of a carry the body hands on unchanged stays one, and a
    per-iteration update of a scanned state (``xs``: a layer's running statistics in a scan
    over layers) is an update of the stacked state. A carry the body changes is a copy of
    what entered it on the first trip only: its values stacked (an RNN's hidden states,
    ``scan(cell, h0, xs)`` with ``h0`` an argument) are no copy."""
    local = frozenset(s for s in states if s is not None)
    changed = frozenset(
        s
        for s, o_in, o_out in zip(states, outer, carried, strict=True)
        if s is not None and (o_in.copy_of is None or o_out.copy_of != o_in.copy_of)
    )
    out = []
    for o_out in results:
        o = _seen_from_outside(o_out, states, outer, local)
        copy_of = None if o_out.derived & changed else o_out.copy_of
        out.append(dataclasses.replace(o, copy_of=copy_of, big=o_out.big))
    return out


def _seen_from_outside(
    o_out: Origin, states: list[int | None], outer: list[Origin], local: frozenset[int]
) -> Origin:
    """A body result's origin in terms of what entered the loop: linear in a carry is linear
    in what entered that carry (and an update of it when the body combined it)."""
    derived, updates = o_out.derived - local, o_out.updates - local
    for s, o_m in zip(states, outer, strict=True):
        if s in o_out.derived:
            derived |= o_m.derived
            updates |= o_m.derived if s in o_out.updates else o_m.updates
    return Origin(derived=derived, updates=updates & derived)


#: Ops whose result holds an operand's magnitude (a sum, a product, a choice, a move, a
#: maximum): a constant beyond the half range in an operand may be beyond it in the result.
#: ``exp``, ``tanh``, comparisons, matmuls (computed values) and the rest do not carry it.
CARRIES_MAGNITUDE = _MOVES | SCATTER_COMBINES | _SELECTIONS | _LINEAR
CARRIES_MAGNITUDE |= {"abs", "floor", "ceil", "round", "integer_pow", "square", "sign"}
CARRIES_MAGNITUDE |= {"reduce_max", "reduce_min", "reduce_sum", "cumsum", "cummax", "cummin"}
CARRIES_MAGNITUDE |= {"argsort", "sort", "top_k", "stop_gradient", "optimization_barrier"}
#: Fused units whose result keeps an operand's magnitude (``log_softmax(-1e9) = -1e9 - lse``).
UNITS_CARRYING = frozenset({"jit:log_softmax", "jit:log_sigmoid", "jit:logsumexp"})


def carries_magnitude(key: str) -> bool:
    """Whether a node of list key ``key`` hands on an operand's magnitude (see
    :data:`CARRIES_MAGNITUDE`); structural nodes (carries, ``cond`` outputs, streams) do."""
    return key in CARRIES_MAGNITUDE or key in UNITS_CARRYING or key.startswith("<")


def beyond(value: Any, limit: float) -> bool:
    """Whether a concrete float ``value`` (a literal, a captured constant) holds a finite
    value beyond ``limit`` in magnitude, or at it: ``finfo(float16).min`` in float16 is a
    fill too (any score added to it leaves the range, or rounds it unevenly)."""
    dtype = value.dtype if hasattr(value, "dtype") else np.asarray(value).dtype
    if not jnp.issubdtype(dtype, jnp.floating):  # a PRNG key has no NumPy form
        return False
    a = np.abs(np.asarray(value).astype(np.float64))
    a = a[np.isfinite(a)]
    return bool(a.size) and float(a.max()) >= limit


def const_origin(value: Any, limit: float | None) -> Origin:
    """A literal's or a captured constant's origin: big when it holds a finite value beyond
    the half range (``limit``; None: no half type, nothing is big)."""
    return BIG_CONST if limit is not None and beyond(value, limit) else CONST


def const_origins(values: list[Any], n: int, limit: float | None) -> list[Origin]:
    """The origins of ``n`` captured constants of values ``values`` (unknown: not big)."""
    if len(values) != n:
        return [CONST] * n
    return [const_origin(v, limit) for v in values]


def big_seed(eqn: Any, ins: list[Origin], literals: list[Any], limit: float, key: str = "") -> bool:
    """Whether the outputs of forward equation ``eqn`` (list key ``key``, operand origins
    ``ins``, literal operand values ``literals``, None for variables) are *big* for a half
    type whose largest finite value is ``limit`` (see :attr:`Origin.big`).

    Why: ``(1.0 - mask) * finfo(float32).min``, ``where(m, 0.0, -1e10)``, ``jnp.full(shape,
    -1e9)``, a relative-position bias plus such a fill, the scores it is added to: float32
    holds them finite, their magnitude is the user's constant, and no half type can hold it.
    Computed in half they become infinite, and a fully masked softmax row NaN. A literal
    beyond the range (or a quotient by one below its reciprocal) starts it, and every op that
    keeps an operand's magnitude hands it on, whatever the other operands are. Every backward
    (transposed) equation -- a cotangent times the constant -- is none: it overflows honestly,
    for loss scaling to see.
    """
    name = key if key in UNITS_CARRYING else eqn.primitive.name
    if name not in CARRIES_MAGNITUDE and name not in UNITS_CARRYING:
        return False
    floats = [
        (o, v) for a, o, v in zip(eqn.invars, ins, literals, strict=True) if _is_float(a.aval.dtype)
    ]
    if name == "div" and len(floats) == 2 and floats[1][1] is not None:
        d = np.abs(np.asarray(floats[1][1], np.float64))
        if d.size and np.isfinite(d).all() and (d > 0).all() and float(d.min()) < 1.0 / limit:
            return True
    if name == "div":  # a quotient keeps its numerator's magnitude, not its divisor's
        floats = floats[:1]
    return any(o.big or (v is not None and beyond(v, limit)) for o, v in floats)
