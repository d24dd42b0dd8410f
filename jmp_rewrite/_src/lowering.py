"""``dtype=None``: the half dtype decided where the program is lowered, not where it is traced.

TF picks its target dtype by the device grappler optimises a graph for. In JAX that moment is
the lowering, and it need not happen on the machine that traces: a CPU host lowers a step for
a TPU or GPU topology (``jax.jit(step).trace(...).lower(lowering_platforms=("tpu",))``,
MaxText's ``train_compile.py``) or exports it for other platforms (``jax.export(...,
platforms=[...])``). So ``rewrite(f)`` without a dtype emits one program per lowering
platform, each a branch of ``lax.platform_dependent`` -- the way float8 and fused attention
choose their kernels (``fp8.py``, ``emit/attention.py``): ``tpu`` gets the bfloat16
program, ``cuda`` the float16 one (TF's compute-capability rule, see
:func:`~jmp_rewrite._src.settings.cuda_choice`), every other platform the function unchanged
(float32). A lowering for one platform compiles its branch alone; a multi-platform export
keeps each, chosen when the module is compiled; an eager call runs only the branch of the
default device (``platform_dependent`` resolves it before calling any other).

Cost: ``f`` is traced once, for every platform. Its jaxpr is painted once per distinct
configuration (two paintings: bfloat16 and float16; one when float8 makes both bfloat16), the
first time the program is emitted under a trace, and cached with the trace; an eager call
paints only the configuration it runs (none on a CPU). Each emission under a trace (each
trace of the caller, as for a rewrite with a dtype) emits every painted program once.
Platforms whose configuration is the same share one branch, a painting that changes nothing
shares the unchanged branch, and a program no platform changes is emitted as it is, with no
``platform_dependent`` at all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
from jax import lax

from jmp_rewrite._src.settings import RewriteConfig, Settings, resolve_config


@dataclasses.dataclass(frozen=True)
class PlatformConfigs:
    """The painting configuration of each lowering platform (hashable: a cache key).

    Attributes:
      branches: ``((platform, config), ...)`` for the platforms ``dtype=None`` may rewrite
        for (``tpu``, ``cuda``); a None config runs the program unchanged there, as on every
        platform not named.
    """

    branches: tuple[tuple[str, RewriteConfig | None], ...]


def platform_configs(settings: Settings) -> PlatformConfigs:
    """The configurations of ``settings.lowered`` (one per platform, resolved as a given
    dtype's would be: lists, level and environment variables)."""
    return PlatformConfigs(
        tuple(
            (
                platform,
                resolve_config(
                    dtype,
                    settings.lists,
                    settings.level,
                    settings.infer_follows_allow,
                    settings.fp8,
                    settings.fuse_attention,
                ),
            )
            for platform, dtype in settings.lowered
        )
    )


class Program(Protocol):
    """A traced program painted with one configuration (``rewrite.Rewritten``)."""

    @property
    def changed(self) -> bool: ...

    def emit(self, flat_args: Sequence[Any]) -> list[Any]: ...


class PerPlatform:
    """One traced program's variants, one per lowering platform, emitted as the branches of
    ``lax.platform_dependent``.

    Args:
      configs: each platform's configuration.
      make: a configuration (None: unchanged) -> its :class:`Program`, painted; called once
        per distinct configuration, when first emitted.
    """

    def __init__(self, configs: PlatformConfigs, make: Callable[[RewriteConfig | None], Program]):
        self.configs = configs
        self._make = make
        self._programs: dict[RewriteConfig | None, Program] = {}
        self._branches: dict[int, Callable[..., list[Any]]] = {}
        self._lazies: dict[RewriteConfig, Callable[..., list[Any]]] = {}

    def program(self, config: RewriteConfig | None) -> Program:
        """The program painted with ``config`` (cached)."""
        if config not in self._programs:
            self._programs[config] = self._make(config)
        return self._programs[config]

    def programs(self) -> list[Program]:
        """The painted programs so far, the unchanged one first."""
        return list(self._programs.values())

    def _branch(self, program: Program) -> Callable[..., list[Any]]:
        # One callable per program: platform_dependent joins the platforms of equal branches.
        key = id(program)
        if key not in self._branches:
            self._branches[key] = lambda *flat: program.emit(flat)
        return self._branches[key]

    def _lazy(self, config: RewriteConfig) -> Callable[..., list[Any]]:
        """A branch that paints ``config`` only when it is called (one per config)."""
        if config not in self._lazies:
            self._lazies[config] = lambda *flat: self.program(config).emit(flat)
        return self._lazies[config]

    def emit(self, flat_args: Sequence[Any]) -> list[Any]:
        """The program for the platform it is lowered for, on ``flat_args``.

        Concrete arguments are (most likely) an eager call, where ``platform_dependent``
        calls one branch: a configuration not painted yet is painted only if its branch is
        the one called. Under a trace every branch is traced: each is painted first, so that
        one whose painting changes nothing is the unchanged branch.
        """
        eager = not any(isinstance(a, jax.core.Tracer) for a in flat_args)
        unchanged = self.program(None)
        per_platform = {}
        for platform, config in self.configs.branches:
            if config is None:
                continue
            if eager and config not in self._programs:
                per_platform[platform] = self._lazy(config)
                continue
            program = self.program(config)
            if program.changed:
                per_platform[platform] = self._branch(program)
        if not per_platform:
            return unchanged.emit(flat_args)
        out = lax.platform_dependent(*flat_args, default=self._branch(unchanged), **per_platform)
        return list(out)
