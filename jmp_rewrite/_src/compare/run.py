"""``compare``: the numerics debugger. Runs a program in float32 and rewritten, side by side.

The program is traced and painted exactly as :func:`jmp_rewrite.rewrite` would, then evaluated
twice on the same concrete inputs by an interpreter over the painting graph:

* once with an empty painting: the float32 reference, every equation in its original dtype;
* once with the real painting: each equation runs in half precision or float32 as the
  rewritten program runs it (the same casts, inserted by the same
  :class:`~jmp_rewrite._src.emit.emitter.Emitter` code).

Values inside ``jax.make_jaxpr``-traced bodies are tracers and cannot be looked at, so the
interpreter does not re-bind higher-order equations: call bodies (``jit``, ``closed_call``,
``checkpoint``, custom derivative wrappers, fused units such as ``jit:log_softmax``) are run
inline, a ``cond`` runs the branch its concrete index selects, and ``while``/``scan`` loops run
in Python (``scan``'s ``reverse`` honoured). Straight-line stretches of equations are compiled
as one ``jax.jit`` each that returns every intermediate value (compiling each equation on its
own would cost far more than running it), so values are rounded as XLA rounds them. Every
equation's float outputs are recorded per execution; the half run is compared with the
reference execution by execution and the results are aggregated per equation (largest error,
summed counts). Equations whose bodies the painter does not see through (``shard_map``, other
equations holding jaxprs) run whole, without detail inside.

Errors are *accumulated*: an equation's half-precision output is compared with the float32
output of the same equation in the float32 run, so an error made upstream shows downstream
too. That is why the suggestions (see :func:`compare`) blame only the equations where a
problem *starts*.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src import rewrite as rewrite_lib
from jmp_rewrite._src import settings as settings_lib
from jmp_rewrite._src.compare.comparison import Comparison, EquationComparison
from jmp_rewrite._src.compare.eager import EMPTY, Recorder, Stats
from jmp_rewrite._src.compare.suggest import fmt_error, suggest
from jmp_rewrite._src.emit.facts import equation_facts
from jmp_rewrite._src.fp8 import Fp8Rules
from jmp_rewrite._src.lists import op_lists as op_lists_lib
from jmp_rewrite._src.paint.additions import half_accumulating_carries
from jmp_rewrite._src.paint.painting import Painting
from jmp_rewrite._src.trace import source_info
from jmp_rewrite._src.trace.equations import is_f32, is_float
from jmp_rewrite._src.trace.graph import Graph, Node

#: Default tolerance on the relative error, per half-precision dtype: 20 (float16) or 13
#: (bfloat16) units of roundoff, room for a few roundings to accumulate.
DEFAULT_TOLERANCE = {"float16": 1e-2, "bfloat16": 5e-2}

# -- suggestions ------------------------------------------------------------------------------


def _has_float_output(n: Node) -> bool:
    return n.eqn is None or any(is_float(v.aval.dtype) for v in n.eqn.outvars)


# -- the entry point ------------------------------------------------------------------------------


def _check_args(flat: Sequence[Any]) -> None:
    for x in flat:
        if isinstance(x, jax.ShapeDtypeStruct):
            raise TypeError(
                "compare runs the program: pass concrete arrays, not jax.ShapeDtypeStruct "
                "(use jmp_rewrite.explain to inspect a program without running it)"
            )
        if isinstance(x, jax.core.Tracer):
            raise TypeError(
                "compare runs eagerly on concrete values and cannot be called inside a JAX "
                "transformation (jax.jit, jax.grad, jax.vmap...); call it outside"
            )


def _tolerance(tolerance: float | None, dtype: np.dtype) -> float:
    if tolerance is None:
        return DEFAULT_TOLERANCE[dtype.name]
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float | np.floating):
        raise TypeError(f"tolerance must be a number, got {type(tolerance).__name__}")
    if not (math.isfinite(tolerance) and tolerance > 0):
        raise ValueError(f"tolerance must be a positive finite number, got {tolerance!r}")
    return float(tolerance)


def _records(
    graph: Graph,
    painting: Painting,
    ref_runs: dict[int, int],
    half: Recorder,
    tol: float,
    dtype: np.dtype,
) -> tuple[list[EquationComparison], int | None, list[str]]:
    records, notes = [], []
    first: tuple[int, int] | None = None
    chosen = painting.attention
    fused = set().union(*(f.nodes - f.outputs for f in chosen.fused)) if chosen else set()
    for n in graph.nodes:
        if n.id in fused:
            continue  # replaced by a fused attention: never run in the rewritten program
        runs_f32, runs_half = ref_runs.get(n.id, 0), half.runs.get(n.id, 0)
        if not _has_float_output(n) or not (runs_f32 or runs_half):
            continue
        if runs_f32 != runs_half:
            notes.append(
                f"{n.path} ran {runs_f32} times in float32 and {runs_half} times in "
                f"{dtype.name}: the control flow diverged; {min(runs_f32, runs_half)} "
                "executions compared"
            )
        st = half.stats.get(n.id, Stats())
        if st.first_exceed is not None and (first is None or st.first_exceed < first[0]):
            first = (st.first_exceed, len(records))
        facts = equation_facts(graph, painting, n)
        if n.unit is not None:  # inside a fused unit, the unit's list decides the colour
            facts["list"] = graph.nodes[n.unit].listed_kind
        records.append(_make_record(facts, st, tol))
    return records, None if first is None else first[1], notes


def _half_carry_notes(
    graph: Graph, painting: Painting, stats: dict[int, Stats], dtype: np.dtype
) -> list[str]:
    """Loop carries run in half precision that add to themselves (see
    :func:`~jmp_rewrite._src.paint.additions.half_accumulating_carries`), with their measured
    error."""
    notes = []
    for carry, path in half_accumulating_carries(graph, painting).items():
        through = ", ".join(dict.fromkeys(graph.nodes[i].key for i in path if i != carry))
        error = fmt_error(stats.get(carry, Stats()).rel_error)
        notes.append(
            f"{graph.nodes[carry].path} (<carry>): carried in {dtype.name} and adds to itself "
            f"({through}), rounded at every iteration (largest relative error {error}): if it "
            "is state, update it linearly (new = old + step, where(ok, new, old)), which the "
            "rewrite keeps float32, or run the loop in a jmp_rewrite.float32_region"
        )
    return notes


#: Share of the non-zero values of the float16 backward pass that may become zero before
#: compare names gradient underflow (with a loss scale of 2**15, below 0.1% on the flash
#: attention test model; without it 0.21%).
UNDERFLOW_SHARE = 1e-3


def _gradient_underflow_notes(
    graph: Graph, painting: Painting, stats: dict[int, Stats], dtype: np.dtype
) -> list[str]:
    """Gradient underflow: many values of a float16 backward pass became zero."""
    if dtype != np.dtype(jnp.float16):
        return []
    phases = source_info.origins(graph)
    underflow = size = 0
    for n in graph.nodes:
        origin = phases.get(n.id)
        if n.id in painting.allow and origin is not None and origin.phase == source_info.BACKWARD:
            st = stats.get(n.id, Stats())
            underflow, size = underflow + st.underflow, size + st.size
    if not size or underflow < UNDERFLOW_SHARE * size:
        return []
    return [
        f"gradient underflow: {underflow} of {size} values computed in float16 in the backward "
        f"pass became zero ({underflow / size:.2%}); float16 needs loss scaling, as in TF: "
        "tx = jmp_rewrite.loss_scale_optimizer(tx) with jmp_rewrite.value_and_grad(loss)"
        "(opt_state, ...) (moving ops to the deny list would not help: the backward matmuls "
        "read their inputs in float16)"
    ]


def _make_record(facts: dict[str, Any], st: Stats, tol: float) -> EquationComparison:
    return EquationComparison(
        **facts,
        rel_error=st.rel_error,
        norm_error=st.norm_error,
        overflow=st.overflow,
        underflow=st.underflow,
        nan=st.nan,
        max_abs_f32=st.max_abs,
        count=st.count,
        size=st.size,
        exceeds=st.rel_error > tol,
    )


def _output_records(
    closed: Any, ref_outs: list[Any], half_outs: list[Any], tol: float
) -> list[EquationComparison]:
    records = []
    for i, (v, r, h) in enumerate(
        zip(jc.open_jaxpr(closed).outvars, ref_outs, half_outs, strict=True)
    ):
        if not is_float(v.aval.dtype):
            continue
        st = Stats()
        st.update([np.asarray(r)], [h], 0, tol)
        facts = {
            "path": f"<output {i}>",
            "primitive": "<output>",
            "key": "<output>",
            "list": "",
            "colour": str(np.dtype(v.aval.dtype)),
            "painted_by": None,
            "float32": is_f32(v.aval.dtype),
            "in_float32_region": False,
        }
        records.append(_make_record(facts, st, tol))
    return records


def compare(
    fun: Callable[..., Any],
    *args: Any,
    dtype: DTypeLike | None = None,
    lists: op_lists_lib.OpLists | None = None,
    level: str | None = None,
    tolerance: float | None = None,
    infer_follows_allow: bool = True,
    fp8: bool | Fp8Rules = False,
    fuse_attention: bool = False,
    **kwargs: Any,
) -> Comparison:
    """Runs ``fun`` in float32 and rewritten side by side, equation by equation.

    ``fun`` is traced and painted as :func:`jmp_rewrite.rewrite` would, then run twice,
    eagerly, on these concrete arguments: as written (the float32 reference) and with the
    rewrite's dtypes and casts. Each equation's float outputs are compared (loop bodies at
    every iteration; call bodies such as ``jit`` inline, with paths like ``scan/body/...``)
    and reported with their relative error, overflow, underflow and NaN counts. Errors
    accumulate: an equation's error includes what it inherits from its inputs.

    Suggestion rules (a problem *starts* at an equation when it shows there and in none of
    its inputs earlier; only such equations are blamed):

    1. an equation that ran in half precision, whose key is on the allow, infer or clear
       list, and that overflows (finite float32 values become inf) or produces NaN: move its
       key to deny;
    2. such an equation whose relative error exceeds ``tolerance``: move its key to deny
       (the reason mentions underflow when non-zero values became zero: for gradients, loss
       scaling is the usual fix);
    3. an equation inside a fused unit (``jit:log_softmax``...) is blamed on the unit's key;
    4. at level ``UNSAFE_FORCE_ALL`` the lists are ignored, so the suggestion is to wrap the
       code in :func:`jmp_rewrite.float32_region` instead (``to_list="float32_region"``);
       when the equation has a name scope, its reason also proposes that narrower fix;
    5. problems starting at equations that ran in float32, at loop carries / ``cond``
       outputs / ``scan`` streams, or at keys that no list holds (casts), are reported in
       :attr:`Comparison.notes`, not as suggestions.

    One suggestion per key, earliest problem first. :meth:`Comparison.apply` re-runs the
    comparison with suggestions applied; :meth:`Comparison.suggested_lists` gives the lists.

    Straight-line stretches of the program are compiled (one ``jax.jit`` per stretch, with
    every intermediate value as an output), so each equation's value is rounded as XLA
    rounds it in the rewritten program; control flow runs in Python on concrete values.
    ``shard_map`` bodies and other equations holding jaxprs the painter does not see into
    run whole (no detail inside). The float32 run is reused by :meth:`Comparison.apply`.

    Args:
      fun: the function, as for :func:`jmp_rewrite.rewrite`: a forward pass, a loss or a
        whole train step (a ``jax.jit``-decorated function is looked into as well).
      *args: concrete example arguments (arrays or pytrees of arrays; Flax NNX objects
        run on copies of their state: what ``fun`` sets on them is not written back).
      dtype: ``jnp.float16`` or ``jnp.bfloat16``; None picks by platform and falls back to
        float16 where the platform has no fast half precision (e.g. a CPU).
      lists: a :class:`jmp_rewrite.OpLists` (default: TF's lists for ``dtype``, with the
        ``JMP_REWRITE_*`` environment overrides).
      level: as in :func:`jmp_rewrite.rewrite`.
      tolerance: relative-error tolerance (default ``1e-2`` for float16, ``5e-2`` for
        bfloat16).
      infer_follows_allow: as in :func:`jmp_rewrite.rewrite`.
      fp8: as in :func:`jmp_rewrite.rewrite` (bfloat16 only): the matmuls run in float8 are
        compared with their float8 rounding (``EquationComparison.float8`` names their
        formats; the summary gives their largest error), and a float8 matmul where a
        problem starts is noted with the :class:`jmp_rewrite.Fp8Rules` exclusion that keeps
        it bfloat16, not blamed on the lists.
      fuse_attention: as in :func:`jmp_rewrite.rewrite`: a fused attention's output (and,
        in a differentiated program, its inputs' cotangents) are compared at the equations
        that produced them in the float32 run; the equations it replaces are not compared.
      **kwargs: keyword arguments for ``fun``.

    Returns:
      A :class:`Comparison`: ``print`` it for a table, or look at ``.equations``,
      ``.first_exceeding``, ``.suggestions``; ``.apply()`` tries the suggestions.

    Raises:
      TypeError: if ``fun`` is not callable, ``lists`` is not an OpLists, or an argument is
        abstract (``jax.ShapeDtypeStruct``) or a tracer (compare was called under ``jit``).
      ValueError: if ``dtype`` is not float16, bfloat16 or None, or ``tolerance`` is not a
        positive number.

    Example:
      >>> import jax.numpy as jnp
      >>> import jmp_rewrite
      >>> lists = jmp_rewrite.default_lists(jnp.float16).move("reduce_sum", "infer")
      >>> c = jmp_rewrite.compare(lambda w, x: jnp.sum((x @ w) * 1e3), jnp.ones((64, 64)),
      ...                         jnp.ones((4, 64)), dtype=jnp.float16, lists=lists)
      >>> c.first_exceeding.path, c.suggestions[0].to_list
      ('reduce_sum', 'deny')
    """
    if not callable(fun):
        raise TypeError(f"compare expects a callable, got {type(fun).__name__}: {fun!r}")
    settings_lib.validate_fp8(dtype, fp8)
    settings_lib.validate_fuse_attention(fuse_attention)
    dt = settings_lib.validate_dtype(dtype)
    if dt is None:
        dt = settings_lib.platform_dtype() or np.dtype(jnp.float16)
    tol = _tolerance(tolerance, dt)
    _check_args(jax.tree.leaves((args, kwargs)))
    return _compare(
        fun, args, kwargs, dt, lists, level, tol, infer_follows_allow, None, fp8, fuse_attention
    )


@dataclasses.dataclass
class _Reference:
    """A float32 run, reusable by :meth:`Comparison.apply` while the graph is the same."""

    signature: tuple[Any, ...]
    store: dict[int, list[list[np.ndarray]]]
    runs: dict[int, int]
    iterations: dict[int, int]
    outs: list[Any]


def _signature(graph: Graph) -> tuple[Any, ...]:
    return tuple((n.path, n.key, n.unit, tuple(n.fanin)) for n in graph.nodes)


def _compare(
    fun: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dt: np.dtype,
    lists: op_lists_lib.OpLists | None,
    level: str | None,
    tol: float,
    infer_follows_allow: bool,
    previous: _Reference | None,
    fp8: bool | Fp8Rules = False,
    fuse_attention: bool = False,
) -> Comparison:
    fn = rewrite_lib.rewrite(
        fun,
        dtype=dt,
        lists=lists,
        level=level,
        infer_follows_allow=infer_follows_allow,
        fp8=fp8,
        fuse_attention=fuse_attention,
    )
    entry, flat = fn.trace(*args, **kwargs)
    graph, config = entry.graph, entry.config
    painting = entry.painting if entry.painting.changed else EMPTY
    consts = jc.consts_of(entry.closed)

    signature = _signature(graph)
    if previous is not None and previous.signature == signature:
        reference = previous  # same program, same inputs: the float32 run is the same
    else:
        ref = Recorder(reference=None, tolerance=tol)
        outs = ref.emitter(graph, EMPTY, dt, config.options).run(graph.top, consts, flat)
        reference = _Reference(signature, ref.store, dict(ref.runs), dict(ref.iterations), outs)
    half = Recorder(reference=reference.store, tolerance=tol, loop_limits=reference.iterations)
    # The rewrite casts outputs back to their dtypes; exact, so compared without the cast.
    half_outs = half.emitter(graph, painting, dt, config.options).run(graph.top, consts, flat)

    records, first, notes = _records(graph, painting, reference.runs, half, tol, dt)
    notes += _half_carry_notes(graph, painting, half.stats, dt)
    notes += _gradient_underflow_notes(graph, painting, half.stats, dt)
    suggestions, more_notes = suggest(graph, painting, half.stats, dt, tol, config.force_all)

    def rerun(new_lists: op_lists_lib.OpLists) -> Comparison:
        return _compare(
            fun,
            args,
            kwargs,
            dt,
            new_lists,
            level,
            tol,
            infer_follows_allow,
            reference,
            fp8,
            fuse_attention,
        )

    return Comparison(
        dtype=dt.name,
        tolerance=tol,
        changed=bool(entry.painting.changed),
        lists=config.lists,
        equations=tuple(records),
        outputs=tuple(_output_records(entry.closed, reference.outs, half_outs, tol)),
        suggestions=tuple(suggestions),
        notes=tuple(dict.fromkeys(half.notes + notes + more_notes)),
        first_index=first,
        _rerun=rerun,
    )
