"""A benchmark script run in a subprocess, for the smoke tests of ``benchmarks/``."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def cpu_subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a test's subprocess: CPU only, the checkout importable, and no
    ``JAX_CHECK_TRACER_LEAKS`` (it disables JAX's caches; leaks are checked in-process)."""
    flags = " ".join(f for f in (os.environ.get("XLA_FLAGS"), extra.pop("XLA_FLAGS", None)) if f)
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "XLA_FLAGS": flags,  # the suite's compile settings (conftest.py) and the caller's
        **extra,
    }
    env.pop("JAX_CHECK_TRACER_LEAKS", None)
    return env


def run_script(name: str, out: pathlib.Path, *args: str) -> tuple[dict, str]:
    """``benchmarks/<name> --smoke --out <out> <args>`` on CPU: (its JSON, its stdout).

    Without ``JAX_CHECK_TRACER_LEAKS`` (it disables JAX's caches; the scripts use only the
    public API, whose tracing the library's own tests check). The timeout only guards
    against a hang: no test depends on how fast the machine is."""
    env = cpu_subprocess_env()
    script = ROOT / "benchmarks" / name
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text()), proc.stdout
