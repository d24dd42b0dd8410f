"""Issue 22: a generator of programs made of what real JAX programs are made of.

A :class:`Program` is a chain of blocks over a hidden ``h`` (``B x D``), each block a frozen
dataclass (so a counterexample prints as the Python literal that rebuilds it):

* :class:`Dense` -- ``act(h @ w + b)`` as a matmul, an einsum or a 1-D convolution, with an
  optional residual; :class:`Norm` -- layer, RMS or batch normalisation;
* :class:`Attention` -- ``softmax(q k^T / sqrt(D) + bias) v`` with a mask that is an *input*
  (Hugging Face's ``attention_mask``; row 0 fully padded, the last key padded for every row)
  or a captured constant, in every spelling of the idiom: ``(1 - m) * finfo(float32).min``,
  ``* -1e9``, ``* -3.4e38``, ``where(m, s, full(finfo.min))``, ``where(m, s, -1e9)``, the bias
  added before or after the scaling;
* :class:`MaskBias` -- ``softmax(q k^T + pos + fill bias) v``: a computed bias (T5's
  learned relative positions, ALiBi's slopes, none) plus a mask fill beyond the half range
  (``finfo(float32).min``, ``-1e9``, ``-1e10``, a ``jnp.full`` array), the bias built
  across a boundary (``cond``, ``scan``, ``while_loop``, ``jit``, ``checkpoint``,
  ``custom_vjp``), its mask an input, an integer mask or one a half matmul computes
  (``m @ e``: the gradient through the bias is ~1e9, and overflows float16);
* :class:`Overflow` -- values beyond the half range from computation, read by a matmul:
  ``exp(c x)``, ``exp(c x) / 0.5``, ``exp(c x)`` plus a mask bias; they overflow honestly in
  half (the oracle: where the reference overflows, the rewrite must too);
* :class:`Copy` -- an input (or a view of it, or ``exp`` of it: a float32 value in both lists)
  handed to an output through nothing, ``jit``, ``checkpoint``, a ``cond`` whose other branch
  is a constant, a zero-trip ``scan`` or a loop that carries it unchanged, beside a matmul
  that reads the same value;
* :class:`State` -- state updates of every shape the README names (EMA, SGD, Adam, an ODE step
  ``y + k / 100``, RK4 with ``dt / 6 * (...)``, clipped and projected steps, ``.at[].add``,
  a pytree through ``ravel_pytree``, and the nonlinear ``0.5 * c * c + step``), applied once,
  inside a ``cond``, or carried by ``scan`` (optionally reversed, unrolled, with the update
  under a ``cond`` every other trip), ``fori_loop`` or ``while_loop``, for 0, 1 or 6 trips,
  through a cycle of 1 to 4 carries (``c_i' = update(c_{i+1})``), optionally read by a matmul;
  updates through a selection (issue 28.3: ``top_k`` of the state plus increments as beam
  search writes it, ``sort``, ``max``, an ``argmax``-indexed take) and through nonlinear
  readers of the carry (issue 29.7: ``0.5 * c * c``, ``0.5 / c``);
* :class:`Recurrence` -- a linear recurrence ``h_t = a_t h_{t-1} + b_t`` over a 64-step
  sequence tiled from ``h`` (issue 28.4), its coefficient near 1 computed from a matmul as
  gated RNNs and state-space models write it (``sigmoid(. + 4)``, Mamba's ``exp(-softplus(.)
  A)``, minGRU's ``1 - z``, a learned decay with no matmul), by ``lax.scan``, a ``fori_loop``
  over the stacked sequence, or ``lax.associative_scan``.

* :class:`Complex` -- complex values between half matmuls (issue 28): an LRU or S5 diagonal
  recurrence (``exp(dt * lam)``) over the rows of ``h``, an FFT long convolution, a complex
  matmul with ``abs``/``conj``/``imag``; :class:`Kernel` -- a Pallas kernel (``interpret=True``):
  the tutorial's gridded matmul or a flash attention, each with a plain-JAX ``custom_vjp``.

Each block may be wrapped in ``jit``, ``checkpoint``, ``custom_jvp``, ``custom_vjp``, a
two-step ``scan`` that stacks its outputs or a one-device ``shard_map`` (``h`` split on its
batch axis, so parameters are ``pvary``-ed); the program is run plain, under ``jax.grad`` (both
orders around the rewrite) or under ``jax.vmap`` (both orders). Programs are dtype-generic:
the same code runs in float32 and, under ``jax.enable_x64``, in float64 (the oracle's truth,
``tests/test_oracle.py``).

Building blocks shared with ``tests/test_invariants.py``: its activations and losses.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec as P
from test_invariants import ACTIVATIONS, LOSSES

B, D, N = 8, 16, 32  # batch (= sequence), width, scatter-add updates
FMIN = jnp.finfo(jnp.float32).min  # a numpy float32 scalar, as Hugging Face writes it
# Repeated scatter indices (embedding-gradient style) and the values each one reads.
IDX = np.random.default_rng(8).integers(0, 4, N).astype(np.int32)
IDX_SRC = np.random.default_rng(9).integers(0, D, N).astype(np.int32)


def attention_mask(seed: int) -> np.ndarray:
    """A 0/1 float mask: row 0 fully padded, the last key padded, each other row >= 1 key."""
    m = (np.random.default_rng((seed, 99)).random((B, B)) < 0.7).astype(np.float32)
    m[:, 0] = 1.0
    m[:, -1] = 0.0
    m[0] = 0.0
    return m


# ------------------------------------------------------------------------------------------
# Blocks
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Dense:
    op: str = "matmul"  # matmul | einsum | conv
    act: str = "linear"
    residual: bool = False
    k: int = 0
    wrappers: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Norm:
    kind: str = "layer"  # layer | rms | batch
    wrappers: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Attention:
    spelling: str = "finfo_mul"  # see MASK_SPELLINGS
    before_scale: bool = False
    mask_input: bool = True  # the mask is an argument (else a captured constant)
    k: int = 0
    wrappers: tuple[str, ...] = ()
    export_probs: bool = True  # the weights are an output too (never fused then)


@dataclasses.dataclass(frozen=True)
class MaskBias:
    pos: str = "relative"  # see POSITION_BIASES
    fill: str = "finfo"  # see FILLS
    route: str = "plain"  # see BIAS_ROUTES
    mask: str = "input"  # input | int | computed
    k: int = 0
    wrappers: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Overflow:
    kind: str = "exp"  # see OVERFLOWS
    k: int = 0
    wrappers: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Copy:
    src: str = "x"  # x | x_T | w | s | exp_x
    route: str = "plain"  # see COPY_ROUTES
    k: int = 0
    wrappers: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class State:
    update: str = "sgd"  # see UPDATES
    carrier: str = "step"  # see CARRIERS
    trips: int = 6
    carries: int = 1  # a cycle of this many carries
    reverse: bool = False
    unroll: int = 1
    h_carry: bool = True  # the loop also carries h through a matmul layer
    feed: bool = False  # a matmul reads the new state
    taken: bool = True  # carrier "cond": the branch that updates runs
    k: int = 0
    wrappers: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Complex:
    kind: str = "lru"  # see COMPLEX_KINDS
    k: int = 0
    wrappers: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Recurrence:
    coef: str = "sigmoid"  # see COEFFICIENTS
    how: str = "scan"  # see RECURRENCES
    k: int = 0
    wrappers: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Loop:
    """Issue 29: a ``while_loop`` whose condition reads its carries in one way of
    :data:`CONDITIONS`, carrying a counter, a boolean flag, an activation ``tanh(h @ w + b)``,
    another from the input ``x`` (handed out: ``x`` itself when the loop never runs), a
    linear state (an EMA of the activation) and a carry of another type (:data:`EXTRAS`)
    that the condition never reads; ``trips`` iterations (0: it never runs)."""

    cond: str = "counter"  # see CONDITIONS
    traced_init: bool = False  # the flag's initial value computed from x (else a literal)
    trips: int = 3
    extra: str = "none"  # see EXTRAS
    k: int = 0
    wrappers: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Kernel:
    kind: str = "matmul"  # matmul (Pallas's gridded tutorial kernel) | flash (attention)
    k: int = 0
    wrappers: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Precise:
    """Issue 29: a dense layer ``tanh(h @ w + b)`` (or a 1-D convolution) whose matmul asks
    for a precision or a dot algorithm (:data:`PRECISIONS`), read by a default one."""

    precision: str = "high"  # see PRECISIONS
    op: str = "matmul"  # matmul | conv (precisions only: no dot algorithm)
    k: int = 0
    wrappers: tuple[str, ...] = ()


#: How a Loop's condition reads its carries: a literal counter; its boolean flag returned as
#: is (``lambda c: c.flag``) or negated; the counter and a float carry (a test always true);
#: the counter against a bound computed from the input; an integer carry counting by 2.
CONDITIONS = ("counter", "flag", "not_flag", "counter_and_float", "traced_bound", "int_carry")
#: A Loop's carry the condition does not read: a typed PRNG key, a raw uint32 key, an int, a
#: bool; each changes every trip.
EXTRAS = ("none", "key", "raw_key", "int", "bool")
PRECISIONS = ("default", "high", "highest", "high_highest", "tf32", "f32_algorithm")
PRECISIONS += ("bf16_algorithm", "bf16x3_algorithm")


MASK_SPELLINGS = ("finfo_mul", "neg1e9_mul", "neg3e38_mul", "full_where", "where_neg1e9")
POSITION_BIASES = ("none", "relative", "alibi")
# (``finfo(float16).min`` is pinned in float16, where float32 keeps ``s - 65504`` distinct
# per score: the oracle's reference cannot judge it; ``tests/test_mask_values.py`` does)
FILLS = ("finfo", "neg1e9", "neg1e10", "full")
BIAS_ROUTES = ("plain", "cond", "scan", "while_loop", "jit", "checkpoint", "custom_vjp")
OVERFLOWS = ("exp", "exp_div", "exp_plus_bias")
COPY_ROUTES = ("plain", "jit", "checkpoint", "cond_ones", "cond_const", "scan0", "fori_carried")
UPDATES = ("sgd", "ema", "adam", "ode_div", "rk4", "clip", "project", "scatter", "ravel")
UPDATES += ("top_k", "sort", "max", "take_max")  # through a selection (issue 28.3)
NONLINEAR_UPDATES = ("square", "reciprocal")  # no linear state (issue 29.7)
UPDATES += NONLINEAR_UPDATES
COEFFICIENTS = ("sigmoid", "mamba", "min_gru", "decay")
RECURRENCES = ("scan", "fori_loop", "associative_scan")
#: What the generator draws: associative_scan's tree compiles slowly on a CPU (6-19 s of CPU
#: for a generated program, grad included), so only tests/test_recurrences.py and the shrunk
#: counterexamples run it.
_RECURRENCE_DRAWS = ("scan", "fori_loop")
REPEAT = 8  # the recurrence's sequence: h tiled REPEAT times (64 steps; 32 hide the bug)
CARRIERS = ("step", "cond", "scan", "fori_loop", "while_loop", "scan_cond")
COMPLEX_KINDS = ("lru", "s5", "fft", "cmatmul")
WRAPPERS = ("jit", "checkpoint", "custom_jvp", "custom_vjp", "scan2", "shard_map")
TRANSFORMS = ("none", "grad_outer", "grad_inner", "vmap_outer", "vmap_inner")


@dataclasses.dataclass(frozen=True)
class Program:
    blocks: tuple[Any, ...]
    transform: str = "none"  # how the oracle runs it, see TRANSFORMS
    final_dense: bool = False
    outer_jit: bool = False
    loss: str = "mean_square"
    seed: int = 0

    def inputs(self, draw: int = 0) -> dict[str, Any]:
        """Float32 arguments for draw ``draw`` (the mask is the same in every draw)."""
        rng = np.random.default_rng((self.seed, draw))
        f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
        x_shape = (2, B, D) if self.transform.startswith("vmap") else (B, D)
        return {
            "x": f32(rng.standard_normal(x_shape)),
            "w": [f32(rng.standard_normal((D, D)) / np.sqrt(D)) for _ in range(3)],
            "b": f32(0.1 * rng.standard_normal((D,))),
            "g": f32(1.0 + 0.1 * rng.standard_normal((D,))),
            "s": [f32(rng.uniform(0.5, 1.5, (D,))) for _ in range(4)],  # states (a pytree)
            "kernel": f32(rng.standard_normal((3, D, D)) / np.sqrt(3 * D)),
            "m": f32(attention_mask(self.seed)),
            "rel": f32(0.5 * rng.standard_normal((2 * B - 1,))),  # relative-position bias
            "e": f32(np.eye(B)),  # a computed mask's weight: ``m @ e`` is the mask, 0 or 1
        }

    def exact(self) -> frozenset[str]:
        """Outputs that hand on a float32 value: bit-exact in every version."""
        names = set()
        for i, blk in enumerate(self.blocks):
            if isinstance(blk, Copy):
                names.add(f"copy{i}")
            if isinstance(blk, State) and _state_untouched(blk):
                names.update(_state_names(i, blk))
            if isinstance(blk, Loop) and _known_unrun(blk):  # x and the state unchanged
                names.update((f"loop{i}_s", f"loop{i}_x"))
        return frozenset(names)

    def linear_states(self) -> frozenset[str]:
        """State outputs updated linearly from themselves, or selected from such an update
        (every update but :data:`NONLINEAR_UPDATES`): the README's state, which the rewrite
        updates in float32."""
        names = set()
        for i, blk in enumerate(self.blocks):
            if isinstance(blk, State) and blk.update not in NONLINEAR_UPDATES:
                names.update(_state_names(i, blk))
        return frozenset(names)


def _known_unrun(blk: Loop) -> bool:
    """A loop that never runs, and whose condition reads literals only (a counter, an int
    carry, a flag given as a literal), so the rewrite knows it when it paints: its carries
    hand on what entered them, bit-exact. (One reading a float carry or a traced value may
    run, as far as the rewrite can tell: its carries are painted as a running loop's.)"""
    literal = blk.cond in ("counter", "int_carry") or (
        blk.cond in ("flag", "not_flag") and not blk.traced_init
    )
    return blk.trips == 0 and literal


def _state_untouched(blk: State) -> bool:
    if blk.carrier == "cond":
        return not blk.taken
    return blk.carrier != "step" and blk.trips == 0


def _state_names(i: int, blk: State) -> list[str]:
    parts = {"adam": ("", "_mu", "_nu"), "ravel": ("_a", "_b")}.get(blk.update, ("",))
    return [f"state{i}_{j}{part}" for j in range(blk.carries) for part in parts]


def _flag(p: dict[str, Any], taken: bool) -> jax.Array:
    """A data-dependent predicate with a known value (|mean(x)| < 10 for these inputs)."""
    small = jnp.abs(jnp.mean(p["x"])) < 10.0
    return small if taken else ~small


def _dense(blk: Dense, h: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, dict]:
    if blk.op == "matmul":
        y = h @ p["w"][blk.k]
    elif blk.op == "einsum":
        y = jnp.einsum("bd,ed->be", h, p["w"][blk.k].T)
    else:
        dims = ("NWC", "WIO", "NWC")
        y = lax.conv_general_dilated(h[None], p["kernel"], (1,), "SAME", dimension_numbers=dims)
        y = y[0]
    y = ACTIVATIONS[blk.act](y + p["b"])
    return (h + y if blk.residual else y), {}


def _norm(blk: Norm, h: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, dict]:
    if blk.kind == "rms":
        return h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * p["g"], {}
    axis = 0 if blk.kind == "batch" else -1
    mean = jnp.mean(h, axis=axis, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), axis=axis, keepdims=True)
    return (h - mean) * lax.rsqrt(var + 1e-5) * p["g"] + p["b"], {}


