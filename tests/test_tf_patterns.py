"""The painting agrees with TensorFlow's ``auto_mixed_precision`` on TF's own test patterns.

Every case comes from ``/work/shared/reference/tf_amp_algorithm.md`` (the reference):

* §4.1 ``AutoMixedPrecisionTest`` (``auto_mixed_precision_test.cc``): T1-T5, T10-T12, T18,
  T19-T31, plus our documented behaviour for T6 and a ``float32_region`` analogue of T7;
* §4.2 ``AutoMixedPrecisionMklTest`` (bfloat16): M1, M2, M4, M5; ``SimulateGpu`` S1;
* §4.3 the Python v1-loop tests ``test_propagation_through_simple_loop_1..8``, built with
  ``jax.lax.while_loop`` and ``jax.lax.fori_loop`` (static bounds: a ``scan``). A loop carry
  is one *clear* node (``<carry>``): TF's Enter/Merge/Switch/NextIteration/Exit collapsed, so
  TF's recurrent colour match holds by construction (see ``jmp_rewrite/_src/trace/graph.py``);
* §4.4 the extra probes A1-X, in three columns: float16 TF 2.21 (``infer_follows_allow=True``,
  the default), float16 TF 2.19 (``infer_follows_allow=False``) and bfloat16;
* §1.8 the level/environment table for ``Exp->MatMul->Relu->Tanh->Rsqrt->MatMul->Sum``.

TF op -> JAX (reference §3): MatMul ``x @ w`` (``dot_general``), Relu ``jax.nn.relu`` or
``jnp.maximum(x, 0)`` (key ``max``), Exp/Log/Sqrt/Tanh ``jnp.*``, Sigmoid ``jax.nn.sigmoid``
(``logistic``), Sum/Mean ``jnp.sum``/``jnp.mean`` (``reduce_sum``), Pow ``x ** 2.5``
(``pow``) or ``x ** 3`` (``integer_pow``), Square ``jnp.square``/``x ** 2`` (key
``square``), Rsqrt ``jax.lax.rsqrt``, BiasAdd ``+ b``, Cast ``astype``. TF's unlisted
``SparseMatMul`` stand-in is ``jnp.sin``. LogSoftmax/Softplus/Elu are the named jit units
``jit:log_softmax`` etc. (one infer node each, like TF's fused ops). Softmax is decomposed
into primitives in JAX 0.10.2 (documented difference: it paints like TF's decomposed probe A1).

Colours: ``allow`` (half precision), ``deny`` (painted deny by pass 2) and ``float32``
(never painted). TF's "f32" is one of the last two; each test states which, by TF's passes.

Cast counts are the ``convert_element_type`` equations the rewrite *adds* (rewritten program
minus original, sub-jaxprs included), like TF's "+N casts". Top-level inputs play TF's
Const/Placeholder: one cast after each at its first half-precision use. Outputs are cast back
to their original dtype (TF keeps fetched nodes float32 instead; see T6).

Not covered, because they have no JAX analogue:

* T6 PreserveFetches as TF does it: a jaxpr output is like TF's ``Identity`` fetch node, its
  producer is never preserved; the test below checks our documented behaviour instead;
* T7 PreserveCPUNodes: jaxprs have no per-node device placement (``test_t7_analogue`` uses a
  ``float32_region``, our analogue of an unprocessable node, instead);
* T8 PreserveIdentityAfterVariable: JAX has no TF1 ref variables; parameters are inputs;
* T9 FusedBatchNorm: the V1->V2 op rename (``U=float``) has no JAX counterpart; JAX batch
  norm is ``reduce_sum``/``sub``/``mul``/``rsqrt`` primitives;
* T13-T17 and M3 (TensorList clusters, ``TensorListThroughFunction``): no TensorList ops;
* C1/C2 (CPU fp16 *emulation* mode, casts around every allow op): no emulation mode;
* S1's GPU variants (``SIMULATE_GPU``, nodes pinned to CPU): only the no-GPU case is mirrored;
* probe X with the GraphDef reversed: a jaxpr is always in topological order.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_walk import compiled_loop_bodies, lowered_eqns

import jmp_rewrite

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

F16, BF16 = jnp.float16, jnp.bfloat16
A, D, F = "allow", "deny", "float32"
_CODE = {"A": A, "D": D, "F": F}

# Inputs are made with NumPy: no XLA compilation at import time.
_RNG = np.random.default_rng(0)


def _array(*shape: int, scale: float = 0.1) -> jax.Array:
    return jnp.asarray(_RNG.normal(size=shape).astype(np.float32) * scale)


X = jnp.asarray(np.full((32, 32), 1 / 32, np.float32))  # TF's Const 1/32 input
W = _array(32, 32)
W2 = _array(32, 32)
B = _array(32)
EYE = jnp.asarray(np.eye(32, dtype=np.float32))
LABELS = jnp.asarray(np.eye(32, dtype=np.float32)[np.arange(32) % 8])


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No JMP_REWRITE_* variable from the caller's environment may change the lists."""
    for name in list(os.environ):
        if name.startswith("JMP_REWRITE_"):
            monkeypatch.delenv(name)


# ------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------


def relu(v: Any) -> Any:
    """TF Relu as one ``max`` primitive. ``jax.nn.relu`` is a ``custom_jvp_call`` around the
    same ``max`` (same key, same colour); it is used in T3 and T5 only, as tracing custom
    derivatives is slow under the suite's ``JAX_CHECK_TRACER_LEAKS=1``."""
    return jnp.maximum(v, 0.0)


def paint(fun: Callable[..., Any], *args: Any, dtype: Any = F16, **kw: Any):
    return jmp_rewrite.paint(fun, *args, dtype=dtype, **kw)


def table(result: Any) -> list[tuple[str, str]]:
    """``(key, colour)`` of every vertex computing on float32 values, in program order.

    Left out: the equations inside a named jit unit (``jit:log_softmax``...: the unit is one
    node, like TF's fused op), integer/bool-only equations (loop counters), and the
    ``<const>`` vertices through which loop-invariant operands enter a loop (TF's ``Enter``
    of a weight read inside the loop, which TF's tests do not check either).
    """
    out, unit = [], None
    for e in result:
        if unit is not None and e.path.startswith(unit + "/"):
            continue
        unit = e.path if e.key.startswith("jit:") else None
        if e.float32 and e.key != "<const>":
            out.append((e.key, e.colour))
    return out


def rows(*spec: str) -> list[tuple[str, str]]:
    """``rows("dot_general:A", "exp:D")`` -> ``[("dot_general", "allow"), ("exp", "deny")]``."""
    out = []
    for item in spec:
        key, _, code = item.rpartition(":")
        out.append((key, _CODE[code]))
    return out


def _sub_jaxprs(eqn: Any) -> Iterator[Any]:
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(item, "eqns"):
                yield item
            elif hasattr(item, "jaxpr"):
                yield item.jaxpr


