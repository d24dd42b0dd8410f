"""Speed-up of ``jmp_rewrite`` on a GPU: whole train steps, float32 vs rewritten vs hand-written.

The one command a GPU session runs (from the repository root; about 9 minutes at most; the
script stops starting new work after ``--budget-s`` and writes the JSON after every variant,
so a run cut short still leaves every finished figure)::

    make .venv/.installed && .venv/bin/pip install -q "jax[cuda12]"
    set -o pipefail; PYTHONPATH=$PWD PYTHONUNBUFFERED=1 timeout 570 .venv/bin/python benchmarks/gpu_speedup.py --tf32 --budget-s 480 --out $OUT/gpu_speedup.json 2>&1 | tee $OUT/gpu_speedup.log

(``$OUT`` is the device tool's output folder; elsewhere use any path. ``--models gpt`` or
``--variants f32 rw-bf16 hand-bf16`` reruns a part; ``--tf32`` adds float32 with TF32 matmuls,
in the last pass.) ``--smoke`` runs everything at toy sizes and without a time budget (CPU,
about 1.5 minutes of CPU; the tests run it); ``--trace-only`` traces, rewrites and lowers the
full-size steps without compiling. On a machine without a GPU the script refuses the full-size
run unless ``--allow-cpu`` is given.

What is timed, each in one process on one card: a whole jitted train step (forward, backward
and Adam; parameters, model state and optimizer state donated) of

* ``gpt``: GPT-2 small (12 layers, d=768, 12 heads, sequence 1024, vocabulary 50304, batch 16
  on an 80 GB card, 32 on larger ones), plain JAX;
* ``resnet50``: ResNet-50 at ImageNet shapes (224x224 NHWC, batch 128), plain JAX;
* ``vit``: ViT-B/16 (224x224, batch 128) as a Flax Linen user writes it.

Variants (in this order of priority: with a short budget the later passes are skipped):

* ``f32``: float32, ``jax.default_matmul_precision('highest')`` (no TF32);
* ``rw-bf16``: ``jmp_rewrite.rewrite(step, dtype=bfloat16)``;
* ``hand-bf16``: the same model with Flax's ``dtype=jnp.bfloat16`` (float32 parameters,
  float32 normalisation statistics and loss), the baseline a Flax user has today;
* ``rw-f16-lso``: ``rewrite(dtype=float16)`` with ``loss_scale_optimizer`` (``lax.cond``);
* ``rw-f16-lso-select``: the same with ``loss_scale_optimizer(use_select=True)``;
* ``f32-tf32`` (``--tf32``): float32 with ``default_matmul_precision('tensorfloat32')``;
* ``rw-bf16-fused``: ``rewrite(dtype=bfloat16, fuse_attention=True)``: attention forward and
  backward as cuDNN's flash attention (``speedup_vs_unfused``: over ``rw-bf16``; target
  1.25x for the GPT at T1024);
* only when named with ``--variants``: ``rw-fp8-fused`` (float8 weight GEMMs and fused
  attention: the two levers together, held to 1.25x over ``rw-fp8``), ``rw-fp8``
  (``rewrite(dtype=bfloat16, fp8=True)``:
  the blocks' weight GEMMs in float8, ``float8_matmuls`` and ``float8_flops_share`` count
  them), ``hw-fp8-qwix`` (its hand-written baseline, GPT only: ``hand-bf16`` with the same
  weight GEMMs through qwix's quantized-training dot, e4m3 forward, e5m2 gradients, per-tensor
  current scaling; ``skipped: qwix not installed`` where qwix is missing -- it is not a
  dependency; see ``_gpu_steps.qwix_fp8_dot``), ``rw-f16`` (``rewrite(dtype=float16)``, no loss
  scaling), ``hand-f16`` (Flax's ``dtype=jnp.float16``) and ``hand-f16-dynscale`` (that model
  with ``flax.training.dynamic_scale.DynamicScale`` and ``jnp.where`` on the new parameters
  and optimizer state, as Flax's ImageNet example trains in float16).

Reported per model and variant: median step time, speed-up over ``f32``, speed ratio to
``hand-bf16`` (``t_hand / t``: above 1 is faster), achieved TFLOP/s and MFU (matmul and
convolution FLOPs counted from the step's jaxpr, against the card's dense bf16 peak, looked up
by device kind or given with ``--peak-tflops``), XLA's FLOP count (``cost_analysis``), peak
memory (XLA's buffer assignment: arguments + outputs - aliased + temporaries, per variant; and
the process-wide ``peak_bytes_in_use`` of the allocator, which only grows), trace (+ rewrite),
lowering and compile times, the share of matmul FLOPs whose operands are half precision, and
the losses of every step (all variants start from the same parameters and train on one fixed
batch, so the rewritten losses should track float32's).
"""  # noqa: E501 - the command above is one line on purpose: copy it whole

