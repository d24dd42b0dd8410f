"""Writes the example notebooks of this directory, without outputs.

Run from the repository root after editing a cell::

    .venv/bin/python notebooks/make_notebooks.py

The notebooks are executed by ``make test`` (``pytest --nbmake notebooks``); they use only
public names of ``jmp_rewrite`` and keep their outputs small.
"""

from __future__ import annotations

import os
import textwrap

import nbformat

HERE = os.path.dirname(os.path.abspath(__file__))


def md(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_markdown_cell(textwrap.dedent(text).strip())


def code(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_code_cell(textwrap.dedent(text).strip())


# --------------------------------------------------------------------------------------------
# 01: quickstart.

QUICKSTART = [
    md(
        """
        # jmp_rewrite quickstart

        `jmp_rewrite` is TensorFlow's *automatic mixed precision* for JAX: it takes any JAX
        function (here a whole jitted Flax NNX train step), paints every operation with TF's
        allow / infer / deny / clear lists, and re-emits it with matmuls and convolutions in
        half precision and numerically sensitive ops (`exp`, `log`, reductions, the loss) in
        float32. Dynamic loss scaling is an optax transformation.

        This notebook trains a small NNX classifier twice, in float32 and in mixed float16,
        and compares the losses. On a CPU the rewrite is forced with `dtype=jnp.float16` (TF,
        and `jmp_rewrite` by default, only rewrite on GPUs and TPUs), so it shows the numerics,
        not a speed-up.
        """
    ),
    code(
        """
        import jax
        import jax.numpy as jnp
        import matplotlib.pyplot as plt
        import numpy as np
        import optax
        from flax import nnx

        import jmp_rewrite

        print(jax.devices()[0].platform, jmp_rewrite.__version__)
        """
    ),
    md(
        """
        ## Data and model

        Three interleaved spirals: a small problem a linear model cannot solve.
        """
    ),
    code(
        """
        def spirals(n, seed):
            rng = np.random.default_rng(seed)
            label = rng.integers(0, 3, n)
            t = rng.uniform(0.1, 1.0, n)
            angle = 4.0 * t + 2.0 * np.pi * label / 3 + rng.normal(0, 0.15, n)
            x = np.stack([t * np.cos(angle), t * np.sin(angle)], axis=1)
            return x.astype(np.float32), label.astype(np.int32)


        x_train, y_train = spirals(2048, seed=0)
        x_test, y_test = spirals(512, seed=1)


        class Classifier(nnx.Module):
            def __init__(self, rngs):
                self.fc1 = nnx.Linear(2, 64, rngs=rngs)
                self.norm = nnx.LayerNorm(64, rngs=rngs)
                self.fc2 = nnx.Linear(64, 64, rngs=rngs)
                self.out = nnx.Linear(64, 3, rngs=rngs)

            def __call__(self, x):
                x = nnx.gelu(self.norm(self.fc1(x)))
                x = nnx.gelu(self.fc2(x))
                return self.out(x)


        graphdef, params = nnx.split(Classifier(nnx.Rngs(0)))
        print(f"{sum(p.size for p in jax.tree.leaves(params)):,} parameters")
        """
    ),
    md(
        """
        ## The train step

        A plain functional NNX train step. The only mixed-precision change is to
        differentiate the *scaled* loss: `jmp_rewrite.value_and_grad(loss_fn)(opt_state, ...)`
        is `jax.value_and_grad` of `loss * loss_scale`, and returns the unscaled loss. The
        loss-scale optimizer's `update` unscales the gradients, checks them, and skips the
        step if any is inf/NaN.
        """
    ),
    code(
        """
        def loss_fn(params, x, y):
            logits = nnx.merge(graphdef, params)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


        def make_train_step(tx, loss_scaled):
            @jax.jit
            def train_step(params, opt_state, x, y):
                if loss_scaled:
                    loss, grads = jmp_rewrite.value_and_grad(loss_fn)(opt_state, params, x, y)
                else:
                    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state, loss

            return train_step


        # float32 baseline.
        tx_f32 = optax.adam(1e-2)
        step_f32 = make_train_step(tx_f32, loss_scaled=False)

        # Mixed precision: loss scaling outermost in the optax chain, and the *jitted* train
        # step rewritten to float16 (jax.jit again around it caches the compilation).
        tx_mixed = jmp_rewrite.loss_scale_optimizer(
            optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), loss_scale="dynamic"
        )
        step_mixed = jax.jit(
            jmp_rewrite.rewrite(make_train_step(tx_mixed, loss_scaled=True), dtype=jnp.float16)
        )
        """
    ),
    md(
        """
        ## What will the rewrite do?

        `jmp_rewrite.explain` traces the step (nothing runs) and reports every equation's
        list, colour and the pass that painted it. Display the report in a notebook for a
        coloured table (see `03_op_lists`); here its totals suffice.
        """
    ),
    code(
        """
        opt_state = tx_mixed.init(params)
        report = jmp_rewrite.explain(
            make_train_step(tx_mixed, loss_scaled=True),
            params, opt_state, x_train[:128], y_train[:128], dtype=jnp.float16,
        )
        print(report.summary())
        print("in float16:", {p: c["half"] for p, c in report.per_primitive().items() if c["half"]})
        """
    ),
    md("## Train both"),
    code(
        """
        def train(step, tx, steps=60, batch=128):
            p, state = params, tx.init(params)
            rng = np.random.default_rng(0)  # the same batches for both runs
            losses = []
            for _ in range(steps):
                idx = rng.integers(0, len(x_train), batch)
                p, state, loss = step(p, state, x_train[idx], y_train[idx])
                losses.append(float(loss))
            return p, state, losses


        def accuracy(p):
            logits = nnx.merge(graphdef, p)(x_test)
            return float(jnp.mean(jnp.argmax(logits, -1) == y_test))


        params_f32, _, losses_f32 = train(step_f32, tx_f32)
        params_mixed, state_mixed, losses_mixed = train(step_mixed, tx_mixed)

        ls = jmp_rewrite.get_loss_scale_state(state_mixed)
        print(f"test accuracy: float32 {accuracy(params_f32):.1%}, "
              f"mixed {accuracy(params_mixed):.1%}")
        print(f"loss scale {float(ls.loss_scale):g}, applied {int(ls.applied_steps)}, "
              f"skipped {int(ls.skipped_steps)}")
        # Parameters (and Adam's moments) stay float32; only the compute is float16.
        print({str(x.dtype) for x in jax.tree.leaves((params_mixed, state_mixed))})
        """
    ),
    code(
        """
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(losses_f32, label="float32")
        ax.plot(losses_mixed, "--", label="mixed float16 (rewritten)")
        ax.set(xlabel="step", ylabel="training loss", yscale="log")
        ax.legend()
        plt.show()
        """
    ),
    md(
        """
        ## TF's seed API: `enable_mixed_precision_graph_rewrite`

        TF1's one-liner wraps the optimizer in loss scaling and switches the rewrite on for
        every graph built afterwards. In JAX that means every function decorated with
        `jmp_rewrite.rewrite` *without* its own `dtype`, traced after the call. On a GPU the
        dtype follows the platform (float16 on compute capability >= 7.0, bfloat16 on TPU,
        nothing on CPU); pass `dtype=jnp.float16` to force it:

        ```python
        tx = jmp_rewrite.enable_mixed_precision_graph_rewrite(optax.adam(1e-2), dtype=jnp.float16)
        step = jax.jit(jmp_rewrite.rewrite(make_train_step(tx, loss_scaled=True)))  # no dtype
        ...
        jmp_rewrite.disable_mixed_precision_graph_rewrite()
        ```

        Next: `02_loss_scale_dynamics` (skipped steps and the loss scale) and `03_op_lists`
        (the lists, the explain report and the `compare` numerics debugger).
        """
    ),
]


# --------------------------------------------------------------------------------------------
# 02: loss-scale dynamics.

DYNAMICS = [
    md(
        """
        # Loss-scale dynamics

        Dynamic loss scaling (TF1's `DynamicLossScale`): the loss is multiplied by a scale
        *S* before differentiation so that small float16 gradients do not flush to zero; the
        gradients are divided by *S* again in float32. If any gradient is inf or NaN the step
        is **skipped** (parameters and optimizer state unchanged) and *S* is halved; after
        `increment_period` finite steps in a row *S* is doubled.

        This notebook shows both kinds of overflow: natural ones, from a scale that starts
        too high for float16, and injected ones, where we poison the gradients on chosen steps.
        """
    ),
    code(
        """
        import jax
        import jax.numpy as jnp
        import matplotlib.pyplot as plt
        import numpy as np
        import optax

        import jmp_rewrite
        """
    ),
    code(
        """
        # A small regression problem: a 2-layer MLP in plain JAX.
        rng = np.random.default_rng(0)
        x_data = rng.normal(size=(1024, 16)).astype(np.float32)
        w_true = rng.normal(size=(16, 1)).astype(np.float32)
        y_data = np.tanh(x_data @ w_true) + 0.05 * rng.normal(size=(1024, 1)).astype(np.float32)

        key1, key2 = jax.random.split(jax.random.key(0))
        params = {
            "w1": jax.random.normal(key1, (16, 64)) / 4.0,
            "b1": jnp.zeros(64),
            "w2": jax.random.normal(key2, (64, 1)) / 8.0,
        }


        def loss_fn(params, x, y):
            h = jnp.tanh(x @ params["w1"] + params["b1"])
            return jnp.mean((h @ params["w2"] - y) ** 2)


        def make_step(tx):
            def step(params, opt_state, x, y, poison):
                loss, grads = jmp_rewrite.value_and_grad(loss_fn)(opt_state, params, x, y)
                # Fault injection: on a poisoned step one gradient leaf becomes inf.
                grads["w2"] = jnp.where(poison, jnp.inf, grads["w2"])
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state, loss

            # The whole step runs in mixed float16 (forced on CPU).
            return jax.jit(jmp_rewrite.rewrite(step, dtype=jnp.float16))


        def run(tx, steps, poisoned=()):
            step = make_step(tx)
            p, state = params, tx.init(params)
            history = {"loss": [], "scale": [], "applied": []}
            for i in range(steps):
                idx = (np.arange(64) + 64 * i) % len(x_data)
                history["scale"].append(float(jmp_rewrite.get_loss_scale(state)))
                p, state, loss = step(p, state, x_data[idx], y_data[idx], i in poisoned)
                history["loss"].append(float(loss))
                history["applied"].append(bool(jmp_rewrite.last_step_applied(state)))
            return p, state, history
        """
    ),
    md(
        """
        ## Natural overflow: a scale too large for float16

        float16's largest finite value is 65504. Starting at *S* = 2**30, the scaled
        gradients overflow in the float16 backward pass; each overflow skips the step and
        halves *S* until the gradients fit. Then *S* grows again every 20 good steps, and
        overflows now and then at the top: the typical saw-tooth.
        """
    ),
    code(
        """
        print("float16 max:", float(jnp.finfo(jnp.float16).max))
        tx = jmp_rewrite.loss_scale_optimizer(
            optax.adam(1e-2),
            jmp_rewrite.DynamicLossScale(initial_loss_scale=2.0**30, increment_period=20),
        )
        _, state, natural = run(tx, steps=120)
        ls = jmp_rewrite.get_loss_scale_state(state)
        print(f"applied {int(ls.applied_steps)}, skipped {int(ls.skipped_steps)}, "
              f"final scale 2**{np.log2(float(ls.loss_scale)):.0f}")
        print("skipped steps:", [i for i, ok in enumerate(natural["applied"]) if not ok])
        """
    ),
    md(
        """
        ## Injected overflow

        Now start from a comfortable scale and poison the gradients on steps 30-33 and 70. Each
        poisoned step is skipped (its update is zero, Adam's moments and step count are
        untouched) and halves the scale.
        """
    ),
    code(
        """
        poisoned = {30, 31, 32, 33, 70}
        tx = jmp_rewrite.loss_scale_optimizer(
            optax.adam(1e-2),
            jmp_rewrite.DynamicLossScale(initial_loss_scale=2.0**10, increment_period=20),
        )
        _, state, injected = run(tx, steps=100, poisoned=poisoned)
        skipped = [i for i, ok in enumerate(injected["applied"]) if not ok]
        ls = jmp_rewrite.get_loss_scale_state(state)
        print("skipped steps:", skipped, "== poisoned:", skipped == sorted(poisoned))
        print(f"counters: applied_steps={int(ls.applied_steps)}, "
              f"skipped_steps={int(ls.skipped_steps)}, good_steps={int(ls.good_steps)}, "
              f"last_step_applied={bool(jmp_rewrite.last_step_applied(state))}")
        """
    ),
    code(
        """
        fig, axes = plt.subplots(2, 2, figsize=(10, 5), sharex="col")
        for col, (title, h) in enumerate([("natural overflow", natural),
                                          ("injected overflow", injected)]):
            steps = np.arange(len(h["loss"]))
            bad = np.array([not ok for ok in h["applied"]])
            axes[0, col].step(steps, h["scale"], where="post")
            axes[0, col].plot(steps[bad], np.array(h["scale"])[bad], "rx", label="skipped")
            axes[0, col].set(yscale="log", ylabel="loss scale", title=title)
            axes[0, col].set_yscale("log", base=2)
            axes[0, col].legend()
            axes[1, col].plot(steps, h["loss"])
            axes[1, col].plot(steps[bad], np.array(h["loss"])[bad], "rx")
            axes[1, col].set(xlabel="step", ylabel="loss", yscale="log")
        fig.tight_layout()
        plt.show()
        """
    ),
    md(
        """
        ## A skipped step changes nothing

        Run one poisoned update by hand: the parameters come back identical, and the
        `debug=True` option records which gradient leaves were not finite.
        """
    ),
    code(
        """
        tx = jmp_rewrite.loss_scale_optimizer(optax.adam(1e-2), debug=True)
        state = tx.init(params)
        loss, grads = jmp_rewrite.value_and_grad(loss_fn)(state, params, x_data[:64], y_data[:64])
        grads["b1"] = grads["b1"].at[3].set(jnp.nan)
        updates, state = tx.update(grads, state, params)
        new_params = optax.apply_updates(params, updates)
        print("applied:", bool(jmp_rewrite.last_step_applied(state)))
        print("params unchanged:", all(jax.tree.leaves(jax.tree.map(jnp.array_equal,
                                                                    params, new_params))))
        print("scale halved to", float(jmp_rewrite.get_loss_scale(state)))
        print("non-finite leaves:", jmp_rewrite.non_finite_leaves(state, params))
        """
    ),
]


# --------------------------------------------------------------------------------------------
# 03: op lists, levels, explain HTML, compare.

OP_LISTS = [
    md(
        """
        # Op lists, levels, `explain` and `compare`

        The rewrite decides each op's precision from four lists, as TF's grappler pass does:

        * **allow**: always half precision (matmuls, convolutions);
        * **infer**: half precision when their neighbours are (adds, activations, ...);
        * **deny**: always float32, and deny spreads forward through infer/clear ops (`exp`,
          `log`, reductions in float16, softmax/log-softmax as fused units);
        * **clear**: precision-agnostic, take the colour of their neighbours (reshapes, max, ...).
        """
    ),
    code(
        """
        import jax
        import jax.numpy as jnp
        import numpy as np

        import jmp_rewrite

        lists = jmp_rewrite.default_lists(jnp.float16)
        print(lists)
        for op in ["dot_general", "add", "tanh", "exp", "reduce_sum", "reshape", "jit:log_softmax"]:
            print(f"{op:>15}: {lists.kind(op)}")
        print("bfloat16 reduce_sum:", jmp_rewrite.default_lists(jnp.bfloat16).kind("reduce_sum"))
        print("levels:", jmp_rewrite.LEVELS)
        """
    ),
    md(
        """
        ## A small attention block

        `explain` shows what the rewrite would do, without running anything (the arguments
        may be `jax.ShapeDtypeStruct`s). Displaying the report gives the totals per phase
        (forward, backward, optimizer), the lint, and a tree of the program's scopes
        (`jax.named_scope` here; Flax and Haiku module paths, or the attributes Flax NNX
        modules are called through): open a scope for its equations, coloured by list, dark
        green ones run in half precision; hover a row for the pass that painted it, a source
        cell for the line of code.
        """
    ),
    code(
        """
        def attention(params, x):
            with jax.named_scope("qkv"):
                q, k, v = (x @ params[name] for name in ("wq", "wk", "wv"))
            with jax.named_scope("scores"):
                weights = jax.nn.softmax(q @ k.T / np.sqrt(q.shape[-1]), axis=-1)
            with jax.named_scope("output"):
                y = (weights @ v) @ params["wo"]
            return jnp.mean(y * y)


        rng = np.random.default_rng(0)
        params = {name: jnp.asarray(rng.normal(size=(32, 32)) / np.sqrt(32), jnp.float32)
                  for name in ("wq", "wk", "wv", "wo")}
        x = jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)  # 64 tokens of width 32

        report = jmp_rewrite.explain(attention, params, x, dtype=jnp.float16)
        report
        """
    ),
    md(
        """
        The same as text, one line per scope (or `"line"`, `"primitive"`; on the command line
        `python -m jmp_rewrite explain module:fn --shapes ... --by scope`), then the lint:
        matmuls whose dimensions tensor cores cannot take, and deny-list ops that keep a chain
        of equations float32, with the one list change that would release it and its risk.
        """
    ),
    code(
        """
        print(report.format("scope"))
        """
    ),
    md(
        """
        ## Customising the lists and the level

        `OpLists` are immutable: `.move(op, to=...)`, `.add(...)` and `.remove(...)` return new
        lists (TF's `TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_{ALLOW,INFER,DENY,CLEAR}LIST_{ADD,
        REMOVE}` environment variables are read as `JMP_REWRITE_...`). The level
        (`JMP_REWRITE_LEVEL`) changes the lists wholesale.
        """
    ),
    code(
        """
        variants = {
            "default": dict(),
            "exp on infer": dict(lists=lists.move("exp", to="infer")),
            "mul denied": dict(lists=lists.move("mul", to="deny")),
            "TENSOR_CORES_ONLY": dict(level="TENSOR_CORES_ONLY"),
            "TREAT_INFER_AS_DENY": dict(level="TREAT_INFER_AS_DENY"),
            "UNSAFE_FORCE_ALL": dict(level="UNSAFE_FORCE_ALL"),
        }
        print(f"{'variant':>20}  half/total  casts")
        for name, kwargs in variants.items():
            r = jmp_rewrite.explain(attention, params, x, dtype=jnp.float16, **kwargs)
            print(f"{name:>20}  {len(r.converted):>4}/{r.total:<5}  {len(r.casts):>5}")
        """
    ),
    code(
        """
        # The same report as JSON-ready data, e.g. for a CI check.
        data = report.to_dict()
        print(data["totals"])
        print({k: v for k, v in data["per_primitive"].items() if v["half"]})
        """
    ),
    md(
        """
        ## Finding a bad op with `compare`

        Suppose someone "optimised" the lists by moving `reduce_sum` from deny to infer, so
        that the final mean runs in float16 too. With activations of a realistic size the sum
        of squares exceeds float16's maximum (65504). `compare` runs the float32 program and
        the rewritten one side by side on real inputs, equation by equation, and points at
        the first equation whose error exceeds the tolerance.
        """
    ),
    code(
        """
        fast_lists = lists.move("reduce_sum", to="infer")
        big_x = 8.0 * x
        comparison = jmp_rewrite.compare(attention, params, big_x, dtype=jnp.float16,
                                         lists=fast_lists)
        print(comparison.summary())
        print()
        first = comparison.first_exceeding
        print("first exceeding:", first.path, first.key, first.list, first.colour, first.overflow)
        for s in comparison.suggestions:
            print("suggestion:", s)
        """
    ),
    code(
        """
        fixed = comparison.apply()  # re-run with the suggestions applied to the lists
        print(fixed.summary())
        print("reduce_sum now on:", fixed.lists.kind("reduce_sum"))
        """
    ),
    code(
        """
        # The rewritten function with the fixed lists gives the float32 answer again.
        reference = attention(params, big_x)
        broken = jmp_rewrite.rewrite(attention, dtype=jnp.float16, lists=fast_lists)
        repaired = jmp_rewrite.rewrite(attention, dtype=jnp.float16, lists=fixed.lists)
        print(f"float32 {float(reference):.2f}, broken lists {float(broken(params, big_x))}, "
              f"repaired lists {float(repaired(params, big_x)):.2f}")
        """
    ),
]


NOTEBOOKS = {
    "01_quickstart.ipynb": QUICKSTART,
    "02_loss_scale_dynamics.ipynb": DYNAMICS,
    "03_op_lists.ipynb": OP_LISTS,
}


def main() -> None:
    for name, cells in NOTEBOOKS.items():
        nb = nbformat.v4.new_notebook(cells=cells)
        for i, cell in enumerate(nb.cells):  # stable ids: regenerating gives no diff
            cell.id = f"{name.split('_')[0]}-{i:02d}"
        nb.metadata["kernelspec"] = {
            "display_name": "Python 3",
            "language": "python",
            "name": "python3",
        }
        nb.metadata["language_info"] = {"name": "python"}
        nbformat.validate(nb)
        path = os.path.join(HERE, name)
        with open(path, "w", encoding="utf-8") as f:
            nbformat.write(nb, f)
        print("wrote", path)


if __name__ == "__main__":
    main()
