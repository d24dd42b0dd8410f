"""``dtype=None`` decided where the program is lowered, not on the tracing host (issue 37.3).

One function traced on this CPU machine: a TPU lowering runs its bfloat16 program, a CUDA
lowering its float16 program, a CPU lowering (or any other) the function unchanged. The
exports here are cross-platform (``jax.export(..., platforms=[...])`` needs no TPU or CUDA
plugin); the deviceless XLA:TPU compile needs libtpu (``.venv-tpu``) and is skipped elsewhere.
"""

from __future__ import annotations

import importlib.util
import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jaxpr_walk import lowered_prims, prims

import jmp_rewrite as jr
from jmp_rewrite._src import rewrite as rewrite_lib
from jmp_rewrite._src import settings as settings_lib

pytestmark = [
    pytest.mark.usefixtures("leak_check_only_where_asked"),
    pytest.mark.filterwarnings("ignore::jmp_rewrite.RewriteOffWarning"),
]

RNG = np.random.default_rng(37)
F32, F16, BF16 = np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16)
#: StableHLO's element type names.
SHORT = {F32: "f32", F16: "f16", BF16: "bf16"}
WANT = {"tpu": BF16, "cuda": F16, "cpu": F32, "rocm": F32}


def _arr(*shape):
    return jnp.asarray(RNG.normal(size=shape) / np.sqrt(shape[0]), jnp.float32)


IMG, KERNEL, W1, W2 = _arr(8, 8, 8, 3), _arr(3, 3, 3, 8), _arr(8, 16), _arr(16, 8)


