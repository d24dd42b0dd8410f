"""The numerics debugger: ``jmp_rewrite.compare``."""

from __future__ import annotations

import doctest
import importlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_rewrite as jr

F16_INFER_SUM = jr.default_lists(jnp.float16).move("reduce_sum", "infer")
W = jnp.asarray(np.full((16, 16), 0.5, np.float32))  # ONES @ W: every element is 8.0
ONES = jnp.asarray(np.ones((2, 16), np.float32))


def _rand(*shape, key=0, scale=0.3):
    return jnp.asarray(scale * np.random.default_rng(key).standard_normal(shape), jnp.float32)


def sum_times_1e3(w, x):
    h = x @ w
    return jnp.sum(h * 1e3)  # 32 elements of 8e3: the sum, 2.56e5, overflows float16


# -- overflow: detection, first equation, suggestion, fix ------------------------------------


def test_overflow_detected_at_the_equation_that_overflows():
    c = jr.compare(sum_times_1e3, W, ONES, dtype=jnp.float16, lists=F16_INFER_SUM)
    assert isinstance(c, jr.Comparison)
    (total,) = c.find("reduce_sum")
    assert total.half and total.list == "infer"
    assert total.overflow == 1 and total.rel_error == float("inf")
    assert total.max_abs_f32 == pytest.approx(2.56e5)
    # Upstream equations are exact (8 and 8e3 are representable) and did not overflow.
    assert [e.overflow for e in c.find("dot_general") + c.find("mul")] == [0, 0]
    assert c.find("mul")[0].rel_error == 0.0
    assert c.first_exceeding is total
    # A half sum accumulates in float32; only its half readers see the overflow. The output
    # reads the float32 sum, so the program's result is still right here.
    assert c.outputs[0].overflow == 0
    (s,) = c.suggestions
    assert isinstance(s, jr.Suggestion)
    assert (s.key, s.path, s.to_list) == ("reduce_sum", "reduce_sum", "deny")
    assert "overflows in float16" in s.reason
    assert str(s).startswith("move `reduce_sum` at `reduce_sum` to deny: overflows in float16")


def test_applying_the_suggestion_removes_the_overflow():
    c = jr.compare(sum_times_1e3, W, ONES, dtype=jnp.float16, lists=F16_INFER_SUM)
    fixed = c.apply(*c.suggestions)
    assert fixed.overflow == 0 and fixed.suggestions == () and fixed.first_exceeding is None
    assert fixed.lists.kind("reduce_sum") == "deny"
    assert fixed.find("reduce_sum")[0].colour == "deny"
    assert fixed.find("mul")[0].half  # only the culprit moved
    assert fixed.outputs[0].rel_error < 1e-3
    # The same through the lists, and with apply() taking every suggestion.
    lists = c.suggested_lists()
    assert lists.kind("reduce_sum") == "deny" and F16_INFER_SUM.kind("reduce_sum") == "infer"
    again = jr.compare(sum_times_1e3, W, ONES, dtype=jnp.float16, lists=lists)
    assert again.overflow == 0 and again.equations == fixed.equations
    assert c.apply().equations == fixed.equations


def test_mul_between_two_matmuls_then_the_matmul_that_reads_it():
    def f(w1, w2, x):
        return ((x @ w1) * 1e4) @ w2  # 8e4 > 65504

    c = jr.compare(f, W, W, ONES, dtype=jnp.float16)
    assert c.first_exceeding.key == "mul" and c.first_exceeding.overflow == 32
    assert [s.key for s in c.suggestions] == ["mul"]  # not the dot_general that inherits inf
    assert c.find("dot_general")[1].overflow > 0
    # With mul in float32 its value is cast to float16 for the second matmul: that one is
    # blamed next; once it is denied too the program is clean.
    second = c.apply()
    assert second.find("mul")[0].colour == "deny" and second.find("mul")[0].overflow == 0
    assert [(s.key, s.path) for s in second.suggestions] == [("dot_general", "dot_general")]
    third = second.apply()
    assert third.overflow == 0 and third.suggestions == ()


def test_nan_is_blamed_on_the_overflow_that_caused_it():
    def f(w, x):
        h = (x @ w) * 1e4
        return (h - h * 1.0) @ w  # inf - inf in float16

    c = jr.compare(f, W, ONES, dtype=jnp.float16)
    sub = c.find("sub")[0]
    assert sub.half and sub.nan == 32 and sub.overflow == 0
    assert [s.key for s in c.suggestions] == ["mul"]
    assert c.first_exceeding.key == "mul"


# -- benign programs -------------------------------------------------------------------------


def mlp(params, x):
    for w, b in params[:-1]:
        x = jnp.tanh(x @ w + b)
    w, b = params[-1]
    return x @ w + b


