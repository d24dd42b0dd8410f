"""explain(): the per-equation report, totals, casts, and its three renderings."""

import html
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_rewrite as jr

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

W1 = 0.1 * jnp.ones((8, 16))
W2 = 0.1 * jnp.ones((16, 16))
X = jnp.ones((4, 8))


def loss(params, x):
    h = jnp.tanh(x @ params[0])
    h, _ = jax.lax.scan(lambda c, _: (jax.nn.relu(c @ params[1]), None), h, None, length=3)
    return jnp.mean(h**2)


def test_report_rows_dtypes_and_passes():
    r = jr.explain(loss, [W1, W2], X, dtype=jnp.float16)
    assert r.dtype == "float16" and r.changed
    by_path = {e.path: e for e in r.equations}
    dot = by_path["dot_general"]
    assert dot.list == "allow" and dot.half and dot.painted_by == "add_allowlist_ops"
    assert dot.in_dtypes == ("float32", "float32") and dot.in_dtypes_after == ("float16",) * 2
    assert dot.out_dtypes_after == ("float16",)
    tanh = by_path["tanh"]
    assert tanh.half and tanh.painted_by == "add_clear_and_infer_to_allow_if_between_allow"
    assert by_path["scan/body/dot_general"].half
    assert by_path["scan/const"].half  # the weight enters the loop once, in half precision
    total = by_path["reduce_sum"]
    assert not total.half and total.colour == "deny" and total.out_dtypes_after == ("float32",)


def test_totals():
    r = jr.explain(loss, [W1, W2], X, dtype=jnp.float16)
    # dot, tanh, scan-body dot, relu's max are half; x**2, sum and the mean's div are not
    assert (len(r.converted), r.total) == (4, 7)
    assert r.half_flops_share == 1.0
    first = [e for e in r.equations if e.path == "dot_general"][0]
    assert first.flops == 2 * 4 * 16 * 8
    body = [e for e in r.equations if e.path == "scan/body/dot_general"][0]
    assert body.flops == 3 * 2 * 4 * 16 * 16  # times the scan length
    # casts: x and W1 before the first matmul, W2 at its reader in the scan body (a loop
    # invariant XLA hoists out of the loop), the square's input
    assert [(c.where, c.from_dtype, c.to_dtype) for c in r.casts] == [
        ("dot_general", "float32", "float16"),
        ("dot_general", "float32", "float16"),
        ("scan/body/dot_general", "float32", "float16"),
        ("integer_pow", "float16", "float32"),
    ]
    per = r.per_primitive()
    assert per["dot_general"] == {"half": 2, "float32": 0}
    assert per["reduce_sum"] == {"half": 0, "float32": 1}
    assert r.residual_bytes_rewritten < r.residual_bytes_float32


def test_removing_dot_general_from_allow_leaves_the_program_alone():
    def f(a, b):
        return jnp.exp(a @ b).sum()

    lists = jr.default_lists(jnp.float16).remove(allow=["dot_general"])
    r = jr.explain(f, X, W1, dtype=jnp.float16, lists=lists)
    assert not r.changed and r.half_flops_share == 0.0 and r.casts == ()


def test_no_allowlist_op():
    r = jr.explain(lambda x: jnp.exp(x).sum(), X, dtype=jnp.bfloat16)
    assert not r.changed and len(r.converted) == 0 and "unchanged" in r.summary()


def test_renderings():
    r = jr.explain(loss, [W1, W2], X, dtype=jnp.bfloat16)
    text = str(r)
    assert "scan/body/dot_general" in text and "float32 -> bfloat16" in text
    # bf16 lists: Sum/Mean and Square are infer (TF oneDNN), so the whole loss is bf16
    assert "equations in half precision: 7 / 7" in text
    html = r._repr_html_()
    assert html.count('<tr class="eq"') == len(r.equations)  # one row per equation, in a tree
    assert "#6aa84f" in html and "add_allowlist_ops" in html  # half colour, pass on hover
    data = json.loads(json.dumps(r.to_dict()))
    assert data["totals"]["converted"] == 7 and data["dtype"] == "bfloat16"
    assert len(data["equations"]) == len(r.equations) and len(data["casts"]) == len(r.casts)


def test_train_step_has_no_residual_figure_and_abstract_inputs_work(leak_checking):
    def step(params, x):
        g = jax.grad(loss)(params, x)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g)

    spec = jax.ShapeDtypeStruct
    r = jr.explain(
        step,
        [spec((8, 16), jnp.float32), spec((16, 16), jnp.float32)],
        spec((4, 8), jnp.float32),
        dtype=jnp.float16,
    )
    assert r.half_flops_share == 1.0
    dots = [e for e in r.equations if e.primitive == "dot_general"]
    assert len(dots) >= 5 and all(e.half for e in dots)
    assert r.residual_bytes_float32 is None  # a train step: it already has its backward pass