def count_casts(jaxpr: Any) -> int:
    """``convert_element_type`` equations in ``jaxpr`` and all its sub-jaxprs."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "convert_element_type"
        n += sum(count_casts(sub) for sub in _sub_jaxprs(eqn))
    return n


def signature(jaxpr: Any) -> list[tuple[str, tuple[str, ...]]]:
    """Every equation's primitive and input/output dtypes, sub-jaxprs included, in order."""
    out = []
    for eqn in jaxpr.eqns:
        dtypes = tuple(str(v.aval.dtype) for v in [*eqn.invars, *eqn.outvars])
        out.append((eqn.primitive.name, dtypes))
        for sub in _sub_jaxprs(eqn):
            out += signature(sub)
    return out


def emitted(fun: Callable[..., Any], *args: Any, dtype: Any = F16, **kw: Any) -> Any:
    """The closed jaxpr of the rewritten ``fun``."""
    return jax.make_jaxpr(jmp_rewrite.rewrite(fun, dtype=dtype, **kw))(*args)


def added_casts(fun: Callable[..., Any], *args: Any, dtype: Any = F16, **kw: Any) -> int:
    """Casts the rewrite adds (TF's "+N casts"); also checks outputs keep their dtypes."""
    before = jax.make_jaxpr(fun)(*args)
    after = emitted(fun, *args, dtype=dtype, **kw)
    assert [a.dtype for a in after.out_avals] == [a.dtype for a in before.out_avals]
    return count_casts(after.jaxpr) - count_casts(before.jaxpr)


def check(
    fun: Callable[..., Any],
    args: tuple[Any, ...],
    expected: list[tuple[str, str]],
    casts: int | None,
    *,
    dtype: Any = F16,
    **kw: Any,
) -> Any:
    result = paint(fun, *args, dtype=dtype, **kw)
    assert table(result) == expected, f"\n{result}"
    if casts is not None:
        assert added_casts(fun, *args, dtype=dtype, **kw) == casts
    return result


# ------------------------------------------------------------------------------------------
# §4.1 AutoMixedPrecisionTest
# ------------------------------------------------------------------------------------------


def test_t1_noop_without_allowlist_op():
    def t1(x):  # Exp(deny1) -> Relu(clr1) -> Sqrt(infer1) -> Relu(clr2)
        return relu(jnp.sqrt(relu(jnp.exp(x))))

    result = check(t1, (X,), rows("exp:F", "max:F", "sqrt:F", "max:F"), casts=0)
    assert not result.changed  # TF: "No allowlist ops found, nothing to do"
    assert signature(emitted(t1, X)) == signature(jax.make_jaxpr(t1)(X))


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["T2-fp16", "M1-bf16"])
def test_t2_m1_already_half(dtype):
    def t2(x):
        cst1 = x.astype(dtype)  # Cast f32 -> half
        clr1 = relu(cst1 @ cst1)  # allow1 is already half
        cst2 = clr1.astype(jnp.float32)  # Cast half -> f32
        return relu(cst2)

    result = paint(t2, X, dtype=dtype)
    # Nothing float32 is painted: the half ops are not float32, the f32 tail meets no allow.
    assert [(e.key, e.colour) for e in result] == rows(
        "convert_element_type:F", "dot_general:F", "max:F", "convert_element_type:F", "max:F"
    ), f"\n{result}"
    assert not result.changed
    assert added_casts(t2, X, dtype=dtype) == 0


