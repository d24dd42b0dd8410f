"""Where an equation comes from: its model scope, the user's source line and its phase.

Three sources of information, all recorded by JAX on every equation:

* the **name stack** (``jax.named_scope``; Flax Linen and Haiku push module paths such as
  ``ResNet/BottleneckBlock_3/Conv_0``). Transforms wrap it (``transpose(jvp(MLP))/Dense_1``):
  the wrappers are stripped, and ``transpose(`` marks the backward pass;
* the **traceback**: the user's source line is the innermost frame outside JAX, Flax,
  Optax, Haiku, Equinox, jmp_rewrite and the standard library. Flax NNX pushes no names and
  Equinox only class names (``eqx.nn.Linear``), so there the scope comes from the frames:
  each call of a module's ``__call__`` from user code adds the attribute it was called
  through (``self.conv1(x)`` gives ``conv1``) or, for a bare name (``model(x)``), the
  module's class;
* nesting: a ``jit``/``scan``/``cond`` body records name stack and frames relative to its
  own trace, so they are joined to those of the equation that holds it.

Phases: **backward** when any level's name stack contains ``transpose(`` (JAX's transpose
of the forward pass); **optimizer** when a frame below the user's innermost frame lies in an
optimizer library (Optax outside ``optax.losses``, ``nnx.Optimizer``, Flax's ``TrainState``,
jmp_rewrite's loss-scale optimizer): ``tx.update(...)`` called from the user's train step.
Optimizer frames above the user's (``jmp_rewrite.value_and_grad`` wrapping the loss) do not
count. Otherwise **forward**, a hand-written update ``p - lr * g`` included. Float32 regions
keep the phase of their code and show as a scope of their own.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import linecache
import os
import re
import sysconfig
from typing import Any

from jmp_rewrite._src import _jax_compat as jc
from jmp_rewrite._src.trace.graph_records import walk_scopes
from jmp_rewrite._src.trace.regions import region_names

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"
PHASES = (FORWARD, BACKWARD, OPTIMIZER)

#: Packages whose frames are not the user's code.
LIBRARIES = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "haiku",
    "equinox",
    "jmp_rewrite",
    "chex",
    "jaxtyping",
    "numpy",
    "ml_dtypes",
    "opt_einsum",
)
#: Inside a library, modules written as user code (jmp_rewrite's demo model).
_USER_CODE_IN_LIBRARIES = re.compile(r"[/\\]jmp_rewrite[/\\](?:_src[/\\])?demo")
#: Module libraries whose layers' ``__call__`` name a scope when NNX/Equinox push no names.
_LAYER_DIRS = (("flax", "nnx", "nn"), ("equinox", "nn"))
#: Optimizer code (relative to the package roots); ``optax/losses`` is the loss, not it.
_OPTIMIZER_PARTS = (("optax",), ("flax", "nnx", "training"), ("flax", "training"))
_NOT_OPTIMIZER_PARTS = (("optax", "losses"),)
_LOSS_SCALE_OPTIMIZER = os.path.join("jmp_rewrite", "_src", "loss_scale", "optimizer.py")

_IPYTHON_CELL = re.compile(r"ipykernel_\d+[/\\]\d+\.py$")
_WRAPPER = re.compile(r"^([A-Za-z_][\w\-]*)\((.*)\)$")


@dataclasses.dataclass(frozen=True)
class Frame:
    """One Python frame of an equation's traceback (see :func:`jc.traceback_frames`)."""

    file: str
    function: str
    line: int
    col: int = -1
    end_line: int = -1
    end_col: int = -1


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where one equation comes from.

    Attributes:
      scope: module path, ``/``-separated (``MLP/Dense_0``); ``""`` at the top level.
      source: ``file:line`` of the user's code that created it; ``""`` if unknown.
      phase: ``forward``, ``backward`` or ``optimizer``.
    """

    scope: str = ""
    source: str = ""
    phase: str = FORWARD


@dataclasses.dataclass(frozen=True)
class _Context:
    names: tuple[str, ...] = ()  # name-stack components of the enclosing equations
    frames: tuple[Frame, ...] = ()  # outermost first, across nesting levels
    backward: bool = False


# --------------------------------------------------------------------------------------------
# Files.


@functools.lru_cache(maxsize=1)
def _roots() -> dict[str, tuple[str, ...]]:
    """Package name -> its directories (found without importing it); ``""``: the stdlib."""
    roots: dict[str, tuple[str, ...]] = {}
    paths = sysconfig.get_paths()
    roots[""] = tuple({os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib")})
    for name in LIBRARIES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        locations = getattr(spec, "submodule_search_locations", None) or ()
        roots[name] = tuple(os.path.realpath(p) for p in locations)
    return roots


def _under(path: str, parts: tuple[str, ...]) -> bool:
    """Whether ``path`` lies under package ``parts[0]``'s root joined with ``parts[1:]``."""
    for root in _roots().get(parts[0], ()):
        base = os.path.join(root, *parts[1:])
        if path == base or path.startswith(base + os.sep):
            return True
    return False


