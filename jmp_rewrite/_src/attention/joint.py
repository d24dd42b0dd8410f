"""The backward pass of an attention in a differentiated program (``rewrite(grad(f))``).

PyTorch Inductor's ``fuse_attention`` pass traces each attention pattern through its
backward (``joint_fwd_bwd``) and matches forward and backward together. The same here, with
one difference: the reference is not a hand-written pattern per spelling but the program's
own forward attention, replayed and differentiated with ``jax.vjp`` by the JAX that traced
the program. JAX's differentiation is deterministic, so the program holds the reference's
equations -- the forward, the values the forward saves for the backward, the transposed
backward -- with the same primitives and parameters, wired the same way. :func:`unify` finds
them, anchored at the inputs (queries, keys, values, masks, biases), binding the output's
cotangent on the way, and returns every program equation of the attention and the
cotangents of its inputs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src.trace import higher_order as ho
from jmp_rewrite._src.trace.higher_order import bind

#: Parameter values compared by value only.
_PLAIN = (
    int,
    float,
    complex,
    str,
    bytes,
    bool,
    tuple,
    np.ndarray,
    np.generic,
    np.dtype,
    type(None),
)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _jaxpr_text(value: Any, cache: dict[int, str]) -> str:
    key = id(value)
    if key not in cache:
        cache[key] = str(value)
    return cache[key]


def same_params(a: dict[str, Any], b: dict[str, Any], cache: dict[int, str]) -> bool:
    """Equal equation parameters; bodies compared by their text (names are canonical)."""
    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        xs, ys = (x, y) if isinstance(x, tuple) and isinstance(y, tuple) else ((x,), (y,))
        if len(xs) != len(ys):
            return False
        for u, w in zip(xs, ys, strict=True):
            if jc.is_any_jaxpr(u) or jc.is_any_jaxpr(w):
                if _jaxpr_text(u, cache) != _jaxpr_text(w, cache):
                    return False
                continue
            try:
                same = bool(np.all(u == w)) if isinstance(u, np.ndarray) else u == w
            except Exception:  # noqa: BLE001 - objects that do not compare: by their text
                same = False
            if not same and type(u) is type(w) and not isinstance(u, _PLAIN):
                # a rule wrapped anew for each trace (custom_jvp_call's jvp): by its name
                same = _ADDRESS.sub("", str(u)) == _ADDRESS.sub("", str(w))
            if not same:
                return False
    return True


# -- the reference ----------------------------------------------------------------------------


def _live(jaxpr: Any, wanted: set[Any]) -> list[int]:
    """Indices of the equations ``wanted`` vars depend on (``wanted`` grows)."""
    keep = []
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if any(v in wanted for v in eqn.outvars):
            keep.append(i)
            wanted.update(a for a in eqn.invars if not jc.is_literal(a))
    return keep[::-1]


def _read(env: dict[Any, Any], atom: Any) -> Any:
    return jc.literal_value(atom) if jc.is_literal(atom) else env[atom]


def _replay(eqn: Any, invals: list[Any], keep: Sequence[bool]) -> list[Any]:
    """Binds ``eqn`` as the program's forward did before it was differentiated: a call that
    now also hands values to the backward pass is re-traced with its forward outputs only."""
    layout = ho.describe(eqn)
    if all(keep) or layout is None or layout.kind != ho.CALL:
        return bind(eqn, invals, eqn.params)
    body = layout.inner()
    outs = [v for v, k in zip(body.outvars, keep, strict=True) if k]

    def fun(*args: Any) -> tuple[Any, ...]:
        env = dict(zip(body.invars, args, strict=True))
        _run(body, env, {a for a in outs if not jc.is_literal(a)})
        return tuple(_read(env, a) for a in outs)

    fun.__name__ = fun.__qualname__ = ho.jit_name(eqn) or "fun"
    options = {k: eqn.params[k] for k in ("inline", "keep_unused") if k in eqn.params}
    values = iter(jax.jit(fun, **options)(*invals))
    return [next(values) if k else None for k in keep]


def _run(jaxpr: Any, env: dict[Any, Any], wanted: set[Any]) -> None:
    for i in _live(jaxpr, set(wanted)):
        eqn = jaxpr.eqns[i]
        keep = [
            not jc.is_drop_var(v) and v in wanted or _read_later(jaxpr, i, v) for v in eqn.outvars
        ]
        outs = _replay(eqn, [_read(env, a) for a in eqn.invars], keep)
        for v, x in zip(eqn.outvars, outs, strict=True):
            if x is not None and not jc.is_drop_var(v):
                env[v] = x


def _read_later(jaxpr: Any, i: int, var: Any) -> bool:
    if jc.is_drop_var(var):
        return False
    return any(var in e.invars for e in jaxpr.eqns[i + 1 :]) or var in jaxpr.outvars


class _Sub:
    """The forward equations of an attention as a jaxpr-like object for :func:`_run`."""

    def __init__(self, eqns: list[Any], outvars: list[Any]):
        self.eqns, self.outvars = eqns, outvars


def _forward(eqns: list[Any], inputs: list[Any], out: Any):
    sub = _Sub(eqns, [out])

    def forward(*args: Any) -> Any:
        env = dict(zip(inputs, args, strict=True))
        _run(sub, env, {out})
        return env[out]

    return forward


def forward_text(eqns: list[Any], inputs: list[Any], out: Any) -> str:
    """The forward ``eqns`` as the program ran them before it was differentiated, as text
    (names canonical): equal texts, equal references."""
    avals = [jc.abstract_value(a.aval) for a in inputs]
    return str(jax.make_jaxpr(_forward(eqns, inputs, out))(*avals))


def reference(eqns: list[Any], inputs: list[Any], n_diff: int, out: Any) -> Any:
    """``(out, cotangents of inputs[:n_diff])`` of the forward ``eqns``, traced with
    ``jax.vjp`` at the inputs' avals plus the cotangent of ``out`` (the last input)."""
    forward = _forward(eqns, inputs, out)

    def joint(*args: Any) -> tuple[Any, ...]:
        diff, rest, g = args[:n_diff], args[n_diff:-1], args[-1]
        value, pullback = jax.vjp(lambda *d: forward(*d, *rest), *diff)
        return (value, *pullback(g))

    avals = [jc.abstract_value(a.aval) for a in [*inputs, out]]
    return jax.make_jaxpr(joint)(*avals)