from __future__ import annotations

import os

# Before JAX starts: let one program use most of the card (JAX preallocates 75% by default).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _gpu_models  # noqa: E402
from _gpu_steps import (  # noqa: E402
    DEFAULT_VARIANTS,
    DONATE,
    VARIANTS,
    Unavailable,
    Variant,
    abstract_args,
    make_step,
    version_of,
    write_json,
    xla_peak_bytes,
)

import jmp_rewrite  # noqa: E402

HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
MATMULS = ("dot_general", "conv_general_dilated")
#: Name-stack marker of ``jmp_rewrite.float32_region`` (its documented mechanism).
REGION = "jmp_rewrite_float32_region"

#: Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s, by a substring of ``device_kind``
#: (first match wins, so the specific names come first). H200 is the H100's chip.
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200 NVL", 835.0),
    ("GH200", 989.4),
    ("H200", 989.4),
    ("H100", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
)


#: XLA flags for ``--smoke``: LLVM's optimisations take most of XLA:CPU's compile time.
SMOKE_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
#: Passes over the models: every model gets the headline variants before any gets the rest.
PASSES = (
    ("f32", "rw-bf16", "hand-bf16"),
    ("rw-bf16-fused",),
    ("rw-f16-lso",),
    ("rw-fp8", "rw-fp8-fused", "hw-fp8-qwix"),
    ("rw-bf16-cuda-lists",),
    ("rw-f16-lso-select",),
    ("f32-tf32",),
    ("rw-f16", "hand-f16", "hand-f16-dynscale"),
)


# ------------------------------------------------------------------------------------------
# Train steps
# ------------------------------------------------------------------------------------------


def _sub_jaxprs(eqn: Any) -> list[Any]:
    subs = []
    for value in eqn.params.values():
        for v in value if type(value) is tuple else (value,):
            if hasattr(v, "eqns"):
                subs.append(v)
            elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                subs.append(v.jaxpr)
    return subs


def _matmul_flops(eqn: Any) -> int:
    out = eqn.outvars[0].aval
    if eqn.primitive.name == "conv_general_dilated":
        rhs = eqn.invars[1].aval
        spec = eqn.params["dimension_numbers"].rhs_spec  # (out feature, in feature, spatial)
        per_output = rhs.shape[spec[1]] * math.prod(rhs.shape[d] for d in spec[2:])
        return 2 * math.prod(out.shape) * per_output
    (contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval
    return 2 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in contract)


def _is_float8(dtype: Any) -> bool:
    return "float8" in str(dtype)


def _float8_dot_in(jaxpr: Any) -> bool:
    return any(
        e.primitive.name in MATMULS and any(_is_float8(v.aval.dtype) for v in e.invars)
        for e in jaxpr.eqns
    )


def _platform_branch(eqn: Any, platform: str) -> list[Any]:
    """Of a ``lax.platform_dependent`` (a ``cond`` whose branches name their platforms), the
    one branch this backend runs, as a one-element list; else ``[]``. (Fused attention's
    CUDA, TPU and default attentions are alternatives, not work done three times.)"""
    chosen = eqn.params.get("branches_platforms") if eqn.primitive.name == "cond" else None
    if not chosen:
        return []
    index = next((i for i, ps in enumerate(chosen) if ps and platform in ps), None)
    if index is None:
        index = next((i for i, ps in enumerate(chosen) if ps is None), None)
    return [] if index is None else [eqn.params["branches"][index].jaxpr]


