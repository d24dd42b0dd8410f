"""Public entry points of the rewrite: ``rewrite``, ``rewrite_jaxpr``, ``paint``.

``rewrite(fun)`` traces ``fun`` to a jaxpr at the avals of each new input signature, paints
it with TF's passes and re-emits it under the caller's trace, casting float32 values to half
precision where painted. The traced jaxpr and its painting are cached per signature, so
repeated calls do not re-trace or re-paint; ``jax.jit`` around the result caches compilation
as usual. Without a dtype, the program is painted once per lowering platform's dtype and
emitted as the branches of ``lax.platform_dependent`` (see ``lowering.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, overload

import jax
from jax.typing import DTypeLike

from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src import fp8 as fp8_lib
from jmp_rewrite._src import lowering, nnx_support
from jmp_rewrite._src.emit.emitter import Emitter
from jmp_rewrite._src.emit.facts import PaintResult, paint_result
from jmp_rewrite._src.lists.op_lists import OpLists
from jmp_rewrite._src.paint.painting import Painting
from jmp_rewrite._src.paint.passes import paint
from jmp_rewrite._src.settings import (
    _HALF_DTYPES_MSG,
    Fp8NoneSelectedWarning,
    RewriteConfig,
    RewriteOffWarning,
    Settings,
    _user_stacklevel,
    effective_settings,
    resolve_config,
    validate_dtype,
    validate_fp8,
    validate_fuse_attention,
)
from jmp_rewrite._src.trace import arguments
from jmp_rewrite._src.trace.graph import Graph

F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass
class Rewritten:
    """A traced, painted program ready to be emitted.

    With ``dtype=None`` it is one traced program painted per lowering platform:
    ``per_platform`` holds the paintings (``graph``, ``painting`` and ``config`` are None).
    """

    closed: Any
    graph: Graph | None
    painting: Painting | None
    config: RewriteConfig | None
    out_tree: Any
    trace_cache: dict[Any, Any] = dataclasses.field(default_factory=dict)
    per_platform: lowering.PerPlatform | None = None

    @property
    def changed(self) -> bool:
        """Whether the painting changes anything (one program's)."""
        return self.painting is not None and self.painting.changed

    def programs(self) -> list[Rewritten]:
        """The painted programs: this one, or each lowering platform's painted so far."""
        if self.per_platform is None:
            return [self]
        return self.per_platform.programs()  # type: ignore[return-value]

    def emit(self, flat_args: Sequence[Any]) -> list[Any]:
        if self.per_platform is not None:
            return self.per_platform.emit(flat_args)
        if not self.changed:
            return jc.eval_jaxpr(self.closed, *flat_args)
        emitter = Emitter(
            self.graph, self.painting, self.config.dtype, self.config.options, self.trace_cache
        )
        out_dtypes = [v.aval.dtype for v in jc.open_jaxpr(self.closed).outvars]
        return emitter.run(self.graph.top, jc.consts_of(self.closed), flat_args, out_dtypes)


def analyse(closed: Any, config: RewriteConfig | None) -> tuple[Graph | None, Painting | None]:
    """Builds the graph of ``closed`` and paints it (None, None when there is nothing to do)."""
    if config is None:
        return None, None
    graph = Graph(closed, config.lists, config.dtype)
    painting = paint(
        graph,
        infer_follows_allow=config.infer_follows_allow,
        force_all=config.force_all,
        fp8=config.fp8,
        attention=config.fuse_attention,
    )
    return graph, painting


def no_fp8_reason(painting: Painting | None, config: RewriteConfig | None) -> str:
    """Why float8 was asked for and runs no matmul (see ``fp8.why_none``), else ``""``."""
    if config is None or config.fp8 is None:
        return ""
    return fp8_lib.why_none(painting.fp8 if painting is not None and painting.changed else None)


def _warn_no_fp8(name: str, why: str) -> None:
    warnings.warn(
        f"{name} runs no matmul in float8 under fp8=True: {why}",
        Fp8NoneSelectedWarning,
        stacklevel=_user_stacklevel(),
    )


@dataclasses.dataclass
class _Entry:
    """A cache entry: the painted program and where its outputs go."""

    rewritten: Rewritten
    outputs: arguments.Outputs


class _RewrittenFunction:
    """The callable returned by :func:`rewrite`."""

    def __init__(
        self,
        fun: Callable[..., Any],
        dtype: Any,
        lists: Any,
        level: str | None,
        infer_follows_allow: bool,
        static: arguments.StaticArgs,
        fp8: Any = False,
        fuse_attention: bool = False,
    ):
        # First: update_wrapper copies ``fun.__dict__`` (nnx.jit's and our own wrappers carry
        # attributes such as ``static_argnums`` or ``dtype``), which must not shadow ours.
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.dtype = validate_dtype(dtype) if dtype is not None else None
        self.lists = lists
        self.level = level
        self.infer_follows_allow = infer_follows_allow
        self.static = static
        self.fp8 = fp8
        self.fuse_attention = fuse_attention
        self._cache: dict[Any, _Entry] = {}
        # Traces per key with static Python numbers left out (to warn about re-tracing).
        self._churn: dict[Any, list[Any]] = {}
        # Reasons already given for running unchanged (said once per function and reason).
        self._said_off: set[str] = set()

    @property
    def _name(self) -> str:
        return getattr(self.fun, "__name__", type(self.fun).__name__)

    def config(self) -> RewriteConfig | lowering.PlatformConfigs | None:
        """The painting configuration now: one, or with ``dtype=None`` each lowering
        platform's (warns once when the default device runs the function unchanged)."""
        s = effective_settings(
            self.dtype,
            self.lists,
            self.level,
            self.infer_follows_allow,
            self.fp8,
            self.fuse_attention,
        )
        if s.dtype is None and s.off_reason not in self._said_off:
            self._said_off.add(s.off_reason)
            here = " here" if s.lowered else ""
            warnings.warn(
                f"rewrite({self._name}) runs unchanged{here}: {s.off_reason}",
                RewriteOffWarning,
                stacklevel=_user_stacklevel(),
            )
        if s.lowered:
            return lowering.platform_configs(s)
        return resolve_config(
            s.dtype, s.lists, s.level, s.infer_follows_allow, s.fp8, s.fuse_attention
        )

    def _lookup(self, args: tuple[Any, ...], kwargs: dict[str, Any]):
        call = arguments.split_call(self.static, args, kwargs, self._name)
        config = self.config()
        key = (call.key, config)
        try:
            entry = self._cache.get(key)
        except TypeError:
            raise arguments.unhashable_error(
                call, self.static, args, kwargs, self.fun, self._name
            ) from None
        if entry is None:
            self._note_retrace(call.key, args, kwargs)
            entry = self._trace(call, config)
            self._cache[key] = entry
        return entry, call

    def _note_retrace(self, key: arguments.CallKey, args, kwargs) -> None:
        seen = self._churn.setdefault(arguments.churn_key(key), [])
        seen.append(key)
        if len(seen) == arguments.CHURN_WARNING_AFTER:
            arguments.warn_churn(seen[0], key, self.static, args, kwargs, self.fun, self._name)

    def trace(self, *args: Any, **kwargs: Any) -> tuple[Rewritten, list[Any]]:
        """Traces and paints for these arguments (cached); returns it and the flat inputs
        (the array leaves of the arguments, NNX state included)."""
        entry, call = self._lookup(args, kwargs)
        return entry.rewritten, call.dynamic

    def _trace(self, call: arguments.Call, config: Any) -> _Entry:
        key, name = call.key, self._name
        graphdef = key.graphdef
        outputs: list[arguments.Outputs] = []

        def flat_fun(*dynamic):
            args, kwargs, nodes, before = arguments.rebuild(key, dynamic)
            out = self.fun(*args, **kwargs)
            state = nnx_support.changed_state(graphdef, nodes, before, name) if nodes else None
            arrays, layout = arguments.flatten_outputs((out, state))
            outputs.append(layout)
            return arrays

        avals = arguments.trace_avals(call.dynamic)
        closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*avals)
        out_tree = jax.tree.structure(out_shape)
        if isinstance(config, lowering.PlatformConfigs):  # painted per platform, when emitted

            def program(cfg: RewriteConfig | None) -> Rewritten:
                return Rewritten(closed, *analyse(closed, cfg), cfg, out_tree)

            per_platform = lowering.PerPlatform(config, program)
            rewritten = Rewritten(closed, None, None, None, out_tree, per_platform=per_platform)
        else:
            rewritten = Rewritten(closed, *analyse(closed, config), config, out_tree)
        return _Entry(rewritten, outputs[-1])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        calls = _CALLS.get()
        if calls is not None:
            calls.append(self)
        entry, call = self._lookup(args, kwargs)
        flat_out = entry.rewritten.emit(call.dynamic)
        for program in entry.rewritten.programs():
            why = no_fp8_reason(program.painting, program.config)
            if why and why not in self._said_off:
                self._said_off.add(why)
                _warn_no_fp8(f"rewrite({self._name})", why)
        out, state = entry.outputs.unflatten(flat_out)
        if state is not None:
            nnx_support.write_back(call.nodes, state)
        return out

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        return functools.partial(self, obj)

    def __repr__(self) -> str:
        fp8 = "" if not self.fp8 else f", fp8={self.fp8!r}"
        fused = ", fuse_attention=True" if self.fuse_attention else ""
        name = getattr(self.fun, "__name__", self.fun)
        return f"rewrite({name!r}, dtype={self.dtype}{fp8}{fused})"


