"""explain's readable views: scopes and source lines (Flax NNX, Linen, Haiku), phases, the
cost per group, the lint, the text and HTML renderings and ``explain --by``."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
import uuid

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jmp_rewrite as jr
from jmp_rewrite._src.cli import main as cli
from jmp_rewrite._src.explain import view as explain_view
from jmp_rewrite._src.trace import source_info

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

HERE = os.path.abspath(__file__)


def line_of(fun, marker: str) -> str:
    """``file:line`` of the line of ``fun``'s source that contains ``marker``."""
    lines, start = inspect.getsourcelines(fun)
    hits = [start + i for i, text in enumerate(lines) if marker in text]
    assert len(hits) == 1, (marker, hits)
    return f"{HERE}:{hits[0]}"


def by_scope(report, primitive: str, phase: str = "forward") -> dict[str, list]:
    out: dict[str, list] = {}
    for e in report.equations:
        if e.primitive == primitive and e.phase == phase:
            out.setdefault(e.scope, []).append(e)
    return out


# --------------------------------------------------------------------------------------------
# Models.


class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(8, 16, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.hidden(x))  # nnx hidden
        return self.out(h)  # nnx out


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16)(x)  # linen hidden
        h = nn.gelu(h)  # linen gelu
        return nn.Dense(4)(h)  # linen out


def haiku_net(x):
    h = hk.Linear(16, name="encoder")(x)  # haiku encoder
    h = jax.nn.relu(h)
    with jax.named_scope("head"):
        return hk.nets.MLP([8, 4])(h)  # haiku head


X = jnp.ones((4, 8))


def test_flax_nnx_scopes_come_from_attributes_and_lines_from_frames():
    model = NnxMLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model)

    def loss(params, x):
        y = nnx.merge(graphdef, params)(x)  # nnx call
        return jnp.mean(y**2)

    def step(params, x):
        return jax.grad(loss)(params, x)

    r = jr.explain(step, params, X, dtype=jnp.float16)
    fwd, bwd = by_scope(r, "dot_general"), by_scope(r, "dot_general", "backward")
    # NNX pushes no names: the scope is the attribute each Linear is called through, under
    # the class of the model called by a bare name.
    assert sorted(fwd) == ["NnxMLP/hidden", "NnxMLP/out"]
    assert sorted(bwd) == ["NnxMLP/hidden", "NnxMLP/out"]
    assert len(bwd["NnxMLP/out"]) == 2 and len(bwd["NnxMLP/hidden"]) == 1  # no dx of the data
    hidden_line = line_of(NnxMLP.__call__, "# nnx hidden")
    assert [e.source for e in fwd["NnxMLP/hidden"]] == [hidden_line]
    assert {e.source for e in bwd["NnxMLP/out"]} == {line_of(NnxMLP.__call__, "# nnx out")}
    # relu (jit inside custom_jvp) sits in the model, on its line
    relu = [e for e in r.equations if e.primitive == "max" and e.phase == "forward"]
    assert [(e.scope, e.source) for e in relu] == [("NnxMLP", hidden_line)]
    groups = {g.key: g for g in r.groups("line")}
    assert groups[hidden_line].scopes == ["NnxMLP/hidden", "NnxMLP"]
    assert set(groups[hidden_line].phases) == {"forward", "backward"}


