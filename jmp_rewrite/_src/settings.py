"""What a rewrite runs with: the half dtype (the caller's, the global switch's or, for
``dtype=None``, each lowering platform's, as TF picks it by device), the lists after levels
and environment variables, and why a rewrite is off on this machine when no dtype applies.

:func:`jmp_rewrite.rewrite`, ``explain``, ``compare`` and the seed API all decide through
:func:`effective_settings` and :func:`resolve_config`, so they agree on one program.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_rewrite._src import fp8 as fp8_lib
from jmp_rewrite._src.lists import environment
from jmp_rewrite._src.lists import op_lists as op_lists_lib

HALF_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
_HALF_DTYPES_MSG = "jnp.float16 or jnp.bfloat16"
_ALLOWED_DTYPES_MSG = f"{_HALF_DTYPES_MSG} or None (pick by platform)"

#: TF's kMinGPUArch: float16 only pays off on GPUs with tensor cores (compute capability 7.0).
MIN_GPU_COMPUTE_CAPABILITY = (7, 0)


@dataclasses.dataclass
class _GlobalSwitch:
    """Process-wide state of ``enable_mixed_precision_graph_rewrite``."""

    enabled: bool = False
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


GLOBAL = _GlobalSwitch()


def validate_dtype(dtype: Any) -> np.dtype | None:
    """``dtype`` as a NumPy half dtype, or None.

    Raises:
      ValueError: if ``dtype`` is not float16, bfloat16 or None.
    """
    if dtype is None:
        return None
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in HALF_DTYPES:
        raise ValueError(f"dtype must be {_ALLOWED_DTYPES_MSG}; got {dtype!r}")
    return dt


def validate_fp8(dtype: Any, fp8: Any) -> Any:
    """``fp8`` as :class:`~jmp_rewrite.Fp8Rules` or None, checked against ``dtype``.

    Raises:
      TypeError: if ``fp8`` is not a bool or rules.
      ValueError: if float8 is asked for with a dtype other than bfloat16 (or None).
    """
    rules = fp8_lib.resolve_rules(fp8)
    if rules is not None and dtype is not None:
        try:
            dt = np.dtype(dtype)
        except TypeError:
            dt = None
        if dt != np.dtype(jnp.bfloat16):
            raise ValueError(f"{fp8_lib.NEEDS_BF16}; got dtype={dtype!r}")
    return rules


def validate_fuse_attention(fuse_attention: Any) -> bool:
    """``fuse_attention`` as a bool.

    Raises:
      TypeError: if it is not a bool.
    """
    if not isinstance(fuse_attention, bool | np.bool_):
        raise TypeError(f"fuse_attention must be True or False, got {fuse_attention!r}")
    return bool(fuse_attention)


# Frames of these packages (and of Python's wrappers) are not where a user calls from.
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (jax, np, sys.modules["jmp_rewrite"], sys.modules.get("jaxlib", jax))
)
_LIBRARY_FILES = frozenset(os.path.abspath(m.__file__) for m in (functools, contextlib))


def _is_library(filename: str) -> bool:
    return filename.startswith(_LIBRARY_DIRS) or filename in _LIBRARY_FILES


def _user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, from its caller, of the innermost frame outside JAX,
    NumPy and jmp_rewrite: the user's call, under ``jax.jit`` too."""
    frame, level = sys._getframe(2), 2
    while frame is not None and _is_library(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


class RewriteOffWarning(UserWarning):
    """A rewritten function runs unchanged on this machine's default device: ``dtype=None``
    picks no half dtype for it (a CPU, say).

    ``dtype=None`` decides where the program is lowered, so the same function still runs in
    bfloat16 when lowered for a TPU and in float16 for a CUDA GPU (the message says which).
    Said once per function and reason, as TF logs that its pass is off. Silence it with
    ``warnings.filterwarnings("ignore", category=jmp_rewrite.RewriteOffWarning)``.
    """


class Fp8NoneSelectedWarning(UserWarning):
    """``fp8=True`` (or :class:`~jmp_rewrite.Fp8Rules`) runs no matmul of a rewritten
    function in float8: every half-precision matmul stayed bfloat16 (too small, the first or
    last weight GEMM, activation x activation, excluded) or none runs in half precision.
    The function runs as the bfloat16 rewrite; the message says why, once per function and
    reason (``explain``'s report and ``lint()`` say it too). Silence it with
    ``warnings.filterwarnings("ignore", category=jmp_rewrite.Fp8NoneSelectedWarning)``.
    """


_PLATFORM_RULE = (
    "dtype=None picks the half dtype where the program is lowered, as TF picks it by device "
    "(float16 on CUDA GPUs of compute capability >= 7.0, bfloat16 on TPUs, none elsewhere)"
)
_FORCE_HINT = "pass dtype=jnp.float16 or dtype=jnp.bfloat16 to rewrite anyway"

#: The lowering platforms ``dtype=None`` may rewrite for (``lax.platform_dependent``'s
#: names); every other platform (``cpu``, ``rocm``, ...) runs the function unchanged.
LOWERED_PLATFORMS = ("tpu", "cuda")


def platform_choice(device: Any = None) -> tuple[np.dtype | None, str]:
    """:func:`platform_dtype` and, when it is None, why (a sentence for messages)."""
    device = device if device is not None else jax.devices()[0]
    if device.platform == "tpu":
        return np.dtype(jnp.bfloat16), ""
    if device.platform in ("gpu", "cuda"):
        cc = getattr(device, "compute_capability", None)
        try:
            major, minor = (int(p) for p in str(cc).split(".")[:2])
        except ValueError:
            return None, f"{_PLATFORM_RULE}; the GPU reports no compute capability ({cc!r})"
        if (major, minor) >= MIN_GPU_COMPUTE_CAPABILITY:
            return np.dtype(jnp.float16), ""
        return None, f"{_PLATFORM_RULE}; this GPU's compute capability is {major}.{minor}"
    return None, f"{_PLATFORM_RULE}, and the default device is a {device.platform}"


def cuda_choice() -> tuple[np.dtype | None, str]:
    """The half dtype of a CUDA lowering under ``dtype=None``, and why none (a sentence).

    TF's rule on this machine's CUDA GPUs when it has any (float16 if every one has compute
    capability >= 7.0); without one -- a deviceless compile for a GPU from a CPU host --
    the GPU is not known, and a GPU with tensor cores (compute capability >= 7.0: V100 and
    every later data-centre card) is assumed: float16.
    """
    try:
        devices = [d for d in jax.devices("cuda") if d.platform in ("gpu", "cuda")]
    except RuntimeError:  # no CUDA backend here
        devices = []
    for device in devices:
        dtype, why = platform_choice(device)
        if dtype is None:
            return None, why
    return np.dtype(jnp.float16), ""


def lowering_dtypes(fp8: Any = False) -> tuple[tuple[str, np.dtype | None], ...]:
    """``dtype=None``'s half dtype for each of :data:`LOWERED_PLATFORMS`, as
    ``((platform, dtype or None), ...)``: bfloat16 for ``tpu``, :func:`cuda_choice` for
    ``cuda``; every other platform runs unchanged. Float8 (``fp8``) needs bfloat16, so
    under it a CUDA lowering runs bfloat16 with float8 matmuls instead of float16."""
    cuda = cuda_choice()[0]
    if cuda is not None and fp8_lib.resolve_rules(fp8) is not None:
        cuda = np.dtype(jnp.bfloat16)
    return (("tpu", np.dtype(jnp.bfloat16)), ("cuda", cuda))


def lowering_words(lowered: tuple[tuple[str, Any], ...]) -> str:
    """``lowered`` (:func:`lowering_dtypes`) in words: ``"lowered for tpu it runs in
    bfloat16, for cuda in float16, for any other platform unchanged (float32)"``."""
    parts = [f"for {p} in {np.dtype(d).name}" for p, d in lowered if d is not None]
    if not parts:
        return "it runs unchanged (float32) on every platform"
    parts[0] = parts[0].replace(" in ", " it runs in ", 1)
    return f"lowered {', '.join(parts)}, for any other platform unchanged (float32)"


def platform_dtype(device: jax.Device | None = None) -> np.dtype | None:
    """TF's choice of target dtype for a device: float16 on CUDA GPUs of compute capability
    >= 7.0, bfloat16 on TPUs, None (no rewrite) elsewhere, e.g. on CPU.

    It is the dtype ``rewrite(f)`` (``dtype=None``) runs in on that device. The rewrite
    itself decides where its program is lowered, so a function traced on a CPU host still
    runs in bfloat16 when lowered for a TPU and in float16 for a CUDA GPU.

    Args:
      device: a ``jax.Device``; defaults to ``jax.devices()[0]``.

    Returns:
      ``np.dtype(jnp.float16)``, ``np.dtype(jnp.bfloat16)`` or None.

    Example:
      >>> import jax, jmp_rewrite
      >>> jmp_rewrite.platform_dtype(jax.devices("cpu")[0]) is None  # TF: no rewrite on CPU
      True
    """
    return platform_choice(device)[0]


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a rewrite with given arguments uses now (after the global switch and the platform).

    Attributes:
      dtype: the half dtype on this machine's default device, or None when the rewrite is
        off there.
      lists: the :class:`~jmp_rewrite.OpLists`, or None for the defaults.
      level: the level argument, or None.
      infer_follows_allow: TF's pass 4 switch.
      off_reason: why ``dtype`` is None (a sentence), else ``""``.
      fp8: the ``fp8`` argument (False, True or :class:`~jmp_rewrite.Fp8Rules`).
      fuse_attention: the ``fuse_attention`` argument.
      lowered: when no dtype is given (``dtype=None``, and the global switch gives none),
        the half dtype of each lowering platform, decided where the program is lowered
        (:func:`lowering_dtypes`); ``()`` when a dtype is given.
    """

    dtype: Any
    lists: Any
    level: str | None
    infer_follows_allow: bool
    off_reason: str = ""
    fp8: Any = False
    fuse_attention: bool = False
    lowered: tuple[tuple[str, Any], ...] = ()


def effective_settings(
    dtype: Any,
    lists: Any,
    level: str | None,
    infer_follows_allow: bool,
    fp8: Any = False,
    fuse_attention: bool = False,
) -> Settings:
    """The settings :func:`rewrite` with these arguments uses now; ``explain`` uses the same.

    An explicit ``dtype`` wins. Otherwise :func:`jmp_rewrite.enable_mixed_precision_graph_rewrite`
    supplies its options when it is on, and without a dtype from it the dtype is decided
    where the program is lowered (TF's rule per platform: :func:`lowering_dtypes`).
    ``dtype`` is then the default device's, which the program runs in here.
    """
    if dtype is not None:
        return Settings(
            dtype, lists, level, infer_follows_allow, fp8=fp8, fuse_attention=fuse_attention
        )
    prefix = ""
    if GLOBAL.enabled:
        opts = GLOBAL.options
        lists = opts.get("lists", lists)
        level = opts.get("level", level)
        infer_follows_allow = opts.get("infer_follows_allow", infer_follows_allow)
        if opts.get("dtype") is not None:
            return Settings(
                opts["dtype"],
                lists,
                level,
                infer_follows_allow,
                fp8=fp8,
                fuse_attention=fuse_attention,
            )
        prefix = "enable_mixed_precision_graph_rewrite is on without a dtype, and "
    lowered = lowering_dtypes(fp8)
    dtype, why = platform_choice()
    if dtype is not None and fp8_lib.resolve_rules(fp8) is not None:
        dtype = np.dtype(jnp.bfloat16)  # float8 needs bfloat16 (lowering_dtypes)
    off = f"{prefix}{why}; {lowering_words(lowered)}; {_FORCE_HINT}" if dtype is None else ""
    return Settings(dtype, lists, level, infer_follows_allow, off, fp8, fuse_attention, lowered)


@dataclasses.dataclass(frozen=True)
class RewriteConfig:
    """Everything that decides how a program is painted (hashable: a cache key)."""

    dtype: np.dtype
    lists: Any
    force_all: bool
    infer_follows_allow: bool
    #: the float8 rules (:class:`~jmp_rewrite.Fp8Rules`), None without float8.
    fp8: Any = None
    #: replace attention by fused calls (``fuse_attention=True``).
    fuse_attention: bool = False

    @property
    def options(self) -> dict[str, Any]:
        return {
            "force_all": self.force_all,
            "infer_follows_allow": self.infer_follows_allow,
            "fp8": self.fp8,
            "fuse_attention": self.fuse_attention,
        }


def resolve_config(
    dtype: Any,
    lists: Any,
    level: str | None,
    infer_follows_allow: bool,
    fp8: Any = False,
    fuse_attention: bool = False,
) -> RewriteConfig | None:
    """The painting configuration, or None when the program is to be left unchanged.

    With ``lists=None`` the defaults for ``dtype`` are used, with the ``JMP_REWRITE_*``
    environment overrides (TF's ``TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_*``) applied; explicit
    ``lists`` are used as given. ``level`` (else ``JMP_REWRITE_LEVEL``) applies either way.
    """
    dt = validate_dtype(dtype)
    if dt is None:
        return None
    rules = fp8_lib.resolve_rules(fp8)
    if rules is not None and dt != np.dtype(jnp.bfloat16):
        raise ValueError(f"{fp8_lib.NEEDS_BF16}; got dtype {dt}")
    if lists is not None and not isinstance(lists, op_lists_lib.OpLists):
        raise TypeError(f"lists must be a jmp_rewrite.OpLists, got {type(lists).__name__}")
    # Resolved once per (arguments, JMP_REWRITE_* / TF_AUTO_MIXED_PRECISION_* variables): it
    # runs on every eager call.
    env = tuple(sorted((k, v) for k, v in os.environ.items() if environment.is_ours(k)))
    config = _resolve_config(dt, lists, level, bool(infer_follows_allow), env)
    if rules is not None:
        config = dataclasses.replace(config, fp8=rules)
    if validate_fuse_attention(fuse_attention):
        config = dataclasses.replace(config, fuse_attention=True)
    return config


@functools.lru_cache(maxsize=256)
def _resolve_config(
    dt: np.dtype, lists: Any, level: str | None, infer_follows_allow: bool, env_items: tuple
) -> RewriteConfig:
    env = dict(env_items)
    if level is not None:
        try:
            op_lists_lib.canonical_level(level)
        except ValueError as e:
            raise ValueError(f"level={level!r}: {e}") from None
    if lists is None:
        lists, level = environment.lists_from_environment(dt, env, level=level)
    else:
        if level is None:
            level = environment.level_from_environment(env)
        lists = op_lists_lib.apply_level(lists, level, dt)
    level = op_lists_lib.canonical_level(level)
    # TF <= 2.19 ran pass 4 in BF16 mode only, so turning it off affects float16 alone.
    infer_follows_allow = infer_follows_allow or dt == np.dtype(jnp.bfloat16)
    return RewriteConfig(dt, lists, level == "UNSAFE_FORCE_ALL", infer_follows_allow)
