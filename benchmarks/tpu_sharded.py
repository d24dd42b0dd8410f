"""The GPT train step sharded over a TPU slice, compiled without a TPU: per-chip memory of
the rewrite against hand-written bfloat16, and the loss-scale optimizer's skip decision in
the compiled program.

A deviceless XLA:TPU compile (``jax.experimental.topologies``, libtpu from PyPI: run it in
``.venv-tpu``, see ``make tpu-memory``) of the benchmark's GPT step over every chip of a
topology (``v5p:2x2x1``: four chips by default), with a ``(data, model)`` mesh:

* ``fsdp``: mesh ``(chips, 1)``: the batch and every parameter (and Adam's moments) split
  over ``data`` along their largest dimension divisible by it (FSDP/ZeRO-3 style: XLA
  gathers each weight where it is read);
* ``fsdp+tensor``: mesh ``(chips / 2, 2)``: as ``fsdp``, and each matrix's other dimension
  split over ``model`` (tensor parallelism of the weights, activations as XLA propagates).

Variants: ``hand-bf16`` (the model written in bfloat16), ``rw-bf16`` (``rewrite(step,
dtype=jnp.bfloat16)``) and ``rw-bf16-lso`` (the same with ``loss_scale_optimizer`` around
Adam: its finiteness check and skip compiled in). For each: XLA's per-chip buffer
assignment (peak = arguments + outputs - donated + temporaries), the collectives of the
optimised HLO by kind, and, for the loss-scaled step, the collectives it adds to
``rw-bf16``'s (the skip decision must agree across chips at the cost of one reduction,
not one per gradient leaf).

Run (from the repository root)::

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 .venv-tpu/bin/python benchmarks/tpu_sharded.py \\
        --topology v5p:2x2x1 [--layers 12 --batch 32 --seq 1024] [--out runs/x.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _gpu_models  # noqa: E402
import _gpu_steps  # noqa: E402

VARIANTS = {
    "hand-bf16": _gpu_steps.VARIANTS["hand-bf16"],
    "rw-bf16": _gpu_steps.VARIANTS["rw-bf16"],
    "rw-bf16-lso": dataclasses.replace(
        _gpu_steps.VARIANTS["rw-bf16"], key="rw-bf16-lso", loss_scale=True
    ),
}

#: Collective ops of XLA's optimised HLO (the ``-start`` halves of asynchronous ones).
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"=\s*\S+\s+(" + "|".join(_COLLECTIVES) + r")(-start)?\(")


def collectives(hlo: str) -> dict[str, int]:
    """Collective ops of an optimised HLO module's text, by kind (async ones counted once)."""
    counts = dict.fromkeys(_COLLECTIVES, 0)
    for m in _OP.finditer(hlo):
        counts[m.group(1)] += 1
    return counts


def pred_all_reduces(hlo: str) -> int:
    """All-reduces of boolean or integer scalars or small vectors: decisions, not data."""
    n = 0
    for line in hlo.splitlines():
        if _OP.search(line) and "all-reduce" in line:
            result = line.split("=", 1)[1].strip().split(" ", 1)[0]
            if re.match(r"^\(?(pred|s32|u32)\[\d{0,3}\]", result):
                n += 1
    return n


def spec_for(shape: tuple[int, ...], data: int, model: int) -> P:
    """FSDP (and tensor) split of one array: its largest dimension divisible by ``data`` on
    ``data``; with ``model`` > 1, its largest other dimension divisible by ``model`` too."""
    axes: list[Any] = [None] * len(shape)
    order = sorted(range(len(shape)), key=lambda i: -shape[i])
    for i in order:
        if shape[i] % data == 0 and shape[i] >= data:
            axes[i] = "data"
            break
    if model > 1 and len(shape) >= 2:
        for i in order:
            if axes[i] is None and shape[i] % model == 0:
                axes[i] = "model"
                break
    return P(*axes)