def test_flax_linen_scopes_strip_transforms_and_split_phases():
    model = LinenMLP()
    params = model.init(jax.random.key(0), X)
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)

    def step(params, opt_state, x):
        grads = jax.grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)  # linen update
        return optax.apply_updates(params, updates), opt_state

    r = jr.explain(step, params, opt_state, X, dtype=jnp.float16)
    fwd, bwd = by_scope(r, "dot_general"), by_scope(r, "dot_general", "backward")
    # "jvp(LinenMLP)/Dense_0" and "transpose(jvp(LinenMLP))/Dense_1" lose their wrappers
    assert sorted(fwd) == sorted(bwd) == ["LinenMLP/Dense_0", "LinenMLP/Dense_1"]
    assert fwd["LinenMLP/Dense_1"][0].source == line_of(LinenMLP.__call__, "# linen out")
    tanh = [e for e in r.equations if e.primitive == "tanh"]
    assert [(e.scope, e.source) for e in tanh] == [
        ("LinenMLP", line_of(LinenMLP.__call__, "# linen gelu"))
    ]
    update_line = line_of(step, "# linen update")
    optimizer = [e for e in r.equations if e.phase == "optimizer"]
    assert optimizer and {e.scope for e in optimizer} == {""}
    assert update_line in {e.source for e in optimizer}
    assert not any(e.half for e in optimizer if e.primitive == "sqrt")
    # Every equation is in exactly one phase; the totals add up.
    totals = explain_view.phase_totals(r)
    assert list(totals) == ["forward", "backward", "optimizer"]
    assert sum(s.equations for s in totals.values()) == r.total
    assert sum(s.half for s in totals.values()) == len(r.converted)


def test_haiku_module_names_and_named_scopes():
    net = hk.without_apply_rng(hk.transform(haiku_net))
    params = net.init(jax.random.key(0), X)
    r = jr.explain(jax.grad(lambda p, x: net.apply(p, x).sum()), params, X, dtype=jnp.float16)
    fwd, bwd = by_scope(r, "dot_general"), by_scope(r, "dot_general", "backward")
    expected = ["encoder", "head/mlp/linear_0", "head/mlp/linear_1"]
    assert sorted(fwd) == sorted(bwd) == expected
    assert fwd["encoder"][0].source == line_of(haiku_net, "# haiku encoder")
    assert fwd["head/mlp/linear_1"][0].source == line_of(haiku_net, "# haiku head")
    tree = {g.key: g for g in r.groups("scope")}
    assert tree["head/mlp/linear_0"].total.half_flops == tree["head/mlp/linear_0"].total.flops
    assert set(tree["encoder"].phases) == {"forward", "backward"}


def test_equinox_layers_named_by_attribute():
    """Equinox's layers push only their class name (``eqx.nn.Linear``) on the name stack:
    the attribute they are called through tells them apart."""
    eqx = pytest.importorskip("equinox")

    class Net(eqx.Module):
        first: eqx.nn.Linear
        second: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.first = eqx.nn.Linear(8, 16, key=k1)
            self.second = eqx.nn.Linear(16, 4, key=k2)

        def __call__(self, x):
            return self.second(jax.nn.relu(self.first(x)))  # eqx call

    def loss(net, x):
        return jnp.mean(jax.vmap(net)(x) ** 2)

    r = jr.explain(eqx.filter_grad(loss), Net(jax.random.key(0)), X, dtype=jnp.float16)
    fwd, bwd = by_scope(r, "dot_general"), by_scope(r, "dot_general", "backward")
    assert sorted(fwd) == sorted(bwd) == ["Net/first", "Net/second"]
    assert fwd["Net/first"][0].source == line_of(Net.__call__, "# eqx call")