def matmul_structure(jaxpr: Any) -> dict[str, Any]:
    """Matmul/conv equations and FLOPs of a traced step, and how many run in half precision.

    Equations inside a ``jmp_rewrite.float32_region`` (the loss-scale optimizer's finiteness
    check has a few float32 matrix-vector products) are counted apart, as ``region_matmuls``:
    they are the optimizer's, not the model's, and stay float32 by design. With ``fp8=True``
    a float8 matmul is a ``lax.platform_dependent`` choice between the float8 GEMM (CUDA) and
    its emulation (float32 operands): counted once, as the float8 GEMM (``float8_matmuls``;
    float8 counts as half precision in ``half_matmuls``).
    """
    counts = dict.fromkeys(
        (
            "matmuls",
            "half_matmuls",
            "matmul_flops",
            "half_matmul_flops",
            "region_matmuls",
            "float8_matmuls",
            "float8_matmul_flops",
        ),
        0,
    )
    top = jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") and hasattr(jaxpr.jaxpr, "eqns") else jaxpr
    here = {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())
    stack = [(top, False, False)]
    while stack:
        scope, outer_region, emulation = stack.pop()
        for eqn in scope.eqns:
            # Name stacks inside sub-jaxprs are relative: a region's flag is inherited.
            region = outer_region or REGION in str(eqn.source_info.name_stack)
            subs = _sub_jaxprs(eqn)
            # the branches of a float8 GEMM's platform_dependent: the emulation is not counted
            choice = eqn.primitive.name == "cond" and any(map(_float8_dot_in, subs))
            subs = subs if choice else _platform_branch(eqn, here) or subs
            stack.extend((sub, region, choice or emulation) for sub in subs)
            if eqn.primitive.name not in MATMULS:
                continue
            if region:
                counts["region_matmuls"] += 1
                continue
            float8 = any(_is_float8(v.aval.dtype) for v in eqn.invars)
            if emulation and not float8:
                continue
            flops = _matmul_flops(eqn)
            half = all(
                np.dtype(v.aval.dtype) in HALF or _is_float8(v.aval.dtype) for v in eqn.invars
            )
            counts["matmuls"] += 1
            counts["matmul_flops"] += flops
            counts["half_matmuls"] += half
            counts["half_matmul_flops"] += flops * half
            counts["float8_matmuls"] += float8
            counts["float8_matmul_flops"] += flops * float8
    total = counts["matmul_flops"]
    counts["half_flops_share"] = counts["half_matmul_flops"] / total if total else 0.0
    counts["float8_flops_share"] = counts["float8_matmul_flops"] / total if total else 0.0
    return counts


def _cost_flops(compiled: Any) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - some backends have no cost model
        return None
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    return float(cost["flops"]) if cost and "flops" in cost else None


def _memory_stats() -> dict[str, Any]:
    stats = jax.devices()[0].memory_stats()
    return stats or {}


# ------------------------------------------------------------------------------------------
# One model x variant
# ------------------------------------------------------------------------------------------