@functools.lru_cache(maxsize=4096)
def _real(path: str) -> str:
    return os.path.realpath(path) if not path.startswith("<") else path


@functools.lru_cache(maxsize=4096)
def is_user_file(path: str) -> bool:
    """Whether frames in ``path`` are the user's code (not a library or the stdlib)."""
    if path.startswith("<"):
        return path == "<string>" or path.startswith("<ipython-input")
    real = _real(path)
    if _USER_CODE_IN_LIBRARIES.search(real):
        return True
    return not any(_under(real, (name,)) for name in ("", *LIBRARIES))


@functools.lru_cache(maxsize=4096)
def _is_optimizer_file(path: str) -> bool:
    real = _real(path)
    if real.endswith(_LOSS_SCALE_OPTIMIZER):
        return True
    if any(_under(real, p) for p in _NOT_OPTIMIZER_PARTS):
        return False
    return any(_under(real, p) for p in _OPTIMIZER_PARTS)


@functools.lru_cache(maxsize=4096)
def _is_layer_file(path: str) -> bool:
    return is_user_file(path) or any(_under(_real(path), p) for p in _LAYER_DIRS)


@functools.lru_cache(maxsize=4096)
def _is_module_machinery(path: str) -> bool:
    """Frames a module call passes through: module libraries, and ``jax.named_scope`` used
    as a decorator (Equinox's layers)."""
    real = _real(path)
    if _under(real, ("jax", "_src", "source_info_util.py")):
        return True
    return any(_under(real, (name,)) for name in ("flax", "haiku", "equinox"))


def short_path(path: str) -> str:
    """``path`` for display: relative to the working directory when under it, ``cell`` for
    a Jupyter cell, else its last two components."""
    if path.startswith("<"):
        return path
    if _IPYTHON_CELL.search(path):
        return "cell"
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        rel = ".."
    if not rel.startswith(".."):
        return rel
    return "…/" + "/".join(path.replace("\\", "/").split("/")[-2:])


def source_text(source: str) -> str:
    """The code at ``file:line`` (stripped), or ``""`` if it cannot be read."""
    path, _, line = source.rpartition(":")
    if not path or not line.isdigit():
        return ""
    return linecache.getline(path, int(line)).strip()


# --------------------------------------------------------------------------------------------
# Name stacks and frames.


def split_name_stack(name_stack: str) -> tuple[tuple[str, ...], bool]:
    """``"transpose(jvp(MLP))/Dense_1"`` -> ``(("MLP", "Dense_1"), True)``: the scope
    components without transform wrappers, and whether one wrapper is ``transpose``."""
    names, backward = [], False
    for part in name_stack.split("/"):
        while (m := _WRAPPER.match(part)) is not None:
            backward = backward or m.group(1) == "transpose"
            part = m.group(2)
        if part:
            names.append(part)
    return tuple(names), backward


