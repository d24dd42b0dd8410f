"""The command line: ``python -m jmp_rewrite {demo,explain,compare}``.

* ``demo``: trains a small model in float32 and in mixed precision and compares them (see
  :mod:`jmp_rewrite.demo`); ``make demo`` runs it.
* ``explain MODULE:FUNCTION --shapes "f32[8,16],f32[16]"``: prints
  :func:`jmp_rewrite.explain`'s report for a function of the user's, traced at those shapes
  (``--by scope|line|primitive``: grouped, with the lint). ``--factory MODULE:FUNCTION``
  instead names a function returning ``(fn, args)``, for arguments that are pytrees.
* ``compare``: the same inputs, run through :func:`jmp_rewrite.compare` (float32 against the
  rewrite, equation by equation, with suggested list changes).

Errors in the arguments (an unknown option, a bad shape spec, a module or function that cannot
be found, a factory that returns something else) print a one-line message and exit with status
2; a function that fails to trace or run exits with status 1.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from jmp_rewrite._src.cli.inputs import (
    DTYPE_ALIASES,
    UsageError,
    concrete,
    load_factory,
    load_function,
    parse_shapes,
)

__all__ = ["DTYPE_ALIASES", "UsageError", "build_parser", "load_function", "main", "parse_shapes"]

# --------------------------------------------------------------------------------------------
# Subcommands.


def _inputs(args: argparse.Namespace, run: bool) -> tuple[Any, tuple, dict, str]:
    """The function, its arguments and a label, from TARGET --shapes or --factory."""
    if args.factory is not None:
        if args.target is not None or args.shapes is not None:
            raise UsageError("--factory gives the function and its arguments: drop TARGET/--shapes")
        fun, fargs, fkwargs = load_factory(args.factory)
        return fun, fargs, fkwargs, args.factory
    if args.target is None:
        raise UsageError("name MODULE:FUNCTION (with --shapes) or --factory MODULE:FUNCTION")
    fun = load_function(args.target)
    shapes = parse_shapes(args.shapes) if args.shapes is not None else []
    return fun, tuple(concrete(shapes) if run else shapes), {}, args.target


def _describe(fargs: tuple, fkwargs: dict) -> str:
    import jax

    leaves = jax.tree.leaves((fargs, fkwargs))
    shown = ", ".join(
        f"{getattr(x, 'dtype', type(x).__name__)}{list(getattr(x, 'shape', ()))}"
        for x in leaves[:6]
    )
    return (shown + (f", ... ({len(leaves)} arrays)" if len(leaves) > 6 else "")) or "no arguments"


def _cmd_explain(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    import jmp_rewrite

    fun, fargs, fkwargs, label = _inputs(args, run=False)
    try:
        report = jmp_rewrite.explain(
            fun, *fargs, dtype=jnp.dtype(args.dtype), level=args.level, **fkwargs
        )
    except Exception as e:  # the user's function failed to trace at these arguments
        print(
            f"error: explaining {label} at ({_describe(fargs, fkwargs)}) failed: "
            f"{type(e).__name__}: {e}",
            file=sys.stderr,
        )
        return 1
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    elif args.summary:
        print(report.summary())
    elif args.by:
        print(report.format(args.by))
    else:
        print(report)
    if args.html:
        title = html.escape(f"jmp_rewrite explain {label}")
        page = (
            "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
            f"<title>{title}</title></head><body>"
            f"<h1>{title}</h1>{report._repr_html_()}</body></html>\n"
        )
        directory = os.path.dirname(args.html)
        if directory:
            os.makedirs(directory, exist_ok=True)
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(page)
        print(f"wrote {args.html}", file=sys.stderr)
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    import jmp_rewrite

    fun, fargs, fkwargs, label = _inputs(args, run=True)
    try:
        result = jmp_rewrite.compare(
            fun,
            *fargs,
            dtype=jnp.dtype(args.dtype),
            level=args.level,
            tolerance=args.tolerance,
            **fkwargs,
        )
    except Exception as e:  # the user's function failed to trace or run
        print(
            f"error: comparing {label} at ({_describe(fargs, fkwargs)}) failed: "
            f"{type(e).__name__}: {e}",
            file=sys.stderr,
        )
        return 1
    print(json.dumps(result.to_dict(), indent=1) if args.json else result)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from jmp_rewrite import demo

    config = demo.DemoConfig(
        model=args.model,
        dtype=args.dtype,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        out=args.out,
        train_size=args.train_size,
        test_size=args.test_size,
        image_size=args.image_size,
        loss_scale=args.loss_scale,
        initial_scale=args.initial_scale,
        increment_period=args.increment_period,
        eval_every=args.eval_every,
        progress=not args.no_progress,
    )
    try:
        config.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        demo.check_dependencies()
    except ImportError as e:
        print(f"python -m jmp_rewrite demo: error: {e}", file=sys.stderr)
        return 1
    demo.run_demo(config)
    return 0


def _tolerance(text: str) -> float:
    """``--tolerance``: a positive finite relative error (``compare``'s own check, made
    before the inputs are built, as a usage error naming the value)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"expected a positive finite number (a relative error, e.g. 1e-3), got {text!r}"
        )
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


