"""Issue 8's figures: how far mixed-precision training lands from float32, rewrite vs by hand.

Run by hand (not a test; about 3-5 minutes on 2 CPU cores)::

    .venv/bin/python benchmarks/numerics_vs_handwritten.py
    .venv/bin/python benchmarks/numerics_vs_handwritten.py --only bn lists --json out.json

Every figure is a distance from a float32 run of the same model, on the same data:

* ``rewrite``: the float32 model's train step through ``jmp_rewrite.rewrite(dtype=...)``;
* ``hand``: the model written in half precision by hand, Flax's way (``dtype=bfloat16`` /
  ``float16``, float32 parameters: half-precision compute, float32 statistics, float32
  master weights, the loss on float32 logits);
* ``noise``: the float32 noise floor: float32 again with each batch's rows permuted. Losses,
  gradients and batch statistics are means over the batch, so this computes the same function
  summed in another order; what separates it from float32 is float32 rounding, amplified by
  training as any rounding is. (A second seed would measure seed variance instead, and
  ``jax.default_matmul_precision`` changes nothing in float32 on a CPU.)

Sections (models in ``tests/user_models.py`` unless said otherwise):

1. ``nnx``: Flax NNX MLP whose blocks run through ``nnx.remat``, an ``nnx.jit`` helper or
   ``nnx.scan``; 30 Adam steps (``nnx.Optimizer``) with a post-update forward pass; relative
   error of the parameter change ``p_30 - p_0``.
2. ``bn``: Linen and NNX Dense-BatchNorm nets, 400 bfloat16 Adam steps on fresh batches;
   relative error of the running variance and mean.
3. ``embed``: gradient of an ``nnx.Embed`` table for one Zipf(1.1) batch (16 x 256 tokens),
   bfloat16; relative error of the rows of the three most frequent tokens. ``hand, f32
   gather`` looks the table up in float32 and casts the rows (its scatter-add is float32).
4. ``lists`` (issue item 7: which lists bfloat16 should use off the CPU): a small Linen
   transformer LM (2 layers, d=64, 4 heads, T=32, a Markov-chain language) and a small Linen
   CNN with batch norm (16x16x3, 10 classes of noisy templates), trained with Adam on fresh
   batches; the error is the mean over the last 10% of steps of ``|loss - loss_f32|``, with
   ``rewrite`` using TF's oneDNN bfloat16 lists (today's default), the float16 (CUDA) lists
   passed as ``lists=jmp_rewrite.default_lists(jnp.float16)``, and ``float16`` itself
   (rewritten and by hand); averaged over ``--seeds`` (initialisation and data) seeds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import user_models as um  # noqa: E402

import jmp_rewrite  # noqa: E402
from jmp_rewrite.demo.report import machine  # noqa: E402

BF16, F16 = jnp.bfloat16, jnp.float16


def _table(title: str, header: list[str], rows: list[list[Any]]) -> str:
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = [f"\n### {title}\n", "| " + " | ".join(header) + " |"]
    lines.append("|" + "---|" * len(header))
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# 1-3: user models
# ------------------------------------------------------------------------------------------


def nnx_section(steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pattern in ("remat", "jit", "scan"):
        ref = um.train_nnx(pattern, "float32", steps=steps)
        err = lambda r, ref=ref: um.param_change_error(r.init, r.final, ref.init, ref.final)
        row: dict[str, float] = {}
        if pattern == "remat":
            row["noise"] = err(um.train_nnx(pattern, "float32_perm", steps=steps))
        for name, dt in (("float16", F16), ("bfloat16", BF16)):
            got = um.train_nnx(pattern, "rewrite", dtype=dt, steps=steps, frozen_steps=1)
            row[f"rewrite {name}"] = err(got)
            row[f"lr=0 step moves {name}"] = max(
                float(np.abs(np.asarray(a) - np.asarray(b)).max())
                for a, b in zip(jax.tree.leaves(got.frozen), jax.tree.leaves(got.init))
            )
            if pattern == "remat":  # the hand-written model is the same for every pattern
                row[f"hand {name}"] = err(um.train_nnx(pattern, "hand", dtype=dt, steps=steps))
        out[pattern] = row
        print(f"  nnx {pattern}: {row}", file=sys.stderr)
    return out


def bn_section(steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for framework in ("linen", "nnx"):
        ref = um.train_bn(framework, "float32", steps=steps)[0]
        row = {}
        for run in ("rewrite", "hand", "float32_perm"):
            got = um.train_bn(framework, run, dtype=BF16, steps=steps)[0]
            for stat in ("var", "mean"):
                row[f"{run} {stat}"] = um.rel(got[stat], ref[stat])
        out[framework] = row
        print(f"  bn {framework}: {row}", file=sys.stderr)
    return out


def embed_section() -> dict[str, Any]:
    ref = um.embedding_grad("float32")
    runs = {
        "rewrite bfloat16": um.embedding_grad("rewrite", dtype=BF16),
        "hand bfloat16": um.embedding_grad("hand", dtype=BF16),
        "hand bfloat16, f32 gather": um.embedding_grad("hand", dtype=BF16, gather_float32=True),
        "rewrite float16": um.embedding_grad("rewrite", dtype=F16),
        "noise": um.embedding_grad("float32_perm"),
    }
    counts = [int(c) for c in np.sort(ref.counts)[::-1][:3]]
    out = {"counts": counts}
    out.update({k: um.frequent_token_errors(g, ref, top=3) for k, g in runs.items()})
    print(f"  embed: {out}", file=sys.stderr)
    return out


# ------------------------------------------------------------------------------------------
# 4: which lists for bfloat16 -- a transformer LM and a CNN, Flax Linen
# ------------------------------------------------------------------------------------------


class LM(nn.Module):
    vocab: int = 256
    width: int = 64
    heads: int = 4
    layers: int = 2
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        d = self.dtype
        x = nn.Embed(self.vocab, self.width, dtype=d)(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.width))
        x = x + pos.astype(x.dtype)
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.layers):
            h = nn.LayerNorm(dtype=d)(x)
            x = x + nn.MultiHeadDotProductAttention(self.heads, dtype=d)(h, h, mask=mask)
            h = nn.LayerNorm(dtype=d)(x)
            x = x + nn.Dense(self.width, dtype=d)(nn.gelu(nn.Dense(4 * self.width, dtype=d)(h)))
        return nn.Dense(self.vocab, dtype=d)(nn.LayerNorm(dtype=d)(x))


class CNN(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        for feats, stride in ((16, 1), (32, 2), (32, 2)):
            x = nn.Conv(feats, (3, 3), strides=stride, use_bias=False, dtype=self.dtype)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=self.dtype)(x)
            x = nn.relu(x)
        return nn.Dense(10, dtype=self.dtype)(jnp.mean(x, axis=(1, 2)))


def lm_batches(steps: int, seed: int = 0, batch: int = 16, seq: int = 32) -> Iterator[Any]:
    """A Markov-chain language: each token has a few likely successors (Dirichlet(0.05))."""
    rng = np.random.default_rng(seed)
    trans = rng.dirichlet(np.full(256, 0.05), size=256)
    cum = np.cumsum(trans, axis=1)
    for _ in range(steps):
        toks = np.empty((batch, seq + 1), np.int32)
        toks[:, 0] = rng.integers(0, 256, batch)
        for t in range(seq):
            u = rng.random(batch)[:, None]
            toks[:, t + 1] = np.minimum((u > cum[toks[:, t]]).sum(1), 255)
        yield toks[:, :-1], toks[:, 1:]


def cnn_batches(steps: int, seed: int = 0, batch: int = 32) -> Iterator[Any]:
    """Ten classes of smooth random 16x16x3 templates, scaled and shifted, plus noise."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((10, 4, 4, 3))
    templates = np.repeat(np.repeat(base, 4, axis=1), 4, axis=2)
    for _ in range(steps):
        y = rng.integers(0, 10, batch)
        scale = rng.uniform(0.5, 1.5, (batch, 1, 1, 1))
        x = templates[y] * scale + 0.3 + rng.standard_normal((batch, 16, 16, 3))
        yield x.astype(np.float32), y.astype(np.int32)


