"""Float8 matmuls inside a bfloat16 rewrite: ``rewrite(step, dtype=jnp.bfloat16, fp8=True)``.

Which matmuls (:func:`select`): the *weight GEMMs* of a program's blocks -- a ``dot_general``
painted half precision one of whose operands is linear in a program input through data
movement, casts and linear ops (a parameter, its transpose, its bfloat16 copy, a layer's
slice of stacked parameters; origins.Origin.derived) -- whose M, N and K are large enough to
pay. Attention's activation x activation matmuls (operands computed by other matmuls and
nonlinear ops), one-hot embedding matmuls, the first and the last weight GEMM (the network's
input layer and its output head), matmuls inside a ``float32_region`` and those asking for a
precision stay as the bfloat16 rewrite paints them. :class:`Fp8Rules` moves matmuls in or out
by model scope or source line (the names ``explain`` shows).

How (:func:`fp8_dot`): per-tensor *current* scaling -- amax of the operand in float32,
``scale = amax / finfo(f8).max`` (a zero amax scales by 1; a non-finite amax gives a
non-finite result, which the loss-scale optimizer or the user's NaN checks then see), values
saturated at ``+-finfo(f8).max`` before the cast (float8_e4m3fn has no infinity: an
unsaturated overflow would become NaN). Forward operands e4m3 x e4m3; the backward GEMMs take
the cotangent in e5m2 and reuse the forward's quantized operand (a ``jax.custom_vjp``), so
``grad(rewrite(f))`` runs three float8 GEMMs per weight GEMM. In ``rewrite(grad(f))`` the
backward matmuls are already in the program: a backward-pass ``dot_general`` that reads the
very same value as a selected forward matmul of its jaxpr (JAX's transpose of a
``dot_general`` reads the forward's operands) is quantized the same way, the shared operand
e4m3 and the other (the cotangent) e5m2; values are followed through calls (``jit``, the
backward pass's ``checkpoint`` bodies). A forward matmul that ``jax.checkpoint`` recomputes in
the backward pass (``rematted_computation``) is a forward GEMM, run as its forward is (e4m3 x
e4m3), never paired as a gradient GEMM. Forward and backward in separate jaxprs (a ``scan``
over layers differentiated before the rewrite) cannot be paired that way: there the
backward matmuls stay bfloat16; ``grad(rewrite(f))`` quantizes them. A GEMM in a loop body is
every iteration's: never "the first" or "the last" weight GEMM.

Emission: on CUDA the float8 operands go to ``dot_general`` with a
``lax.DotAlgorithmPreset.ANY_F8_ANY_F8_*`` precision, the only form XLA:GPU turns into the
cuBLASLt float8 GEMM (``__cublas$lt$matmul$f8``) with default flags (plain float8 dots become
Triton fusions); the scales multiply the float32 result and fold into the GEMM. Elsewhere
(CPU: the presets do not lower there) the same quantized values are dequantized exactly to
float32 and multiplied with float32 accumulation: the same rounding. The choice is made at
lowering time by ``lax.platform_dependent``, so one rewritten function runs on CPU, compiles
deviceless for an H100/H200 and runs on the card. A TPU lowering runs the bfloat16 matmul
(:data:`TPU_REASON`); where the default device is a TPU, ``Fp8NoneSelectedWarning`` says so.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src.trace import higher_order as ho
from jmp_rewrite._src.trace import source_info

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)

#: Forward GEMMs: fast accumulation (Hopper's tensor cores accumulate float8 products in a
#: reduced-precision accumulator, promoted to float32 periodically). ``..._F32_FAST_ACCUM``
#: rather than ``ANY_F8_ANY_F8_ANY_FAST_ACCUM``: jax 0.11.2 lowers the latter *without* the
#: fast-accumulation flag (measured in a deviceless XLA:GPU compile, 2026-11-26), while the F32
#: form keeps it; the GEMM's float32 result is scaled and cast to bfloat16 in its epilogue.
FORWARD_PRESET = lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM
#: Gradient GEMMs: full float32 accumulation (Flax's and Transformer Engine's convention:
#: gradients sum over the batch, where a reduced-precision accumulator loses most).
BACKWARD_PRESET = lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32

#: The smallest M, N and K of a float8 GEMM, by default. Roofline of an H200 (989 TFLOP/s
#: bf16, 1979 float8, 4.8 TB/s; ridge points 206 and 412 FLOP/byte) for a GEMM of M tokens
#: and N = K = d: 2Md^2 FLOPs; bf16 moves ~4Md bytes (operand and result), float8 ~3Md (a
#: one-byte operand, a bf16 result). bf16 is compute-bound from d ~ 412, float8 from d ~ 618;
#: in between float8 saves a quarter of the bytes, below d ~ 256 hardly anything. Current
#: scaling adds, per operand element, an amax read and a quantizing copy (~3 bytes when XLA
#: fuses the amax into the producer, ~5 when nothing fuses), which the halved GEMM time
#: repays from d ~ 600 (~1000 unfused). 256 is thus the lowest size at which float8 can win
#: (when the quantization fuses into the producer); raise ``min_dim`` for models where it
#: does not. The measurements' cost model gives 1.03-1.15x at d = 768, 1.15-1.30x at 4096
#: (shared/measurements/fp8-xla-gpu-facts-2026-11-26.md; not measured on a card).
MIN_DIM = 256
#: XLA pads float8 GEMM dimensions to multiples of 16 (a copy of the operand) otherwise.
MULTIPLE = 16


@dataclasses.dataclass(frozen=True)
class Fp8Rules:
    """Which matmuls of a bfloat16 rewrite run in float8 (immutable, hashable).

    ``fp8=True`` is ``Fp8Rules()``. Patterns are ``fnmatch`` patterns matched against a
    matmul's model scope (``GPT/Block_3/Dense_0``) and its source (``model.py:42``), the
    names :func:`jmp_rewrite.explain` shows; a pattern matching no matmul of the program is
    an error when the function is traced.

    Attributes:
      include: matmuls to run in float8 whatever the default rules say (any half-precision
        ``dot_general`` outside float32 regions: an attention matmul, the head, a small one).
      exclude: matmuls to keep bfloat16 (wins over ``include``).
      min_dim: the smallest M, N and K of a float8 GEMM (256 by default, the smallest size
        at which the halved GEMM time can repay the quantizing passes).
      multiple: M, N and K must be multiples of it (XLA pads otherwise).
      keep_first: keep the program's first weight GEMM (its input layer) bfloat16.
      keep_last: keep its last weight GEMM (the output head) bfloat16.

    Example:
      >>> import jmp_rewrite
      >>> jmp_rewrite.Fp8Rules(exclude=("*/attn/*",)).min_dim
      256
    """

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    min_dim: int = MIN_DIM
    multiple: int = MULTIPLE
    keep_first: bool = True
    keep_last: bool = True

    def __post_init__(self) -> None:
        for name in ("include", "exclude"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, Iterable):
                raise TypeError(
                    f"Fp8Rules.{name} must be a tuple of patterns (strings), got {value!r}"
                )
            value = tuple(value)
            bad = [v for v in value if not isinstance(v, str) or not v]
            if bad:
                raise TypeError(f"Fp8Rules.{name}: patterns must be non-empty strings, got {bad}")
            object.__setattr__(self, name, value)
        for name in ("min_dim", "multiple"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Fp8Rules.{name} must be a positive int, got {value!r}")


def resolve_rules(fp8: Any) -> Fp8Rules | None:
    """``fp8=`` as given to ``rewrite``: False/None (off), True (default rules) or rules."""
    if fp8 is None or fp8 is False:
        return None
    if fp8 is True:
        return Fp8Rules()
    if isinstance(fp8, Fp8Rules):
        return fp8
    raise TypeError(f"fp8 must be True, False or a jmp_rewrite.Fp8Rules, got {fp8!r}")


#: Why float8 needs ``dtype=jnp.bfloat16`` (said when another dtype is asked for).
NEEDS_BF16 = (
    "fp8=True needs dtype=jnp.bfloat16: float8 GEMMs on Hopper take float8 operands and give "
    "a bfloat16 (or float32) result, which the bfloat16 rewrite's neighbours read as they are; "
    "a float16 rewrite relies on loss scaling, whose scale the per-tensor float8 scales would "
    "undo and fight (and float16's range would clip the GEMM's output)"
)


# -- selection ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fp8Dot:
    """How one ``dot_general`` runs in float8.

    Attributes:
      formats: the float8 dtype of the lhs and of the rhs.
      fast_accum: fast (reduced-precision) accumulation: forward GEMMs only.
      role: ``forward``, or ``backward`` (a gradient GEMM already in the program).
    """

    formats: tuple[np.dtype, np.dtype]
    fast_accum: bool
    role: str

    def describe(self) -> str:
        return " x ".join(_short(f) for f in self.formats)


@dataclasses.dataclass(frozen=True)
class Fp8Selection:
    """The float8 choice of a painting (``Painting.fp8``).

    Attributes:
      dots: node id -> :class:`Fp8Dot` for the matmuls run in float8.
      left: node id -> why a half-precision matmul stays bfloat16 (a sentence; ``shape:
        ...`` when only its shape kept it).
    """

    dots: dict[int, Fp8Dot] = dataclasses.field(default_factory=dict)
    left: dict[int, str] = dataclasses.field(default_factory=dict)


def gemm_dims(eqn: Any) -> tuple[int, int, int]:
    """M, N and K of a ``dot_general`` (batch dimensions left out)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = (a.aval.shape for a in eqn.invars[:2])
    m = math.prod(d for i, d in enumerate(lhs) if i not in (*lc, *lb))
    n = math.prod(d for i, d in enumerate(rhs) if i not in (*rc, *rb))
    k = math.prod(lhs[i] for i in lc)
    return m, n, k