ZEROS = jnp.asarray(np.zeros(32, np.float32))
PARAMS = [(_rand(8, 32, key=1), ZEROS), (_rand(32, 4, key=2), ZEROS[:4])]
X = _rand(16, 8, key=3, scale=1.0)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_benign_program_has_small_errors_and_no_suggestions(dtype):
    c = jr.compare(mlp, PARAMS, X, dtype=dtype)
    assert c.changed and c.suggestions == () and c.first_exceeding is None
    assert c.max_rel_error < c.tolerance
    assert all(e.overflow == e.underflow == e.nan == 0 for e in c.equations)
    assert sum(e.half for e in c.equations) >= 5
    assert all(e.rel_error > 0 for e in c.find("dot_general"))  # it did run in half precision
    assert c.outputs[0].rel_error < c.tolerance
    assert c.tolerance == (1e-2 if dtype == jnp.float16 else 5e-2)
    assert "suggestions:\n  none" in str(c)


def test_program_without_allowlist_op_is_unchanged():
    c = jr.compare(lambda x: jnp.tanh(x) * 2.0, X, dtype=jnp.float16)
    assert not c.changed
    assert all(e.colour == "float32" and e.rel_error == 0 for e in c.equations)
    assert c.suggestions == () and "unchanged" in c.summary()


# -- train steps -----------------------------------------------------------------------------

OPT = optax.sgd(0.1)


def _train_step(scale):
    def loss(p, x, y):
        with jax.named_scope("loss"):
            h = jnp.tanh(x @ p["w1"])
            return jnp.mean((h @ p["w2"] - y) ** 2) * scale

    def step(p, s, x, y):
        value, grads = jax.value_and_grad(loss)(p, x, y)

        @jr.float32_region
        def update(g, s, p):
            u, s = OPT.update(g, s, p)
            return optax.apply_updates(p, u), s

        p, s = update(grads, s, p)
        return p, s, value

    return step


P = {"w1": _rand(8, 16, key=4), "w2": _rand(16, 2, key=5)}
Y = _rand(16, 2, key=6, scale=1.0)


def test_train_step_forward_and_backward_compared():
    c = jr.compare(_train_step(1.0), P, OPT.init(P), X, Y, dtype=jnp.float16)
    dots = c.find("dot_general")
    assert len(dots) == 5 and all(d.half for d in dots)  # 2 forward, 3 backward
    assert {d.scope for d in dots} == {"loss"}
    assert c.suggestions == () and c.first_exceeding is None
    # The optimizer update runs in the float32 region: its equations are float32.
    region = [e for e in c.equations if e.scope == "" and e.primitive in ("mul", "add")]
    assert region and all(e.colour == "float32" for e in region)
    assert len(c.outputs) == 3 and all(o.rel_error < 1e-2 for o in c.outputs)


def test_train_step_backward_overflow_found_and_fixed():
    c = jr.compare(_train_step(1e6), P, OPT.init(P), X, Y, dtype=jnp.float16)
    first = c.first_exceeding
    assert first.half and first.overflow > 0
    assert c.outputs[0].nan + c.outputs[0].overflow > 0  # new parameters are ruined
    s = c.suggestions[0]
    assert s.to_list == "deny" and s.scope == "loss" and s.key == first.key
    assert "float32_region" in s.reason  # the narrower fix is proposed too
    assert str(s).startswith(f"move `{s.key}` at `loss/{first.path}` to deny")
    fixed = c
    for _ in range(4):  # each fix can expose the next equation to overflow
        if not fixed.suggestions:
            break
        fixed = fixed.apply()
    assert fixed.overflow == 0 and fixed.suggestions == ()
    assert all(o.rel_error < 1e-2 for o in fixed.outputs)


# -- control flow and calls -----------------------------------------------------------------


def test_scan_body_overflow_at_some_iterations():
    def f(w, xs):
        def body(c, x):
            s = jnp.sum((x @ w) * (c * 100.0))  # 25600 * c: overflows from c = 3 on
            return c + 1.0, s

        return jax.lax.scan(body, 1.0, xs)[1]

    xs = jnp.asarray(np.ones((5, 2, 16), np.float32))
    c = jr.compare(f, W, xs, dtype=jnp.float16, lists=F16_INFER_SUM)
    (total,) = c.find("scan/body/reduce_sum")
    assert total.count == 5 and total.overflow == 3
    assert c.first_exceeding is total
    assert [(s.key, s.path) for s in c.suggestions] == [("reduce_sum", "scan/body/reduce_sum")]
    assert c.find("scan/ys")[0].overflow == 3
    assert c.apply().overflow == 0