def _make_t3(relu_fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def t3(x):
        deny1 = jnp.exp(x)
        clr1 = relu_fn(deny1)
        infer1 = jnp.sqrt(clr1)
        clr2 = relu_fn(infer1)
        allow1 = clr2 @ clr2
        clr3 = relu_fn(allow1)
        infer2 = jnp.log(clr3)
        clr4 = relu_fn(infer2)
        deny2 = jnp.sin(clr4)  # TF: SparseMatMul, unlisted
        return relu_fn(deny2)  # clr5

    return t3


_t3 = _make_t3(relu)


_T3_ROWS = rows(
    "exp:D",  # deny1
    "max:D",  # clr1: deny (clear, upstream of infer1)
    "sqrt:D",  # infer1: deny
    "max:A",  # clr2: pass 5
    "dot_general:A",  # allow1
    "max:A",  # clr3: pass 5
    "log:F",  # infer2: pass 4 sees clr3 still unpainted
    "max:F",  # clr4
    "sin:F",  # deny2 (unlisted)
    "max:F",  # clr5
)


@pytest.mark.parametrize(
    "dtype, relu_fn",
    [
        pytest.param(F16, relu, id="T3-fp16"),
        pytest.param(F16, jax.nn.relu, id="T3-fp16-jax.nn.relu"),
        pytest.param(BF16, relu, id="M2-bf16"),
    ],
)
def test_t3_m2_simple(dtype, relu_fn):
    # +2 casts: infer1 -> clr2 to half, clr3 -> infer2 to float32.
    check(_make_t3(relu_fn), (X,), _T3_ROWS, casts=2, dtype=dtype)


def test_t4_no_infer_op_treat_infer_as_deny():
    def t4(x):
        clr1 = relu(jnp.exp(x))
        clr2 = relu(jnp.sqrt(clr1))
        clr3 = relu(clr2 @ clr2)
        clr4 = relu(jnp.log(clr3))
        return jnp.log(clr4 @ clr4)  # infer3 -> fetch

    expected = rows(
        "exp:D",
        "max:D",  # clr1
        "sqrt:D",  # infer1, now deny
        "max:A",  # clr2
        "dot_general:A",  # allow1
        "max:A",  # clr3
        "log:D",  # infer2, now deny
        "max:A",  # clr4: leads only to allow2, so not in U; deny stops before it
        "dot_general:A",  # allow2
        "log:D",  # infer3
    )
    # +4: sqrt -> clr2, clr3 -> log, log -> clr4, allow2 -> log.
    check(t4, (X,), expected, casts=4, level="TREAT_INFER_AS_DENY")


def test_t4_level_from_environment(monkeypatch):
    monkeypatch.setenv("JMP_REWRITE_LEVEL", "TREAT_INFER_AS_DENY")

    def f(x):
        return relu(jnp.log(relu(x @ x)))

    assert paint(f, X).colours("log") == [D]


@pytest.mark.parametrize(
    "relu_fn",
    [
        pytest.param(relu, id="jnp.maximum"),
        pytest.param(jax.nn.relu, id="jax.nn.relu"),
    ],
)
def test_t5_bidirectional_clear_chain(relu_fn):
    def t5(x):
        clr1 = relu_fn(x)
        clr2 = relu_fn(x)
        allow1 = clr1 @ clr1
        # TF clr3 = ShapeN(clr1, clr2): a clear op joining both, with a non-float output.
        clr3 = clr1 > clr2
        clr4 = relu_fn(clr2)
        return allow1, clr4, clr3

    # Clear propagation reaches clr2 and clr4 *through* the comparison, in both directions.
    # Documented difference (paint.keep_float32_reads_unrounded): clr4 is an output and
    # clr2 -> clr4 only move the float32 input, so they stay float32 (TF: half, and clr4
    # cast back to float32 at the fetch); the comparison reads clr2 cast after it instead.
    expected = rows("max:A", "max:F", "dot_general:A", "gt:A", "max:F")
    check(t5, (X,), expected, casts=None)


@pytest.mark.parametrize(
    "relu_fn",
    [
        pytest.param(relu, id="jnp.maximum"),
        # Two jax.nn.relu calls read x: the call sites pass x in the dtype their bodies
        # want, so it is cast once, outside (TF: one Cast per source port).
        pytest.param(jax.nn.relu, id="jax.nn.relu"),
    ],
)
def test_t5_casts(relu_fn):
    def t5(x):
        clr1, clr2 = relu_fn(x), relu_fn(x)
        return clr1 @ clr1, relu_fn(clr2), clr1 > clr2

    # TF +3: one shared cast after the input, allow1 and clr4 back to float32 at the fetch.
    assert added_casts(t5, X) == 3


def _t6(x):
    allow1 = x @ x
    clr1 = relu(allow1)
    infer1 = jnp.sqrt(clr1)
    deny1 = jnp.exp(infer1)
    clr2 = relu(deny1)
    allow2 = clr2 @ clr2
    clr3 = relu(allow2)
    deny2 = jnp.exp(clr3)
    clr4 = relu(deny2)
    return allow1, clr2, clr3, clr4  # TF fetches allow1, clr2, clr3 (and clr4 is the sink)


def test_t6_outputs_are_not_preserved_documented_difference():
    # OUR documented behaviour, not TF's: TF preserves fetched nodes (allow1, clr2, clr3 stay
    # float32). A jaxpr output is like TF's Identity fetch node, so the producers are painted
    # as if they were not fetched and the outputs are cast back to float32.
    expected = rows(
        "dot_general:A",  # allow1 (TF: f32, preserved)
        "max:A",  # clr1 (TF: f32, next to a preserved node)
        "sqrt:F",  # infer1: not between allows; pass 4 sees clr1 unpainted
        "exp:D",
        "max:F",  # clr2 (TF: f32, preserved): not in U, so deny stops before it; an
        # output moving the float32 exp, so float32 (paint.keep_float32_reads_unrounded)
        "dot_general:A",  # allow2
        "max:A",  # clr3 (TF: f32, preserved)
        "exp:D",
        "max:F",  # clr4
    )
    check(_t6, (X,), expected, casts=None)


def test_t6_casts():
    # x -> half, clr1 -> sqrt, clr2 -> half for allow2, clr3 -> exp (shared with clr3's
    # output cast), allow1 back to float32 at the output (clr2 is float32: see above).
    assert added_casts(_t6, X) == 5


@pytest.mark.parametrize("version", [True, False], ids=["tf2.21", "tf2.19"])
def test_t7_analogue_float32_region(version):
    # T7 pins allow2 to the CPU, so TF does not process it (ShouldProcess is false). The JAX
    # analogue of an unprocessable node is a float32_region; device placement itself has none.
    @jmp_rewrite.float32_region
    def allow2_on_cpu(v):
        return v @ v

    def t7(x):
        allow1 = relu(x) @ x
        infer1 = jnp.tanh(allow1)
        return relu(allow2_on_cpu(infer1))

    result = paint(t7, X, infer_follows_allow=version)
    infer1 = A if version else F  # TF 2.19: f32; TF >= 2.20: pass 4 makes it half
    assert table(result) == [
        ("max", A),  # clr1
        ("dot_general", A),  # allow1
        ("tanh", infer1),
        ("dot_general", F),  # allow2, not processed
        ("max", F),  # clr2
    ], f"\n{result}"
    (region_dot,) = [e for e in result if e.in_float32_region]
    assert region_dot.primitive == "dot_general" and region_dot.colour == F
    # +2 either way: the float32 cast moves from after allow1 to after infer1 (x is one input,
    # cast once before clr1 and allow1).
    assert added_casts(t7, X, infer_follows_allow=version) == 2


def test_t10_repeated_and_list_type_attrs():
    def t10(x):
        allow1 = x @ x
        # TF IdentityN (list(type) attribute): one clear equation with three outputs.
        a, b, c = jax.lax.optimization_barrier((allow1, allow1, allow1))
        infer1 = a + b + c  # TF AddN: a chain of add
        return infer1 @ infer1

    expected = rows("dot_general:A", "optimization_barrier:A", "add:A", "add:A", "dot_general:A")
    check(t10, (X,), expected, casts=2)  # +2: the input and the fetch


def test_t11_existing_cast():
    mask = jnp.asarray(_RNG.random((32, 32)) < 0.5)

    def t11(m):
        cst1 = m.astype(jnp.float32)  # Cast bool -> float
        return cst1 @ cst1

    # TF: cst1 becomes Cast(bool -> half) in place; +1 cast (the fetch, back to float32).
    check(t11, (mask,), rows("convert_element_type:A", "dot_general:A"), casts=1)
    first = emitted(t11, mask).eqns[0]
    assert first.primitive.name == "convert_element_type"
    assert first.invars[0].aval.dtype == jnp.bool_
    assert first.params["new_dtype"] == jnp.float16


def _loop(kind: str, body: Callable[[Any], Any], init: Any) -> Any:
    """A four-trip loop with one float carry (plus the counter)."""
    if kind == "while_loop":
        state = jax.lax.while_loop(
            lambda ic: ic[0] < 4, lambda ic: (ic[0] + 1, body(ic[1])), (0, init)
        )
        return state[1]
    return jax.lax.fori_loop(0, 4, lambda i, c: body(c), init)  # static bounds: a scan


LOOP_KINDS = ["while_loop", "fori_loop"]


@pytest.mark.parametrize("kind", LOOP_KINDS)
def test_t12_recurrent_edge_colour_mismatch(kind):
    def t12(x):
        def body(c):
            infer1 = jnp.sqrt(c)
            return infer1 @ infer1  # allow1 -> NextIteration

        return _loop(kind, body, jnp.exp(x))  # deny1 -> Enter -> Merge; Exit -> fetch

    # TF: Merge is deny (on the clear path Exp -> Sqrt), so NextIteration and the second
    # Merge are forced float32; only allow1 is half. Our carry is that Merge.
    expected = rows("exp:D", "<carry>:D", "sqrt:D", "dot_general:A")
    # +2: infer1 -> allow1 to half, allow1 -> NextIteration to float32 (both in the body).
    check(t12, (X,), expected, casts=2)


@pytest.mark.parametrize(
    "batch_matmul",
    [
        pytest.param(jnp.matmul, id="matmul"),
        pytest.param(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), id="einsum"),
    ],
)
def test_t18_batch_matmul(batch_matmul):
    x = jnp.asarray(np.full((8, 32, 32), 1 / 32, np.float32))
    result = paint(lambda v: batch_matmul(v, v), x)
    assert result.colours("dot_general") == [A], f"\n{result}"
    assert all(e.colour == A for e in result if e.float32), f"\n{result}"
    assert added_casts(lambda v: batch_matmul(v, v), x) == 2  # the input and the fetch