def _shape_problem(eqn: Any, rules: Fp8Rules) -> str:
    dims = dict(zip("MNK", gemm_dims(eqn), strict=True))
    bad = [f"{k}={v}" for k, v in dims.items() if v < rules.min_dim or v % rules.multiple]
    if not bad:
        return ""
    return (
        f"shape: {', '.join(bad)} (float8 needs M, N, K >= {rules.min_dim} and multiples of "
        f"{rules.multiple})"
    )


def _matches(patterns: tuple[str, ...], where: source_info.Origin) -> list[str]:
    names = [n for n in (where.scope, where.source) if n]
    return [p for p in patterns if any(fnmatch.fnmatchcase(n, p) for n in names)]


def _one_hot(producer: Any) -> bool:
    """A one-hot matrix: a cast from booleans/integers, or ``jax.nn.one_hot``'s jit."""
    if producer is None:
        return False
    name = producer.primitive.name
    if name == "convert_element_type":
        return not jnp.issubdtype(producer.invars[0].aval.dtype, jnp.inexact)  # not a real part
    return "one_hot" in str(producer.params.get("name", ""))


@dataclasses.dataclass
class _Dot:
    node: int
    eqn: Any
    scope: Any  # the ScopeRec instance
    origins: tuple[Any, ...]  # graph origins of the operands
    producers: tuple[Any, ...]  # producing equations of the operands in this scope
    where: source_info.Origin
    values: tuple[Any, ...]  # the operands as values of the whole program (see _dots)
    in_loop: bool = False  # in a scan or while body: one equation for every iteration