# Rewritten functions called while ``explain`` traces (see :func:`recording_calls`).
_CALLS: contextvars.ContextVar[list[_RewrittenFunction] | None] = contextvars.ContextVar(
    "jmp_rewrite_rewritten_calls", default=None
)


@contextlib.contextmanager
def recording_calls() -> Iterator[list[_RewrittenFunction]]:
    """Collects the rewritten functions called (traced) inside the ``with`` block."""
    calls: list[_RewrittenFunction] = []
    token = _CALLS.set(calls)
    try:
        yield calls
    finally:
        _CALLS.reset(token)


def _is_jit(fun: Any) -> bool:
    """``jax.jit``, ``nnx.jit``, ``eqx.filter_jit`` and the like: a wrapper that compiles the
    function it wraps without changing what it computes (it can be lowered)."""
    return callable(getattr(fun, "lower", None)) and hasattr(fun, "__wrapped__")


def find_rewritten(fun: Any) -> tuple[_RewrittenFunction | None, int]:
    """The :func:`rewrite` inside ``fun`` and how many jits wrap it, or ``(None, 0)``.

    Looks through wrappers that only compile (``jax.jit``, ``nnx.jit``, ``eqx.filter_jit``,
    found by ``__wrapped__``), not through ones that change the computation (``jax.grad``).
    """
    jits, seen = 0, set()
    while id(fun) not in seen:
        if isinstance(fun, _RewrittenFunction):
            return fun, jits
        seen.add(id(fun))
        if not _is_jit(fun):
            break
        fun, jits = fun.__wrapped__, jits + 1
    return None, 0