def _linen_training(
    kind: str, run: str, dtype: Any, lists: Any, steps: int, lr: float, seed: int = 0
) -> list[float]:
    """Losses of ``steps`` Adam steps of the LM or the CNN (``run`` as in user_models)."""
    model_dtype = dtype if run == "hand" else None
    if kind == "lm":
        model, batches = LM(dtype=model_dtype), lm_batches(steps, seed)
        example = jnp.zeros((2, 32), jnp.int32)
    else:
        model, batches = CNN(dtype=model_dtype), cnn_batches(steps, seed)
        example = jnp.zeros((2, 16, 16, 3), jnp.float32)
    variables = jax.jit(lambda: model.init(jax.random.key(seed, impl="rbg"), example))()
    params, stats = variables["params"], variables.get("batch_stats", {})
    tx = optax.adam(lr)

    def train_step(params, stats, opt_state, x, y):
        def loss_fn(params):
            if stats:
                logits, new = model.apply(
                    {"params": params, "batch_stats": stats}, x, mutable=["batch_stats"]
                )
                new_stats = new["batch_stats"]
            else:
                logits, new_stats = model.apply({"params": params}, x), stats
            xent = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
            return xent.mean(), new_stats

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, loss

    if run == "rewrite":
        train_step = jmp_rewrite.rewrite(train_step, dtype=dtype, lists=lists)
    step = jax.jit(train_step)
    opt_state, losses = tx.init(params), []
    for i, (x, y) in enumerate(batches):
        if run == "float32_perm":
            perm = np.random.default_rng(i).permutation(len(x))
            x, y = x[perm], y[perm]
        params, stats, opt_state, loss = step(params, stats, opt_state, x, y)
        losses.append(float(loss))
    return losses


