"""jmp_rewrite: TensorFlow's automatic mixed precision for JAX.

Public names only; the implementation lives in ``jmp_rewrite._src``, which is private.
"""

from importlib.metadata import PackageNotFoundError, version

from jmp_rewrite._src.regions import float32_region as float32_region

try:
    __version__ = version("jmp_rewrite")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = ("float32_region",)