def run_variant(
    model: _gpu_models.Model,
    variant: Variant,
    *,
    warmup: int,
    steps: int,
    deadline: float,
    trace_only: bool = False,
) -> dict[str, Any]:
    """Compiles and times one train step; returns its record (raises on failure).

    With ``trace_only`` the step is traced (and rewritten) and lowered at abstract arguments;
    nothing is allocated, compiled or run: a check of the full-size code paths on any machine.
    """
    tx, step = make_step(model, variant)
    jitted = jax.jit(step, donate_argnums=DONATE)
    if trace_only:
        params, state, opt_state, inputs, labels = abstract_args(model, tx)
    else:
        params, state = jax.device_put(model.params), jax.device_put(model.state)
        opt_state = tx.init(params)
        inputs, labels = jax.device_put(model.inputs), jax.device_put(model.labels)
    args = (params, state, opt_state, inputs, labels)
    precision = (
        jax.default_matmul_precision(variant.precision)
        if variant.precision
        else contextlib.nullcontext()
    )
    with precision:
        t0 = time.perf_counter()
        traced = jitted.trace(*args)  # for rewritten steps this includes the rewrite
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
    rec: dict[str, Any] = {
        "status": "traced" if trace_only else "ok",
        "precision": variant.precision,
        "tf32": variant.tf32,
        "trace_s": t1 - t0,
        "lower_s": t2 - t1,
        **matmul_structure(traced.jaxpr),
    }
    if trace_only:
        return rec
    compiled = lowered.compile()
    rec["compile_s"] = time.perf_counter() - t2
    rec["xla_flops"] = _cost_flops(compiled)
    rec["xla_peak_bytes"] = xla_peak_bytes(compiled)
    del traced, lowered
    times, losses, applied = [], [], []
    for i in range(warmup + steps):
        t = time.perf_counter()
        params, state, opt_state, loss = compiled(params, state, opt_state, inputs, labels)
        jax.block_until_ready((params, state, opt_state, loss))
        dt = time.perf_counter() - t
        losses.append(loss)
        if variant.loss_scale:
            applied.append(jmp_rewrite.last_step_applied(opt_state))
        if i >= warmup:
            times.append(dt)
        if i >= warmup + 2 and time.perf_counter() > deadline:
            rec["steps_cut_by_budget"] = True
            break
    rec["step_times_s"] = times
    if variant.loss_scale:  # a skipped step (lax.cond) is cheaper: time the applied ones
        kept = [t for t, ok in zip(times, applied[warmup:]) if bool(ok)]
        rec["timed_applied_steps"] = len(kept)
        times = kept or times
    rec["median_step_s"] = statistics.median(times)
    rec["min_step_s"] = min(times)
    rec["losses"] = [float(x) for x in losses]
    rec["first_loss"], rec["final_loss"] = rec["losses"][0], rec["losses"][-1]
    stats = _memory_stats()
    rec["process_peak_bytes"] = stats.get("peak_bytes_in_use")
    if variant.loss_scale:
        ls = jmp_rewrite.get_loss_scale_state(opt_state)
        rec["loss_scale"] = float(ls.loss_scale)
        rec["skipped_steps"] = int(ls.skipped_steps)
        rec["applied_steps"] = int(ls.applied_steps)
        rec["applied"] = [bool(a) for a in applied]  # per step: False = skipped (overflow)
    del params, state, opt_state, compiled
    return rec


def _is_oom(err: BaseException) -> bool:
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


# ------------------------------------------------------------------------------------------
# Summary, table, JSON
# ------------------------------------------------------------------------------------------


def compare_losses(run: dict[str, Any], reference: list[float]) -> dict[str, Any]:
    """Losses of ``run`` against float32's, step by step.

    A step skipped by the loss-scale optimizer leaves the parameters unchanged, so each loss
    is compared with float32's loss after the same number of *applied* updates.
    """
    applied = run.get("applied") or [True] * len(run["losses"])
    pairs, updates = [], 0
    for loss, ok in zip(run["losses"], applied):
        if updates < len(reference):
            pairs.append((loss, reference[updates]))
        updates += bool(ok)
    diffs = [abs(a - b) / abs(b) for a, b in pairs]
    return {
        "first_loss_rel_diff_vs_f32": diffs[0],
        "last_loss_rel_diff_vs_f32": diffs[-1],
        "max_loss_rel_diff_vs_f32": max(diffs),
        "loss_steps_compared": len(pairs),
    }


