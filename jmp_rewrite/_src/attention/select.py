"""Fused attention, ``rewrite(..., fuse_attention=True)``: which attentions are replaced.

Each forward attention (:mod:`~jmp_rewrite._src.attention.match`) of a painted program is
replaced by one fused call (emitted by :mod:`~jmp_rewrite._src.emit.attention`: cuDNN's
flash attention on CUDA, JAX's Pallas flash-attention kernel on a TPU, JAX's own attention
elsewhere) when what it computes is what the program computes:

* its intermediates (logits, probabilities) are read by nothing else: then it is the whole
  forward pass of a function differentiated after the rewrite (``grad(rewrite(f))``: JAX
  differentiates the fused call) or not differentiated at all;
* or they are read only by their own backward pass, in the same jaxpr
  (``rewrite(grad(f))``): forward and backward are found together
  (:mod:`~jmp_rewrite._src.attention.joint`) and replaced by the fused call and its VJP.
  Replacing the forward alone would save nothing while the backward still reads the
  probabilities, so an attention whose backward is not found stays as written.

Both matmuls must be painted half precision (never inside a ``float32_region``). A row the
masks may leave without keys (padding from the data) gets the value float32 gives it
(uniform weights for a finite fill, NaN for ``-inf``) from outside the fused kernel. Every
attention left as written has its reason (``AttentionSelection.left``), which
``explain(...).lint()`` shows; so does every fused attention the TPU kernel cannot take
(``FusedAttention.tpu``: a TPU runs it as written).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src.attention import tpu as tpu_lib
from jmp_rewrite._src.attention.joint import Unifier, forward_text, reference
from jmp_rewrite._src.attention.layout import arrange, mask_value
from jmp_rewrite._src.attention.match import Core, Unfused, match
from jmp_rewrite._src.attention.view import View
from jmp_rewrite._src.trace import shapes, source_info
from jmp_rewrite._src.trace.equations import is_float
from jmp_rewrite._src.trace.higher_order import bind

#: Constant masks and biases up to this many elements are evaluated when painting (to find
#: a causal mask, and whether a row is left without keys).
_CONST_LIMIT = 1 << 24


@dataclasses.dataclass
class FusedAttention:
    """One attention replaced by a fused call.

    Attributes:
      core: what it computes (:class:`~jmp_rewrite._src.attention.match.Core`).
      scope: the graph scope (a ``ScopeRec``) holding its equations.
      number: its position among the program's fused attentions (from 0).
      skip: the scope's equations the fused call replaces.
      forward_at: where the forward call is emitted (the P.V matmul).
      backward_at: where its VJP is emitted (None: no backward in the program).
      g: the cotangent of the output, read by the backward.
      diff: the inputs differentiated (of the queries, keys, values, then biases).
      grads: the program's vars for their cotangents (None where not computed).
      nodes: the graph nodes of the equations replaced.
      outputs: those whose values the fused call provides (output, cotangents).
      label: where it is (the model scope) and what it is, for ``explain``.
      saved_bytes: bytes of the replaced equations' other outputs (the logits,
        probabilities and their cotangents), which the fused call never writes.
      tpu: why the TPU flash-attention kernel cannot take it (a sentence; then a TPU runs
        it as written), or ``""`` (:mod:`~jmp_rewrite._src.attention.tpu`).
    """

    core: Core
    scope: Any
    number: int
    skip: frozenset[int]
    forward_at: int
    backward_at: int | None
    g: Any
    diff: tuple[Any, ...]
    grads: tuple[Any, ...]
    nodes: frozenset[int]
    outputs: frozenset[int]
    label: str
    saved_bytes: int
    tpu: str = ""

    def reads(self) -> list[Any]:
        """The scope atoms the fused call reads (queries, keys, values, masks, biases)."""
        c = self.core
        atoms = [c.q, c.k, c.v, *(s.atom for s in (*c.masks, *c.biases))]
        return [a for a in atoms if not jc.is_literal(a)]


@dataclasses.dataclass
class AttentionSelection:
    """The fused-attention choice of a painting (``Painting.attention``).

    Attributes:
      fused: the attentions replaced, in program order.
      left: node id (of the P.V matmul) -> why an attention stays as written.
    """

    fused: list[FusedAttention] = dataclasses.field(default_factory=list)
    left: dict[int, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self._roles: dict[int, dict[int, tuple[str, FusedAttention]]] = {}
        for f in self.fused:
            self.add(f)

    def add(self, f: FusedAttention) -> None:
        roles = self._roles.setdefault(id(f.scope), {})
        for i in f.skip:
            roles[i] = ("skip", f)
        roles[f.forward_at] = ("forward", f)
        if f.backward_at is not None:
            roles[f.backward_at] = ("backward", f)

    def role(self, scope: Any, index: int) -> tuple[str, FusedAttention] | None:
        """What the emitter does at equation ``index`` of ``scope``, or None."""
        roles = self._roles.get(id(scope))
        return None if roles is None else roles.get(index)

    def in_scope(self, scope: Any) -> bool:
        return id(scope) in self._roles

    def of_node(self, node: int) -> FusedAttention | None:
        return next((f for f in self.fused if node in f.nodes), None)


def _scopes(scope: Any):
    yield scope
    for rec in scope.eqns:
        for sub in rec.subs.values():
            for s in sub if isinstance(sub, list) else [sub]:
                yield from _scopes(s)


def _nodes(rec: Any) -> set[int]:
    out = {n for n in (rec.node, *rec.carries, *rec.operands, *rec.xs, *rec.ys) if n is not None}
    for sub in rec.subs.values():
        for s in sub if isinstance(sub, list) else [sub]:
            for r in s.eqns:
                out |= _nodes(r)
    return out


class _Constants:
    """Values of scope atoms computed from constants only (a causal mask), or None."""

    def __init__(self, scope: Any, consts: dict[Any, Any]):
        self.scope, self.consts, self.memo = scope, consts, {}
        self.producers = {
            v: i for i, e in enumerate(scope.jaxpr.eqns) for v in e.outvars if not jc.is_drop_var(v)
        }

    def value(self, atom: Any, depth: int = 0) -> Any:
        if jc.is_literal(atom):
            return np.asarray(jc.literal_value(atom))
        if atom in self.consts:
            return np.asarray(self.consts[atom])
        if atom in self.memo:
            return self.memo[atom]
        self.memo[atom] = None
        i = self.producers.get(atom)
        if i is None or depth > 32 or shapes.size(getattr(atom.aval, "shape", ())) > _CONST_LIMIT:
            return None
        eqn = self.scope.jaxpr.eqns[i]
        ins = [self.value(a, depth + 1) for a in eqn.invars]
        if any(x is None for x in ins):
            return None
        with jax.ensure_compile_time_eval():
            outs = bind(eqn, [jax.numpy.asarray(x) for x in ins], eqn.params)
        for v, x in zip(eqn.outvars, outs, strict=True):
            if not jc.is_drop_var(v):
                self.memo[v] = np.asarray(x)
        return self.memo[atom]


def _decide_masks(core: Core, consts: _Constants) -> Core:
    """Causal masks become ``is_causal``; rows a mask may leave without keys get float32's
    value from outside the fused kernel (``guard_mask``)."""
    order = [*range(len(core.batch)), "t", "s"]
    kept, const_keep = [], None
    for m in core.masks:
        value = consts.value(m.atom)
        if value is None:
            kept.append(m)
            continue
        full = arrange(mask_value(m, value, np), m.dims, order, np)
        const_keep = full if const_keep is None else const_keep & full
        tril = np.tril(np.ones((core.t, core.s), bool))
        same = full.reshape(-1, *full.shape[-2:])
        if (
            not core.causal
            and core.t > 1
            and full.shape[-2:] == tril.shape
            and all(np.array_equal(x, tril) for x in same)
        ):
            core = dataclasses.replace(core, causal=True, causal_mask=m)
            continue
        kept.append(dataclasses.replace(m, const=full))
    guard_mask = any(m.const is None for m in kept)
    if const_keep is not None and not const_keep.any(axis=-1).all():
        guard_mask = True  # a constant mask with an empty row
    return dataclasses.replace(core, masks=tuple(kept), guard_mask=guard_mask)


def _closed(view: View, eqns: set[int], outputs: set[Any]) -> str:
    """Why the intermediates of ``eqns`` are not private to them ("" when they are)."""
    jaxpr = view.scope.jaxpr
    for i in sorted(eqns):
        for v in jaxpr.eqns[i].outvars:
            if jc.is_drop_var(v) or v in outputs:
                continue
            if v in view.outvars:
                return f"its {jaxpr.eqns[i].primitive.name} result leaves the function"
            outside = [j for j in view.readers.get(v, []) if j not in eqns]
            if outside:
                return (
                    f"its {jaxpr.eqns[i].primitive.name} result is also read by "
                    f"{jaxpr.eqns[outside[0]].primitive.name} (the attention weights are used "
                    "elsewhere)"
                )
    return ""


def _inputs(view: View, core: Core) -> list[Any]:
    jaxpr = view.scope.jaxpr
    made = {v for i in core.eqns for v in jaxpr.eqns[i].outvars}
    found: dict[Any, None] = {}
    for i in sorted(core.eqns):
        for a in jaxpr.eqns[i].invars:
            if not jc.is_literal(a) and a not in made:
                found[a] = None
    sides = (*core.masks, *core.biases, *([core.causal_mask] if core.causal_mask else []))
    expected = [core.q, core.k, core.v, *(s.atom for s in sides if not jc.is_literal(s.atom))]
    # a scalar constant the program also reads elsewhere (a scale both passes read) is no
    # input: the fused call takes its value
    extra = [a for a in found if a not in expected and view.literal(view.val(a)) is None]
    if extra:
        raise Unfused(
            f"it reads a value that is none of queries, keys, values, masks, biases ({extra[0]})"
        )
    if len({id(core.q), id(core.k), id(core.v)}) != 3:
        raise Unfused("the queries, keys and values are not three different arrays")
    return [a for a in dict.fromkeys(expected) if a in found]


class _Joint:
    """Forward + backward of an attention, through references cached by their text."""

    def __init__(self, view: View, cache: dict[Any, Any]):
        self.view, self.cache = view, cache
        self.unifier = Unifier(view.scope.jaxpr, view.readers)

    def find(self, core: Core, inputs: list[Any]):
        jaxpr = self.view.scope.jaxpr
        eqns = [jaxpr.eqns[i] for i in sorted(core.eqns)]
        floats = [a for a in inputs[3:] if is_float(a.aval.dtype)]
        # What the program differentiates: everything first; then without the biases (a
        # mask's bias), without the values or the queries and keys (an input, frozen).
        q, k, v = core.q, core.k, core.v
        tries = [[q, k, v, *floats], [q, k, v], [q, k, *floats], [q, k], [v, *floats], [v]]
        tries = [t for i, t in enumerate(tries) if t and t not in tries[:i]]
        made = {v for e in eqns for v in e.outvars}
        consts = [  # scalar constants also read elsewhere: inputs of the reference only
            a
            for a in dict.fromkeys(a for e in eqns for a in e.invars if not jc.is_literal(a))
            if a not in made and a not in inputs
        ]
        for diff in tries:
            order = [*diff, *(a for a in inputs if a not in diff), *consts]
            key = (forward_text(eqns, order, core.o), len(diff))
            ref = self.cache.get(key)
            if ref is None:
                ref = self.cache[key] = reference(eqns, order, len(diff), core.o)
            rj = jc.open_jaxpr(ref)
            bound = dict(zip(rj.invars[:-1], order, strict=True))
            found = self.unifier.run(ref, bound, {rj.invars[-1]})
            if found is not None:
                eqmap, m = found
                return (
                    set(eqmap.values()),
                    m[rj.invars[-1]],
                    tuple(diff),
                    [m[a] for a in rj.outvars],
                )
        return None


def select(graph: Any, painting: Any) -> AttentionSelection:
    """The attentions of a painted graph to fuse, and why the others stay as written."""
    phases = source_info.origins(graph)
    sel = AttentionSelection()
    cache: dict[Any, Any] = {}
    consts_top = getattr(graph, "const_values", {})
    for scope in _scopes(graph.top):
        view = None
        for i, (eqn, rec) in enumerate(zip(scope.jaxpr.eqns, scope.eqns, strict=True)):
            if eqn.primitive.name != "dot_general" or rec.kind != "leaf" or rec.node is None:
                continue
            phase = phases.get(rec.node)
            if phase is not None and phase.phase == source_info.BACKWARD:
                if "rematted_computation" not in jc.name_stack(eqn):
                    continue  # a gradient matmul (its forward is the candidate)
            view = view or View(scope)
            try:
                core, _ = match(view, i)
                if core is None:
                    continue
                found = _fuse(graph, painting, view, core, cache, consts_top, scope)
            except Unfused as why:
                sel.left[rec.node] = str(why)
                continue
            core, skip, backward_at, g, diff, grads = found
            nodes = set().union(*(_nodes(scope.eqns[j]) for j in skip))
            out_vars = {core.o, *(v for v in grads if v is not None)}
            outputs = {
                scope.eqns[j].node
                for j in skip
                if scope.eqns[j].node is not None
                and any(v in out_vars for v in scope.jaxpr.eqns[j].outvars)
            }
            saved = 0
            for n in nodes - outputs:
                node = graph.nodes[n]
                if node.eqn is None:
                    continue
                for v in node.eqn.outvars:
                    if is_float(v.aval.dtype):
                        size = 2 if n in painting.allow else np.dtype(v.aval.dtype).itemsize
                        saved += shapes.size(v.aval.shape) * size
            kind = "forward and backward" if backward_at is not None else "forward"
            what = ["causal" if core.causal else "", "masked" if core.masks else ""]
            what += ["with a bias" if core.biases else ""]
            desc = ", ".join(w for w in (kind, *what) if w)
            origin = phases.get(rec.node)
            scope_name = origin.scope if origin is not None else ""
            where = "/".join(n for n in scope_name.split("/") if "->" not in n)
            label = f"{where or scope.path.rstrip('/') or 'attention'} ({desc})"
            sel.fused.append(
                FusedAttention(
                    core,
                    scope,
                    len(sel.fused),
                    frozenset(skip),
                    i,
                    backward_at,
                    g,
                    diff,
                    tuple(grads),
                    frozenset(nodes),
                    frozenset(outputs),
                    label,
                    int(saved),
                    tpu_lib.refusal(core),
                )
            )
            sel.add(sel.fused[-1])
    return sel


def _bias_batch(core: Core, b: Any) -> int:
    """The batch size of a bias as the fused call takes it, ``(B|1, N|1, T|1, S|1)``: its
    dims over the logits' batch dims but the last (the heads; the only one: the batch)."""
    nb = len(core.batch)
    lead = range(nb - 1) if nb > 1 else range(nb)
    shape = getattr(b.atom.aval, "shape", ())
    return int(np.prod([shape[i] for i, lab in enumerate(b.dims) if lab in lead]))