def model(kernel, w1, w2, img):
    """A convolution, then two dense layers: the allowlist ops the lowerings should paint."""
    y = lax.conv_general_dilated(
        img, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    h = jnp.tanh(jnp.mean(jax.nn.relu(y), axis=(1, 2)) @ w1)
    return jnp.sum((h @ w2) ** 2)


ARGS = (KERNEL, W1, W2, IMG)


def _matmul_types(text: str) -> dict[str, list[str]]:
    """The result element types of the dot_generals and convolutions of a StableHLO text."""
    out = {}
    for op in ("dot_general", "convolution"):
        out[op] = re.findall(rf"stablehlo\.{op}\b.*-> tensor<(?:[\d?]+x)*(\w+)>", text)
    return out


def _exported(fun, platforms, *args):
    return jax.export.export(jax.jit(fun), platforms=platforms)(*args)


@pytest.mark.parametrize("platform", ["tpu", "cuda", "cpu"])
def test_one_traced_function_lowers_to_each_platforms_dtype(platform, leak_checking):
    fn = jr.rewrite(model)
    types = _matmul_types(_exported(fn, [platform], *ARGS).mlir_module())
    want = SHORT[WANT[platform]]
    assert types["dot_general"] == [want, want] and types["convolution"] == [want]
    # the float32 reference: the CPU's program is the function's own
    plain = _matmul_types(_exported(model, [platform], *ARGS).mlir_module())
    assert plain == {"dot_general": ["f32"] * 2, "convolution": ["f32"]}


def test_trace_once_lower_for_a_tpu_from_this_cpu_host():
    """MaxText's ``train_compile.py``: trace on the host, lower for the target."""
    traced = jax.jit(jr.rewrite(jax.value_and_grad(model, argnums=(0, 1, 2)))).trace(*ARGS)
    tpu = _matmul_types(traced.lower(lowering_platforms=("tpu",)).as_text())
    here = _matmul_types(traced.lower().as_text())
    assert set(tpu["dot_general"]) == set(tpu["convolution"]) == {"bf16"}
    assert len(tpu["dot_general"]) >= 4  # forward and backward
    assert set(here["dot_general"]) == set(here["convolution"]) == {"f32"}


def test_a_multi_platform_export_keeps_each_platforms_program_and_runs_on_cpu():
    fn = jr.rewrite(model)
    exported = _exported(fn, ["cpu", "tpu", "cuda"], *ARGS)
    assert exported.platforms == ("cpu", "tpu", "cuda")
    assert set(_matmul_types(exported.mlir_module())["dot_general"]) == {"f32", "bf16", "f16"}
    np.testing.assert_array_equal(exported.call(*ARGS), model(*ARGS))


def test_the_cpu_runs_the_function_unchanged_eager_jitted_and_differentiated():
    fn = jr.rewrite(model)
    np.testing.assert_array_equal(fn(*ARGS), model(*ARGS))
    np.testing.assert_array_equal(jax.jit(fn)(*ARGS), jax.jit(model)(*ARGS))
    want = jax.jit(jax.grad(model, argnums=(0, 1, 2)))(*ARGS)
    for grad in (
        jax.grad(jr.rewrite(model), argnums=(0, 1, 2)),  # grad(rewrite(f))
        jr.rewrite(jax.grad(model, argnums=(0, 1, 2))),  # rewrite(grad(f))
    ):
        for got, ref in zip(jax.jit(grad)(*ARGS), want, strict=True):
            np.testing.assert_array_equal(got, ref)
        for got, ref in zip(grad(*ARGS), want, strict=True):  # eager
            np.testing.assert_allclose(got, ref, rtol=1e-6)


@pytest.mark.parametrize("order", ["grad(rewrite(f))", "rewrite(grad(f))"])
def test_both_orders_of_grad_lower_to_the_platforms_dtype(order, leak_checking):
    grad = jax.grad(jr.rewrite(model), argnums=(0, 1, 2))
    if order == "rewrite(grad(f))":
        grad = jr.rewrite(jax.grad(model, argnums=(0, 1, 2)))
    for platform in ("tpu", "cuda", "cpu"):
        types = _matmul_types(_exported(grad, [platform], *ARGS).mlir_module())
        want = SHORT[WANT[platform]]
        assert set(types["dot_general"]) == set(types["convolution"]) == {want}, platform


def test_vmap_keeps_the_choice_to_the_lowering():
    fn = jax.vmap(jr.rewrite(model), in_axes=(None, None, None, 0))
    imgs = jnp.stack([IMG, IMG * 2])
    np.testing.assert_array_equal(
        jax.jit(fn)(*ARGS[:3], imgs), jax.vmap(model, (None,) * 3 + (0,))(*ARGS[:3], imgs)
    )
    closed = jax.make_jaxpr(fn)(*ARGS[:3], imgs)
    for platform, want in WANT.items():
        dots = lowered_prims(closed, "dot_general", platform)
        assert {a.aval.dtype for e in dots for a in e.invars} == {want}, platform


def _signature(closed, platform):
    """The matmuls and casts of ``closed`` as lowered for ``platform``, with their types."""
    return [
        (e.primitive.name, tuple(str(v.aval) for v in e.outvars))
        for e in lowered_prims(closed, "dot_general", platform)
        + lowered_prims(closed, "convert_element_type", platform)
    ]


def test_rewriting_twice_lowers_as_rewriting_once():
    once, twice = jr.rewrite(model), jr.rewrite(jr.rewrite(model))
    np.testing.assert_array_equal(jax.jit(twice)(*ARGS), jax.jit(once)(*ARGS))
    for platform in ("tpu", "cuda"):
        a = _matmul_types(_exported(once, [platform], *ARGS).mlir_module())
        b = _matmul_types(_exported(twice, [platform], *ARGS).mlir_module())
        assert a == b, platform
        j1, j2 = jax.make_jaxpr(once)(*ARGS), jax.make_jaxpr(twice)(*ARGS)
        # the same matmuls and casts; the outer rewrite casts the parameters before the
        # inner one's platform_dependent instead of inside it, so the order differs
        assert sorted(_signature(j1, platform)) == sorted(_signature(j2, platform))


def test_each_dtype_is_painted_once_and_equal_dtypes_share_a_branch(monkeypatch):
    configs = []
    real = rewrite_lib.analyse

    def counting(closed, config):
        configs.append(None if config is None else config.dtype)
        return real(closed, config)

    monkeypatch.setattr(rewrite_lib, "analyse", counting)
    fn = jr.rewrite(model)
    np.testing.assert_array_equal(fn(*ARGS), model(*ARGS))
    assert configs == [None]  # an eager call on the CPU paints nothing
    for wrap in (jax.jit, jax.jit, lambda f: f):  # two traces of the caller, then eager
        wrap(fn)(*ARGS)
    assert sorted(map(str, configs)) == ["None", "bfloat16", "float16"]  # once each
    index = prims(jax.make_jaxpr(fn)(*ARGS), "platform_index")
    assert [e.params["platforms"] for e in index] == [(("tpu",), ("cuda",), None)]
    # float8 needs bfloat16: TPU and CUDA run the same configuration, one branch
    configs.clear()
    rules = jr.Fp8Rules(min_dim=8, multiple=8, keep_first=False, keep_last=False)
    fp8 = jr.rewrite(model, fp8=rules)
    index = prims(jax.make_jaxpr(fp8)(*ARGS), "platform_index")
    assert index[0].params["platforms"] == (("tpu", "cuda"), None)
    assert sorted(map(str, configs)) == ["None", "bfloat16"]


def test_a_call_on_concrete_arrays_under_jit_still_lowers_per_platform():
    """Concrete arguments look like an eager call (each branch painted when called), but a
    ``jax.jit`` around the call stages every branch: each lowering still gets its own."""
    fn = jr.rewrite(model)
    traced = jax.jit(lambda: fn(*ARGS)).trace()
    for platform in ("tpu", "cuda", "cpu"):
        types = _matmul_types(traced.lower(lowering_platforms=(platform,)).as_text())
        assert set(types["dot_general"]) == {SHORT[WANT[platform]]}, platform
    np.testing.assert_array_equal(jax.jit(lambda: fn(*ARGS))(), jax.jit(lambda: model(*ARGS))())


def test_float8_under_dtype_none_lowers_for_cuda_in_bfloat16_and_float8():
    rules = jr.Fp8Rules(min_dim=8, multiple=8, keep_first=False, keep_last=False)
    fn = jr.rewrite(model, fp8=rules)
    # lowered, not exported: jax.export cannot serialize the float8 GEMM's dot algorithm
    cuda = jax.jit(fn).trace(*ARGS).lower(lowering_platforms=("cuda",)).as_text()
    assert "f8E4M3FN" in cuda and "f16>" not in cuda.replace("bf16>", "")
    np.testing.assert_array_equal(jax.jit(fn)(*ARGS), jax.jit(model)(*ARGS))


def test_a_program_no_platform_changes_is_emitted_as_it_is():
    def no_matmul(x):
        return jnp.sum(jnp.tanh(x) ** 2)

    closed = jax.make_jaxpr(jr.rewrite(no_matmul))(W1)
    assert str(closed) == str(jax.make_jaxpr(no_matmul)(W1))


class _OldGpu:
    platform, compute_capability = "gpu", "6.1"


def test_a_local_cuda_gpu_below_compute_capability_7_lowers_unchanged(monkeypatch):
    """This machine's CUDA GPUs decide a CUDA lowering (TF's rule); without one (a deviceless
    compile) a GPU with tensor cores is assumed (the other tests)."""
    devices = jax.devices
    monkeypatch.setattr(
        jax, "devices", lambda backend=None: [_OldGpu()] if backend == "cuda" else devices(backend)
    )
    fn = jr.rewrite(model)
    closed = jax.make_jaxpr(fn)(*ARGS)
    assert prims(closed, "platform_index")[0].params["platforms"] == (("tpu",), None)
    monkeypatch.undo()
    assert _matmul_types(_exported(fn, ["cuda"], *ARGS).mlir_module())["dot_general"] == ["f32"] * 2


class _Gpu:
    platform = "gpu"

    def __init__(self, compute_capability: str):
        self.compute_capability = compute_capability


@pytest.mark.parametrize("capabilities", [("8.0", "6.1"), ("6.1", "9.0")])
def test_every_local_cuda_gpu_decides_a_cuda_lowering(monkeypatch, capabilities):
    """TF's rule holds for every GPU of the machine: one below compute capability 7.0, first
    or not, makes a CUDA lowering run unchanged, and says which."""
    monkeypatch.setattr(jax, "devices", lambda backend=None: [_Gpu(c) for c in capabilities])
    dtype, why = settings_lib.cuda_choice()
    assert dtype is None and "compute capability is 6.1" in why
    assert dict(settings_lib.lowering_dtypes())["cuda"] is None
    monkeypatch.setattr(jax, "devices", lambda backend=None: [_Gpu("8.0"), _Gpu("9.0")])
    assert settings_lib.cuda_choice() == (np.dtype(jnp.float16), "")


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.bn(self.linear(x))))


