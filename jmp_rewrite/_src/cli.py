"""The command line: ``python -m jmp_rewrite {demo,explain}``.

* ``demo``: trains a small model in float32 and in mixed precision and compares them (see
  :mod:`jmp_rewrite.demo`); ``make demo`` runs it.
* ``explain MODULE:FUNCTION --shapes "f32[8,16],f32[16]"``: prints
  :func:`jmp_rewrite.explain`'s report for a function of the user's, traced at those shapes
  (``--by scope|line|primitive``: grouped, with the lint).

Errors in the arguments (an unknown option, a bad shape spec, a module or function that cannot
be found) print a one-line message and exit with status 2; a function that fails to trace
exits with status 1.
"""

from __future__ import annotations

import argparse
import html
import importlib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

#: Short dtype names accepted in ``--shapes`` (any NumPy/JAX dtype name works as well).
DTYPE_ALIASES: dict[str, str] = {
    "f16": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "f64": "float64",
    "i8": "int8",
    "i16": "int16",
    "i32": "int32",
    "i64": "int64",
    "u8": "uint8",
    "u16": "uint16",
    "u32": "uint32",
    "u64": "uint64",
    "c64": "complex64",
    "c128": "complex128",
    "pred": "bool",
}

_SPEC_RE = re.compile(r"\s*([A-Za-z][A-Za-z0-9_]*)\s*\[([^\[\]]*)\]\s*")


class UsageError(Exception):
    """A bad command-line argument; reported as ``error: ...`` with exit status 2."""


# --------------------------------------------------------------------------------------------
# --shapes


def _parse_dtype(name: str, spec: str) -> Any:
    import jax
    import jax.numpy as jnp

    canonical = DTYPE_ALIASES.get(name.lower(), name.lower())
    try:
        dtype = jnp.dtype(canonical)
    except TypeError:
        raise UsageError(
            f"unknown dtype {name!r} in shape spec {spec!r}; use one of "
            f"{', '.join(DTYPE_ALIASES)} or a NumPy dtype name such as float32"
        ) from None
    if dtype.itemsize == 8 and not jax.config.jax_enable_x64:
        raise UsageError(
            f"{name}: 64-bit dtypes need JAX_ENABLE_X64=1 in the environment (spec {spec!r})"
        )
    return dtype


def parse_shapes(text: str) -> list[Any]:
    """Parses ``"f32[8,16],f32[16],i32[]"`` into ``jax.ShapeDtypeStruct`` objects.

    Each item is ``DTYPE[d0,d1,...]``: a dtype (``f16``, ``bf16``, ``f32``, ``i32``, ...,
    or a NumPy name such as ``float32``) and the dimensions, non-negative integers;
    ``DTYPE[]`` is a scalar. Items are separated by commas; spaces are ignored.

    Args:
      text: the spec.

    Returns:
      One ``jax.ShapeDtypeStruct`` per item, in order.

    Raises:
      UsageError: with a message pointing at the offending item.

    Example:
      >>> [(s.shape, str(s.dtype)) for s in parse_shapes("f32[8,16], i32[]")]
      [((8, 16), 'float32'), ((), 'int32')]
    """
    import jax

    if not text or not text.strip():
        raise UsageError('--shapes is empty; expected e.g. "f32[8,16],f32[16]"')
    out, pos = [], 0
    while pos < len(text):
        match = _SPEC_RE.match(text, pos)
        if match is None:
            rest = text[pos:].strip()
            raise UsageError(
                f"cannot parse shape spec at {rest!r} (in {text!r}); expected items like "
                'f32[8,16] separated by commas, e.g. "f32[8,16],f32[16],i32[]"'
            )
        name, dims_text = match.group(1), match.group(2)
        item = match.group(0).strip()
        dtype = _parse_dtype(name, item)
        dims = []
        if dims_text.strip():
            for d in dims_text.split(","):
                d = d.strip()
                if not d.isdigit():
                    raise UsageError(
                        f"bad dimension {d!r} in {item!r}: dimensions are non-negative integers"
                    )
                dims.append(int(d))
        out.append(jax.ShapeDtypeStruct(tuple(dims), dtype))
        pos = match.end()
        if pos < len(text):
            if text[pos] != ",":
                raise UsageError(f"expected ',' after {item!r} in {text!r}, got {text[pos:]!r}")
            pos += 1
            if not text[pos:].strip():
                raise UsageError(f"trailing ',' in shape spec {text!r}")
    return out


