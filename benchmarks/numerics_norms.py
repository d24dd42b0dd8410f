"""A normalization computed in half precision: ``tanh(x @ w + b)`` read by an RMS norm.

Run by hand (not a test; seconds on 2 CPU cores)::

    .venv/bin/python benchmarks/numerics_norms.py

The program of the generator's ``grad-tanh-into-rms-norm`` find (tests/test_oracle.py), B8
D16, loss ``mean(y ** 2)`` of the normalized ``y``; relative error of the gradients of ``w``
and ``b`` against float64, median of 8 draws, for:

* ``rewrite(grad)`` / ``grad(rewrite)``: the library, both orders;
* ``reference``: only the matmuls in half (the generator's oracle);
* ``hand (Flax)``: the model in half as Flax writes it: matmul and tanh in half, the RMS norm
  computed in float32 from the half activations and cast to half once (``nn.RMSNorm(dtype=)``);
* ``tanh deny`` / ``mul deny``: the rewrite with that primitive moved to the deny list.

A loss of the normalized activations' squares is nearly independent of them (RMS-normalized
rows have a fixed mean square), so its gradient is a difference of two nearly equal terms in
the norm's backward pass; rounding either the norm's products or tanh's output (its
derivative ``1 - ans**2`` reads the output, and cancels where ``|ans|`` nears 1) in half
shows in the gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jmp_rewrite as jr

DRAWS = 8


def model(p, x, dtype=None):
    w, b, g = p
    if dtype is not None:
        w, b, x = w.astype(dtype), b.astype(dtype), x.astype(dtype)
    h = jnp.tanh(x @ w + b)
    if dtype is not None:  # Flax's RMSNorm(dtype=dtype): statistics and product in float32
        h = h.astype(jnp.float32)
        y = (h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * g).astype(dtype)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))
    y = h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * g
    return jnp.mean(jnp.square(y))


def _moved(dtype, names: set[str]) -> jr.OpLists:
    lists = jr.default_lists(dtype)
    return jr.OpLists(
        allow=lists.allow,
        infer=lists.infer - names,
        clear=lists.clear - names,
        deny=lists.deny | names,
    )


def _error(a, truth) -> float:
    a = np.asarray(a, np.float64)
    return float(np.linalg.norm(a - truth) / np.linalg.norm(truth))


def run(dtype) -> dict[str, tuple[float, float]]:
    grad = jax.grad(model)
    ways = {
        "rewrite(grad)": jr.rewrite(grad, dtype=dtype),
        "grad(rewrite)": jax.grad(jr.rewrite(model, dtype=dtype)),
        "reference": jr.rewrite(
            grad, dtype=dtype, lists=jr.OpLists(allow=_moved(dtype, set()).allow)
        ),
        "hand (Flax)": jax.grad(lambda p, x: model(p, x, dtype)),
        "tanh deny": jr.rewrite(grad, dtype=dtype, lists=_moved(dtype, {"tanh"})),
        "mul deny": jr.rewrite(grad, dtype=dtype, lists=_moved(dtype, {"mul"})),
    }
    errors: dict[str, list[list[float]]] = {k: [] for k in ways}
    for seed in range(DRAWS):
        rng = np.random.default_rng(seed)
        p = [
            jnp.asarray(rng.standard_normal((16, 16)) / 4, jnp.float32),
            jnp.asarray(0.1 * rng.standard_normal(16), jnp.float32),
            jnp.asarray(1 + 0.1 * rng.standard_normal(16), jnp.float32),
        ]
        x = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
        with jax.enable_x64(True):
            truth = grad([jnp.asarray(a, jnp.float64) for a in p], jnp.asarray(x, jnp.float64))
            truth = [np.asarray(t) for t in truth]
        for key, fun in ways.items():
            got = fun(p, x)
            errors[key].append([_error(got[i], truth[i]) for i in range(2)])
    return {k: tuple(np.median(np.array(v), axis=0)) for k, v in errors.items()}


def main() -> None:
    print("| way | f16 dW | f16 db | bf16 dW | bf16 db |")
    print("|---|---|---|---|---|")
    f16, bf16 = run(jnp.float16), run(jnp.bfloat16)
    for key in f16:
        print(
            f"| {key} | {f16[key][0]:.2e} | {f16[key][1]:.2e} | "
            f"{bf16[key][0]:.2e} | {bf16[key][1]:.2e} |"
        )


if __name__ == "__main__":
    main()