def rewritten_with(fun: Callable[..., Any], settings: Settings, static: Any = None) -> Any:
    """A :func:`rewrite` of ``fun`` with these settings (``dtype`` set) and static arguments."""
    static = static if static is not None else arguments.resolve_static(fun, None, None)
    return _RewrittenFunction(
        fun,
        settings.dtype,
        settings.lists,
        settings.level,
        settings.infer_follows_allow,
        static,
        settings.fp8,
        settings.fuse_attention,
    )


@overload
def rewrite(
    fun: F,
    *,
    dtype: DTypeLike | None = ...,
    lists: OpLists | None = ...,
    level: str | None = ...,
    infer_follows_allow: bool = ...,
    static_argnums: Any = ...,
    static_argnames: Any = ...,
    fp8: bool | fp8_lib.Fp8Rules = ...,
    fuse_attention: bool = ...,
) -> F: ...


@overload
def rewrite(
    fun: None = ...,
    *,
    dtype: DTypeLike | None = ...,
    lists: OpLists | None = ...,
    level: str | None = ...,
    infer_follows_allow: bool = ...,
    static_argnums: Any = ...,
    static_argnames: Any = ...,
    fp8: bool | fp8_lib.Fp8Rules = ...,
    fuse_attention: bool = ...,
) -> Callable[[F], F]: ...


