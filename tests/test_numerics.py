"""Issue 2 §5 "Numerics": rewritten Flax NNX models stay within half-precision tolerance.

Three small models built from Flax NNX layers -- an MLP (``nnx.Linear``), a CNN with batch
norm (``nnx.Conv`` + ``nnx.BatchNorm`` in training mode, so the running statistics are
outputs too) and a pre-LN transformer block (``nnx.LayerNorm`` + ``nnx.MultiHeadAttention`` +
an MLP) -- are run in float32 and rewritten to float16 and bfloat16. For each we check

* the parameter gradients of both orders, ``jax.grad(rewrite(loss))`` and
  ``rewrite(jax.grad(loss))``, against float32, and the forward results of the same two
  programs (logits and updated batch statistics, returned as ``has_aux``);
* structurally, in the emitted jaxpr (sub-jaxprs included), that every ``dot_general`` and
  ``conv_general_dilated`` takes half-precision operands, none went missing, and the results
  have the original pytree, shapes and dtypes -- for those two programs and for the rewritten
  forward pass ``rewrite(apply)``.

The models go through ``nnx.split``/``nnx.merge`` so that what is rewritten is a plain JAX
function of arrays; ``merge(..., copy=True)`` keeps batch norm from mutating the caller's state.

Tolerances, from the unit roundoff ``u`` (float16: 2**-11 ~ 4.9e-4; bfloat16: 2**-8 ~ 3.9e-3).
A rewritten layer rounds its input, its weights and its output to half precision (matmuls and
convs accumulate in float32), so each layer adds a relative error of about ``sqrt(3) u`` to
what it passes on, and independent errors add in quadrature: for these 3-5 layer models
about ``3u``. Forward outputs are compared by the relative error of their norms with a bound
of ``4u`` (float16 2e-3, bfloat16 1.6e-2; observed 1.2-1.6u). Gradients also round the
backward pass's cotangents, roughly doubling the depth: the whole gradient's bound is ``6u``
(observed 1.4-2.4u). Per parameter, the error is measured against the larger of the leaf's
norm and a tenth of the whole gradient's (some true gradients are analytically zero: a conv
bias followed by batch norm, attention's key bias), with a bound of ``16u`` (observed up to
11u: a bias gradient sums 64 cotangent rows in half precision, as JAX's transpose of a
half-precision broadcast does in hand-written half-precision code too). For scale: a
hand-written Flax model with ``dtype=float16/bfloat16`` lands at 1.5-2u on the MLP and CNN.
Activations are smooth (see :class:`CNN`), so these are relative errors of a differentiable
function. A half-precision sum accumulates in float32, as ``jnp.sum`` does (before that fix
the CNN's batch norm in bfloat16 was 24u off: see test_bf16_reduce_sum_accumulates_in_float32).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jaxpr_walk import all_eqns

import jmp_rewrite

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
HALF = {"float16": F16, "bfloat16": BF16}
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
FWD_TOL = {k: 4 * u for k, u in UNIT_ROUNDOFF.items()}
GRAD_TOL = {k: 6 * u for k, u in UNIT_ROUNDOFF.items()}
LEAF_TOL = {k: 16 * u for k, u in UNIT_ROUNDOFF.items()}
MATMULS = ("dot_general", "conv_general_dilated")

# ------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(32, 64, rngs=rngs)
        self.l2 = nnx.Linear(64, 64, rngs=rngs)
        self.l3 = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.l3(jax.nn.gelu(self.l2(jnp.tanh(self.l1(x)))))


class CNN(nnx.Module):
    """conv-BN-silu, strided conv-BN-silu, flatten, linear. Batch norm in training mode.

    Smooth activations on purpose: batch norm centres 2048 values per channel on zero, and
    with relu a half-precision rounding flips some of them across the kink, which changes the
    gradient discontinuously (float32 on half-rounded inputs is then already 10-40u off), so
    no relative tolerance would mean anything.
    """

    def __init__(self, rngs: nnx.Rngs):
        self.c1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(8, rngs=rngs)
        self.c2 = nnx.Conv(8, 16, (3, 3), strides=2, rngs=rngs)
        self.bn2 = nnx.BatchNorm(16, rngs=rngs)
        self.fc = nnx.Linear(8 * 8 * 16, 10, rngs=rngs)

    def __call__(self, x):
        x = jax.nn.silu(self.bn1(self.c1(x)))
        x = jax.nn.silu(self.bn2(self.c2(x)))
        return self.fc(x.reshape(x.shape[0], -1))


class TransformerBlock(nnx.Module):
    """Pre-LN block (attention + gelu MLP, residuals) and a mean-pooled linear head."""

    def __init__(self, rngs: nnx.Rngs, d: int = 32, heads: int = 4):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.att = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.fc1 = nnx.Linear(d, 4 * d, rngs=rngs)
        self.fc2 = nnx.Linear(4 * d, d, rngs=rngs)
        self.head = nnx.Linear(d, 10, rngs=rngs)

    def __call__(self, x):
        x = x + self.att(self.ln1(x))
        x = x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))
        return self.head(jnp.mean(x, axis=1))


#: name -> (model class, input shape, number of matmul/conv equations in the forward pass
#: and in a gradient program). A gradient program has the forward's matmuls plus two per
#: matmul for the backward (operand cotangents), minus one for a first layer whose input is
#: the data (its cotangent is never needed). The transformer's first matmuls (q, k, v) read
#: a layer norm with parameters, so all 9 need both.
MODELS: dict[str, tuple[Callable[[nnx.Rngs], nnx.Module], tuple[int, ...], int, int]] = {
    "mlp": (MLP, (16, 32), 3, 8),
    "cnn": (CNN, (8, 16, 16, 3), 3, 8),
    # q, k, v, logits, weighted values, out projection, fc1, fc2, head
    "transformer": (TransformerBlock, (4, 16, 32), 9, 27),
}

# ------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------


def matmuls(jaxpr: Any) -> list[Any]:
    return [e for e in all_eqns(jaxpr) if e.primitive.name in MATMULS]


def operand_dtypes(eqn: Any) -> list[np.dtype]:
    return [np.dtype(v.aval.dtype) for v in eqn.invars]


def signature(tree: Any) -> tuple[Any, list[tuple[tuple[int, ...], np.dtype]]]:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, [(tuple(np.shape(x)), np.dtype(jnp.result_type(x))) for x in leaves]


def flat(tree: Any) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def rel_err(ref: Any, got: Any) -> float:
    """||got - ref|| / ||ref|| over all leaves of the two pytrees."""
    r, g = flat(ref), flat(got)
    return float(np.linalg.norm(g - r) / np.linalg.norm(r))


def worst_leaf_err(ref: Any, got: Any) -> tuple[str, float]:
    """The parameter with the largest error, measured against max(||leaf||, ||grad|| / 10)."""
    floor = 0.1 * np.linalg.norm(flat(ref))
    worst = ("", 0.0)
    for (path, r), g in zip(jax.tree_util.tree_leaves_with_path(ref), jax.tree.leaves(got)):
        r, g = np.asarray(r, np.float64), np.asarray(g, np.float64)
        err = float(np.linalg.norm(g - r) / max(np.linalg.norm(r), floor))
        if err > worst[1]:
            worst = (jax.tree_util.keystr(path), err)
    return worst


def run(fun: Callable[..., Any], *args: Any) -> Any:
    """``jax.jit(fun)(*args)``, compiled at XLA backend optimisation level 0.

    That halves XLA:CPU's compile time, which is most of this file's run time. Level 0 only
    turns down LLVM's optimisation of the generated code: which operations run in half
    precision is the program's, and results differ from the default level by rounding
    (e.g. fused multiply-adds), within the tolerances either way.
    """
    return jax.jit(fun).lower(*args).compile({"xla_backend_optimization_level": 0})(*args)


@dataclasses.dataclass
class Case:
    """A model split into a plain function of arrays, with its inputs and float32 results."""

    apply: Callable[..., Any]  # (params, rest, x) -> (logits, batch_stats)
    loss: Callable[..., Any]  # (params, rest, x, y) -> (loss, (logits, batch_stats))
    args: tuple[Any, ...]  # (params, rest, x, y)
    ref_aux: Any  # float32 (logits, batch_stats)
    ref_grads: Any  # float32 gradient wrt params


def init_state(state: nnx.State, rng: np.random.Generator) -> nnx.State:
    """Random values for an abstract state, drawn with NumPy.

    Flax's initializers would do too, but run eagerly they compile one XLA program per
    shape (about 13 s of CPU for the CNN); NumPy takes milliseconds. Kernels are
    fan-in scaled normals, biases and normalisation offsets small normals (non-zero, so
    they matter), scales near 1, batch statistics (0, 1).
    """

    def draw(path: Any, leaf: Any) -> Any:
        names = [str(getattr(k, "key", k)) for k in path]
        shape = leaf.shape
        if "kernel" in names:
            # q/k/v kernels are (in, heads, head_dim); others (..., in, out).
            fan_in = shape[0] if {"query", "key", "value"} & set(names) else np.prod(shape[:-1])
            value = rng.standard_normal(shape) / np.sqrt(fan_in)
        elif "scale" in names:
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif "var" in names:
            value = np.ones(shape)
        elif "mean" in names:
            value = np.zeros(shape)
        else:
            value = 0.1 * rng.standard_normal(shape)
        return jnp.asarray(value, leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, state)


@functools.cache
def case(name: str) -> Case:
    cls, shape, _, _ = MODELS[name]
    abstract = nnx.eval_shape(lambda: cls(nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    rng = np.random.default_rng(0)
    params, rest = init_state(params, rng), init_state(rest, rng)

    def apply(params, rest, x):
        model = nnx.merge(graphdef, params, rest, copy=True)
        return model(x), nnx.state(model, nnx.BatchStat)

    def loss(params, rest, x, y):
        logits, stats = apply(params, rest, x)
        xent = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return jnp.mean(xent), (logits, stats)

    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    y = jnp.arange(shape[0]) % 10
    args = (params, rest, x, y)
    grads, aux = run(jax.grad(loss, has_aux=True), *args)
    return Case(apply, loss, args, aux, grads)


def grad_of_rewrite(c: Case, dtype: Any, lists: Any = None) -> Callable[..., Any]:
    """``jax.grad(rewrite(loss))``: differentiate the rewritten program."""
    return jax.grad(jmp_rewrite.rewrite(c.loss, dtype=dtype, lists=lists), has_aux=True)


def rewrite_of_grad(c: Case, dtype: Any, lists: Any = None) -> Callable[..., Any]:
    """``rewrite(jax.grad(loss))``: rewrite the float32 backward pass as a program."""
    return jmp_rewrite.rewrite(jax.grad(c.loss, has_aux=True), dtype=dtype, lists=lists)


@functools.cache
def results(name: str, dtype_name: str) -> dict[str, Any]:
    """Gradients and forward results of both orders, from one jitted program per order."""
    c = case(name)
    dtype = HALF[dtype_name]
    outer_grads, outer_aux = run(grad_of_rewrite(c, dtype), *c.args)
    inner_grads, inner_aux = run(rewrite_of_grad(c, dtype), *c.args)
    return {
        "grad(rewrite)": (outer_grads, outer_aux),
        "rewrite(grad)": (inner_grads, inner_aux),
    }


def bf16_lists_with_float32_sums() -> Any:
    """The bfloat16 lists with ``reduce_sum`` denied, as in the float16 lists."""
    return jmp_rewrite.default_lists(BF16).move("reduce_sum", "deny")


CASES = [pytest.param(m, d, id=f"{m}-{d}") for m in MODELS for d in HALF]
ORDERS = ("grad(rewrite)", "rewrite(grad)")

# ------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model,dtype_name", CASES)
@pytest.mark.parametrize("order", ORDERS)
def test_forward_within_half_precision_tolerance(model, dtype_name, order):
    """Logits and updated batch statistics, from the forward pass of each program."""
    c = case(model)
    _, (logits, stats) = results(model, dtype_name)[order]
    ref_logits, ref_stats = c.ref_aux
    assert signature((logits, stats)) == signature((ref_logits, ref_stats))
    assert np.all(np.isfinite(logits))
    err = rel_err(ref_logits, logits)
    assert err <= FWD_TOL[dtype_name], f"logits: relative error {err:.2e}"
    # Not bit-identical: the program really ran in half precision.
    assert err > 0.05 * UNIT_ROUNDOFF[dtype_name]
    if jax.tree.leaves(ref_stats):  # batch norm's running mean/var: float32 outputs
        stats_err = rel_err(ref_stats, stats)
        assert stats_err <= FWD_TOL[dtype_name], f"batch stats: relative error {stats_err:.2e}"


# ------------------------------------------------------------------------------------------
# Gradients
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model,dtype_name", CASES)
@pytest.mark.parametrize("order", ORDERS)
def test_gradients_within_half_precision_tolerance(model, dtype_name, order):
    c = case(model)
    grads, _ = results(model, dtype_name)[order]

    # Same tree, shapes and float32 dtypes as the parameters: master weights, float32 grads.
    assert signature(grads) == signature(c.args[0])
    assert all(np.dtype(g.dtype) == F32 for g in jax.tree.leaves(grads))
    assert np.all(np.isfinite(flat(grads)))
    err = rel_err(c.ref_grads, grads)
    assert err <= GRAD_TOL[dtype_name], f"whole gradient: relative error {err:.2e}"
    assert err > 0.05 * UNIT_ROUNDOFF[dtype_name]  # the backward pass did run in half
    leaf, leaf_err = worst_leaf_err(c.ref_grads, grads)
    assert leaf_err <= LEAF_TOL[dtype_name], f"{leaf}: relative error {leaf_err:.2e}"


def test_cnn_bf16_within_tolerance_with_float32_sums():
    """The CNN in bfloat16 is within tolerance with reduce_sum denied too (the TF-fused-op
    parity setting for sums)."""
    c = case("cnn")
    lists = bf16_lists_with_float32_sums()
    fun = grad_of_rewrite(c, BF16, lists)
    grads, (logits, stats) = run(fun, *c.args)
    assert rel_err(c.ref_aux[0], logits) <= FWD_TOL["bfloat16"]
    assert rel_err(c.ref_aux[1], stats) <= FWD_TOL["bfloat16"]
    assert rel_err(c.ref_grads, grads) <= GRAD_TOL["bfloat16"]
    assert worst_leaf_err(c.ref_grads, grads)[1] <= LEAF_TOL["bfloat16"]
    convs = matmuls(jax.make_jaxpr(fun)(*c.args))
    assert convs and all(operand_dtypes(e) == [BF16, BF16] for e in convs)


def test_bf16_reduce_sum_accumulates_in_float32(leak_checking):
    """Minimal repro: batch norm's sum over batch and space (2048 values per channel),
    painted bfloat16, should accumulate in float32 as ``jnp.sum`` does for bfloat16 input,
    and be off by ~u, not by tens of percent. Called eagerly, as ``rewrite``'s result
    usually is: under ``jax.jit`` XLA:CPU happens to split this particular reduction into
    a tree and gets ~u, but not batch norm's in the CNN above."""

    def f(w, x):
        return jnp.sum(x @ w, axis=(0, 1, 2))

    w = jnp.eye(8)
    x = jnp.asarray(np.random.default_rng(0).uniform(1.0, 3.0, (8, 16, 16, 8)), jnp.float32)
    painting = jmp_rewrite.paint(f, w, x, dtype=BF16)
    assert painting.colours("reduce_sum") == ["allow"]  # TF's oneDNN lists: Sum is infer
    hand = jnp.sum(x.astype(BF16) @ w.astype(BF16), axis=(0, 1, 2))  # f32 accumulator
    assert rel_err(f(w, x), hand) <= UNIT_ROUNDOFF["bfloat16"]
    got = jmp_rewrite.rewrite(f, dtype=BF16)(w, x)
    assert rel_err(f(w, x), got) <= UNIT_ROUNDOFF["bfloat16"]  # was 0.75 with a bf16 sum


