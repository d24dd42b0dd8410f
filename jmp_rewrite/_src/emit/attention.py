"""Emitting a fused attention: one fused call in place of its equations.

The queries, keys and values are moved to ``(batch, length, heads, head dim)`` and cast to
the rewrite's half dtype (cuDNN refuses float32); masks and biases stay the small arrays they
broadcast from, moved to ``(batch|1, heads|1, queries|1, keys|1)``. On CUDA the call is
cuDNN's flash attention (``implementation='cudnn'``: a mask or bias broadcast over queries or
keys is broadcast first, which cuDNN needs; a bias's finite values are clamped to the half
range and cast, its infinities kept),
on a TPU JAX's Pallas flash-attention kernel (:mod:`~jmp_rewrite._src.emit.tpu_attention`),
elsewhere JAX's own (``'xla'``, whose logits are float32): the choice is made when the program
is lowered (``lax.platform_dependent``), so one rewritten function runs on a CPU, compiles
deviceless for an H100/H200 or a TPU and runs there. The branch not taken is not lowered, nor
are the values it would save for the backward pass. An attention the TPU kernel cannot take
(``FusedAttention.tpu``) runs on a TPU as written: its own equations, as the rewrite paints
them, traced in the TPU branch (JAX's XLA attention there keeps 2.7x the temporaries of
the written-out attention); ``rewrite(grad(f))`` then differentiates them with ``jax.vjp``
as it does the fused call.

In ``rewrite(grad(f))`` the forward call is differentiated on the spot (``jax.vjp``) and its
VJP, kept with the scope's values, is called where the program's backward of the attention
was; where that is not at hand (``compare`` runs stretches of a program separately) the
VJP is taken again from the inputs.

A row a mask (a selection) may leave without keys gets the value float32 gives it, from
outside the kernel: the mean of the values for a finite fill (uniform weights), NaN for
``-inf``, and float32's gradient (none to the masked logits). An additive mask needs no
guard: the bias is added to float32 logits as the program adds it, so such a row is what
float32 makes it (uniform for ``finfo.min``, NaN for ``-inf``), and so is its gradient
(which float32's differentiation passes to the queries and keys through the rounding).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src.attention.layout import arrange, mask_value, place
from jmp_rewrite._src.attention.match import Core, Side
from jmp_rewrite._src.attention.select import FusedAttention
from jmp_rewrite._src.emit import tpu_attention
from jmp_rewrite._src.emit.clamping import clamp
from jmp_rewrite._src.emit.custom_rules import cast


def _heads(batch: tuple[int, ...]) -> tuple[int, int]:
    """The logits' batch dims as ``(batch, heads)``: the last one is the heads."""
    if not batch:
        return 1, 1
    if len(batch) == 1:
        return batch[0], 1
    return math.prod(batch[:-1]), batch[-1]


def operand(x: Any, labels: tuple, length: str, batch: tuple[int, ...], group: int = 1) -> Any:
    """Queries (``length="t"``), keys or values (``"s"``) as ``(B, L, N, D)``; grouped
    queries (GQA) with ``N = heads * group``, the heads of a group next to each other, as
    ``jax.nn.dot_product_attention`` pairs them with fewer key/value heads."""
    x = arrange(x, labels, [*range(len(batch)), "g", length, "d"], jnp)
    b, n = _heads(batch)
    x = x.reshape((b, n * group, *x.shape[-2:]))
    return jnp.swapaxes(x, 1, 2)


def side(x: Any, s: Side, core: Core) -> Any:
    """A mask or bias as ``(B|1, N|1, T|1, S|1)``."""
    nb = len(core.batch)
    x = arrange(x, s.dims, [*range(nb), "t", "s"], jnp)
    if nb == 0:
        return x[None, None]
    if nb == 1:
        return x[:, None]
    lead = x.shape[: nb - 1]
    if any(d != 1 for d in lead):
        x = jnp.broadcast_to(x, (*core.batch[: nb - 1], *x.shape[nb - 1 :]))
        x = x.reshape((math.prod(core.batch[: nb - 1]), *x.shape[nb - 1 :]))
    else:
        x = x.reshape((1, *x.shape[nb - 1 :]))
    # a side per key/value head, for each query head of its group (GQA)
    return jnp.repeat(x, core.group, axis=1) if x.shape[1] > 1 else x


def _full_lengths(x: Any, t: int, s: int) -> Any:
    """cuDNN takes masks and biases with both sequence lengths (jax issue 28974)."""
    return None if x is None else jnp.broadcast_to(x, (*x.shape[:2], t, s))


#: cuDNN's NaN query gradients with an explicit mask or bias at lengths ``64 mod 128``
#: (pytorch issue 196678): those lengths are padded to the next multiple of 128.
_TILE = 128


