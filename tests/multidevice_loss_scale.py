"""Run by test_loss_scale_multidevice.py in a subprocess with 8 CPU devices.

``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before JAX is imported,
which the parent pytest process has already done; hence a separate process. Usage::

    python tests/multidevice_loss_scale.py {jit_sharded,shard_map_axis_name}

Prints ``OK <scenario>`` on success; any failed check raises (non-zero exit status).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_rewrite as jr

assert jax.device_count() == 8, jax.devices()
MESH = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def replicated_scalars_agree(tree) -> None:
    """Every addressable shard of every scalar leaf holds the same value."""
    for leaf in jax.tree.leaves(tree):
        if leaf.ndim == 0:
            values = {np.asarray(s.data).item() for s in leaf.addressable_shards}
            assert len(values) == 1, values


def jit_sharded() -> None:
    """SPMD jit: the finiteness check over sharded gradients is global, with no axis_name."""
    w_sharding = NamedSharding(MESH, P("data", None))
    b_sharding = NamedSharding(MESH, P())
    shardings = {"w": w_sharding, "b": b_sharding}
    host_params = {
        "w": np.arange(64 * 4, dtype=np.float32).reshape(64, 4) / 256,
        "b": np.zeros(4, np.float32),
    }
    for use_select in (False, True):
        params = jax.device_put(host_params, shardings)
        tx = jr.loss_scale_optimizer(
            optax.adam(0.1),
            jr.DynamicLossScale(initial_loss_scale=8.0, increment_period=2),
            use_select=use_select,
        )

        @jax.jit
        def step(params, state, grads, tx=tx):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        state = jax.jit(tx.init)(params)
        true = {"w": np.full((64, 4), 0.5, np.float32), "b": np.full(4, -0.25, np.float32)}

        def scaled(true, scale, poison=None):
            grads = {k: v * scale for k, v in true.items()}
            if poison is not None:
                leaf, index, value = poison
                grads[leaf] = grads[leaf].copy()
                grads[leaf][index] = value
            return jax.device_put(grads, shardings)

        # Step 1, finite: matches the same update computed on one device.
        new_params, state = step(params, state, scaled(true, 8.0))
        ref_tx = optax.adam(0.1)
        ref_updates, _ = ref_tx.update(true, ref_tx.init(host_params))
        ref_params = optax.apply_updates(host_params, ref_updates)
        for k in host_params:
            np.testing.assert_allclose(
                np.asarray(new_params[k]), ref_params[k], rtol=1e-6, atol=1e-7
            )
        assert new_params["w"].sharding.is_equivalent_to(w_sharding, 2), new_params["w"].sharding
        assert bool(state.last_step_applied) and float(state.loss_scale) == 8.0
        params = new_params

        # Step 2, an Inf in the rows held by the last device only: every device skips.
        assert w_sharding.shard_shape((64, 4)) == (8, 4)
        grads = scaled(true, 8.0, ("w", (60, 2), np.inf))
        owners = [s.device for s in grads["w"].addressable_shards if s.index[0].start == 56]
        assert len(owners) == 1
        new_params, state = step(params, state, grads)
        for k in host_params:
            np.testing.assert_array_equal(np.asarray(new_params[k]), np.asarray(params[k]))
        assert not bool(state.last_step_applied) and float(state.loss_scale) == 4.0
        assert int(state.inner_state[0].count) == 1
        replicated_scalars_agree(state)

        # Step 3, a NaN in the replicated bias: skipped as well.
        new_params, state = step(params, state, scaled(true, 4.0, ("b", 1, np.nan)))
        np.testing.assert_array_equal(np.asarray(new_params["w"]), np.asarray(params["w"]))
        assert float(state.loss_scale) == 2.0 and int(state.skipped_steps) == 2
        replicated_scalars_agree(state)

        if not use_select:
            hlo = step.lower(params, state, scaled(true, 2.0)).compile().as_text()
            assert "all-reduce" in hlo  # the global reduction of the check
    print("OK jit_sharded")


def shard_map_axis_name() -> None:
    """shard_map: local gradients differ per device; axis_name makes all devices agree."""
    specs = {"w": P("data"), "b": P()}
    params = {"w": jnp.ones((8, 3)), "b": jnp.zeros(3)}
    params = jax.device_put(params, {k: NamedSharding(MESH, s) for k, s in specs.items()})
    true = {"w": np.full((8, 3), 0.5, np.float32), "b": np.full(3, 0.25, np.float32)}

    def state_specs(tx):
        local = {"w": jax.ShapeDtypeStruct((1, 3), jnp.float32), "b": params["b"]}
        shape = jax.eval_shape(tx.init, local)
        return jax.tree_util.tree_map_with_path(
            lambda path, _: P("data") if "'w'" in jax.tree_util.keystr(path) else P(), shape
        )

    def run(tx, grads, state=None, check_vma=True):
        sspecs = state_specs(tx)
        if state is None:
            state = jax.jit(jax.shard_map(tx.init, mesh=MESH, in_specs=(specs,), out_specs=sspecs))(
                params
            )

        def local_step(params, state, grads):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, state.last_step_applied[None]

        step = jax.shard_map(
            local_step,
            mesh=MESH,
            in_specs=(specs, sspecs, specs),
            out_specs=(specs, sspecs, P("data")),
            check_vma=check_vma,
        )
        return jax.jit(step)(params, state, grads), state

    def poisoned(device: int, value: float):
        w = true["w"] * 4.0
        w = w.copy()
        w[device, 1] = value
        return jax.device_put(
            {"w": w, "b": true["b"] * 4.0}, {k: NamedSharding(MESH, s) for k, s in specs.items()}
        )

    rule = jr.DynamicLossScale(initial_loss_scale=4.0, increment_period=10)

    # Without axis_name the devices disagree: device 3 skips, the others apply.
    tx = jr.loss_scale_optimizer(optax.sgd(1.0), rule)
    (_, _, applied), _ = run(tx, poisoned(3, np.inf), check_vma=False)
    np.testing.assert_array_equal(np.asarray(applied), [i != 3 for i in range(8)])

    for use_select, debug in ((False, False), (False, True), (True, False)):
        tx = jr.loss_scale_optimizer(
            optax.sgd(1.0, momentum=0.5),
            rule,
            axis_name="data",
            use_select=use_select,
            debug=debug,
        )
        (new_params, state, applied), state0 = run(tx, poisoned(3, np.inf))
        np.testing.assert_array_equal(np.asarray(applied), [False] * 8)
        for k in params:
            np.testing.assert_array_equal(np.asarray(new_params[k]), np.asarray(params[k]))
        assert float(state.loss_scale) == 2.0 and int(state.skipped_steps) == 1
        replicated_scalars_agree((state.loss_scale, state.good_steps, state.skipped_steps))
        if debug:
            np.testing.assert_array_equal(np.asarray(state.debug.leaf_has_inf), [False, True])
            np.testing.assert_array_equal(np.asarray(state.debug.leaf_has_nan), [False, False])
        # A finite step: every device applies the same update.
        grads = jax.device_put(
            {"w": true["w"] * 2.0, "b": true["b"] * 2.0},
            {k: NamedSharding(MESH, s) for k, s in specs.items()},
        )
        (new_params, state, applied), _ = run(tx, grads, state=state)
        np.testing.assert_array_equal(np.asarray(applied), [True] * 8)
        np.testing.assert_allclose(np.asarray(new_params["w"]), 1.0 - true["w"])
        np.testing.assert_allclose(np.asarray(new_params["b"]), -true["b"])
        assert int(state.applied_steps) == 1 and int(state0.applied_steps) == 0
    print("OK shard_map_axis_name")


SCENARIOS = {"jit_sharded": jit_sharded, "shard_map_axis_name": shard_map_axis_name}

if __name__ == "__main__":
    for name in sys.argv[1:] or list(SCENARIOS):
        SCENARIOS[name]()
