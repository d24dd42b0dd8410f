"""Issue 24: shape-polymorphic programs (``jax.export`` with symbolic dimensions).

Serving exports a rewritten model once with a symbolic batch (``symbolic_shape("b, 16")``) and
calls it at any batch. Every decision the painter, the emitter and ``explain`` take from
shapes goes through ``jmp_rewrite._src.trace.shapes``, which decides from the structure when a
comparison of symbolic dimensions is inconclusive, never by raising. Checked here:

* the helpers themselves, on the inconclusive cases;
* the README's models and a small transformer (symbolic batch and sequence length), forward
  and ``grad(rewrite(f))``, and whole rewritten train steps with the loss-scale optimizer:
  exported, serialized, deserialized and called at batch 1, 7 and 32, against float32
  within half-precision tolerance and against the rewrite traced at that concrete size;
  float16 and bfloat16;
* the rewrite decides the same with symbolic shapes as with concrete ones: the same
  equations run in half precision (per primitive, backward pass included);
* generated programs (the building blocks of ``tests/test_invariants.py``, plus a scan over
  the symbolic batch) traced with a symbolic batch;
* ``explain`` on a function traced with symbolic shapes: FLOPs and bytes as expressions.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_invariants as ti
from hypothesis import HealthCheck, Phase, given, settings
from jax import lax
from jaxpr_walk import HALF, all_eqns

import jmp_rewrite
from jmp_rewrite._src.trace import shapes

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

F16, BF16 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16)
DTYPES = pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
SIZES = (1, 7, 32)
#: ||rewritten - float32|| / ||float32|| allowed, per dtype (measured: see each test).
TOL = {F16: 1e-2, BF16: 6e-2}
#: ... and against the rewrite traced at the concrete size (the same program, compiled for a
#: symbolic or a known batch: XLA may fuse and so round differently).
SAME = {F16: 2e-3, BF16: 1.6e-2}
SCOPE = jax.export.SymbolicScope()  # one per program: its specs share their symbols
(B,) = jax.export.symbolic_shape("b", scope=SCOPE)


def sym(spec: str, dtype: Any = jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jax.export.symbolic_shape(spec, scope=SCOPE), dtype)


def rel(a: Any, b: Any) -> float:
    la = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(a)]
    lb = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(b)]
    da, db = np.concatenate(la), np.concatenate(lb)
    return float(np.linalg.norm(da - db) / max(np.linalg.norm(db), 1e-30))


def export_roundtrip(fun: Callable[..., Any], *specs: Any) -> Callable[..., Any]:
    """``fun`` exported at ``specs`` (pytrees of arrays / ShapeDtypeStructs), serialized and
    deserialized: the callable a server would load. Pytrees travel flattened (optax states
    are namedtuples, which serialization would need registered)."""
    leaves, tree = jax.tree.flatten(specs)
    out_tree = []

    def flat(*xs):
        out = fun(*jax.tree.unflatten(tree, xs))
        out_leaves, t = jax.tree.flatten(out)
        out_tree.append(t)
        return out_leaves

    exported = jax.export.export(jax.jit(flat))(*leaves)
    loaded = jax.export.deserialize(exported.serialize())
    assert str(loaded.in_avals) == str(exported.in_avals)  # symbolic: their own scope
    return lambda *args: jax.tree.unflatten(out_tree[0], loaded.call(*jax.tree.leaves(args)))


def half_counts(fun: Callable[..., Any], *args: Any) -> collections.Counter:
    """Equations (sub-jaxprs included) with a half-precision output, per primitive. Casts
    are left out: a mean over a symbolic axis divides by a computed dimension, cast like any
    value, where a known one is a literal converted in place."""
    jaxpr = jax.make_jaxpr(fun)(*args)
    return collections.Counter(
        e.primitive.name
        for e in all_eqns(jaxpr)
        if e.primitive.name != "convert_element_type"
        and any(getattr(v.aval, "dtype", None) in HALF for v in e.outvars)
    )


def concrete(specs: Any, n: int) -> Any:
    """``specs`` with every symbolic dimension set to ``n`` (as ShapeDtypeStructs)."""

    def one(s):
        if not isinstance(s, jax.ShapeDtypeStruct):
            return s
        shape = tuple(d if shapes.is_static(d) else n for d in s.shape)
        return jax.ShapeDtypeStruct(shape, s.dtype)

    return jax.tree.map(one, specs)


# ------------------------------------------------------------------------------------------
# The helpers, on the comparisons JAX cannot decide
# ------------------------------------------------------------------------------------------


def test_size_less_decides_broadcasts_from_the_structure():
    # The issue's comparison: '64*b' > '64' is inconclusive (equal at b = 1).
    with pytest.raises(jax.errors.InconclusiveDimensionOperation):
        bool(64 < 64 * B)
    assert shapes.size_less((1, 64), (B, 64))  # a bias row broadcast over the batch
    assert shapes.size_less((64,), (B, 64))  # fewer dimensions
    assert shapes.size_less((B, 1), (B, 64))  # decided by JAX: 64*b - b > 0
    assert not shapes.size_less((B, 64), (B, 64))
    assert not shapes.size_less((B, 64), (1, 64))
    (t,) = jax.export.symbolic_shape("t", scope=SCOPE)
    assert shapes.size_less((1, t, 16), (B, t, 16))
    assert not shapes.size_less((B, 1, 16), (1, t, 16))  # neither is smaller for every b, t
    assert shapes.size_less((2, 3), (4, 3)) and not shapes.size_less((4, 3), (2, 3))


def test_counts_and_decisions_on_symbolic_dimensions():
    assert shapes.is_zero(0) and shapes.is_zero(B - B) and shapes.is_zero(np.int64(0))
    assert not shapes.is_zero(B) and not shapes.is_zero(B - 1) and not shapes.is_zero(3)
    assert shapes.static_size((3, 4)) == 12 and shapes.static_size((B, 4)) is None
    assert shapes.size((B, 4, 2)) == 8 * B and shapes.dim(np.int64(5)) == 5
    assert shapes.multiple_of(8 * B, 8) is True and shapes.multiple_of(16, 8) is True
    assert shapes.multiple_of(10, 8) is False and shapes.multiple_of(B, 8) is None
    assert shapes.ratio(3, 4) == 0.75 and shapes.ratio(0, 0) is None
    assert shapes.ratio(64 * B, 64 * B) == 1.0 and shapes.ratio(0, 64 * B) == 0.0
    assert shapes.ratio(64 * B, 64 * B + 3) is None  # depends on b
    order = sorted([5, 64 * B, 100, B], key=shapes.descending)
    assert order[2:] == [100, 5] and {str(x) for x in order[:2]} == {"b", "64*b"}
    assert shapes.fmt(1234567) == "1,234,567" and shapes.fmt(64 * B + 3) == "64*b + 3"
    assert json.dumps(shapes.jsonable({"s": ((B, 4), [2 * B]), "n": 3, "x": None})) == (
        '{"s": [["b", 4], ["2*b"]], "n": 3, "x": null}'
    )


# ------------------------------------------------------------------------------------------
# Models: the issue's, the README's, a small transformer
# ------------------------------------------------------------------------------------------


def _normal(seed: int, shape: tuple[int, ...], scale: float = 1.0) -> jax.Array:
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def issue_mlp() -> tuple[Callable, Any, Any, Callable]:
    """The issue's reproduction: two Dense layers with biases, tanh, log_softmax."""

    def f(params, x):
        for i, layer in enumerate(params):
            x = x @ layer["w"] + layer["b"]
            if i < len(params) - 1:
                x = jnp.tanh(x)
        return jax.nn.log_softmax(x, -1)

    params = [
        {"w": _normal(0, (16, 64), 0.25), "b": _normal(1, (64,), 0.1)},
        {"w": _normal(2, (64, 10), 0.25), "b": _normal(3, (10,), 0.1)},
    ]
    return f, params, sym("b, 16"), lambda n: _normal(n, (n, 16))