def rewrite(
    fun=None,
    *,
    dtype=None,
    lists=None,
    level=None,
    infer_follows_allow=True,
    static_argnums=None,
    static_argnames=None,
    fp8=False,
    fuse_attention=False,
):
    """Rewrites ``fun`` to run in mixed precision, as TF's ``auto_mixed_precision`` would.

    The function is traced to a jaxpr, every equation is painted with TF's allow / infer /
    deny / clear lists and passes, and the program is re-emitted with float32 values cast to
    ``dtype`` where painted. Only float32 values are converted; parameters stay float32
    (they are cast at their first half-precision use), and the result has the same pytree,
    shapes and dtypes as ``fun``'s. A program with no allowlist op (no matmul/conv) is
    returned unchanged. Use as a plain call or a decorator, with or without arguments.

    Arguments are taken as ``jax.jit`` takes them, with Equinox's filter convention for the
    leaves of the others and Flax NNX objects handled as ``nnx.jit`` handles them:

    * ``static_argnums`` / ``static_argnames`` are mapped to each other through ``fun``'s
      signature (as in ``jax.jit``), so a static argument may be passed by position or by
      keyword.
    * In every other argument, of any pytree structure, array leaves (``jax.Array``, NumPy
      arrays and scalars, ``jax.ShapeDtypeStruct``) are traced, and every other leaf --
      Python numbers and bools, strings, functions, other objects -- is static, as in
      ``eqx.filter_jit``: passed to ``fun`` as it is and part of the cache key (compared by
      type and value, so it must be hashable). So ``eqx.filter_jit(rewrite(f))(module, x)``
      works, and an ``int`` argument may size an array. Unlike under ``jax.jit``, Python
      numbers are not traced: wrapping ``fun`` never turns a concrete value into a tracer.
      A number that changes on every call re-traces on every call (a warning says so after
      a few): pass it as an array, or call under ``jax.jit``, which traces it.
    * Flax NNX objects (modules, ``nnx.Optimizer``, ``nnx.Rngs``, variables), anywhere in
      the arguments, may be updated in place as under ``nnx.jit``: they are split into
      structure and state, and the caller's objects are updated after the call. Both
      ``nnx.jit(rewrite(step))`` and ``rewrite(nnx.jit(step))`` train. (``jax.jit`` copies
      NNX objects, with or without the rewrite: use ``nnx.jit``.)
    * The result's array leaves come out of the rewritten program; its other leaves (e.g.
      the functions inside an updated Equinox module) are returned as ``fun`` made them.

    Args:
      fun: the function to rewrite (any JAX-traceable callable: a loss, a model apply, a
        whole jitted train step).
      dtype: ``jnp.float16`` or ``jnp.bfloat16`` forces the rewrite on any platform; None
        picks by platform like TF, where the program is lowered (``lax.platform_dependent``:
        a step traced on a CPU host and lowered for a TPU is rewritten): bfloat16 for TPUs,
        float16 for CUDA GPUs of compute capability >= 7.0 (this machine's GPUs decide;
        without one, a deviceless compile, such a GPU is assumed), no rewrite elsewhere
        (CPU) -- unless :func:`jmp_rewrite.enable_mixed_precision_graph_rewrite` gives a
        dtype. Where this machine's default device runs the function unchanged, a
        :class:`RewriteOffWarning` says so once, with the reason.
      lists: a :class:`jmp_rewrite.OpLists`; default: the TF 2.21 lists for ``dtype`` with
        the environment overrides applied (TF's ``TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_*``
        variables or their ``JMP_REWRITE_*`` aliases).
      level: TF's ``..._LEVEL``: ``"TENSOR_CORES_ONLY"``, ``"TREAT_INFER_AS_DENY"`` or
        ``"UNSAFE_FORCE_ALL"`` (default: the ``..._LEVEL`` variable or the default level).
      infer_follows_allow: run TF's pass 4 (TF >= 2.20 does in every mode); False gives
        the TF <= 2.19 float16 behaviour.
      static_argnums: indices of static arguments, as in ``jax.jit`` (negative ones count
        from the end of ``fun``'s positional parameters).
      static_argnames: names of static arguments, as in ``jax.jit``.
      fp8: True (or a :class:`jmp_rewrite.Fp8Rules`) runs the weight GEMMs of the
        program's blocks in float8 (forward e4m3 x e4m3, gradients with the cotangent in
        e5m2, per-tensor current scaling, float32 accumulation, bfloat16 result), the rest
        as the bfloat16 rewrite paints it; needs ``dtype=jnp.bfloat16`` (or None: TPU
        and CUDA lowerings then both run bfloat16). On CUDA the
        cuBLASLt float8 GEMM, elsewhere an exact emulation (same rounding). When it runs no
        matmul in float8, a :class:`jmp_rewrite.Fp8NoneSelectedWarning` says why, once.
      fuse_attention: True replaces each attention -- ``softmax(scale * q k^T + bias,
        masked) v``, forward and (in a differentiated program) backward -- by one
        ``jax.nn.dot_product_attention`` call: cuDNN's flash attention on CUDA, JAX's own
        elsewhere, in the half dtype. Attention whose meaning the fused call would change
        (dropout on the weights, another normalisation, head dims cuDNN refuses, a
        ``float32_region``) stays as written; ``explain(...).lint()`` says why.

    Returns:
      The rewritten function (or, without ``fun``, a decorator producing one).

    Raises:
      TypeError: if ``fun`` is not callable, ``static_argnums``/``static_argnames`` are
        not ints/strs, or ``fuse_attention`` is not a bool; when called, if a static value
        is not hashable.
      ValueError: if ``dtype`` is not float16, bfloat16 or None, or a static index or name
        is not a parameter of ``fun``, or ``fp8`` is asked for with float16; when called, if
        an NNX object is declared static or ``fun`` changes the structure of one, or an
        :class:`Fp8Rules` pattern matches no matmul.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import jmp_rewrite
      >>> @jmp_rewrite.rewrite(dtype=jnp.float16)
      ... def layer(w, x):
      ...   return jnp.tanh(x @ w)
      >>> layer(jnp.ones((4, 4)), jnp.ones((2, 4))).dtype
      dtype('float32')
      >>> def blocks(w, x, n, act):
      ...   for _ in range(n):
      ...     x = act(x @ w)
      ...   return x
      >>> f = jmp_rewrite.rewrite(blocks, dtype=jnp.bfloat16, static_argnames="n")
      >>> f(jnp.eye(4), jnp.ones((2, 4)), 3, act=jnp.tanh).shape  # act: static, automatically
      (2, 4)
    """
    validate_fp8(dtype, fp8)
    validate_dtype(dtype)
    validate_fuse_attention(fuse_attention)
    # Checked here too so that a bad value fails at decoration, even without ``fun``.
    arguments.resolve_static(lambda *a, **k: None, static_argnums, static_argnames)

    def decorate(f: F) -> F:
        if not callable(f):
            raise TypeError(f"rewrite expects a callable, got {type(f).__name__}: {f!r}")
        static = arguments.resolve_static(f, static_argnums, static_argnames)
        return _RewrittenFunction(  # type: ignore[return-value]
            f, dtype, lists, level, infer_follows_allow, static, fp8, fuse_attention
        )

    if fun is None:
        return decorate
    return decorate(fun)