# T19-T31: Placeholder -> MatMul(allow1, eye) -> OP (infer1) -> MatMul(allow2, eye) -> fetch.
UNARY_INFER = [
    pytest.param(jax.nn.elu, "jit:elu", id="T19-Elu"),
    pytest.param(jax.lax.erf, "erf", id="T20-Erf"),
    pytest.param(jax.lax.erfc, "erfc", id="T21-Erfc"),
    pytest.param(lambda v: 1.0 / v, "div", id="T22-Inv"),
    pytest.param(jnp.log, "log", id="T23-Log"),
    pytest.param(jnp.log1p, "log1p", id="T24-Log1p"),
    pytest.param(jax.nn.log_softmax, "jit:log_softmax", id="T25-LogSoftmax"),
    pytest.param(jnp.reciprocal, "reciprocal", id="T26-Reciprocal"),
    pytest.param(jax.nn.sigmoid, "logistic", id="T27-Sigmoid"),
    # T28 Softmax: see test_t28_softmax_decomposed_documented_difference.
    pytest.param(jax.nn.softplus, "jit:softplus", id="T29-Softplus"),
    pytest.param(jnp.sqrt, "sqrt", id="T30-Sqrt"),
    pytest.param(jnp.tanh, "tanh", id="T31-Tanh"),
]


def _between(op: Callable[[Any], Any]) -> Callable[..., Any]:
    def f(x, eye):
        return op(x @ eye) @ eye

    return f


@pytest.mark.parametrize("version", [True, False], ids=["tf2.21", "tf2.19"])
@pytest.mark.parametrize("op, key", UNARY_INFER)
def test_t19_t31_unary_infer_between_allows(op, key, version):
    # Pass 3 paints an infer op between two allow ops in every TF version. Named units are
    # painted whole, like TF's fused kernel, except their deny pieces (exp, expm1,
    # reduce_sum), which accumulate in float32 as TF's fused half kernels do.
    result = paint(_between(op), X, EYE, infer_follows_allow=version)
    assert table(result) == [("dot_general", A), (key, A), ("dot_general", A)], f"\n{result}"
    assert all(e.colour == A for e in result if e.float32 and e.list != D), f"\n{result}"
    assert all(e.colour != A for e in result if e.list == D), f"\n{result}"


@pytest.mark.parametrize("op, key", UNARY_INFER)
def test_t19_t31_casts(op, key):
    # The input, the eye (one cast shared by both matmuls) and the fetch. softplus passes the
    # literal 0.0 into its inner custom_jvp_call: converted in place at the call site. A unit
    # with a deny piece (elu's expm1, log_softmax's exp + reduce_sum, softplus's exp) keeps
    # it float32 inside the half unit: one cast into it and one out, as a fused half kernel
    # accumulates in float32.
    inner = 2 if key in ("jit:elu", "jit:log_softmax", "jit:softplus") else 0
    assert added_casts(_between(op), X, EYE) == 3 + inner


def test_t28_softmax_decomposed_documented_difference():
    # OUR documented behaviour: jax.nn.softmax is not a named unit in JAX 0.10.2, so it is
    # painted primitive by primitive, exactly like TF's decomposed softmax (probe A1): exp
    # and the sum are deny and the deny flows into the div. TF's fused Softmax is all half.
    result = paint(_between(jax.nn.softmax), X, EYE)
    assert table(result) == _SOFTMAX_BETWEEN_221, f"\n{result}"


# ------------------------------------------------------------------------------------------
# §4.2 AutoMixedPrecisionMklTest (bfloat16) and SimulateGpu
# ------------------------------------------------------------------------------------------


def _conv_bias_relu(x, w, b):
    y = jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return relu(y + b)  # BiasAdd (broadcast_in_dim + add) -> Relu


def test_m4_infer_follows_upstream_allow():
    x, w, b = _array(2, 8, 8, 4, scale=1.0), _array(3, 3, 4, 8), _array(8)
    expected = rows("conv_general_dilated:A", "broadcast_in_dim:A", "add:A", "max:A")
    # infer by pass 4, the clear ops by pass 5. +4: three inputs to bf16, one back to f32.
    check(_conv_bias_relu, (x, w, b), expected, casts=4, dtype=BF16)


def test_m5_infer_follows_upstream_deny():
    def m5(x, y, b):
        return relu(x**y + b)  # Pow(deny) -> BiasAdd(infer) -> Relu(clr)

    result = check(
        m5,
        (X, W, B),
        rows("pow:F", "broadcast_in_dim:F", "add:F", "max:F"),
        casts=0,
        dtype=BF16,
    )
    assert not result.changed  # no allowlist op


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the no-GPU case of S1")
def test_s1_no_gpu_no_rewrite():
    # SimulateGpu.Simple_NoGpu: without a suitable GPU nothing changes. dtype=None picks the
    # platform's dtype like TF, and a CPU has none. (An explicit dtype is TF's SIMULATE_GPU.)
    # The CPU's program: dtype=None decides where the program is lowered (issue 37.3).
    assert jmp_rewrite.platform_dtype() is None
    with pytest.warns(jmp_rewrite.RewriteOffWarning, match="default device is a cpu"):
        rewritten = jax.make_jaxpr(jmp_rewrite.rewrite(_t3))(X)
    cpu = [
        (e.primitive.name, tuple(str(v.aval.dtype) for v in [*e.invars, *e.outvars]))
        for e in lowered_eqns(rewritten, "cpu")
    ]
    assert cpu == signature(jax.make_jaxpr(_t3)(X))
    assert table(paint(_t3, X)) == _T3_ROWS


# ------------------------------------------------------------------------------------------
# §4.3 Python v1-loop tests: inp -> while_loop(i < 4) { body } -> out -> identity
# ------------------------------------------------------------------------------------------


def _letter(letter: str, v: Any, w: Any) -> Any:
    kind = letter.lower()
    if kind == "w":  # allow
        return v @ w
    if kind == "g":  # infer
        return v + 0.1
    if kind == "c":  # clear
        return relu(v)
    assert kind == "b"  # deny: Sqrt(Pow(x, 2)); Pow is the deny op, Sqrt the checked node
    return jnp.sqrt(jax.lax.pow(v, 2.0))


# OUR documented behaviour, not TF v1's (issue 14): a loop body that updates its carry from
# itself (loop3's ``v + 0.1``) keeps the carry and the update float32, as state. TF v1 paints
# them half (G between W's across the back edge); TF 2.x's functional While keeps the carry
# float32 at the loop boundary and the body (no allow op) float32, as we do.
_OUR_LOOP_BODIES = {("G", "F")}