def readme_example() -> tuple[Callable, Any, Any, Callable]:
    """README "Example": a relu MLP's softmax cross-entropy with integer labels."""

    def loss(params, batch):
        x, y = batch
        h = jax.nn.relu(x @ params["w1"])
        return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"], y).mean()

    params = {"w1": _normal(4, (64, 32), 0.15), "w2": _normal(5, (32, 10), 0.15)}
    spec = (sym("b, 64"), sym("b", jnp.int32))
    return loss, params, spec, lambda n: (_normal(n, (n, 64)), jnp.arange(n, dtype=jnp.int32) % 10)


class LinenCNN(nn.Module):
    """README "Port a Flax example": a Linen CNN with BatchNorm."""

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(16, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.relu(x).reshape(x.shape[0], -1)
        return nn.Dense(10)(x)


def linen_cnn() -> tuple[Callable, Any, Any, Callable]:
    """Training mode: the batch statistics come back beside the logits."""
    model = LinenCNN()
    variables = model.init(jax.random.key(0), jnp.ones((2, 8, 8, 1)), train=False)

    def f(variables, x):
        logits, updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
        return logits, updates["batch_stats"]

    return f, variables, sym("b, 8, 8, 1"), lambda n: _normal(n, (n, 8, 8, 1))


class Transformer(nn.Module):
    """A pre-norm causal self-attention block and an MLP, mean-pooled to logits."""

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        h = x + nn.SelfAttention(num_heads=2, qkv_features=16)(nn.LayerNorm()(x), mask=mask)
        h = h + nn.Dense(16)(nn.gelu(nn.Dense(32)(nn.LayerNorm()(h))))
        return nn.Dense(10)(h.mean(1))


def transformer() -> tuple[Callable, Any, Any, Callable]:
    """Symbolic batch and sequence length."""
    model = Transformer()
    params = model.init(jax.random.key(1), jnp.ones((2, 5, 16)))
    return model.apply, params, sym("b, t, 16"), lambda n: _normal(n, (n, n + 3, 16))


def equinox_mlp() -> tuple[Callable, Any, Any, Callable]:
    """README "Equinox": ``eqx.nn.MLP`` under ``jax.vmap`` (its array leaves exported)."""
    import equinox as eqx

    mlp = eqx.nn.MLP(in_size=16, out_size=10, width_size=32, depth=2, key=jax.random.key(2))
    arrays, static = eqx.partition(mlp, eqx.is_array)

    def f(arrays, x):
        return jax.vmap(eqx.combine(arrays, static))(x)

    return f, arrays, sym("b, 16"), lambda n: _normal(n, (n, 16))


def nnx_cnn() -> tuple[Callable, Any, Any, Callable]:
    """README "Flax NNX": Conv, BatchNorm (batch statistics), Linear; split and merged."""
    from flax import nnx

    class CNN(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(1, 16, (3, 3), rngs=rngs)
            self.bn = nnx.BatchNorm(16, rngs=rngs)
            self.linear = nnx.Linear(16 * 8 * 8, 10, rngs=rngs)

        def __call__(self, x):
            x = nnx.relu(self.bn(self.conv(x)))
            return self.linear(x.reshape(x.shape[0], -1))

    graphdef, state = nnx.split(CNN(nnx.Rngs(0)))

    def f(state, x):
        model = nnx.merge(graphdef, state)
        return model(x), nnx.state(model, nnx.BatchStat)

    return f, state, sym("b, 8, 8, 1"), lambda n: _normal(n, (n, 8, 8, 1))


MODELS = {
    "issue_mlp": issue_mlp,
    "readme_example": readme_example,
    "linen_cnn": linen_cnn,
    "transformer": transformer,
    "equinox_mlp": equinox_mlp,
    "nnx_cnn": nnx_cnn,
}


def _loss_of(f: Callable) -> Callable:
    """A scalar of every float output (the mean square), to differentiate."""

    def loss(params, x):
        outs = [o for o in jax.tree.leaves(f(params, x)) if jnp.issubdtype(o.dtype, jnp.floating)]
        return sum(jnp.mean(jnp.square(o)) for o in outs)

    return loss


def _versions(f: Callable, dtype: Any, mode: str) -> tuple[Callable, Callable]:
    """(float32, rewritten): the model, or ``grad`` of a loss of it (``grad(rewrite(f))``)."""
    if mode == "forward":
        return f, jmp_rewrite.rewrite(f, dtype=dtype)
    return jax.grad(_loss_of(f)), jax.grad(_loss_of(jmp_rewrite.rewrite(f, dtype=dtype)))


def _model_cases() -> list[Any]:
    """Every model in both modes and both dtypes, except that the three that take longest to
    compile (convolutions, attention) run each mode in one dtype: each dtype and mode is
    still covered by those models as a family, at half the time."""
    cheap = [(m, mode, d) for m in MODELS if m not in _HEAVY for mode in MODES for d in (F16, BF16)]
    heavy = [(m, mode, d) for m, cases in _HEAVY.items() for mode, d in cases]
    return [pytest.param(*c, id=f"{c[0]}-{c[1]}-{np.dtype(c[2]).name}") for c in cheap + heavy]


MODES = ("forward", "grad")
_HEAVY = {
    "linen_cnn": (("forward", F16), ("grad", BF16)),
    "nnx_cnn": (("forward", BF16), ("grad", F16)),
    "transformer": (("forward", F16), ("grad", BF16)),
}


@pytest.mark.parametrize(("model", "mode", "dtype"), _model_cases())
def test_exported_model_matches_float32_at_every_size(model, mode, dtype):
    """Exported once with a symbolic batch (and sequence length), serialized and reloaded,
    called at batch 1, 7 and 32: the float32 result within half-precision tolerance, the
    result of the rewrite traced at that size, float32 outputs, and the same equations in
    half precision as with concrete shapes."""
    f, params, spec, make_x = MODELS[model]()
    ref_fn, new_fn = _versions(f, dtype, mode)
    served = export_roundtrip(new_fn, params, spec)
    for n in SIZES:
        x = make_x(n)
        got, ref = served(params, x), jax.jit(ref_fn)(params, x)
        assert jax.tree.structure(got) == jax.tree.structure(ref)
        for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
            assert g.dtype == r.dtype and g.shape == r.shape
        assert rel(got, ref) <= TOL[dtype], (n, rel(got, ref))
        if n == 7:  # the rewrite traced at this size computes the same
            traced = jax.jit(new_fn)(params, x)
            assert rel(got, traced) <= SAME[dtype], rel(got, traced)


def _loops(trips: int) -> dict[str, Callable]:
    """Loops with literal bounds whose carries have a symbolic batch the condition never reads
    (the rewrite evaluates such a condition to learn whether the loop runs at all)."""

    def body(c):
        i, h, w = c
        return i + 1, jnp.tanh(h @ w), w

    return {
        "while": lambda h, w: lax.while_loop(lambda c: c[0] < trips, body, (0, h, w))[1],
        "while_from_literal_carry": lambda h, w: lax.while_loop(
            lambda c: c[0] < trips, body, (jnp.int32(0), h * 2.0, w)
        )[1],
        "fori_loop": lambda h, w: lax.fori_loop(0, trips, lambda i, h: jnp.tanh(h @ w), h),
        "scan": lambda h, w: lax.scan(lambda h, _: (jnp.tanh(h @ w), None), h, length=trips)[0],
    }


@DTYPES
@pytest.mark.parametrize("trips", [0, 3])
@pytest.mark.parametrize("loop", sorted(_loops(0)))
def test_loops_with_literal_bounds_over_symbolic_carries(loop, trips, dtype):
    """Exported with a symbolic batch: a loop that never runs hands its carry on exactly, one
    that runs is within half-precision tolerance, at batch 1 and 7; its matmul runs in half."""
    f = _loops(trips)[loop]
    w = _normal(1, (16, 16), 0.25)
    served = export_roundtrip(jmp_rewrite.rewrite(f, dtype=dtype), sym("b, 16"), w)
    for n in (1, 7):
        h = _normal(n, (n, 16))
        got, ref = served(h, w), jax.jit(f)(h, w)
        assert got.dtype == jnp.float32 and got.shape == (n, 16)
        if trips == 0:
            np.testing.assert_array_equal(got, ref)
        else:
            assert rel(got, ref) <= TOL[dtype], (n, rel(got, ref))
    if trips:
        assert half_counts(jmp_rewrite.rewrite(f, dtype=dtype), sym("b, 16"), w)["dot_general"]


@jax.custom_vjp
def _tanh_layer_and_argmax(x, w):
    y = jnp.tanh(x @ w)
    return y, jnp.argmax(y, -1)


def _tanh_layer_fwd(x, w):
    out = _tanh_layer_and_argmax(x, w)
    return out, (x, w, out[0])


def _tanh_layer_bwd(res, cts):
    x, w, y = res
    g = cts[0] * (1 - y**2)  # cts[1]: the integer output's float0 zeros
    return g @ w.T, x.T @ g


_tanh_layer_and_argmax.defvjp(_tanh_layer_fwd, _tanh_layer_bwd)


@jax.custom_jvp
def _softplus_and_sign(x):
    return jax.nn.softplus(x), (x > 0).astype(jnp.int32)


@_softplus_and_sign.defjvp
def _softplus_and_sign_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    y, s = _softplus_and_sign(x)
    # float0 zeros of a symbolic shape: a broadcast scalar (no numpy array has that shape)
    return (y, s), (jax.nn.sigmoid(x) * dx, lax.broadcast(np.zeros((), jax.dtypes.float0), s.shape))


def _custom_rule_losses() -> dict[str, Callable]:
    def vjp_loss(w, x):
        y, i = _tanh_layer_and_argmax(x, w)
        return jnp.sum(y * (i[:, None] + 1.0))

    def jvp_loss(w, x):
        y, s = _softplus_and_sign(x @ w)
        return jnp.sum(y * s)

    return {"custom_vjp": vjp_loss, "custom_jvp": jvp_loss}


@DTYPES
@pytest.mark.parametrize("order", ["grad(rewrite)", "rewrite(grad)"])
@pytest.mark.parametrize("rule", sorted(_custom_rule_losses()))
def test_custom_rules_with_an_integer_output_at_a_symbolic_batch(rule, order, dtype):
    """A custom derivative rule whose function also returns an integer (an argmax, a sign):
    its zero cotangent is made at the symbolic batch (float0 zeros, as JAX's own), exported
    and called at batch 1 and 7 within tolerance of float32's gradient."""
    loss = _custom_rule_losses()[rule]
    if order == "grad(rewrite)":
        new_fn = jax.grad(jmp_rewrite.rewrite(loss, dtype=dtype))
    else:
        new_fn = jmp_rewrite.rewrite(jax.grad(loss), dtype=dtype)
    w = _normal(1, (16, 16), 0.25)
    served = export_roundtrip(new_fn, w, sym("b, 16"))
    for n in (1, 7):
        x = _normal(n, (n, 16))
        got, ref = served(w, x), jax.jit(jax.grad(loss))(w, x)
        assert got.dtype == jnp.float32 and rel(got, ref) <= TOL[dtype], (n, rel(got, ref))


def test_export_under_the_tracer_leak_check(leak_checking):
    """The module runs without ``jax_check_tracer_leaks`` (it recompiles every call); one
    export of ``grad(rewrite(f))`` at a symbolic batch runs under it."""
    f, params, spec, make_x = MODELS["issue_mlp"]()
    ref_fn, new_fn = _versions(f, F16, "grad")
    x = make_x(3)
    got, ref = export_roundtrip(new_fn, params, spec)(params, x), ref_fn(params, x)
    assert rel(got, ref) <= TOL[F16], rel(got, ref)


@DTYPES
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_symbolic_shapes_paint_as_concrete_ones(model, mode, dtype):
    """The rewrite takes the same decisions at a symbolic batch as at a known one: the same
    equations run in half precision, per primitive, the backward pass's included (a bias
    broadcast over a symbolic batch gets its float32 tangent rule as over a known one)."""
    f, params, spec, _ = MODELS[model]()
    _, new_fn = _versions(f, dtype, mode)
    symbolic = half_counts(new_fn, params, spec)
    assert symbolic == half_counts(new_fn, params, concrete(spec, 7))
    assert symbolic["dot_general"] + symbolic["conv_general_dilated"] >= 2


# ------------------------------------------------------------------------------------------
# Whole train steps with the loss-scale optimizer
# ------------------------------------------------------------------------------------------


def readme_train_step() -> tuple[Callable, Any, Any, Callable]:
    """README "Example": value_and_grad of the scaled loss, loss-scale optimizer (Adam)."""
    loss, params, spec, make_batch = readme_example()
    tx = jmp_rewrite.loss_scale_optimizer(optax.adam(1e-2))

    def step(state, batch):
        params, opt_state = state
        value, grads = jmp_rewrite.value_and_grad(loss)(opt_state, params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    return step, (params, tx.init(params)), spec, make_batch


def linen_train_step() -> tuple[Callable, Any, Any, Callable]:
    """README "Port a Flax example": the Linen CNN's train step (SGD with momentum,
    batch statistics updated beside the parameters)."""
    model = LinenCNN()
    variables = model.init(jax.random.key(0), jnp.ones((2, 8, 8, 1)), train=False)
    params, stats = variables["params"], variables["batch_stats"]
    # 2**15 overflows float16 in the BatchNorm backward of one example (8 x 8 pixels): that
    # first step is skipped, as loss scaling does, where the float32 step is not.
    scale = jmp_rewrite.DynamicLossScale(initial_loss_scale=2.0**10)
    tx = jmp_rewrite.loss_scale_optimizer(optax.sgd(0.05, momentum=0.9), scale)

    def step(state, batch):
        params, stats, opt_state = state
        x, y = batch

        def loss_fn(params):
            logits, updates = model.apply(
                {"params": params, "batch_stats": stats}, x, train=True, mutable=["batch_stats"]
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return loss, updates["batch_stats"]

        (value, stats), grads = jmp_rewrite.value_and_grad(loss_fn, has_aux=True)(opt_state, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), stats, opt_state), value

    spec = (sym("b, 8, 8, 1"), sym("b", jnp.int32))
    make = lambda n: (_normal(n, (n, 8, 8, 1)), jnp.arange(n, dtype=jnp.int32) % 10)  # noqa: E731
    return step, (params, stats, tx.init(params)), spec, make


TRAIN_STEPS = {"readme_example": readme_train_step, "linen_cnn": linen_train_step}


def _floats(tree: Any) -> list[jax.Array]:
    """The float arrays of ``tree``, less scalars (the loss scale would dwarf the moments)."""
    return [a for a in jax.tree.leaves(tree) if jnp.issubdtype(a.dtype, jnp.floating) and a.ndim]


@DTYPES
@pytest.mark.parametrize("name", sorted(TRAIN_STEPS))
def test_exported_train_step_with_loss_scale_optimizer(name, dtype):
    """A whole rewritten train step exported with a symbolic batch: at batch 1, 7 and 32 the
    step's loss, new parameters, optimizer moments and statistics match the float32 step's;
    the loss scale is kept and the step applied. A batch with an infinity: the step is
    skipped (parameters bit for bit as they were) and the loss scale halved."""
    step, state, spec, make_batch = TRAIN_STEPS[name]()
    served = export_roundtrip(jmp_rewrite.rewrite(step, dtype=dtype), state, spec)
    reference = jax.jit(step)
    scale = float(jmp_rewrite.get_loss_scale(state[-1]))
    for n in SIZES:
        batch = make_batch(n)
        (new, value), (ref, ref_value) = served(state, batch), reference(state, batch)
        assert abs(float(value) - float(ref_value)) <= TOL[dtype] * abs(float(ref_value))
        # The optimizer state holds the gradients (Adam's moments, SGD's momentum trace).
        for i, (a, r) in enumerate(zip(new, ref, strict=True)):
            assert rel(_floats(a), _floats(r)) <= 2 * TOL[dtype], (n, i, rel(a, r))
        assert bool(jmp_rewrite.last_step_applied(new[-1]))
        assert float(jmp_rewrite.get_loss_scale(new[-1])) == scale
    x, y = make_batch(7)
    (skipped, _) = served(state, (x.at[3].set(jnp.inf), y))
    assert not bool(jmp_rewrite.last_step_applied(skipped[-1]))
    assert float(jmp_rewrite.get_loss_scale(skipped[-1])) == scale / 2
    for a, b in zip(jax.tree.leaves(skipped[0]), jax.tree.leaves(state[0]), strict=True):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------------------------------
# Generated programs with a symbolic batch (tests/test_invariants.py's building blocks)
# ------------------------------------------------------------------------------------------

#: The blocks of tests/test_invariants.py whose shapes follow the batch (``mask``, ``scatter``
#: and ``embed`` use constants of its fixed batch), and ``rows``: a scan over the batch's rows
#: (a running state), so the trip count is symbolic.
SYMBOLIC_FEATURES = ("copy", "ema", "carry", "rows")


def _rows_block(blk: Any) -> Callable[[jax.Array, dict[str, Any]], Any]:
    def rows(h, p):
        def body(c, row):
            c = 0.9 * c + 0.1 * jnp.tanh(row @ p["w"][blk.weight] + p["b"])
            return c, c * row

        c, ys = lax.scan(body, jnp.zeros_like(p["b"]), h)
        return ys @ p["w"][(blk.weight + 1) % 3], {"rows_state": c}

    return rows


#: tests/test_invariants.py's losses; ``h[:, 0]`` is a gather at a symbolic batch (a slice at
#: a known one), so the first column is taken with ``index_in_dim``, a slice at both.
LOSSES: dict[str, Callable[[jax.Array], jax.Array]] = {
    "mean_square": ti.LOSSES["mean_square"],
    "logsumexp": lambda h: jnp.mean(
        jax.nn.logsumexp(h, axis=-1) - lax.index_in_dim(h, 0, 1, keepdims=False)
    ),
}


def build_symbolic(program: Any) -> Callable[[dict[str, Any]], dict[str, jax.Array]]:
    """``tests/test_invariants.py``'s ``build``, with the ``rows`` block."""

    def forward(p):
        h, outs = p["x"], {}
        for i, blk in enumerate(program.blocks):
            fn = _rows_block(blk) if blk.kind == "rows" else ti._block_fn(i, blk)
            for wrapper in blk.wrappers:
                fn = ti._wrap(fn, wrapper)
            h, o = fn(h, p)
            outs.update(o)
        outs["h"] = h @ p["w"][2] if program.final_dense else h
        return outs

    def fun(p):
        outs = forward(p)
        if program.loss is not None:
            loss = lambda t: LOSSES[program.loss](forward({**p, **t})["h"])  # noqa: E731
            grads = jax.grad(loss)({"w": p["w"], "b": p["b"]})
            outs.update({f"grad_w{j}": g for j, g in enumerate(grads["w"])})
            outs["grad_b"] = grads["b"]
        return outs

    return jax.jit(fun) if program.outer_jit else fun


@st.composite
def symbolic_programs(draw: Any, grad: bool) -> Any:
    """1 to 3 of :data:`SYMBOLIC_FEATURES`, each optionally after a dense layer."""
    loss = draw(st.sampled_from(sorted(LOSSES))) if grad else None
    chosen = []
    for kind in draw(st.permutations(SYMBOLIC_FEATURES))[: draw(st.integers(1, 3))]:
        if draw(st.booleans()):
            chosen.append(draw(ti.blocks("dense")))
        if kind == "rows":
            wrappers = tuple(draw(st.lists(st.sampled_from(["jit", "checkpoint"]), max_size=1)))
            chosen.append(ti.Block("rows", draw(st.integers(0, 2)), None, wrappers))
        else:
            chosen.append(draw(ti.blocks(kind, grad)))
    return ti.Program(
        blocks=tuple(chosen),
        final_dense=draw(st.booleans()),
        outer_jit=draw(st.booleans()),
        loss=loss,
        seed=draw(st.integers(0, 1000)),
    )


def _inputs(program: Any, n: int) -> dict[str, Any]:
    p = program.inputs(0)
    p["x"] = _normal(program.seed + n, (n, ti.D))
    return p


@DTYPES
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "grad"])
@settings(
    max_examples=3,
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_generated_programs_with_a_symbolic_batch(dtype, grad, data):
    """A generated program, rewritten and exported with a symbolic batch, serialized and
    reloaded: the same equations in half precision as traced at a known batch, and at batch
    1 and 8 the invariants of tests/test_invariants.py against the rewrite traced at that
    size (copies bit-exact, finite stays finite, loop state within u / 4 of float32, no
    further from float32 than 1.5 x the concrete rewrite + 4 ulp)."""
    program = data.draw(symbolic_programs(grad), label="program")
    fun = build_symbolic(program)
    rewritten = jmp_rewrite.rewrite(fun, dtype=dtype)
    spec = {**_inputs(program, 8), "x": sym("b, 16")}
    assert half_counts(rewritten, spec) == half_counts(rewritten, _inputs(program, 8))
    served = export_roundtrip(rewritten, spec)
    u = ti.UNIT_ROUNDOFF[dtype]
    for n in (1, 8):
        p = _inputs(program, n)
        got, ref, traced = served(p), jax.jit(fun)(p), jax.jit(rewritten)(p)
        for name, r in ref.items():
            y, t = got[name], traced[name]
            assert y.dtype == r.dtype and y.shape == r.shape, name
            if name in program.copies():
                np.testing.assert_array_equal(y, r, err_msg=name)
                continue
            rn, yn = ti._np32(r), ti._np32(y)
            assert not (np.isfinite(rn) & ~np.isfinite(yn)).any(), name
            finite = rn[np.isfinite(rn)]
            scale = float(np.linalg.norm(finite)) or 1.0
            if name in program.states():
                assert ti._error(y, r) <= ti.I4_FRACTION * u * scale, name
            atol = ti.I2_ULPS * u * (float(np.max(np.abs(finite))) if finite.size else 0.0)
            assert ti._error(y, r) <= ti.I2_FACTOR * ti._error(t, r) + atol, (n, name)


# ------------------------------------------------------------------------------------------
# explain on symbolic shapes
# ------------------------------------------------------------------------------------------


def _linear_in_b(symbolic: Any, at_1: int, at_2: int) -> None:
    """``symbolic`` is the count ``a*b + c`` that concrete batches 1 and 2 give."""
    a, c = at_2 - at_1, 2 * at_1 - at_2
    assert str(symbolic) == (f"{a}*b + {c}" if c else f"{a}*b"), (symbolic, at_1, at_2)


@pytest.mark.parametrize("wrapped", [False, True], ids=["function", "jit_rewrite"])
def test_explain_counts_symbolic_shapes_as_expressions(wrapped):
    """explain of the issue's model at a symbolic batch: FLOPs and bytes are expressions in
    ``b``, equal to what concrete batches give; the tensor-core lint still names the
    10-wide output; the text, HTML and JSON views render them."""
    f, params, spec, _ = issue_mlp()
    fun = jax.jit(jmp_rewrite.rewrite(f, dtype=F16)) if wrapped else f
    explain = lambda *a: jmp_rewrite.explain(fun, *a, dtype=F16)  # noqa: E731
    r = explain(params, spec)
    r1, r2 = (explain(params, jax.ShapeDtypeStruct((n, 16), jnp.float32)) for n in (1, 2))
    assert r.matmul_flops == 3328 * B and r.half_flops_share == 1.0
    _linear_in_b(r.matmul_flops, r1.matmul_flops, r2.matmul_flops)
    for field in ("residual_bytes_float32", "residual_bytes_rewritten"):
        _linear_in_b(getattr(r, field), getattr(r1, field), getattr(r2, field))
    assert [e.half for e in r.equations] == [e.half for e in r1.equations]
    assert len(r.casts) == len(r1.casts)
    summary = r.summary()
    assert "matmul/conv FLOPs in half precision: 100.0% of 3328*b" in summary
    assert f"{r.residual_bytes_float32} (float32)" in summary
    (finding,) = r.lint()
    assert finding.kind == "tensor_cores" and "output features 10 " in finding.message
    assert "f16[b,64] x f16[64,10]" in finding.message and finding.flops == 1280 * B
    row, row1 = (
        next(line for line in x.format("primitive").splitlines() if line.startswith("dot_"))
        for x in (r, r1)
    )
    assert row.split()[:5] == row1.split()[:5] and row.split()[3] == "100%"
    assert "3328*b" in row
    assert "3328*b" in r.to_html()
    data = json.loads(json.dumps(r.to_dict()))
    assert data["totals"]["half_flops_share"] == 1.0
    dots = [e for e in data["equations"] if e["primitive"] == "dot_general"]
    assert [e["flops"] for e in dots] == ["2048*b", "1280*b"]
    assert dots[0]["in_shapes"] == [["b", 16], [16, 64]]


def test_explain_symbolic_sequence_and_scan_length():
    """A symbolic sequence length: attention's FLOPs grow with t^2, a scan over t multiplies
    its body's FLOPs by t; a symbolic GEMM dimension (t in q @ k^T) is not a tensor-core
    finding (it may be any multiple), a known one (10 classes) is."""
    f, params, spec, _ = transformer()
    r = jmp_rewrite.explain(f, params, spec, dtype=BF16)
    assert "t^2" in str(r.matmul_flops) and r.half_flops_share == 1.0
    findings = [x.message for x in r.lint() if x.kind == "tensor_cores"]
    assert any("output features 10 " in m for m in findings), findings
    assert not any(" t " in m or "features b" in m for m in findings), findings
    assert "(symbolic" not in r.format()

    def rnn(p, xs):
        def body(h, x):
            h = jnp.tanh(x @ p["wx"] + h @ p["wh"])
            return h, h

        return lax.scan(body, jnp.zeros((xs.shape[1], 16)), xs)

    p = {"wx": _normal(0, (16, 16)), "wh": _normal(1, (16, 16))}
    r = jmp_rewrite.explain(rnn, p, sym("t, b, 16"), dtype=F16)
    assert r.matmul_flops == 1024 * B * jax.export.symbolic_shape("t", scope=SCOPE)[0]
    assert {e.trips for e in r.equations if e.primitive == "dot_general"} == {
        jax.export.symbolic_shape("t", scope=SCOPE)[0]
    }


def test_explain_says_when_a_share_depends_on_the_symbols(leak_checking):
    """A train step whose finiteness check stays float32 (a float32 region): the share of
    FLOPs in half precision depends on the batch, and the summary says so, with both
    counts; the JSON has no share."""
    step, state, spec, _ = readme_train_step()
    r = jmp_rewrite.explain(jmp_rewrite.rewrite(step, dtype=F16), state, spec)
    assert r.half_flops_share is None and not shapes.is_static(r.matmul_flops)
    words = r.summary().splitlines()[4]
    assert words.startswith("matmul/conv FLOPs in half precision: ")
    assert "(the share depends on the symbolic dimensions)" in words
    assert str(r.matmul_flops) in words and "in float32 regions" in words
    assert r.to_dict()["totals"]["half_flops_share"] is None
    for g in r.groups("primitive"):
        if g.key == "dot_general":
            assert g.total.half_flops_share is None or g.total.half_flops_share == 1.0