# -- matching ---------------------------------------------------------------------------------


class Unifier:
    """Finds a reference jaxpr's equations in a scope (see the module docstring)."""

    def __init__(self, scope_jaxpr: Any, readers: dict[Any, list[int]]):
        self.jaxpr = scope_jaxpr
        self.readers = readers
        self.producers: dict[Any, tuple[int, int]] = {}
        for i, eqn in enumerate(scope_jaxpr.eqns):
            for j, v in enumerate(eqn.outvars):
                if not jc.is_drop_var(v):
                    self.producers[v] = (i, j)
        self.text: dict[int, str] = {}

    def run(
        self, ref: Any, bound: dict[Any, Any], free: set[Any]
    ) -> tuple[dict[int, int], dict[Any, Any]] | None:
        """``(ref equation -> scope equation, ref var -> scope atom)``, or None."""
        rj = jc.open_jaxpr(ref)
        self.ref, self.free = rj, free
        self.ref_producers = {
            v: (i, j)
            for i, e in enumerate(rj.eqns)
            for j, v in enumerate(e.outvars)
            if not jc.is_drop_var(v)
        }
        self.m: dict[Any, Any] = dict(bound)
        self.eqmap: dict[int, int] = {}
        self.used: dict[int, int] = {}
        live = set(_live(rj, {a for a in rj.outvars if not jc.is_literal(a)}))
        for ri, eqn in enumerate(rj.eqns):
            if ri in self.eqmap:
                continue
            anchor = next(
                ((k, a) for k, a in enumerate(eqn.invars) if not jc.is_literal(a) and a in self.m),
                None,
            )
            if anchor is None:
                continue
            pos, atom = anchor
            target = self.m[atom]
            found = False
            for pi in self.readers.get(target, []):
                pe = self.jaxpr.eqns[pi]
                if pe.primitive.name != eqn.primitive.name or pos >= len(pe.invars):
                    continue
                if pe.invars[pos] is not target:
                    continue
                saved = (dict(self.m), dict(self.eqmap), dict(self.used))
                if self._eqn(ri, pi):
                    found = True
                    break
                self.m, self.eqmap, self.used = saved
            if not found and ri in live:
                return None
        if not live <= set(self.eqmap):
            return None
        if any(jc.is_literal(a) or a not in self.m for a in rj.outvars):
            return None
        return self.eqmap, self.m

    def _eqn(self, ri: int, pi: int) -> bool:
        if ri in self.eqmap:
            return self.eqmap[ri] == pi
        if pi in self.used:
            return False
        r, p = self.ref.eqns[ri], self.jaxpr.eqns[pi]
        if (
            r.primitive.name != p.primitive.name
            or len(r.invars) != len(p.invars)
            or len(r.outvars) != len(p.outvars)
            or any(
                getattr(a.aval, "shape", None) != getattr(b.aval, "shape", None)
                or getattr(a.aval, "dtype", None) != getattr(b.aval, "dtype", None)
                for a, b in zip(r.outvars, p.outvars, strict=True)
            )
            or not same_params(r.params, p.params, self.text)
        ):
            return False
        self.eqmap[ri], self.used[pi] = pi, ri
        for a, b in zip(r.invars, p.invars, strict=True):
            if not self._atom(a, b):
                return False
        for a, b in zip(r.outvars, p.outvars, strict=True):
            if not jc.is_drop_var(a):
                self.m[a] = b
        return True

    def _atom(self, r: Any, p: Any) -> bool:
        if jc.is_literal(r):
            if not jc.is_literal(p):
                return False
            x, y = np.asarray(jc.literal_value(r)), np.asarray(jc.literal_value(p))
            return (
                x.dtype == y.dtype
                and x.shape == y.shape
                and bool(np.all((x == y) | (x != x) & (y != y)))
            )
        if r in self.m:
            return self.m[r] is p
        if jc.is_literal(p) or jc.is_drop_var(p):
            return False
        if r in self.free:
            self.m[r] = p
            return True
        where_r, where_p = self.ref_producers.get(r), self.producers.get(p)
        if where_r is None or where_p is None or where_r[1] != where_p[1]:
            return False
        return self._eqn(where_r[0], where_p[0])
