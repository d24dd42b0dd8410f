"""What the command line explains or compares: a function and its example arguments.

``MODULE:FUNCTION`` with ``--shapes "f32[8,16],f32[16]"`` (abstract arguments, enough for
``explain``), or ``--factory MODULE:FUNCTION``: a function of the user's that returns
``(fn, args)`` or ``(fn, args, kwargs)``, for functions of pytrees (dict parameters,
optimizer states) that a shape list cannot describe.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable
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


def load_factory(target: str) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """Calls the factory ``MODULE:FUNCTION`` and checks what it returns.

    The factory takes no arguments and returns ``(fn, args)`` or ``(fn, args, kwargs)``:
    the function to explain or compare, its positional arguments (a tuple or list of
    pytrees of arrays, ``jax.ShapeDtypeStruct`` for ``explain``) and keyword arguments.

    Raises:
      UsageError: if the factory cannot be loaded, fails, or returns anything else.
    """
    factory = load_function(target)
    try:
        made = factory()
    except Exception as e:
        raise UsageError(f"the factory {target} failed: {type(e).__name__}: {e}") from e
    shape = "(fn, args) or (fn, args, kwargs), e.g. return loss, (params, x, y)"
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise UsageError(f"the factory {target} must return {shape}; it returned {made!r:.200}")
    fn, args, kwargs = (*made, {}) if len(made) == 2 else made
    if not callable(fn):
        raise UsageError(f"the factory {target} returned {fn!r:.100} as fn; {shape}")
    if not isinstance(args, tuple | list) or not isinstance(kwargs, dict):
        raise UsageError(
            f"the factory {target} must return {shape}: args a tuple or list, kwargs a dict; "
            f"got {type(args).__name__} and {type(kwargs).__name__}"
        )
    return fn, tuple(args), kwargs


def concrete(shapes: list[Any], seed: int = 0) -> list[Any]:
    """Arrays for ``jax.ShapeDtypeStruct`` s (``compare`` runs the function): floats from a
    standard normal distribution, integers and booleans zero."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), max(len(shapes), 1))
    return [
        jax.random.normal(k, s.shape, s.dtype)
        if jnp.issubdtype(s.dtype, jnp.inexact)
        else jnp.zeros(s.shape, s.dtype)
        for k, s in zip(keys, shapes)
    ]
