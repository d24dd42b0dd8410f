"""The rewrite engine: public API, re-emission invariants and higher-order primitives."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jaxpr_walk import (
    all_eqns,
    casts,
    emitted,
    lowered_eqns,
    lowered_prims,
    prims,
    runs_in_half,
    scopes,
)
from multidevice import run_on_eight_devices

import jmp_rewrite as jr
from jmp_rewrite._src.trace.higher_order import describe

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
KEY = jax.random.key(0)


def _rand(*shape, key=0, scale=0.3):
    return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


def mlp(params, x):
    for w, b in params[:-1]:
        x = jax.nn.relu(x @ w + b)
    w, b = params[-1]
    return x @ w + b


PARAMS = [(_rand(8, 16, key=1), jnp.zeros(16)), (_rand(16, 4, key=2), jnp.zeros(4))]
X = _rand(5, 8, key=3, scale=1.0)


def maybe_jit(jit):
    return jax.jit if jit else (lambda f: f)


# -- API -------------------------------------------------------------------------------------


def test_decorator_forms_agree():
    a = jr.rewrite(mlp, dtype=jnp.float16)
    b = jr.rewrite(dtype=jnp.float16)(mlp)

    @jr.rewrite(dtype=jnp.float16)
    def c(params, x):
        return mlp(params, x)

    outs = [f(PARAMS, X) for f in (a, b, c)]
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])
    assert outs[0].dtype == F32
    assert a.__name__ == "mlp"


def _lowered_signature(jaxpr, platform):
    return [
        (e.primitive.name, tuple(str(v.aval) for v in [*e.invars, *e.outvars]))
        for e in lowered_eqns(jaxpr, platform)
    ]


@pytest.mark.filterwarnings("ignore::jmp_rewrite.RewriteOffWarning")
def test_bare_decorator_is_platform_default_and_cpu_is_unchanged():
    """dtype=None decides where the program is lowered (issue 37.3): the jaxpr carries each
    platform's program, and the one a CPU lowers is the function's own, bit for bit."""

    @jr.rewrite
    def f(params, x):
        return mlp(params, x)

    assert jr.platform_dtype() is None  # tests run on CPU
    rewritten, plain = jax.make_jaxpr(f)(PARAMS, X), jax.make_jaxpr(mlp)(PARAMS, X)
    assert _lowered_signature(rewritten, "cpu") == _lowered_signature(plain, "cpu")
    assert all(runs_in_half(e) for e in lowered_prims(rewritten, "dot_general", "tpu"))
    np.testing.assert_array_equal(f(PARAMS, X), mlp(PARAMS, X))
    np.testing.assert_array_equal(jax.jit(f)(PARAMS, X), jax.jit(mlp)(PARAMS, X))


@pytest.mark.parametrize("bad", [jnp.float32, jnp.float64, jnp.int8, "fp8", 3])
def test_bad_dtype_is_a_value_error_listing_allowed(bad):
    with pytest.raises(ValueError, match="float16.*bfloat16"):
        jr.rewrite(mlp, dtype=bad)


def test_non_callable_is_a_type_error():
    with pytest.raises(TypeError, match="callable"):
        jr.rewrite(42, dtype=jnp.float16)
    with pytest.raises(TypeError, match="OpLists"):
        jr.rewrite(mlp, dtype=jnp.float16, lists={"allow": ["dot_general"]})(PARAMS, X)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("jit", [False, True])
def test_matches_float32_and_keeps_signature(dtype, jit):
    f = maybe_jit(jit)(jr.rewrite(mlp, dtype=dtype))
    out = f(PARAMS, X)
    ref = mlp(PARAMS, X)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = 2e-2 if dtype == jnp.bfloat16 else 3e-3
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)
    j = emitted(jr.rewrite(mlp, dtype=dtype), PARAMS, X)
    dots = prims(j, "dot_general")
    assert len(dots) == 2 and all(runs_in_half(e) for e in dots)
    assert all(np.dtype(v.aval.dtype) == F32 for v in j.jaxpr.invars)  # master weights


def test_pytrees_kwargs_and_static_args():
    def f(tree, *, scale, mode):
        y = tree["a"] @ tree["b"]
        return {"out": y * scale if mode == "mul" else y + scale, "n": tree["n"]}

    tree = {"a": _rand(3, 4), "b": _rand(4, 2), "n": jnp.arange(3)}
    g = jr.rewrite(f, dtype=jnp.bfloat16, static_argnames="mode")
    for mode in ("mul", "add"):
        out = g(tree, scale=2.0, mode=mode)
        ref = f(tree, scale=2.0, mode=mode)
        assert jax.tree.structure(out) == jax.tree.structure(ref)
        assert out["n"].dtype == ref["n"].dtype and out["out"].dtype == F32
        np.testing.assert_allclose(out["out"], ref["out"], rtol=2e-2, atol=2e-2)
    h = jax.jit(
        jr.rewrite(lambda x, n: x @ x * n, dtype=jnp.float16, static_argnums=1), static_argnums=1
    )
    np.testing.assert_allclose(h(_rand(3, 3), 3), _rand(3, 3) @ _rand(3, 3) * 3, rtol=3e-3)


def test_repeated_calls_reuse_the_painted_program():
    traces = []

    def f(x):
        traces.append(1)
        return jnp.tanh(x @ x)

    g = jr.rewrite(f, dtype=jnp.float16)
    for _ in range(3):
        g(_rand(4, 4))
    assert len(traces) == 1
    g(_rand(5, 5))  # new signature: traced again
    assert len(traces) == 2


def test_every_transformation_order_agrees():
    def loss(params, x):
        return jnp.mean(mlp(params, x) ** 2)

    ref_val, ref_grad = jax.value_and_grad(loss)(PARAMS, X)
    rw = functools.partial(jr.rewrite, dtype=jnp.float16)
    variants = {
        "grad(rewrite)": jax.value_and_grad(rw(loss)),
        "rewrite(grad)": rw(jax.value_and_grad(loss)),
        "jit(rewrite(grad))": jax.jit(rw(jax.value_and_grad(loss))),
        "rewrite(jit(grad))": rw(jax.jit(jax.value_and_grad(loss))),
        "jit(grad(rewrite))": jax.jit(jax.value_and_grad(rw(loss))),
    }
    for name, f in variants.items():
        val, grad = f(PARAMS, X)
        np.testing.assert_allclose(val, ref_val, rtol=1e-2, err_msg=name)
        for g, r in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad), strict=True):
            assert g.dtype == F32, name
            np.testing.assert_allclose(g, r, rtol=3e-2, atol=3e-3, err_msg=name)


def test_vmap_in_both_orders():
    xs = jnp.stack([X, 2 * X])
    ref = jax.vmap(mlp, (None, 0))(PARAMS, xs)
    a = jax.vmap(jr.rewrite(mlp, dtype=jnp.bfloat16), (None, 0))(PARAMS, xs)
    b = jr.rewrite(jax.vmap(mlp, (None, 0)), dtype=jnp.bfloat16)(PARAMS, xs)
    for out in (a, b):
        assert out.dtype == F32
        np.testing.assert_allclose(out, ref, rtol=3e-2, atol=3e-2)


def test_no_allowlist_op_returns_the_program_unchanged():
    def f(x):
        return jnp.tanh(jnp.exp(x) + 1.0).sum()

    g = jr.rewrite(f, dtype=jnp.float16)
    assert str(emitted(g, X)) == str(emitted(f, X))
    assert not jr.paint(f, X, dtype=jnp.float16).changed


def test_only_float32_is_converted():
    def f(a, b, n):
        return (a @ a).astype(jnp.float32) + (b @ b) + n.sum()

    a = _rand(4, 4).astype(jnp.bfloat16)
    j = emitted(jr.rewrite(f, dtype=jnp.float16), a, _rand(4, 4), jnp.arange(4))
    dots = prims(j, "dot_general")
    # the bf16 matmul is left in bf16 (not recast to f16); the f32 one goes to f16
    assert [np.dtype(d.invars[0].aval.dtype) for d in dots] == [BF16, F16]
    # the user's bf16 -> f32 cast feeds only a half add: TF retargets it to bf16 -> f16
    user_cast = casts(j)[0]
    assert np.dtype(user_cast.invars[0].aval.dtype) == BF16
    assert np.dtype(user_cast.params["new_dtype"]) == F16
    assert np.dtype(j.jaxpr.outvars[0].aval.dtype) == F32


def test_float64_is_never_converted():
    code = (
        "import jax, jax.numpy as jnp, jmp_rewrite as jr, numpy as np\n"
        "jax.config.update('jax_enable_x64', True)\n"
        "f = lambda a, b: (a @ a).sum() + (b @ b).sum()\n"
        "a = jnp.ones((3, 3), jnp.float64); b = jnp.ones((3, 3), jnp.float32)\n"
        "j = jax.make_jaxpr(jr.rewrite(f, dtype=jnp.float16))(a, b)\n"
        "dots = [e for e in j.jaxpr.eqns if e.primitive.name == 'dot_general']\n"
        "print([str(d.invars[0].aval.dtype) for d in dots])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.stdout.strip() == "['float64', 'float16']"


# -- emission invariants ----------------------------------------------------------------


def _producers(jaxpr):
    return {v: e for e in jaxpr.eqns for v in e.outvars}


def _transformer_like(params, x):
    h = jnp.tanh(x @ params[0][0]) * 0.5 + 1.0
    h = jax.nn.relu(h @ params[1][0])
    return jax.nn.log_softmax(h).sum() + jnp.sum(h * h)


@pytest.mark.parametrize("fun", [mlp, _transformer_like])
@pytest.mark.parametrize("grad", [False, True])
def test_one_cast_per_value_and_dtype_no_round_trips_literals_in_place(fun, grad):
    f = jax.grad(lambda p, x: jnp.sum(fun(p, x))) if grad else fun
    j = emitted(jr.rewrite(f, dtype=jnp.float16), PARAMS, X)
    for scope in scopes(j):
        seen = set()
        producers = _producers(scope)
        for e in scope.eqns:
            if e.primitive.name != "convert_element_type":
                continue
            src = e.invars[0]
            assert not hasattr(src, "val"), "literals are converted in place, not cast"
            key = (src, np.dtype(e.params["new_dtype"]))
            assert key not in seen, f"two casts of one value to {key[1]}"
            seen.add(key)
            prev = producers.get(src)
            if prev is not None and prev.primitive.name == "convert_element_type":
                # never f32 -> half -> f32
                assert not (
                    np.dtype(prev.invars[0].aval.dtype) == F32
                    and np.dtype(e.params["new_dtype"]) == F32
                ), "round trip"


def test_existing_cast_to_float32_feeding_half_ops_is_retargeted():
    def f(mask, w):
        return mask.astype(jnp.float32) @ w  # TF T11: Cast(bool->float) -> MatMul

    j = emitted(jr.rewrite(f, dtype=jnp.float16), jnp.ones((4, 4), bool), _rand(4, 4))
    first = j.jaxpr.eqns[0]
    assert first.primitive.name == "convert_element_type"
    assert np.dtype(first.params["new_dtype"]) == F16  # bool -> f16 directly
    assert len(casts(j)) == 3  # the retargeted cast, w -> f16, result -> f32


def test_idempotent():
    def step(params, x):
        return jax.value_and_grad(lambda p: jnp.sum(_transformer_like(p, x)))(params)

    once = jr.rewrite(step, dtype=jnp.bfloat16)
    twice = jr.rewrite(once, dtype=jnp.bfloat16)
    a, b = emitted(once, PARAMS, X), emitted(twice, PARAMS, X)
    sig = lambda j: [
        (e.primitive.name, tuple(str(v.aval) for v in e.outvars))  # noqa: E731
        for e in all_eqns(j)
    ]
    assert sig(a) == sig(b)
    np.testing.assert_array_equal(once(PARAMS, X)[0], twice(PARAMS, X)[0])


def test_rewrite_jaxpr_keeps_avals():
    cj = jax.make_jaxpr(jax.grad(lambda p, x: jnp.sum(mlp(p, x))))(PARAMS, X)
    new = jr.rewrite_jaxpr(cj, dtype=jnp.float16)
    assert [v.aval for v in new.jaxpr.invars] == [v.aval for v in cj.jaxpr.invars]
    assert [v.aval for v in new.jaxpr.outvars] == [v.aval for v in cj.jaxpr.outvars]
    assert all(runs_in_half(e) for e in prims(new, "dot_general"))
    flat = jax.tree.leaves((PARAMS, X))
    ref = jax.core.eval_jaxpr(cj.jaxpr, cj.consts, *flat)
    out = jax.core.eval_jaxpr(new.jaxpr, new.consts, *flat)
    for o, r in zip(out, ref, strict=True):
        assert o.dtype == r.dtype
        assert np.linalg.norm(o - r) <= 1e-2 * np.linalg.norm(r)
    with pytest.raises(TypeError, match="ClosedJaxpr"):
        jr.rewrite_jaxpr(mlp, dtype=jnp.float16)
    with pytest.raises(ValueError, match="dtype"):
        jr.rewrite_jaxpr(cj, dtype=None)


# -- higher-order primitives ---------------------------------------------------------------


def test_jit_body_is_painted_and_keeps_its_name():
    inner = jax.jit(lambda a, b: jnp.tanh(a @ b))
    j = emitted(jr.rewrite(lambda a, b: inner(a, b) @ b, dtype=jnp.float16), X, _rand(8, 8))
    jit_eqn = prims(j, "jit")[0]
    assert jit_eqn.params["name"] == "<lambda>"
    assert all(runs_in_half(e) for e in prims(j, "dot_general"))
    assert runs_in_half(prims(j, "tanh")[0])  # between two matmuls (pass 3) across the call
    assert np.dtype(jit_eqn.outvars[0].aval.dtype) == F16  # no cast back at the boundary


@pytest.mark.parametrize("jit", [False, True])
def test_cond_outputs_follow_branches(jit):
    def f(pred, a, w):
        y = lax.cond(pred, lambda z: z @ w, lambda z: jnp.tanh(z @ w), a)
        return y @ w

    w = _rand(8, 8)
    g = maybe_jit(jit)(jr.rewrite(f, dtype=jnp.float16))
    for pred in (True, False):
        np.testing.assert_allclose(g(pred, X, w), f(pred, X, w), rtol=1e-2, atol=1e-2)
    cond = prims(emitted(jr.rewrite(f, dtype=jnp.float16), True, X, w), "cond")[0]
    assert np.dtype(cond.outvars[0].aval.dtype) == F16
    for branch in describe(cond).body("cases"):
        assert np.dtype(branch.jaxpr.outvars[0].aval.dtype) == F16


def test_cond_output_is_a_merge_deny_stays_in_its_branch():
    # Like TF's Merge (clear): deny from one branch does not flow into an output that only
    # leads to an allow op (probe H), so the output is half and the exp branch casts its
    # float32 result inside the branch.
    def f(pred, a, w):
        return lax.cond(pred, lambda z: z @ w, lambda z: jnp.exp(z), a) @ w

    w = _rand(8, 8)
    p = jr.paint(f, True, X, w, dtype=jnp.float16)
    assert p.colours("exp") == ["deny"] and p.colours("<cond-output>") == ["allow"]
    cond = prims(emitted(jr.rewrite(f, dtype=jnp.float16), True, X, w), "cond")[0]
    assert np.dtype(cond.outvars[0].aval.dtype) == F16
    exp_branch = describe(cond).body("cases")[0].jaxpr
    exp = [e for e in exp_branch.eqns if e.primitive.name == "exp"][0]
    assert np.dtype(exp.outvars[0].aval.dtype) == F32
    for pred in (True, False):
        g = jr.rewrite(f, dtype=jnp.float16)
        np.testing.assert_allclose(g(pred, X, w), f(pred, X, w), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("jit", [False, True])
def test_while_and_scan_carries_are_type_consistent(jit):
    w = _rand(8, 8)

    def f(a, n):
        a = lax.fori_loop(0, n, lambda i, z: jnp.tanh(z @ w), a)  # while (dynamic n)
        c, ys = lax.scan(lambda c, x: (jnp.tanh(c @ w) + x, jnp.sum(c)), a, jnp.stack([a, a]))
        return c @ w, ys

    g = maybe_jit(jit)(jr.rewrite(f, dtype=jnp.float16))
    out, ys = g(X, 3)
    ref_out, ref_ys = f(X, 3)
    np.testing.assert_allclose(out, ref_out, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(ys, ref_ys, rtol=2e-2, atol=2e-2)
    assert ys.dtype == F32
    j = emitted(jr.rewrite(f, dtype=jnp.float16), X, 3)
    wl, sc = prims(j, "while")[0], prims(j, "scan")[0]
    body = describe(wl).inner("body")  # JAX's parameter names live in higher_order.py
    assert np.dtype(body.invars[-1].aval.dtype) == F16 == np.dtype(body.outvars[-1].aval.dtype)
    layout = describe(sc)
    sbody, k = layout.inner(), layout.size("consts")  # w is a scan const
    assert np.dtype(sbody.invars[k].aval.dtype) == F16 == np.dtype(sbody.outvars[0].aval.dtype)
    assert np.dtype(sbody.outvars[1].aval.dtype) == F32  # ys from a deny reduce_sum


def test_scan_grad_matches():
    w = _rand(8, 8)

    def loss(w, a):
        c, _ = lax.scan(lambda c, _: (jnp.tanh(c @ w), None), a, None, length=4)
        return jnp.sum(c**2)

    ref = jax.grad(loss)(w, X)
    for f in (
        jax.grad(jr.rewrite(loss, dtype=jnp.float16)),
        jr.rewrite(jax.grad(loss), dtype=jnp.float16),
    ):
        np.testing.assert_allclose(f(w, X), ref, rtol=3e-2, atol=3e-3)


def test_custom_jvp_rule_is_kept():
    # jax.nn.relu's custom JVP gives gradient 0 at 0; max(x, 0)'s own JVP would give 0.5.
    def f(w, x):
        return jnp.sum(jax.nn.relu(x @ w))

    w = jnp.zeros((4, 4))
    x = jnp.ones((2, 4))
    g = jax.grad(jr.rewrite(f, dtype=jnp.float16))(w, x)
    np.testing.assert_array_equal(g, np.zeros((4, 4)))
    np.testing.assert_array_equal(jax.grad(f)(w, x), g)
    j = emitted(jr.rewrite(f, dtype=jnp.float16), w, x)
    relu = prims(j, "custom_jvp_call")[0]
    assert runs_in_half(relu)  # painted half, no cast around the call


def test_custom_vjp_backward_is_kept():
    @jax.custom_vjp
    def scaled_tanh(x):
        return jnp.tanh(x)

    scaled_tanh.defvjp(lambda x: (jnp.tanh(x), x), lambda x, g: (3.0 * g,))  # not the math

    def f(w, x):
        return jnp.sum(scaled_tanh(x @ w) @ w)

    w, x = _rand(4, 4), _rand(2, 4)
    ref = jax.grad(f)(w, x)
    out = jax.grad(jr.rewrite(f, dtype=jnp.float16))(w, x)
    np.testing.assert_allclose(out, ref, rtol=1e-2, atol=1e-2)
    assert out.dtype == F32
    j = emitted(jr.rewrite(f, dtype=jnp.float16), w, x)
    assert runs_in_half(prims(j, "custom_vjp_call")[0])


def test_checkpoint_body_is_rewritten_and_grad_matches():
    w = _rand(8, 8)

    def loss(w, x):
        h = jax.checkpoint(lambda z: jnp.tanh(z @ w) @ w)(x)
        return jnp.sum(h**2)

    j = emitted(jr.rewrite(jax.grad(loss), dtype=jnp.float16), w, X)
    remats = prims(j, "remat2") + prims(j, "checkpoint")
    assert remats
    dots = prims(j, "dot_general")
    assert dots and all(runs_in_half(e) for e in dots)
    np.testing.assert_allclose(
        jr.rewrite(jax.grad(loss), dtype=jnp.float16)(w, X),
        jax.grad(loss)(w, X),
        rtol=3e-2,
        atol=3e-3,
    )


def test_named_unit_log_softmax_runs_whole_in_half_between_matmuls():
    w = _rand(8, 8)

    def f(x):
        return jax.nn.log_softmax(x @ w) @ w

    p = jr.paint(f, X, dtype=jnp.float16)
    assert p.colours("jit:log_softmax") == ["allow"]  # TF LogSoftmax: infer, between allows
    j = emitted(jr.rewrite(f, dtype=jnp.float16), X)
    unit = prims(j, "jit")[0]
    inner = {e.primitive.name: e for e in all_eqns(unit.params["jaxpr"])}
    assert runs_in_half(inner["sub"]) and runs_in_half(inner["log"])
    # its deny pieces accumulate in float32, as TF's fused half kernels do
    assert not runs_in_half(inner["exp"]) and not runs_in_half(inner["reduce_sum"])


# -- float32 regions ------------------------------------------------------------------------


def test_float32_region_is_never_converted_and_casts_back_on_entry():
    w = _rand(8, 8)

    @jr.float32_region
    def sensitive(h):
        return jnp.tanh(h) * 3.0 + 1.0

    def f(x):
        return sensitive(x @ w) @ w

    p = jr.paint(f, X, dtype=jnp.float16)
    region = [e for e in p if e.in_float32_region]
    assert {e.primitive for e in region} == {"tanh", "mul", "add"}
    assert all(e.colour == "float32" for e in region)
    j = emitted(jr.rewrite(f, dtype=jnp.float16), X)
    tanh = prims(j, "tanh")[0]
    assert np.dtype(tanh.invars[0].aval.dtype) == F32
    # without the region, TF's pass 3 paints them half (between two matmuls)
    q = jr.paint(lambda x: (jnp.tanh(x @ w) * 3.0 + 1.0) @ w, X, dtype=jnp.float16)
    assert q.colours("tanh") == ["allow"]


def test_float32_region_rejects_non_callable():
    with pytest.raises(TypeError, match="callable"):
        jr.float32_region("not a function")


# -- lists, levels, environment ----------------------------------------------------------


def test_user_lists_and_levels_change_the_painting():
    w = _rand(8, 8)

    def f(x):
        return jnp.tanh(x @ w) @ w

    assert jr.paint(f, X, dtype=jnp.float16).colours("tanh") == ["allow"]
    deny_tanh = jr.default_lists(jnp.float16).move("tanh", to="deny")
    assert jr.paint(f, X, dtype=jnp.float16, lists=deny_tanh).colours("tanh") == ["deny"]
    p = jr.paint(f, X, dtype=jnp.float16, level="TENSOR_CORES_ONLY")
    assert p.colours("tanh") == ["float32"] and p.colours("dot_general") == ["allow"] * 2
    forced = jr.paint(lambda x: jnp.exp(x @ w), X, dtype=jnp.float16, level="UNSAFE_FORCE_ALL")
    assert forced.colours("exp") == ["allow"]


def test_environment_overrides_apply_to_default_lists(monkeypatch):
    w = _rand(8, 8)

    def f(x):
        return jnp.tanh(x @ w) @ w

    monkeypatch.setenv("JMP_REWRITE_INFERLIST_REMOVE", "tanh")
    monkeypatch.setenv("JMP_REWRITE_DENYLIST_ADD", "tanh")
    assert jr.paint(f, X, dtype=jnp.float16).colours("tanh") == ["deny"]
    monkeypatch.setenv("JMP_REWRITE_DENYLIST_ADD", "tanhh")
    with pytest.raises(ValueError, match="tanhh"):
        jr.paint(f, X, dtype=jnp.float16)


def test_paint_result_is_readable():
    p = jr.paint(mlp, PARAMS, X, dtype=jnp.float16)
    text = str(p)
    assert "dot_general" in text and "add_allowlist_ops" in text
    assert len(p) == len(list(p)) and p[0].path == "dot_general"
    assert all(e.colour == "allow" for e in p.half)


# -- multiple devices -------------------------------------------------------------------------


def test_shard_map_and_shardings_on_eight_devices():
    assert run_on_eight_devices("multidevice_rewrite.py").strip().endswith("OK")


def test_typed_prng_keys_pass_through():
    w = _rand(4, 4)

    def f(key, x):
        mask = jax.random.bernoulli(key, 0.5, x.shape)
        noise = jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(1), 3), x.shape)
        return jnp.tanh(jnp.where(mask, x, 0.0) @ w) @ w + noise

    key, x = jax.random.key(0), _rand(2, 4)
    for g in (jr.rewrite(f, dtype=jnp.float16), jax.jit(jr.rewrite(f, dtype=jnp.float16))):
        np.testing.assert_allclose(g(key, x), f(key, x), rtol=1e-2, atol=1e-2)
    assert jr.explain(f, key, x, dtype=jnp.float16).half_flops_share == 1.0


def test_out_of_range_float32_literals_are_clamped_not_infinite():
    # flax masks attention with jnp.finfo(float32).min; as -inf a fully masked row is NaN
    def f(w, x, mask):
        return jax.nn.softmax(jnp.where(mask, x @ w, jnp.finfo(jnp.float32).min))

    out = jr.rewrite(f, dtype=jnp.float16)(_rand(4, 4), _rand(1, 4), jnp.zeros((1, 4), bool))
    np.testing.assert_allclose(out, np.full((1, 4), 0.25))


def test_rewriting_a_rewritten_function_keeps_the_outer_options():
    # functools.update_wrapper copies the wrapped function's __dict__; the outer rewrite's
    # own dtype and cache must survive it (they were the inner one's).
    inner = jr.rewrite(lambda w, x: jnp.tanh(x @ w), dtype=jnp.float16)
    outer = jr.rewrite(inner, dtype=jnp.bfloat16)
    assert outer.dtype == np.dtype(jnp.bfloat16) and inner.dtype == F16
    assert outer._cache is not inner._cache
    # The inner rewrite runs first, while the outer one traces: its float16 matmul is no
    # float32 equation, so the outer painting leaves it as it is.
    w = _rand(X.shape[-1], 8)
    dots = prims(emitted(outer, w, X), "dot_general")
    assert dots and {np.dtype(v.aval.dtype) for e in dots for v in e.invars} == {F16}
