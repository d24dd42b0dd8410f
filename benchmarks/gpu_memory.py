"""GPU and TPU memory of the GPU benchmark's train steps, measured without a GPU or TPU.

``make gpu-memory`` (or ``.venv-gpu/bin/python benchmarks/gpu_memory.py``) compiles the train
steps of ``gpu_speedup.py`` -- the same models, sizes, variants and step builders
(``_gpu_models.py``, ``_gpu_steps.py``) -- for an NVIDIA H200 (or ``--target h100``) on a
CPU-only machine: a *deviceless* XLA:GPU compile through ``jax.experimental.topologies``.
XLA's buffer assignment for the card comes out of ``memory_analysis()``; on the H200 it
matched the card's own figures within 40 KB (2026-11-26). Timings still need a card.

It needs jax/jaxlib with the CUDA plugin (``jax[cuda12]``, about 5.6 GB of wheels), so it has
its own environment, ``.venv-gpu`` (made by ``make gpu-memory``; never part of ``make test``).
No GPU, driver or CUDA toolkit is used: ``CUDA_VISIBLE_DEVICES=-1``, ``JAX_PLATFORMS=cpu``.

Reported per model and variant (``f32``, ``rw-bf16``, ``hand-bf16``, ``rw-f16``,
``rw-f16-lso``, ``hand-f16``, ``hand-f16-dynscale``, ``rw-fp8``; see ``gpu_speedup.py``):

* ``peak``: arguments + outputs - aliased (donated) + temporaries, the figure ``gpu_speedup.py``
  reports on the card, and ``temp`` alone;
* ``moved``: bytes each kernel of the optimised HLO reads and writes (operands and results of
  every fusion, library call and unfused op; for a ``conditional``, its costliest branch):
  XLA's ``cost_analysis`` is not available without a device, so it is counted from the HLO;
* ``kernels`` (launches: fusions, cuBLAS/cuDNN calls, unfused ops) and ``converts`` (convert
  ops in the optimised HLO, fused or not); per model, the kernels loss scaling adds
  (``rw-f16-lso`` over ``rw-f16``, Flax's ``hand-f16-dynscale`` over ``hand-f16``);
* ``rw/hand``: peak of each rewritten variant over its hand-written counterpart (``rw-bf16`` /
  ``hand-bf16``, ``rw-f16`` / ``hand-f16``, ``rw-f16-lso`` / ``hand-f16-dynscale``,
  ``rw-fp8`` / ``hand-bf16``);
* ``float8_gemms``: cuBLASLt float8 GEMM calls (``__cublas$lt$matmul$f8``) and
  ``float8_triton_fusions``: Triton GEMM fusions fed float8 operands (``rw-fp8``: the former
  should count every float8 matmul, the latter none).

TPUs (``--target v5e``, ``v5p``, ``v6e``: one chip; ``make tpu-memory``, whose environment
``.venv-tpu`` holds jax with libtpu) compile the same steps through XLA:TPU, deviceless as
well (``jax.experimental.topologies.get_topology_desc(platform="tpu", ...)``). There XLA's
``cost_analysis`` works without a device and is reported as it is: ``bytes accessed`` and
``optimal_seconds``, XLA:TPU's cost-model estimate of the step's time (a model of the chip,
not a timing), with the rewrite-over-hand-written ratio of each. A step that does not fit the
chip's HBM is refused at compile time (``CompileTimeHbmOom``): it is reported as "does not
fit (needs X GiB)", X read from XLA's message. ``float8_dots`` counts the dots and
convolutions of the optimised HLO with a float8 operand (fused or not) and
``float8_upcasts`` the converts from float8 to a wider type: float8 GEMMs kept by XLA:TPU
show in the former, emulated ones in the latter; ``tpu_kernel_calls`` counts the Mosaic
custom calls (``tpu_custom_call``: ``rw-bf16-fused``'s flash-attention kernels, three per
attention with its backward). The TPU default is ``f32``, ``rw-bf16``,
``hand-bf16``, ``rw-fp8`` and ``rw-bf16-fused`` (float16 is no TPU type). The steps are
rewritten with ``dtype=jnp.bfloat16`` given explicitly, so that every target compiles the same
program (``dtype=None`` decides where the program is lowered: bfloat16 for a TPU here too).

``--baseline RUN.json`` prints an earlier run beside this one and takes from it the variants
not compiled now: after a painting change, ``--variants rw-bf16 rw-f16 rw-f16-lso`` recompiles
only the rewritten steps (the float32 and hand-written ones do not depend on jmp_rewrite).

Full sizes are the card's (GPT-2 small B32 T1024, ResNet-50 B128 224x224, ViT-B/16 B128); a
GPT compile takes minutes on two cores. ``--smoke`` compiles toy sizes (seconds);
``--platform cpu`` compiles for the host instead (no CUDA plugin needed; CPU memory is no
proxy for the GPU's: XLA:CPU upcasts half-precision matmuls) -- the tests use both.
"""

