"""Small helpers for tests that inspect emitted jaxprs (recursing into sub-jaxprs)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def sub_jaxprs(eqn: Any) -> Iterator[Any]:
    for value in eqn.params.values():
        for v in value if isinstance(value, tuple) else (value,):
            if hasattr(v, "eqns"):
                yield v
            elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                yield v.jaxpr


def all_eqns(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` (closed or open), sub-jaxprs included, in order."""
    jaxpr = jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") and hasattr(jaxpr.jaxpr, "eqns") else jaxpr
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn):
            yield from all_eqns(sub)


def scopes(jaxpr: Any) -> Iterator[Any]:
    """``jaxpr`` and every sub-jaxpr (open)."""
    jaxpr = jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") and hasattr(jaxpr.jaxpr, "eqns") else jaxpr
    yield jaxpr
    for eqn in jaxpr.eqns:
        for sub in sub_jaxprs(eqn):
            yield from scopes(sub)


def float_in_dtypes(eqn: Any) -> list[np.dtype]:
    return [
        np.dtype(a.aval.dtype) for a in eqn.invars if jnp.issubdtype(a.aval.dtype, jnp.floating)
    ]


def runs_in_half(eqn: Any) -> bool:
    dtypes = float_in_dtypes(eqn)
    return bool(dtypes) and all(d in HALF for d in dtypes)


def prims(jaxpr: Any, name: str) -> list[Any]:
    return [e for e in all_eqns(jaxpr) if e.primitive.name == name]


def casts(jaxpr: Any) -> list[Any]:
    return prims(jaxpr, "convert_element_type")


def emitted(fun: Any, *args: Any, **kwargs: Any) -> Any:
    return jax.make_jaxpr(fun)(*args, **kwargs)


def _platform_branch(eqn: Any, platform: str) -> Any | None:
    """The branch a ``lax.platform_dependent`` cond lowers for ``platform`` (None: not one)."""
    chosen = eqn.params.get("branches_platforms") if eqn.primitive.name == "cond" else None
    if chosen is None:
        return None
    index = next((i for i, ps in enumerate(chosen) if ps and platform in ps), None)
    if index is None:
        index = next((i for i, ps in enumerate(chosen) if ps is None), None)
    assert index is not None, f"{platform} has no branch in {chosen}"
    return eqn.params["branches"][index].jaxpr


def lowered_eqns(jaxpr: Any, platform: str) -> Iterator[Any]:
    """:func:`all_eqns` of ``jaxpr`` as it is lowered for ``platform``: of each
    ``lax.platform_dependent`` (a ``cond`` over a ``platform_index``), the platform's branch
    alone, as the lowering keeps it (``dtype=None``, float8, fused attention)."""
    jaxpr = jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") and hasattr(jaxpr.jaxpr, "eqns") else jaxpr
    for eqn in jaxpr.eqns:
        branch = _platform_branch(eqn, platform)
        if branch is not None:
            yield from lowered_eqns(branch, platform)
            continue
        if eqn.primitive.name == "platform_index":
            continue
        yield eqn
        for sub in sub_jaxprs(eqn):
            yield from lowered_eqns(sub, platform)


def lowered_prims(jaxpr: Any, name: str, platform: str) -> list[Any]:
    """:func:`prims` of ``jaxpr`` as lowered for ``platform`` (see :func:`lowered_eqns`)."""
    return [e for e in lowered_eqns(jaxpr, platform) if e.primitive.name == name]


def compiled_loop_bodies(fun: Any, *args: Any) -> str:
    """The optimised HLO that XLA runs on every trip of ``jit(fun)``'s loops: each
    ``while``'s body and condition and every computation they call (fusions, nested loops).
    What XLA hoisted out of a loop (a loop-invariant cast) is not in it."""
    text = jax.jit(fun).lower(*args).compile().as_text()
    comps: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            name = head.group(1)
            comps[name] = ""
        elif name is not None:
            comps[name] += line + "\n"
    called = lambda body: re.findall(r"(?:calls|body|condition|to_apply)=%?([\w.\-]+)", body)  # noqa: E731
    todo = [
        n for body in comps.values() for n in re.findall(r"(?:body|condition)=%?([\w.\-]+)", body)
    ]
    seen: set[str] = set()
    while todo:
        n = todo.pop()
        if n not in seen and n in comps:
            seen.add(n)
            todo += called(comps[n])
    return "".join(comps[n] for n in sorted(seen))


#: Equations a value that saturates on its way into half passes before its cast (a clamped
#: constant, a pinned big value): those are cast before a body, where their flags are known.
_SATURATING = ("clamp", "max", "min", "select_n", "pjit", "jit")


def _loops_inside(eqn: Any) -> bool:
    return any(
        e.primitive.name in ("scan", "while", "shard_map")
        for b in sub_jaxprs(eqn)
        for e in all_eqns(b)
    )


def half_casts_handed_into_bodies(jaxpr: Any) -> list[str]:
    """Where a body is handed a float32 value already cast into half: an operand of a
    higher-order equation, outside its per-trip groups (carries, scanned slices), that its
    own scope cast from a computed or input float32 value. Under ``grad`` its cotangent would
    be summed in half (a loop's over every trip). Only values with a float path from the
    scope's inputs count (the library's own pinned fills derive from integer flags), and
    only bodies that sum over trips or devices: loops, ``shard_map``, a call or branch with
    one inside (a plain call sums a cotangent over its readers, as the top level does; the
    library's own leaf wrappers take half operands by design). Empty where the rule holds."""
    from jmp_rewrite._src import _jax_compat as jc
    from jmp_rewrite._src.trace import higher_order as ho

    found = []
    for scope in scopes(jaxpr):
        made = {v: e for e in scope.eqns for v in e.outvars}
        # values with a float path from the scope's inputs (a pinned flag's fill is not one)
        derived = {v for v in scope.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)}
        for e in scope.eqns:
            if any(not jc.is_literal(a) and a in derived for a in e.invars):
                derived.update(v for v in e.outvars if hasattr(v.aval, "dtype"))
        for eqn in scope.eqns:
            layout = ho.describe(eqn)
            summing = layout is not None and layout.kind in (ho.SCAN, ho.WHILE, ho.SHARD_MAP)
            if layout is None or not (summing or _loops_inside(eqn)):
                continue  # its transpose sums nothing over trips or devices
            per_trip = set(ho.per_trip_positions(layout))
            for i, atom in enumerate(eqn.invars):
                cast = None if i in per_trip or jc.is_literal(atom) else made.get(atom)
                if cast is None or cast.primitive.name != "convert_element_type":
                    continue
                src = cast.invars[0]
                source = made.get(src)
                if (
                    np.dtype(cast.outvars[0].aval.dtype) in HALF
                    and np.dtype(src.aval.dtype) == np.float32
                    and src in derived
                    and not (source is not None and source.primitive.name in _SATURATING)
                ):
                    found.append(
                        f"{eqn.primitive.name} operand {i}: {cast.outvars[0].aval.str_short()}"
                    )
    return found
