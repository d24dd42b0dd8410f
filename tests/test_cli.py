"""The command line: ``python -m jmp_rewrite {demo,explain}`` and the demo's pieces."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys
import uuid

import jax
import numpy as np
import pytest

import jmp_rewrite
from jmp_rewrite import demo
from jmp_rewrite._src.cli import main as cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

USER_MODULE = """
import jax.numpy as jnp


def loss(w, x):
    return jnp.tanh(x @ w).sum()


def no_matmul(x):
    return jnp.exp(x).sum()


class Model:
    @staticmethod
    def apply(w, x):
        return x @ w


NOT_A_FUNCTION = 3


def readme_loss(params, x, y):
    import jax, optax
    h = jax.nn.relu(x @ params["w1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"], y).mean()


def example():
    params = {"w1": jnp.full((16, 32), 0.05), "w2": jnp.full((32, 8), 0.05)}
    return readme_loss, (params, jnp.ones((4, 16)), jnp.arange(4))


def example_kwargs():
    return lambda w, *, x: (x @ w).sum(), (jnp.ones((8, 8)),), {"x": jnp.ones((2, 8))}


def example_overflow():
    return lambda w, x: jnp.sum((x @ w) * 1e3), (jnp.ones((64, 64)), jnp.ones((4, 64)))


def not_a_pair():
    return loss


def example_rounding():  # float16 rounds these: relative errors near 1e-3, none beyond 1e-2
    w = jnp.sin(jnp.arange(64 * 64, dtype=jnp.float32)).reshape(64, 64) / 8
    return lambda w, x: jnp.tanh(x @ w), (w, jnp.cos(jnp.arange(4 * 64.0)).reshape(4, 64))
