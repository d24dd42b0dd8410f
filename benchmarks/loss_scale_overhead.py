"""Overhead of dynamic loss scaling on the optimizer update of a ~10M-parameter model.

Not a test; run by hand::

    .venv/bin/python benchmarks/loss_scale_overhead.py [--rounds 7] [--steps 5] [--batch 256 1024]

Compares the jitted ``update + optax.apply_updates`` of

* ``adam`` and ``adam (A/A)``: plain ``optax.adam`` twice, compiled separately; their timing
  ratio is the noise floor of the measurement;
* ``loss_scale_optimizer``: ``jmp_rewrite.loss_scale_optimizer(adam)`` (``lax.cond``, the
  default) and ``use_select=True``;
* ``apply_if_finite``: ``optax.apply_if_finite(adam, 1000)``, a skip without scaling;
* ``jmp-style select``: unscale, ``all_finite``, adam, then ``jnp.where`` on params and state,
  plus a jmp ``DynamicLossScale.adjust``-style rule, written by hand.

For each it reports XLA's own cost model (``compiled.cost_analysis()``: bytes accessed and
flops, deterministic) and interleaved timings (medians over rounds of wall time and of this
process's user and system CPU time), with and without ``donate_argnums`` for params and
optimizer state; then the cost model with float16 gradients of float32 params (mixed
precision proper); finally the share of the loss-scaling overhead in a whole jitted train step
(forward, backward, update) of the same model at each ``--batch``. Prints markdown tables.

On a shared machine wall time is noisy (compare with the A/A row); user CPU time is steadier.
System time is mostly XLA:CPU page-faulting the fresh temporary buffers of each call (it has
no caching allocator); a global finiteness check keeps all gradients alive at once, which
makes those temporaries larger.
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import jmp_rewrite
from jmp_rewrite.demo.report import machine

# ~10M parameters: 1024 -> 1536 -> 1536 -> 1536 -> 1536 -> 256 MLP, with biases.
LAYER_SIZES = (1024, 1536, 1536, 1536, 1536, 256)


def init_params(key: jax.Array) -> dict[str, dict[str, jax.Array]]:
    params = {}
    for i, (n_in, n_out) in enumerate(zip(LAYER_SIZES[:-1], LAYER_SIZES[1:], strict=True)):
        key, sub = jax.random.split(key)
        params[f"layer{i}"] = {
            "w": jax.random.normal(sub, (n_in, n_out), jnp.float32) / n_in**0.5,
            "b": jnp.zeros((n_out,), jnp.float32),
        }
    return params


def mlp(params: Any, x: jax.Array) -> jax.Array:
    n = len(params)
    for i in range(n):
        x = x @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"]
        if i < n - 1:
            x = jax.nn.relu(x)
    return x


def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((mlp(params, x) - y) ** 2)


# ------------------------------------------------------------------------------------------
# The update + apply step of each variant: (params, opt_state, grads) -> (params, opt_state).


def optax_step(tx: optax.GradientTransformation) -> Callable[..., Any]:
    def step(params: Any, opt_state: Any, grads: Any) -> Any:
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def jmp_style(adam: optax.GradientTransformation) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """A hand-written jmp-README loop: unscale, check, update, select_tree, adjust."""
    period, factor = 2000, 2.0

    def init(params: Any) -> Any:
        return adam.init(params), (jnp.float32(2.0**15), jnp.int32(0))

    def step(params: Any, state: Any, grads: Any) -> Any:
        adam_state, (scale, counter) = state
        grads = jax.tree.map(lambda g: g * (1.0 / scale), grads)
        finite = jmp_rewrite.all_finite(grads)
        updates, new_adam_state = adam.update(grads, adam_state, params)
        new_params = optax.apply_updates(params, updates)
        params = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_params, params)
        adam_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_adam_state, adam_state)
        grown = jnp.where(counter == period - 1, scale * factor, scale)
        grown = jnp.where(jnp.isfinite(grown), grown, scale)
        scale = jnp.where(finite, grown, jnp.maximum(1.0, scale / factor))
        counter = ((counter + 1) % period) * finite
        return params, (adam_state, (scale, counter))

    return init, step


def variants() -> dict[str, tuple[Callable[..., Any], Callable[..., Any]]]:
    adam = optax.adam(1e-4)
    out: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {}
    out["adam"] = (adam.init, optax_step(adam))
    out["adam (A/A)"] = (adam.init, optax_step(optax.adam(1e-4)))
    tx = jmp_rewrite.loss_scale_optimizer(adam)
    out["loss_scale_optimizer (cond, default)"] = (tx.init, optax_step(tx))
    tx = jmp_rewrite.loss_scale_optimizer(adam, use_select=True)
    out["loss_scale_optimizer (use_select)"] = (tx.init, optax_step(tx))
    tx = optax.apply_if_finite(adam, 1000)
    out["optax.apply_if_finite"] = (tx.init, optax_step(tx))
    out["jmp-style select"] = jmp_style(adam)
    return out


def cost(compiled: Any) -> tuple[float, float]:
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list | tuple):  # older JAX: one dict per device
        analysis = analysis[0]
    return float(analysis["bytes accessed"]), float(analysis.get("flops", 0.0))


def compile_all(
    fns: dict[str, tuple[Callable[..., Any], Callable[..., Any]]],
    params: Any,
    grads: Any,
    donate: bool,
) -> dict[str, dict[str, Any]]:
    out = {}
    for name, (init, step) in fns.items():
        state = init(params)
        jitted = jax.jit(step, donate_argnums=(0, 1) if donate else ())
        compiled = jitted.lower(params, state, grads).compile()
        out[name] = {"compiled": compiled, "init": init, "cost": cost(compiled)}
    return out


def copy_tree(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


class Timing(NamedTuple):
    """Median seconds per step: wall clock, and this process's user and system CPU time."""

    wall: float
    user: float
    system: float


