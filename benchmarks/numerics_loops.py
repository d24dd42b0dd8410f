"""Issue 14's figures: loop state, RoPE and the log-softmax gradient, rewrite vs by hand.

Run by hand (not a test; about a minute on 2 CPU cores)::

    .venv/bin/python benchmarks/numerics_loops.py [--json out.json]

Every figure is a relative error against the float32 program, in float16 and bfloat16:

* ``rewrite``: the float32 program through ``jmp_rewrite.rewrite(dtype=...)``;
* ``hand``: the same program written in half precision by a careful user (matmuls and
  activations in half, state, losses and updates in float32; Flax's way for BatchNorm);
* ``noise``: the float32 noise floor, the float32 program with each batch's rows permuted
  (where the result is a mean over rows; 0 where rows are independent).

The programs are those of ``tests/test_state_in_loops.py`` (the regression tests judge the
same figures): 100 SGD steps in a ``fori_loop`` (weight change), the README's train step in a
``lax.scan`` of 50 steps, an RK4 neural ODE (1000 steps of 1e-3; change of the state), a
diffrax-like adaptive solver, an EMA under ``lax.cond`` and a ``where``-guarded step in loops,
BatchNorm statistics through a ``scan`` of microbatches, q after RoPE, the log-softmax
gradient; diffrax's Tsit5 itself when diffrax is installed; and from
``tests/test_loop_cotangents.py`` an Elman RNN's weight gradients under
``jax.grad(rewrite(loss))`` (summed over 512 trips: 2.8e-2 bfloat16, 4.7e-3 float16 off
float32 when the weights were cast before the loop, against hand-written 6.9e-3, 3.2e-3).

Before issue 14 (the engine of commit 26e252f, the same programs; hand-written and noise
unchanged): fori_loop training 34.6% (f16) / 91% (bf16) off float32, the README recipe in a
scan 1.18% / 9.55%, RK4 25.4% / 92.8%, the adaptive solver 0.05% / 6.2%, the EMA under cond
34.8% / 90.7%, the where-guarded steps 34.6% / 91%, q after RoPE 17.9% / 57.9%, diffrax's
Tsit5 0.26% / 12.9%; the BatchNorm statistics and the log-softmax gradient within 1% of today.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_loop_cotangents as lc  # noqa: E402
import test_state_in_loops as t  # noqa: E402

import jmp_rewrite  # noqa: E402

DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}


def _permuted(x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    order = np.random.default_rng(9).permutation(x.shape[0])
    return x[order], y[order]


def _training(train: Callable[..., Any]) -> Callable[[Any], dict[str, float]]:
    p, x, y = t._mlp_params(0), t.f32(2, 64, 16), t.f32(3, 64, 4)
    ref = t._change(jax.jit(train)(p, x, y), p)
    noise = t.rel(t._change(jax.jit(train)(p, *_permuted(x, y)), p), ref)

    def run(dtype: Any) -> dict[str, float]:
        got = jax.jit(jmp_rewrite.rewrite(train, dtype=dtype))(p, x, y)
        hand = jax.jit(train, static_argnums=3)(p, x, y, dtype)
        return {"rewrite": t.rel(t._change(got, p), ref), "hand": t.rel(t._change(hand, p), ref)}

    run.noise = noise  # type: ignore[attr-defined]
    return run


def _readme_recipe() -> Callable[[Any], dict[str, float]]:
    train, (params, state, x, y) = t.readme_recipe_in_a_scan()
    ref = t._change(jax.jit(train)(params, state, x, y), params)

    def run(dtype: Any) -> dict[str, float]:
        got = jax.jit(jmp_rewrite.rewrite(train, dtype=dtype))(params, state, x, y)
        hand = jax.jit(train, static_argnums=4)(params, state, x, y, dtype)
        return {
            "rewrite": t.rel(t._change(got, params), ref),
            "hand": t.rel(t._change(hand, params), ref),
        }

    run.noise = t.rel(t._change(jax.jit(train)(params, state, *_permuted(x, y)), params), ref)  # type: ignore[attr-defined]
    return run


def _ode(solve: Callable[..., Any]) -> Callable[[Any], dict[str, float]]:
    w1, w2, y0 = t.f32(0, 8, 32, scale=0.35), t.f32(1, 32, 8, scale=0.18), t.f32(2, 16, 8)
    ref = jax.jit(solve)(y0, w1, w2) - y0

    def run(dtype: Any) -> dict[str, float]:
        got = jax.jit(jmp_rewrite.rewrite(solve, dtype=dtype))(y0, w1, w2)
        hand = jax.jit(solve, static_argnums=3)(y0, w1, w2, dtype)
        return {"rewrite": t.rel(got - y0, ref), "hand": t.rel(hand - y0, ref)}

    run.noise = 0.0  # type: ignore[attr-defined]
    return run


def _diffrax_tsit5() -> Callable[[Any], dict[str, float]] | None:
    try:
        import diffrax
    except ImportError:
        return None

    def solve(y0, w1, w2, half=None):
        def f(_, y, args):
            return t.neural_ode_f(y, w1, w2, half)

        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(f),
            diffrax.Tsit5(),
            0.0,
            1.0,
            0.01,
            y0,
            stepsize_controller=diffrax.PIDController(rtol=1e-4, atol=1e-6),
            max_steps=4096,
        )
        return sol.ys[-1]

    return _ode(solve)


def _bn() -> Callable[[Any], dict[str, float]]:
    w, b = t.f32(0, 32, 32, scale=32**-0.5), 8.0 + t.f32(1, 32, scale=0.5)
    xs = t.f32(2, 64, 128, 32)
    ref = jax.jit(t.bn_statistics)(w, b, xs)[1]

    def run(dtype: Any) -> dict[str, float]:
        got = jax.jit(jmp_rewrite.rewrite(t.bn_statistics, dtype=dtype))(w, b, xs)[1]
        hand = jax.jit(t.bn_statistics, static_argnums=3)(w, b, xs, dtype)[1]
        return {"rewrite": t.rel(got, ref), "hand": t.rel(hand, ref)}

    perm = xs[:, np.random.default_rng(9).permutation(xs.shape[1])]
    run.noise = t.rel(jax.jit(t.bn_statistics)(w, b, perm)[1], ref)  # type: ignore[attr-defined]
    return run


def _rope() -> Callable[[Any], dict[str, float]]:
    x, wq = t.f32(0, t.ROPE_T, t.ROPE_D), t.f32(1, t.ROPE_D, t.ROPE_D, scale=t.ROPE_D**-0.5)
    inv_freq = 1.0 / (10000 ** (jnp.arange(0, t.ROPE_D, 2, dtype=jnp.float32) / t.ROPE_D))
    ref = t.rope_q(x, wq, inv_freq)

    def run(dtype: Any) -> dict[str, float]:
        got = jmp_rewrite.rewrite(t.rope_q, dtype=dtype)(x, wq, inv_freq)
        return {"rewrite": t.rel(got, ref), "hand": t.rel(t.rope_q(x, wq, inv_freq, dtype), ref)}

    run.noise = 0.0  # type: ignore[attr-defined]
    return run


def _log_softmax_grad() -> Callable[[Any], dict[str, float]]:
    x, w = t.f32(0, 256, 64), t.f32(1, 64, 512, scale=0.5)
    y = jax.nn.one_hot(np.random.default_rng(2).integers(0, 512, 256), 512)
    grad = jax.grad(t.log_softmax_loss)
    ref = grad(w, x, y)

    def run(dtype: Any) -> dict[str, float]:
        got = jmp_rewrite.rewrite(grad, dtype=dtype)(w, x, y)
        return {"rewrite": t.rel(got, ref), "hand": t.rel(grad(w, x, y, dtype), ref)}

    run.noise = t.rel(grad(w, *_permuted(x, y)), ref)  # type: ignore[attr-defined]
    return run


def _rnn_weight_gradients(body: str) -> Callable[[Any], dict[str, float]]:
    """``jax.grad(rewrite(loss))`` of an Elman RNN over 512 steps (the weights' gradients
    summed over the trips: ``tests/test_loop_cotangents.py``)."""
    params, xs = lc.inputs()
    ref = jax.jit(jax.grad(lc.rnn(body)))(params, xs)

    def run(dtype: Any) -> dict[str, float]:
        got = jax.jit(jax.grad(jmp_rewrite.rewrite(lc.rnn(body), dtype=dtype)))(params, xs)
        hand = jax.jit(jax.grad(lc.rnn(body, half=dtype)))(params, xs)
        return {"rewrite": lc.rel(got, ref), "hand": lc.rel(hand, ref)}

    run.noise = 0.0  # type: ignore[attr-defined]
    return run


def cases() -> dict[str, Callable[[Any], dict[str, float]]]:
    out = {
        "fori_loop training, weight change": _training(t.fori_training),
        "README recipe in a scan, weight change": _readme_recipe(),
        "RK4 neural ODE (1000 steps), change of y": _ode(t.rk4),
        "adaptive solver (while_loop), change of y": _ode(t.adaptive_solve),
        "EMA under cond in a scan, EMA change": _training(t.ema_training),
        "where-guarded steps, weight change": _training(t.guarded_training),
        "BatchNorm variance through a scan": _bn(),
        "q after RoPE": _rope(),
        "log_softmax loss gradient": _log_softmax_grad(),
        "Elman RNN (scan, 512 steps), grad(rewrite) weight gradients": _rnn_weight_gradients(
            "scan"
        ),
        "Elman RNN in a shard_map, grad(rewrite) weight gradients": _rnn_weight_gradients(
            "shard_map"
        ),
    }
    tsit5 = _diffrax_tsit5()
    if tsit5 is not None:
        out["diffrax Tsit5 neural ODE, change of y"] = tsit5
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    results: dict[str, Any] = {}
    lines = [
        "| pattern | noise | f16 rewrite | f16 hand | bf16 rewrite | bf16 hand |",
        "|---|---|---|---|---|---|",
    ]
    for name, run in cases().items():
        row = {"noise": run.noise}
        for dname, dtype in DTYPES.items():
            row.update({f"{dname} {k}": v for k, v in run(dtype).items()})
        results[name] = row
        cells = [row["noise"]] + [row[f"{d} {k}"] for d in DTYPES for k in ("rewrite", "hand")]
        lines.append(f"| {name} | " + " | ".join(f"{c:.3g}" for c in cells) + " |")
        print(lines[-1], file=sys.stderr)
    results["seconds"] = time.perf_counter() - t0
    print("\n".join(lines))
    print(f"\n({results['seconds']:.0f} s; jax {jax.__version__}, {jax.devices()[0].platform})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