def _dots(graph: Any, painting: Any, where: dict[int, source_info.Origin]) -> list[_Dot]:
    """Every ``dot_general`` painted half precision, in program order.

    Each operand is also named as a value of the whole program: a call's (``jit``,
    ``checkpoint``, ``custom_vjp``) parameter is the caller's argument, its result what the
    body returns, so that a gradient GEMM inside the backward pass's ``checkpoint`` reads
    the same value as the forward GEMM outside. Loop bodies keep values of their own (one
    per iteration)."""
    out: list[_Dot] = []
    visits = iter(range(1 << 62))

    def visit(scope: Any, names: dict[Any, Any], in_loop: bool) -> int:
        producers: dict[Any, Any] = {}
        here = next(visits)

        def value(a: Any) -> Any:
            return None if jc.is_literal(a) else names.get(a, (here, a))

        for eqn, rec in zip(scope.jaxpr.eqns, scope.eqns, strict=True):
            if (
                eqn.primitive.name == "dot_general"
                and rec.node is not None
                and rec.node in painting.allow
                and graph.nodes[rec.node].key == "dot_general"
            ):
                ops = eqn.invars[:2]
                out.append(
                    _Dot(
                        rec.node,
                        eqn,
                        scope,
                        tuple(rec.operand_origins[:2]) if rec.operand_origins else (None, None),
                        tuple(None if jc.is_literal(a) else producers.get(a) for a in ops),
                        where.get(rec.node, source_info.Origin()),
                        tuple(value(a) for a in ops),
                        in_loop,
                    )
                )
            for v in eqn.outvars:
                producers[v] = eqn
            for sub in rec.subs.values():
                for s in sub if isinstance(sub, list) else [sub]:
                    inner = s.jaxpr
                    call = rec.kind in CALL_KINDS and len(inner.invars) == len(eqn.invars)
                    ins = (
                        {v: value(a) for v, a in zip(inner.invars, eqn.invars) if value(a)}
                        if call
                        else {}
                    )
                    loop = rec.kind in (ho.SCAN, ho.WHILE)
                    there = visit(s, ins, in_loop or loop)
                    if call and len(inner.outvars) == len(eqn.outvars):
                        for v, r in zip(eqn.outvars, inner.outvars, strict=True):
                            if not jc.is_literal(r):
                                names[v] = ins.get(r, (there, r))
        return here

    visit(graph.top, {}, False)
    out.sort(key=lambda d: d.node)
    return out