def test_float32_regions_count_as_float32_in_the_flops_share():
    """A matmul in a float32 region runs in float32: the share says so, and says why."""
    w = jnp.ones((8, 8))

    @jr.float32_region
    def check(h):
        return h @ w  # float32 by request

    r = jr.explain(lambda x: check(jnp.tanh(x @ w)), jnp.ones((2, 8)), dtype=jnp.float16)
    region = [e for e in r.equations if e.in_float32_region and e.primitive == "dot_general"]
    assert len(region) == 1 and not region[0].half and region[0].flops > 0
    assert r.half_flops_share == 0.5 and r.region_flops == region[0].flops == r.matmul_flops / 2
    assert "FLOPs in half precision: 50.0% of 512 (256 in float32 regions" in r.summary()
    assert {e.scope for e in region} == {"float32_region(check)"}  # by the function's name


def test_flops_share_without_matmuls_is_none_not_100_percent():
    r = jr.explain(lambda x: jnp.exp(x).sum(), jnp.ones(3), dtype=jnp.float16)
    assert r.half_flops_share is None and r.to_dict()["totals"]["half_flops_share"] is None
    assert "FLOPs in half precision: none (no matmul or convolution)" in r.summary()


def test_default_dtype_agrees_with_rewrite_off_on_cpu():
    """dtype=None decides as rewrite does: on a CPU the rewrite is off, and the report says
    why instead of showing a float16 rewrite that rewrite(loss) would not do."""
    r = jr.explain(loss, [W1, W2], X)
    assert r.dtype == "none" and not r.changed and r.equations == ()
    assert "rewrite off (runs unchanged)" in str(r) and "default device is a cpu" in str(r)
    assert "dtype=jnp.float16" in r.off_reason  # how to see what a GPU would run
    with pytest.warns(jr.RewriteOffWarning, match="default device is a cpu"):
        out = jr.rewrite(loss)([W1, W2], X)
    assert out == loss([W1, W2], X)


def test_default_dtype_follows_the_seed_api():
    jr.enable_mixed_precision_graph_rewrite(optax.sgd(0.1), dtype=jnp.bfloat16)
    try:
        assert jr.explain(loss, [W1, W2], X).dtype == "bfloat16"
    finally:
        jr.disable_mixed_precision_graph_rewrite()


def test_a_rewritten_function_is_explained_with_its_own_settings(leak_checking):
    """README's first example: explain(jit(rewrite(step))) explains step as rewritten, not
    the already rewritten program (whose matmuls are no longer float32)."""
    lists = jr.default_lists(jnp.float16).move("tanh", to="deny")
    inner = jr.rewrite(loss, dtype=jnp.float16, lists=lists)
    r = jr.explain(jax.jit(inner), [W1, W2], X, residuals=False)
    assert r.dtype == "float16" and r.changed and r.half_flops_share == 1.0
    assert [e.colour for e in r.equations if e.primitive == "tanh"] == ["deny"]
    assert r.explained.startswith("loss, the function inside jit(rewrite(loss, dtype=float16))")
    assert r.summary().splitlines()[0].startswith("explained: loss")
    assert jr.explain(inner, [W1, W2], X, residuals=False).explained.startswith(
        "loss, the function inside rewrite(loss, dtype=float16)"
    )
    # Arguments given to explain win over the rewrite's.
    assert jr.explain(inner, [W1, W2], X, dtype=jnp.bfloat16, residuals=False).dtype == "bfloat16"


def test_a_rewritten_function_called_inside_is_noted():
    inner = jr.rewrite(loss, dtype=jnp.float16)
    r = jr.explain(jax.grad(inner), [W1, W2], X, dtype=jnp.float16)
    assert "rewrite(loss) inside it shows as already rewritten" in r.explained


def test_bad_dtype():
    with pytest.raises(ValueError, match="bfloat16"):
        jr.explain(loss, [W1, W2], X, dtype=np.float64)


def test_html_explains_lists_colours_and_each_reason_in_words():
    from jmp_rewrite._src.explain.html import LIST_MEANINGS

    page = jr.explain(loss, [W1, W2], X, dtype=jnp.float16).to_html()
    assert "Legend: lists and colours" in page
    for meaning in LIST_MEANINGS.values():
        assert html.escape(meaning) in page
    # The reason is a cell of its own, not only a hover title.
    assert "<td>on the allow list</td>" in page and "<td>between half-precision ops</td>" in page
    off = jr.explain(loss, [W1, W2], X).to_html()  # rewrite off on CPU: says why, no table
    assert "rewrite off (runs unchanged)" in off and "<table" not in off