def time_interleaved(
    compiled: dict[str, dict[str, Any]], params: Any, extra: tuple, rounds: int, steps: int
) -> dict[str, Timing]:
    """Runs ``compiled[name](params, state, *extra)`` chained; variants take turns each round.

    The order is reversed every other round, so drift in machine load hits all variants alike.
    User and system CPU times are reported because on a shared machine they are steadier than
    wall time, and because XLA:CPU page-faults the fresh temporaries of every call (system
    time), which a caching allocator (as on GPU) would avoid.
    """
    carries = {n: (copy_tree(params), c["init"](params)) for n, c in compiled.items()}
    for name, c in compiled.items():  # warm up
        carries[name] = c["compiled"](*carries[name], *extra)
        jax.block_until_ready(carries[name])
    samples: dict[str, list[Timing]] = {n: [] for n in compiled}
    for r in range(rounds):
        order = list(compiled) if r % 2 == 0 else list(reversed(compiled))
        for name in order:
            fn = compiled[name]["compiled"]
            carry = carries[name]
            wall, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            for _ in range(steps):
                carry = fn(*carry, *extra)
            jax.block_until_ready(carry)
            wall = time.perf_counter() - wall
            after = resource.getrusage(resource.RUSAGE_SELF)
            samples[name].append(
                Timing(
                    wall / steps,
                    (after.ru_utime - cpu.ru_utime) / steps,
                    (after.ru_stime - cpu.ru_stime) / steps,
                )
            )
            carries[name] = carry
    return {
        n: Timing(*(statistics.median(getattr(t, f) for t in s) for f in Timing._fields))
        for n, s in samples.items()
    }