def _letter_rows(letters: str, codes: str) -> list[tuple[str, str]]:
    key = {"w": "dot_general", "g": "add", "c": "max", "b": "sqrt"}
    out = []
    for letter, code in zip(letters, codes, strict=True):
        # TF's letters: a capital is expected half precision, so must be painted allow.
        assert letter.isupper() == (code == "A") or (letters, codes) in _OUR_LOOP_BODIES
        if letter.lower() == "b":
            out.append(("pow", D))
        out.append((key[letter.lower()], _CODE[code]))
    return out


# (inp, body, out) as in TF, then our colours (A/D/F) of the same nodes and of the carry.
LOOP_TESTS = [
    pytest.param("W", "C", "C", "A", "A", "A", "A", id="loop1"),
    pytest.param("C", "C", "W", "A", "A", "A", "A", id="loop2"),
    # TF v1: the infer op lies between allows *across* the back edge (pass 3). Ours: the carry
    # is updated from itself (``v + 0.1``): state, float32 with its update (_OUR_LOOP_BODIES).
    pytest.param("W", "G", "W", "A", "F", "A", "F", id="loop3"),
    # The deny from the body's Pow goes round the back edge: the carry (TF's Merge/Switch/
    # NextIteration) is float32, cast at entry and exit (TF's Enter/Exit are half).
    pytest.param("W", "gbg", "W", "A", "DDD", "A", "D", id="loop4"),
    # Deny from the input enters the loop through the clear carry up to the infer g.
    pytest.param("b", "gWC", "c", "D", "DAA", "F", "D", id="loop5"),
    # No deny/infer is reachable from the carry by clear-only paths: Sqrt's deny stops there.
    pytest.param("b", "CWCG", "C", "D", "AAAA", "A", "A", id="loop6"),
    pytest.param("C", "GWCG", "C", "A", "AAAA", "A", "A", id="loop7"),
    pytest.param("C", "CgbgWC", "g", "A", "AFDDAA", "F", "A", id="loop8"),
]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kind", LOOP_KINDS)
@pytest.mark.parametrize("inp, body, out, inp_c, body_c, out_c, carry", LOOP_TESTS)
def test_simple_loop(inp, body, out, inp_c, body_c, out_c, carry, kind, dtype):
    def f(x, w):
        for letter in inp:
            x = _letter(letter, x, w)

        def loop_body(v):
            for letter in body:
                v = _letter(letter, v, w)
            return v

        x = _loop(kind, loop_body, x)
        for letter in out:
            x = _letter(letter, x, w)
        return x

    expected = (
        _letter_rows(inp, inp_c)
        + [("<carry>", _CODE[carry])]
        + _letter_rows(body, body_c)
        + _letter_rows(out, out_c)
    )
    result = paint(f, X, W, dtype=dtype)
    assert table(result) == expected, f"\n{result}"


# ------------------------------------------------------------------------------------------
# §4.4 Extra probes: float16 TF 2.21, float16 TF 2.19 (infer_follows_allow=False), bfloat16
# ------------------------------------------------------------------------------------------

COLUMNS = {
    "fp16-tf2.21": {"dtype": F16},
    "fp16-tf2.19": {"dtype": F16, "infer_follows_allow": False},
    "bf16": {"dtype": BF16},
}


def _a1(x, w):  # decomposed softmax between two matmuls
    mm1 = x @ w
    mx = jnp.max(mm1, axis=-1, keepdims=True)  # Max: reduce_max, broadcast_in_dim
    e = jnp.exp(mm1 - mx)
    s = jnp.sum(e, axis=-1, keepdims=True)  # Sum: reduce_sum, broadcast_in_dim
    return (e / s) @ w


def _a2(x, w):  # jax.nn.softmax between two matmuls (decomposed in JAX 0.10.2)
    return jax.nn.softmax(x @ w) @ w


def _a3(x, w):
    return jax.nn.softmax(x @ w)


_SOFTMAX_HEAD = ["dot_general:A", "reduce_max:A", "max:A", "broadcast_in_dim:A", "stop_gradient:A"]
_SOFTMAX_TAIL = ["exp:D", "reduce_sum:D", "broadcast_in_dim:D", "div:D"]
_SOFTMAX_BETWEEN_221 = rows(*_SOFTMAX_HEAD, "sub:A", *_SOFTMAX_TAIL, "dot_general:A")

_A1_221 = rows(
    "dot_general:A",
    "reduce_max:A",
    "broadcast_in_dim:A",
    "sub:A",  # pass 4 (TF >= 2.20)
    "exp:D",
    "reduce_sum:D",
    "broadcast_in_dim:D",
    "div:D",
    "dot_general:A",
)


def _swap(expected: list[tuple[str, str]], key: str, colour: str) -> list[tuple[str, str]]:
    return [(k, colour if k == key else c) for k, c in expected]


def _all_allow(expected: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(k, A) for k, _ in expected]


def _b4(x, w, w2):
    return x @ w + x @ w2  # mm1, mm2 -> AddV2


def _c(x, w, b):
    return relu(x @ w + b) @ w  # BiasAdd(Const bias) -> Relu -> mm2


def _d(x, w):
    mm1 = x @ w
    return (mm1 - jnp.mean(mm1, axis=-1, keepdims=True)) @ w  # reduce_sum, bcast, div; sub


def _f(x, w16):
    return x.reshape(16, 64).T @ w16  # Const -> Reshape -> Transpose -> mm1


def _g(x, w):
    mm1 = x @ w
    return (mm1 * jnp.sum(mm1, axis=-1, keepdims=True)) @ w


def _h(x, w16):
    return relu(jnp.exp(x).reshape(64, 16)) @ w16


def _m(x, w):
    r = relu(x @ w)
    return r @ w, jnp.exp(r)  # Relu -> {mm2, Exp}


def _n(x, w):
    mm1 = x @ w
    return jnp.where(mm1 > 0, mm1, jnp.zeros_like(mm1)) @ w  # Greater, SelectV2


W16 = W[:16]
_D_FP16 = rows(
    "dot_general:A", "reduce_sum:D", "broadcast_in_dim:D", "div:D", "sub:D", "dot_general:A"
)
_G_FP16 = rows("dot_general:A", "reduce_sum:D", "broadcast_in_dim:D", "mul:D", "dot_general:A")
_S_FP16 = rows("dot_general:A", "square:F", "rsqrt:F", "dot_general:A")


def _same(expected: list[tuple[str, str]], casts: int) -> dict[str, Any]:
    return dict.fromkeys(COLUMNS, (expected, casts))