def _from_float_inputs(jaxpr: Any, atom: Any) -> bool:
    """Whether ``atom`` is computed from a float input of ``jaxpr`` through equations that
    pass a derivative (not through a cast from an integer or boolean, nor ``stop_gradient``)."""
    producers = {v: e for e in jaxpr.eqns for v in e.outvars if not jc.is_drop_var(v)}
    inputs = {v for v in jaxpr.invars if is_float(v.aval.dtype)}
    seen, todo = set(), [atom]
    while todo:
        a = todo.pop()
        if jc.is_literal(a) or a in seen or not is_float(getattr(a.aval, "dtype", np.int32)):
            continue
        seen.add(a)
        if a in inputs:
            return True
        e = producers.get(a)
        if e is not None and e.primitive.name != "stop_gradient":
            todo += list(e.invars)
    return False


def _fuse(graph, painting, view, core, cache, consts_top, scope):
    pv_node = scope.eqns[core.pv].node
    qk_node = scope.eqns[core.qk].node
    for node in (pv_node, qk_node):
        if graph.nodes[node].region:
            raise Unfused("it runs inside a float32_region")
        if node not in painting.allow:
            raise Unfused("its matmuls are not painted half precision")
    consts = _Constants(scope, consts_top if scope is graph.top else {})
    core = _decide_masks(core, consts)
    inputs = _inputs(view, core)
    why = _closed(view, core.eqns, {core.o})
    if not why:
        # JAX differentiates the fused call: a learned bias it may reach (over the queries
        # or heads; one over batch and keys only is a padding mask, never trained)
        heads = len(core.batch) - 1 if len(core.batch) > 1 else None
        for b in core.biases:
            learned = any(lab in ("t", heads) for lab in b.dims if lab is not None)
            if learned and _bias_batch(core, b) > 1 and _from_float_inputs(scope.jaxpr, b.atom):
                raise Unfused(
                    f"its bias of batch {_bias_batch(core, b)} is computed from the function's "
                    "float inputs, which JAX may differentiate: cuDNN computes a bias's gradient "
                    "for batch 1 only (jax issue 30593)"
                )
        return core, core.eqns, None, None, (), ()
    found = _Joint(view, cache).find(core, inputs)
    if found is None:
        raise Unfused(
            f"its intermediates are read outside it ({why}), and not as its backward pass "
            "(JAX's derivative of this forward) in the same jaxpr"
        )
    matched, g, diff, outs = found
    for b in core.biases:
        if any(b.atom is a for a in diff) and _bias_batch(core, b) > 1:
            raise Unfused(
                f"it differentiates a bias of batch {_bias_batch(core, b)}: cuDNN computes a "
                "bias's gradient for batch 1 only (jax issue 30593)"
            )
    why = _closed(view, matched, set(outs))
    if why:
        raise Unfused(why)
    backward_at = min(j for j in matched if g in view.scope.jaxpr.eqns[j].invars)
    return core, matched, backward_at, g, diff, outs[1:]
