"""Issue 29: the corpus of the painting goldens (``tests/test_goldens.py``).

A family is a function returning :class:`~golden_text.Case` s; each is traced once (never
compiled) and painted under each of its configurations. The families:

* ``tf_patterns``: the TF patterns of ``tests/test_tf_patterns.py`` (T1-T31, the v1 loop
  tests with ``while_loop`` and ``fori_loop``, the probes in their columns, the level and
  environment table), each in float16 and bfloat16;
* ``models``: the benchmark models (``benchmarks/_models.py``, ``benchmarks/_gpu_models.py``)
  at small sizes, forward and as train steps, in float16, bfloat16 and bfloat16 with float8
  matmuls (rules lowered to these sizes);
* ``libraries``: the Flax Linen / NNX, Equinox and Haiku models of the tests
  (``tests/user_models.py``, ``tests/test_real_models.py``, ``tests/test_model_libraries.py``);
* ``generated``: programs of ``tests/program_gen.py`` drawn with fixed seeds
  (:func:`sampled_programs`: a NumPy generator over this module's own copy of the
  generator's vocabulary, so that what other families add to the generator does not move
  these programs);
* ``rules``: the issue's families pinned by rule: matmul precisions and dot algorithms,
  ``while_loop`` conditions and carries of every type, float8 rules, nested scans.

Arguments are ``jax.ShapeDtypeStruct`` s (parameters by ``jax.eval_shape`` of the models'
own initialisers): nothing here runs or compiles.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from golden_text import BF16, F16, HALF, Case, Config, abstract
from jax import lax

import jmp_rewrite

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

F32 = jnp.float32


def sds(*shape: int, dtype: Any = F32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


# ------------------------------------------------------------------------------------------
# tf_patterns
# ------------------------------------------------------------------------------------------


def tf_patterns() -> list[Case]:
    import test_tf_patterns as tp

    X, W, W2, B = (abstract(a) for a in (tp.X, tp.W, tp.W2, tp.B))
    relu = tp.relu
    cases: list[Case] = []

    def add(name: str, fun: Callable[..., Any], *args: Any, configs=HALF) -> None:
        cases.append(Case(f"tf/{name}", fun, args, configs))

    add("T1", lambda x: relu(jnp.sqrt(relu(jnp.exp(x)))), X)

    def t2(dtype):
        def f(x):
            return relu((relu(x.astype(dtype) @ x.astype(dtype))).astype(F32))

        return f

    add("T2", t2(jnp.float16), X, configs=(F16,))
    add("M1", t2(jnp.bfloat16), X, configs=(BF16,))
    add("T3", tp._make_t3(relu), X)
    add("T3-jax.nn.relu", tp._make_t3(jax.nn.relu), X, configs=(F16,))

    def t4(x):
        clr3 = relu(relu(jnp.sqrt(relu(jnp.exp(x)))) @ relu(jnp.sqrt(relu(jnp.exp(x)))))
        return jnp.log(relu(jnp.log(clr3)) @ relu(jnp.log(clr3)))

    add("T4", t4, X, configs=(Config("float16", level="TREAT_INFER_AS_DENY"),))

    def t5(relu_fn):
        def f(x):
            clr1, clr2 = relu_fn(x), relu_fn(x)
            return clr1 @ clr1, relu_fn(clr2), clr1 > clr2

        return f

    add("T5", t5(relu), X)
    add("T5-jax.nn.relu", t5(jax.nn.relu), X, configs=(F16,))
    add("T6", tp._t6, X)

    @jmp_rewrite.float32_region
    def allow2_on_cpu(v):
        return v @ v

    def t7(x):
        return relu(allow2_on_cpu(jnp.tanh(relu(x) @ x)))

    add("T7", t7, X, configs=(F16, Config("float16", infer_follows_allow=False), BF16))

    def t10(x):
        allow1 = x @ x
        a, b, c = jax.lax.optimization_barrier((allow1, allow1, allow1))
        return (a + b + c) @ (a + b + c)

    add("T10", t10, X)
    mask = jax.ShapeDtypeStruct((32, 32), jnp.bool_)
    add("T11", lambda m: m.astype(F32) @ m.astype(F32), mask)
    for kind in tp.LOOP_KINDS:

        def t12(x, kind=kind):
            return tp._loop(kind, lambda c: jnp.sqrt(c) @ jnp.sqrt(c), jnp.exp(x))

        add(f"T12-{kind}", t12, X)
    x3 = sds(8, 32, 32)
    add("T18", lambda v: jnp.matmul(v, v), x3)
    add("T18-einsum", lambda v: jnp.einsum("bij,bjk->bik", v, v), x3)
    eye = abstract(tp.EYE)
    for param in tp.UNARY_INFER:
        op, key = param.values
        configs = (F16, Config("float16", infer_follows_allow=False), BF16)
        add(f"between/{param.id}", tp._between(op), X, eye, configs=configs)
    add("T28-softmax", tp._between(jax.nn.softmax), X, eye)
    conv = (sds(2, 8, 8, 4), sds(3, 3, 4, 8), sds(8))
    add("M4", tp._conv_bias_relu, *conv)
    add("M5", lambda x, y, b: relu(x**y + b), X, W, B, configs=(BF16,))
    for param in tp.LOOP_TESTS:
        inp, body, out = param.values[:3]
        for kind in tp.LOOP_KINDS:

            def f(x, w, inp=inp, body=body, out=out, kind=kind):
                for letter in inp:
                    x = tp._letter(letter, x, w)

                def loop_body(v):
                    for letter in body:
                        v = tp._letter(letter, v, w)
                    return v

                x = tp._loop(kind, loop_body, x)
                for letter in out:
                    x = tp._letter(letter, x, w)
                return x

            add(f"{param.id}-{kind}", f, X, W)
    for name, (fun, args, columns) in tp.PROBES.items():
        configs = tuple(
            Config(
                **{
                    "dtype": np.dtype(c["dtype"]).name,
                    **{k: v for k, v in c.items() if k != "dtype"},
                }
            )
            for col, c in tp.COLUMNS.items()
            if col in columns
        )
        add(f"probe/{name}", fun, *abstract(args), configs=configs)
    add(
        "probe/P",
        tp._xent,
        X,
        W,
        abstract(tp.LABELS),
        configs=(
            F16,
            Config("float16", infer_follows_allow=False),
            BF16,
            Config(
                "bfloat16",
                lists=jmp_rewrite.default_lists(jnp.bfloat16).move("reduce_sum", to="deny"),
                tag="reduce_sum-deny",
            ),
        ),
    )
    weak = jax.ShapeDtypeStruct((32, 32), F32, weak_type=True)
    add("probe/U", lambda x, w: x.astype(F32) @ w, weak, W)
    for kind in tp.LOOP_KINDS:
        add(
            f"probe/W-{kind}",
            lambda x, w, kind=kind: tp._loop(kind, lambda c: jnp.tanh(c @ w), x),
            X,
            W,
            configs=(F16, Config("float16", infer_follows_allow=False), BF16),
        )
    env_configs = []
    for param in tp.ENV_TABLE:
        kwargs, env = param.values[:2]
        env_configs.append(
            Config(
                "float16",
                level=kwargs.get("level"),
                lists=kwargs.get("lists"),
                env=tuple(sorted(env.items())),
                tag=param.id,
            )
        )
    add("env-chain", tp._env_chain, X, W, configs=tuple(env_configs))
    grad = jax.grad(tp._xent_loss)
    add(
        "log-softmax-grad",
        grad,
        W,
        X,
        abstract(tp.LABELS),
        configs=(F16, Config("float16", infer_follows_allow=False), BF16),
    )
    return cases


FAMILIES: dict[str, Callable[[], list[Case]]] = {
    "tf_patterns": tf_patterns,
}


# ------------------------------------------------------------------------------------------
# generated
# ------------------------------------------------------------------------------------------

# The generator's vocabulary as of issue 29 (a copy: programs drawn here stay the same when
# the generator gains block kinds, spellings or carriers).
_ACTS = ("gelu", "linear", "relu", "tanh")
_LOSSES = ("logsumexp", "mean_square")
_SPELLINGS = ("finfo_mul", "neg1e9_mul", "neg3e38_mul", "full_where", "where_neg1e9")
_ROUTES = ("plain", "jit", "checkpoint", "cond_ones", "cond_const", "scan0", "fori_carried")
_UPDATES = ("sgd", "ema", "adam", "ode_div", "rk4", "clip", "project", "scatter", "ravel", "square")
_CARRIERS = ("step", "cond", "scan", "fori_loop", "while_loop", "scan_cond")
_WRAPPERS = ("jit", "checkpoint", "custom_jvp", "custom_vjp", "scan2")
#: Painted whole: ``rewrite(grad(f))``, ``rewrite(vmap(f))``; the outer orders paint ``f``.
_TRANSFORMS = ("none", "grad_inner", "vmap_inner")


def _pick(rng: np.random.Generator, options: Any) -> Any:
    return options[int(rng.integers(len(options)))]


def _sample_block(rng: np.random.Generator, transform: str) -> Any:
    import program_gen as pg

    kind = _pick(rng, ("state", "attention", "copy", "dense", "norm"))
    wrappers = tuple(_pick(rng, _WRAPPERS) for _ in range(int(rng.integers(3))))
    k = int(rng.integers(3))
    if kind == "state":
        carriers = _CARRIERS if not transform.startswith("grad") else _CARRIERS[:4] + _CARRIERS[5:]
        carrier = _pick(rng, carriers)
        looped = carrier not in ("step", "cond")
        scan = carrier.startswith("scan")
        return pg.State(
            update=_pick(rng, _UPDATES),
            carrier=carrier,
            trips=_pick(rng, (6, 0, 1)) if looped else 1,
            carries=int(rng.integers(1, 5)),
            reverse=bool(rng.integers(2)) if scan else False,
            unroll=_pick(rng, (1, 2)) if scan else 1,
            h_carry=bool(rng.integers(2)) if looped else False,
            feed=bool(rng.integers(2)),
            taken=bool(rng.integers(2)) if carrier == "cond" else True,
            k=k,
            wrappers=wrappers,
        )
    if kind == "attention":
        return pg.Attention(
            _pick(rng, _SPELLINGS), bool(rng.integers(2)), bool(rng.integers(2)), k, wrappers
        )
    if kind == "copy":
        src = _pick(rng, ("x", "x_T", "w", "s", "exp_x"))
        return pg.Copy(src, _pick(rng, _ROUTES), k, wrappers)
    if kind == "dense":
        op = _pick(rng, ("matmul", "einsum", "conv"))
        return pg.Dense(op, _pick(rng, _ACTS), bool(rng.integers(2)), k, wrappers)
    return pg.Norm(_pick(rng, ("layer", "rms", "batch")), wrappers)


def sampled_programs(n: int, seed: int = 29) -> list[Any]:
    """``n`` programs of ``tests/program_gen.py``, drawn as its ``programs()`` strategy draws
    them (1-4 blocks, each maybe after a dense layer), by a seeded NumPy generator."""
    import program_gen as pg

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        transform = _pick(rng, _TRANSFORMS)
        blocks: list[Any] = []
        for _ in range(int(rng.integers(1, 5))):
            if rng.integers(2):
                blocks.append(pg.Dense(act=_pick(rng, _ACTS)))
            blocks.append(_sample_block(rng, transform))
        out.append(
            pg.Program(
                blocks=tuple(blocks),
                transform=transform,
                final_dense=bool(rng.integers(2)),
                outer_jit=bool(rng.integers(2)),
                loss=_pick(rng, _LOSSES),
                seed=int(rng.integers(1001)),
            )
        )
    return out


GENERATED = 100


def generated() -> list[Case]:
    import program_gen as pg

    cases = []
    for i, program in enumerate(sampled_programs(GENERATED)):
        fun = pg.transformed(program, lambda f: f)
        cases.append(Case(f"gen/{i:03d}", fun, (abstract(program.inputs(0)),), note=repr(program)))
    return cases


FAMILIES["generated"] = generated


# ------------------------------------------------------------------------------------------
# models: the benchmark models at small sizes
# ------------------------------------------------------------------------------------------

#: Float8 rules for small models: the default choice (weight GEMMs but the first and the
#: last), with the shape threshold lowered to these sizes.
SMALL_FP8 = jmp_rewrite.Fp8Rules(min_dim=16, multiple=16)
MODEL_CONFIGS = (F16, BF16, Config("bfloat16", fp8=SMALL_FP8))


def models() -> list[Case]:
    import _gpu_models
    import _gpu_steps
    import _models
    import optax

    cases = []
    fp8 = Config("bfloat16", fp8=SMALL_FP8)
    init = functools.partial(_models.init_transformer, layers=2, d_model=32, vocab=64)
    params = jax.eval_shape(init)
    tokens = sds(2, 16, dtype=jnp.int32)
    fwd = functools.partial(_models.transformer_logits, heads=4)
    cases.append(Case("bench/transformer-logits", fwd, (params, tokens), MODEL_CONFIGS))
    opt = optax.adam(1e-3)
    step = _models._step_factory(lambda p, s, t: (fwd(p, t), s), opt)()
    args = (params, {}, jax.eval_shape(opt.init, params), tokens, tokens)
    cases.append(Case("bench/transformer-step", step, args, (F16, fp8)))
    params, stats = jax.eval_shape(_models.init_resnet18)
    # The stem and three blocks (the third strided, with a projection shortcut).
    params = {**params, "blocks": params["blocks"][:3], "fc": {"w": sds(128, 10), "b": sds(10)}}
    stats = {**stats, "blocks": stats["blocks"][:3]}
    images, labels = sds(2, 8, 8, 3), sds(2, dtype=jnp.int32)
    cases.append(Case("bench/resnet-logits", _models.resnet18_logits, (params, stats, images)))
    step = _models._step_factory(_models.resnet18_logits, opt)()
    args = (params, stats, jax.eval_shape(opt.init, params), images, labels)
    cases.append(Case("bench/resnet-step", step, args, (F16,)))
    small = {
        "gpt": lambda: _gpu_models.gpt_model(
            layers=2, d_model=64, heads=4, seq=16, vocab=128, batch=2
        ),
        "resnet50": lambda: _gpu_models.resnet50_model(
            batch=2, size=16, stages=(1, 1), width=8, classes=10
        ),
        "vit": lambda: _gpu_models.vit_model(
            batch=2, size=16, patch=8, hidden=32, layers=2, heads=2, mlp_dim=64, classes=10
        ),
    }
    plain, lso = _gpu_steps.Variant("adam"), _gpu_steps.Variant("lso", loss_scale=True)
    steps = {
        "gpt": ((lso, (F16,)), (plain, (fp8,))),
        "resnet50": ((plain, (BF16,)),),
        "vit": ((plain, (F16, fp8)),),
    }
    for name, build in small.items():
        model = build()
        for variant, configs in steps[name]:
            tx, step = _gpu_steps.make_step(model, variant)
            args = _gpu_steps.abstract_args(model, tx)
            cases.append(Case(f"gpu/{name}-{variant.key}-step", step, args, configs))
    return cases


FAMILIES["models"] = models


# ------------------------------------------------------------------------------------------
# libraries: Flax NNX / Linen, Equinox and Haiku models of the tests
# ------------------------------------------------------------------------------------------


def _nnx_step(make: Callable[[], Any], x: Any, y: Any, loss_scaled: bool = False) -> Case:
    """A user's NNX train step over ``make() -> (model, optimizer)``, as a function of the
    split state (``nnx.merge``, ``nnx.value_and_grad``, ``optimizer.update``)."""
    import optax
    from flax import nnx

    abstract_pair = nnx.eval_shape(make)
    graphdef, state = nnx.split(abstract_pair)

    def step(state, x, y):
        model, opt = nnx.merge(graphdef, state, copy=True)

        def loss_fn(model):
            logits = model(x).astype(F32)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return (jmp_rewrite.scale_loss(loss, opt) if loss_scaled else loss), loss

        (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        opt.update(model, grads)
        return nnx.state((model, opt)), loss

    return step, (state, x, y)


def libraries() -> list[Case]:
    import equinox as eqx
    import flax.linen as nn
    import haiku as hk
    import optax
    import test_model_libraries as tml
    import test_real_models as trm
    import user_models as um
    from flax import nnx

    cases = []
    x16, y16 = sds(8, 16), sds(8, dtype=jnp.int32)
    adam = optax.adam(1e-3)
    for pattern, configs in (("remat", (F16,)), ("jit", (BF16,)), ("scan", HALF)):

        def make(pattern=pattern):
            model = um.NnxNet(pattern, rngs=nnx.Rngs(0))
            return model, nnx.Optimizer(model, adam, wrt=nnx.Param)

        step, args = _nnx_step(make, x16, y16)
        cases.append(Case(f"nnx/net-{pattern}-step", step, args, configs))

    def make_bn():
        model = um.NnxBNNet(rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, adam, wrt=nnx.Param)

    step, args = _nnx_step(make_bn, x16, y16)
    cases.append(Case("nnx/bn-step", step, args))
    lso = jmp_rewrite.loss_scale_optimizer(optax.adam(1e-2))

    def make_cnn():
        model = tml.CNN(nnx.Rngs(0))
        return model, nnx.Optimizer(model, lso, wrt=nnx.Param)

    step, args = _nnx_step(make_cnn, sds(4, 8, 8, 1), sds(4, dtype=jnp.int32), loss_scaled=True)
    cases.append(Case("nnx/cnn-dropout-lso-step", step, args, (F16,)))
    embed = nnx.eval_shape(lambda: um.EmbedNet(64, 16, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(embed, nnx.Param, ...)

    def embed_grad(params, rest, tokens, graphdef=graphdef):
        def loss(params):
            logits = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        return jax.grad(loss)(params)

    cases.append(Case("nnx/embed-grad", embed_grad, (params, rest, sds(2, 9, dtype=jnp.int32))))
    for name, make_model, x, y in (
        ("real/nnx_cnn", trm._NnxCNN, sds(2, 8, 8, 3), sds(2, dtype=jnp.int32)),
        (
            "real/nnx_transformer",
            lambda rngs: trm._NnxBlock(16, width=16, heads=2, rngs=rngs),
            sds(2, 8, dtype=jnp.int32),
            sds(2, 8, dtype=jnp.int32),
        ),
    ):
        graphdef, params, state = nnx.split(
            nnx.eval_shape(lambda m=make_model: m(nnx.Rngs(0))), nnx.Param, ...
        )

        def loss_fn(params, state, x, y, graphdef=graphdef, name=name):
            model = nnx.merge(graphdef, params, state, copy=True)
            logits = model(x)
            if name.endswith("cnn"):
                loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            else:
                loss = optax.softmax_cross_entropy(logits, jax.nn.one_hot(y, 16)).mean()
            return loss, nnx.state(model, nnx.Not(nnx.Param))

        step = trm._loss_scaled_step(lso, loss_fn)
        args = (params, state, jax.eval_shape(lso.init, params), x, y)
        cases.append(Case(f"{name}-lso-step", step, args, (F16,)))
    for name, net in (("linen/bn", um.LinenBNNet()), ("linen/mlp", trm._LinenMLP())):
        variables = jax.eval_shape(functools.partial(net.init, train=False), jax.random.key(0), x16)
        params, state = variables["params"], {"batch_stats": variables["batch_stats"]}

        def linen_step(params, state, opt_state, x, y, net=net):
            def loss_fn(params):
                logits, new = net.apply(
                    {"params": params, **state}, x, train=True, mutable=["batch_stats"]
                )
                logp = jax.nn.log_softmax(logits)
                return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1)), new

            (loss, new), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)

            @jmp_rewrite.float32_region
            def update(grads, opt_state, params):
                updates, opt_state = adam.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state

            return (*update(grads, opt_state, params), new, loss)

        args = (params, state, jax.eval_shape(adam.init, params), x16, y16)
        cases.append(Case(f"{name}-step", linen_step, args))

    def resnet(x, train):  # ResNet18's blocks, one per group, narrower
        net = hk.nets.ResNet(
            blocks_per_group=(1, 1, 1, 1),
            num_classes=10,
            bottleneck=False,
            channels_per_group=(8, 16, 32, 64),
            use_projection=(True, True, True, True),
        )
        return net(x, is_training=train)

    net = hk.without_apply_rng(hk.transform_with_state(resnet))
    images = sds(2, 16, 16, 3)
    params, state = jax.eval_shape(
        functools.partial(net.init, train=True), jax.random.key(0), images
    )
    apply = functools.partial(net.apply, train=True)
    cases.append(Case("haiku/resnet-train-forward", apply, (params, state, images), (F16,)))
    key = jax.eval_shape(lambda: jax.random.key(5))
    is_leaf = lambda v: isinstance(v, (jax.Array, jax.ShapeDtypeStruct))  # noqa: E731
    for kind, (cls, x) in tml.eqx_models().items():
        model = eqx.filter_eval_shape(cls, jax.random.key(0))
        params, static = eqx.partition(model, is_leaf)
        opt_state = jax.eval_shape(lso.init, params)
        make_step = tml.eqx_step(lso)

        def eqx_step(params, opt_state, x, y, key, static=static, make_step=make_step):
            model, opt_state, loss = make_step(eqx.combine(params, static), opt_state, x, y, key)
            return eqx.filter(model, is_leaf), opt_state, loss

        args = (params, opt_state, abstract(x), sds(x.shape[0], dtype=jnp.int32), key)
        configs = HALF if kind == "attention" else (F16,)
        cases.append(Case(f"equinox/{kind}-lso-step", eqx_step, args, configs))
    del nn
    return cases


FAMILIES["libraries"] = libraries


# ------------------------------------------------------------------------------------------
# rules: the families, pinned whole
# ------------------------------------------------------------------------------------------


def rules() -> list[Case]:
    import program_gen as pg
    import test_explain_oracles as teo
    import test_rule_families as trf

    X, W, V = sds(8, 16), sds(16, 16), sds(16, 32)
    cases: list[Case] = []
    for param in trf.PRECISIONS:
        precision = param.values[0]
        fun = trf._with_precision(precision)
        cases.append(Case(f"precision/{param.id}", fun, (X, W, W), (F16,)))
    flag = {
        "traced": lambda x: jnp.sum(x) > -1e9,
        "true": lambda x: True,
        "false": lambda x: False,
    }
    for name, init in flag.items():
        cases.append(Case(f"while/flag-carry-{name}", trf._flag_loop(init), (X, W)))
    key = jax.eval_shape(lambda: jax.random.key(0))
    raw = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    for stop in (3, 0):
        for kind, k in (("typed", key), ("raw", raw)):
            cases.append(Case(f"while/key-carry-{kind}-{stop}", trf._key_loop(stop), (X, W, k)))
    layers = (sds(32, 32), sds(32, 32), sds(4, 32, 32))
    small = dict(min_dim=16, multiple=16)
    fp8 = (
        Config("bfloat16", fp8=jmp_rewrite.Fp8Rules(**small), tag="default"),
        Config(
            "bfloat16",
            fp8=jmp_rewrite.Fp8Rules(include=("blk*",), exclude=("blk*",), **small),
            tag="include-and-exclude",
        ),
        Config(
            "bfloat16",
            fp8=jmp_rewrite.Fp8Rules(keep_first=False, keep_last=False, **small),
            tag="keep-none",
        ),
    )
    cases.append(Case("fp8/scan-over-layers", trf._layers, layers, fp8))
    grad = jax.grad(lambda *a: jnp.sum(trf._layers(*a)), argnums=(1, 2))
    cases.append(Case("fp8/scan-over-layers-grad", grad, layers, fp8[:1]))
    nested = lambda w, v, w2, x: teo._nested(w, v @ w2, x)  # noqa: E731
    args = (W, V, sds(32, 16), X)
    cases.append(Case("loops/scan-in-scan", nested, args))
    grad = jax.grad(lambda *a: jnp.sum(nested(*a)), argnums=(0, 1, 2))
    cases.append(Case("loops/scan-in-scan-grad", grad, args, (BF16,)))
    for pad, stride, groups in (("SAME", 1, 1), ("VALID", 2, 4), (((2, 1), (0, 3)), 2, 1)):

        def conv(x, k, pad=pad, stride=stride, groups=groups):
            y = lax.conv_general_dilated(
                x,
                k,
                (stride, stride),
                pad,
                dimension_numbers=("NHWC", "HWIO", "NHWC"),
                feature_group_count=groups,
            )
            return jnp.sum(jnp.tanh(y) ** 2)

        name = f"conv/{pad if isinstance(pad, str) else 'explicit'}-s{stride}-g{groups}-grad"
        fun = jax.grad(conv, argnums=(0, 1))
        cases.append(Case(name, fun, (sds(2, 9, 8, 8), sds(3, 3, 8 // groups, 8))))
    # while conditions with constants: a traced bound, a concrete one closed over
    bound = jnp.asarray(3, jnp.int32)

    def traced_bound(x, w):
        n = (jnp.sum(x) > 1e9).astype(jnp.int32) + 3
        return lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))

    def closed_bound(x, w):
        return lax.while_loop(
            lambda c: c[0] < bound, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x)
        )

    for stop in (0, 3):  # a bound made in the function: a literal operand of the condition

        def made_bound(x, w, stop=stop):
            n = jnp.int32(stop)
            body = lambda c: (c[0] + 1, jnp.tanh(c[1] @ w))  # noqa: E731
            return lax.while_loop(lambda c: c[0] < n, body, (0, x))

        cases.append(Case(f"while/literal-bound-{stop}", made_bound, (X, W)))
    cases.append(Case("while/traced-bound", traced_bound, (X, W)))
    cases.append(Case("while/closed-over-bound", closed_bound, (X, W)))
    # powers released or not (release_saturated_powers): into tanh (GELU), a sigmoid, an erf
    # and a scaled sum; into an exp (no limit: stays deny); read twice (stays deny)
    into = {
        "tanh-gelu": lambda h: jnp.tanh(0.79 * (h + 0.044715 * h**3)),
        "logistic": lambda h: jax.nn.sigmoid(2.0 * h**3 - 1.0),
        "erf": lambda h: lax.erf(h**3),
        "exp": lambda h: jnp.exp(0.5 * h**3),
        "exp-of-sum": lambda h: jnp.exp(h**3 + 1.0),
        "shared": lambda h: jnp.tanh(h**3) + h**3,
    }
    for name, act in into.items():
        fun = lambda x, w, act=act: act(x @ w) @ w  # noqa: E731
        cases.append(Case(f"power/into-{name}", fun, (X, W)))
    for i, program in enumerate(sampled_wider_programs(24)):
        fun = pg.transformed(program, lambda f: f)
        args = (abstract(program.inputs(0)),)
        cases.append(Case(f"gen-wide/{i:02d}", fun, args, note=repr(program)))
    return cases


# Issue 29's block kinds of the generator, a copy of their vocabulary (see _ACTS above).
_CONDITIONS = ("counter", "flag", "not_flag", "counter_and_float", "traced_bound", "int_carry")
_EXTRAS = ("none", "key", "raw_key", "int", "bool")
_PRECISIONS = ("default", "high", "highest", "high_highest", "tf32", "f32_algorithm")
_PRECISIONS += ("bf16_algorithm", "bf16x3_algorithm")


def sampled_wider_programs(n: int, seed: int = 2929) -> list[Any]:
    """``n`` programs of one or two of issue 29's blocks (``Loop``, ``Precise``), each maybe
    after a dense layer, by a seeded NumPy generator."""
    import program_gen as pg

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        transform = _pick(rng, _TRANSFORMS)
        blocks: list[Any] = []
        for _ in range(int(rng.integers(1, 3))):
            if rng.integers(2):
                blocks.append(pg.Dense(act=_pick(rng, _ACTS)))
            wrappers = tuple(_pick(rng, _WRAPPERS) for _ in range(int(rng.integers(2))))
            if transform.startswith("grad") or rng.integers(2):
                op = _pick(rng, ("matmul", "conv"))
                blocks.append(
                    pg.Precise(_pick(rng, _PRECISIONS), op, int(rng.integers(3)), wrappers)
                )
            else:
                cond, extra = _pick(rng, _CONDITIONS), _pick(rng, _EXTRAS)
                trips, traced = _pick(rng, (3, 0, 1)), bool(rng.integers(2))
                blocks.append(pg.Loop(cond, traced, trips, extra, int(rng.integers(3)), wrappers))
        out.append(
            pg.Program(
                tuple(blocks), transform, bool(rng.integers(2)), seed=int(rng.integers(1001))
            )
        )
    return out


FAMILIES["rules"] = rules


# ------------------------------------------------------------------------------------------
# attention: fuse_attention=True, the spellings fused and those left (tests/golden_attention.py)
# ------------------------------------------------------------------------------------------

import golden_attention  # noqa: E402

FAMILIES["attention"] = golden_attention.attention
