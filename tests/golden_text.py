"""Issue 29: exact painting goldens -- the canonical text of a painted program, and its files.

Every program of the corpus (``tests/golden_corpus.py``) is traced once and painted under each
of its configurations (float16, bfloat16, float8 rules, TF 2.19's pass 4, levels, lists, the
environment); each painting is written as a block of text, one line per vertex of the painting
graph (equation, loop carry, ``cond`` output, scan stream), in graph order::

    === tf/T3 [float16]
    # dtype: float16 | equations in half precision: 5 / 6 | casts inserted: 2 | ...
       0 dot_general   allow:allow  add_allowlist_ops  in f32,f32>f16,f16 out f32>f16 | flops 65,536
       1 max           clear:allow  add_clear_and_infer_to_allow_if_between_allow  in f32>f16 ...

Each line: the vertex's id and path (sub-jaxprs joined by ``/``), its list and colour, the pass
or rule that decided it (``painted_by``; ``kept``/``released`` when a rule took it out of
painting and a later pass wrote another reason), its float dtypes in and out (``a>b`` where
the rewrite changes them), the vertices it reads (``<- 3,5``), and, where they apply: the
phase (backward / optimizer), inside a float32 region or a fused unit, the float8 choice (or
why a half matmul stays bfloat16), explain's FLOPs and trip count, the deny keys whose move to
infer would paint it half (``what-if``), the additions a half carry accumulates through, the
model scope, and the casts the emitter inserts for its operands (shape and dtypes). Casts not
at a vertex (a call's operands, a scope's outputs) follow the vertices. The first lines of a
block are explain's summary and lint (kind, equations and change; never a source line).

Nothing depends on the JAX version but what JAX traces: variable names never appear, and
:func:`normalise` maps the spellings that differ between jax 0.10.2 and 0.12. Where the jaxprs
themselves differ, the newer version's blocks are stored apart (``tests/goldens/jax-0.12/``,
only the blocks that differ from the base files, which hold the floor's text).

The files are ``tests/goldens/FAMILY.golden``; ``tools/goldens.py --bless`` rewrites them from
the code and prints the diff (``make goldens`` does it on both JAX ends).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import pathlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from jmp_rewrite._src import rewrite as rewrite_lib
from jmp_rewrite._src import settings as settings_lib
from jmp_rewrite._src.emit.emitter import Emitter
from jmp_rewrite._src.explain import build as explain_lib

ROOT = pathlib.Path(__file__).resolve().parent / "goldens"
#: The JAX version whose text the base files hold (the floor of the supported range).
BASE_VERSION = "jax-0.10"
HEADER = "=== "
BLESS_COMMAND = "make goldens  (or: .venv/bin/python tools/goldens.py --bless)"


def version_key() -> str:
    major, minor = jax.__version__.split(".")[:2]
    return f"jax-{major}.{minor}"


# ------------------------------------------------------------------------------------------
# The corpus' records
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """One painting of a program: the arguments of ``rewrite`` that decide it."""

    dtype: str = "float16"
    fp8: Any = False
    infer_follows_allow: bool = True
    level: str | None = None
    lists: Any = None
    env: tuple[tuple[str, str], ...] = ()
    fuse_attention: bool = False
    #: a short name for the header when lists/env/fp8 rules need one
    tag: str = ""

    def label(self) -> str:
        parts = [self.dtype]
        if self.fp8 is True:
            parts.append("fp8")
        elif self.fp8:
            parts.append("fp8-rules")
        if self.fuse_attention:
            parts.append("fused")
        if not self.infer_follows_allow:
            parts.append("tf2.19")
        if self.level:
            parts.append(self.level)
        if self.tag:
            parts.append(self.tag)
        return " ".join(parts)


F16 = Config("float16")
BF16 = Config("bfloat16")
HALF = (F16, BF16)


@dataclasses.dataclass(frozen=True)
class Case:
    """A program of the corpus: ``fun(*args)`` (arrays or ``jax.ShapeDtypeStruct``), painted
    under each of ``configs``. ``note``: one line printed under the header (a generated
    program's literal)."""

    name: str
    fun: Callable[..., Any]
    args: tuple[Any, ...]
    configs: tuple[Config, ...] = HALF
    note: str = ""


def abstract(tree: Any) -> Any:
    """Arrays as ``jax.ShapeDtypeStruct``: the corpus traces, it never computes."""
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype) if hasattr(a, "dtype") else a, tree
    )


# ------------------------------------------------------------------------------------------
# Rendering
# ------------------------------------------------------------------------------------------

_DTYPES = {
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "float64": "f64",
    "float8_e4m3fn": "e4m3",
    "float8_e5m2": "e5m2",
    "int32": "i32",
    "int64": "i64",
    "uint32": "u32",
    "uint8": "u8",
    "int8": "i8",
    "bool": "bool",
    "float": "float",
}

#: Spellings that differ between JAX versions for the same program: (pattern, replacement).
_NORMALISE = (
    (re.compile(r"\bpjit\b"), "jit"),
    (re.compile(r"\bclosed_call\b"), "jit"),
    (re.compile(r"\bremat2?\b"), "checkpoint"),
    (re.compile(r"\bcustom_vjp_call_jaxpr\b"), "custom_vjp_call"),
)