def test_reverse_scan_while_cond_and_jit_paths():
    @jax.jit
    def inner(w, x):
        return jnp.tanh(x @ w)

    def f(w, x):
        h = inner(w, x)

        def body(c, xi):
            return c * 0.5 + jnp.sum(xi @ w), (xi @ w) * c

        c, ys = jax.lax.scan(body, 1.0, jnp.stack([x, 2 * x, 3 * x]), reverse=True)
        y = jax.lax.cond(c > 0, lambda a: a * 2, lambda a: a - 1, h)
        z = jax.lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] @ w), (0, y))
        return jnp.sum(z[1]), ys

    w, x = _rand(8, 8, key=7), _rand(4, 8, key=8, scale=1.0)
    c = jr.compare(f, w, x, dtype=jnp.float16)
    paths = {e.path for e in c.equations}
    assert {
        "jit/dot_general",
        "jit/tanh",
        "scan/body/dot_general",
        "while/body/dot_general",
    } <= paths
    assert "cond/branch1/mul" in paths and "cond/branch0/sub" not in paths  # branch taken
    assert c.find("scan/body/dot_general")[0].count == 3
    assert c.find("while/body/dot_general")[0].count == 3
    assert c.find("while/carry")[0].count == 4  # initial value and 3 iterations
    assert c.suggestions == () and c.max_rel_error < 1e-2
    # The comparison replays the real rewrite: its half outputs are those of jr.rewrite (up
    # to the last bits: its segments are compiled with XLA's quick options).
    ref, half = jax.jit(f)(w, x), jax.jit(jr.rewrite(f, dtype=jnp.float16))(w, x)
    for rec, r, h in zip(c.outputs, ref, half):
        err = np.max(np.abs(np.asarray(h) - np.asarray(r))) / np.max(np.abs(np.asarray(r)))
        assert rec.rel_error == pytest.approx(err, rel=0.05, abs=1e-6)


def test_cond_and_while_overflows():
    def g(w, x, flag):
        h = x @ w
        y = jax.lax.cond(flag > 0, lambda a: jnp.sum(a * 1e3), lambda a: jnp.sum(a), h)
        z = jax.lax.while_loop(lambda s: s[0] < 4, lambda s: (s[0] + 1, (s[1] @ w) * 2.0), (0, h))
        return y, z[1]

    c = jr.compare(g, W, ONES, 1, dtype=jnp.float16, lists=F16_INFER_SUM)
    assert c.first_exceeding.path == "cond/branch1/reduce_sum"
    assert [(s.key, s.path) for s in c.suggestions] == [
        ("reduce_sum", "cond/branch1/reduce_sum"),
        ("dot_general", "while/body/dot_general"),
    ]
    taken_other = jr.compare(g, W, ONES, 0, dtype=jnp.float16, lists=F16_INFER_SUM)
    assert "cond/branch1/reduce_sum" not in {e.path for e in taken_other.equations}


def test_fused_unit_blamed_on_its_key():
    assert jr.default_lists(jnp.float16).kind("jit:log_softmax") == "infer"
    # ONES @ w: 0, 1, ..., 15, exactly.
    w = jnp.asarray(np.tile(np.arange(16, dtype=np.float32) / 16, (16, 1)))

    def f(w, x):
        return jax.nn.log_softmax(x @ w) @ w

    c = jr.compare(f, w, ONES, dtype=jnp.float16, tolerance=1e-6)
    first = c.first_exceeding
    assert first.path.startswith("jit/") and first.list == "infer" and first.half
    assert c.find("dot_general")[0].rel_error == 0.0
    assert c.suggestions[0].key == "jit:log_softmax" and c.suggestions[0].path == first.path
    fixed = c.apply(c.suggestions[0])
    assert fixed.find("jit:log_softmax")[0].colour == "deny"
    assert not any(e.half for e in fixed.equations if e.path.startswith("jit/"))


# -- underflow ---------------------------------------------------------------------------------


def test_float16_underflow_to_zero():
    c = jr.compare(lambda w, x: jnp.sum((x @ w) * 1e-9), W, ONES, dtype=jnp.float16)
    (mul,) = c.find("mul")
    assert mul.half and mul.underflow == 32 and mul.rel_error == 1.0
    (s,) = c.suggestions
    assert s.key == "mul" and "became zero" in s.reason and "loss scaling" in s.reason


def test_bfloat16_underflow_by_rounding_is_detected():
    # bfloat16 keeps float32's exponent range, but 1 + 8e-4 rounds to 1 (7 mantissa bits).
    c = jr.compare(
        lambda w, x: ((x @ w) + 1.0) - 1.0,
        jnp.asarray(np.full((16, 16), 0.5e-4, np.float32)),
        ONES,
        dtype=jnp.bfloat16,
    )
    (sub,) = c.find("sub")
    assert sub.half and sub.underflow == 32 and sub.rel_error == 1.0
    assert c.first_exceeding is sub
    assert [s.key for s in c.suggestions] == ["sub"]
    assert c.find("add")[0].rel_error < c.tolerance  # rounding 1.0008 to 1 is not the problem
    assert c.apply().find("sub")[0].underflow == 0


