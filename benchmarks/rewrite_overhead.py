"""How much does ``jmp_rewrite.rewrite`` cost next to XLA compilation, and what does it emit?

Run by hand (not a test)::

    .venv/bin/python benchmarks/rewrite_overhead.py                 # everything, bfloat16
    .venv/bin/python benchmarks/rewrite_overhead.py --dtype float16 --repeats 1
    .venv/bin/python benchmarks/rewrite_overhead.py --only chain --sizes 1000 10000

Prints markdown tables. What is measured (every timing on a *fresh* function object, since
JAX caches traces and compilations per function; medians over ``--repeats``; wall-clock and
process CPU time, which on a shared machine is the steadier of the two):

1. **Train steps** (``value_and_grad`` + Adam inside ``jmp_rewrite.float32_region``): a
   12-layer transformer (d_model 256, 4 heads, seq 128, batch 8) and a CIFAR-style
   ResNet-18 (32x32, batch 8, batch norm in training mode), plain JAX (``_models.py``).

   * ``trace``: ``jax.make_jaxpr(step)``, which ``rewrite`` does once per signature and which
     ``jax.jit`` does anyway for the float32 step;
   * ``graph`` / ``paint`` / ``emit``: the rewrite's own work on that jaxpr -- building the
     painting graph, TF's passes, and re-emitting the program with casts (timed through
     ``jmp_rewrite._src``; emission is timed as tracing the re-emitted program to a jaxpr,
     which is what ``jax.jit`` of the rewritten function does in place of tracing ``step``);
   * ``rewrite = graph + paint + emit`` is the overhead the rewrite adds, and is checked
     end to end: ``lower(jit(rewrite(step))) - lower(jit(step))`` (includes lowering the
     extra cast equations);
   * ``compile``: ``jax.jit(...).lower(...).compile()`` of the rewritten step (and of the
     float32 step for reference). Target: rewrite <= 10% of compile.

2. **Painting time vs program size**: a generated chain of ``tanh(h @ w + b)`` blocks at
   ~1k, 10k and 100k equations; time per equation should be flat (linear growth).

3. **Structure**: share of ``dot_general``/``conv_general_dilated`` equations whose operands
   are half precision (target 100%), and ``convert_element_type`` counts -- in the jaxpr and
   as ``convert(`` ops in the optimised HLO -- for the rewritten step, a hand-written version
   (parameters and inputs cast to half once at the top of the loss, loss in float32,
   optimizer in float32) and the float32 step. Target: no more converts than hand-written.
   On XLA:CPU the HLO counts include the converts XLA itself adds to compute half-precision
   elementwise ops in float32, for both versions.
"""

from __future__ import annotations

import argparse
import gc
import re
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _models  # noqa: E402

import jmp_rewrite  # noqa: E402
from jmp_rewrite._src import _jax_compat as jc  # noqa: E402
from jmp_rewrite._src.emit.emitter import Emitter  # noqa: E402
from jmp_rewrite._src.paint.passes import paint as paint_graph  # noqa: E402
from jmp_rewrite._src.settings import resolve_config  # noqa: E402
from jmp_rewrite._src.trace.graph import Graph  # noqa: E402

# The rewrite's pieces, timed separately (benchmark only; tests use the public API).
from jmp_rewrite.demo.report import machine  # noqa: E402

MATMULS = ("dot_general", "conv_general_dilated")


# ------------------------------------------------------------------------------------------
# Timing and jaxpr helpers
# ------------------------------------------------------------------------------------------


class Timer:
    """Wall-clock and process CPU seconds of a block (optionally with the cyclic garbage
    collector paused: its full collections scan the whole heap, so with a 100k-equation
    jaxpr alive they add a size-dependent cost that is not the algorithm's)."""

    def __init__(self, gc_off: bool = False):
        self.gc_off = gc_off

    def __enter__(self) -> Timer:
        gc.collect()
        if self.gc_off:
            gc.disable()
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall = time.perf_counter() - self.wall0
        self.cpu = time.process_time() - self.cpu0
        if self.gc_off:
            gc.enable()


