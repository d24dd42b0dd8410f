"""A ``tests/multidevice_*.py`` script run on 8 virtual CPU devices, in a fresh interpreter:
the device count must be set through ``XLA_FLAGS`` before JAX is first imported."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from benchmark_runs import cpu_subprocess_env

HERE = pathlib.Path(__file__).resolve().parent


def run_on_eight_devices(script: str, *args: str) -> str:
    """Runs ``tests/<script> <args>``; its stdout (a failure shows its stderr's end). The
    environment is :func:`benchmark_runs.cpu_subprocess_env`'s; the timeout only guards
    against a hang: no test depends on how fast the machine is."""
    env = cpu_subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run(
        [sys.executable, str(HERE / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr[-4000:]}"
    return out.stdout