"""


def _run(
    *args: str, cwd: str | None = None, timeout: float = 1800, code: str | None = None
) -> subprocess.CompletedProcess:
    """``python -m jmp_rewrite ARGS`` (or ``python -c CODE``) in a fresh interpreter."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, *(["-c", code] if code else ["-m", "jmp_rewrite"]), *args],
        cwd=cwd or REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A fresh importable module in tmp_path (a unique name: no sys.modules clashes)."""
    name = f"user_mod_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


# --------------------------------------------------------------------------------------------
# The demo, end to end.


def test_demo_end_to_end(tmp_path, capsys):
    """The default model (cnn), float16 + dynamic loss scaling, through the command line."""
    out = tmp_path / "run"
    args = ["demo", "--steps", "20", "--batch-size", "32", "--train-size", "512"]
    args += ["--test-size", "256", "--increment-period", "5", "--out", str(out)]
    assert cli.main(args) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "mixed float16" in captured.err  # the progress
    # Not a terminal: plain lines every tenth of the run, no bar redrawn with carriage returns
    # (a CI log would hold every redraw).
    assert "\r" not in captured.err
    assert "mixed float16: step 20/20, loss " in captured.err
    assert "float32: step 2/20, loss " in captured.err
    # The explain summary of the mixed train step.
    assert "equations in half precision" in text
    assert "in half precision: dot_general x" in text and "conv_general_dilated x" in text
    # The side-by-side table.
    for row in ("train loss", "test loss", "test accuracy", "skipped steps", "final loss scale"):
        assert row in text
    header = next(line for line in text.splitlines() if "float32" in line and "mixed" in line)
    assert header.split() == ["float32", "mixed", "float16"]
    assert "loss-scale trajectory: 2^15 -> 2^16 @6 (growth)" in text
    # The files.
    png = (out / "training.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "explain.html").read_text()
    assert "<table" in page and "conv_general_dilated" in page and "training.png" in page
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics["runs"]) == {"float32", "mixed float16"}
    f32, mixed = metrics["runs"]["float32"], metrics["runs"]["mixed float16"]
    assert len(mixed["losses"]) == 20 and len(mixed["scales"]) == 20
    assert all(np.isfinite(mixed["losses"]))
    # It learns (chance is 10%), and mixed precision tracks float32.
    assert f32["test_accuracies"][-1] > 0.2 and mixed["test_accuracies"][-1] > 0.2
    assert abs(f32["test_losses"][-1] - mixed["test_losses"][-1]) < 0.1 * f32["test_losses"][-1]
    # Every model conv/matmul runs in half precision; the rest of the share is the loss-scale
    # optimizer's finiteness check, which stays float32.
    assert metrics["explain"]["half_flops_share"] > 0.99
    assert metrics["skipped_steps"] == [s + 1 for s, ok in enumerate(mixed["applied"]) if not ok]
    assert f"skipped steps ({len(metrics['skipped_steps'])})" in text


def test_train_mlp_bfloat16_has_no_loss_scaling():
    """The other model and dtype: bfloat16 needs no loss scaling, so none is used."""
    config = demo.DemoConfig(
        model="mlp",
        dtype="bfloat16",
        steps=8,
        batch_size=32,
        train_size=256,
        test_size=128,
        progress=False,
    )
    x_train, y_train = demo.make_dataset(config.train_size)
    x_test, y_test = demo.make_dataset(config.test_size, seed=1)
    model = demo.make_model("mlp", config.image_size, seed=0)
    result, step, example = demo.train(
        config, (x_train, y_train, x_test, y_test), model, mixed=True
    )
    assert result.name == "mixed bfloat16"
    assert result.scales == [] and result.final_scale is None and all(result.applied)
    assert result.losses[-1] < result.losses[0]
    assert result.eval_steps == [1, 2, 3, 4, 5, 6, 7, 8]
    assert 0.0 <= result.test_accuracies[-1] <= 1.0
    report = jmp_rewrite.paint(step, *example, dtype="bfloat16")
    assert set(report.colours("dot_general")) == {"allow"}


def test_demo_config_loss_scale_choices():
    assert isinstance(demo.DemoConfig().loss_scale_rule(), jmp_rewrite.DynamicLossScale)
    assert demo.DemoConfig(dtype="bfloat16").loss_scale_rule() is None
    assert demo.DemoConfig(dtype="bfloat16", loss_scale="dynamic").loss_scale_rule() is not None
    assert demo.DemoConfig(loss_scale="none").loss_scale_rule() is None
    assert demo.DemoConfig(loss_scale="1024").loss_scale_rule() == 1024.0
    rule = demo.DemoConfig(initial_scale=8, increment_period=3).loss_scale_rule()
    assert (rule.initial_loss_scale, rule.increment_period) == (8, 3)


WITHOUT_FLAX = """
import sys
sys.modules["flax"] = None  # as if flax were not installed: importing it raises ImportError
import jmp_rewrite
import jmp_rewrite.demo as demo
from jmp_rewrite._src.cli import main as cli
assert demo.DemoConfig().model == "cnn" and len(demo.make_dataset(4)[0]) == 4
try:
    demo.run_demo
except ImportError as e:
    print("run_demo:", e)
raise SystemExit(cli.main(sys.argv[1:]))
"""


def test_demo_without_flax_says_what_to_install():
    """flax is an extra: jmp_rewrite, the CLI and the demo's options import without it."""
    proc = _run("demo", "--steps", "1", code=WITHOUT_FLAX)
    assert proc.returncode == 1, proc.stderr
    hint = "pip install 'jmp_rewrite[demo]'"
    assert proc.stderr.strip() == (
        "python -m jmp_rewrite demo: error: the jmp_rewrite demo needs flax, which is not "
        f"installed; install the demo's dependencies with: {hint}"
    )
    assert proc.stdout.startswith("run_demo: the jmp_rewrite demo needs flax") and hint in (
        proc.stdout
    )


