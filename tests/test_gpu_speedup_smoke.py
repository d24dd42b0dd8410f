"""``benchmarks/gpu_speedup.py --smoke``: the whole GPU benchmark at toy sizes on CPU.

The script is meant to be run once, unattended, on a borrowed GPU; this runs it end to end
(one subprocess, about 1.5 minutes of CPU: 21 small XLA compilations) and checks its JSON: every
model x variant ran, its numbers are sane, the rewritten steps really run their matmuls in
half precision, and their losses track float32's. ``--smoke`` has no time budget, so nothing
here depends on how fast or how loaded the machine is. The summary's ratios and targets are
checked on records made up here (:func:`gpu_speedup.summarise`), not recomputed from the
JSON.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys

import pytest
from benchmark_runs import run_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_speedup  # noqa: E402

MODELS = ("gpt", "resnet50", "vit")
VARIANTS = (
    "f32",
    "rw-bf16",
    "rw-bf16-cuda-lists",
    "hand-bf16",
    "rw-f16-lso",
    "rw-f16-lso-select",
    "f32-tf32",
    "rw-bf16-fused",
    "rw-fp8-fused",
)
HALF = ("rw-bf16", "rw-bf16-cuda-lists", "hand-bf16", "rw-f16-lso", "rw-f16-lso-select")
#: Attentions per model at the smoke sizes (one layer each).
ATTENTIONS = {"gpt": 1, "resnet50": 0, "vit": 1}
FLOAT32 = ("f32", "f32-tf32")
# A script over the public API: `make test` runs it, `make test-newest` need not.
pytestmark = pytest.mark.once


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("gpu_speedup") / "smoke.json"
    # the default variants (--tf32 adds f32-tf32), and float8 with fused attention
    return run_script("gpu_speedup.py", out, "--tf32", "--variants", *VARIANTS)


def test_meta_records_versions_device_and_tf32(smoke):
    meta = smoke[0]["meta"]
    import jax

    assert meta["jax"] == jax.__version__
    assert meta["platform"] == "cpu" and meta["device_kind"]
    assert meta["smoke"] is True and meta["f32_tf32"] is False
    assert meta["budget_s"] is None  # --smoke: no time budget, every variant runs
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
    # Fused attention on a CPU is JAX's own attention: its float32 logits' gradient reaches
    # the queries' and keys' gradient matmuls (two per attention) in float32; the rest is half.
    fused = variants["rw-bf16-fused"]
    assert fused["matmul_flops"] == flops
    assert fused["matmuls"] - fused["half_matmuls"] == 2 * ATTENTIONS[model]


@pytest.mark.parametrize("model", MODELS)
def test_losses_train_and_track_float32(smoke, model):
    rec = smoke[0]["models"][model]
    for key, r in rec["variants"].items():
        assert r["final_loss"] < r["first_loss"], key  # one fixed batch: training fits it
    summary = rec["summary"]["variants"]
    for key in (*HALF, "rw-bf16-fused"):
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
    # Every ratio was measured (none left empty) and every target evaluated.
    for key, s in rec["summary"]["variants"].items():
        for ratio in ("speedup_vs_f32", "speed_vs_hand_bf16", "memory_vs_hand_bf16"):
            assert s[ratio] is not None and 0 < s[ratio] < math.inf, (key, ratio, s)
    targets = rec["summary"]["targets"]
    assert all(isinstance(v, bool) for v in targets.values()), targets


def test_float32_variants_on_cpu_compile_the_same_program(smoke):
    """TF32 does not exist on a CPU: both float32 variants need the same XLA buffers, and the
    half-precision ones a different amount (their activations are half precision)."""
    for model in MODELS:
        v = smoke[0]["models"][model]["variants"]
        assert v["f32-tf32"]["xla_peak_bytes"] == v["f32"]["xla_peak_bytes"], model
        assert v["rw-bf16"]["xla_peak_bytes"] != v["f32"]["xla_peak_bytes"], model


def _record(median_s: float, peak_bytes: int, status: str = "ok") -> dict:
    losses = [2.0, 1.5, 1.0]
    return {
        "status": status,
        "median_step_s": median_s,
        "matmul_flops": 2e12,
        "xla_peak_bytes": peak_bytes,
        "losses": losses,
        "first_loss": losses[0],
        "final_loss": losses[-1],
    }


def test_summary_ratios_and_targets_on_made_up_records():
    """hand-bf16 takes 1 s and 100 bytes; the rewrite at 0.98x its speed and 105 bytes meets
    both targets, 0.67x or 106 bytes misses them, and float32 is 2x slower."""
    model = {
        "key": "gpt",
        "variants": {
            "f32": _record(2.0, 200),
            "hand-bf16": _record(1.0, 100),
            "rw-bf16": _record(1.0 / 0.98, 105),
            "rw-f16-lso": _record(1.5, 106),
            "rw-f16-lso-select": _record(0.1, 1, status="error"),
        },
    }
    out = gpu_speedup.summarise(model, peak_tflops=4.0)
    v, targets = out["variants"], out["targets"]
    assert set(v) == {"f32", "hand-bf16", "rw-bf16", "rw-f16-lso"}  # the error is left out
    assert v["f32"]["speedup_vs_f32"] == 1.0 and v["hand-bf16"]["speedup_vs_f32"] == 2.0
    assert v["hand-bf16"]["tflops"] == 2.0 and v["hand-bf16"]["mfu"] == 0.5
    assert targets["rw-bf16 speed >= 0.97 x hand-bf16"] is True
    assert targets["rw-bf16 memory <= 1.05 x hand-bf16"] is True
    assert targets["rw-f16-lso speed >= 0.97 x hand-bf16"] is False
    assert targets["rw-f16-lso memory <= 1.05 x hand-bf16"] is False
    assert targets["rw-bf16 >= 1.8 x f32 (no TF32)"] is True  # 2 / (1 / 0.98) = 1.96
    assert "rw-f16-lso-select speed >= 0.97 x hand-bf16" not in targets
    assert not any("fused" in k for k in targets)  # no fused variant ran


def test_fused_attention_targets_on_made_up_records():
    """Issue 31: fused attention over the unfused rewrite, alone and with float8: 1.25x at
    T1024, 1.4x from T4096."""
    runs = {"rw-bf16": _record(1.3, 100), "rw-bf16-fused": _record(1.0, 60)}
    runs |= {"rw-fp8": _record(1.2, 100), "rw-fp8-fused": _record(1.0, 60)}
    short = gpu_speedup.summarise({"key": "gpt", "config": {"seq": 1024}, "variants": runs}, None)
    assert short["variants"]["rw-bf16-fused"]["speedup_vs_unfused"] == pytest.approx(1.3)
    assert short["targets"]["rw-bf16-fused >= 1.25 x rw-bf16"] is True
    assert short["targets"]["rw-fp8-fused >= 1.25 x rw-fp8"] is False  # 1.2x
    long = gpu_speedup.summarise({"key": "gpt", "config": {"seq": 4096}, "variants": runs}, None)
    assert long["targets"]["rw-bf16-fused >= 1.4 x rw-bf16"] is False


def test_summary_without_baselines_leaves_ratios_empty():
    """No hand-written or float32 run (e.g. skipped): ratios and targets are None, not 0."""
    out = gpu_speedup.summarise({"key": "vit", "variants": {"rw-bf16": _record(1.0, 10)}}, None)
    s = out["variants"]["rw-bf16"]
    assert s["speedup_vs_f32"] is None and s["speed_vs_hand_bf16"] is None
    assert s["memory_vs_hand_bf16"] is None and s["mfu"] is None
    assert out["targets"] == {
        "rw-bf16 speed >= 0.97 x hand-bf16": None,
        "rw-bf16 memory <= 1.05 x hand-bf16": None,
    }


def test_full_size_run_on_a_cpu_is_refused_with_the_reason(capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_speedup.main(["--models", "gpt", "--variants", "f32"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "not a GPU" in err and "--smoke" in err and "--allow-cpu" in err


def test_table_is_printed(smoke):
    out = smoke[1]
    assert "| model | variant | median ms |" in out
    for model in MODELS:
        assert f"| {model} | rw-bf16 |" in out


def test_qwix_baseline_runs_or_is_skipped_with_the_reason(tmp_path, monkeypatch, capsys):
    """``hw-fp8-qwix`` (only when named): qwix is no dependency of the project, so where it
    is missing the variant is recorded and printed as skipped, not as an error; where it is
    installed, the GPT's 3 weight GEMMs after the first (one layer at smoke sizes) run in
    float8 forward and backward. It exists for the GPT only."""
    import importlib.util

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() appends to it
    out = tmp_path / "qwix.json"
    argv = ["--smoke", "--models", "gpt", "resnet50", "--variants", "hw-fp8-qwix"]
    result = gpu_speedup.main([*argv, "--out", str(out)])
    assert json.loads(out.read_text())["models"]["gpt"]["variants"].keys() == {"hw-fp8-qwix"}
    gpt = result["models"]["gpt"]["variants"]["hw-fp8-qwix"]
    resnet = result["models"]["resnet50"]["variants"]["hw-fp8-qwix"]
    assert resnet["status"] == "skipped: hw-fp8-qwix is written for the GPT only, not resnet50"
    printed = capsys.readouterr().out
    if importlib.util.find_spec("qwix") is None:
        assert gpt["status"] == "skipped: qwix not installed"
        assert "gpt hw-fp8-qwix: skipped: qwix not installed" in printed
        assert "| gpt | hw-fp8-qwix | skipped: qwix not installed |" in printed
    else:
        assert gpt["status"] == "ok", gpt
        assert gpt["float8_matmuls"] == 9 and gpt["half_matmuls"] == gpt["matmuls"]
        assert all(math.isfinite(x) for x in gpt["losses"])
