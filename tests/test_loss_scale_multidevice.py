"""Loss scaling on 8 virtual CPU devices (SPMD jit with sharded params; shard_map + axis_name).

Each scenario runs ``multidevice_loss_scale.py`` in a fresh interpreter, because the device
count must be set through ``XLA_FLAGS`` before JAX is first imported.
"""

from __future__ import annotations

import pytest
from multidevice import run_on_eight_devices


@pytest.mark.parametrize("scenario", ["jit_sharded", "shard_map_axis_name"])
def test_multidevice(scenario):
    assert f"OK {scenario}" in run_on_eight_devices("multidevice_loss_scale.py", scenario)