# probe -> (function, args, {column: (rows, casts)}); a missing column: TF gives none.
PROBES: dict[str, tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = {
    # mm1 h, Max h, Sub h (2.19: f), Exp/Sum/Div f, mm2 h; 5 casts (2.19: 6: mm1 and the
    # max each cast to f32 for the Sub). bf16 as 2.21.
    "A1": (
        _a1,
        (X, W),
        {
            "fp16-tf2.21": (_A1_221, 5),
            "fp16-tf2.19": (_swap(_A1_221, "sub", F), 6),
            "bf16": (_A1_221, 5),
        },
    ),
    # Documented difference: TF's fused Softmax is all half (A2) / half in 2.21 (A3); the
    # decomposed jax.nn.softmax paints like A1. A2-unit/A3-unit are the fused analogue.
    "A2": (
        _a2,
        (X, W),
        {
            "fp16-tf2.21": (_SOFTMAX_BETWEEN_221, 5),
            "fp16-tf2.19": (_swap(_SOFTMAX_BETWEEN_221, "sub", F), 6),
            "bf16": (_SOFTMAX_BETWEEN_221, 5),
        },
    ),
    "A3": (
        _a3,
        (X, W),
        {
            "fp16-tf2.21": (rows(*_SOFTMAX_HEAD, "sub:A", *_SOFTMAX_TAIL), 3),
            "fp16-tf2.19": (rows(*_SOFTMAX_HEAD, "sub:F", *_SOFTMAX_TAIL), 4),
            "bf16": (rows(*_SOFTMAX_HEAD, "sub:A", *_SOFTMAX_TAIL), 3),
        },
    ),
    # jax.nn.log_softmax is one infer unit, like TF's fused Softmax: A2 all half ...
    "A2-unit": (
        lambda x, w: jax.nn.log_softmax(x @ w) @ w,
        (X, W),
        # 3 casts + 2 inside the unit around its float32 exp/reduce_sum
        _same(rows("dot_general:A", "jit:log_softmax:A", "dot_general:A"), 5),
    ),
    # ... and A3 half in 2.21, f32 in 2.19 (cast after mm1 instead of after the unit).
    "A3-unit": (
        lambda x, w: jax.nn.log_softmax(x @ w),
        (X, W),
        {
            "fp16-tf2.21": (rows("dot_general:A", "jit:log_softmax:A"), 5),
            "fp16-tf2.19": (rows("dot_general:A", "jit:log_softmax:F"), 3),
            "bf16": (rows("dot_general:A", "jit:log_softmax:A"), 5),
        },
    ),
    "B": (
        lambda x, w: jnp.tanh(x @ w),
        (X, W),
        {
            "fp16-tf2.21": (rows("dot_general:A", "tanh:A"), 3),
            "fp16-tf2.19": (rows("dot_general:A", "tanh:F"), 3),
            "bf16": (rows("dot_general:A", "tanh:A"), 3),
        },
    ),
    "B2": (
        lambda x, w: jnp.log(x @ w),
        (X, W),
        {
            "fp16-tf2.21": (rows("dot_general:A", "log:A"), 3),
            "fp16-tf2.19": (rows("dot_general:A", "log:F"), 3),
            "bf16": (rows("dot_general:A", "log:A"), 3),
        },
    ),
    # Relu h, Tanh f in every column: pass 4 runs before pass 5 paints the Relu.
    "B3": (
        lambda x, w: jnp.tanh(relu(x @ w)),
        (X, W),
        _same(rows("dot_general:A", "max:A", "tanh:F"), 3),
    ),
    # Casts: x, w, w2 and the fetch; 2.19: both matmuls cast to f32 for the Add instead.
    "B4": (
        _b4,
        (X, W, W2),
        {
            "fp16-tf2.21": (rows("dot_general:A", "dot_general:A", "add:A"), 4),
            "fp16-tf2.19": (rows("dot_general:A", "dot_general:A", "add:F"), 5),
            "bf16": (rows("dot_general:A", "dot_general:A", "add:A"), 4),
        },
    ),
    # All half; the bias is cast: x, w, b and the fetch.
    "C": (
        _c,
        (X, W, B),
        _same(rows("dot_general:A", "broadcast_in_dim:A", "add:A", "max:A", "dot_general:A"), 4),
    ),
    # Mean is deny in fp16 and so are its div/broadcast and the Sub; infer in bf16.
    # fp16 casts: x, w, mm1 -> f32 (one, shared by Mean and Sub), Sub -> half, the fetch.
    "D": (
        _d,
        (X, W),
        {
            "fp16-tf2.21": (_D_FP16, 5),
            "fp16-tf2.19": (_D_FP16, 5),
            # + the half Mean's float32 accumulation: its input cast up, its result down
            "bf16": (_all_allow(_D_FP16), 5),
        },
    ),
    "E": (lambda x, w: jnp.exp(x) @ w, (X, W), _same(rows("exp:D", "dot_general:A"), 3)),
    # The cast sits right after the input; Reshape/Transpose run in half.
    "F": (_f, (X, W16), _same(rows("reshape:A", "transpose:A", "dot_general:A"), 3)),
    # Sum is deny in fp16 and flows into the Mul (infer); bf16: all half.
    "G": (
        _g,
        (X, W),
        {
            "fp16-tf2.21": (_G_FP16, 5),
            "fp16-tf2.19": (_G_FP16, 5),
            # + the half Sum's float32 accumulation: its input cast up, its result down
            "bf16": (_all_allow(_G_FP16), 5),
        },
    ),
    # Deny does not flow into clear ops that lead only to an allow op.
    "H": (_h, (X, W16), _same(rows("exp:D", "reshape:A", "max:A", "dot_general:A"), 3)),
    "I": (
        lambda x, w: (jnp.exp(x) + x) @ w,
        (X, W),
        _same(rows("exp:D", "add:D", "dot_general:A"), 3),
    ),
    "K": (
        lambda x, w: relu(jnp.tanh(x @ w)) @ w,
        (X, W),
        _same(rows("dot_general:A", "tanh:A", "max:A", "dot_general:A"), 3),
    ),
    "L": (
        lambda x, w: jnp.exp(relu(x @ w)),
        (X, W),
        _same(rows("dot_general:A", "max:A", "exp:D"), 3),
    ),
    # Relu h, mm2 h, Exp f; 4 casts: x, w, relu -> exp, mm2 -> fetch.
    "M": (_m, (X, W), _same(rows("dot_general:A", "max:A", "dot_general:A", "exp:D"), 4)),
    # Greater and Select half. TF casts the zeros Const; in JAX the zeros are a broadcast
    # literal, converted in place (no cast equation): x, w and the fetch.
    "N": (
        _n,
        (X, W),
        _same(
            rows("dot_general:A", "gt:A", "broadcast_in_dim:A", "select_n:A", "dot_general:A"), 3
        ),
    ),
    # Square and Rsqrt are unlisted in fp16: they block (x, w, mm1 -> f32, rsqrt -> half,
    # the fetch); infer in bf16.
    "S-square": (
        lambda x, w: jax.lax.rsqrt(jnp.square(x @ w)) @ w,
        (X, W),
        {
            "fp16-tf2.21": (_S_FP16, 5),
            "fp16-tf2.19": (_S_FP16, 5),
            "bf16": (_all_allow(_S_FP16), 3),
        },
    ),
    "S-pow2": (
        lambda x, w: jax.lax.rsqrt((x @ w) ** 2) @ w,
        (X, W),
        {
            "fp16-tf2.21": (_S_FP16, 5),
            "fp16-tf2.19": (_S_FP16, 5),
            "bf16": (_all_allow(_S_FP16), 3),
        },
    ),
    # Pow is deny: x, w, mm1 -> f32, pow -> half, the fetch.
    "T-pow": (
        lambda x, w: ((x @ w) ** 2.5) @ w,
        (X, W),
        _same(rows("dot_general:A", "pow:D", "dot_general:A"), 5),
    ),
    "T-integer_pow": (
        lambda x, w: ((x @ w) ** 3) @ w,
        (X, W),
        {
            **_same(rows("dot_general:A", "integer_pow:D", "dot_general:A"), 5),
            # Documented difference (op_lists.DIFFERENCES_FROM_TF): Pow is infer in bfloat16,
            # which has float32's exponent range; TF keeps it deny (5 casts).
            "bf16": (_all_allow(rows("dot_general:A", "integer_pow:D", "dot_general:A")), 3),
        },
    ),
    # W (while loop): test_probe_w. X: pass 4 paints the chain in one sweep (2.21).
    "X": (
        lambda x, w: jnp.log(jax.nn.sigmoid(jnp.tanh(x @ w))),
        (X, W),
        {
            "fp16-tf2.21": (rows("dot_general:A", "tanh:A", "logistic:A", "log:A"), 3),
            "fp16-tf2.19": (rows("dot_general:A", "tanh:F", "logistic:F", "log:F"), 3),
        },
    ),
}

_PROBE_CASES = [
    pytest.param(name, column, id=f"{name}-{column}")
    for name, (_, _, columns) in PROBES.items()
    for column in COLUMNS
    if column in columns
]


@pytest.mark.parametrize("name, column", _PROBE_CASES)
def test_probe(name, column):
    fun, args, columns = PROBES[name]
    expected, casts = columns[column]
    check(fun, args, expected, casts=casts, **COLUMNS[column])


def test_probe_f_cast_sits_after_the_input():
    # TF: "the cast sits right after the Const": the reshape reads the half copy.
    fun, args, _ = PROBES["F"]
    eqns = emitted(fun, *args).eqns
    assert eqns[0].primitive.name == "convert_element_type"
    assert eqns[0].params["new_dtype"] == jnp.float16
    reshape = next(e for e in eqns if e.primitive.name == "reshape")
    assert reshape.invars[0].aval.dtype == jnp.float16


def _xent(x, w, labels):
    # optax.softmax_cross_entropy's lowering: log_softmax unit, mul, reduce_sum, neg.
    return -jnp.sum(labels * jax.nn.log_softmax(x @ w), axis=-1)


@pytest.mark.parametrize("column", ["fp16-tf2.21", "fp16-tf2.19"])
def test_probe_p_cross_entropy_fp16(column):
    # TF's fused SoftmaxCrossEntropyWithLogits is deny. JAX has no fused op: as the reference
    # says (§3.1), the deny reduce_sum keeps the loss's accumulation float32; the log-softmax
    # and the mul before it follow TF's passes for infer ops (pass 4 in 2.21 paints them).
    follow = A if column == "fp16-tf2.21" else F
    expected = [
        ("dot_general", A),
        ("jit:log_softmax", follow),
        ("mul", follow),
        ("reduce_sum", D),
        ("neg", F),
    ]
    check(_xent, (X, W, LABELS), expected, casts=None, **COLUMNS[column])


def test_probe_p_cross_entropy_bf16_documented_difference():
    # Documented difference (README, "How the lists differ"): JAX has no fused
    # SoftmaxCrossEntropyWithLogits (deny in TF's bf16 list too). Decomposed, its pieces are
    # log_softmax (infer), mul (infer), reduce_sum (infer in bf16) and neg (clear), so in
    # bfloat16 the whole loss follows the logits into bf16, as TF's bf16 rewrite does with a
    # decomposed loss. Moving reduce_sum to deny restores TF's fused-op result.
    result = paint(_xent, X, W, LABELS, dtype=BF16)
    assert [c for k, c in table(result) if k == "reduce_sum"] == [A], f"\n{result}"
    lists = jmp_rewrite.default_lists(BF16).move("reduce_sum", to="deny")
    result = paint(_xent, X, W, LABELS, dtype=BF16, lists=lists)
    assert [c for k, c in table(result) if k == "reduce_sum"] == [D], f"\n{result}"


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_probe_u_float32_to_float32_cast_retargeted(dtype):
    # Cast(f32 -> f32) -> MatMul: the user cast itself casts to half (no extra cast). A JAX
    # f32 -> f32 convert_element_type exists only to drop a weak type.
    weak = jnp.broadcast_to(jnp.asarray(1 / 32), (32, 32))
    assert jax.typeof(weak).weak_type

    def u(x, w):
        return x.astype(jnp.float32) @ w

    check(u, (weak, W), rows("convert_element_type:A", "dot_general:A"), casts=2, dtype=dtype)
    first = emitted(u, weak, W, dtype=dtype).eqns[0]
    assert first.primitive.name == "convert_element_type"
    assert first.params["new_dtype"] == dtype
    assert first.invars[0].aval.dtype == jnp.float32


@pytest.mark.parametrize("version", [True, False], ids=["tf2.21", "tf2.19"])
@pytest.mark.parametrize("kind", LOOP_KINDS)
def test_probe_w_loop_body_matmul_tanh(kind, version):
    # OUR documented behaviour: a carry is a v1 Merge (clear), so the Tanh lies between the
    # MatMul and itself across the back edge and pass 3 paints it and the carry half, in
    # every version. TF 2.x functional While keeps the carry float32 at the call boundary
    # and optimises the body separately (2.19: Tanh f32), i.e. casts every iteration.
    def w_probe(x, w):
        return _loop(kind, lambda c: jnp.tanh(c @ w), x)

    expected = rows("<carry>:A", "dot_general:A", "tanh:A")
    # x at loop entry, w (a loop invariant, painted half like a Const feeding TF's Enter)
    # and the result back to float32. w enters the loop in float32 and is cast at its
    # reader, so its cotangent sums in float32 under grad; XLA hoists that cast: the
    # compiled loop casts nothing of w's shape, once before the loop as TF does.
    check(w_probe, (X, W), expected, casts=3, infer_follows_allow=version)
    (loop,) = [
        e
        for e in emitted(w_probe, X, W, infer_follows_allow=version).eqns
        if e.primitive.name in ("while", "scan")
    ]
    assert sorted(str(v.aval.dtype) for v in loop.invars if v.aval.shape == W.shape) == [
        "float16",
        "float32",
    ]
    assert sum(count_casts(sub) for sub in _sub_jaxprs(loop)) == 1
    rewritten = jmp_rewrite.rewrite(w_probe, dtype=F16, infer_follows_allow=version)
    body = compiled_loop_bodies(rewritten, X, W).splitlines()
    assert not [line for line in body if " convert(" in line and "convert_element_type" in line]


@pytest.mark.parametrize("name", ["B", "B2", "B4", "X"])
def test_probe_bf16_tf219_runs_pass4(name):
    fun, args, _ = PROBES[name]
    result = paint(fun, *args, dtype=BF16, infer_follows_allow=False)
    assert all(e.colour == A for e in result if e.float32), f"\n{result}"


# ------------------------------------------------------------------------------------------
# §1.8 Levels and environment variables: Exp -> MatMul -> Relu -> Tanh -> Rsqrt -> MatMul -> Sum
# ------------------------------------------------------------------------------------------


def _env_chain(x, w):
    return jnp.sum(jax.lax.rsqrt(jnp.tanh(relu(jnp.exp(x) @ w))) @ w)


_ENV_KEYS = ["exp", "dot_general", "max", "tanh", "rsqrt", "dot_general", "reduce_sum"]


def _env_rows(codes: str) -> list[tuple[str, str]]:
    return [(k, _CODE[c]) for k, c in zip(_ENV_KEYS, codes, strict=True)]


ENV_TABLE = [
    # Tanh stays float32 even in 2.21: pass 4 sees Relu, which is not yet allow.
    pytest.param({}, {}, "DAAFFAD", 5, id="default"),
    pytest.param({"level": "TENSOR_CORES_ONLY"}, {}, "FAFFFAF", 5, id="TENSOR_CORES_ONLY"),
    pytest.param(
        {}, {"JMP_REWRITE_LEVEL": "TENSOR_CORES_ONLY"}, "FAFFFAF", 5, id="env-TENSOR_CORES_ONLY"
    ),
    pytest.param({"level": "UNSAFE_FORCE_ALL"}, {}, "AAAAAAA", 3, id="UNSAFE_FORCE_ALL"),
    pytest.param(
        {}, {"JMP_REWRITE_LEVEL": "UNSAFE_FORCE_ALL"}, "AAAAAAA", 3, id="env-UNSAFE_FORCE_ALL"
    ),
    pytest.param({}, {"JMP_REWRITE_INFERLIST_ADD": "rsqrt"}, "DAAAAAD", 3, id="INFERLIST_ADD"),
    pytest.param({}, {"JMP_REWRITE_CLEARLIST_ADD": "rsqrt"}, "DAAAAAD", 3, id="CLEARLIST_ADD"),
    pytest.param(
        {"lists": jmp_rewrite.default_lists(F16).add(infer=["rsqrt"])},
        {},
        "DAAAAAD",
        3,
        id="lists.add-infer",
    ),
    pytest.param(
        {"lists": jmp_rewrite.default_lists(F16).move("rsqrt", to="clear")},
        {},
        "DAAAAAD",
        3,
        id="lists.move-clear",
    ),
    # No allowlist op left: the program is unchanged.
    pytest.param(
        {}, {"JMP_REWRITE_ALLOWLIST_REMOVE": "dot_general"}, "FFFFFFF", 0, id="ALLOWLIST_REMOVE"
    ),
    pytest.param(
        {"lists": jmp_rewrite.default_lists(F16).remove(allow=["dot_general"])},
        {},
        "FFFFFFF",
        0,
        id="lists.remove-allow",
    ),
]


@pytest.mark.parametrize("kwargs, env, codes, casts", ENV_TABLE)
def test_levels_and_environment(kwargs, env, codes, casts, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = check(_env_chain, (X, W), _env_rows(codes), casts=casts, **kwargs)
    assert result.changed == (casts > 0)


def test_conflicting_lists_raise(monkeypatch):
    # TF: "Op lists have conflicting entries", the pass fails and the graph is left unchanged.
    # OUR documented behaviour: the conflict is an error (Relu/max is already clear).
    monkeypatch.setenv("JMP_REWRITE_INFERLIST_ADD", "max")
    with pytest.raises(ValueError, match="conflicting entries"):
        paint(_env_chain, X, W)
    monkeypatch.delenv("JMP_REWRITE_INFERLIST_ADD")
    with pytest.raises(ValueError, match="conflicting entries"):
        jmp_rewrite.default_lists(F16).add(infer=["max"])


def test_results_are_numerically_close(leak_checking):
    # Sanity: the rewritten T3 and probe C compute what the originals do, within half precision.
    for fun, args in ((_t3, (X,)), (PROBES["C"][0], PROBES["C"][1])):
        want = jax.jit(fun)(*args)
        got = jax.jit(jmp_rewrite.rewrite(fun, dtype=F16))(*args)
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------------------
# Whole graphs: the gradient of a log-softmax loss (TF's LogSoftmax gradient)
# ------------------------------------------------------------------------------------------


def _xent_loss(w, x, labels):
    return jnp.mean(_xent(x, w, labels))


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("version", [True, False], ids=["tf2.21", "tf2.19"])
def test_whole_graph_log_softmax_gradient_is_float32_throughout(dtype, version, leak_checking):
    # TF's LogSoftmax gradient is Exp (deny), Sum, Mul, Sub: float32 throughout, in float16
    # and bfloat16. JAX's divides by the sum of the exps the forward unit hands over (a
    # residual TF's Exp recomputes): that sum is a deny vertex of its own, so the div was
    # bfloat16 before, where the sum is on the infer list.
    grad = jax.grad(_xent_loss)
    report = jmp_rewrite.explain(grad, W, X, LABELS, dtype=dtype, infer_follows_allow=version)
    backward = [e for e in report.equations if e.phase == "backward" and e.path.startswith("jit/")]
    keys = [e.key for e in backward]
    for key in ("div", "reduce_sum", "mul", "add_any"):
        assert key in keys, keys
    assert not [e.path for e in backward if e.half], f"\n{report}"
    # the matmuls on both sides are half
    assert all(e.half for e in report.equations if e.key == "dot_general"), f"\n{report}"


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_log_softmax_gradient_is_not_painted_as_the_fused_unit(dtype):
    # The forward jit:log_softmax is one fused op; its transpose, a jit of the same name, is
    # painted primitive by primitive (explain rows) and runs in float32 (the program).
    grad = jax.grad(_xent_loss)
    report = jmp_rewrite.explain(grad, W, X, LABELS, dtype=dtype)
    units = [e for e in report.equations if e.key == "jit:log_softmax"]
    assert [e.phase for e in units] == ["forward"], f"\n{report}"
    assert units[0].half
    jits = [e for e in emitted(grad, W, X, LABELS, dtype=dtype).eqns if e.primitive.name == "jit"]
    assert len(jits) == 2  # the forward unit and its transpose
    inner = jits[1].params["jaxpr"]
    inner = getattr(inner, "jaxpr", inner)
    floats = [
        v.aval.dtype
        for e in inner.eqns
        for v in [*e.invars, *e.outvars]
        if jnp.issubdtype(v.aval.dtype, jnp.floating)
    ]
    assert floats and all(d == jnp.float32 for d in floats), inner
    want = jax.grad(_xent_loss)(W, X, LABELS)
    got = jmp_rewrite.rewrite(grad, dtype=dtype)(W, X, LABELS)
    np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-3)