LIST_VARIANTS: dict[str, tuple[str, Any, Callable[[], Any]]] = {
    "rewrite bf16, oneDNN lists (default)": ("rewrite", BF16, lambda: None),
    "rewrite bf16, float16 (CUDA) lists": ("rewrite", BF16, lambda: jmp_rewrite.default_lists(F16)),
    "hand bf16": ("hand", BF16, lambda: None),
    "rewrite float16": ("rewrite", F16, lambda: None),
    "hand float16": ("hand", F16, lambda: None),
    "noise (float32, rows permuted)": ("float32_perm", None, lambda: None),
}


def lists_section(lm_steps: int, cnn_steps: int, seeds: int) -> dict[str, Any]:
    """Per model and variant: the loss error, averaged over ``seeds`` (init and data)."""
    out: dict[str, Any] = {}
    for kind, steps, lr in (("lm", lm_steps, 3e-3), ("cnn", cnn_steps, 3e-3)):
        tail = max(1, steps // 10)
        row: dict[str, list[float]] = {"float32 final loss": []}
        for seed in range(seeds):
            ref = np.asarray(_linen_training(kind, "float32", None, None, steps, lr, seed))
            row["float32 final loss"].append(float(ref[-tail:].mean()))
            for name, (run, dt, lists) in LIST_VARIANTS.items():
                got = np.asarray(_linen_training(kind, run, dt, lists(), steps, lr, seed))
                row.setdefault(name, []).append(float(np.abs(got - ref)[-tail:].mean()))
        out[kind] = {k: float(np.mean(v)) for k, v in row.items()}
        out[kind]["per seed"] = row
        print(f"  lists {kind}: {row}", file=sys.stderr)
    return out


# ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", choices=["nnx", "bn", "embed", "lists"])
    parser.add_argument("--nnx-steps", type=int, default=30)
    parser.add_argument("--bn-steps", type=int, default=400)
    parser.add_argument("--lm-steps", type=int, default=400)
    parser.add_argument("--cnn-steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the lists section")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    only = set(args.only or ["nnx", "bn", "embed", "lists"])
    results: dict[str, Any] = {"jax": jax.__version__, "device": str(jax.devices()[0])}
    print(f"measured {machine()}, jax {jax.__version__}", flush=True)
    t0 = time.perf_counter()
    tables = []

    if "nnx" in only:
        r = results["nnx"] = nnx_section(args.nnx_steps)
        header = ["pattern", "dtype", "rewrite", "hand-written", "float32 noise", "lr=0 moves"]
        rows = [
            [
                p,
                d,
                r[p][f"rewrite {d}"],
                r["remat"][f"hand {d}"],
                r["remat"]["noise"],
                r[p][f"lr=0 step moves {d}"],
            ]
            for p in r
            for d in ("float16", "bfloat16")
        ]
        tables.append(
            _table(
                f"NNX parameter change after {args.nnx_steps} Adam steps, relative error",
                header,
                rows,
            )
        )
    if "bn" in only:
        r = results["bn"] = bn_section(args.bn_steps)
        rows = [
            [
                fw,
                stat,
                r[fw][f"rewrite {stat}"],
                r[fw][f"hand {stat}"],
                r[fw][f"float32_perm {stat}"],
            ]
            for fw in r
            for stat in ("var", "mean")
        ]
        tables.append(
            _table(
                f"BatchNorm running statistics after {args.bn_steps} bfloat16 steps, "
                "relative error",
                ["framework", "statistic", "rewrite", "hand-written", "float32 noise"],
                rows,
            )
        )
    if "embed" in only:
        r = results["embed"] = embed_section()
        names = [k for k in r if k != "counts"]
        rows = [[f"#{i + 1} ({c}x)", *(r[k][i] for k in names)] for i, c in enumerate(r["counts"])]
        tables.append(
            _table(
                "Embedding gradient rows of the most frequent tokens (Zipf batch), relative error",
                ["token", *names],
                rows,
            )
        )
    if "lists" in only:
        r = results["lists"] = lists_section(args.lm_steps, args.cnn_steps, args.seeds)
        names = ["float32 final loss", *LIST_VARIANTS]
        rows = [[k, *(r[k][n] for n in names)] for k in r]
        tables.append(
            _table(
                f"Loss error, mean |loss - loss_f32| over the last 10% of steps "
                f"(LM {args.lm_steps} steps, CNN {args.cnn_steps} steps; mean of "
                f"{args.seeds} seeds)",
                ["model", *names],
                rows,
            )
        )

    results["seconds"] = time.perf_counter() - t0
    print("\n".join(tables))
    print(f"\n({results['seconds']:.0f} s; jax {jax.__version__}, {results['device']})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