def _attention(i: int, blk: Attention, h: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, dict]:
    m = p["m"] if blk.mask_input else jnp.asarray(attention_mask(0))
    q, kk = h @ p["w"][blk.k], h @ p["w"][(blk.k + 1) % 3]
    s = q @ kk.T
    scale = 1.0 / math.sqrt(D)
    if not blk.before_scale:
        s = s * scale
    if blk.spelling == "finfo_mul":
        s = s + (1.0 - m) * FMIN
    elif blk.spelling == "neg1e9_mul":
        s = s + (1.0 - m) * -1e9
    elif blk.spelling == "neg3e38_mul":
        s = s + (1.0 - m) * -3.4e38
    elif blk.spelling == "full_where":
        s = jnp.where(m > 0, s, jnp.full(s.shape, FMIN))
    else:
        s = jnp.where(m > 0, s, -1e9)
    if blk.before_scale:
        s = s * scale
    probs = jax.nn.softmax(s, axis=-1)
    return probs @ h, ({f"probs{i}": probs} if blk.export_probs else {})


def _fill_bias(blk: MaskBias, keep: jax.Array) -> jax.Array:
    """The mask's bias: 0 where ``keep``, the fill elsewhere (a computed mask's as a
    product, so that the gradient reaches it: the fill times the cotangent)."""
    if blk.fill == "full":
        return (1.0 - keep) * jnp.full(keep.shape, -1e9)
    fill = {"finfo": FMIN, "neg1e9": -1e9, "neg1e10": -1e10}[blk.fill]
    if blk.mask == "computed":
        return (1.0 - keep) * fill
    return jnp.where(keep > 0, 0.0, fill)


