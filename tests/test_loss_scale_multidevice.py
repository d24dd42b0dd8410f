"""Loss scaling on 8 virtual CPU devices (SPMD jit with sharded params; shard_map + axis_name).

Each scenario runs ``multidevice_loss_scale.py`` in a fresh interpreter, because the device
count must be set through ``XLA_FLAGS`` before JAX is first imported.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
SCRIPT = HERE / "multidevice_loss_scale.py"


@pytest.mark.parametrize("scenario", ["jit_sharded", "shard_map_axis_name"])
def test_multidevice(scenario):
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("JAX_CHECK_TRACER_LEAKS", None)  # it disables caches; leaks are checked elsewhere
    out = subprocess.run(
        [sys.executable, str(SCRIPT), scenario],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,  # a hang guard only: no test depends on how fast the machine is
        check=False,
    )
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr[-4000:]}"
    assert f"OK {scenario}" in out.stdout