from __future__ import annotations

import os
import sys

# Before JAX starts: no GPU is looked for; the CUDA plugin only compiles.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _gpu_models  # noqa: E402
import _gpu_steps  # noqa: E402

import jmp_rewrite  # noqa: E402

_COMMON = """
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
"""


def _target(name: str, bandwidth: int, memory: int) -> str:
    """An XLA ``GpuTargetConfig`` text proto (cuDNN 9.8, CUDA runtime 12.9)."""
    return (
        f"gpu_device_info {{{_COMMON}  memory_bandwidth: {bandwidth}\n"
        f"  device_memory_size: {memory}\n}}\n"
        'platform_name: "CUDA"\n'
        "dnn_version_info { major: 9 minor: 8 }\n"
        "runtime_version { major: 12 minor: 9 }\n"
        f'device_description_str: "{name}"\n'
    )


#: Targets: the H200 of the 2026-11-26 measurements, and the H100 SXM (same chip, 80 GB).
TARGETS = {
    "h200": _target("NVIDIA H200", 4_800_000_000_000, 150_109_208_576),
    "h100": _target("NVIDIA H100 80GB HBM3", 3_352_320_000_000, 84_978_434_048),
}
#: TPU targets: one chip of each generation (the topology names libtpu takes).
TPU_TARGETS = {"v5e": "v5e:1x1", "v5p": "v5p:1x1x1", "v6e": "v6e:1x1"}
#: What runs by default on a TPU: float32, bfloat16 (rewritten, by hand), float8 weight GEMMs
#: and fused attention (float16 is no TPU type).
TPU_VARIANTS = ("f32", "rw-bf16", "hand-bf16", "rw-fp8", "rw-bf16-fused")
#: Variants by half type (``f32`` is the reference of both).
BY_DTYPE = {
    "bf16": ("rw-bf16", "hand-bf16"),
    "f16": ("rw-f16", "rw-f16-lso", "hand-f16", "hand-f16-dynscale"),
    "fp8": ("rw-fp8",),
    # Issue 31: the rewrite with fuse_attention=True (cuDNN flash attention).
    "fused": ("rw-bf16-fused", "rw-f16-lso-fused"),
}
#: Rewritten variant -> its hand-written counterpart.
PAIRS = {
    "rw-bf16": "hand-bf16",
    "rw-f16": "hand-f16",
    "rw-f16-lso": "hand-f16-dynscale",
    "rw-fp8": "hand-bf16",
    "rw-bf16-fused": "hand-bf16",
    "rw-f16-lso-fused": "hand-f16-dynscale",
}
#: Fused variant -> the same rewrite with attention as written.
FUSED = {"rw-bf16-fused": "rw-bf16", "rw-f16-lso-fused": "rw-f16-lso"}
#: cuDNN's fused attention calls (forward, backward; with or without a bias).
_FMHA = re.compile(r'custom_call_target="__cudnn\$fmha\w*"')
#: Mosaic (Pallas) TPU kernels: the TPU flash attention's forward, dK/dV and dQ kernels.
_MOSAIC = re.compile(r'custom_call_target="tpu_custom_call"')
#: cuBLASLt's float8 GEMM in optimised XLA:GPU HLO; a Triton GEMM fusion fed float8 operands.
_F8_GEMM = re.compile(r'custom_call_target="__cublas\$lt\$matmul\$f8"')
_F8_TRITON = re.compile(r"^.*\bfusion\(.*\bf8e\w*\[.*__triton_gemm.*$", re.MULTILINE)
#: XLA:TPU's compile-time HBM check; the step's needs, its two forms (temporaries alone,
#: or all the program's buffers), and the chip's HBM.
_HBM_OOM = re.compile(r"CompileTimeHbmOom|exceeds available HBM|out of memory in memory space hbm")
_NEEDS = (
    ("all buffers", re.compile(r"Used ([0-9.]+)([KMGT])i?B? of ([0-9.]+)([KMGT])i?B? hbm")),
    (
        "temporaries",
        re.compile(r"\(([0-9.]+)([KMGT])\) exceeds available HBM \(([0-9.]+)([KMGT])\)"),
    ),
)
_UNIT = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
#: A float8 array type (``f8e4m3fn``, ``f8e5m2``, ...).
_F8 = re.compile(r"\bf8e\w*\[")
#: Card sizes of ``gpu_speedup.py`` on a card over 100 GiB (GPT batch 16 on an 80 GB one).
FULL_SIZES = {"gpt": {"batch": 32, "seq": 1024}, "resnet50": {"batch": 128}, "vit": {"batch": 128}}