def rewrite_jaxpr(
    closed_jaxpr: Any,
    *,
    dtype: DTypeLike | None,
    lists: OpLists | None = None,
    level: str | None = None,
    infer_follows_allow: bool = True,
    fp8: bool | fp8_lib.Fp8Rules = False,
    fuse_attention: bool = False,
) -> Any:
    """Rewrites a closed jaxpr; the result has the same input and output avals.

    Args:
      closed_jaxpr: a ``jax.extend.core.ClosedJaxpr`` (e.g. from ``jax.make_jaxpr``).
      dtype: ``jnp.float16`` or ``jnp.bfloat16``.
      lists: a :class:`jmp_rewrite.OpLists` (default: TF's lists for ``dtype``).
      level: as in :func:`rewrite`.
      infer_follows_allow: as in :func:`rewrite`.
      fp8: as in :func:`rewrite` (a :class:`jmp_rewrite.Fp8NoneSelectedWarning` on every
        call that runs no matmul in float8).
      fuse_attention: as in :func:`rewrite`.

    Returns:
      A new closed jaxpr (the input itself when nothing is painted).

    Raises:
      TypeError: if ``closed_jaxpr`` is not a closed jaxpr.
      ValueError: if ``dtype`` is not float16 or bfloat16.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import jmp_rewrite
      >>> cj = jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((2, 2)), jnp.ones((2, 2)))
      >>> new = jmp_rewrite.rewrite_jaxpr(cj, dtype=jnp.bfloat16)
      >>> [str(e.primitive) for e in new.jaxpr.eqns]
      ['convert_element_type', 'convert_element_type', 'dot_general', 'convert_element_type']
    """
    if not (
        jc.is_closed_jaxpr(closed_jaxpr) or jc.MERGED_JAXPR_TYPES and jc.is_any_jaxpr(closed_jaxpr)
    ):
        raise TypeError(
            f"rewrite_jaxpr expects a ClosedJaxpr (from jax.make_jaxpr), "
            f"got {type(closed_jaxpr).__name__}"
        )
    if dtype is None:
        raise ValueError(f"rewrite_jaxpr needs an explicit dtype: {_HALF_DTYPES_MSG}")
    validate_fp8(dtype, fp8)
    config = resolve_config(dtype, lists, level, infer_follows_allow, fp8, fuse_attention)
    graph, painting = analyse(closed_jaxpr, config)
    why = no_fp8_reason(painting, config)
    if why:
        _warn_no_fp8("rewrite_jaxpr", why)
    if not painting.changed:
        return closed_jaxpr
    return Emitter(graph, painting, config.dtype, config.options).trace_program(closed_jaxpr)


