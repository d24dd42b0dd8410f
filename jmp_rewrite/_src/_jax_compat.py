"""The one place that knows how JAX's IR types differ between versions.

JAX 0.10 has separate ``ClosedJaxpr`` (a ``Jaxpr`` plus ``consts``) and ``Jaxpr``.
JAX 0.11 merged them: ``ClosedJaxpr`` is an alias of ``Jaxpr``, which carries its own
``consts`` and whose ``.jaxpr`` returns itself. Several ``jax.core`` names moved to
``jax.extend.core``. Everything else in jmp_rewrite goes through the helpers here, so a
JAX upgrade touches this file only.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.extend.core as jex_core
import numpy as np

ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
JaxprEqn = jex_core.JaxprEqn
Literal = jex_core.Literal
Var = jex_core.Var
DropVar = jex_core.DropVar
Primitive = jex_core.Primitive
primitives = jex_core.primitives

#: True on JAX >= 0.11, where ``ClosedJaxpr is Jaxpr``.
MERGED_JAXPR_TYPES: bool = ClosedJaxpr is Jaxpr


def is_closed_jaxpr(value: Any) -> bool:
    """Whether ``value`` is a jaxpr that carries its consts (a ``ClosedJaxpr`` in 0.10)."""
    if MERGED_JAXPR_TYPES:
        return False  # one type only: treated as an open jaxpr with its own consts
    return isinstance(value, ClosedJaxpr)


def is_open_jaxpr(value: Any) -> bool:
    """Whether ``value`` is a bare ``Jaxpr`` (``checkpoint`` and ``shard_map`` hold one)."""
    return isinstance(value, Jaxpr) and not is_closed_jaxpr(value)


def is_any_jaxpr(value: Any) -> bool:
    return is_closed_jaxpr(value) or is_open_jaxpr(value)


def open_jaxpr(value: Any) -> Any:
    """The bare jaxpr (eqns, invars, constvars, outvars) of a closed or open jaxpr."""
    return value.jaxpr if is_closed_jaxpr(value) else value


def consts_of(value: Any) -> list[Any]:
    """The const values bound to a jaxpr's constvars (empty for an open 0.10 jaxpr)."""
    if is_closed_jaxpr(value):
        return list(value.consts)
    return list(getattr(value, "consts", ()) or ())


def make_closed(jaxpr: Any, consts: list[Any]) -> Any:
    """A closed jaxpr from a bare one and its consts."""
    if MERGED_JAXPR_TYPES:  # pragma: no cover - JAX >= 0.11: a Jaxpr holds its consts
        if list(consts) != list(consts_of(jaxpr)):
            raise NotImplementedError("re-closing a jaxpr over new consts on JAX >= 0.11")
        return jaxpr
    return ClosedJaxpr(jaxpr, consts)


def same_form(original: Any, closed: Any, eqn_name: str) -> Any:
    """``closed`` (fresh from ``jax.make_jaxpr``) in the form ``original`` had in a param."""
    if MERGED_JAXPR_TYPES or is_closed_jaxpr(original):  # pragma: no branch
        return closed
    if consts_of(closed):
        raise NotImplementedError(
            f"rewriting the body of {eqn_name!r} created array constants, which its open "
            "jaxpr cannot hold; please report this program"
        )
    return open_jaxpr(closed)


def function_name(jaxpr: Any, default: str = "fun") -> str:
    """The traced function's name, from the jaxpr's debug info when it has one."""
    info = getattr(jaxpr, "debug_info", None)
    src = getattr(info, "func_src_info", None) or getattr(info, "func_name", None)
    name = str(src).split(" ")[0] if src else default
    return name if name.isidentifier() else default


def var_aval(atom: Any) -> Any:
    return atom.aval


def is_array_aval(aval: Any) -> bool:
    """Whether ``aval`` is an array's (``ShapedArray``), not a mutable Ref's, a token's or
    another abstract value's (a Ref's aval has a shape and dtype too, but is read with
    ``get`` and written with ``swap``)."""
    return isinstance(aval, jax.core.ShapedArray)


def is_literal(atom: Any) -> bool:
    return isinstance(atom, Literal)


def literal_value(atom: Any) -> Any:
    return atom.val


def is_drop_var(atom: Any) -> bool:
    return isinstance(atom, DropVar)


def name_stack(eqn: Any) -> str:
    """The name-stack string of an equation (``jax.named_scope`` names live here)."""
    info = getattr(eqn, "source_info", None)
    return str(getattr(info, "name_stack", "")) if info is not None else ""