def _padding(n: int, explicit: bool) -> int:
    """The positions a sequence of length ``n`` gets for cuDNN: to a multiple of 128 where
    ``n % 128 == 64`` with a mask or bias, else to an even length."""
    if explicit and n % _TILE == _TILE // 2:
        return _TILE // 2
    return n % 2


def _dpa(impl: str, core: Core, half: Any, q: Any, k: Any, v: Any, bias: Any, mask: Any) -> Any:
    if impl != "cudnn":
        # JAX's own attention asks float16 logits for the F16_F16_F32 dot algorithm, which
        # XLA:CPU (and TPU) refuse when compiling: there float16 runs it in float32 (no
        # speed to lose off CUDA; more exact than half, never less).
        f16 = q.dtype == jnp.float16
        up = (lambda x: x.astype(jnp.float32)) if f16 else (lambda x: x)
        out = jax.nn.dot_product_attention(
            up(q),
            up(k),
            up(v),
            bias=None if bias is None else up(bias),
            mask=mask,
            scale=core.scale,
            is_causal=core.causal,
        )
        return out.astype(q.dtype)
    t, s = q.shape[1], k.shape[1]
    mask = _full_lengths(mask, t, s)
    bias = _full_lengths(bias, t, s)
    bias = None if bias is None else clamp(bias, half).astype(half)
    # cuDNN trains on even lengths only (jax 0.10-0.12 count a bias whenever training): an
    # odd length (ViT's 197 tokens) gets one more query and key, the key masked by its
    # sequence length, the query row dropped (its mask row all True: never a NaN there);
    # with a mask or bias, a length 64 mod 128 is padded to a multiple of 128 the same way.
    tp, sp = (_padding(n, mask is not None or bias is not None) for n in (t, s))
    lengths = None
    if tp or sp:
        q, k, v = (
            jnp.pad(x, ((0, 0), (0, p), (0, 0), (0, 0))) for x, p in ((q, tp), (k, sp), (v, sp))
        )
        pads = ((0, 0), (0, 0), (0, tp), (0, sp))
        mask = None if mask is None else jnp.pad(mask, pads, constant_values=True)
        bias = None if bias is None else jnp.pad(bias, pads)
        lengths = jnp.full((q.shape[0],), s, jnp.int32)
    out = jax.nn.dot_product_attention(
        q,
        k,
        v,
        bias=bias,
        mask=mask,
        scale=core.scale,
        is_causal=core.causal,
        key_value_seq_lengths=lengths,
        implementation="cudnn",
    )
    return out[:, :t]


#: The implementation each platform's branch runs (``"tpu"``: the TPU kernel, or the
#: attention as written where it refuses one). Tests set ``"default"`` to ``"tpu"`` to run
#: the TPU branch on a CPU (the kernel under ``pltpu.force_tpu_interpret_mode``).
BRANCHES = {"cuda": "cudnn", "tpu": "tpu", "default": "xla"}
#: While set (:func:`one_platform`), the one platform whose branch is emitted, alone.
_ONLY: list[str] = []


@contextlib.contextmanager
def one_platform(platform: str) -> Iterator[None]:
    """Emits only ``platform``'s attention (``explain``'s count of the values saved for the
    backward pass: a ``platform_dependent``'s VJP keeps every branch's, zeros for those not
    taken, until the program is lowered for one platform)."""
    _ONLY.append(platform)
    try:
        yield
    finally:
        _ONLY.pop()


def attend(
    core: Core, half: Any, out_dtype: Any, q, k, v, biases, masks, written: Any = None
) -> Any:
    """The attention ``core`` describes, on the program's arrays, in the P.V dot's layout:
    cuDNN's on CUDA, the TPU kernel on a TPU, JAX's own elsewhere, chosen when the program
    is lowered. ``written(q, k, v, biases, masks)``, when given, is the attention as the
    program writes it (the rewrite's own equations): a TPU runs it instead of the kernel,
    which refuses this attention."""
    impls = {i: functools.partial(_fused, i, core, half, out_dtype) for i in ("xla", "tpu")}
    if written is not None:
        impls["tpu"] = written
    if cudnn_traceable():
        impls["cudnn"] = functools.partial(_fused, "cudnn", core, half, out_dtype)
    branches = {p: impls[i] for p, i in BRANCHES.items() if i in impls}
    if _ONLY:
        return branches.get(_ONLY[-1], branches["default"])(q, k, v, list(biases), list(masks))
    return lax.platform_dependent(q, k, v, list(biases), list(masks), **branches)