def summarise(model_rec: dict[str, Any], peak_tflops: float | None) -> dict[str, Any]:
    """Ratios against ``f32`` and ``hand-bf16`` and the issue's targets, per variant."""
    runs = {k: v for k, v in model_rec["variants"].items() if v.get("status") == "ok"}
    f32, hand = runs.get("f32"), runs.get("hand-bf16")
    out: dict[str, Any] = {}
    for key, r in runs.items():
        t = r["median_step_s"]
        s: dict[str, Any] = {"tflops": r["matmul_flops"] / t / 1e12}
        s["mfu"] = s["tflops"] / peak_tflops if peak_tflops else None
        s["speedup_vs_f32"] = f32["median_step_s"] / t if f32 else None
        s["speed_vs_hand_bf16"] = hand["median_step_s"] / t if hand else None
        s["memory_vs_hand_bf16"] = (
            r["xla_peak_bytes"] / hand["xla_peak_bytes"]
            if hand and r["xla_peak_bytes"] and hand["xla_peak_bytes"]
            else None
        )
        if f32:
            s.update(compare_losses(r, f32["losses"]))
        out[key] = s
    targets: dict[str, bool | None] = {}
    for key in ("rw-bf16", "rw-bf16-cuda-lists", "rw-f16-lso", "rw-f16-lso-select"):
        if key in out:
            v = out[key]["speed_vs_hand_bf16"]
            targets[f"{key} speed >= 0.97 x hand-bf16"] = None if v is None else v >= 0.97
            m = out[key]["memory_vs_hand_bf16"]
            targets[f"{key} memory <= 1.05 x hand-bf16"] = None if m is None else m <= 1.05
    if model_rec["key"] == "gpt" and "rw-bf16" in out:
        v = out["rw-bf16"]["speedup_vs_f32"]
        targets["rw-bf16 >= 1.8 x f32 (no TF32)"] = None if v is None else v >= 1.8
    # Issue 31: fused attention, alone and with float8 (the two levers add up): 1.25x at
    # T1024, 1.4x from T4096 (attention's share of the step grows with the sequence).
    seq = model_rec.get("config", {}).get("seq")
    need = 1.4 if seq is not None and seq >= 4096 else 1.25
    for fused, plain in (("rw-bf16-fused", "rw-bf16"), ("rw-fp8-fused", "rw-fp8")):
        if model_rec["key"] == "gpt" and fused in runs and plain in runs:
            v = runs[plain]["median_step_s"] / runs[fused]["median_step_s"]
            out[fused]["speedup_vs_unfused"] = v
            targets[f"{fused} >= {need} x {plain}"] = v >= need
    return {"variants": out, "targets": targets}


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def print_table(result: dict[str, Any]) -> None:
    meta = result["meta"]
    print(
        f"\n## {meta['device_kind']} ({meta['platform']}), jax {meta['jax']}, "
        f"peak {meta['peak_tflops']} TFLOP/s bf16 dense ({meta['peak_source']}); "
        f"f32 baseline: TF32 off\n"
    )
    head = (
        "| model | variant | median ms | vs f32 | vs hand-bf16 | TFLOP/s | MFU | XLA mem GiB "
        "| mem vs hand | trace s | compile s | half FLOPs | loss first -> last | Δ vs f32 |"
    )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for m in result["models"].values():
        summ = m.get("summary", {}).get("variants", {})
        for key, r in m["variants"].items():
            if r.get("status") == "traced":
                print(
                    f"| {m['key']} | {key} | traced only | | | "
                    f"{r['matmul_flops'] / 1e12:.2f} TFLOP/step | | | | {r['trace_s']:.2f} | "
                    f"lower {r['lower_s']:.1f} | {r['half_flops_share']:.0%} | | |"
                )
                continue
            if r.get("status") != "ok":
                error = f": {r['error'][:60]}" if r.get("error") else ""
                print(f"| {m['key']} | {key} | {r.get('status')}{error} |")
                continue
            s = summ.get(key, {})
            d = s.get("last_loss_rel_diff_vs_f32")
            print(
                f"| {m['key']} | {key} | {r['median_step_s'] * 1e3:.2f} "
                f"| {_fmt(s.get('speedup_vs_f32'), '.2f')}x "
                f"| {_fmt(s.get('speed_vs_hand_bf16'), '.3f')} "
                f"| {s['tflops']:.1f} | {_fmt(s.get('mfu'), '.1%')} "
                f"| {_fmt(r['xla_peak_bytes'], '.2f', 2.0**-30)} "
                f"| {_fmt(s.get('memory_vs_hand_bf16'), '.3f')} "
                f"| {r['trace_s']:.2f} | {r['compile_s']:.1f} "
                f"| {r['half_flops_share']:.0%} "
                f"| {r['first_loss']:.4f} -> {r['final_loss']:.4f} "
                f"| {_fmt(d, '.2%')} |"
            )
    for m in result["models"].values():
        for name, ok in m.get("summary", {}).get("targets", {}).items():
            print(
                f"target {m['key']}: {name}: {'-' if ok is None else ('met' if ok else 'MISSED')}"
            )


def peak_for(device_kind: str) -> float | None:
    for needle, peak in PEAK_TFLOPS:
        if needle.lower() in device_kind.lower():
            return peak
    return None