# ------------------------------------------------------------------------------------------
# Optimised HLO: kernels, converts, bytes moved
# ------------------------------------------------------------------------------------------

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4}
_BYTES |= {"u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_BYTES |= dict.fromkeys(("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz", "f8e5m2fnuz"), 1)
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
_BRANCHES = re.compile(
    r"(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation=%?([\w.\-]+))"
)
#: Instructions that launch nothing (views, tuples, constants).
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all"}
_FREE |= {"partition-id", "replica-id", "opt-barrier"}


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (a tuple counts all its arrays)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BYTES[dtype]
    return total


def _computations(text: str) -> tuple[dict[str, list[tuple[str, ...]]], str | None]:
    comps: dict[str, list[tuple[str, ...]]] = {}
    entry, current = None, None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(2)
            comps[current] = []
            entry = current if m.group(1) else entry
        elif current is not None and line.strip() == "}":
            current = None
        elif current is not None and (m := _INSTRUCTION.match(line)):
            comps[current].append(m.groups())
    return comps, entry


def hlo_stats(text: str) -> dict[str, int]:
    """Kernels, bytes moved and converts of an optimised HLO module (see the module doc)."""
    comps, entry = _computations(text)

    def walk(name: str) -> dict[str, int]:
        out = dict.fromkeys(("kernels", "fusions", "library_calls", "bytes_moved"), 0)
        shapes = {n: s for n, s, _, _ in comps.get(name, [])}
        for _, shape, op, rest in comps.get(name, []):
            if op == "conditional":
                names = []
                for group, single in _BRANCHES.findall(rest):
                    names += [b.strip().lstrip("%") for b in group.split(",")] if group else []
                    names += [single] if single else []
                branches = [walk(b) for b in names]
                best = max(branches, key=lambda b: b["bytes_moved"], default={})
                for k, v in best.items():
                    out[k] += v
                continue
            if op in _FREE:
                continue
            operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
            out["kernels"] += 1
            out["fusions"] += op == "fusion"
            out["library_calls"] += op == "custom-call"
            out["bytes_moved"] += shape_bytes(shape) + sum(
                shape_bytes(shapes.get(o, "")) for o in operands
            )
        return out

    stats = walk(entry) if entry else {}
    stats["converts"] = len(re.findall(r"\bconvert\(", text))
    stats["float8_gemms"] = len(_F8_GEMM.findall(text))
    stats["float8_triton_fusions"] = len(_F8_TRITON.findall(text))
    stats["fused_attention_calls"] = len(_FMHA.findall(text))
    stats["tpu_kernel_calls"] = len(_MOSAIC.findall(text))
    stats.update(float8_stats(comps))
    return stats


def _operands(rest: str, shapes: dict[str, str]) -> list[str]:
    """The shapes of an instruction's operands: typed in place (XLA:GPU's text) or by name
    from their computation (XLA:TPU's text names them only)."""
    out = []
    for operand in _split_operands(rest):
        name = re.search(r"%([\w.\-]+)\s*$", operand)
        typed = operand[: name.start()] if name else operand
        if _ARRAY.search(typed) or name is None:
            out.append(typed)
        else:
            out.append(shapes.get(name[1], ""))
    return out


def _split_operands(rest: str) -> list[str]:
    """The operand list of ``op(...)``, split at its top-level commas."""
    depth, parts, current = 0, [], []
    for ch in rest:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                break
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
            continue
        current.append(ch)
    parts.append("".join(current).strip())
    return [p for p in parts if p]


def float8_stats(comps: dict[str, list[tuple[str, ...]]]) -> dict[str, int]:
    """``float8_dots``: dots and convolutions with a float8 operand (fused or not);
    ``float8_upcasts``: converts of a float8 array to a wider type."""
    dots = upcasts = 0
    for instructions in comps.values():
        shapes = {n: shape for n, shape, _, _ in instructions}
        for _, shape, op, rest in instructions:
            if op in ("dot", "convolution"):
                dots += any(_F8.search(o) for o in _operands(rest, shapes))
            elif op == "convert" and not _F8.search(shape):
                upcasts += any(_F8.search(o) for o in _operands(rest, shapes))
    return {"float8_dots": dots, "float8_upcasts": upcasts}


def hbm_oom(message: str) -> dict[str, Any] | None:
    """``{"needs_bytes", "hbm_bytes", "needs"}`` of an XLA:TPU compile-time HBM refusal
    (``None`` for any other error). XLA:TPU's sizes are binary (``15.75G``: GiB); ``needs``
    says what its figure counts (``temporaries``: arguments and outputs come on top). Either
    figure is ``None`` where the message does not give it."""
    if not _HBM_OOM.search(message):
        return None
    for what, pattern in _NEEDS:
        if m := pattern.search(message):
            need, hbm = float(m.group(1)) * _UNIT[m.group(2)], float(m.group(3)) * _UNIT[m.group(4)]
            return {"needs_bytes": int(need), "hbm_bytes": int(hbm), "needs": what}
    return {"needs_bytes": None, "hbm_bytes": None, "needs": None}


# ------------------------------------------------------------------------------------------
# Compiling one model x variant
# ------------------------------------------------------------------------------------------


def compile_variant(
    model: _gpu_models.Model, key: str, device: Any, lowering_platform: str
) -> tuple[Any, float]:
    """The compiled train step of ``model`` in variant ``key`` and its compile seconds."""
    variant = _gpu_steps.VARIANTS[key]
    tx, step = _gpu_steps.make_step(model, variant)
    sharding = None if device is None else jax.sharding.SingleDeviceSharding(device)
    args = _gpu_steps.abstract_args(model, tx, sharding)
    precision = (
        jax.default_matmul_precision(variant.precision)
        if variant.precision
        else contextlib.nullcontext()
    )
    t0 = time.perf_counter()
    with precision:
        traced = jax.jit(step, donate_argnums=_gpu_steps.DONATE).trace(*args)
        compiled = traced.lower(lowering_platforms=(lowering_platform,)).compile()
    return compiled, time.perf_counter() - t0


def measure(compiled: Any) -> dict[str, Any]:
    m = compiled.memory_analysis()
    rec: dict[str, Any] = {
        "peak_bytes": _gpu_steps.xla_peak_bytes(compiled),
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "alias_bytes": int(m.alias_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
    }
    stats = hlo_stats(compiled.as_text())
    rec.update(stats)
    try:  # XLA:TPU's (and the host's) cost model; XLA:GPU has none without a device
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001
        cost = None
    cost = cost[0] if isinstance(cost, list) and cost else cost
    if cost:
        rec["flops"] = cost.get("flops")
        rec["bytes_accessed"] = cost.get("bytes accessed")
        # A cost model that cannot price the program answers a negative time (libtpu 0.0.50.1
        # on v5e and v6e): no estimate then, the answer kept beside it.
        seconds = cost.get("optimal_seconds")
        rec["optimal_seconds"] = seconds if seconds is not None and seconds > 0 else None
        if rec["optimal_seconds"] is None and seconds is not None:
            rec["optimal_seconds_reported"] = seconds
    return rec


def ratios(variants: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Peak memory of each rewritten variant over its hand-written counterpart."""
    out = {}
    for rw, hand in PAIRS.items():
        a, b = variants.get(rw, {}), variants.get(hand, {})
        if a.get("peak_bytes") and b.get("peak_bytes"):
            out[f"{rw}/{hand}"] = a["peak_bytes"] / b["peak_bytes"]
    return out


#: Loss-scaled variant -> the same step without loss scaling.
LOSS_SCALED = {"rw-f16-lso": "rw-f16", "hand-f16-dynscale": "hand-f16"}


def loss_scaling_kernels(variants: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Kernels each loss-scaled variant adds to the same step without loss scaling."""
    out = {}
    for scaled, plain in LOSS_SCALED.items():
        a, b = variants.get(scaled, {}), variants.get(plain, {})
        if "kernels" in a and "kernels" in b:
            out[f"{scaled} - {plain}"] = a["kernels"] - b["kernels"]
    return out


def estimate_ratios(variants: dict[str, dict[str, Any]]) -> dict[str, float]:
    """XLA's time estimate (``optimal_seconds``) of each rewritten variant over its
    hand-written counterpart, where the compiler gives one (XLA:TPU)."""
    out = {}
    for rw, hand in PAIRS.items():
        a, b = variants.get(rw, {}), variants.get(hand, {})
        if a.get("optimal_seconds") and b.get("optimal_seconds"):
            out[f"{rw}/{hand}"] = a["optimal_seconds"] / b["optimal_seconds"]
    return out


def _ratio_of(model: dict[str, Any], key: str) -> float | None:
    return next((v for k, v in model.get("ratios", {}).items() if k.startswith(key + "/")), None)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def fused_ratios(variants: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Peak memory and bytes moved of each fused variant over the unfused rewrite (and
    temporaries, where both have them)."""
    out = {}
    for fused, plain in FUSED.items():
        a, b = variants.get(fused, {}), variants.get(plain, {})
        if a.get("peak_bytes") and b.get("peak_bytes") and b.get("bytes_moved"):
            out[f"{fused}/{plain}"] = {
                "peak": a["peak_bytes"] / b["peak_bytes"],
                "moved": a["bytes_moved"] / b["bytes_moved"],
            }
            if a.get("temp_bytes") is not None and b.get("temp_bytes"):
                out[f"{fused}/{plain}"]["temp"] = a["temp_bytes"] / b["temp_bytes"]
    return out


def summarise(model: dict[str, Any]) -> None:
    """Sets a model record's ``ratios``, ``fused_ratios`` and ``loss_scaling_kernels`` from
    its variants."""
    model["ratios"] = ratios(model["variants"])
    model["estimate_ratios"] = estimate_ratios(model["variants"])
    model["fused_ratios"] = fused_ratios(model["variants"])
    model["loss_scaling_kernels"] = loss_scaling_kernels(model["variants"])


def take_baseline(result: dict[str, Any], baseline: dict[str, Any]) -> None:
    """Fills in, from an earlier run, the variants this run did not compile (marked
    ``from_baseline``), and records the earlier peaks and ratios as ``before``."""
    for key, model in result["models"].items():
        old = baseline.get("models", {}).get(key)
        if old is None or old.get("config") != model["config"]:
            continue
        for vkey, rec in old["variants"].items():
            if vkey not in model["variants"] and "peak_bytes" in rec:
                model["variants"][vkey] = {**rec, "from_baseline": True}
        summarise(model)
        model["before"] = {
            "peak_bytes": {k: r.get("peak_bytes") for k, r in old["variants"].items()},
            "bytes_moved": {k: r.get("bytes_moved") for k, r in old["variants"].items()},
            "ratios": ratios(old["variants"]),
            "loss_scaling_kernels": loss_scaling_kernels(old["variants"]),
        }


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f}"


def does_not_fit(rec: dict[str, Any]) -> str:
    """A compile-time HBM refusal, worded: does not fit (needs X GiB ...; HBM Y GiB)."""
    oom = rec["hbm_oom"]
    what = f" of {oom['needs']}" if oom.get("needs") else ""
    hbm = _gib(oom["hbm_bytes"])
    return f"does not fit (needs {_gib(oom['needs_bytes'])} GiB{what}; HBM {hbm} GiB)"


def print_tpu_table(result: dict[str, Any]) -> None:
    """The TPU figures: memory, bytes accessed and XLA's estimate, with their ratios."""
    meta = result["meta"]
    unit, scale = ("MiB", 2.0**-20) if meta["smoke"] else ("GiB", 2.0**-30)
    print(
        f"\n## {meta['target']} ({meta['topology']}; deviceless XLA:TPU compile on "
        f"{meta['host']}), jax {meta['jax']}, libtpu {meta['libtpu']}, {meta['date']}\n"
    )
    head = f"| model | variant | peak {unit} | temp {unit} | rw/hand peak | GB accessed "
    head += "| XLA's estimate ms | rw/hand estimate | converts | float8 dots | float8 upcasts "
    head += "| compile s |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for m in result["models"].values():
        for key, r in m["variants"].items():
            if "hbm_oom" in r:
                print(f"| {m['key']} | {key} | {does_not_fit(r)} |")
                continue
            if "peak_bytes" not in r:
                print(f"| {m['key']} | {key} | {r.get('error', '?')[:80]} |")
                continue
            est = r.get("optimal_seconds")
            if est is None and "optimal_seconds_reported" in r:
                est_text = f"none ({r['optimal_seconds_reported']:.3g} s)"
            else:
                est_text = _fmt(None if est is None else est * 1e3, ".3f")
            acc = r.get("bytes_accessed")
            ratio = m.get("estimate_ratios", {})
            er = next((v for k, v in ratio.items() if k.startswith(key + "/")), None)
            print(
                f"| {m['key']} | {key} | {r['peak_bytes'] * scale:.2f} "
                f"| {r['temp_bytes'] * scale:.2f} | {_fmt(_ratio_of(m, key), '.3f')} "
                f"| {_fmt(None if acc is None else acc / 1e9, '.2f')} "
                f"| {est_text} | {_fmt(er, '.3f')} "
                f"| {r['converts']} | {r['float8_dots']} | {r['float8_upcasts']} "
                f"| {r['compile_s']:.0f} |"
            )
    print(
        "\nXLA's estimate: optimal_seconds, XLA:TPU's cost model of the step (not a timing); "
        "none: the model answered a negative time (shown), no estimate for that chip."
    )
    for m in result["models"].values():
        for key, r in m["variants"].items():
            if r.get("tpu_kernel_calls"):
                print(f"{m['key']} {key}: {r['tpu_kernel_calls']} Mosaic TPU kernel calls")
        for name, f in m.get("fused_ratios", {}).items():
            temp = f" temporaries {f['temp']:.3f}x," if "temp" in f else ""
            print(f"{m['key']} {name}: peak {f['peak']:.3f}x,{temp} bytes moved {f['moved']:.3f}x")


def print_table(result: dict[str, Any]) -> None:
    meta = result["meta"]
    if meta["platform"] == "tpu":
        print_tpu_table(result)
        return
    unit, scale = ("MiB", 2.0**-20) if meta["smoke"] else ("GiB", 2.0**-30)
    print(
        f"\n## {meta['target']} (deviceless XLA:GPU compile on {meta['host']}), "
        f"jax {meta['jax']}, {meta['date']}\n"
    )
    base = any("before" in m for m in result["models"].values())
    head = f"| model | variant | peak {unit} | temp {unit} | rw/hand | moved GB | kernels "
    head += "| converts | compile s |"
    head += f" before: peak {unit} | rw/hand | moved GB |" if base else ""
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for m in result["models"].values():
        before = m.get("before", {})
        for key, r in m["variants"].items():
            if "peak_bytes" not in r:
                print(f"| {m['key']} | {key} | {r.get('error', '?')[:80]} |")
                continue
            line = (
                f"| {m['key']} | {key} | {r['peak_bytes'] * scale:.2f} "
                f"| {r['temp_bytes'] * scale:.2f} | {_fmt(_ratio_of(m, key), '.3f')} "
                f"| {r['bytes_moved'] / 1e9:.2f} | {r['kernels']} | {r['converts']} "
                f"| {'(baseline)' if r.get('from_baseline') else format(r['compile_s'], '.0f')} |"
            )
            if base:
                peak = before.get("peak_bytes", {}).get(key)
                moved = before.get("bytes_moved", {}).get(key)
                line += (
                    f" {_fmt(None if peak is None else peak * scale, '.2f')} "
                    f"| {_fmt(_ratio_of(before, key), '.3f')} "
                    f"| {_fmt(None if moved is None else moved / 1e9, '.2f')} |"
                )
            print(line)
    for m in result["models"].values():
        for key, r in m["variants"].items():
            if r.get("float8_gemms") or r.get("float8_triton_fusions"):
                print(
                    f"{m['key']} {key}: {r['float8_gemms']} cuBLASLt float8 GEMMs, "
                    f"{r['float8_triton_fusions']} Triton GEMM fusions with float8 operands"
                )
    for m in result["models"].values():
        for key, r in m["variants"].items():
            if r.get("fused_attention_calls"):
                print(f"{m['key']} {key}: {r['fused_attention_calls']} cuDNN fused attention calls")
        for name, f in m.get("fused_ratios", {}).items():
            print(f"{m['key']} {name}: peak {f['peak']:.3f}x, bytes moved {f['moved']:.3f}x")
    for m in result["models"].values():
        for name, n in m.get("loss_scaling_kernels", {}).items():
            was = m.get("before", {}).get("loss_scaling_kernels", {}).get(name)
            was = "" if was is None else f" (before: {was})"
            print(f"{m['key']}: loss scaling adds {n} kernels, {name}{was}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=tuple(_gpu_models.BUILDERS), default=None)
    parser.add_argument(
        "--dtypes", nargs="+", choices=tuple(BY_DTYPE), default=None,
        help="default: all on a GPU; on a TPU f32 rw-bf16 hand-bf16 rw-fp8 rw-bf16-fused",
    )  # fmt: skip
    parser.add_argument(
        "--variants", nargs="+", choices=tuple(_gpu_steps.VARIANTS), default=None,
        help="default: f32 and the variants of --dtypes",
    )  # fmt: skip
    parser.add_argument("--target", choices=(*TARGETS, *TPU_TARGETS), default="h200")
    parser.add_argument(
        "--platform", choices=("cuda", "tpu", "cpu"), default=None,
        help="default: the target's (cuda, tpu); cpu: compile for the host (no CUDA plugin "
        "or libtpu; not the accelerator's figures)",
    )  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="toy sizes (seconds)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    parser.add_argument("--dump-hlo", type=Path, default=None, help="folder for optimised HLO")
    parser.add_argument(
        "--baseline", type=Path, default=None,
        help="an earlier run's JSON: printed beside this one, and the source of the variants "
        "not compiled now (e.g. --variants rw-bf16 rw-f16 rw-f16-lso after a painting change: "
        "the float32 and hand-written steps do not depend on jmp_rewrite)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    family = "tpu" if args.target in TPU_TARGETS else "cuda"
    args.platform = args.platform or family
    models = args.models or list(_gpu_models.BUILDERS)
    if args.variants:
        variants = args.variants
    elif family == "tpu" and args.dtypes is None:
        variants = list(TPU_VARIANTS)
    else:
        variants = ["f32", *(v for d in args.dtypes or BY_DTYPE for v in BY_DTYPE[d])]
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

    device, topology_name = None, None
    if args.platform == "cuda":
        from jax.experimental import topologies

        topology = topologies.get_topology_desc(
            platform="cuda", target_config=TARGETS[args.target], topology="1x1x1"
        )
        device = topology.devices[0]
    elif args.platform == "tpu":
        from jax.experimental import topologies

        topology_name = TPU_TARGETS[args.target]
        topology = topologies.get_topology_desc(platform="tpu", topology_name=topology_name)
        device = topology.devices[0]
    result: dict[str, Any] = {
        "meta": {
            "target": device.device_kind if device is not None else f"host ({platform.machine()})",
            "platform": args.platform,
            "host": f"{platform.machine()} CPU x{os.cpu_count()}",
            "date": time.strftime("%Y-%m-%d"),
            "jax": jax.__version__,
            "jaxlib": _gpu_steps.version_of("jaxlib"),
            "cuda_plugin": _gpu_steps.version_of("jax-cuda12-plugin"),
            "libtpu": _gpu_steps.version_of("libtpu"),
            "topology": topology_name,
            "jmp_rewrite": jmp_rewrite.__version__,
            "flax": _gpu_steps.version_of("flax"),
            "optax": _gpu_steps.version_of("optax"),
            "python": platform.python_version(),
            "smoke": args.smoke,
            "argv": sys.argv[1:] if argv is None else list(argv),
        },
        "models": {},
    }
    unit, scale = ("MiB", 2.0**-20) if args.smoke else ("GiB", 2.0**-30)
    for key in models:
        sizes = _gpu_models.SMOKE_SIZES[key] if args.smoke else FULL_SIZES[key]
        model = _gpu_models.BUILDERS[key](**sizes)
        rec_model: dict[str, Any] = {
            "key": key,
            "description": model.description,
            "config": model.config,
            "variants": {},
            "ratios": {},
        }
        result["models"][key] = rec_model
        for vkey in variants:
            t0 = time.perf_counter()
            try:
                compiled, seconds = compile_variant(model, vkey, device, args.platform)
                rec = {**measure(compiled), "compile_s": seconds}
                if args.dump_hlo is not None:
                    args.dump_hlo.mkdir(parents=True, exist_ok=True)
                    name = f"{args.target}-{key}-{vkey}.hlo"
                    (args.dump_hlo / name).write_text(compiled.as_text())
                del compiled
            except Exception as err:  # noqa: BLE001 - record it, go on with the rest
                rec = {"error": f"{type(err).__name__}: {err}"[:2000]}
                if (oom := hbm_oom(str(err))) is not None:
                    rec["hbm_oom"] = oom
                rec["compile_s"] = time.perf_counter() - t0
            rec_model["variants"][vkey] = rec
            summarise(rec_model)
            _gpu_steps.write_json(result, args.out)
            if "peak_bytes" in rec:
                print(
                    f"{key} {vkey}: peak {rec['peak_bytes'] * scale:.3f} {unit}, temp "
                    f"{rec['temp_bytes'] * scale:.3f} {unit}, moved "
                    f"{rec['bytes_moved'] / 1e9:.2f} GB, {rec['kernels']} kernels, "
                    + (
                        f"XLA's estimate {rec['optimal_seconds'] * 1e3:.3f} ms, "
                        if rec.get("optimal_seconds") and args.platform == "tpu"
                        else ""
                    )
                    + f"compile {rec['compile_s']:.0f} s",
                    flush=True,
                )
            elif "hbm_oom" in rec:
                print(f"{key} {vkey}: {does_not_fit(rec)}, {rec['compile_s']:.0f} s", flush=True)
            else:
                print(f"{key} {vkey}: {rec['error'][:500]}", flush=True)
    if args.baseline is not None:
        take_baseline(result, json.loads(args.baseline.read_text()))
        _gpu_steps.write_json(result, args.out)
    print_table(result)
    return result


if __name__ == "__main__":
    main()