def test_demo_uses_only_public_names():
    """The demo is an application of the library: no jmp_rewrite._src, only exported names."""
    public = set(jmp_rewrite.__all__) | {"__version__"}
    used = set()
    for path in sorted(pathlib.Path(REPO, "jmp_rewrite", "demo").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jmp_rewrite"):
                assert node.module == "jmp_rewrite" or node.module.startswith("jmp_rewrite.demo"), (
                    f"{path.name} imports {node.module}"
                )
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("jmp_rewrite._src"), path.name
            if isinstance(node, ast.Attribute) and getattr(node.value, "id", "") == "jmp_rewrite":
                assert node.attr in public, f"{path.name} uses jmp_rewrite.{node.attr}"
                used.add(node.attr)
    assert {"rewrite", "explain", "loss_scale_optimizer", "value_and_grad"} <= used


# --------------------------------------------------------------------------------------------
# --help and argument errors.


def test_help(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "demo" in text and "explain" in text and "compare" in text and "--factory" in text


def test_demo_help_lists_options(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for option in ("--dtype", "--steps", "--model", "--out", "--seed", "--batch-size"):
        assert option in text
    assert "float16" in text and "bfloat16" in text and "cnn" in text and "mlp" in text


def test_explain_help(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["explain", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "MODULE:FUNCTION" in text and "--shapes" in text and "--json" in text


def test_no_subcommand_is_an_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([])
    assert exc.value.code == 2
    assert "required" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "resnet"], "invalid choice: 'resnet'"),
        (["--dtype", "float32"], "invalid choice: 'float32'"),
        (["--steps", "0"], "expected a positive integer"),
        (["--batch-size", "many"], "expected a positive integer"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_demo_bad_arguments_argparse(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--loss-scale", "huge"], "--loss-scale must be 'dynamic', 'none' or a positive number"),
        (["--loss-scale", "-4"], "--loss-scale must be a positive finite number"),
        (["--image-size", "10"], "--image-size must be a multiple of 4"),
        (["--lr", "0"], "--lr must be > 0"),
        (["--initial-scale", "nan"], "--initial-scale must be a finite number >= 1"),
    ],
)
def test_demo_bad_arguments_validated(args, message, capsys):
    assert cli.main(["demo", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "usage:" in err


# --------------------------------------------------------------------------------------------
# explain MODULE:FUNCTION


def test_explain_prints_report(user_module, capsys):
    assert cli.main(["explain", f"{user_module}:loss", "--shapes", "f32[8,16], f32[4,8]"]) == 0
    out = capsys.readouterr().out
    assert "dtype: float16" in out
    assert "equations in half precision: 2 / 3" in out
    assert "dot_general" in out and "casts inserted" in out


def test_explain_json_html_and_options(user_module, tmp_path, capsys):
    html_path = tmp_path / "reports" / "loss.html"
    code = cli.main(
        [
            "explain",
            f"{user_module}:loss",
            "--shapes",
            "f32[8,16],f32[4,8]",
            "--dtype",
            "bfloat16",
            "--json",
            "--html",
            str(html_path),
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["dtype"] == "bfloat16"
    # bfloat16's lists put reduce_sum on infer (float16's on deny): all 3 equations convert.
    assert data["totals"]["converted"] == 3 and data["totals"]["equations"] == 3
    assert "<table" in html_path.read_text() and str(html_path) in captured.err


def test_explain_summary_level_and_dotted_attribute(user_module, capsys):
    args = ["explain", f"{user_module}:Model.apply", "--shapes", "f16[2,2],f32[3,2]"]
    assert cli.main([*args, "--summary", "--level", "tensor_cores_only"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dtype: float16") and "dot_general" not in out


def test_explain_file_path_target(user_module, capsys):
    assert cli.main(["explain", f"{user_module}.py:no_matmul", "--shapes", "f32[3]"]) == 0
    assert "no allowlist op: unchanged" in capsys.readouterr().out


def test_explain_factory_describes_functions_of_pytrees(user_module, capsys):
    """The README's loss(params, x, y) with dict params: --shapes cannot say it, a factory can."""
    assert cli.main(["explain", "--factory", f"{user_module}:example", "--summary"]) == 0
    out = capsys.readouterr().out
    assert "dtype: float16" in out and "FLOPs in half precision: 100.0%" in out
    assert cli.main(["explain", "--factory", f"{user_module}:example_kwargs", "--summary"]) == 0
    assert "FLOPs in half precision: 100.0%" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--factory", "{m}:not_a_pair"], "must return (fn, args) or (fn, args, kwargs)"),
        (["--factory", "{m}:NOT_A_FUNCTION"], "is not callable"),
        (["{m}:loss", "--factory", "{m}:example"], "--factory gives the function"),
        ([], "name MODULE:FUNCTION (with --shapes) or --factory"),
    ],
)
def test_explain_factory_errors(user_module, args, message, capsys):
    assert cli.main(["explain", *(a.format(m=user_module) for a in args)]) == 2
    assert message in capsys.readouterr().err


def test_compare_prints_errors_and_suggestions(user_module, capsys):
    args = ["compare", "--factory", f"{user_module}:example_overflow", "--json"]
    assert cli.main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["dtype"] == "float16" and data["equations"]
    assert cli.main(["compare", f"{user_module}:loss", "--shapes", "f32[8,16],f32[4,8]"]) == 0
    out = capsys.readouterr().out
    assert "dot_general" in out and "rel" in out.lower()


@pytest.mark.parametrize("given", ["1e-9", "0.5", None])
def test_compare_uses_the_tolerance_given(user_module, capsys, given):
    """``--tolerance`` is the tolerance the comparison judges by (float16's default 1e-2
    otherwise): reported, and every equation whose error is past it, and only those, is
    marked as exceeding."""
    args = ["compare", "--factory", f"{user_module}:example_rounding", "--json"]
    assert cli.main(args + (["--tolerance", given] if given else [])) == 0
    data = json.loads(capsys.readouterr().out)
    tol = float(given or 1e-2)
    assert data["tolerance"] == tol
    errors = [e["rel_error"] for e in data["equations"]]
    assert max(errors) > 1e-5 and all(e < 1e-2 for e in errors), errors
    assert [e["exceeds"] for e in data["equations"]] == [e > tol for e in errors]
    assert (data["first_exceeding"] is not None) == (tol < 1e-5)
    assert cli.main(args[:-1] + (["--tolerance", given] if given else [])) == 0
    assert f"compare: float16 vs float32, tolerance {tol:g}\n" in capsys.readouterr().out


@pytest.mark.parametrize("given", ["0", "-1e-3", "nan", "inf", "abc", "1e-3x"])
def test_compare_refuses_a_bad_tolerance(user_module, capsys, given):
    """A bad ``--tolerance`` is a usage error naming the value and what is allowed, before
    the inputs are built."""
    args = ["compare", "--factory", f"{user_module}:example_rounding", f"--tolerance={given}"]
    with pytest.raises(SystemExit) as exc:  # argparse's own usage error
        cli.main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "argument --tolerance: expected a positive finite number" in err
    assert f"(a relative error, e.g. 1e-3), got {given!r}" in err


def test_explain_subprocess_imports_from_cwd(tmp_path):
    (tmp_path / "cli_user_fn.py").write_text(USER_MODULE)
    proc = _run("explain", "cli_user_fn:loss", "--shapes", "f32[8,16],f32[4,8]", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "equations in half precision: 2 / 3" in proc.stdout


@pytest.mark.parametrize(
    ("target", "shapes", "message"),
    [
        ("{m}", "f32[2]", "expected MODULE:FUNCTION"),
        ("{m}:", "f32[2]", "expected MODULE:FUNCTION"),
        ("no_such_module_xyz:f", "f32[2]", "cannot import module 'no_such_module_xyz'"),
        ("missing_file_xyz.py:f", "f32[2]", "no such file: missing_file_xyz.py"),
        (
            "{m}:lost",
            "f32[2]",
            "has no attribute 'lost'; callables there: Model, example, ",
        ),
        ("{m}:Model.fit", "f32[2]", "{m}:Model has no attribute 'fit'"),
        ("{m}:NOT_A_FUNCTION", "f32[2]", "{m}:NOT_A_FUNCTION is not callable: 3 (int)"),
        ("{m}:loss", "f32[8,x]", "bad dimension 'x' in 'f32[8,x]'"),
        ("{m}:loss", "f32[-1]", "bad dimension '-1'"),
        ("{m}:loss", "q7[3]", "unknown dtype 'q7'"),
        ("{m}:loss", "f32[8", "cannot parse shape spec at 'f32[8'"),
        ("{m}:loss", "f32[2];f32[2]", "expected ',' after 'f32[2]'"),
        ("{m}:loss", "f32[2],", "trailing ','"),
        ("{m}:loss", " ", "--shapes is empty"),
        ("{m}:loss", "f64[2]", "64-bit dtypes need JAX_ENABLE_X64=1"),
    ],
)
def test_explain_bad_arguments(user_module, capsys, target, shapes, message):
    target = target.format(m=user_module)
    assert cli.main(["explain", target, "--shapes", shapes]) == 2
    err = capsys.readouterr().err
    assert message.format(m=user_module) in err
    assert "usage:" in err


def test_explain_function_that_fails_to_trace(user_module, capsys):
    code = cli.main(["explain", f"{user_module}:loss", "--shapes", "f32[8,16],f32[4,9]"])
    assert code == 1
    err = capsys.readouterr().err
    assert f"error: explaining {user_module}:loss at (float32[8, 16], float32[4, 9]) failed" in err
    assert "TypeError" in err


def test_explain_bad_arguments_subprocess(tmp_path):
    proc = _run("explain", "nowhere_xyz:f", "--shapes", "f32[2]", cwd=tmp_path)
    assert proc.returncode == 2
    assert "cannot import module 'nowhere_xyz'" in proc.stderr
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------------------------
# Pieces.


def test_parse_shapes():
    specs = cli.parse_shapes("f32[8,16], bf16[ 4 ], i32[], bool[2,0], float16[1]")
    assert [s.shape for s in specs] == [(8, 16), (4,), (), (2, 0), (1,)]
    assert [str(s.dtype) for s in specs] == ["float32", "bfloat16", "int32", "bool", "float16"]
    assert all(isinstance(s, jax.ShapeDtypeStruct) for s in specs)


def test_make_dataset_is_deterministic_and_balanced():
    x1, y1 = demo.make_dataset(500, seed=3)
    x2, y2 = demo.make_dataset(500, seed=3)
    x3, _ = demo.make_dataset(500, seed=4)
    assert x1.shape == (500, 16, 16, 1) and x1.dtype == np.float32 and y1.dtype == np.int32
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
    assert not np.array_equal(x1, x3)
    counts = np.bincount(y1, minlength=len(demo.CLASS_NAMES))
    assert counts.min() > 25
    # Class means differ: the images carry their label.
    means = np.stack([x1[y1 == k].mean(0) for k in range(len(demo.CLASS_NAMES))])
    assert np.ptp(means.reshape(10, -1), axis=0).max() > 0.2


def test_make_model_is_deterministic():
    a = demo.make_model("mlp", 8, seed=1)
    b = demo.make_model("mlp", 8, seed=1)
    np.testing.assert_array_equal(a.fc1.kernel[...], b.fc1.kernel[...])
    assert float(a.bn1.var[...].min()) == 1.0 and float(a.fc1.bias[...].max()) == 0.0
    with pytest.raises(ValueError, match="unknown model 'vit'"):
        demo.make_model("vit", 8, seed=0)


def _result(scales, applied):
    n = len(applied)
    return demo.RunResult(
        "mixed float16",
        [1.0] * n,
        scales,
        applied,
        [n],
        [1.0],
        [0.5],
        scales[-1] if scales else None,
        0.0,
        1.0,
    )


def test_scale_events_and_trajectory():
    r = _result([8.0, 8.0, 16.0, 16.0, 8.0, 8.0], [True, True, True, False, True, True])
    assert demo.scale_events(r) == [(1, 8.0, "initial"), (3, 16.0, "growth"), (5, 8.0, "overflow")]
    assert demo.trajectory_text(r) == "2^3 -> 2^4 @3 (growth) -> 2^3 @5 (overflow)"
    assert r.skipped_steps == [3]
    assert demo.trajectory_text(_result([], [True])) == "no loss scaling"


def test_comparison_table_aligns_columns():
    f32 = _result([], [True, True])
    f32.name = "float32"
    mixed = _result([4.0, 2.0], [False, True])
    lines = demo.comparison_table(f32, mixed).splitlines()
    assert len({len(line) for line in lines}) == 1
    assert any(line.startswith("skipped steps") and line.endswith(" 1") for line in lines)
    assert any(line.startswith("final loss scale") and line.endswith("2^1") for line in lines)