def _nnx_step(model, optimizer, x, y):
    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    loss, grads = jr.value_and_grad(loss_fn)(optimizer, model)
    optimizer.update(model, grads)
    return loss


def test_nnx_state_is_written_back_and_each_platform_gets_its_program():
    x, y = _arr(16, 4) + 1.0, jnp.arange(16) % 3

    def setup():
        model = _Net(nnx.Rngs(0))
        return model, nnx.Optimizer(model, jr.loss_scale_optimizer(optax.sgd(0.1)), wrt=nnx.Param)

    (model, opt), (ref_model, ref_opt) = setup(), setup()
    step, ref_step = nnx.jit(jr.rewrite(_nnx_step)), nnx.jit(_nnx_step)
    for _ in range(2):
        np.testing.assert_array_equal(step(model, opt, x, y), ref_step(ref_model, ref_opt, x, y))
    for a, b in zip(
        jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(ref_model)), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    assert float(jnp.abs(model.bn.mean[...]).max()) > 0  # the batch statistics moved
    graphdef, state = nnx.split((model, opt))

    def pure(state, x, y):
        m, o = nnx.merge(graphdef, state)
        loss = jr.rewrite(_nnx_step)(m, o, x, y)
        return loss, nnx.state((m, o))

    closed = jax.make_jaxpr(pure)(state, x, y)
    for platform, want in WANT.items():
        dots = lowered_prims(closed, "dot_general", platform)
        assert {a.aval.dtype for e in dots for a in e.invars} - {F32} <= {want}, platform
        assert any(want in {a.aval.dtype for a in e.invars} for e in dots), platform
    assert {
        v.aval.dtype for v in closed.jaxpr.outvars if jnp.issubdtype(v.aval.dtype, jnp.floating)
    } == {F32}