def all_eqns(jaxpr: Any) -> Iterator[Any]:
    if isinstance(jaxpr, jex_core.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if isinstance(sub, jex_core.ClosedJaxpr | jex_core.Jaxpr):
                    yield from all_eqns(sub)


def structure(closed: Any) -> dict[str, Any]:
    eqns = list(all_eqns(closed))
    half = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
    mm = [e for e in eqns if e.primitive.name in MATMULS]
    mm_half = [e for e in mm if all(np.dtype(v.aval.dtype) in half for v in e.invars)]
    return {
        "eqns": len(eqns),
        "matmuls": len(mm),
        "matmuls_half": len(mm_half),
        "converts": sum(e.primitive.name == "convert_element_type" for e in eqns),
    }


def hlo_converts(compiled: Any) -> int:
    return len(re.findall(r"\bconvert\(", compiled.as_text()))


def rewrite_pieces(closed: Any, dtype: Any, gc_off: bool = False) -> tuple[dict[str, Any], Any]:
    """Times graph construction, painting and emission of ``closed``."""
    config = resolve_config(dtype, None, None, True)
    with Timer(gc_off) as t_graph:
        graph = Graph(closed, config.lists)
    with Timer(gc_off) as t_paint:
        painting = paint_graph(
            graph, infer_follows_allow=config.infer_follows_allow, force_all=config.force_all
        )
    inner = jc.open_jaxpr(closed)
    in_avals = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
        for v in inner.invars
    ]
    with Timer(gc_off) as t_emit:
        emitter = Emitter(graph, painting, config.dtype, config.options)
        new = emitter.trace(
            graph.top, jc.consts_of(closed), in_avals, [v.aval.dtype for v in inner.outvars]
        )
    return {"graph": t_graph, "paint": t_paint, "emit": t_emit, "nodes": len(graph.nodes)}, new


def med(values: list[float]) -> float:
    return statistics.median(values)


# ------------------------------------------------------------------------------------------
# 1 + 3: train steps
# ------------------------------------------------------------------------------------------


def bench_workload(work: _models.Workload, dtype: Any, repeats: int) -> dict[str, Any]:
    args = work.args
    rows: dict[str, list[float]] = {}

    def add(key: str, t: Timer) -> None:
        rows.setdefault(key + "_wall", []).append(t.wall)
        rows.setdefault(key + "_cpu", []).append(t.cpu)

    emitted = None
    for _ in range(repeats):
        with Timer() as t:
            closed = jax.make_jaxpr(work.make_step())(*args)
        add("trace", t)
        pieces, emitted = rewrite_pieces(closed, dtype)
        for k in ("graph", "paint", "emit"):
            add(k, pieces[k])
        with Timer() as t:
            lowered_f32 = jax.jit(work.make_step()).lower(*args)
        add("lower_f32", t)
        with Timer() as t:
            lowered_rw = jax.jit(jmp_rewrite.rewrite(work.make_step(), dtype=dtype)).lower(*args)
        add("lower_rw", t)
        # Fresh lowerings each repeat, so nothing is served from a compilation cache.
        with Timer() as t:
            compiled_f32 = lowered_f32.compile()
        add("compile_f32", t)
        with Timer() as t:
            compiled_rw = lowered_rw.compile()
        add("compile_rw", t)
    hand_step = work.make_step(hand_dtype=dtype)
    hand_closed = jax.make_jaxpr(hand_step)(*args)
    compiled_hand = jax.jit(work.make_step(hand_dtype=dtype)).lower(*args).compile()

    out = {k: med(v) for k, v in rows.items()}
    out["nodes"] = pieces["nodes"]
    out["struct_f32"] = structure(closed)
    out["struct_rw"] = structure(emitted)
    out["struct_hand"] = structure(hand_closed)
    out["hlo_f32"] = hlo_converts(compiled_f32)
    out["hlo_rw"] = hlo_converts(compiled_rw)
    out["hlo_hand"] = hlo_converts(compiled_hand)
    return out