def _fused(impl: str, core: Core, half: Any, out_dtype: Any, q, k, v, biases, masks) -> Any:
    half = np.dtype(half)
    q4, k4, v4 = (
        operand(x, labels, length, core.batch, group).astype(half)
        for x, labels, length, group in (
            (q, core.q_labels, "t", core.group),
            (k, core.k_labels, "s", 1),
            (v, core.v_labels, "s", 1),
        )
    )
    bias = None
    for b, x in zip(core.biases, biases, strict=True):
        term = side(jnp.asarray(x, jnp.float32), b, core) * np.float32(b.coef)
        bias = term if bias is None else bias + term
    mask, keeps = None, []
    for m, x in zip(core.masks, masks, strict=True):
        keep = side(mask_value(m, jnp.asarray(x), jnp), m, core)
        mask = keep if mask is None else mask & keep
        keeps.append((m, keep))
    if impl == "tpu":  # masks per query (B|1, 1, T, 1), else per key (or per batch)
        q_keep = [keep[:, 0, :, 0] for m, keep in keeps if "t" in m.dims]
        k_keep = [keep[:, 0, 0, :] for m, keep in keeps if "t" not in m.dims]
        out = tpu_attention.flash(core, q4, k4, v4, bias, q_keep, k_keep)
    else:
        out = _dpa(impl, core, half, q4, k4, v4, bias, mask)
    out = _guard(core, out, v4, mask)
    b, t, n, d = out.shape
    out = jnp.swapaxes(out, 1, 2).reshape((*core.batch, core.group, t, d))
    order = [*range(len(core.batch)), "g", "t", "d"]
    return place(out, order, core.out_labels, tuple(core.o.aval.shape), jnp).astype(out_dtype)


def _guard(core: Core, out: Any, v4: Any, mask: Any) -> Any:
    """Rows a mask leaves without keys: float32's value (see the module docstring). Its
    gradient is float32's too: the values' is the uniform weights', the queries' and keys'
    zero (a selection passes none to the masked logits)."""
    if not core.guard_mask or mask is None:
        return out
    keep = mask
    if core.causal:
        keep = keep & jnp.tril(jnp.ones((out.shape[1], v4.shape[1]), bool))
    ok = jnp.swapaxes(jnp.any(keep, axis=-1), 1, 2)[..., None]  # (B|1, T|1, N|1, 1)
    if core.fill == -math.inf:
        fallback = jnp.full(out.shape, jnp.nan, jnp.float32)
    else:
        mean = jnp.mean(v4.astype(jnp.float32), axis=1, keepdims=True)  # (B, 1, K, D)
        mean = jnp.repeat(mean, core.group, axis=2)  # (B, 1, N, D)
        fallback = jnp.broadcast_to(mean, out.shape)
    return jnp.where(ok, out, fallback.astype(out.dtype))


@functools.lru_cache(maxsize=1)
def cudnn_traceable() -> bool:
    """Whether cuDNN's attention can be traced here (a CUDA plugin is installed, with or
    without a GPU: a deviceless compile). Without one the program cannot be lowered for
    CUDA, and only JAX's own attention is emitted."""
    x = jax.ShapeDtypeStruct((1, 2, 1, 8), jnp.bfloat16)
    try:
        jax.eval_shape(lambda a: jax.nn.dot_product_attention(a, a, a, implementation="cudnn"), x)
    except Exception:  # noqa: BLE001 - cuDNN not detected, or not on this platform
        return False
    return True


# -- the emitter's side ----------------------------------------------------------------------