# --------------------------------------------------------------------------------------------
# MODULE:FUNCTION


def load_function(target: str) -> Callable[..., Any]:
    """Imports ``MODULE:FUNCTION`` (``MODULE`` importable from the current directory).

    ``MODULE`` is a dotted module name or a path to a ``.py`` file; ``FUNCTION`` may be
    dotted (``Class.method``, ``obj.attr``).

    Raises:
      UsageError: if the target is malformed, the module cannot be imported, the attribute
        does not exist or is not callable.
    """
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(
            f"expected MODULE:FUNCTION (e.g. mymodel:loss or path/to/file.py:loss), got {target!r}"
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise UsageError(f"no such file: {module_name}")
        name = os.path.splitext(os.path.basename(module_name))[0]
        spec = importlib.util.spec_from_file_location(name, module_name)
        module = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(name, module)
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            if sys.modules.get(name) is module:
                del sys.modules[name]
            raise UsageError(f"importing {module_name} failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and module_name.startswith(e.name):
                raise UsageError(
                    f"cannot import module {module_name!r}: {e} (MODULE must be importable "
                    "from the current directory or PYTHONPATH)"
                ) from e
            raise UsageError(f"importing {module_name!r} failed: {type(e).__name__}: {e}") from e
        except Exception as e:
            raise UsageError(f"importing {module_name!r} failed: {type(e).__name__}: {e}") from e
    obj: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            where = module_name + ":" + ".".join(attr.split(".")[:i]) if i else module_name
            names = sorted(
                n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None))
            )
            hint = f"; callables there: {', '.join(names[:20])}" if names else ""
            raise UsageError(f"{where} has no attribute {part!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{target} is not callable: {obj!r} ({type(obj).__name__})")
    return obj


# --------------------------------------------------------------------------------------------
# Subcommands.


def _cmd_explain(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    import jmp_rewrite

    fun = load_function(args.target)
    shapes = parse_shapes(args.shapes) if args.shapes is not None else []
    try:
        report = jmp_rewrite.explain(fun, *shapes, dtype=jnp.dtype(args.dtype), level=args.level)
    except Exception as e:  # the user's function failed to trace at these shapes
        given = ", ".join(f"{s.dtype}{list(s.shape)}" for s in shapes) or "no arguments"
        print(
            f"error: explaining {args.target} at ({given}) failed: {type(e).__name__}: {e}",
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
        title = html.escape(f"jmp_rewrite explain {args.target}")
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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m jmp_rewrite``."""
    from jmp_rewrite import demo  # its options only: importing them needs no flax

    parser = argparse.ArgumentParser(
        prog="python -m jmp_rewrite",
        description="TensorFlow-style automatic mixed precision for JAX: demo and explain.",
        epilog=(
            "examples:\n"
            "  python -m jmp_rewrite demo                      # float32 vs mixed float16, ~1 min\n"
            "  python -m jmp_rewrite demo --model mlp --steps 200 --out runs/mlp\n"
            '  python -m jmp_rewrite explain mymodel:loss --shapes "f32[8,16],f32[16]"'
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="{demo,explain}")
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
            "Traces MODULE:FUNCTION at the given shapes (nothing is executed), paints it "
            "with TF's lists and prints jmp_rewrite.explain's report: every equation with "
            "its list, colour and pass, the casts inserted and the totals."
        ),
        epilog=(
            "examples:\n"
            '  python -m jmp_rewrite explain mymodel:loss --shapes "f32[8,16],f32[16]"\n'
            '  python -m jmp_rewrite explain mymodel:loss --shapes "f32[8,16],f32[16]" --by line'
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    e.add_argument(
        "target",
        metavar="MODULE:FUNCTION",
        help="e.g. mymodel:loss or path/to/file.py:loss (MODULE importable from "
        "the current directory)",
    )
    e.add_argument(
        "--shapes",
        default=None,
        help='positional argument shapes, e.g. "f32[8,16],f32[16],i32[]" '
        "(dtypes: f16 bf16 f32 f64 i8 i16 i32 i64 u8 u32 bool ...)",
    )
    e.add_argument(
        "--dtype",
        choices=demo.DTYPES,
        default="float16",
        help="half-precision dtype (default: float16)",
    )
    from jmp_rewrite._src.op_lists import LEVELS

    e.add_argument(
        "--level",
        choices=LEVELS,
        type=str.upper,
        default=None,
        help="TF's rewrite level (default: JMP_REWRITE_LEVEL or DEFAULT)",
    )
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