# -- levels, scopes, options ----------------------------------------------------------------


def test_unsafe_force_all_suggests_a_float32_region():
    c = jr.compare(sum_times_1e3, W, ONES, dtype=jnp.float16, level="UNSAFE_FORCE_ALL")
    (s,) = c.suggestions
    assert (s.key, s.to_list) == ("reduce_sum", "float32_region")
    assert str(s).startswith("wrap `reduce_sum`")
    with pytest.raises(ValueError, match="float32_region"):
        c.apply(s)
    with pytest.raises(ValueError, match="float32_region"):
        c.suggested_lists(s)
    assert c.suggested_lists() == c.lists  # no list suggestion to apply


def test_tolerance_decides_what_exceeds():
    tight = jr.compare(mlp, PARAMS, X, dtype=jnp.bfloat16, tolerance=1e-6)
    assert tight.tolerance == 1e-6
    assert tight.first_exceeding is not None and tight.first_exceeding.half
    assert tight.suggestions and tight.suggestions[0].to_list == "deny"


# -- rendering -----------------------------------------------------------------------------------


def test_str_table_and_to_dict():
    c = jr.compare(sum_times_1e3, W, ONES, dtype=jnp.float16, lists=F16_INFER_SUM)
    text = str(c)
    assert "first exceeding tolerance: reduce_sum" in text
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if "rel err" in line)
    marked = [line for line in lines if line.startswith(">>")]
    assert len(marked) == 1 and "reduce_sum" in marked[0] and "inf" in marked[0]
    # Aligned: the column of "rel err" ends at the same place on every row of the table.
    table = lines[header : header + 1 + len(c.equations)]
    end = lines[header].index("rel err") + len("rel err")
    assert all(line[end - 1] != " " for line in table)
    assert "move `reduce_sum` at `reduce_sum` to deny" in text
    d = c.to_dict()
    json.dumps(d, allow_nan=False)
    assert d["first_exceeding"] == "reduce_sum"
    assert d["suggestions"][0]["to_list"] == "deny"
    assert {"path", "rel_error", "overflow", "underflow", "nan", "max_abs_f32"} <= set(
        d["equations"][0]
    )
    assert c.worst(1)[0].key == "reduce_sum"


def test_module_doctests():
    module = importlib.import_module(jr.compare.__module__)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 2 and result.failed == 0


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, "int8", jnp.float64])
def test_bad_dtype(dtype):
    with pytest.raises(ValueError, match="float16.*bfloat16"):
        jr.compare(sum_times_1e3, W, ONES, dtype=dtype)


def test_bad_arguments():
    with pytest.raises(TypeError, match="callable"):
        jr.compare("not a function", W, dtype=jnp.float16)
    with pytest.raises(ValueError, match="positive"):
        jr.compare(sum_times_1e3, W, ONES, dtype=jnp.float16, tolerance=-1.0)
    with pytest.raises(TypeError, match="ShapeDtypeStruct"):
        jr.compare(sum_times_1e3, jax.ShapeDtypeStruct((16, 16), jnp.float32), ONES)
    with pytest.raises(TypeError, match="OpLists"):
        jr.compare(sum_times_1e3, W, ONES, dtype=jnp.float16, lists={"deny": ["exp"]})
    with pytest.raises(TypeError, match="inside a JAX transformation"):
        jax.jit(lambda w: jr.compare(sum_times_1e3, w, ONES, dtype=jnp.float16).overflow)(W)
    c = jr.compare(lambda x: x @ x, ONES[:, :2], dtype=jnp.float16)
    with pytest.raises(TypeError, match="Suggestion"):
        c.apply("reduce_sum")


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_nans_float32_has_too_are_not_blamed_on_half_precision(dtype):
    """A NaN the float32 run has as well (``sqrt`` of a negative matmul result) is no NaN
    half precision produced: no equation counts it, none is reported bad for it, and no
    suggestion moves ``sqrt`` (round 7's survivor: compare blamed float32's own NaNs)."""

    def f(w, x):
        return jnp.tanh(jnp.sqrt(x @ w)) @ w

    w = jnp.asarray(np.random.default_rng(0).normal(size=(8, 8)), jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 8)), jnp.float32)
    assert np.isnan(np.asarray(f(w, x))).any()  # float32 has NaNs of its own
    c = jr.compare(f, w, x, dtype=dtype)
    (root,) = c.find("sqrt")
    assert all(e.nan == 0 for e in c.equations + c.outputs), [
        (e.path, e.nan) for e in c.equations if e.nan
    ]
    assert not root.exceeds and root.rel_error < 2e-2
    assert not any("sqrt" in str(s) for s in c.suggestions), c.suggestions