def train_steps() -> dict[str, tuple[Callable[..., Any], Callable[..., Any]]]:
    adam = optax.adam(1e-4)
    plain_tx = adam
    ls_tx = jmp_rewrite.loss_scale_optimizer(adam)
    sel_tx = jmp_rewrite.loss_scale_optimizer(adam, use_select=True)

    def plain_step(params: Any, state: Any, x: jax.Array, y: jax.Array) -> Any:
        grads = jax.grad(loss_fn)(params, x, y)
        updates, state = plain_tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def scaled_step(tx: Any) -> Callable[..., Any]:
        def step(params: Any, state: Any, x: jax.Array, y: jax.Array) -> Any:
            _, grads = jmp_rewrite.value_and_grad(loss_fn)(state, params, x, y)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        return step

    return {
        "train step, plain adam": (plain_tx.init, plain_step),
        "train step, plain adam (A/A)": (plain_tx.init, plain_step),
        "train step, loss_scale_optimizer (cond)": (ls_tx.init, scaled_step(ls_tx)),
        "train step, loss_scale_optimizer (select)": (sel_tx.init, scaled_step(sel_tx)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 1024])
    args = parser.parse_args()

    key = jax.random.PRNGKey(0)
    params = init_params(key)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3 * 2.0**15), params)

    print(f"# Loss-scaling overhead: {n_params / 1e6:.2f}M parameters (float32), adam\n")
    print(f"measured {machine()}")
    print(
        f"jax {jax.__version__}, optax {optax.__version__}, backend "
        f"{jax.default_backend()} ({jax.devices()[0].device_kind}), "
        f"{platform.processor() or platform.machine()}; rounds={args.rounds}, "
        f"steps/round={args.steps}\n"
    )
    fns = variants()
    for donate in (False, True):
        compiled = compile_all(fns, params, grads, donate)
        times = time_interleaved(compiled, params, (grads,), args.rounds, args.steps)
        base_bytes, base_flops = compiled["adam"]["cost"]
        base = times["adam"]
        print(f"## update + apply, donate_argnums={'(params, state)' if donate else 'none'}\n")
        print(
            "| variant | bytes accessed (MB) | x adam | GFLOP | x adam | wall ms/step | x adam "
            "| user CPU ms | x adam | system CPU ms |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, c in compiled.items():
            nbytes, flops = c["cost"]
            t = times[name]
            print(
                f"| {name} | {nbytes / 1e6:.1f} | {nbytes / base_bytes:.3f} | "
                f"{flops / 1e9:.3f} | {flops / base_flops:.2f} | {t.wall * 1e3:.1f} | "
                f"{t.wall / base.wall:.2f} | {t.user * 1e3:.1f} | {t.user / base.user:.2f} | "
                f"{t.system * 1e3:.1f} |"
            )
        print()

    # Mixed precision proper: float16 gradients of float32 params (cost model only).
    half_grads = jax.tree.map(lambda g: g.astype(jnp.float16), grads)
    print("## update + apply, float16 gradients, float32 params, donated (cost model)\n")
    print("| variant | bytes accessed (MB) | x adam |")
    print("|---|---:|---:|")
    base_bytes = None
    for name, fn in fns.items():
        try:
            (c,) = compile_all({name: fn}, params, half_grads, donate=True).values()
        except TypeError as e:  # optax.apply_if_finite: its cond branches disagree on dtypes
            print(f"| {name} | fails: {str(e).splitlines()[0]} | |")
            continue
        base_bytes = base_bytes or c["cost"][0]
        print(f"| {name} | {c['cost'][0] / 1e6:.1f} | {c['cost'][0] / base_bytes:.3f} |")
    print()

    for batch in args.batch:
        x = jax.random.normal(key, (batch, LAYER_SIZES[0]), jnp.float32)
        y = jax.random.normal(key, (batch, LAYER_SIZES[-1]), jnp.float32)
        steps = train_steps()
        compiled = {}
        for name, (init, step) in steps.items():
            state = init(params)
            jitted = jax.jit(step, donate_argnums=(0, 1))
            compiled[name] = {
                "compiled": jitted.lower(params, state, x, y).compile(),
                "init": init,
            }
            compiled[name]["cost"] = cost(compiled[name]["compiled"])

        times = time_interleaved(compiled, params, (x, y), args.rounds, args.steps)
        base = "train step, plain adam"
        b0, t0 = compiled[base]["cost"][0], times[base]
        print(f"## whole train step (forward + backward + update), batch {batch}, donated\n")
        print(
            "| variant | bytes accessed (MB) | overhead | wall ms/step | overhead "
            "| user CPU ms | overhead | system CPU ms |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name, c in compiled.items():
            nbytes, t = c["cost"][0], times[name]
            print(
                f"| {name} | {nbytes / 1e6:.1f} | {100 * (nbytes - b0) / b0:+.1f}% | "
                f"{t.wall * 1e3:.1f} | {100 * (t.wall - t0.wall) / t0.wall:+.1f}% | "
                f"{t.user * 1e3:.1f} | {100 * (t.user - t0.user) / t0.user:+.1f}% | "
                f"{t.system * 1e3:.1f} |"
            )
        print()


if __name__ == "__main__":
    main()
