"""``benchmarks/gpu_memory.py``: its HLO accounting, and one run at toy sizes on the host.

The script's real target is an XLA:GPU compile (``make gpu-memory``, its own environment
with the CUDA plugin); here it compiles for the CPU (``--platform cpu``), which exercises the
same step builders, memory analysis, HLO accounting and JSON (about 10 s: 2 compilations).
The TPU target (``--target v5p``) needs libtpu, which only ``.venv-tpu`` has: its smoke run is
skipped elsewhere, its message parsing and float8 counting are checked here everywhere.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
from benchmark_runs import run_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

HLO = """\
HloModule step

%fused_add (p0: f32[8], p1: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  %p1 = f32[8]{0} parameter(1)
  ROOT %add.1 = f32[8]{0} add(%p0, %p1)
}

%apply (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  ROOT %neg = f32[8]{0} negate(%a)
}

%skip (b: f32[8]) -> f32[8] {
  ROOT %b = f32[8]{0} parameter(0)
}

ENTRY %main (x: f32[8], y: bf16[4,2], c: pred[]) -> (f32[8], f32[8]) {
  %x = f32[8]{0} parameter(0)
  %y = bf16[4,2]{1,0} parameter(1)
  %c = pred[] parameter(2)
  %conv = f32[4,2]{1,0} convert(%y)
  %b = f32[8]{0} bitcast(%conv)
  %fusion = f32[8]{0} fusion(%x, %b), kind=kLoop, calls=%fused_add
  %cond = f32[8]{0} conditional(%c, %fusion, %fusion), true_computation=%apply, \
false_computation=%skip
  ROOT %t = (f32[8]{0}, f32[8]{0}) tuple(%fusion, %cond)
}
"""


def test_hlo_accounting():
    import gpu_memory

    assert gpu_memory.shape_bytes("(f32[8]{0}, bf16[4,2]{1,0}, pred[])") == 32 + 16 + 1
    stats = gpu_memory.hlo_stats(HLO)
    # convert: 16 + 32 bytes; fusion: 32 + 32 + 32; the costlier branch (negate): 32 + 32.
    assert stats["kernels"] == 3 and stats["fusions"] == 1 and stats["library_calls"] == 0
    assert stats["bytes_moved"] == 48 + 96 + 64
    assert stats["converts"] == 1


def test_float8_gemms_are_counted():
    import gpu_memory

    f8 = (
        "  %cublas-gemm.3 = (bf16[512,768]{1,0}, s8[33554432]{0}) custom-call("
        "f8e4m3fn[512,3072]{1,0} %a, f8e4m3fn[768,3072]{1,0} %b), "
        'custom_call_target="__cublas$lt$matmul$f8", backend_config={}\n'
    )
    triton = (
        "  %gemm_fusion_dot.7 = bf16[512,768]{1,0} fusion(f8e5m2[512,3072]{1,0} %g, "
        "bf16[3072,768]{1,0} %w), kind=kCustom, calls=%gemm_fusion_dot.7_computation, "
        'backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}\n'
    )
    bf16 = triton.replace("f8e5m2", "bf16").replace(".7", ".8")
    stats = gpu_memory.hlo_stats(HLO + f8 * 2 + triton + bf16)
    assert stats["float8_gemms"] == 2 and stats["float8_triton_fusions"] == 1
    assert gpu_memory.hlo_stats(HLO)["float8_gemms"] == 0


def test_fused_attention_calls_are_counted():
    import gpu_memory

    fmha = (
        "  %custom-call.1 = (bf16[2,16,2,32]{3,2,1,0}, f32[2,2,16]{2,1,0}, u8[0]{0}) custom-call("
        "bf16[2,16,2,32]{3,2,1,0} %q, bf16[2,16,2,32]{3,2,1,0} %k, bf16[2,16,2,32]{3,2,1,0} %v), "
        'custom_call_target="__cudnn$fmhaSoftmax", backend_config={}\n'
    )
    bwd = fmha.replace("fmhaSoftmax", "fmhaScaleBiasSoftmaxBackward").replace(".1 ", ".2 ")
    assert gpu_memory.hlo_stats(HLO + fmha + bwd)["fused_attention_calls"] == 2
    assert gpu_memory.hlo_stats(HLO)["fused_attention_calls"] == 0
    mosaic = (
        "  %custom-call.7 = bf16[2,2,128,32]{3,2,1,0} custom-call(bf16[2,2,128,32]{3,2,1,0} "
        '%q), custom_call_target="tpu_custom_call", backend_config={}\n'
    )
    assert gpu_memory.hlo_stats(HLO + mosaic * 3)["tpu_kernel_calls"] == 3
    assert gpu_memory.hlo_stats(HLO + fmha)["tpu_kernel_calls"] == 0
    variants = {
        "rw-bf16": {"peak_bytes": 100, "bytes_moved": 200},
        "rw-bf16-fused": {"peak_bytes": 50, "bytes_moved": 120},
    }
    assert gpu_memory.fused_ratios(variants) == {
        "rw-bf16-fused/rw-bf16": {"peak": 0.5, "moved": 0.6}
    }


def test_baseline_fills_in_variants_not_compiled_now():
    import gpu_memory

    config = {"batch": 2}
    now = {"models": {"gpt": {"config": config, "variants": {"rw-bf16": {"peak_bytes": 90}}}}}
    before = {
        "models": {
            "gpt": {
                "config": config,
                "variants": {"rw-bf16": {"peak_bytes": 120}, "hand-bf16": {"peak_bytes": 100}},
                "ratios": {"rw-bf16/hand-bf16": 1.2},
            }
        }
    }
    gpu_memory.take_baseline(now, before)
    gpt = now["models"]["gpt"]
    assert gpt["variants"]["hand-bf16"] == {"peak_bytes": 100, "from_baseline": True}
    assert gpt["ratios"] == {"rw-bf16/hand-bf16": 0.9}
    assert gpt["before"]["ratios"] == {"rw-bf16/hand-bf16": 1.2}
    assert gpt["before"]["peak_bytes"]["rw-bf16"] == 120
    variants = {"rw-f16": {"kernels": 10}, "rw-f16-lso": {"kernels": 17}}
    assert gpu_memory.loss_scaling_kernels(variants) == {"rw-f16-lso - rw-f16": 7}
    other = {"models": {"gpt": {"config": {"batch": 4}, "variants": {}, "ratios": {}}}}
    gpu_memory.take_baseline(other, before)  # other sizes: nothing taken
    assert "before" not in other["models"]["gpt"]


def test_smoke_run_on_the_host(tmp_path):
    out = tmp_path / "gpu_memory.json"
    result, stdout = run_script(
        "gpu_memory.py",
        out,
        "--platform",
        "cpu",
        "--models",
        "gpt",
        "--variants",
        "rw-bf16",
        "hand-bf16",
        "rw-bf16-fused",
    )
    assert result["meta"]["platform"] == "cpu" and result["meta"]["smoke"] is True
    gpt = result["models"]["gpt"]
    assert set(gpt["variants"]) == {"rw-bf16", "hand-bf16", "rw-bf16-fused"}
    for rec in gpt["variants"].values():
        assert rec["peak_bytes"] > 0 and rec["temp_bytes"] >= 0, rec
        assert rec["kernels"] > 0 and rec["bytes_moved"] > 0 and rec["converts"] > 0, rec
    assert set(gpt["ratios"]) == {"rw-bf16/hand-bf16", "rw-bf16-fused/hand-bf16"}
    fused = gpt["fused_ratios"]["rw-bf16-fused/rw-bf16"]  # the host's figures: no cuDNN here
    assert fused["peak"] > 0 and fused["moved"] > 0
    assert gpt["variants"]["rw-bf16-fused"]["fused_attention_calls"] == 0
    assert "| gpt | rw-bf16 |" in stdout


def test_tpu_hbm_refusal_is_read():
    import gpu_memory

    message = (
        "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total "
        "memory required for HLO temporaries (47.68G) exceeds available HBM (15.75G). HLO "
        "module: jit_f."
    )
    oom = gpu_memory.hbm_oom(message)
    assert oom == {
        "needs_bytes": int(47.68 * 2**30),
        "hbm_bytes": int(15.75 * 2**30),
        "needs": "temporaries",
    }
    assert gpu_memory.does_not_fit({"hbm_oom": oom}) == (
        "does not fit (needs 47.68 GiB of temporaries; HBM 15.75 GiB)"
    )
    older = "Ran out of memory in memory space hbm. Used 20.50G of 15.75G hbm. Exceeded by 4.75G"
    assert gpu_memory.hbm_oom(older)["needs"] == "all buffers"
    assert gpu_memory.hbm_oom("INVALID_ARGUMENT: something else") is None


def test_tpu_float8_dots_and_upcasts_are_counted():
    import gpu_memory

    kept = (
        "  %convolution.3 = bf16[512,768]{1,0:T(8,128)(2,1)} convolution(bf16[512,3072]"
        "{1,0:T(8,128)(2,1)} %a, f8e4m3fn[3072,768]{1,0:T(8,128)(4,1)} %w), dim_labels=bf_io->bf\n"
    )
    dot = "  %dot.1 = f32[8,8]{1,0} dot(f8e5m2[8,16]{1,0} %g, f8e4m3fn[16,8]{1,0} %x)\n"
    upcast = "  %convert.9 = bf16[3072,768]{1,0:T(8,128)(2,1)} convert(f8e4m3fn[3072,768] %q)\n"
    down = "  %convert.8 = f8e4m3fn[3072,768]{1,0} convert(bf16[3072,768]{1,0} %w)\n"
    gpu = "%fused_gemms (a: bf16[512,3072]) -> bf16[512,768] {\n" + kept + dot + upcast + down
    stats = gpu_memory.hlo_stats(HLO + gpu + "}\n")
    assert stats["float8_dots"] == 2 and stats["float8_upcasts"] == 1
    # XLA:TPU's text names operands without their types: they are looked up by name.
    tpu = """\