class Fusion:
    """What :class:`~jmp_rewrite._src.emit.emitter.Emitter` does at a fused attention's
    equations."""

    def __init__(self, selection: Any):
        self.selection = selection
        self._producers: dict[int, dict[Any, int]] = {}

    def step(self, em: Any, scope: Any, index: int, env: dict[Any, Any], read: Any) -> bool:
        """Runs equation ``index`` of ``scope`` if it belongs to a fused attention (the
        forward call, its VJP, or nothing); False for any other equation."""
        hit = self.selection.role(scope, index)
        if hit is None:
            return False
        role, f = hit
        if role == "forward":
            self._forward(em, f, env, read)
        elif role == "backward":
            self._backward(em, f, env, read)
        return True

    def io(self, scope: Any, index: int, eqn: Any) -> tuple[list[Any], list[Any]]:
        """The atoms equation ``index`` of ``scope`` reads and the vars it writes as the
        rewritten program runs it (a fused attention's: its call's)."""
        hit = self.selection.role(scope, index)
        if hit is None:
            return list(eqn.invars), list(eqn.outvars)
        role, f = hit
        if role == "forward":
            return f.reads(), [f.core.o]
        if role == "backward":
            return [*f.reads(), f.g], [v for v in f.grads if v is not None]
        return [], []

    def _call(self, em: Any, f: FusedAttention, env: dict[Any, Any], read: Any):
        """The fused call as a function of the inputs the program differentiates, and their
        values (the others are read here and closed over)."""
        c = f.core
        qkv = [read(a, em.half if _is_f32(a) else None) for a in (c.q, c.k, c.v)]
        biases = [read(b.atom) for b in c.biases]
        masks = [read(m.atom) for m in c.masks]
        out_dtype = em.target(f.scope.eqns[c.pv].node, c.o.aval.dtype)
        atoms = [c.q, c.k, c.v, *(b.atom for b in c.biases)]
        values = [*qkv, *biases]
        where = [atoms.index(a) for a in f.diff]
        refused = f.tpu or not tpu_attention.tpu_traceable()
        written = self._written(em, f, out_dtype, env) if refused else None

        def fun(*diff):
            args = list(values)
            for i, x in zip(where, diff, strict=True):
                args[i] = x
            return attend(c, em.half, out_dtype, *args[:3], args[3:], masks, written)

        return fun, [values[i] for i in where]

    def _written(self, em: Any, f: FusedAttention, out_dtype: Any, env: dict[Any, Any]) -> Any:
        """The attention as the program writes it: its equations run as the rewrite paints
        them (what a TPU runs where its kernel refuses the attention; see ``attend``), in
        the branch's own trace (no hooks: ``explain`` and ``compare`` see the fused
        call)."""
        c = f.core
        atoms = [c.q, c.k, c.v, *(b.atom for b in c.biases), *(m.atom for m in c.masks)]

        def written(q, k, v, biases, masks):
            local = dict(env)  # what the equations read besides: a scalar, a causal mask
            for atom, x in zip(atoms, [q, k, v, *biases, *masks], strict=True):
                if not jc.is_literal(atom):
                    local[atom] = x
            reading = em.reader(local)
            hooks, em.hooks = em.hooks, _QUIET
            try:
                with em.staging(), em.own_flags():
                    for i in sorted(c.eqns):
                        eqn, rec = f.scope.jaxpr.eqns[i], f.scope.eqns[i]
                        outs = em.step(eqn, rec, reading)
                        for var, x in zip(eqn.outvars, outs, strict=True):
                            if not jc.is_drop_var(var):
                                local[var] = x
            finally:
                em.hooks = hooks
            return cast(local[c.o], out_dtype)

        return written

    def _forward(self, em: Any, f: FusedAttention, env: dict[Any, Any], read: Any) -> None:
        fun, diff = self._call(em, f, env, read)
        if f.backward_at is None:
            out = fun(*diff)
        else:
            out, env[("attention", f.number)] = jax.vjp(fun, *diff)
        env[f.core.o] = out
        self._heard(em, f, f.core.o, out)

    def _backward(self, em: Any, f: FusedAttention, env: dict[Any, Any], read: Any) -> None:
        pullback = env.pop(("attention", f.number), None)
        if pullback is None:  # taken again (compare runs the program in stretches)
            fun, diff = self._call(em, f, env, read)
            _, pullback = jax.vjp(fun, *diff)
        out_dtype = em.target(f.scope.eqns[f.core.pv].node, f.core.o.aval.dtype)
        cts = pullback(read(f.g, out_dtype))
        producers = self._producer_nodes(f.scope)
        for var, ct in zip(f.grads, cts, strict=True):
            if var is None or jc.is_drop_var(var):
                continue
            node = producers.get(var)
            value = cast(ct, em.target(node, var.aval.dtype))
            env[var] = value
            self._heard(em, f, var, value)

    def _producer_nodes(self, scope: Any) -> dict[Any, int]:
        found = self._producers.get(id(scope))
        if found is None:
            found = self._producers[id(scope)] = {
                v: rec.node
                for e, rec in zip(scope.jaxpr.eqns, scope.eqns, strict=True)
                for v in e.outvars
            }
        return found

    def _heard(self, em: Any, f: FusedAttention, var: Any, value: Any) -> None:
        for e, rec in zip(f.scope.jaxpr.eqns, f.scope.eqns, strict=True):
            if rec.node is not None and len(e.outvars) == 1 and e.outvars[0] is var:
                em.hooks.value(em, e, rec, [value])
                return


class _Quiet:
    """Hooks that hear nothing (the written-out attention of a TPU branch)."""

    def value(self, *args: Any) -> None:
        pass

    def cast(self, *args: Any) -> None:
        pass


_QUIET = _Quiet()


def _is_f32(atom: Any) -> bool:
    return np.dtype(atom.aval.dtype) == np.float32