def paint_program(
    fun: Callable[..., Any],
    *args: Any,
    dtype: DTypeLike | None,
    lists: OpLists | None = None,
    level: str | None = None,
    infer_follows_allow: bool = True,
    static_argnums: Any = None,
    static_argnames: Any = None,
    fp8: bool | fp8_lib.Fp8Rules = False,
    fuse_attention: bool = False,
    **kwargs: Any,
) -> PaintResult:
    """Paints ``fun`` at these arguments with TF's passes, without running it.

    Args:
      fun: the function, as for :func:`rewrite`.
      *args: example arguments (arrays, ``jax.ShapeDtypeStruct``; NNX objects stay as given).
      dtype: ``jnp.float16`` or ``jnp.bfloat16``.
      lists: a :class:`jmp_rewrite.OpLists` (default: TF's lists for ``dtype``).
      level: as in :func:`rewrite`.
      infer_follows_allow: as in :func:`rewrite`.
      static_argnums: as in :func:`rewrite`.
      static_argnames: as in :func:`rewrite`.
      fp8: as in :func:`rewrite` (float8 matmuls show in ``EquationPaint.float8``).
      fuse_attention: as in :func:`rewrite` (fused attentions show in
        ``EquationPaint.attention``).
      **kwargs: example keyword arguments.

    Returns:
      A :class:`PaintResult`: for every equation (sub-jaxprs included), its list, colour and
      the pass that set it.

    Raises:
      ValueError: if ``dtype`` is not float16 or bfloat16.

    Example:
      >>> import jax.numpy as jnp
      >>> import jmp_rewrite
      >>> p = jmp_rewrite.paint(lambda w, x: jnp.exp(x @ w), jnp.ones((2, 2)),
      ...                       jnp.ones((2, 2)), dtype=jnp.float16)
      >>> p.colours("dot_general"), p.colours("exp")
      (['allow'], ['deny'])
    """
    if dtype is None:
        raise ValueError(f"paint needs an explicit dtype: {_HALF_DTYPES_MSG}")
    fn = rewrite(
        fun,
        dtype=dtype,
        lists=lists,
        level=level,
        infer_follows_allow=infer_follows_allow,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
        fp8=fp8,
        fuse_attention=fuse_attention,
    )
    entry, _ = fn.trace(*args, **kwargs)
    dtype = entry.config.dtype if entry.config is not None else None
    return paint_result(entry.graph, entry.painting, dtype)
