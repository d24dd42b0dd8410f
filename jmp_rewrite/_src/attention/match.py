"""The forward attention of a scope: ``softmax(scale * q k^T + bias, masked) v``.

Matched by meaning, not by spelling: from a ``dot_general`` whose operand is a softmax
(``exp(x - max x) / sum exp(x - max x)`` over one axis, through casts, inside calls or not),
the softmax's input is followed back through elementwise steps to the ``dot_general`` of the
logits. Each step must be one of: a product or quotient by a positive constant (the scale),
the addition of a tensor (a bias: T5's relative positions, an additive mask), a selection
between the logits and a constant (a mask: ``where(mask, s, finfo.min)``, causal through
``tril`` or an iota comparison, padding from the data), or a cast. Masks and biases are
followed back through broadcasts to the array they broadcast (a ``(T, S)`` causal mask stays
``(T, S)``), so the fused call never materialises them at the logits' size.

What the fused call computes must be what the program computes: a positive scale; masks that
zero the masked weights (a fill at or below :data:`FILL_LIMIT`, or ``-inf``); one fill for all
masks; no bias after a mask; the head dims cuDNN takes. Anything else is left as written, with
the reason (:class:`Unfused`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src.attention.view import FOLDED, At, Val, View

#: A mask fill at or below this zeroes the masked weights in float32 as a fused kernel's
#: own mask does (``exp(fill - max)`` is 0 for any logit above ``fill + 104``).
FILL_LIMIT = -1e4
#: cuDNN flash attention's head dims: multiples of 8 up to 128; up to 256 on Hopper (compute
#: capability 9.0) with cuDNN 9.5 or later, when such a card is detected where the program
#: is traced (a deviceless compile knows no GPU, and JAX refuses above 128 there).
HEAD_DIM_MULTIPLE = 8
HEAD_DIM_MAX = 128
HEAD_DIM_MAX_HOPPER = 256


def head_dim_max() -> int:
    """The largest head dim fused: 256 where a Hopper card with cuDNN 9.5+ is detected."""
    found = jc.cuda_attention_target()
    if found is not None and found[0] >= (9, 0) and found[1] >= (9, 5):
        return HEAD_DIM_MAX_HOPPER
    return HEAD_DIM_MAX


#: The elementwise steps allowed between the logits and the softmax.
_STEPS = ("mul", "div", "add", "sub", "select_n", "convert_element_type")
#: Data movement a mask or bias is followed back through.
_MOVES = ("broadcast_in_dim", "reshape", "convert_element_type", "squeeze", "expand_dims")
_MAX_DEPTH = 16


class Unfused(Exception):
    """Why an attention is left as written (the message is the reason, a sentence)."""


#: A dim's meaning: a batch dim of the logits (its index), ``"t"`` (queries), ``"s"`` (keys),
#: ``"d"`` (the head dim), ``"g"`` (the query heads sharing a key/value head, grouped-query
#: attention as MaxText and Gemma write it), or None (a dim of size 1 that means nothing).
Label = int | str | None


@dataclasses.dataclass(frozen=True)
class Side:
    """A mask or bias of the logits, as the array it broadcasts from.

    Attributes:
      atom: the scope's atom holding it.
      dims: for each dim of ``atom``, its :data:`Label` (batch, ``t``, ``s``; None: size 1).
      coef: a bias's coefficient; a mask's 1.0 (keep where True) or -1.0 (where False).
      test: for a mask made boolean on the way (``where(m != 0, ...)``): the comparison
        ``(primitive, constant, constant_first)`` applied to ``atom``, else None.
      const: its value when it depends on constants only (a causal mask), else None.
    """

    atom: Any
    dims: tuple[Label, ...]
    coef: float = 1.0
    test: tuple[str, float, bool] | None = None
    const: Any = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass
class Core:
    """One forward attention of a scope (what :func:`match` finds). Every array's dims are
    given as :data:`Label` s."""

    pv: int  # index of the probabilities x values dot_general
    qk: int  # index of the logits dot_general
    eqns: set[int]  # scope equations computing o from q, k, v and the sides
    q: Any
    k: Any
    v: Any
    q_labels: tuple[Label, ...]
    k_labels: tuple[Label, ...]
    v_labels: tuple[Label, ...]
    out_labels: tuple[Label, ...]  # of the P.V dot's output
    batch: tuple[int, ...]  # the logits' batch sizes
    t: int  # queries
    s: int  # keys
    scale: float
    masks: tuple[Side, ...]
    biases: tuple[Side, ...]
    fill: float | None
    o: Any  # the P.V dot's output var
    causal: bool = False
    #: the constant mask ``causal`` stands for (still read by the program's equations)
    causal_mask: Side | None = None
    #: a mask may leave rows without keys (a data mask): the output's value there is set as
    #: float32 sets it (uniform weights for a finite fill, NaN for -inf). A bias needs no
    #: such guard: added in float32, as the program adds it, it gives float32's value.
    guard_mask: bool = False
    #: grouped-query attention: the query heads per key/value head (the queries' ``"g"`` dim)
    group: int = 1


def _same(view: View, a: Val, b: Val) -> bool:
    return view.resolve(a).key() == view.resolve(b).key()


def _strip_casts(view: View, val: Val, ats: list[At]) -> tuple[Val, At | None]:
    at = view.producer(val)
    while at is not None and at.name == "convert_element_type":
        ats.append(at)
        val = at.operand(0)
        at = view.producer(val)
    return val, at


def _row_reduction(view: View, val: Val, kind: str, ats: list[At]) -> At | None:
    """The ``kind`` reduction ``val`` broadcasts back (keepdims), through casts, a
    ``stop_gradient`` and ``max(-inf, .)`` (``jnp.max``'s initial value)."""
    at = view.producer(val)
    while at is not None:
        ats.append(at)
        if at.name == kind:
            return at
        if at.name in ("broadcast_in_dim", "reshape", "convert_element_type", "stop_gradient"):
            at = view.producer(at.operand(0))
        elif at.name == "max" and view.literal(at.operand(0)) == -math.inf:
            at = view.producer(at.operand(1))
        else:
            return None
    return None


def softmax(view: View, val: Val, ats: list[At]) -> tuple[Val, int] | None:
    """``(x, axis)`` when ``val`` is ``softmax(x, axis)`` (through casts), else None."""
    _, at = _strip_casts(view, val, ats)
    if at is None or at.name != "div":
        return None
    ats.append(at)
    e = at.operand(0)
    total = _row_reduction(view, at.operand(1), "reduce_sum", ats)
    if total is None or len(total.eqn.params["axes"]) != 1:
        return None
    summed, _ = _strip_casts(view, total.operand(0), ats)
    e_inner, exp = _strip_casts(view, e, ats)
    if (
        exp is None
        or exp.name != "exp"
        or not (_same(view, summed, e) or _same(view, summed, e_inner))
    ):
        return None
    ats.append(exp)
    sub = view.producer(exp.operand(0))
    if sub is None or sub.name != "sub":
        return None
    ats.append(sub)
    x = sub.operand(0)
    peak = _row_reduction(view, sub.operand(1), "reduce_max", ats)
    axis = int(total.eqn.params["axes"][0])
    if (
        peak is None
        or tuple(peak.eqn.params["axes"]) != (axis,)
        or not _same(view, peak.operand(0), x)
    ):
        return None
    return x, axis


def _chain(view: View, x: Val, depth: int = 0) -> tuple[At, list[tuple[At, int]]] | None:
    """From the softmax input back to the logits ``dot_general``: the steps (equation, the
    operand position the chain runs through), logits first."""
    at = view.producer(x)
    if at is None:
        return None
    if at.name == "dot_general":
        return (at, []) if at.ctx.parent is None else None
    if depth > _MAX_DEPTH:
        return None
    if at.name == "tanh" and _chain(view, at.operand(0), depth + 1) is not None:
        raise Unfused(
            "its logits are soft-capped (tanh(s / c) * c, Gemma 2's): cuDNN's flash attention "
            "has no soft-cap"
        )
    if at.name in ("transpose", "reshape"):  # data movement (JAX's own attention has some)
        if at.name == "reshape" and _ones_moved(at) is None:
            return None
        positions: tuple[int, ...] = (0,)
    elif at.name in _STEPS:
        positions = {"convert_element_type": (0,), "select_n": (1, 2)}.get(at.name, (0, 1))
    else:
        return None
    for pos in positions:
        if pos >= len(at.eqn.invars):
            continue
        operand = at.operand(pos)
        if at.name in _STEPS and operand.shape != x.shape:
            continue
        if jc.is_literal(view.resolve(operand).atom):
            continue
        found = _chain(view, operand, depth + 1)
        if found is not None:
            return found[0], [*found[1], (at, pos)]
    return None


def _ones_moved(at: At) -> bool | None:
    """True when a reshape only inserts or removes dims of size 1 (None otherwise)."""
    src, out = at.operand(0).shape, tuple(at.eqn.outvars[0].aval.shape)
    return True if [d for d in src if d != 1] == [d for d in out if d != 1] else None


def _forward_labels(at: At, labels: list[Label]) -> list[Label]:
    """The labels of ``at``'s output, given those of its chain operand."""
    if at.name == "transpose":
        return [labels[p] for p in at.eqn.params["permutation"]]
    if at.name == "reshape":
        src, out = at.operand(0).shape, at.eqn.outvars[0].aval.shape
        big = iter([labels[i] for i, d in enumerate(src) if d != 1])
        return [next(big) if d != 1 else None for d in out]
    return list(labels)


def _moved_labels(at: At, labels: list[Label]) -> list[Label] | None:
    """The labels of ``at``'s operand 0, given those of its output (a broadcast, a reshape
    of size-1 dims, a cast)."""
    src, out = at.operand(0).shape, tuple(at.eqn.outvars[0].aval.shape)
    if at.name == "convert_element_type":
        return list(labels)
    if at.name == "broadcast_in_dim":
        bd = at.eqn.params["broadcast_dimensions"]
        return [labels[bd[i]] if src[i] == out[bd[i]] else None for i in range(len(src))]
    if at.name == "transpose":
        perm = at.eqn.params["permutation"]
        back: list[Label] = [None] * len(src)
        for j, p in enumerate(perm):
            back[p] = labels[j]
        return back
    # reshape / squeeze / expand_dims: only size-1 dims inserted or removed
    if [d for d in src if d != 1] != [d for d in out if d != 1]:
        return None
    big = iter([labels[j] for j, d in enumerate(out) if d != 1])
    return [next(big) if d != 1 else None for d in src]


_TESTS = ("ne", "eq", "gt", "ge", "lt", "le")


def side(view: View, val: Val, labels: list[Label], tops: set[int]) -> Side:
    """The array a bias operand (whose dims have ``labels``) broadcasts from (see
    :func:`sides`)."""
    found = sides(view, val, labels, tops, split=False)
    return found[0]


def sides(
    view: View, val: Val, labels: list[Label], tops: set[int], split: bool = True
) -> list[Side]:
    """The arrays a mask or bias operand (whose dims have ``labels``) broadcasts from,
    through broadcasts, transposes, size-1 reshapes, casts, (for a mask) one comparison with
    a constant and (``split``) the ``and`` of masks (``tril & padding``: each its own, so a
    causal one is found); adds the scope's equations only this one reads to ``tops``."""
    dims: list[Label] = list(labels)
    test = None
    while True:
        val = view.resolve(val)
        if val.ctx.parent is None:
            atom = val.atom
            if jc.is_literal(atom) or atom in view.outvars:
                break
            if len(set(view.readers.get(atom, []))) != 1:
                break  # read elsewhere too: it stays, and is read from there
        at = view.producer(val)
        if at is None:
            break
        if split and at.name == "and" and test is None and at.eqn.invars[0].aval.dtype == bool:
            if at.ctx.parent is None:
                tops.add(at.top)
            return [s for i in (0, 1) for s in sides(view, at.operand(i), dims, tops)]
        if at.name in _TESTS and test is None and len(at.eqn.invars) == 2:
            consts = [_scalar(view, at.operand(i)) for i in (0, 1)]
            if (consts[0] is None) == (consts[1] is None):
                break
            first = consts[0] is not None
            test = (at.name, consts[0] if first else consts[1], first)
            moved: list[Label] | None = list(dims)
            nxt = at.operand(1 if first else 0)
        else:
            moved = _moved_labels(at, dims) if at.name in (*_MOVES, "transpose") else None
            nxt = at.operand(0)
        if moved is None:
            break
        if at.ctx.parent is None:
            tops.add(at.top)
        val, dims = nxt, moved
    atom = view.scope_atom(val)
    if atom is None:
        raise Unfused("a mask or bias is computed inside a call from the logits' operands")
    shape = getattr(atom.aval, "shape", ())
    dims = [d if d != "d" and shape[i] != 1 else None for i, d in enumerate(dims)]
    return [Side(atom, tuple(dims), test=test)]


def _operand_labels(shape, contract, batch, free_label, grouped=False):
    """Labels of a dot operand: its batch dims (0, 1, ...), its contracted head dim ``d``,
    its one free dim of size > 1 (``free_label``); other free dims must be of size 1. The
    queries (``grouped``) may have a second, after it: the query heads of a group (``g``)."""
    labels: list[Label] = [None] * len(shape)
    for i, b in enumerate(batch):
        labels[b] = i
    labels[contract] = "d"
    free = [d for d in range(len(shape)) if d not in (*batch, contract)]
    big = [d for d in free if shape[d] != 1] or free[-1:]
    if len(big) == 2 and grouped:
        labels[big[1]] = "g"
        big = big[:1]
    if len(big) != 1:
        return None
    labels[big[0]] = free_label
    return labels


def _layouts(
    view: View, qk: At, pv: At, p_pos: int, x_labels: list[Label], qk_labels
) -> dict[str, Any]:
    (c0, c1), (b0, b1) = pv.eqn.params["dimension_numbers"]
    pc, vc, pb, vb = (c0, c1, b0, b1) if p_pos == 0 else (c1, c0, b1, b0)
    v_atom = pv.eqn.invars[1 - p_pos]
    nb = len(qk.eqn.params["dimension_numbers"][1][0])
    p_batch = [x_labels[d] for d in pb]
    if [x_labels[d] for d in pc] != ["s"] or sorted(p_batch, key=str) != list(range(nb)):
        raise Unfused(
            "the values matmul does not contract the probabilities' keys over the logits' "
            f"batch dims (dimension numbers {pv.eqn.params['dimension_numbers']})"
        )
    v_shape = v_atom.aval.shape
    v_labels = _operand_labels(v_shape, vc[0], vb, "d")
    if v_labels is None:
        raise Unfused("the values have more than one dim besides batch and keys")
    for d, label in zip(vb, p_batch, strict=True):
        v_labels[d] = label
    v_labels[vc[0]] = "s"
    free_p = [x_labels[d] for d in range(len(x_labels)) if d not in (*pc, *pb)]
    free_v = [v_labels[d] for d in range(len(v_shape)) if d not in (*vc, *vb)]
    out_labels = [*p_batch, *(free_p + free_v if p_pos == 0 else free_v + free_p)]
    qa, ka = qk.eqn.invars[qk_labels["q"]], qk.eqn.invars[1 - qk_labels["q"]]
    d = qa.aval.shape[qk_labels["q_labels"].index("d")]
    dv = v_shape[v_labels.index("d")]
    if d != dv:
        raise Unfused(f"the values' head dim ({dv}) differs from the queries' ({d})")
    if d % HEAD_DIM_MULTIPLE or d > head_dim_max():
        raise Unfused(
            f"head dim {d}: cuDNN's flash attention takes multiples of {HEAD_DIM_MULTIPLE} up to "
            f"{head_dim_max()} ({HEAD_DIM_MAX_HOPPER} on Hopper with cuDNN 9.5 or later, when "
            "such a card is detected where the program is traced)"
        )
    for name, atom in (("queries", qa), ("keys", ka), ("values", v_atom)):
        if jc.is_literal(atom):
            raise Unfused(f"the {name} are a constant")
    out_shape = pv.eqn.outvars[0].aval.shape
    batch = [1] * nb
    for label, size in zip(out_labels, out_shape, strict=True):
        if isinstance(label, int):
            batch[label] = size
    return dict(
        q=qa,
        k=ka,
        v=v_atom,
        q_labels=tuple(qk_labels["q_labels"]),
        k_labels=tuple(qk_labels["k_labels"]),
        v_labels=tuple(v_labels),
        out_labels=tuple(out_labels),
        batch=tuple(batch),
        t=qa.aval.shape[qk_labels["q_labels"].index("t")],
        s=ka.aval.shape[qk_labels["k_labels"].index("s")],
        group=qa.aval.shape[qk_labels["q_labels"].index("g")] if "g" in out_labels else 1,
    )


def _logits_labels(qk: At, s_side: int | None) -> tuple[list[Label], dict[str, Any]] | None:
    """Labels of the logits dot's output, with its operand ``s_side`` as the keys."""
    (lc, rc), (lb, rb) = qk.eqn.params["dimension_numbers"]
    if len(lc) != 1:
        raise Unfused(
            f"the logits matmul contracts {len(lc)} dims (dimension numbers "
            f"{qk.eqn.params['dimension_numbers']})"
        )
    lhs, rhs = (a.aval.shape for a in qk.eqn.invars[:2])
    ll = _operand_labels(lhs, lc[0], lb, "t" if s_side == 1 else "s", grouped=s_side == 1)
    rl = _operand_labels(rhs, rc[0], rb, "s" if s_side == 1 else "t", grouped=s_side == 0)
    if ll is None or rl is None:
        return None
    free_l = [ll[d] for d in range(len(lhs)) if d not in (*lc, *lb)]
    free_r = [rl[d] for d in range(len(rhs)) if d not in (*rc, *rb)]
    labels = [*range(len(lb)), *free_l, *free_r]
    q = 0 if s_side == 1 else 1
    return labels, {"q": q, "q_labels": ll if q == 0 else rl, "k_labels": rl if q == 0 else ll}


def _scalar(view: View, val: Val) -> float | None:
    """The value of a scalar constant, or of one broadcast, else None."""
    return view.literal(val)


def _fold(view: View, steps: list[tuple[At, int]], spaces, tops: set[int]) -> dict[str, Any]:
    """What the steps from the logits to the softmax compute: scale, biases, masks, fill
    (``spaces``: the labels of each step's output)."""
    scale, fill = 1.0, None
    biases: list[Side] = []
    masks: list[Side] = []
    for (at, pos), labels in zip(steps, spaces, strict=True):
        name = at.name
        if name in ("transpose", "reshape"):
            continue
        if name == "convert_element_type":
            if fill is not None:
                fill = float(jc.to_numpy_dtype(fill, at.eqn.params["new_dtype"]))
            continue
        other = at.operand(1 - pos) if name != "select_n" else at.operand(3 - pos)
        if name in ("mul", "div"):
            c = _scalar(view, other)
            if c is None:
                raise Unfused(f"the logits are scaled by a computed value ({name})")
            _scalar_walk(view, other, tops)
            if name == "div" and pos != 0:
                raise Unfused("the logits divide a value")
            c = 1.0 / c if name == "div" else c
            if not (math.isfinite(c) and c > 0):
                raise Unfused(f"the logits are scaled by {c:g} (a positive finite scale is fused)")
            scale *= c
            biases = [dataclasses.replace(b, coef=b.coef * c) for b in biases]
            if fill is not None:
                with np.errstate(over="ignore"):
                    fill = float(np.float32(fill) * np.float32(c))
        elif name in ("add", "sub"):
            if name == "sub" and pos == 1:
                raise Unfused("the logits are subtracted from a value")
            if _scalar(view, other) is not None:
                continue  # softmax(x + c) == softmax(x)
            if masks:
                raise Unfused("a bias is added after the mask (mask after the bias to fuse)")
            s = side(view, other, labels, tops)
            biases.append(dataclasses.replace(s, coef=-1.0 if name == "sub" else 1.0))
        else:  # select_n(pred, case0, case1): the logits are one case, a constant the other
            if len(at.eqn.invars) != 3:
                raise Unfused("a selection between more than two values")
            f = _scalar(view, other)
            if f is None:
                raise Unfused("the masked logits are set to a computed value, not a constant")
            if fill is not None and f != fill:
                raise Unfused(f"masks with different fill values ({fill:g}, {f:g})")
            fill = f
            _scalar_walk(view, other, tops)
            if pos == 1:  # where(pred, fill, s): kept where pred is False
                found = sides(view, at.operand(0), labels, tops, split=False)
                masks += [dataclasses.replace(s, coef=-1.0) for s in found]
            else:
                masks += sides(view, at.operand(0), labels, tops)
    if masks and not (fill == -math.inf or fill <= FILL_LIMIT):
        raise Unfused(
            f"the masked logits are set to {fill:g}, which does not zero their weights "
            f"(a fill <= {FILL_LIMIT:g} or -inf does)"
        )
    return dict(scale=scale, biases=tuple(biases), masks=tuple(masks), fill=fill)


def _scalar_walk(view: View, val: Val, tops: set[int]) -> None:
    """A scalar constant (a fill, a scale) computed in the scope only for this attention
    joins it: the moves and folded functions (``jnp.sqrt(d)``) that make it."""
    val = view.resolve(val)
    if val.ctx.parent is not None or jc.is_literal(val.atom):
        return
    if val.atom in view.outvars or len(set(view.readers.get(val.atom, []))) != 1:
        return
    at = view.producer(val)
    if at is None or at.ctx.parent is not None or at.name not in (*_MOVES, *FOLDED):
        return
    tops.add(at.top)
    for i in range(len(at.eqn.invars)):
        _scalar_walk(view, at.operand(i), tops)


def match(view: View, pv_index: int) -> tuple[Core | None, list[At]]:
    """The attention whose P.V ``dot_general`` is scope equation ``pv_index``.

    Returns ``(core, softmax)``: ``core`` None when no operand of the dot is a softmax
    (``softmax`` then empty); otherwise the softmax's equations found.

    Raises:
      Unfused: a softmax feeds the dot but the attention cannot be fused (the reason).
    """
    eqn = view.scope.jaxpr.eqns[pv_index]
    pv = At(eqn, view.root, pv_index)
    for p_pos in (0, 1):
        ats: list[At] = []
        found = softmax(view, pv.operand(p_pos), ats)
        if found is None:
            continue
        x, axis = found
        contracted = pv.eqn.params["dimension_numbers"][0][p_pos]
        if tuple(contracted) != (axis,):
            raise Unfused(
                f"the softmax runs over axis {axis} of the logits, not over the keys the values "
                f"matmul contracts (axis {', '.join(map(str, contracted))}): over the queries?"
            )
        chain = _chain(view, x)
        if chain is None:
            raise Unfused(
                "the softmax's input is not the logits of a matmul through scales, biases, "
                "masks and casts"
            )
        qk, steps = chain
        for s_side in (1, 0):  # the keys are the logits dot's second operand, or its first
            found_labels = _logits_labels(qk, s_side)
            if found_labels is None:
                continue
            labels, qk_labels = found_labels
            spaces = []
            for at, _ in steps:
                labels = _forward_labels(at, labels)
                spaces.append(labels)
            if labels[axis] == "s" and labels.count("t") == 1:
                break
        else:
            if all(_logits_labels(qk, side) is None for side in (1, 0)):
                raise Unfused(
                    "the queries or keys have more than one dim besides batch and head dims "
                    "(or the keys more than the queries' group of grouped-query attention)"
                )
            raise Unfused(f"the softmax does not run over the keys (axis {axis} of the logits)")
        tops = {pv_index, qk.top, *(a.top for a in ats), *(a.top for a, _ in steps)}
        lay = _layouts(view, qk, pv, p_pos, labels, qk_labels)
        folded = _fold(view, steps, spaces, tops)
        if any("g" in s.dims for s in (*folded["masks"], *folded["biases"])):
            raise Unfused("a mask or bias differs between the query heads of a group (GQA)")
        return Core(pv=pv_index, qk=qk.top, eqns=tops, o=eqn.outvars[0], **lay, **folded), ats
    for p_pos in (0, 1):
        _near_miss(view, pv.operand(p_pos))
    return None, []


def _near_miss(view: View, val: Val) -> None:
    """Raises :class:`Unfused` when ``val`` is almost an attention's probabilities: a
    softmax changed on its way to the values matmul (dropout), or weights normalised by
    their sum but not as a softmax."""
    frontier: list[tuple[Val, tuple[str, ...]]] = [(val, ())]
    for _ in range(4):
        nxt = []
        for v, path in frontier:
            at = view.producer(v)
            if at is None or at.name not in ("mul", "div", "select_n", "convert_element_type"):
                continue
            path = (*path, at.name)
            if at.name == "div" and _row_reduction(view, at.operand(1), "reduce_sum", []):
                e = view.producer(at.operand(0))
                if e is not None and e.name == "exp":
                    what = "exp of the logits without their row maximum subtracted"
                else:
                    what = f"{e.name if e is not None else 'an input'}, not exp(x - max x)"
                raise Unfused(
                    f"its weights are normalised by their sum but are not a softmax ({what})"
                )
            for i in range(len(at.eqn.invars)):
                operand = at.operand(i)
                if operand.shape != val.shape or operand.aval.dtype == np.bool_:
                    continue
                if softmax(view, operand, []) is not None:
                    raise Unfused(
                        f"its softmax reaches the values matmul through {', '.join(path)} "
                        "(dropout on the weights?): only softmax(...) @ v is fused"
                    )
                nxt.append((operand, path))
        frontier = nxt