def test_loss_scaled_step_keeps_the_forward_pass_forward():
    """``jmp_rewrite.value_and_grad`` wraps the loss from the loss-scale optimizer's module:
    only code below the user's frame (``tx.update``) is the optimizer."""
    model = LinenMLP()
    params = model.init(jax.random.key(0), X)
    tx = jr.loss_scale_optimizer(optax.sgd(0.1))
    state = tx.init(params)

    def step(params, state, x):
        loss = lambda p: jnp.mean(model.apply(p, x) ** 2)  # noqa: E731
        _, grads = jr.value_and_grad(loss)(state, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    r = jr.explain(step, params, state, X, dtype=jnp.float16)
    phases = {e.phase for e in r.equations if e.scope.startswith("LinenMLP")}
    assert phases == {"forward", "backward"}
    region = [e for e in r.equations if e.in_float32_region]
    assert region and {e.phase for e in region} == {"optimizer"}
    assert {e.scope for e in region} == {
        "float32_region(loss_scale_optimizer_update)",
        "float32_region(loss_scale_optimizer_update)/check_finite",  # the check's own scope
    }


def test_nested_jit_bodies_join_scope_and_source_of_their_caller():
    def f(x):
        with jax.named_scope("block"):
            h = jnp.where(x > 0, x, 0.1 * x) @ jnp.ones((8, 8))  # where line
        return h.sum()

    r = jr.explain(f, X, dtype=jnp.float16)
    select = [e for e in r.equations if e.primitive == "select_n"]
    assert [(e.path, e.scope, e.source) for e in select] == [
        ("jit/select_n", "block", line_of(f, "# where line"))
    ]


def test_split_name_stack():
    split = source_info.split_name_stack
    assert split("transpose(jvp(MLP))/Dense_1") == (("MLP", "Dense_1"), True)
    assert split("jvp()") == ((), False)
    assert split("vmap(jvp(head))/mlp/linear_0") == (("head", "mlp", "linear_0"), False)
    assert split("") == ((), False)


# --------------------------------------------------------------------------------------------
# Cost, casts and groups.


def test_bytes_flops_and_casts_per_group():
    def f(w, x):
        with jax.named_scope("dense"):
            h = x @ w
        return jnp.exp(h).sum()

    w = jnp.ones((8, 16))
    r = jr.explain(f, w, X, dtype=jnp.float16)
    groups = {g.key: g for g in r.groups("scope")}
    dense, top = groups["dense"].total, groups[""].total
    assert (dense.equations, dense.half, dense.casts) == (1, 1, 2)  # x and w cast to f16
    assert (dense.bytes_half, dense.bytes_float32) == (4 * 16 * 2, 0)
    assert dense.flops == dense.half_flops == 2 * 4 * 16 * 8
    # exp reads the f16 product through a cast and writes float32; the sum a float32 scalar
    assert (top.equations, top.half, top.casts) == (2, 0, 1)
    assert (top.bytes_half, top.bytes_float32) == (0, 4 * 16 * 4 + 4)
    assert sum(g.total.casts for g in groups.values()) == len(r.casts)
    prims = {g.key: g.total for g in r.groups("primitive")}
    assert prims["dot_general"].half == 1 and prims["exp"].half == 0
    with pytest.raises(ValueError, match="by='layer'.*scope, line, primitive"):
        r.groups("layer")


def test_bytes_count_scan_trips():
    def f(w, x):
        def body(c, _):
            return jnp.tanh(c @ w), None

        return jax.lax.scan(body, x, None, length=5)[0].sum()

    r = jr.explain(f, jnp.ones((8, 8)), X, dtype=jnp.float16)
    dot = next(e for e in r.equations if e.path == "scan/body/dot_general")
    assert dot.trips == 5
    assert explain_view.produced_bytes(dot) == (0, 5 * 4 * 8 * 2)


# --------------------------------------------------------------------------------------------
# Lint.


class Wide(nnx.Module):
    """A 100-wide hidden layer and tanh-GELU between two matmuls."""

    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(64, 100, rngs=rngs)
        self.down = nnx.Linear(100, 64, rngs=rngs)

    def __call__(self, x):
        h = self.up(x)  # wide up
        h = h * (1.0 + 0.044715 * h**3)  # wide gate
        return self.down(h)  # wide down


def test_lint_tensor_core_shapes_and_power_deny_chain():
    graphdef, params = nnx.split(Wide(nnx.Rngs(0)))

    def loss(params, x):
        return jnp.mean(nnx.merge(graphdef, params)(x) ** 2)

    x = jnp.ones((32, 64))
    r = jr.explain(loss, params, x, dtype=jnp.float16)
    found = r.lint()
    cores = [f for f in found if f.kind == "tensor_cores"]
    assert [(f.scope, f.source) for f in cores] == [
        ("Wide/up", line_of(Wide.__call__, "# wide up")),
        ("Wide/down", line_of(Wide.__call__, "# wide down")),
    ]
    assert "output features 100" in cores[0].message and "f16[64,100]" in cores[0].message
    assert "contracting 100" in cores[1].message and "output features" not in cores[1].message
    assert cores[0].change.endswith("output features 100 -> 104")
    assert cores[0].flops == 2 * 32 * 64 * 100
    # the gate's x**3 (integer_pow, deny) keeps the chain between the matmuls float32 (a
    # tanh-GELU's x**3 would not: it only feeds the tanh, where an overflow saturates)
    chains = [f for f in found if f.kind == "deny_chain"]
    assert [f.change for f in chains] == ['lists.move("integer_pow", to="infer")']
    chain = chains[0]
    assert chain.source == line_of(Wide.__call__, "# wide gate") and chain.scope == "Wide"
    assert "40" in chain.risk  # overflows half for |x| > 40
    gate_line = line_of(Wide.__call__, "# wide gate")
    gate = next(e for e in r.equations if e.primitive == "add" and e.source == gate_line)
    assert not gate.half and gate.released_by == ("integer_pow",)
    # The promise holds: with that one change the released equations run in half precision.
    moved = jr.explain(
        loss,
        params,
        x,
        dtype=jnp.float16,
        lists=jr.default_lists(jnp.float16).move("integer_pow", to="infer"),
    )
    released = [i for i, e in enumerate(r.equations) if e.released_by]
    assert len(released) == len(chain.equations) >= 4  # x**3, its scaling, the gate
    assert all(moved.equations[i].half for i in released)
    assert chain.bytes == sum(explain_view.produced_bytes(r.equations[i])[0] for i in released)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_lint_is_quiet_on_aligned_float32_safe_programs(dtype):
    # A dtype is given: with dtype=None this CPU runs the program unchanged, and lint says
    # to lint what a TPU or CUDA lowering runs (off_here, issue 37.3).
    args = (jnp.ones((64, 128)), jnp.ones((16, 64)))
    r = jr.explain(lambda w, x: jnp.tanh(x @ w), *args, dtype=dtype)
    assert r.lint() == []
    assert "nothing to change" in r.format()
    assert str(r.lint()) == "no findings: nothing to change"
    off = jr.explain(lambda w, x: jnp.tanh(x @ w), *args)
    assert [f.kind for f in off.lint()] == ["off_here"]


def test_printed_lint_findings_read_as_text_not_as_dataclass_reprs():
    graphdef, params = nnx.split(Wide(nnx.Rngs(0)))
    r = jr.explain(
        lambda p, x: jnp.mean(nnx.merge(graphdef, p)(x) ** 2),
        params,
        jnp.ones((32, 64)),
        dtype=jnp.float16,
    )
    found = r.lint()
    assert isinstance(found, list) and len(found) >= 3
    printed = str(found)
    assert "Finding(" not in printed and "equations=" not in printed
    lines = printed.splitlines()
    assert len(lines) == 2 * len(found)  # one finding per line, its change below it
    for f, head, change in zip(found, lines[::2], lines[1::2], strict=True):
        assert str(f) == f"{head}\n{change}"
        assert head.startswith(f"[{f.kind}] {f.message}")
        assert change == f"    change: {f.change}" + (f"; risk: {f.risk}" if f.risk else "")
    assert "(tensor cores need multiples of 8 in half precision)" in lines[0]
    # format() shows the same text, indented under its "lint (n findings):" heading
    assert "\n".join("  " + line for line in lines) in r.format()


# --------------------------------------------------------------------------------------------
# Renderings.


def _linen_step_report():
    model = LinenMLP()
    params = model.init(jax.random.key(0), X)

    def step(params, x):
        grads = jax.grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return jr.explain(step, params, X, dtype=jnp.float16)


def test_text_view():
    r = _linen_step_report()
    text = r.format("scope")
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("scope"))
    assert lines[header].split()[:3] == ["scope", "phase", "eqns"]
    dense0 = next(line for line in lines if line.startswith("LinenMLP/Dense_0"))
    assert dense0.split()[1:4] == ["forward", "3", "100%"]
    assert lines[lines.index(dense0) + 1].split()[0] == "backward"
    assert "lint (" in text and 'lists.move("reduce_sum", to="infer")' in text
    by_line = r.format("line")
    assert f"{os.path.relpath(HERE)}:" in by_line and "LinenMLP/Dense_0" in by_line