def test_dynamic_loss_scaling_on_cpu_is_what_it_was():
    """The seed API without a dtype: on this CPU the step and its dynamic loss scale run as
    unrewritten; the TPU lowering of the same traced step runs bfloat16."""
    params = {"k": KERNEL, "w1": W1, "w2": W2}

    def loss(p, img):
        return model(p["k"], p["w1"], p["w2"], img)

    def make(rewritten):
        jr.disable_mixed_precision_graph_rewrite()
        tx = jr.enable_mixed_precision_graph_rewrite(optax.adam(1e-2))
        try:

            def step(params, state, img):
                value, grads = jr.value_and_grad(loss)(state, params, img)
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state, value

            step = jax.jit(jr.rewrite(step) if rewritten else step)
            state = tx.init(params)
            out = []
            p = params
            for i in range(3):
                p, state, value = step(p, state, IMG * (1e4 if i == 1 else 1))  # 1: overflows
                out.append((value, jr.get_loss_scale(state), p))
            tpu = _matmul_types(
                step.trace(params, state, IMG).lower(lowering_platforms=("tpu",)).as_text()
            )
        finally:
            jr.disable_mixed_precision_graph_rewrite()
        return out, tpu

    (got, tpu), (want, _) = make(True), make(False)
    for (v, s, p), (rv, rs, rp) in zip(got, want, strict=True):
        np.testing.assert_array_equal(v, rv)
        assert float(s) == float(rs)
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(rp), strict=True):
            np.testing.assert_array_equal(a, b)
    assert set(tpu["dot_general"]) == set(tpu["convolution"]) == {"bf16"}


def test_explain_and_lint_say_each_platforms_dtype():
    report = jr.explain(model, *ARGS, residuals=False)
    assert report.dtype == "none" and report.lowered == (("tpu", "bfloat16"), ("cuda", "float16"))
    text = report.summary()
    assert "dtype=None, decided where the program is lowered: tpu bfloat16, cuda float16" in text
    assert "default device is a cpu" in report.off_reason
    assert report.to_dict()["lowered"] == {"tpu": "bfloat16", "cuda": "float16"}
    findings = report.lint()
    assert [f.kind for f in findings] == ["off_here"]
    assert "tpu runs bfloat16, cuda runs float16" in findings[0].message
    assert "dtype=jnp.bfloat16 or dtype=jnp.float16" in findings[0].change
    pinned = jr.explain(model, *ARGS, dtype=jnp.bfloat16, residuals=False)
    assert pinned.lowered == () and "decided where" not in pinned.summary()


def test_the_warning_names_what_each_lowering_runs():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(jr.rewrite(model)).trace(*ARGS)
    off = [w for w in caught if issubclass(w.category, jr.RewriteOffWarning)]
    assert len(off) == 1
    assert "lowered for tpu it runs in bfloat16, for cuda in float16" in str(off[0].message)


def _has_libtpu() -> bool:
    return importlib.util.find_spec("libtpu") is not None


@pytest.mark.skipif(
    not _has_libtpu(),
    reason="libtpu is not installed in this environment (.venv-tpu has it; a TPU compile "
    "needs it, there is no host stand-in for XLA:TPU)",
)
def test_a_deviceless_tpu_compile_runs_bfloat16():
    from jax.experimental import topologies

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1")
    sharding = jax.sharding.SingleDeviceSharding(topology.devices[0])
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in ARGS]
    traced = jax.jit(jr.rewrite(jax.value_and_grad(model, argnums=(1, 2)))).trace(*args)
    hlo = traced.lower(lowering_platforms=("tpu",)).compile().as_text()
    # XLA:TPU writes matmuls as convolution(...) or dot(...), fused or not
    results = re.findall(r"= (\w+)\[[^\]]*\][^ ]* (?:convolution|dot)\(", hlo)
    assert results and set(results) == {"bf16"}, results