def normalise(text: str) -> str:
    """The same program's text on every JAX version: primitive spellings unified."""
    for pattern, repl in _NORMALISE:
        text = pattern.sub(repl, text)
    return text


def _dt(d: str) -> str:
    return _DTYPES.get(d, d)


def _dtypes(before: tuple[str, ...], after: tuple[str, ...]) -> str:
    b = ",".join(_dt(d) for d in before)
    a = ",".join(_dt(d) for d in after)
    return b if a == b else f"{b}>{a}"


class _TaggedEmitter(Emitter):
    """The emitter, naming where a cast is inserted by vertex id instead of by path (paths
    repeat; ids do not)."""

    def _path(self, scope: Any, eqn: Any, rec: Any) -> str:
        if rec.node is not None:
            return f"#{rec.node}"
        return f"{scope.path}{eqn.primitive.name}#{rec.index}"


@contextlib.contextmanager
def _environment(env: tuple[tuple[str, str], ...]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k, _ in env}
    os.environ.update(dict(env))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclasses.dataclass
class Painted:
    """One painting of a traced program, with explain's report of it."""

    closed: Any
    graph: Any
    painting: Any
    config: Any
    #: explain's report; its casts' ``where`` is the vertex (``#id``) or call reading it
    report: explain_lib.Report


def trace(case: Case) -> Any:
    """The closed jaxpr of ``case`` (shared by its configurations)."""
    return jax.make_jaxpr(case.fun)(*case.args)


def paint(closed: Any, config: Config) -> Painted:
    """``closed`` painted as ``rewrite`` with ``config`` paints it, and explain's report."""
    with _environment(config.env):
        rc = settings_lib.resolve_config(
            config.dtype,
            config.lists,
            config.level,
            config.infer_follows_allow,
            config.fp8,
            config.fuse_attention,
        )
    graph, painting = rewrite_lib.analyse(closed, rc)
    entry = rewrite_lib.Rewritten(closed, graph, painting, rc, None)
    return Painted(
        closed, graph, painting, rc, explain_lib.report_of(entry, emitter=_TaggedEmitter)
    )


#: Fixed column widths (path, list:colour, reason): a longer path in one line never moves
#: the columns of the others, so a diff shows only the lines that changed.
_WIDTHS = (36, 16, 46)


def _fold(rows: list[Any], nodes: list[Any]) -> list[str]:
    """The vertex lines, each run of quiet vertices (``None``: unpainted, float32, inside a
    float32 region or not computing on float32 values, no cast) folded into one line."""
    lines: list[str] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            lines.append(f"{'':>4} ... {len(run)} unpainted region/int vertices {run[0]}-{run[-1]}")
            run.clear()

    for n, row in zip(nodes, rows, strict=True):
        if row is None:
            run.append(n.id)
            continue
        flush()
        cells = "  ".join(c.ljust(w) for c, w in zip(row[:3], _WIDTHS, strict=True))
        lines.append(f"{cells}  {row[3]}")
    flush()
    return lines


def _phase(phase: str) -> str:
    return "" if phase == "forward" else phase


def render(p: Painted) -> list[str]:
    """The lines of one painting (see the module docstring), without the header."""
    r, g, painting = p.report, p.graph, p.painting
    lines = ["# " + " | ".join(r.summary().splitlines())]
    for f in r.lint():
        where = ",".join(f.equations[:4]) + (" ..." if len(f.equations) > 4 else "")
        lines.append(f"# lint {f.kind}: {where}" + (f" -> {f.change}" if f.change else ""))
    at: dict[str, list[str]] = {}
    elsewhere: list[str] = []
    for c in r.casts:
        where, text = c.where, f"{c.value}{_dt(c.from_dtype)}>{_dt(c.to_dtype)}"
        if where.startswith("#"):
            at.setdefault(where[1:], []).append(text)
        else:
            elsewhere.append(f"     cast at {where}: {text}")
    rows: list[tuple[str, str, str, str] | None] = []
    for n, e in zip(g.nodes, r.equations, strict=True):
        assert n.path == e.path
        why = e.painted_by or "-"
        kept = painting.kept.get(n.id) if painting.changed else None
        released = painting.released.get(n.id) if painting.changed else None
        if kept and kept != e.painted_by:
            why += f" kept:{kept}"
        if released and released != e.painted_by:
            why += f" released:{released}"
        dtypes = (
            f"in {_dtypes(e.in_dtypes, e.in_dtypes_after) or '-'} "
            f"out {_dtypes(e.out_dtypes, e.out_dtypes_after) or '-'}"
        )
        extra = [dtypes]
        if n.fanin:
            extra.append("<- " + ",".join(str(i) for i in n.fanin))
        flags = [
            _phase(e.phase),
            "int" if not e.float32 else "",
            "region" if e.in_float32_region else "",
            f"unit#{n.unit}" if n.unit is not None else "",
            "output" if n.feeds_output else "",
        ]
        if any(flags):
            extra.append(" ".join(f for f in flags if f))
        fp8 = painting.fp8 if painting.changed else None
        if fp8 is not None and n.id in fp8.dots:
            d = fp8.dots[n.id]
            extra.append(f"fp8 {e.float8} {d.role}{' fast' if d.fast_accum else ''}")
        elif e.float8_left:
            extra.append(f"fp8-left {e.float8_left}")
        if e.attention:
            number = e.attention.split(":")[0].rsplit(" ", 1)[-1]
            saved = f" saves {e.attention_saved:,} B" if e.attention_saved else ""
            extra.append(f"att#{number}{saved}")
            if e.attention_tpu:
                extra.append(f"att-tpu-left {e.attention_tpu}")
        elif e.attention_left:
            extra.append(f"att-left {e.attention_left}")
        if e.flops:
            extra.append(f"flops {e.flops:,}" + (f" (x{e.trips})" if e.trips != 1 else ""))
        if e.released_by:
            extra.append("what-if " + ",".join(e.released_by))
        if e.accumulates_through:
            extra.append("accumulates " + ",".join(e.accumulates_through))
        if e.scope:
            extra.append(f"@{e.scope}")
        if str(n.id) in at:
            extra.append("cast " + ", ".join(at[str(n.id)]))
        quiet = (
            e.colour == "float32"
            and e.painted_by is None
            and (e.in_float32_region or not e.float32)
            and str(n.id) not in at
        )
        row = (f"{n.id:>4} {e.path}", f"{e.list}:{e.colour}", why, " | ".join(extra))
        rows.append(None if quiet else row)
    lines += _fold(rows, g.nodes)
    lines += elsewhere
    return [normalise(line).rstrip() for line in lines]