#: Higher-order kinds (graph.EqnRec.kind) whose body runs once per call, its parameters the
#: caller's arguments (not loops: a loop body's values differ per iteration).
CALL_KINDS = (ho.CALL, ho.CUSTOM_JVP, ho.CUSTOM_VJP, ho.SHARD_MAP)


def _rematerialised(d: _Dot) -> bool:
    """A forward matmul recomputed inside the backward pass by ``jax.checkpoint``: JAX
    names the recomputation ``rematted_computation``; it is a forward GEMM, not a gradient
    one, whatever the backward operands it shares a value with."""
    return "rematted_computation" in jc.name_stack(d.eqn)


def _same_gemm(forward: _Dot, remat: _Dot) -> bool:
    """Whether ``remat`` recomputes ``forward``: same source, dimension numbers and operand
    shapes, and a parameter value (a weight operand) in common."""
    f, r = forward.eqn, remat.eqn
    return (
        forward.where.source == remat.where.source
        and f.params["dimension_numbers"] == r.params["dimension_numbers"]
        and [a.aval.shape for a in f.invars[:2]] == [a.aval.shape for a in r.invars[:2]]
        and any(
            fv is not None and fv == rv and _weight_operand(o)
            for fv, rv, o in zip(forward.values, remat.values, forward.origins, strict=True)
        )
    )


def _weight_operand(origin: Any) -> bool:
    return origin is not None and not origin.const and bool(origin.derived)


