"""The painting graph: a jaxpr's dataflow seen the way TF's grappler pass sees a GraphDef.

TF paints *(node, type attribute)* vertices of one flat graph. A jaxpr is a tree of jaxprs:
calls (``jit``, ``closed_call``, ``checkpoint``, custom derivative wrappers, ``shard_map``)
and control flow (``cond``, ``while``, ``scan``) hold sub-jaxprs. JAX wraps even
``jnp.where`` and ``jnp.clip`` in ``jit``, so treating calls as opaque would stop almost all
propagation. The graph built here is therefore *flat*:

* every leaf equation is a node (one colour per equation: in JAX nearly every primitive has one
  float type, unlike TF ops with separate ``T``/``U`` attributes);
* call bodies are inlined: an inner invar is the outer value itself;
* a loop carry (``while``/``scan``) is one *clear* node joining its initial value, the body's
  result and every reader: TF's Enter/Merge/Switch/NextIteration/Exit chain collapsed to one
  vertex, so TF's recurrent colour match holds by construction. Inside its body the carry is
  a *state* of its own (:class:`LoopState`), as a program input is at the top level, so the
  painter can tell a carry updated from itself (``new = old + dt * k``) from an activation;
* each ``cond`` output is a *clear* node (TF's Merge) fed by every branch;
* each ``scan`` ``xs``/``ys`` stream is a *clear* node (TF's TensorList writer->reader edge);
* a ``jit`` whose name is on a list (``jit:log_softmax``...) is one node: TF's fused op;
* other equations holding jaxprs (``custom_linear_solve``, ``reduce``, ...) are opaque
  *unlisted* nodes, rewritten inside separately, as programs of their own, or run as written
  when a body is no program of arrays (a kernel over Refs, even a loop: ``equations.sealed``).

Edges carry floating-point values only: TF's int/bool ports are separate vertices, so a deny
op never taints float data through a comparison's boolean output.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src.trace import higher_order as ho
from jmp_rewrite._src.trace.equations import (
    SCATTER_REBUILDERS,
    eqn_is_float32,
    false_at_once,
    has_jaxpr_param,
    holds_allow_ops,
    in_backward_pass,
    is_f32,
    is_float,
    op_key,
    reads_refs,
    sealed,
    touches_complex,
)
from jmp_rewrite._src.trace.graph_records import EqnRec, Node, ScopeRec
from jmp_rewrite._src.trace.origins import (
    NOWHERE,
    LoopState,
    Origin,
    big_seed,
    const_origin,
    const_origins,
    leaf_origin,
    loop_result_origins,
    recurrent_states,
    select_origin,
    stacked_origins,
)
from jmp_rewrite._src.trace.regions import in_float32_region

#: Kinds of higher-order equation whose body is inlined as a call.
_CALL_KINDS = (ho.CALL, ho.CUSTOM_JVP, ho.CUSTOM_VJP, ho.SHARD_MAP)


def _operand_consumers(eqn: Any, rec: EqnRec) -> list[list[int]]:
    """For each operand of ``eqn``, the nodes that read it (see ``ScopeRec.consumers``)."""
    n = len(eqn.invars)
    if rec.kind == "leaf" and eqn.primitive.name == "convert_element_type":
        return [[] for _ in range(n)]
    if rec.kind in ("leaf", "opaque", "unit"):
        return [[rec.node] for _ in range(n)]
    if rec.kind in (ho.WHILE, ho.SCAN):
        return [[] if node is None else [node] for node in rec.operands]
    if rec.kind in _CALL_KINDS:
        sub = rec.subs["body"]
        return [sub.consumers.get(v, []) for v in sub.jaxpr.invars]
    if rec.kind == ho.COND:
        out: list[list[int]] = [[]]
        for i in range(n - 1):
            out.append(
                [c for b in rec.subs["cases"] for c in b.consumers.get(b.jaxpr.invars[i], [])]
            )
        return out
    return [[] for _ in range(n)]


def _discrete(var: Any, o: Origin) -> Origin:
    """An integer or boolean value is frozen (see :class:`Origin`), wherever it comes from:
    nothing differentiates through it (``attention_mask``, ``x > 0``, ``argmax(logits)``).
    A complex value is computed from its floats (an LRU's state), and so is ``h.real``."""
    if jnp.issubdtype(var.aval.dtype, jnp.inexact) or o.frozen:
        return o
    return dataclasses.replace(o, frozen=True)


#: Pieces through which a unit's residual still counts as its deny piece: moving values
#: (clear) and summing them. A sum of exps is the exps accumulated (TF's fused kernels keep it
#: float32); anything else computed from them (the log of the sum) is the unit's own result.
CARRY_DENY = ("reduce_sum",)


def _deny_residuals(sub: Any, nodes: list[Node]) -> list[int | None]:
    """For each output of a unit's body, the deny piece it is (or sums, moves), or None."""
    source: dict[Any, int] = {}
    for e, r in zip(sub.jaxpr.eqns, sub.eqns, strict=True):
        if r.node is None:
            continue
        piece = nodes[r.node]
        if piece.listed_kind == "deny":
            found: int | None = r.node
        elif piece.listed_kind == "clear" or piece.key in CARRY_DENY:
            found = next(
                (source[a] for a in e.invars if not jc.is_literal(a) and a in source), None
            )
        else:
            found = None
        if found is not None:
            for v in e.outvars:
                source[v] = found
    return [None if jc.is_literal(a) else source.get(a) for a in sub.jaxpr.outvars]


class Graph:
    """The flat painting graph of a closed jaxpr (see the module docstring)."""

    def __init__(self, closed: Any, lists: Any, half: Any = None):
        self.lists = lists
        #: the half type's largest finite value (``origins.big_seed``); None: no dtype given.
        self.limit = None if half is None else float(jnp.finfo(half).max)
        self.nodes: list[Node] = []
        self._n_recs = 0
        #: an opaque equation's bodies hold float32 allowlist ops: the program changes even
        #: when no node of this graph is painted (those bodies are rewritten on their own).
        self.opaque_allow = False
        self._backward = False  # while building: inside a backward pass (transposed)
        jaxpr = jc.open_jaxpr(closed)
        n_in = len(jaxpr.constvars) + len(jaxpr.invars)
        origins = const_origins(jc.consts_of(closed), len(jaxpr.constvars), self.limit) + [
            Origin(copy_of=j, derived=frozenset({j})) for j in range(len(jaxpr.invars))
        ]
        #: the program's input avals (``Origin.copy_of`` / ``derived`` index them).
        self.input_avals = [v.aval for v in jaxpr.invars]
        #: the top jaxpr's constvars -> their values (a captured causal mask)
        self.const_values = dict(zip(jaxpr.constvars, jc.consts_of(closed), strict=True))
        #: every float loop carry, as a state of its body (ids after the inputs').
        self.loop_states: list[LoopState] = []
        #: the carry nodes of loops known when painting to run zero times (a scan of length
        #: 0, a ``while`` whose condition is false on literal initial values): they hand
        #: their initial values on (``paint_additions.keep_unrun_loop_carries_float32``).
        self.unrun_carries: list[int] = []
        #: ``cond`` outputs that some branch hands a value with no node of its own: a program
        #: input, a constant the branch closes over, a literal -- a float32 value, as is
        #: (``paint_additions.keep_float32_reads_unrounded``); and ``select_n`` nodes one of
        #: whose cases is a program input.
        self.outside_handoffs: set[int] = set()
        #: per ``select_n`` node (``where``, ``lax.select``, a ``cond`` of a batched predicate
        #: under ``vmap``), the nodes of its cases that are no constants (``Origin.frozen``:
        #: a mask's fill takes the select's type, as a literal does); see
        #: ``paint_additions.keep_float32_reads_unrounded``.
        self.choice_cases: dict[int, tuple[int, ...]] = {}
        self._n_states = len(jaxpr.invars)
        self.top, outs, out_origins = self._scope(jaxpr, [None] * n_in, "", False, None, origins)
        #: the program's outputs: (source node or None, origin, aval) each.
        self.outputs = list(zip(outs, out_origins, [v.aval for v in jaxpr.outvars], strict=True))
        for src in outs:
            if src is not None:
                self.nodes[src].feeds_output = True
        for node in self.nodes:
            for src in node.fanin:
                self.nodes[src].fanout.append(node.id)

    # -- construction -------------------------------------------------------------------

    def _node(
        self,
        key: str,
        path: str,
        *,
        float32: bool,
        process: bool,
        unit: int | None,
        fanin: list[int | None],
        eqn: Any = None,
        kind: str | None = None,
    ) -> int:
        listed = self.lists.kind(key) if kind is None else kind
        # Inside a float32 region or a fused unit nothing is painted on its own: the node
        # behaves as unlisted (never converted, blocks allow, does not spread deny).
        effective = listed if process else "unlisted"
        node = Node(
            id=len(self.nodes),
            key=key,
            kind=effective,
            listed_kind=listed,
            float32=float32,
            process=process,
            path=path,
            eqn=eqn,
            unit=unit,
            region=not process and unit is None,
            fanin=[s for s in fanin if s is not None],
        )
        self.nodes.append(node)
        return node.id

    def _scope(
        self,
        jaxpr: Any,
        in_sources: list[int | None],
        path: str,
        region: bool,
        unit: int | None,
        in_origins: list[Origin],
    ) -> tuple[ScopeRec, list[int | None], list[Origin]]:
        """Adds one jaxpr instance; ``in_sources`` and ``in_origins`` cover constvars then
        invars. Returns the scope, its outputs' source nodes and their origins."""
        rec = ScopeRec(path=path, jaxpr=jaxpr)
        env: dict[Any, int | None] = {}
        origins: dict[Any, Origin] = {}
        invars = [*jaxpr.constvars, *jaxpr.invars]
        for var, src, o in zip(invars, in_sources, in_origins, strict=True):
            env[var] = src
            origins[var] = _discrete(var, o)
            if is_float(var.aval.dtype):
                rec.consumers[var] = []

        def source(atom: Any) -> int | None:
            if jc.is_literal(atom) or not is_float(atom.aval.dtype):
                return None
            return env.get(atom)

        def origin(atom: Any) -> Origin:
            if jc.is_literal(atom):  # a fill passed to a call (``jnp.where``'s jit) is big
                return const_origin(jc.literal_value(atom), self.limit)
            return origins.get(atom, NOWHERE)

        outer_backward = self._backward
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            here = f"{path}{name}"
            in_region = region or in_float32_region(jc.name_stack(eqn))
            process = not in_region and unit is None
            ins = [source(a) for a in eqn.invars]
            in_origins = [origin(a) for a in eqn.invars]
            self._backward = in_backward_pass(outer_backward, eqn)  # for its sub-scopes too
            key = op_key(eqn, self.lists, self._backward)
            layout = None if sealed(eqn) else ho.describe(eqn)  # a kernel: opaque, as written
            out_origins = None
            if key.startswith("jit:") and layout is not None:
                out, erec = self._unit(eqn, layout, key, ins, here, in_region, unit, in_origins)
            elif layout is not None and layout.kind in _CALL_KINDS:
                sub, out, out_origins = self._enter(
                    layout.body(), ins, f"{here}/", in_region, unit, in_origins
                )
                erec = EqnRec(layout.kind, subs={"body": sub})
            elif layout is not None:
                build = {ho.COND: self._cond, ho.WHILE: self._while, ho.SCAN: self._scan}
                out, erec, out_origins = build[layout.kind](
                    eqn, layout, ins, here, in_region, unit, in_origins
                )
            else:
                # Other jaxpr-holding equations are opaque and keep their signature, except
                # scatters, re-emitted at another dtype through jax.lax.
                opaque = has_jaxpr_param(eqn) and name not in SCATTER_REBUILDERS
                node = self._node(
                    key,
                    here,
                    float32=eqn_is_float32(eqn) and not opaque,
                    process=process,
                    unit=unit,
                    fanin=ins,
                    eqn=eqn,
                    kind="unlisted" if opaque or name == "convert_element_type" else None,
                )
                n = self.nodes[node]
                n.is_cast = name == "convert_element_type" and is_f32(eqn.params["new_dtype"])
                n.is_cast &= not touches_complex(eqn)  # from complex: TF's Real, on no list
                if opaque and process and not self.opaque_allow:
                    self.opaque_allow = holds_allow_ops(eqn, self.lists)
                out = [node if is_float(v.aval.dtype) else None for v in eqn.outvars]
                erec = EqnRec("opaque" if opaque else "leaf", node=node)
                if name == "select_n":
                    self._choice(node, eqn, ins, in_origins)
            if out_origins is None:  # a leaf, opaque equation or fused unit
                o = leaf_origin(eqn, self.lists.kind(key), in_origins)
                o = NOWHERE if reads_refs(eqn) else o  # a Ref holds what was last written
                lits = [jc.literal_value(a) if jc.is_literal(a) else None for a in eqn.invars]
                if self.limit is not None and not self._backward:
                    o = dataclasses.replace(o, big=big_seed(eqn, in_origins, lits, self.limit, key))
                out_origins = [o] * len(eqn.outvars)
                if erec.node is not None:
                    self.nodes[erec.node].origin = o
            if erec.node is not None:
                self.nodes[erec.node].backward = self._backward
            erec.const_operands = tuple(o.const for o in in_origins)
            erec.operand_origins = tuple(in_origins)
            forward = not self._backward
            erec.clamped_operands = tuple(forward and o.frozen for o in in_origins)
            erec.big_operands = tuple(forward and o.big for o in in_origins)
            erec.operand_nodes = tuple(ins) if forward else ()
            for var, src, o in zip(eqn.outvars, out, out_origins, strict=True):
                if not jc.is_drop_var(var):
                    env[var] = src
                    origins[var] = _discrete(var, o)
            erec.layout = layout if erec.kind != "opaque" else None
            erec.index = self._n_recs
            self._n_recs += 1
            rec.eqns.append(erec)
            operand_consumers = _operand_consumers(eqn, erec)
            if erec.kind in (*_CALL_KINDS, ho.COND):
                erec.operand_consumers = operand_consumers
            for atom, nodes in zip(eqn.invars, operand_consumers, strict=True):
                if not jc.is_literal(atom) and atom in rec.consumers:
                    rec.consumers[atom].extend(nodes)
        self._backward = outer_backward
        for atom in jaxpr.outvars:
            if not jc.is_literal(atom) and atom in rec.consumers:
                # An input handed on as an output wants its own dtype: a call site passing it
                # cast to half would hand the caller a rounded copy.
                rec.consumers[atom].append(None)
        outs = [source(a) for a in jaxpr.outvars]
        out_origins = [origin(a) for a in jaxpr.outvars]
        rec.big_outputs = tuple(not outer_backward and o.big for o in out_origins)
        return rec, outs, out_origins

    def _choice(self, node: int, eqn: Any, ins: list[int | None], origins: list[Origin]) -> None:
        """Records a ``select_n``'s cases that are values, not constants (see
        :attr:`choice_cases`), and whether one of them is a program input, with no node of
        its own (:attr:`outside_handoffs`)."""
        cases = [
            src
            for a, src, o in zip(eqn.invars[1:], ins[1:], origins[1:], strict=True)
            if is_float(a.aval.dtype) and not o.frozen
        ]
        self.choice_cases[node] = tuple(c for c in cases if c is not None)
        if None in cases:
            self.outside_handoffs.add(node)

    def _structural(
        self, key: str, path: str, avals: list[Any], process: bool, unit: int | None
    ) -> list[int | None]:
        return [
            self._node(
                key,
                path,
                float32=is_f32(a.dtype),
                process=process,
                unit=unit,
                fanin=[],
                kind="clear",
            )
            if is_float(a.dtype)
            else None
            for a in avals
        ]

    def _link(self, into: list[int | None], sources: list[int | None]) -> None:
        for node, src in zip(into, sources, strict=True):
            if node is not None and src is not None:
                self.nodes[node].fanin.append(src)

    def _unit(self, eqn, layout, key, ins, path, region, unit, in_origins):
        process = not region and unit is None
        node = self._node(
            key, path, float32=eqn_is_float32(eqn), process=process, unit=unit, fanin=ins, eqn=eqn
        )
        inner = [
            node if s is not None or is_float(v.aval.dtype) else None
            for s, v in zip(ins, eqn.invars, strict=True)
        ]
        sub, _, _ = self._enter(layout.body(), inner, f"{path}/", region, node, in_origins)
        out = [node if is_float(v.aval.dtype) else None for v in eqn.outvars]
        # A residual the unit hands its backward pass from a deny piece (the ``exp`` of a
        # log-softmax), or that piece summed, reshaped or broadcast (its denominator, the sum
        # of the exps), is TF's gradient op recomputing it (LogSoftmaxGrad's Exp): its own
        # vertex, of that piece's list, so deny spreads into the backward pass as in TF.
        for i, piece in enumerate(_deny_residuals(sub, self.nodes)):
            if out[i] is None or piece is None:
                continue
            out[i] = self._node(
                self.nodes[piece].key,
                f"{path}/output{i}",
                float32=is_f32(eqn.outvars[i].aval.dtype),
                process=process,
                unit=unit,
                fanin=[node],
            )
        return out, EqnRec("unit", node=node, subs={"body": sub})

    def _cond(self, eqn, layout, ins, path, region, unit, in_origins):
        process = not region and unit is None
        outs = self._structural(
            "<cond-output>", f"{path}/output", [v.aval for v in eqn.outvars], process, unit
        )
        subs = []
        args = layout.split(ins)["args"]
        arg_origins = layout.split(in_origins)["args"]
        branch_origins = []
        for i, branch in enumerate(layout.body("cases")):
            sub, bouts, bout_origins = self._enter(
                branch, args, f"{path}/branch{i}/", region, unit, arg_origins
            )
            self._link(outs, bouts)
            self.outside_handoffs.update(
                o for o, b in zip(outs, bouts, strict=True) if o is not None and b is None
            )
            subs.append(sub)
            branch_origins.append(bout_origins)
        rec = EqnRec(ho.COND, subs={"cases": subs}, carries=outs)
        # One branch's result or another's: a selection (``where(ok, new, old)``).
        out_origins = [select_origin(list(os)) for os in zip(*branch_origins, strict=True)]
        for node, o in zip(outs, out_origins, strict=True):
            if node is not None:
                self.nodes[node].origin = o
        return outs, rec, out_origins

    def _while(self, eqn, layout, ins, path, region, unit, in_origins):
        process = not region and unit is None
        ops, atoms, orig = layout.split(ins), layout.split(eqn.invars), layout.split(in_origins)
        cconsts = self._consts(
            atoms["cond_consts"], ops["cond_consts"], path, process, unit, orig["cond_consts"]
        )
        bconsts = self._consts(
            atoms["body_consts"], ops["body_consts"], path, process, unit, orig["body_consts"]
        )
        carries = self._structural(
            "<carry>", f"{path}/carry", [v.aval for v in atoms["carry"]], process, unit
        )
        self._link(carries, ops["carry"])
        carry_in, states = self._carry_states(carries, orig["carry"])
        first = len(self.nodes)
        csub, _, _ = self._body(
            layout, "cond", cconsts + carries, path, region, unit, orig["cond_consts"] + carry_in
        )
        bsub, bouts, bout_origins = self._body(
            layout, "body", bconsts + carries, path, region, unit, orig["body_consts"] + carry_in
        )
        self._link(carries, bouts)
        rec = EqnRec(ho.WHILE, subs={"cond": csub, "body": bsub}, carries=carries)
        rec.operands = cconsts + bconsts + carries
        body = range(first, len(self.nodes))
        out = self._carry_origins(carries, states, orig["carry"], bouts, bout_origins, body)
        if false_at_once(layout, atoms["cond_consts"] + atoms["carry"]):
            out = self._unrun(carries, orig["carry"])
        return carries, rec, out

    def _scan(self, eqn, layout, ins, path, region, unit, in_origins):
        process = not region and unit is None
        ops, atoms, orig = layout.split(ins), layout.split(eqn.invars), layout.split(in_origins)
        nconst, ncarry = layout.size("consts"), layout.size("carry")
        consts = self._consts(atoms["consts"], ops["consts"], path, process, unit, orig["consts"])
        carries = self._structural(
            "<carry>", f"{path}/carry", [v.aval for v in atoms["carry"]], process, unit
        )
        x_avals = [v.aval for v in layout.inner().invars[nconst + ncarry :]]
        xnodes = self._structural("<xs>", f"{path}/xs", x_avals, process, unit)
        # a slice of a copy is one; of a state, linear in it; of a constant, no longer clamped
        x_in = [dataclasses.replace(o, const=False) for o in orig["xs"]]
        self._set_origins(xnodes, x_in)
        self._link(carries, ops["carry"])
        self._link(xnodes, ops["xs"])
        carry_in, states = self._carry_states(carries, orig["carry"])
        body_in = orig["consts"] + carry_in + x_in
        first = len(self.nodes)
        sub, bouts, bout_origins = self._body(
            layout, "body", consts + carries + xnodes, path, region, unit, body_in
        )
        body = range(first, len(self.nodes))
        ynodes = self._structural(
            "<ys>", f"{path}/ys", [v.aval for v in eqn.outvars[ncarry:]], process, unit
        )
        self._link(carries, bouts[:ncarry])
        self._link(ynodes, bouts[ncarry:])
        rec = EqnRec(ho.SCAN, subs={"body": sub}, carries=carries, xs=xnodes, ys=ynodes)
        rec.operands = consts + carries + xnodes
        carry_out = self._carry_origins(
            carries, states, orig["carry"], bouts[:ncarry], bout_origins[:ncarry], body
        )
        if eqn.params.get("length") == 0:
            carry_out = self._unrun(carries, orig["carry"])
        ys_out = stacked_origins(
            states, orig["carry"], bout_origins[:ncarry], bout_origins[ncarry:]
        )
        self._set_origins(ynodes, ys_out)
        return carries + ynodes, rec, carry_out + ys_out

    def _carry_states(self, carries, outer):
        """The origins the body reads its carries with: each float carry a new state (as a
        program input is at the top level), a copy of what entered if that was one."""
        origins, states = [], []
        for node, o in zip(carries, outer, strict=True):
            state = None
            if node is not None:
                state, self._n_states = self._n_states, self._n_states + 1
            states.append(state)
            derived = frozenset() if state is None else frozenset({state})
            origins.append(Origin(copy_of=o.copy_of, derived=derived, big=o.big))
        return origins, states

    def _carry_origins(self, carries, states, outer, bouts, bout_origins, body):
        """The loop's results, seen from outside: a carry the body hands on unchanged stays a
        copy of what entered; one the body computes linearly from the carries is linear in
        what entered them (and an update of it when the body combined it with something
        else). Records each float carry's :class:`LoopState`."""
        out = loop_result_origins(states, outer, bout_origins)
        cycles = recurrent_states(states, bout_origins)
        rows = zip(carries, states, bouts, out, bout_origins, strict=True)
        for node, state, src, o, o_out in rows:
            if node is not None:
                self.nodes[node].origin = o
                cycle = cycles.get(state, frozenset())
                self.loop_states.append(LoopState(state, node, src, o_out, body, cycle))
        return out

    def _unrun(self, carries, outer):
        """A loop that runs zero times: its carries hand on what entered them."""
        self.unrun_carries += [c for c in carries if c is not None]
        self._set_origins(carries, outer)
        return list(outer)

    def _body(self, layout, role, ins, path, region, unit, origins):
        return self._enter(layout.body(role), ins, f"{path}/{role}/", region, unit, origins)

    def _enter(self, body, ins, path, region, unit, origins):
        """Adds a body (closed or open jaxpr) whose invars take ``ins``; its consts are
        constants from nowhere in the graph."""
        n_consts = len(jc.open_jaxpr(body).constvars)
        return self._scope(
            jc.open_jaxpr(body),
            [None] * n_consts + list(ins),
            path,
            region,
            unit,
            const_origins(jc.consts_of(body), n_consts, self.limit) + list(origins),
        )

    def _consts(self, atoms, sources, path, process, unit, origins):
        """Loop-invariant operands enter through a clear node (TF's v1 ``Enter``), so a weight
        used only by half-precision ops in the body is cast once, before the loop."""
        nodes = self._structural("<const>", f"{path}/const", [a.aval for a in atoms], process, unit)
        self._link(nodes, sources)
        self._copies(nodes, origins)
        return nodes

    def _copies(self, nodes, origins):
        """Loop consts hand their operand on unchanged."""
        self._set_origins(nodes, [Origin(copy_of=o.copy_of, big=o.big) for o in origins])

    def _set_origins(self, nodes, origins):
        for node, o in zip(nodes, origins, strict=True):
            if node is not None:
                self.nodes[node].origin = o