def print_workloads(results: dict[str, dict[str, Any]], dtype_name: str) -> None:
    print(f"\n### Rewrite overhead vs XLA compile ({dtype_name}; seconds, wall / CPU)\n")
    print(
        "| train step | jaxpr eqns | trace | graph | paint | emit | **rewrite** "
        "| lower(rw) - lower(f32) | compile rw | compile f32 | rewrite / compile rw |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():

        def wc(k: str, r: dict[str, Any] = r) -> str:
            return f"{r[k + '_wall']:.2f} / {r[k + '_cpu']:.2f}"

        rw_wall = r["graph_wall"] + r["paint_wall"] + r["emit_wall"]
        rw_cpu = r["graph_cpu"] + r["paint_cpu"] + r["emit_cpu"]
        e2e_wall = r["lower_rw_wall"] - r["lower_f32_wall"]
        e2e_cpu = r["lower_rw_cpu"] - r["lower_f32_cpu"]
        print(
            f"| {name} | {r['struct_f32']['eqns']} | {wc('trace')} | {wc('graph')} "
            f"| {wc('paint')} | {wc('emit')} | **{rw_wall:.2f} / {rw_cpu:.2f}** "
            f"| {e2e_wall:.2f} / {e2e_cpu:.2f} | {wc('compile_rw')} | {wc('compile_f32')} "
            f"| **{100 * rw_wall / r['compile_rw_wall']:.1f}% / "
            f"{100 * rw_cpu / r['compile_rw_cpu']:.1f}%** |"
        )
    print(f"\n### Structure ({dtype_name})\n")
    print(
        "| train step | dot/conv eqns | in half | converts (jaxpr): rewritten / hand / f32 "
        "| `convert(` in optimised HLO: rewritten / hand / f32 |"
    )
    print("|---|---|---|---|---|")
    for name, r in results.items():
        s, h, f = r["struct_rw"], r["struct_hand"], r["struct_f32"]
        pct = 100 * s["matmuls_half"] / max(s["matmuls"], 1)
        print(
            f"| {name} | {s['matmuls']} | {s['matmuls_half']} ({pct:.0f}%) "
            f"| {s['converts']} / {h['converts']} / {f['converts']} "
            f"| {r['hlo_rw']} / {r['hlo_hand']} / {r['hlo_f32']} |"
        )


# ------------------------------------------------------------------------------------------
# 2: painting time vs size
# ------------------------------------------------------------------------------------------


def bench_chain(sizes: list[int], dtype: Any, repeats: int, emit: bool) -> None:
    print(f"\n### Painting time vs program size (chain of tanh(h @ w + b); {np.dtype(dtype)})\n")
    print(
        "Seconds (median); per-equation cost in microseconds, with the garbage collector "
        "paused (the algorithm) and running (what a user sees).\n"
    )
    head = "| equations | trace | graph | paint | graph+paint per eqn (GC off / on) |"
    sep = "|---|---|---|---|---|"
    if emit:
        head += " emit | emit per eqn (GC off / on) |"
        sep += "---|---|"
    print(head)
    print(sep)
    for size in sizes:
        walls: dict[str, list[float]] = {}
        n = 0
        for gc_off in (True, False):
            for _ in range(repeats):
                f, args = _models.chain(max(size // 3, 1))  # fresh function: no trace cache
                with Timer() as t_trace:
                    closed = jax.make_jaxpr(f)(*args)
                walls.setdefault("trace", []).append(t_trace.wall)
                if emit:
                    pieces, _ = rewrite_pieces(closed, dtype, gc_off)
                else:
                    config = resolve_config(dtype, None, None, True)
                    with Timer(gc_off) as tg:
                        graph = Graph(closed, config.lists)
                    with Timer(gc_off) as tp:
                        paint_graph(graph)
                    pieces = {"graph": tg, "paint": tp, "nodes": len(graph.nodes)}
                    del graph
                n = pieces["nodes"]
                for k in ("graph", "paint", "emit"):
                    if k in pieces:
                        walls.setdefault(f"{k}_{gc_off}", []).append(pieces[k].wall)
                del closed, pieces
        g, p = med(walls["graph_True"]), med(walls["paint_True"])
        gp_on = med(walls["graph_False"]) + med(walls["paint_False"])
        row = (
            f"| {n} | {med(walls['trace']):.3f} | {g:.3f} | {p:.3f} "
            f"| {1e6 * (g + p) / n:.1f} / {1e6 * gp_on / n:.1f} |"
        )
        if emit:
            e, e_on = med(walls["emit_True"]), med(walls["emit_False"])
            row += f" {e:.3f} | {1e6 * e / n:.1f} / {1e6 * e_on / n:.1f} |"
        print(row, flush=True)


# ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3, help="timings per piece (median)")
    parser.add_argument(
        "--only", choices=("transformer", "resnet", "chain"), action="append", default=None
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--no-emit", action="store_true", help="chain: skip timing emission")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    only = set(args.only or ("transformer", "resnet", "chain"))

    print(
        f"measured {machine()}: jax {jax.__version__}, jmp_rewrite {jmp_rewrite.__version__}, "
        f"{jax.devices()[0].platform}, {args.dtype}, repeats={args.repeats}"
    )
    results: dict[str, dict[str, Any]] = {}
    if "transformer" in only:
        work = _models.transformer_workload(layers=args.layers, batch=args.batch)
        results[work.name] = bench_workload(work, dtype, args.repeats)
    if "resnet" in only:
        work = _models.resnet_workload(batch=args.batch)
        results[work.name] = bench_workload(work, dtype, args.repeats)
    if results:
        print_workloads(results, args.dtype)
    if "chain" in only:
        bench_chain(args.sizes, dtype, args.repeats, emit=not args.no_emit)


if __name__ == "__main__":
    main()