def bind_params(eqn: Any, params: dict[str, Any]) -> dict[str, Any]:
    """``get_bind_params`` across versions: always returns the dict to pass to ``bind``."""
    result = eqn.primitive.get_bind_params(params)
    if isinstance(result, tuple):  # JAX < 0.9.2 returned (subfuns, params)
        subfuns, result = result
        if subfuns:
            raise NotImplementedError(
                f"primitive {eqn.primitive.name!r} needs sub-functions, which this JAX "
                "version passes positionally; upgrade to jax>=0.10.2"
            )
    return result


def eval_jaxpr(jaxpr: Any, *args: Any) -> list[Any]:
    """Evaluates a closed (or const-free open) jaxpr on ``args``."""
    return list(jex_core.jaxpr_as_fun(_as_closed(jaxpr))(*args))


def _as_closed(value: Any) -> Any:
    if is_closed_jaxpr(value):
        return value
    return make_closed(value, consts_of(value))


def to_numpy_dtype(value: Any, dtype: Any) -> Any:
    """A literal's value converted to ``dtype`` (kept as a NumPy scalar or array)."""
    return np.asarray(value, dtype=dtype)


def dtype_of(x: Any) -> Any:
    return jax.numpy.result_type(x) if not hasattr(x, "dtype") else x.dtype


def abstract_value(aval: Any, dtype: Any = None, weak_type: bool | None = None) -> Any:
    """A ``jax.ShapeDtypeStruct`` with everything JAX knows about ``aval`` -- shape, weak
    type, sharding (an Explicit mesh's), varying manual axes (inside ``shard_map``) -- but
    ``dtype`` and ``weak_type`` replaced where given. Tracing a body at these keeps JAX's
    checks (``check_vma``, explicit shardings) seeing the types the program had."""
    sharding = getattr(aval, "sharding", None)
    if sharding is not None and getattr(sharding.mesh, "empty", True):
        sharding = None
    mat = getattr(aval, "mat", None)
    if mat is not None and getattr(mat, "empty", True):
        mat = None
    return jax.ShapeDtypeStruct(
        aval.shape,
        aval.dtype if dtype is None else dtype,
        sharding=sharding,
        weak_type=aval.weak_type if weak_type is None else weak_type,
        manual_axis_type=mat,
    )


def abstract_key(aval: Any) -> tuple[Any, ...]:
    """A hashable key of what :func:`abstract_value` keeps (for trace caches)."""
    sharding = getattr(aval, "sharding", None)
    spec = None if sharding is None or getattr(sharding.mesh, "empty", True) else sharding
    mat = getattr(aval, "mat", None)
    return (aval.shape, str(aval.dtype), aval.weak_type, spec, None if mat is None else str(mat))


def traceback_frames(eqn: Any) -> list[tuple[str, str, int, int, int, int]]:
    """The Python frames that created an equation, innermost first.

    Each frame is ``(file, qualified function name, line, column, end line, end column)`` of
    the instruction running in it (for a call: the span of the call expression); columns are
    -1 where JAX's traceback object cannot give them. Equations in a sub-jaxpr (a ``jit``
    body) carry only the frames of that body's trace. Empty when JAX recorded no traceback.
    """
    info = getattr(eqn, "source_info", None)
    tb = getattr(info, "traceback", None)
    if tb is None:
        return []
    try:  # jaxlib's Traceback: raw (code, lasti) pairs and their source positions
        codes, lastis = tb.raw_frames()
        out = []
        for code, lasti in zip(codes, lastis, strict=True):
            line, col, end_line, end_col = tb.code_addr2location(code, lasti)
            name = getattr(code, "co_qualname", code.co_name)
            out.append((code.co_filename, name, line, col, end_line, end_col))
        return out
    except Exception:  # pragma: no cover - older/newer jaxlib: line numbers only
        return [(f.file_name, f.function_name, f.line_num, -1, f.line_num, -1) for f in tb.frames]


def cuda_attention_target() -> tuple[tuple[int, int], tuple[int, int]] | None:
    """``((major, minor) compute capability, (major, minor) cuDNN version)`` of the first
    local CUDA device, or None where there is none or either cannot be read (a deviceless
    compile, a CPU). cuDNN's version comes from the CUDA plugin's ``_versions`` module
    (``jax_cuda12_plugin``, ``jax_cuda13_plugin``), as ``cudnn_get_version()`` (90500)."""
    import importlib

    try:
        device = jax.local_devices(backend="cuda")[0]
        cc = tuple(int(x) for x in str(device.compute_capability).split(".")[:2])
    except Exception:  # noqa: BLE001 - no CUDA backend, or no card
        return None
    for name in ("jax_cuda13_plugin._versions", "jax_cuda12_plugin._versions"):
        try:
            number = int(importlib.import_module(name).cudnn_get_version())
        except Exception:  # noqa: BLE001 - not this plugin, or no such function
            continue
        return (cc[0], cc[1]), (number // 10000, number // 100 % 100)
    return None