def test_html_tree():
    r = _linen_step_report()
    page = r.to_html()
    assert page == r._repr_html_()
    assert page.count('<tr class="eq"') == len(r.equations)
    # root scope open, sub-scopes nested inside it, each with its summary
    root = page.index("<details open><summary><span class='name'>LinenMLP</span>")
    dense0 = page.index("<span class='name'>Dense_0</span>")
    assert root < dense0 and page.count("<details") >= 4
    assert "Lint: " in page and "fwd " in page and "bwd " in page
    assert 'title="allow op, painted by add_allowlist_ops"' in page
    assert f"{os.path.relpath(HERE)}:" in page and "padding:3px 10px" in page


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium not installed")
def test_html_renders_in_headless_chromium(tmp_path):
    page = tmp_path / "explain.html"
    body = _linen_step_report().to_html()
    page.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>{body}")
    shot = tmp_path / "shot.png"
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu"]
    dom = subprocess.run(
        [*cmd, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120
    )
    assert dom.returncode == 0 and "Dense_0" in dom.stdout and "<details" in dom.stdout
    subprocess.run(
        [*cmd, f"--screenshot={shot}", "--window-size=1200,800", page.as_uri()],
        capture_output=True,
        timeout=120,
        check=True,
    )
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000  # not a blank page


def test_cli_by(tmp_path, monkeypatch, capsys):
    name = f"by_mod_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "import jax, jax.numpy as jnp\n\n\ndef loss(w, x):\n"
        '    with jax.named_scope("dense"):\n        h = x @ w\n    return jnp.tanh(h).sum()\n'
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        for by, first in [("scope", "dense"), ("line", f"{name}.py:6"), ("primitive", "dot")]:
            args = ["explain", f"{name}:loss", "--shapes", "f32[8,100],f32[4,8]", "--by", by]
            assert cli.main(args) == 0
            out = capsys.readouterr().out
            rows = out.split("\n\n")[1].splitlines()
            assert rows[0].startswith(by) and rows[1].startswith(first)
            assert "output features 100 not a multiple of 8" in out
        with pytest.raises(SystemExit) as exc:
            cli.main(["explain", f"{name}:loss", "--shapes", "f32[2,2]", "--by", "x"])
        assert exc.value.code == 2
    finally:
        sys.modules.pop(name, None)
    assert "invalid choice: 'x'" in capsys.readouterr().err


def test_equation_report_fields_in_json():
    f = lambda w, x: (x @ w).sum()  # noqa: E731  json line
    r = jr.explain(f, jnp.ones((8, 100)), X, dtype=jnp.float16)
    data = json.loads(json.dumps(r.to_dict()))["equations"][0]
    assert data["tensor_dims"] == [["contracting", 8], ["output features", 100]]
    assert data["in_shapes"] == [[4, 8], [8, 100]] and data["out_shapes"] == [[4, 100]]
    assert (data["phase"], data["scope"], data["key"]) == ("forward", "", "dot_general")
    assert data["source"] == line_of(test_equation_report_fields_in_json, "json" + " line")