def compile_sharded(model: Any, key: str, mesh: jax.sharding.Mesh) -> tuple[Any, float]:
    tx, step = _gpu_steps.make_step(model, VARIANTS[key])
    data, tensor = mesh.shape["data"], mesh.shape["model"]

    def place(a: Any, batch: bool = False) -> jax.ShapeDtypeStruct:
        shape = tuple(np.shape(a))
        if batch:
            spec = P("data", *([None] * (len(shape) - 1)))
        else:
            spec = spec_for(shape, data, tensor)
        return jax.ShapeDtypeStruct(shape, np.dtype(a.dtype), sharding=NamedSharding(mesh, spec))

    params = jax.tree.map(place, model.params)
    state = jax.tree.map(place, model.state)
    opt_state = jax.tree.map(place, jax.eval_shape(tx.init, model.params))
    inputs, labels = place(model.inputs, True), place(model.labels, True)
    args = (params, state, opt_state, inputs, labels)
    shardings = jax.tree.map(lambda a: a.sharding, args)
    out_shardings = (*shardings[:3], NamedSharding(mesh, P()))
    t0 = time.perf_counter()
    jitted = jax.jit(
        step,
        in_shardings=shardings,
        out_shardings=out_shardings,
        donate_argnums=_gpu_steps.DONATE,
    )
    compiled = jitted.trace(*args).lower(lowering_platforms=("tpu",)).compile()
    return compiled, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5p:2x2x1")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--meshes", nargs="+", default=["fsdp", "fsdp+tensor"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    from jax.experimental import topologies

    devices = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices
    chips = len(devices)
    model = _gpu_models.gpt_model(
        layers=args.layers,
        d_model=args.d_model,
        heads=args.heads,
        seq=args.seq,
        vocab=args.vocab,
        batch=args.batch,
    )
    result: dict[str, Any] = {
        "topology": args.topology,
        "device_kind": devices[0].device_kind,
        "chips": chips,
        "model": model.description,
        "config": model.config,
        "date": datetime.date.today().isoformat(),
        "host": f"{platform.machine()} CPU x{os.cpu_count()}",
        "jax": jax.__version__,
        "libtpu": _gpu_steps.version_of("libtpu"),
        "runs": {},
    }
    print(
        f"## {result['device_kind']} ({args.topology}, {chips} chips; deviceless XLA:TPU "
        f"compile on {result['host']}), jax {result['jax']}, libtpu {result['libtpu']}, "
        f"{result['date']}\n{model.description}\n"
    )
    print(
        "| mesh | variant | peak GiB per chip | temp GiB | rw/hand peak | all-reduce | "
        "all-gather | reduce-scatter | decision all-reduces | compile s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mesh_name in args.meshes:
        tensor = 2 if mesh_name == "fsdp+tensor" else 1
        mesh = jax.sharding.Mesh(
            np.array(devices).reshape(chips // tensor, tensor), ("data", "model")
        )
        runs: dict[str, Any] = {}
        for key in args.variants:
            compiled, seconds = compile_sharded(model, key, mesh)
            hlo = compiled.as_text()
            m = compiled.memory_analysis()
            runs[key] = rec = {
                "peak_bytes": _gpu_steps.xla_peak_bytes(compiled),
                "temp_bytes": int(m.temp_size_in_bytes),
                "collectives": collectives(hlo),
                "decision_all_reduces": pred_all_reduces(hlo),
                "compile_s": seconds,
            }
            hand = runs.get("hand-bf16", {}).get("peak_bytes")
            ratio = f"{rec['peak_bytes'] / hand:.3f}" if hand and key != "hand-bf16" else "-"
            c = rec["collectives"]
            print(
                f"| {mesh_name} | {key} | {rec['peak_bytes'] / 2**30:.3f} | "
                f"{rec['temp_bytes'] / 2**30:.3f} | {ratio} | {c['all-reduce']} | "
                f"{c['all-gather']} | {c['reduce-scatter']} | {rec['decision_all_reduces']} | "
                f"{seconds:.0f} |",
                flush=True,
            )
            del compiled
        result["runs"][mesh_name] = runs
    _gpu_steps.write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