_INPUT_EXAMPLES = """examples:
  python -m jmp_rewrite {cmd} mymodel:loss --shapes "f32[8,16],f32[16]"
  python -m jmp_rewrite {cmd} --factory mymodel:example

A factory is a function of yours, taking no arguments, that returns (fn, args) or
(fn, args, kwargs), for functions of pytrees (dict params, optimizer states):

  def example():
      params = {{"w1": jnp.zeros((784, 512)), "w2": jnp.zeros((512, 10))}}
      return loss, (params, jnp.zeros((128, 784)), jnp.zeros(128, jnp.int32))"""


def _add_inputs(p: argparse.ArgumentParser, dtypes: Sequence[str]) -> None:
    """TARGET, --shapes, --factory, --dtype, --level: what explain and compare take."""
    p.add_argument(
        "target",
        metavar="MODULE:FUNCTION",
        nargs="?",
        default=None,
        help="e.g. mymodel:loss or path/to/file.py:loss (MODULE importable from "
        "the current directory); or use --factory",
    )
    p.add_argument(
        "--shapes",
        default=None,
        help='positional argument shapes, e.g. "f32[8,16],f32[16],i32[]" '
        "(dtypes: f16 bf16 f32 f64 i8 i16 i32 i64 u8 u32 bool ...)",
    )
    p.add_argument(
        "--factory",
        metavar="MODULE:FUNCTION",
        default=None,
        help="a function of yours returning (fn, args) or (fn, args, kwargs): for arguments "
        "that are pytrees (instead of MODULE:FUNCTION and --shapes)",
    )
    p.add_argument(
        "--dtype", choices=dtypes, default="float16", help="half-precision dtype (default: float16)"
    )
    from jmp_rewrite._src.lists.op_lists import LEVELS

    p.add_argument(
        "--level",
        choices=LEVELS,
        type=str.upper,
        default=None,
        help="TF's rewrite level (default: the TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LEVEL "
        "or JMP_REWRITE_LEVEL variable, else DEFAULT)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m jmp_rewrite``."""
    from jmp_rewrite import demo  # its options only: importing them needs no flax

    parser = argparse.ArgumentParser(
        prog="python -m jmp_rewrite",
        description=(
            "TensorFlow-style automatic mixed precision for JAX: demo, explain and compare."
        ),
        epilog=(
            "examples:\n"
            "  python -m jmp_rewrite demo                      # float32 vs mixed float16, ~1 min\n"
            "  python -m jmp_rewrite demo --model mlp --steps 200 --out runs/mlp\n"
            '  python -m jmp_rewrite explain mymodel:loss --shapes "f32[8,16],f32[16]"\n'
            "  python -m jmp_rewrite explain --factory mymodel:example  # returns (fn, args)\n"
            "  python -m jmp_rewrite compare --factory mymodel:example"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="{demo,explain,compare}")
    sub.required = True

    d = sub.add_parser(
        "demo",
        help="train a small model in float32 and mixed precision and compare them",
        description=(
            "Trains a small model on a procedurally generated image data set (10 classes of "
            "noisy shapes, nothing downloaded) twice: in float32, and with the jitted train "
            "step rewritten to mixed precision (float16 + dynamic loss scaling by default; "
            "forced on CPU). Prints the explain summary of the rewritten train step, the "
            "final figures side by side, the skipped steps and the loss-scale trajectory; "
            "writes training.png, explain.html and metrics.json to --out."
        ),
    )
    defaults = demo.DemoConfig()
    d.add_argument(
        "--model",
        choices=demo.MODELS,
        default=defaults.model,
        help="cnn (default): 2 conv+BatchNorm blocks and an MLP head; mlp: 3 linear layers "
        "with BatchNorm",
    )
    d.add_argument(
        "--dtype",
        choices=demo.DTYPES,
        default=defaults.dtype,
        help="half precision of the mixed run (default: %(default)s)",
    )
    d.add_argument(
        "--steps",
        type=_positive_int,
        default=defaults.steps,
        help="optimizer steps per run (default: %(default)s)",
    )
    d.add_argument(
        "--batch-size",
        type=_positive_int,
        default=defaults.batch_size,
        help="images per step (default: %(default)s)",
    )
    d.add_argument(
        "--lr",
        type=float,
        default=defaults.lr,
        help="peak Adam learning rate (cosine decay) (default: %(default)s)",
    )
    d.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        help="seed of data, initialisation and batch order (default: %(default)s)",
    )
    d.add_argument("--out", default=defaults.out, help="output directory (default: %(default)s)")
    d.add_argument(
        "--loss-scale",
        default=None,
        metavar="{dynamic,none,NUMBER}",
        help="loss scaling of the mixed run (default: dynamic for float16, none for bfloat16)",
    )
    d.add_argument(
        "--initial-scale",
        type=float,
        default=defaults.initial_scale,
        help="initial dynamic loss scale (default: %(default)s)",
    )
    d.add_argument(
        "--increment-period",
        type=_positive_int,
        default=defaults.increment_period,
        help="finite steps before the dynamic scale doubles (TF: 2000) (default: %(default)s)",
    )
    d.add_argument(
        "--train-size",
        type=_positive_int,
        default=defaults.train_size,
        help="training images (default: %(default)s)",
    )
    d.add_argument(
        "--test-size",
        type=_positive_int,
        default=defaults.test_size,
        help="test images (default: %(default)s)",
    )
    d.add_argument(
        "--image-size",
        type=_positive_int,
        default=defaults.image_size,
        help="image height and width (a multiple of 4) (default: %(default)s)",
    )
    d.add_argument(
        "--eval-every",
        type=int,
        default=defaults.eval_every,
        help="steps between test evaluations (default: 0, about 8 per run)",
    )
    d.add_argument("--no-progress", action="store_true", help="no progress bars")
    d.set_defaults(handler=_cmd_demo, subparser=d)

    e = sub.add_parser(
        "explain",
        help="print what the rewrite does to a function of yours",
        description=(
            "Traces a function of yours (nothing is executed), paints it with TF's lists and "
            "prints jmp_rewrite.explain's report: every equation with its list, colour and "
            "pass, the casts inserted and the totals."
        ),
        epilog=_INPUT_EXAMPLES.format(cmd="explain")
        + '\n  python -m jmp_rewrite explain mymodel:loss --shapes "f32[8,16],f32[16]" --by line',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_inputs(e, demo.DTYPES)
    out = e.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the report as JSON")
    out.add_argument("--summary", action="store_true", help="print only the totals")
    out.add_argument(
        "--by",
        choices=("scope", "line", "primitive"),
        default=None,
        help="print one line per model scope (Flax/Haiku module path, named scope, NNX "
        "attribute), source line of yours or primitive, forward/backward/optimizer apart, "
        "then the lint (tensor-core shapes, deny chains one list change would release)",
    )
    e.add_argument(
        "--html", metavar="PATH", default=None, help="also write the coloured HTML report to PATH"
    )
    e.set_defaults(handler=_cmd_explain, subparser=e)

    c = sub.add_parser(
        "compare",
        help="run a function of yours in float32 and rewritten, equation by equation",
        description=(
            "Runs a function of yours twice, in float32 and rewritten, and prints "
            "jmp_rewrite.compare's table: each equation's relative error, overflow, underflow "
            "and NaN counts, the first equation past the tolerance and suggested list changes. "
            "With --shapes the arguments are random (floats standard normal, integers zero); "
            "a --factory gives real ones."
        ),
        epilog=_INPUT_EXAMPLES.format(cmd="compare"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_inputs(c, demo.DTYPES)
    c.add_argument(
        "--tolerance",
        type=_tolerance,
        default=None,
        help="relative-error tolerance (default: 1e-2 for float16, 5e-2 for bfloat16)",
    )
    c.add_argument("--json", action="store_true", help="print the comparison as JSON")
    c.set_defaults(handler=_cmd_compare, subparser=c)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status.

    Args:
      argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
      0 on success, 1 if the explained function fails to trace or the demo's dependencies
      are not installed, 2 for bad arguments (argparse exits with 2 itself for unknown
      options).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except UsageError as e:
        sub = args.subparser
        sub.print_usage(sys.stderr)
        print(f"{sub.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