# ------------------------------------------------------------------------------------------
# Structure of the emitted programs
# ------------------------------------------------------------------------------------------


def programs(c: Case, dtype: Any) -> dict[str, tuple[Callable[..., Any], Callable[..., Any]]]:
    """name -> (rewritten function, float32 original), all taking ``c.args``."""
    apply = lambda p, r, x, y: c.apply(p, r, x)
    return {
        "forward": (jmp_rewrite.rewrite(apply, dtype=dtype), apply),
        "grad(rewrite)": (grad_of_rewrite(c, dtype), jax.grad(c.loss, has_aux=True)),
        "rewrite(grad)": (rewrite_of_grad(c, dtype), jax.grad(c.loss, has_aux=True)),
    }


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dtype_name", HALF)
@pytest.mark.parametrize("program", ["forward", *ORDERS])
def test_every_matmul_and_conv_runs_in_half(model, dtype_name, program):
    c = case(model)
    half = HALF[dtype_name]
    rewritten, original = programs(c, half)[program]
    new = jax.make_jaxpr(rewritten)(*c.args)
    old = jax.make_jaxpr(original)(*c.args)

    new_mm, old_mm = matmuls(new), matmuls(old)
    expected = MODELS[model][2] if program == "forward" else MODELS[model][3]
    assert len(old_mm) == expected
    assert sorted(e.primitive.name for e in new_mm) == sorted(e.primitive.name for e in old_mm)
    for eqn in new_mm:
        assert operand_dtypes(eqn) == [half, half], (eqn.primitive.name, operand_dtypes(eqn))
        assert all(np.dtype(v.aval.dtype) == half for v in eqn.outvars)
    if model == "cnn":
        assert any(e.primitive.name == "conv_general_dilated" for e in new_mm)

    # Same results signature as the float32 program; the function's own inputs untouched.
    assert [v.aval for v in new.jaxpr.outvars] == [v.aval for v in old.jaxpr.outvars]
    assert [v.aval for v in new.jaxpr.invars] == [v.aval for v in old.jaxpr.invars]
    assert all(np.dtype(v.aval.dtype) != half for v in new.jaxpr.outvars)


@pytest.mark.parametrize("dtype_name", HALF)
def test_normalisation_statistics_painting(dtype_name):
    """Layer norm statistics (mean and E[x^2]: reduce_sum) stay float32 in both dtypes
    (``keep_normalization_statistics_float32``, as TF's FusedBatchNorm keeps U=float);
    softmax's sum follows exp (deny). The pooling mean is deny in float16 (Sum), and in
    bfloat16, whose oneDNN lists make Sum infer, follows the half-precision matmuls."""
    c = case("transformer")
    params, rest, x, _ = c.args
    painting = jmp_rewrite.paint(c.apply, params, rest, x, dtype=HALF[dtype_name])
    assert painting.changed
    assert painting.colours("dot_general") == ["allow"] * MODELS["transformer"][2]
    sums = painting.colours("reduce_sum")
    pooling = "deny" if dtype_name == "float16" else "allow"
    assert sums == ["float32", "float32", "deny", "float32", "float32", pooling]
    stats = [e for e in painting.find("reduce_sum") if e.colour == "float32"]
    assert all(e.painted_by == "keep_normalization_statistics_float32" for e in stats)
    assert [e.colour for e in painting.find("rsqrt")] == ["float32"] * 2