def _route(route: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` called across ``route``."""
    if route == "plain":
        return fn
    if route in ("jit", "checkpoint"):
        return jax.jit(fn) if route == "jit" else jax.checkpoint(fn)
    if route == "cond":
        return lambda *a: lax.cond(jnp.sum(a[0]) >= 0, fn, lambda *b: fn(*b) * 1.0, *a)
    if route == "scan":
        return lambda *a: lax.scan(lambda c, _: (c, fn(*a)), 0.0, None, length=2)[1][-1]
    if route == "while_loop":
        return lambda *a: lax.while_loop(
            lambda c: c[0] < 2, lambda c: (c[0] + 1, fn(*a)), (0, fn(*a))
        )[1]
    assert route == "custom_vjp", route
    return _custom_vjp(fn)


def _mask_bias(i: int, blk: MaskBias, h: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, dict]:
    q, kk = h @ p["w"][blk.k], h @ p["w"][(blk.k + 1) % 3]
    s = q @ kk.T
    if blk.mask == "input":
        keep = p["m"]
    elif blk.mask == "int":
        keep = (jnp.asarray(attention_mask(0)) > 0).astype(jnp.int32)
    else:  # a mask a half matmul computes (0 or 1, exactly): its gradient is ~1e9
        keep = p["m"] @ p["e"]

    def bias(keep, rel):
        dist = jnp.arange(B)[None, :] - jnp.arange(B)[:, None]
        if blk.pos == "relative":
            pos = rel[dist + B - 1]
        elif blk.pos == "alibi":
            pos = -0.5 * jnp.abs(dist).astype(s.dtype)
        else:
            pos = 0.0
        return pos + _fill_bias(blk, keep)

    probs = jax.nn.softmax(s + _route(blk.route, bias)(keep, p["rel"]), axis=-1)
    return probs @ h, {f"probs{i}": probs}


def _overflow(i: int, blk: Overflow, h: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, dict]:
    big = jnp.exp(4.0 * p["x"])  # beyond float16 where x > 2.8; float32 holds it
    if blk.kind == "exp_div":
        big = big / 0.5
    elif blk.kind == "exp_plus_bias":
        big = big + (1.0 - p["m"][:, : big.shape[-1] // 2].repeat(2, axis=-1)) * -1e9
    return h, {f"over{i}": big @ p["w"][blk.k]}


def _copy(i: int, blk: Copy, h: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, dict]:
    src = {
        "x": lambda: p["x"],
        "x_T": lambda: p["x"].T,
        "w": lambda: p["w"][blk.k],
        "s": lambda: p["s"][0],
        "exp_x": lambda: jnp.exp(4.0 * p["x"]),  # overflows float16 for x > 2.8
    }[blk.src]()
    route = blk.route
    if route == "plain":
        y = src
    elif route in ("jit", "checkpoint"):
        wrap = jax.jit if route == "jit" else jax.checkpoint
        y = wrap(lambda v: v)(src)
    elif route == "cond_ones":
        y = lax.cond(_flag(p, True), lambda v: v, lambda v: jnp.ones_like(v), src)
    elif route == "cond_const":
        const = jnp.asarray(np.full(src.shape, 0.5, np.float32))
        y = lax.cond(_flag(p, True), lambda v: v, lambda v: const.astype(v.dtype), src)
    elif route == "scan0":
        layer = lambda c: jnp.tanh(c.reshape(-1, D) @ p["w"][blk.k]).reshape(c.shape)  # noqa: E731
        y = lax.scan(lambda c, _: (layer(c), None), src, None, length=0)[0]
    else:  # carried unchanged beside a matmul layer
        body = lambda _, c: (c[0], jnp.tanh(c[1] @ p["w"][blk.k]))  # noqa: E731
        y = lax.fori_loop(0, 3, body, (src, h))[0]
    read = y.reshape(-1, D) @ p["w"][blk.k]
    return h, {f"copy{i}": y, f"read{i}": read}


def _update(blk: State, c: Any, grad: jax.Array, stat: jax.Array) -> Any:
    """One step of ``blk.update`` on the state unit ``c`` (an array, or a tuple/dict)."""
    u = blk.update
    if u == "sgd":
        return c - 0.01 * grad
    if u == "ema":
        return 0.9 * c + 0.1 * stat
    if u == "adam":
        w, mu, nu = c
        mu = 0.9 * mu + 0.1 * grad
        nu = 0.999 * nu + 0.001 * grad * grad
        return w - 0.01 * mu / (jnp.sqrt(nu) + 1e-8), mu, nu
    if u == "ode_div":
        return c + (grad - c) / 100
    if u == "rk4":
        dt = 0.05
        f = lambda y: grad - 0.5 * y  # noqa: E731
        k1 = f(c)
        k2 = f(c + dt / 2 * k1)
        k3 = f(c + dt / 2 * k2)
        k4 = f(c + dt * k3)
        return c + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    if u == "clip":
        return jnp.clip(c - 0.01 * grad, -2.0, 2.0)
    if u == "project":
        q = c - 0.01 * grad
        return q * jnp.minimum(1.0, 8.0 / jnp.linalg.norm(q))
    if u == "scatter":
        return c.at[IDX].add(-0.01 * grad[IDX_SRC])
    if u == "ravel":
        flat, unravel = ravel_pytree(c)
        return unravel(flat - 0.01 * jnp.concatenate([grad[:8], grad[8:]]))
    if u == "top_k":  # beam search: every continuation's score, the best D kept
        return lax.top_k((c[:, None] + 0.01 * jnp.stack([grad, stat], 1)).reshape(-1), D)[0]
    if u == "sort":
        return jnp.sort(c - 0.01 * grad)
    if u == "max":  # cummax and its gradient compile slowly on a CPU: tests/test_recurrences.py
        return jnp.max(jnp.stack([c + 0.01 * grad, c - 0.01 * stat]), axis=0)
    if u == "take_max":  # the best of two updates, taken at its argmax
        v = jnp.stack([c + 0.01 * grad, c - 0.01 * stat])
        return v[jnp.argmax(v, axis=0), jnp.arange(D)]
    if u == "reciprocal":
        return 0.5 / c + 0.01 * grad
    assert u == "square", u
    return 0.5 * c * c + 0.01 * grad


def _init_unit(blk: State, s: jax.Array) -> Any:
    if blk.update == "adam":
        return s, jnp.zeros_like(s), jnp.zeros_like(s)
    if blk.update == "ravel":
        return {"a": s[:8], "b": s[8:].reshape(2, 4)}
    return s


def _state(i: int, blk: State, h: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, dict]:
    w = p["w"][blk.k]

    def layer(h):
        return jnp.tanh(h @ w + p["b"]) if blk.h_carry else h

    def stats(h):
        hh = h @ w  # a half-precision matmul feeds every update
        return jnp.mean(hh, axis=0), jnp.mean(hh * hh, axis=0)

    def rotate(units, h):  # the cycle: c_j' = update(c_{j+1})
        grad, stat = stats(h)
        n = len(units)
        return tuple(_update(blk, units[(j + 1) % n], grad, stat) for j in range(n))

    units = tuple(_init_unit(blk, p["s"][j]) for j in range(blk.carries))
    trips = blk.trips
    if blk.carrier == "step":
        units = rotate(units, h)
    elif blk.carrier == "cond":
        units = lax.cond(_flag(p, blk.taken), lambda u: rotate(u, h), lambda u: u, units)
    elif blk.carrier in ("scan", "scan_cond"):

        def body(c, t):
            h, units = c
            h = layer(h)
            if blk.carrier == "scan":
                return (h, rotate(units, h)), None
            even = t % 2 == 0
            return (h, lax.cond(even, lambda u: rotate(u, h), lambda u: u, units)), None

        xs = jnp.arange(trips)
        (h, units), _ = lax.scan(body, (h, units), xs, reverse=blk.reverse, unroll=blk.unroll)
    elif blk.carrier == "fori_loop":

        def fbody(t, c):
            h = layer(c[0])
            return h, rotate(c[1], h)

        h, units = lax.fori_loop(0, trips, fbody, (h, units))
    else:

        def wbody(c):
            h = layer(c[1])
            return c[0] + 1, h, rotate(c[2], h)

        _, h, units = lax.while_loop(lambda c: c[0] < trips, wbody, (0, h, units))
    outs = {}
    names = iter(_state_names(i, blk))
    for unit in units:
        for leaf in jax.tree.leaves(unit):
            outs[next(names)] = leaf
    if blk.feed:
        first = units[0]
        if isinstance(first, dict):  # the raveled pytree: its vector again
            first = jnp.concatenate([first["a"], first["b"].reshape(-1)])
        elif isinstance(first, tuple):  # Adam: the parameters
            first = first[0]
        h = (h * first) @ w
    return h, outs


def _complex(blk: Complex, h: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, dict]:
    """Complex values between half matmuls (issue 28 item 1): a diagonal linear recurrence
    over the rows of ``h`` (an LRU: ``lam * c + B x``; S5: ``lam`` discretised as
    ``exp(dt * lam)``), an FFT long convolution (Hyena, FNet), a complex matmul."""
    w = p["w"][blk.k]
    cdt = jnp.result_type(h.dtype, jnp.complex64)  # complex128 under x64
    r, theta = 0.5 + 0.4 * jnp.tanh(p["s"][0]), p["s"][1] - 1.0  # |lam| in [0.68, 0.86]
    if blk.kind == "fft":
        n = 2 * D
        k = jnp.exp(-jnp.arange(D, dtype=h.dtype) / 4) * p["g"]
        y = jnp.fft.irfft(jnp.fft.rfft(h @ w, n=n) * jnp.fft.rfft(k, n=n), n=n)[:, :D]
        return h + y, {}
    if blk.kind == "cmatmul":
        z = (h @ w).astype(cdt) @ (p["w"][(blk.k + 1) % 3] + 1j * p["w"][(blk.k + 2) % 3])
        return jnp.abs(z) / 4 + jnp.real(z * jnp.conj(z)) / 16 + jnp.imag(z) / 4, {}
    if blk.kind == "lru":
        lam, gain = r * jnp.exp(1j * theta), jnp.ones((), cdt)
    else:  # s5: a continuous-time lam discretised with a step dt
        lam_c = -(1.0 - r) * 4.0 + 3j * theta
        lam = jnp.exp(0.1 * p["s"][2] * lam_c)
        gain = (lam - 1.0) / lam_c

    def step(c, x):  # the rows of h as 4 steps of a batch of 2
        c = lam * c + gain * (x @ w).astype(cdt)
        return c, jnp.real(c) + jnp.abs(c) / 4

    xs = h.reshape(4, B // 4, D)
    _, ys = lax.scan(step, (0 * xs[0]).astype(cdt), xs)  # zeros varying as h (shard_map)
    return ys.reshape(B, D), {}


def _kernel(blk: Kernel, h: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, dict]:
    """A Pallas kernel (``interpret=True``) between half matmuls (issue 28 item 5), with a
    plain-JAX backward pass (``custom_vjp``: a ``pallas_call`` is not differentiable)."""
    w = p["w"][blk.k]
    if blk.kind == "matmul":
        return jnp.tanh(pallas_matmul(h @ w, p["w"][(blk.k + 1) % 3])), {}
    q, k, v = (h @ p["w"][(blk.k + j) % 3] for j in range(3))
    return h + pallas_attention(q, k, v), {}


def _matmul_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] @ y_ref[...]


def _pallas_matmul(x: jax.Array, y: jax.Array) -> jax.Array:
    """The Pallas tutorial's gridded matmul."""
    (m, k), n = x.shape, y.shape[1]
    bm, bn = m // 2, n // 2
    return pl.pallas_call(
        _matmul_kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(2, 2),
        in_specs=[
            pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
            pl.BlockSpec((k, bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=True,
    )(x, y)


def _flash_kernel(q_ref, k_ref, v_ref, o_ref, *, block: int):
    q = q_ref[...]

    def body(i, c):
        m, total, acc = c
        k, v = k_ref[pl.ds(i * block, block), :], v_ref[pl.ds(i * block, block), :]
        s = jnp.dot(q, k.T) / math.sqrt(q.shape[-1])
        m_new = jnp.maximum(m, s.max(-1))
        e, fix = jnp.exp(s - m_new[:, None]), jnp.exp(m - m_new)
        return m_new, total * fix + e.sum(-1), acc * fix[:, None] + jnp.dot(e, v)

    n, dt = k_ref.shape[0] // block, q.dtype
    init = (jnp.full((q.shape[0],), -jnp.inf, dt), jnp.zeros((q.shape[0],), dt), jnp.zeros_like(q))
    _, total, acc = lax.fori_loop(0, n, body, init)
    o_ref[...] = (acc / total[:, None]).astype(o_ref.dtype)


def _flash(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Flash attention over blocks of 4 queries and keys (online softmax)."""
    (t, d), block = q.shape, 4
    full = pl.BlockSpec((t, d), lambda i: (0, 0))
    return pl.pallas_call(
        functools.partial(_flash_kernel, block=block),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(t // block,),
        in_specs=[pl.BlockSpec((block, d), lambda i: (i, 0)), full, full],
        out_specs=pl.BlockSpec((block, d), lambda i: (i, 0)),
        interpret=True,
    )(q, k, v)


def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return jax.nn.softmax(q @ k.T / math.sqrt(q.shape[-1]), axis=-1) @ v


def _with_reference_vjp(kernel: Callable[..., Any], reference: Callable[..., Any]) -> Any:
    fun = jax.custom_vjp(kernel)
    fun.defvjp(lambda *a: (kernel(*a), a), lambda a, g: jax.vjp(reference, *a)[1](g))
    return fun


pallas_matmul = _with_reference_vjp(_pallas_matmul, jnp.matmul)
pallas_attention = _with_reference_vjp(_flash, attention_reference)


def _loop(i: int, blk: Loop, h: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, dict]:
    w, n = p["w"][blk.k], blk.trips
    small = jnp.abs(jnp.mean(p["x"])) < 10.0  # True, traced
    flag0 = (small if n else ~small) if blk.traced_init else n > 0
    extra0 = {
        "none": None,
        "key": jax.random.key(blk.k),
        "raw_key": jax.random.PRNGKey(blk.k),
        "int": 0,
        "bool": False,
    }[blk.extra]
    if blk.cond == "not_flag":
        flag0 = ~flag0 if blk.traced_init else not flag0
    bound = n + (jnp.mean(p["x"]) > 1e9).astype(jnp.int32)  # n, traced

    def cond(c):
        count, flag, h, _, j, _, _ = c
        if blk.cond == "counter":
            return count < n
        if blk.cond == "flag":
            return flag
        if blk.cond == "not_flag":
            return ~flag
        if blk.cond == "counter_and_float":
            return (count < n) & (jnp.sum(jnp.abs(h)) >= 0)
        if blk.cond == "traced_bound":
            return count < bound
        return j < 2 * n

    def body(c):
        count, flag, h, s, j, extra, xc = c
        h = jnp.tanh(h @ w + p["b"])
        xc = jnp.tanh(xc @ w)
        s = 0.9 * s + 0.1 * jnp.mean(h, axis=0)
        more = count + 1 < n
        if blk.extra in ("key", "raw_key"):
            extra = jax.random.split(extra)[0]
        elif blk.extra == "int":
            extra = extra + 3
        elif blk.extra == "bool":
            extra = ~extra
        return count + 1, (~more if blk.cond == "not_flag" else more), h, s, j + 2, extra, xc

    init = (0, flag0, h, p["s"][0], 0, extra0, p["x"])
    _, _, h, s, _, _, xc = lax.while_loop(cond, body, init)
    return h, {f"loop{i}_s": s, f"loop{i}_x": xc}


_PRECISION_VALUES = {
    "default": lax.Precision.DEFAULT,
    "high": lax.Precision.HIGH,
    "highest": lax.Precision.HIGHEST,
    "high_highest": (lax.Precision.HIGH, lax.Precision.HIGHEST),
    "tf32": "tensorfloat32",
    "f32_algorithm": lax.DotAlgorithmPreset.F32_F32_F32,
    "bf16_algorithm": lax.DotAlgorithmPreset.BF16_BF16_F32,
    "bf16x3_algorithm": lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
}


def _precise(blk: Precise, h: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, dict]:
    precision = _PRECISION_VALUES[blk.precision]
    if isinstance(precision, lax.DotAlgorithmPreset) and h.dtype != jnp.float32:
        precision = lax.Precision.HIGHEST  # float64 (the oracle's truth): no such algorithm
    if blk.op == "conv":
        if isinstance(precision, lax.DotAlgorithmPreset):
            precision = lax.Precision.HIGHEST
        dims = ("NWC", "WIO", "NWC")
        y = lax.conv_general_dilated(
            h[None], p["kernel"], (1,), "SAME", dimension_numbers=dims, precision=precision
        )[0]
    else:
        y = jnp.dot(h, p["w"][blk.k], precision=precision)
    return jnp.tanh(y + p["b"]) @ p["w"][(blk.k + 1) % 3], {}


def _coefficient(blk: Recurrence, za: jax.Array, p: dict[str, Any]) -> jax.Array:
    """The recurrence's coefficient, about 0.95-0.999, from the gate projection ``za``."""
    if blk.coef == "sigmoid":
        return jax.nn.sigmoid(za + 4.0)
    if blk.coef == "mamba":
        return jnp.exp(-jax.nn.softplus(za - 4.0) * p["g"])
    if blk.coef == "min_gru":
        return 1.0 - jax.nn.sigmoid(za - 4.0)
    assert blk.coef == "decay", blk.coef  # learned, no matmul
    return jnp.broadcast_to(jnp.exp(-0.02 * jnp.exp(p["g"])), za.shape)


def _recurrence(i: int, blk: Recurrence, h: jax.Array, p: dict[str, Any]) -> tuple[Any, dict]:
    u = jnp.tile(h, (REPEAT, 1))  # [REPEAT * B, D]: time first
    a = _coefficient(blk, u @ p["w"][blk.k], p)
    b = 0.1 * (u @ p["w"][(blk.k + 1) % 3])
    if blk.how == "scan":
        hs = lax.scan(lambda c, ab: (ab[0] * c + ab[1],) * 2, jnp.zeros_like(b[0]), (a, b))[1]
    elif blk.how == "fori_loop":

        def step(t, hs):
            return hs.at[t].set(a[t] * hs[t - 1] + b[t])

        hs = lax.fori_loop(1, b.shape[0], step, jnp.zeros_like(b).at[0].set(b[0]))
    else:
        hs = lax.associative_scan(lambda x, y: (x[0] * y[0], y[0] * x[1] + y[1]), (a, b))[1]
    out = hs[-h.shape[0] :]
    return out, {f"rec{i}": out}


# ------------------------------------------------------------------------------------------
# Wrappers and the whole program
# ------------------------------------------------------------------------------------------


def _custom_jvp(fn: Callable[..., Any]) -> Callable[..., Any]:
    wrapped = jax.custom_jvp(fn)
    wrapped.defjvp(lambda primals, tangents: jax.jvp(fn, primals, tangents))
    return wrapped


def _custom_vjp(fn: Callable[..., Any]) -> Callable[..., Any]:
    wrapped = jax.custom_vjp(fn)
    wrapped.defvjp(lambda h, p: jax.vjp(fn, h, p), lambda vjp, ct: vjp(ct))
    return wrapped


def _wrap(fn: Callable[..., Any], wrapper: str) -> Callable[..., Any]:
    if wrapper == "jit":
        return jax.jit(fn)
    if wrapper == "checkpoint":
        return jax.checkpoint(fn)
    if wrapper == "custom_jvp":
        return _custom_jvp(fn)
    if wrapper == "custom_vjp":
        return _custom_vjp(fn)
    if wrapper == "shard_map":  # on one device: h split on its batch axis, weights whole

        def local(h, p):  # states made device-varying, as a loop carrying them needs
            return fn(h, {**p, "s": [lax.pcast(v, "d", to="varying") for v in p["s"]]})

        mesh = jax.sharding.Mesh(np.array(jax.local_devices(backend="cpu")[:1]), ("d",))
        return jax.shard_map(local, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"))
    assert wrapper == "scan2", wrapper

    def scanned(h, p):  # two steps; per-step outputs come back stacked
        return lax.scan(lambda c, _: fn(c, p), h, None, length=2)

    return scanned


def block_fn(i: int, blk: Any) -> Callable[[jax.Array, dict[str, Any]], Any]:
    kinds = {Dense: _dense, Norm: _norm, Complex: _complex, Kernel: _kernel}
    if type(blk) in kinds:
        fn = lambda h, p: kinds[type(blk)](blk, h, p)  # noqa: E731
    else:
        indexed = {Attention: _attention, Copy: _copy, State: _state, Loop: _loop}.get(type(blk))
        indexed = indexed or {Recurrence: _recurrence, MaskBias: _mask_bias}.get(type(blk))
        indexed = indexed or {Overflow: _overflow}.get(type(blk))
        indexed = indexed or (lambda i, blk, h, p: _precise(blk, h, p))
        fn = lambda h, p: indexed(i, blk, h, p)  # noqa: E731
    for wrapper in blk.wrappers:
        fn = _wrap(fn, wrapper)
    return fn


def forward(program: Program) -> Callable[[dict[str, Any]], dict[str, jax.Array]]:
    """The program as ``p -> {name: array}`` (``h`` is the last hidden value)."""

    def fun(p):
        h, outs = p["x"], {}
        for i, blk in enumerate(program.blocks):
            h, o = block_fn(i, blk)(h, p)
            outs.update(o)
        if program.final_dense:
            h = h @ p["w"][2]
        outs["h"] = h
        return outs

    return jax.jit(fun) if program.outer_jit else fun


def loss_fn(program: Program) -> Callable[[dict[str, Any]], tuple[jax.Array, dict]]:
    """``p -> (loss, outputs)``: the loss of ``h`` plus a small share of every state."""
    fwd = forward(program)

    def loss(p):
        outs = fwd(p)
        value = LOSSES[program.loss](outs["h"])
        for name, v in outs.items():
            if name.startswith("state"):
                value = value + 0.01 * jnp.mean(v)
        return value, outs

    return loss


def transformed(
    program: Program, version: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Callable[[dict[str, Any]], dict[str, jax.Array]]:
    """The program under its transform, with ``version`` (a rewrite, or the identity) applied
    inside (``grad_inner``: ``rewrite(grad(f))``) or outside (``grad_outer``) it."""
    t = program.transform
    if t == "none":
        return version(forward(program))
    if t.startswith("grad"):
        vg = lambda f: jax.value_and_grad(f, has_aux=True)  # noqa: E731
        trainable = ("w", "b", "g", "s", "kernel", "rel", "e")

        def split(f):
            def g(train, rest):
                return f({**rest, **train})

            return g

        def outputs(fun):
            def run(p):
                train = {k: p[k] for k in trainable}
                rest = {k: v for k, v in p.items() if k not in trainable}
                (value, outs), grads = fun(train, rest)
                flat = {}
                for k, v in grads.items():
                    if isinstance(v, list):  # the weights, the states
                        flat.update({f"grad_{k}{j}": leaf for j, leaf in enumerate(v)})
                    else:
                        flat[f"grad_{k}"] = v
                return {**outs, "loss": value, **flat}

            return run

        loss = split(loss_fn(program))
        if t == "grad_outer":
            return outputs(vg(version(loss)))
        return outputs(version(vg(loss)))
    axes = {"x": 0, "w": None, "b": None, "g": None, "s": None, "kernel": None, "m": None}
    axes["rel"] = axes["e"] = None
    fwd = forward(program)
    if t == "vmap_outer":
        return jax.vmap(version(fwd), in_axes=(axes,))
    return version(jax.vmap(fwd, in_axes=(axes,)))


# ------------------------------------------------------------------------------------------
# Strategies
# ------------------------------------------------------------------------------------------


def _wrappers(draw: Any) -> tuple[str, ...]:
    drawn = tuple(draw(st.lists(st.sampled_from(WRAPPERS), max_size=2)))
    if drawn.count("shard_map") > 1:  # a shard_map inside one over the same mesh axis: no
        drawn = drawn[1:]
    return drawn


@st.composite
def state_blocks(draw: Any, transform: str = "none") -> State:
    carriers = CARRIERS if not transform.startswith("grad") else CARRIERS[:4] + CARRIERS[5:]
    carrier = draw(st.sampled_from(carriers))
    looped = carrier not in ("step", "cond")
    return State(
        update=draw(st.sampled_from(UPDATES)),
        carrier=carrier,
        trips=draw(st.sampled_from([6, 0, 1])) if looped else 1,
        carries=draw(st.integers(1, 4)),
        reverse=draw(st.booleans()) if carrier.startswith("scan") else False,
        unroll=draw(st.sampled_from([1, 2])) if carrier.startswith("scan") else 1,
        h_carry=draw(st.booleans()) if looped else False,
        feed=draw(st.booleans()),
        taken=draw(st.booleans()) if carrier == "cond" else True,
        k=draw(st.integers(0, 2)),
        wrappers=_wrappers(draw),
    )


@st.composite
def loop_blocks(draw: Any, transform: str = "none") -> Loop:
    """Issue 29: while loops whose conditions read their carries in every way."""
    return Loop(
        cond=draw(st.sampled_from(CONDITIONS)),
        traced_init=draw(st.booleans()),
        trips=draw(st.sampled_from([3, 0, 1])),
        extra=draw(st.sampled_from(EXTRAS)),
        k=draw(st.integers(0, 2)),
        wrappers=_wrappers(draw),
    )


@st.composite
def precise_blocks(draw: Any, transform: str = "none") -> Precise:
    """Issue 29: matmuls and convolutions of every precision and dot algorithm."""
    return Precise(
        precision=draw(st.sampled_from(PRECISIONS)),
        op=draw(st.sampled_from(["matmul", "conv"])),
        k=draw(st.integers(0, 2)),
        wrappers=_wrappers(draw),
    )


#: Block kinds issue 29 adds to :func:`any_block`, by name.
WIDER = {"loop": loop_blocks, "precise": precise_blocks}


@st.composite
def any_block(draw: Any, transform: str = "none") -> Any:
    kinds = ["state", "attention", "copy", "dense", "norm", "complex", "recurrence"]
    kinds += ["mask_bias", "overflow", *WIDER]
    kind = draw(st.sampled_from(kinds))
    if kind == "state":
        return draw(state_blocks(transform))
    if kind == "loop" and transform.startswith("grad"):
        kind = "precise"  # a while loop is not reverse-differentiable
    if kind in WIDER:
        return draw(WIDER[kind](transform))
    k = draw(st.integers(0, 2))
    if kind == "complex":  # complex values, or a Pallas kernel: boundaries (issue 28)
        if draw(st.booleans()):
            return Complex(draw(st.sampled_from(COMPLEX_KINDS)), k, _wrappers(draw))
        # (inside shard_map a kernel's out_shape must name its varying axes: not drawn)
        wrappers = tuple(w for w in _wrappers(draw) if w != "shard_map")
        return Kernel(draw(st.sampled_from(["matmul", "flash"])), k, wrappers)
    if kind == "recurrence":
        return Recurrence(
            coef=draw(st.sampled_from(COEFFICIENTS)),
            how=draw(st.sampled_from(_RECURRENCE_DRAWS)),
            k=k,
            wrappers=_wrappers(draw),
        )
    if kind == "mask_bias":
        return MaskBias(
            pos=draw(st.sampled_from(POSITION_BIASES)),
            fill=draw(st.sampled_from(FILLS)),
            route=draw(st.sampled_from(BIAS_ROUTES)),
            mask=draw(st.sampled_from(["input", "int", "computed"])),
            k=k,
            wrappers=_wrappers(draw),
        )
    if kind == "overflow":
        return Overflow(kind=draw(st.sampled_from(OVERFLOWS)), k=k, wrappers=_wrappers(draw))
    if kind == "attention":
        return Attention(
            spelling=draw(st.sampled_from(MASK_SPELLINGS)),
            before_scale=draw(st.booleans()),
            mask_input=draw(st.booleans()),
            k=k,
            wrappers=_wrappers(draw),
        )
    if kind == "copy":
        return Copy(
            src=draw(st.sampled_from(["x", "x_T", "w", "s", "exp_x"])),
            route=draw(st.sampled_from(COPY_ROUTES)),
            k=k,
            wrappers=_wrappers(draw),
        )
    if kind == "dense":
        return Dense(
            op=draw(st.sampled_from(["matmul", "einsum", "conv"])),
            act=draw(st.sampled_from(sorted(ACTIVATIONS))),
            residual=draw(st.booleans()),
            k=k,
            wrappers=_wrappers(draw),
        )
    return Norm(kind=draw(st.sampled_from(["layer", "rms", "batch"])), wrappers=_wrappers(draw))


@st.composite
def attention_programs(draw: Any) -> Program:
    """1 or 2 attention blocks that keep their weights to themselves (``fuse_attention``
    replaces them, forward and backward), each maybe after a dense layer, as written or
    differentiated before or after the rewrite."""
    transform = draw(st.sampled_from(("none", "grad_outer", "grad_inner")))
    chosen: list[Any] = []
    for _ in range(draw(st.integers(1, 2))):
        if draw(st.booleans()):
            chosen.append(Dense(act=draw(st.sampled_from(sorted(ACTIVATIONS)))))
        chosen.append(
            Attention(
                spelling=draw(st.sampled_from(MASK_SPELLINGS)),
                before_scale=draw(st.booleans()),
                mask_input=draw(st.booleans()),
                k=draw(st.integers(0, 2)),
                export_probs=False,
            )
        )
    return Program(
        blocks=tuple(chosen),
        transform=transform,
        final_dense=draw(st.booleans()),
        loss=draw(st.sampled_from(sorted(LOSSES))),
        seed=draw(st.integers(0, 1000)),
    )


@st.composite
def programs(draw: Any, transforms: tuple[str, ...] = TRANSFORMS) -> Program:
    """1 to 4 blocks, each optionally after a dense layer, under one of ``transforms``."""
    transform = draw(st.sampled_from(transforms))
    chosen: list[Any] = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            chosen.append(Dense(act=draw(st.sampled_from(sorted(ACTIVATIONS)))))
        chosen.append(draw(any_block(transform)))
    return Program(
        blocks=tuple(chosen),
        transform=transform,
        final_dense=draw(st.booleans()),
        outer_jit=draw(st.booleans()),
        loss=draw(st.sampled_from(sorted(LOSSES))),
        seed=draw(st.integers(0, 1000)),
    )