def paintings(case: Case) -> tuple[Any, list[tuple[str, Painted]]]:
    """``case`` traced once, and its painting under each configuration, by header."""
    closed = trace(case)
    return closed, [(f"{HEADER}{case.name} [{c.label()}]", paint(closed, c)) for c in case.configs]


def block(case: Case, header: str, painted: Painted) -> str:
    """The golden text of one painting of ``case``."""
    body = [f"# {case.note}"] if case.note else []
    return "\n".join([header, *body, *render(painted)])


def render_case(case: Case) -> list[tuple[str, str]]:
    """``(header, block)`` for every configuration of ``case`` (traced once)."""
    _, painted = paintings(case)
    return [(header, block(case, header, p)) for header, p in painted]


# ------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------


def parse(text: str) -> dict[str, str]:
    """Header -> block (header line included) of a golden file, in file order."""
    blocks: dict[str, str] = {}
    current: list[str] = []

    def close() -> None:
        if current:
            blocks[current[0]] = "\n".join(current).rstrip("\n")

    for line in text.splitlines():
        if line.startswith(HEADER):
            close()
            current = [line]
        elif current:
            current.append(line)
    close()
    return blocks


def base_file(family: str) -> pathlib.Path:
    return ROOT / f"{family}.golden"


def version_file(family: str, version: str | None = None) -> pathlib.Path:
    return ROOT / (version or version_key()) / f"{family}.golden"


def _read(path: pathlib.Path) -> dict[str, str]:
    return parse(path.read_text()) if path.is_file() else {}


def expected(family: str, version: str | None = None) -> dict[str, str]:
    """The blessed blocks of ``family`` for a JAX version: the base file's, each replaced by
    the version's own where it has one."""
    version = version or version_key()
    blocks = _read(base_file(family))
    if version != BASE_VERSION:
        blocks.update(_read(version_file(family, version)))
    return blocks


def _join(blocks: dict[str, str]) -> str:
    return "\n\n".join(blocks.values()) + "\n"


def diff(family: str, want: dict[str, str], got: dict[str, str], limit: int = 0) -> str:
    """A unified diff from the blessed text to the code's (``limit`` lines at most, 0: all)."""
    lines = list(
        difflib.unified_diff(
            _join(want).splitlines() if want else [],
            _join(got).splitlines(),
            f"tests/goldens/{family}.golden (blessed, {version_key()})",
            f"{family} (the code now)",
            lineterm="",
            n=2,
        )
    )
    if limit and len(lines) > limit:
        lines = [*lines[:limit], f"... {len(lines) - limit} more diff lines"]
    return "\n".join(lines)


def bless(family: str, got: dict[str, str]) -> pathlib.Path:
    """Writes ``got`` as this JAX version's blessed text: the base file on the base version,
    else only the blocks that differ from the base file (an empty override is removed)."""
    version = version_key()
    if version == BASE_VERSION:
        path = base_file(family)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_join(got))
        return path
    base = _read(base_file(family))
    own = {h: b for h, b in got.items() if base.get(h) != b}
    missing = [h for h in base if h not in got]
    if missing:
        raise ValueError(
            f"{family}: blocks {missing[:3]} of the base file are not in the corpus on "
            f"{version}: bless on {BASE_VERSION} first"
        )
    path = version_file(family, version)
    if own:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_join(own))
    elif path.is_file():
        path.unlink()
    return path