def select(graph: Any, painting: Any, rules: Fp8Rules, check_patterns: bool = True):
    """Chooses the float8 matmuls of a painted graph (see the module docstring).

    Raises:
      ValueError: if ``check_patterns`` and a pattern of ``rules`` matches no matmul.
    """
    where = source_info.origins(graph)
    dots = _dots(graph, painting, where)
    sel = Fp8Selection()
    used: set[str] = set()
    forward = [d for d in dots if d.where.phase == source_info.FORWARD]
    weights = [
        d
        for d in forward
        if any(_weight_operand(o) for o in d.origins) and not any(map(_one_hot, d.producers))
    ]
    # The input layer and the head run once: a GEMM in a loop body is every layer of a
    # ``scan`` over layers, not the first or last of them (keeping it would keep them all).
    first = weights[0].node if weights and not weights[0].in_loop else None
    last = weights[-1].node if weights and not weights[-1].in_loop else None
    weight_ids = {d.node for d in weights}
    for d in forward:
        if d.node in weight_ids:
            reason = _shape_problem(d.eqn, rules)
            if rules.keep_first and d.node == first:
                reason = "the first weight GEMM (the input layer) stays bfloat16"
            elif rules.keep_last and d.node == last:
                reason = "the last weight GEMM (the output head) stays bfloat16"
        elif any(map(_one_hot, d.producers)):
            reason = "an embedding (one-hot matmul) stays bfloat16"
        else:
            reason = "activation x activation (no parameter operand) stays bfloat16"
        inc, exc = _matches(rules.include, d.where), _matches(rules.exclude, d.where)
        used.update(inc, exc)
        if exc:
            reason = f"excluded by {exc[0]!r}"
        elif inc:
            reason = ""
        if reason:
            sel.left[d.node] = reason
        else:
            sel.dots[d.node] = Fp8Dot((E4M3, E4M3), True, source_info.FORWARD)
    # rewrite(grad(jax.checkpoint(f))): the forward GEMMs recomputed in the backward pass
    # run as their forward does (e4m3 x e4m3): the one reading the same parameter value, of
    # the same source and shapes. One whose forward is not found (in a loop) stays bfloat16.
    remat = [d for d in dots if d.where.phase != source_info.FORWARD and _rematerialised(d)]
    for d in remat:
        twin = next((f for f in forward if _same_gemm(f, d)), None)
        if twin is None:
            sel.left[d.node] = "a recomputed forward matmul whose forward was not found"
        elif twin.node in sel.dots:
            sel.dots[d.node] = sel.dots[twin.node]
        else:
            sel.left[d.node] = sel.left[twin.node]
    # rewrite(grad(f)): the gradient GEMMs of the selected forward ones, paired through the
    # value they share (JAX's transpose of a dot_general reads the forward's operands).
    shared = {v for d in (*forward, *remat) if d.node in sel.dots for v in d.values if v}
    for d in dots:
        if d.where.phase == source_info.FORWARD or _rematerialised(d):
            continue
        hits = [v is not None and v in shared for v in d.values]
        exc = _matches(rules.exclude, d.where)
        used.update(exc)
        if hits.count(True) != 1 or exc:
            continue
        fmts = (E4M3, E5M2) if hits[0] else (E5M2, E4M3)
        sel.dots[d.node] = Fp8Dot(fmts, False, source_info.BACKWARD)
    if check_patterns:
        unused = [p for p in (*rules.include, *rules.exclude) if p not in used]
        if unused:
            names = sorted({n for d in dots for n in (d.where.scope, d.where.source) if n})
            raise ValueError(
                f"Fp8Rules pattern {unused[0]!r} matches no half-precision matmul of the "
                f"program; its matmuls' scopes and sources are: {', '.join(names[:20]) or 'none'}"
                + (" ..." if len(names) > 20 else "")
            )
    return sel


#: Why a TPU lowering keeps the selected matmuls bfloat16: XLA:TPU compiles float8 GEMMs for
#: v5e/v5p/v6e, but by its own cost model 1.08-1.17x slower than bfloat16 at 1.06-1.17x the
#: peak (an emulation at a loss); the selection applies on CUDA (and emulated on CPU) only.
TPU_REASON = (
    "on a TPU they run as bfloat16: XLA:TPU has no native float8 matmul on v5e, v5p or v6e "
    "(compiled, float8 costs time and memory there)"
)


def _default_platform() -> str:
    return jax.devices()[0].platform