def _callee_name(caller: Frame, callee: Frame) -> str:
    """The name a module call is made through: ``self.conv1(x)`` -> ``conv1``,
    ``self.layers[0](x)`` -> ``layers[0]``, ``model(x)`` -> the module's class."""
    cls = callee.function.rsplit(".", 2)[-2] if "." in callee.function else callee.function
    if caller.col < 0 or caller.end_line < caller.line:
        return cls
    lines = [linecache.getline(caller.file, i) for i in range(caller.line, caller.end_line + 1)]
    if not any(lines):
        return cls
    lines[-1] = lines[-1][: caller.end_col]
    lines[0] = lines[0][caller.col :]
    try:
        node = ast.parse("".join(lines).strip(), mode="eval").body
    except SyntaxError:
        return cls
    if not isinstance(node, ast.Call):
        return cls
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Subscript):
        text = ast.unparse(func)
        return text[5:] if text.startswith("self.") else text
    return cls


def _frame_scope(frames: tuple[Frame, ...]) -> tuple[str, ...]:
    """Module path rebuilt from the frames (outermost first): one name per module ``__call__``
    entered from user code through module-library frames only (the attribute it is called
    through), or entered otherwise when the module is the user's own (its class)."""
    names: list[str] = []
    caller: Frame | None = None  # the latest user frame that has not called a module yet
    for f in frames:
        user = is_user_file(f.file)
        if f.function.endswith(".__call__") and _is_layer_file(f.file):
            if caller is not None:
                names.append(_callee_name(caller, f))
            elif user:
                names.append(f.function.rsplit(".", 2)[-2])
            caller = None
        if user:
            caller = f
        elif not _is_module_machinery(f.file):
            caller = None  # JAX, jmp_rewrite, ... in between: not a module call
    return tuple(names)


def _origin(ctx: _Context) -> Origin:
    frames = ctx.frames
    last = max((i for i, f in enumerate(frames) if is_user_file(f.file)), default=-1)
    source = f"{frames[last].file}:{frames[last].line}" if last >= 0 else ""
    # Optimizer code runs below the user's last frame (``tx.update(...)``); optimizer frames
    # above it wrap the user's loss (``jmp_rewrite.value_and_grad``) and do not count.
    optimizer = any(_is_optimizer_file(f.file) for f in frames[last + 1 :])
    phase = BACKWARD if ctx.backward else OPTIMIZER if optimizer else FORWARD
    names = ctx.names
    if not names or all("." in n for n in names):
        # No names, or only Equinox's class names (eqx.nn.Linear): the attribute path of
        # the frames says which layer it is.
        names = _frame_scope(frames) or names
    return Origin("/".join(region_names(names)), source, phase)


def _enter(ctx: _Context, eqn: Any) -> _Context:
    names, backward = split_name_stack(jc.name_stack(eqn))
    own = tuple(Frame(*f) for f in reversed(jc.traceback_frames(eqn)))
    return _Context(
        names=ctx.names + names,
        frames=ctx.frames + own,
        backward=ctx.backward or backward,
    )


def _rec_nodes(rec: Any) -> list[int]:
    ids = [rec.node, *rec.carries, *rec.operands, *rec.xs, *rec.ys]
    return [i for i in ids if i is not None]


def origins(graph: Any) -> dict[int, Origin]:
    """The :class:`Origin` of every node of a painting graph (structural vertices: the loop
    or ``cond`` they belong to).

    Args:
      graph: a :class:`jmp_rewrite._src.trace.graph.Graph`.

    Returns:
      Node id -> origin.
    """
    out: dict[int, Origin] = {}

    def step(ctx: _Context, eqn: Any, rec: Any) -> _Context:
        inner = _enter(ctx, eqn)
        here = _origin(inner)
        for node in _rec_nodes(rec):
            out.setdefault(node, here)
        return inner

    walk_scopes(graph.top, _Context(), step)
    return out