%fused_dot (param_0: f8e4m3fn[16,8], param_1: bf16[8,16]) -> bf16[8,8] {
  %param_0 = f8e4m3fn[16,8]{1,0:T(8,128)(4,1)} parameter(0)
  %param_1 = bf16[8,16]{1,0:T(8,128)(2,1)} parameter(1)
  %convert.2 = bf16[16,8]{1,0:T(8,128)(2,1)} convert(%param_0)
  ROOT %convolution.4 = bf16[8,8]{1,0} convolution(%param_1, %convert.2), dim_labels=bf_io->bf
}

%fused_f8 (param_0: f8e4m3fn[16,8], param_1: f8e4m3fn[8,16]) -> bf16[8,8] {
  %param_0 = f8e4m3fn[16,8]{1,0:T(8,128)(4,1)} parameter(0)
  %param_1 = f8e4m3fn[8,16]{1,0:T(8,128)(4,1)} parameter(1)
  ROOT %convolution.5 = bf16[8,8]{1,0} convolution(%param_1, %param_0), dim_labels=bf_io->bf
}
"""
    stats = gpu_memory.hlo_stats(tpu + HLO)
    assert stats["float8_dots"] == 1 and stats["float8_upcasts"] == 1
    assert gpu_memory.shape_bytes("f8e4m3fn[16,8]{1,0}") == 128
    stats = gpu_memory.hlo_stats(HLO)
    assert stats["float8_dots"] == 0 and stats["float8_upcasts"] == 0


def test_tpu_estimate_ratios():
    import gpu_memory

    variants = {
        "rw-bf16": {"optimal_seconds": 0.09},
        "hand-bf16": {"optimal_seconds": 0.1},
        "rw-fp8": {"peak_bytes": 1},
    }
    assert gpu_memory.estimate_ratios(variants) == {"rw-bf16/hand-bf16": 0.09 / 0.1}


def _has_libtpu() -> bool:
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


@pytest.mark.skipif(
    not _has_libtpu(),
    reason="libtpu is not installed in this environment (make tpu-memory installs it in "
    ".venv-tpu; a TPU compile needs it, there is no host stand-in for XLA:TPU)",
)
def test_tpu_smoke_run(tmp_path):
    # A second process may load libtpu beside this one (pytest-xdist's other worker).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    out = tmp_path / "tpu_memory.json"
    result, stdout = run_script(
        "gpu_memory.py", out, "--target", "v5p", "--models", "gpt", "--variants", "rw-bf16",
        "hand-bf16",
    )  # fmt: skip
    assert result["meta"]["platform"] == "tpu" and result["meta"]["topology"] == "v5p:1x1x1"
    gpt = result["models"]["gpt"]
    for rec in gpt["variants"].values():
        assert rec["peak_bytes"] > 0 and rec["optimal_seconds"] > 0, rec
        assert rec["bytes_accessed"] > 0 and rec["converts"] > 0, rec
    assert set(gpt["ratios"]) == set(gpt["estimate_ratios"]) == {"rw-bf16/hand-bf16"}
    assert "| gpt | rw-bf16 |" in stdout and "XLA's estimate" in stdout


@pytest.mark.skipif(
    not _has_libtpu(),
    reason="libtpu is not installed in this environment (a TPU compile needs it)",
)
def test_tpu_fused_attention_smoke_run(tmp_path):
    """``rw-bf16-fused`` compiled for a v5p at toy sizes (T16). There the TPU kernel would
    keep more than the written-out attention (its tiles are 128 wide), so the TPU runs the
    attention as written: no Mosaic call, and the script reports the temporaries' ratio.
    (``tests/test_tpu_attention.py`` compiles the kernel at T1024; the full-size figures are
    in docs/benchmarks.md.)"""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    out = tmp_path / "tpu_memory.json"
    result, stdout = run_script(
        "gpu_memory.py", out, "--target", "v5p", "--models", "gpt", "--variants", "rw-bf16",
        "rw-bf16-fused",
    )  # fmt: skip
    gpt = result["models"]["gpt"]
    assert [r["tpu_kernel_calls"] for r in gpt["variants"].values()] == [0, 0], gpt["variants"]
    assert set(gpt["fused_ratios"]["rw-bf16-fused/rw-bf16"]) == {"peak", "moved", "temp"}
    assert "gpt rw-bf16-fused/rw-bf16: peak" in stdout and "temporaries" in stdout


def test_tpu_negative_estimate_is_no_estimate():
    import types

    import gpu_memory

    class Compiled:
        def __init__(self, seconds):
            self.seconds = seconds

        def memory_analysis(self):
            sizes = dict(argument=8, output=8, alias=0, temp=16)
            return types.SimpleNamespace(**{f"{k}_size_in_bytes": v for k, v in sizes.items()})

        def as_text(self):
            return HLO

        def cost_analysis(self):
            return [{"flops": 1.0, "bytes accessed": 64.0, "optimal_seconds": self.seconds}]

    assert gpu_memory.measure(Compiled(2e-3))["optimal_seconds"] == 2e-3
    rec = gpu_memory.measure(Compiled(-59.86))  # libtpu 0.0.50.1's answer on a v6e
    assert rec["optimal_seconds"] is None and rec["optimal_seconds_reported"] == -59.86
    assert rec["bytes_accessed"] == 64.0 and rec["peak_bytes"] == 32
