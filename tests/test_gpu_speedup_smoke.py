"""``benchmarks/gpu_speedup.py --smoke``: the whole GPU benchmark at toy sizes on CPU.

The script is meant to be run once, unattended, on a borrowed GPU; this runs it end to end
(one subprocess, about 30-40 s of CPU: 18 small XLA compilations) and checks its JSON: every
model x variant ran, its numbers are sane, the rewritten steps really run their matmuls in
half precision, and their losses track float32's.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_speedup.py"
MODELS = ("gpt", "resnet50", "vit")
VARIANTS = (
    "f32",
    "rw-bf16",
    "rw-bf16-cuda-lists",
    "hand-bf16",
    "rw-f16-lso",
    "rw-f16-lso-select",
    "f32-tf32",
)
HALF = ("rw-bf16", "rw-bf16-cuda-lists", "hand-bf16", "rw-f16-lso", "rw-f16-lso-select")
FLOAT32 = ("f32", "f32-tf32")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("gpu_speedup") / "smoke.json"
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("JAX_CHECK_TRACER_LEAKS", None)  # it disables caches; not what is tested here
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--tf32", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text()), proc.stdout


def test_meta_records_versions_device_and_tf32(smoke):
    meta = smoke[0]["meta"]
    import jax

    assert meta["jax"] == jax.__version__
    assert meta["platform"] == "cpu" and meta["device_kind"]
    assert meta["smoke"] is True and meta["f32_tf32"] is False
    assert meta["peak_tflops"] is None  # no peak for a CPU: MFU is left empty, not invented


@pytest.mark.parametrize("model", MODELS)
def test_every_variant_ran_with_positive_times_and_finite_losses(smoke, model):
    result = smoke[0]
    rec = result["models"][model]
    assert set(rec["variants"]) == set(VARIANTS)
    n_steps = result["meta"]["warmup"] + result["meta"]["steps"]
    for key, r in rec["variants"].items():
        assert r["status"] == "ok", (key, r)
        assert r["median_step_s"] > 0 and all(t > 0 for t in r["step_times_s"]), key
        assert r["compile_s"] > 0 and r["trace_s"] > 0, key
        assert len(r["losses"]) == n_steps, key
        assert all(math.isfinite(x) for x in r["losses"]), key
        assert r["matmul_flops"] > 0 and r["xla_peak_bytes"] > 0, key
    assert rec["variants"]["f32"]["precision"] == "highest"
    assert rec["variants"]["f32-tf32"]["precision"] == "tensorfloat32"
    assert rec["variants"]["f32-tf32"]["tf32"] is False  # only a GPU has TF32


@pytest.mark.parametrize("model", MODELS)
def test_half_variants_run_every_model_matmul_in_half_precision(smoke, model):
    variants = smoke[0]["models"][model]["variants"]
    flops = variants["f32"]["matmul_flops"]
    for key in HALF:
        r = variants[key]
        assert r["matmuls"] > 0 and r["half_matmuls"] == r["matmuls"], key
        assert r["half_flops_share"] == 1.0, key
        assert r["matmul_flops"] == flops, key  # same model, same work
    for key in FLOAT32:
        assert variants[key]["half_matmuls"] == 0, key
    for key in ("f32", "rw-bf16", "hand-bf16"):
        assert variants[key]["region_matmuls"] == 0, key  # Adam has no matmuls


@pytest.mark.parametrize("model", MODELS)
def test_losses_train_and_track_float32(smoke, model):
    rec = smoke[0]["models"][model]
    for key, r in rec["variants"].items():
        assert r["final_loss"] < r["first_loss"], key  # one fixed batch: training fits it
    summary = rec["summary"]["variants"]
    for key in HALF:
        s = summary[key]
        assert s["first_loss_rel_diff_vs_f32"] < 1e-2, (key, s)
        assert s["max_loss_rel_diff_vs_f32"] < 5e-2, (key, s)
    for key in FLOAT32:  # TF32 is a no-op on CPU: bit-identical to float32
        assert summary[key]["max_loss_rel_diff_vs_f32"] == 0.0


@pytest.mark.parametrize("model", MODELS)
def test_loss_scale_counts_and_speed_ratios(smoke, model):
    rec = smoke[0]["models"][model]
    n_steps = smoke[0]["meta"]["warmup"] + smoke[0]["meta"]["steps"]
    for key in ("rw-f16-lso", "rw-f16-lso-select"):
        r = rec["variants"][key]
        assert r["applied_steps"] + r["skipped_steps"] == n_steps, key
        assert r["applied"].count(False) == r["skipped_steps"], key
        assert r["loss_scale"] == 2.0**15 / 2 ** r["skipped_steps"], key  # TF's halving
    # Same computation, same starting point: cond and select train alike (up to fusion).
    cond, select = rec["variants"]["rw-f16-lso"], rec["variants"]["rw-f16-lso-select"]
    assert cond["applied"] == select["applied"]
    assert select["losses"] == pytest.approx(cond["losses"], rel=1e-4)
    summary = rec["summary"]["variants"]
    f32, hand = rec["variants"]["f32"], rec["variants"]["hand-bf16"]
    for key, s in summary.items():
        t = rec["variants"][key]["median_step_s"]
        assert s["speedup_vs_f32"] == pytest.approx(f32["median_step_s"] / t)
        assert s["speed_vs_hand_bf16"] == pytest.approx(hand["median_step_s"] / t)
    assert summary["hand-bf16"]["memory_vs_hand_bf16"] == 1.0
    assert set(rec["summary"]["targets"]) >= {
        "rw-bf16 speed >= 0.97 x hand-bf16",
        "rw-bf16 memory <= 1.05 x hand-bf16",
    }


def test_table_is_printed(smoke):
    out = smoke[1]
    assert "| model | variant | median ms |" in out
    for model in MODELS:
        assert f"| {model} | rw-bf16 |" in out