def why_none(selection: Fp8Selection | None) -> str:
    """Why a float8 choice runs no matmul in float8 (a sentence), or ``""`` when it runs
    one; ``selection`` None: the program has no half-precision matmul (nothing painted).
    On a machine whose default device is a TPU, the selected matmuls run bfloat16 there
    (:data:`TPU_REASON`)."""
    if selection is not None and selection.dots and _default_platform() == "tpu":
        n = len(selection.dots)
        return f"{n} matmul{'s' * (n > 1)} selected for float8, but {TPU_REASON}"
    if selection is not None and selection.dots:
        return ""
    if selection is None or not selection.left:
        return (
            "no matmul runs in half precision (float8 starts from the bfloat16 rewrite's "
            "half-precision matmuls)"
        )
    reasons = list(selection.left.values())
    parts = [f"{reasons.count(r)} x {r}" for r in dict.fromkeys(reasons) if r[:6] != "shape:"]
    shapes = [r for r in reasons if r[:6] == "shape:"]  # counted together, one example
    if shapes:
        first = ", the first of them" if len(set(shapes)) > 1 else ""
        parts.insert(0, f"{len(shapes)} x {shapes[0]}{first}")
    n = len(reasons)
    return f"each of its {n} half-precision matmul{'s' * (n > 1)} stays bfloat16: " + "; ".join(
        parts
    )


# -- numerics -----------------------------------------------------------------------------


def quantize(x: Any, dtype: Any) -> tuple[Any, Any]:
    """``x`` scaled into float8 ``dtype`` with a per-tensor current scale.

    Returns ``(q, scale)`` with ``x ~ q.astype(float32) * scale``: ``scale = amax(|x|) /
    finfo(dtype).max`` in float32 (1 for an all-zero ``x``; non-finite when ``x`` holds an
    infinity or NaN, so the product is non-finite too), values saturated at the float8
    range (never rounded to infinity or NaN).

    Example:
      >>> import jax.numpy as jnp
      >>> q, s = quantize(jnp.array([1.0, -2.0, 4.0]), jnp.float8_e4m3fn)
      >>> (q.astype(jnp.float32) * s).tolist(), q.dtype
      ([1.0, -2.0, 4.0], dtype(float8_e4m3fn))
    """
    dtype = np.dtype(dtype)
    fmax = float(jnp.finfo(dtype).max)
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32))
    # At least float32's smallest normal: a subnormal amax would give a scale of 0 (inf, then
    # NaN, once divided by); values that small round to zero in float8 anyway.
    tiny = np.float32(np.finfo(np.float32).tiny)
    scale = jnp.where(amax == 0, jnp.float32(1), jnp.maximum(amax / fmax, tiny))
    q = jnp.clip(x32 / scale, -fmax, fmax).astype(dtype)
    return q, scale