# ------------------------------------------------------------------------------------------


def build_model(key: str, args: argparse.Namespace, batch: int | None = None):
    if args.smoke:
        sizes = dict(_gpu_models.SMOKE_SIZES[key])
    else:
        sizes = {"batch": getattr(args, f"{key}_batch")}
        if key == "gpt":
            sizes["seq"] = args.gpt_seq
            # a wider transformer (issue 23: float8 pays from d ~ 2048)
            sizes.update(layers=args.gpt_layers, d_model=args.gpt_width)
            sizes["heads"] = args.gpt_width // 64
    if batch is not None:
        sizes["batch"] = batch
    return _gpu_models.BUILDERS[key](**sizes)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="toy sizes (CPU, seconds)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no new variant after this many seconds (default 480; none with --smoke, "
        "whose runs must all finish however loaded the machine is)",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=tuple(_gpu_models.BUILDERS),
        default=list(_gpu_models.BUILDERS),
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=tuple(VARIANTS),
        default=None,
        help="default: all but f32-tf32 (which --tf32 adds) and the float16 extras "
        "(rw-f16, hand-f16, hand-f16-dynscale)",
    )
    parser.add_argument(
        "--trace-only",
        action="store_true",
        help="trace, rewrite and lower at abstract arguments; compile and run nothing",
    )
    parser.add_argument("--tf32", action="store_true", help="also float32 with TF32 matmuls")
    parser.add_argument(
        "--allow-cpu",
        action="store_true",
        help="run the full-size models even when the default device is not a GPU (hours)",
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps (default 2; 1 with --smoke)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps (default 10; 5 with --smoke)"
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the card's dense bf16 peak (default: looked up by device kind)",
    )
    parser.add_argument(
        "--gpt-batch", type=int, default=None, help="default 16 on cards under 100 GiB, else 32"
    )
    parser.add_argument("--gpt-seq", type=int, default=1024)
    parser.add_argument(
        "--gpt-width", type=int, default=768, help="GPT's d_model (heads: d / 64; default 768)"
    )
    parser.add_argument("--gpt-layers", type=int, default=12, help="GPT's layers (default 12)")
    parser.add_argument("--resnet50-batch", type=int, default=128)
    parser.add_argument("--vit-batch", type=int, default=128)
    args = parser.parse_args(argv)
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 2)
    steps = args.steps if args.steps is not None else (5 if args.smoke else 10)
    if warmup < 1 or steps < 1:
        parser.error(f"--warmup and --steps must be >= 1; got {warmup} and {steps}")
    if args.budget_s is not None:
        budget = args.budget_s
    else:
        budget = math.inf if args.smoke else 480.0
    variants = args.variants or [k for k in DEFAULT_VARIANTS if k != "f32-tf32" or args.tf32]
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    if args.smoke:  # before the backend starts: cheaper code generation (toy sizes, any speed)
        os.environ["XLA_FLAGS"] = " ".join(
            (os.environ.get("XLA_FLAGS", ""), *SMOKE_XLA_FLAGS)
        ).strip()

    start = time.perf_counter()
    deadline = start + budget
    dev = jax.devices()[0]
    if dev.platform != "gpu" and not (args.smoke or args.trace_only or args.allow_cpu):
        parser.error(
            f"the default device is {dev.platform} ({dev.device_kind}), not a GPU: the "
            "full-size models would take hours here and measure nothing this benchmark is "
            "for. Run it on a GPU machine, or pass --smoke (toy sizes), --trace-only (trace "
            "and lower only) or --allow-cpu (run anyway)"
        )
    limit = _memory_stats().get("bytes_limit")
    if args.gpt_batch is None and not args.smoke:
        args.gpt_batch = 32 if limit and limit > 100 * 2**30 else 16
    peak, source = args.peak_tflops, "--peak-tflops"
    if peak is None:
        peak, source = peak_for(dev.device_kind), "table by device kind"
    result: dict[str, Any] = {
        "meta": {
            "jax": jax.__version__,
            "jaxlib": version_of("jaxlib"),
            "jmp_rewrite": jmp_rewrite.__version__,
            "flax": version_of("flax"),
            "optax": version_of("optax"),
            "python": platform.python_version(),
            "platform": dev.platform,
            "device_kind": dev.device_kind,
            "compute_capability": getattr(dev, "compute_capability", None),
            "device_count": jax.device_count(),
            "bytes_limit": limit,
            "peak_tflops": peak,
            "peak_source": source if peak else None,
            "f32_tf32": False,
            "f32_precision": "highest",
            "smoke": args.smoke,
            "warmup": warmup,
            "steps": steps,
            "budget_s": None if math.isinf(budget) else budget,
            "argv": sys.argv[1:] if argv is None else list(argv),
            "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
        },
        "models": {},
    }
    print(
        f"{dev.device_kind} ({dev.platform}), jax {jax.__version__}, budget "
        + ("none" if math.isinf(budget) else f"{budget:.0f} s"),
        flush=True,
    )

    models: dict[str, _gpu_models.Model] = {}
    for key in args.models:
        models[key] = build_model(key, args)
        m = models[key]
        result["models"][key] = {
            "key": key,
            "description": m.description,
            "config": m.config,
            "params": m.n_params,
            "variants": {},
        }

    est: dict[str, float] = {}  # seconds the last variant of each model took, all in
    for wanted in PASSES:
        for key in args.models:
            for vkey in (v for v in wanted if v in variants):
                rec_model = result["models"][key]
                guess = est.get(key, 120.0 if not args.smoke else 5.0)
                if time.perf_counter() + guess > deadline:
                    rec_model["variants"][vkey] = {"status": "skipped: budget"}
                    print(f"{key} {vkey}: skipped (budget)", flush=True)
                    continue
                t0 = time.perf_counter()
                for attempt in range(3):
                    try:
                        rec = run_variant(
                            models[key],
                            VARIANTS[vkey],
                            warmup=warmup,
                            steps=steps,
                            deadline=deadline,
                            trace_only=args.trace_only,
                        )
                        break
                    except Unavailable as err:  # e.g. qwix not installed: not a failure
                        rec = {"status": f"skipped: {err}"}
                        break
                    except Exception as err:  # noqa: BLE001 - record, go on with the rest
                        rec = {"status": "error", "error": f"{type(err).__name__}: {err}"[:3000]}
                        batch = models[key].config["batch"]
                        # The float32 step needs the most memory: halve the model's batch
                        # (for every variant) and try again.
                        if vkey == "f32" and _is_oom(err) and batch > 1 and attempt < 2:
                            print(f"{key}: out of memory at batch {batch}; halving", flush=True)
                            gc.collect()
                            models[key] = build_model(key, args, batch=batch // 2)
                            rec_model["description"] = models[key].description
                            rec_model["config"] = models[key].config
                            continue
                        break
                gc.collect()
                est[key] = time.perf_counter() - t0
                rec["wall_s"] = est[key]
                rec_model["variants"][vkey] = rec
                rec_model["summary"] = summarise(rec_model, peak)
                result["meta"]["elapsed_s"] = time.perf_counter() - start
                write_json(result, args.out)
                if rec["status"] == "ok":
                    print(
                        f"{key} {vkey}: {rec['median_step_s'] * 1e3:.2f} ms/step, "
                        f"trace {rec['trace_s']:.1f} s, compile {rec['compile_s']:.1f} s, "
                        f"half FLOPs {rec['half_flops_share']:.0%}, "
                        f"loss {rec['first_loss']:.4f} -> {rec['final_loss']:.4f}",
                        flush=True,
                    )
                elif rec["status"] == "traced":
                    print(
                        f"{key} {vkey}: traced in {rec['trace_s']:.1f} s, lowered in "
                        f"{rec['lower_s']:.1f} s, {rec['matmul_flops'] / 1e12:.2f} matmul "
                        f"TFLOP/step, half FLOPs {rec['half_flops_share']:.0%}",
                        flush=True,
                    )
                elif rec["status"].startswith("skipped"):
                    print(f"{key} {vkey}: {rec['status']}", flush=True)
                else:
                    print(f"{key} {vkey}: {rec['error'][:500]}", flush=True)
    result["meta"]["elapsed_s"] = time.perf_counter() - start
    write_json(result, args.out)
    print_table(result)
    return result


if __name__ == "__main__":
    main()