@functools.lru_cache(maxsize=1)
def _cuda_has_fp8() -> bool:
    """Whether a CUDA lowering may use float8 GEMMs: compute capability >= 8.9 (Ada,
    Hopper) on the local GPUs; True without any (a deviceless compile for a Hopper)."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return True
    for dev in devices:
        try:
            major, minor = (int(p) for p in str(dev.compute_capability).split(".")[:2])
        except (AttributeError, ValueError):
            return False
        if (major, minor) < (8, 9):
            return False
    return True


def scaled_dot(
    a: Any, sa: Any, b: Any, sb: Any, dims: Any, out_dtype: Any, fast_accum: bool
) -> Any:
    """``dot_general(a, b) * sa * sb`` of float8 ``a`` and ``b``, in ``out_dtype``: the
    cuBLASLt float8 GEMM on CUDA, an exact float32 emulation elsewhere."""
    scale = sa * sb

    def emulated(a, b, scale):
        out = lax.dot_general(
            a.astype(jnp.float32),
            b.astype(jnp.float32),
            dims,
            precision=lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )
        return (out * scale).astype(out_dtype)

    if not _cuda_has_fp8():
        return emulated(a, b, scale)

    def cuda(a, b, scale):
        preset = FORWARD_PRESET if fast_accum else BACKWARD_PRESET
        out = lax.dot_general(a, b, dims, precision=preset, preferred_element_type=jnp.float32)
        return (out * scale).astype(out_dtype)

    return lax.platform_dependent(a, b, scale, cuda=cuda, default=emulated)


def _remaining(n: int, *removed: Iterable[int]) -> list[int]:
    gone = {i for r in removed for i in r}
    return [i for i in range(n) if i not in gone]


def _transpose_lhs_dims(dims: Any, x_ndim: int, y_ndim: int, swap: bool):
    """JAX's transpose rule of ``dot_general`` for its lhs: the dimension numbers of the
    gradient GEMM ``dot_general(g, y)`` and the permutation of its result."""
    (xc, yc), (xb, yb) = dims
    x_kept = _remaining(x_ndim, xc, xb)
    y_kept = _remaining(y_ndim, yc, yb)
    nb = len(xb)
    if swap:
        ans_y = list(range(nb, nb + len(y_kept)))
    else:
        ans_y = list(range(nb + len(x_kept), nb + len(x_kept) + len(y_kept)))
    ans_batch = list(range(nb))
    new_dims = ((tuple(ans_y), tuple(y_kept)), (tuple(ans_batch), tuple(yb)))
    xc_sorted = [xc[i] for i in np.argsort(yc)]
    perm = tuple(int(i) for i in np.argsort(list(xb) + x_kept + xc_sorted))
    return new_dims, perm


def _grad_operand(g, sg, y, sy, dims, x_shape, swap, dtype):
    new_dims, perm = _transpose_lhs_dims(dims, len(x_shape), y.ndim, swap)
    out = scaled_dot(g, sg, y, sy, new_dims, jnp.float32, False)
    return lax.transpose(out, perm).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def fp8_dot(a: Any, b: Any, dims: Any, out_dtype: Any, formats: Any, fast_accum: bool) -> Any:
    """``dot_general(a, b, dims)`` with both operands quantized to ``formats`` (see
    :func:`quantize`), float32 accumulation, result in ``out_dtype``. Its gradient GEMMs take
    the cotangent in e5m2 (e4m3 where the other operand is e5m2) and the quantized operands
    of the forward pass."""
    return _fp8_dot_fwd(a, b, dims, out_dtype, formats, fast_accum)[0]


def _fp8_dot_fwd(a, b, dims, out_dtype, formats, fast_accum):
    qa, sa = quantize(a, formats[0])
    qb, sb = quantize(b, formats[1])
    out = scaled_dot(qa, sa, qb, sb, dims, out_dtype, fast_accum)
    zeros = (jnp.zeros((0,), a.dtype), jnp.zeros((0,), b.dtype))  # the operands' dtypes
    return out, (qa, sa, qb, sb, zeros)


def _fp8_dot_bwd(dims, out_dtype, formats, fast_accum, res, g):
    qa, sa, qb, sb, (za, zb) = res
    (ac, bc), (ab, bb) = dims
    g_a = E4M3 if formats[1] == E5M2 else E5M2
    g_b = E4M3 if formats[0] == E5M2 else E5M2
    qg, sg = quantize(g, g_a)
    da = _grad_operand(qg, sg, qb, sb, dims, qa.shape, False, za.dtype)
    if g_b != g_a:
        qg, sg = quantize(g, g_b)
    swapped = ((bc, ac), (bb, ab))
    db = _grad_operand(qg, sg, qa, sa, swapped, qb.shape, True, zb.dtype)
    return da, db


fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def emit(eqn: Any, invals: list[Any], choice: Fp8Dot, out_dtype: Any) -> list[Any]:
    """The float8 form of a painted ``dot_general`` (its operands as they are in the
    rewritten program: a float32 parameter, a bfloat16 activation); on a TPU lowering the
    bfloat16 one (:data:`TPU_REASON`)."""
    a, b = invals
    dims = eqn.params["dimension_numbers"]
    dims = tuple(tuple(tuple(int(i) for i in d) for d in pair) for pair in dims)
    out_dtype = np.dtype(out_dtype)

    def float8(a, b):
        return fp8_dot(a, b, dims, out_dtype, choice.formats, choice.fast_accum)

    def tpu(a, b):  # as the bfloat16 rewrite has it: bfloat16 operands, its own precision
        half = [
            x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in (a, b)
        ]
        return eqn.primitive.bind(*half, **{**eqn.params, "preferred_element_type": out_dtype})

    return [lax.platform_dependent(a, b, tpu=tpu, default=float8)]


def _short(dtype: Any) -> str:
    return {E4M3: "e4m3", E5M2: "e5m2"}.get(np.dtype(dtype), str(dtype))
