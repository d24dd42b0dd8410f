"""TensorFlow's auto-mixed-precision op lists, as data keyed by JAX primitive names.

TF's grappler pass ``auto_mixed_precision`` sorts ops into four lists (TF 2.21,
``auto_mixed_precision_lists.h``):

* **allow**: always converted to half precision (matmuls, convolutions);
* **infer**: half precision when their neighbours are (``Add``, ``Mul``, ``Tanh``, ...);
* **deny**: kept in float32, and deny spreads forward through infer/clear ops
  (``Exp``, ``Pow``, ``Sum``, ...);
* **clear**: precision-agnostic data movement (``Reshape``, ``Relu``, ``MaxPool``, ...).

An op on no list is **unlisted**: it is never converted, blocks allow propagation, and does
not spread deny.

This module maps those lists onto JAX primitive names as they appear in jaxprs
(``dot_general``, ``reduce_sum``, ``scatter-add``, ...), plus a few *virtual* keys the
painter computes for one primitive with several meanings:

* ``integer_pow`` is split by its exponent (:func:`integer_pow_key`): ``y == -1`` is key
  ``reciprocal`` (TF ``Reciprocal``), ``y == 2`` is key ``square`` (TF ``Square``), any other
  ``y`` stays ``integer_pow`` (TF ``Pow``).
* A ``dot_general`` without contracting dimensions (``jnp.einsum("i,j->ij", ...)``,
  ``jnp.outer``) is key ``outer_product`` (:func:`dot_general_key`): TF ``Mul`` (infer), not a
  matmul. It does no tensor-core work, and painted allow it would round its operands to half
  before multiplying (RoPE's ``position x frequency`` angles, up to thousands of radians).
* A ``jit`` equation whose ``params["name"]`` is ``N`` is looked up as ``jit:N``
  (:func:`jit_key`). When that key is on a list the painter treats the whole call as one op of
  that list, like TF's fused op, instead of seeing through it. ``jax.nn.log_softmax`` is
  ``jit:log_softmax``, an infer op like TF's ``LogSoftmax``; taken apart it would contain
  ``exp`` and ``reduce_sum`` (deny).

Every primitive reachable from ``jax.lax`` and ``jax.extend.core.primitives`` is classified
deliberately: it is on a default list, or in :data:`FLOAT32_ONLY` (carries floats, stays
float32 on purpose), :data:`STRUCTURAL` (calls and control flow that the painter handles
structurally) or :data:`NON_FLOAT` (never carries floats). Each entry has a one-line reason
(:data:`REASONS` for list entries). ``tests/test_op_lists.py`` fails when a new JAX release
adds a primitive that is not classified.

Misuse to avoid: these are *TF's* choices, kept for parity. For example ``reduce_sum`` is deny
in float16 (so layer-norm and batch-norm statistics stay float32) but infer in bfloat16, and
``rsqrt`` is unlisted in float16. Change them with :meth:`OpLists.add` / :meth:`OpLists.remove`
or TF's environment variables (:mod:`jmp_rewrite._src.lists.environment`), not by editing the tables
here.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import re
import types
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jmp_rewrite._src import _jax_compat

#: The four lists, in TF's order of precedence.
KINDS: tuple[str, ...] = ("allow", "infer", "deny", "clear")
#: What :meth:`OpLists.kind` returns for a key on no list.
UNLISTED = "unlisted"
#: TF's ``TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LEVEL`` values ("" means DEFAULT).
LEVELS: tuple[str, ...] = (
    "DEFAULT",
    "TENSOR_CORES_ONLY",
    "TREAT_INFER_AS_DENY",
    "UNSAFE_FORCE_ALL",
)
#: Half-precision dtypes with default lists.
DTYPES: tuple[str, ...] = ("float16", "bfloat16")

#: Named jit units that the painter treats as one op (TF's fused ops).
JIT_UNIT_PREFIX = "jit:"

# ---------------------------------------------------------------------------------------------
# The tables. Each helper files keys under one category with a one-line reason; a key may be
# filed only once. The classification per dtype lives in _FP16/_BF16; REASONS says why.
#
# A list entry's reason names its TF counterpart first ("TF MatMul/BatchMatMul: ...") or, for a
# primitive TF has no op for, the TF op it behaves like ("no TF op: ..., like Sum"). The test
# of these tables reads those names and checks the key's list in both dtypes against TF
# 2.21's (float16: the CUDA lists; bfloat16: the oneDNN lists; tests/data holds them, as TF
# ships them). Where jmp_rewrite departs from TF on purpose, _def_difference_from_tf says so,
# with the reason; any other departure fails that test.
# ---------------------------------------------------------------------------------------------

_FP16: dict[str, str] = {}  # key -> kind, TF's CUDA fp16 lists (cuda >= 9.1, cudnn >= 8)
_BF16: dict[str, str] = {}  # key -> kind, TF's oneDNN bf16 lists
_REASONS: dict[str, str] = {}
_FLOAT32_ONLY: dict[str, str] = {}
_STRUCTURAL: dict[str, str] = {}
_NON_FLOAT: dict[str, str] = {}
_DIFFERENCES: dict[tuple[str, str], tuple[str, str]] = {}  # (key, dtype) -> (kind, why)


def _file(table: dict[str, str], reason: str, keys: tuple[str, ...]) -> None:
    assert reason, "every classification needs a reason"
    for key in keys:
        tables = (_REASONS, _FLOAT32_ONLY, _STRUCTURAL, _NON_FLOAT)
        assert not any(key in t for t in tables), f"{key!r} is classified twice"
        table[key] = reason


def _def_lists(fp16: str, bf16: str, reason: str, *keys: str) -> None:
    """Puts ``keys`` on list ``fp16`` for float16 and on ``bf16`` for bfloat16."""
    _file(_REASONS, reason, keys)
    for key in keys:
        if fp16 != UNLISTED:
            _FP16[key] = fp16
        if bf16 != UNLISTED:
            _BF16[key] = bf16


def _def_allow(reason: str, *keys: str) -> None:
    _def_lists("allow", "allow", reason, *keys)


def _def_infer(reason: str, *keys: str) -> None:
    _def_lists("infer", "infer", reason, *keys)


def _def_deny(reason: str, *keys: str) -> None:
    _def_lists("deny", "deny", reason, *keys)


def _def_clear(reason: str, *keys: str) -> None:
    _def_lists("clear", "clear", reason, *keys)


def _def_float32_only(reason: str, *keys: str) -> None:
    _file(_FLOAT32_ONLY, reason, keys)


def _def_structural(reason: str, *keys: str) -> None:
    _file(_STRUCTURAL, reason, keys)


def _def_non_float(reason: str, *keys: str) -> None:
    _file(_NON_FLOAT, reason, keys)


def _def_difference_from_tf(dtypes: tuple[str, ...], kind: str, reason: str, *keys: str) -> None:
    """Declares that ``keys`` are on list ``kind`` in ``dtypes`` on purpose, where TF 2.21 puts
    their TF counterpart (the op their reason names) on another."""
    assert reason, "every difference from TF needs a reason"
    for key in keys:
        for dtype in dtypes:
            assert (key, dtype) not in _DIFFERENCES, f"{key!r} differs twice in {dtype}"
            _DIFFERENCES[(key, dtype)] = (kind, reason)


def _jit_units(*names: str) -> tuple[str, ...]:
    return tuple(JIT_UNIT_PREFIX + name for name in names)


# --- allow: TF's tensor-core ops -------------------------------------------------------------
_def_allow("TF MatMul/BatchMatMul(V2)/Einsum: one dot_general per contraction", "dot_general")
_def_allow(
    "TF Conv2D/Conv3D/DepthwiseConv2dNative and backprops (a conv's VJP is again a conv)",
    "conv_general_dilated",
)
_def_allow("no TF op: grouped (MoE) matmul, a contraction like BatchMatMul", "ragged_dot_general")
_def_allow(
    "TF Mha/MhaV2: cuDNN fused attention",
    "dot_product_attention_fwd",
    "dot_product_attention_bwd",
    "dot_product_attention_fwd_wrapper",
    "dot_product_attention_bwd_wrapper",
)

_def_difference_from_tf(
    ("bfloat16",),
    "allow",
    "TF's oneDNN bf16 lists have no Mha (a cuDNN op); a fused attention is a tensor-core op, "
    "allow in bf16 as in fp16",
    "dot_product_attention_fwd",
    "dot_product_attention_bwd",
    "dot_product_attention_fwd_wrapper",
    "dot_product_attention_bwd_wrapper",
)

# --- infer: TF ops that follow their neighbours ----------------------------------------------
_def_infer("TF Add/AddV2/BiasAdd (BiasAdd = broadcast_in_dim + add)", "add")
_def_infer("TF AddN: JAX's gradient accumulation", "add_any")
_def_infer("TF Sub", "sub")
_def_infer("TF Mul (also TanhGrad/SigmoidGrad, which JAX writes with mul/sub)", "mul")
_def_infer("TF RealDiv (and the div inside FloorDiv)", "div")
_def_infer("TF Sqrt", "sqrt")
_def_infer("TF Log", "log")
_def_infer("TF Log1p", "log1p")
_def_infer("TF Log: log2(x) is log(x) / log(2) (jax >= 0.12 has its own primitive)", "log2")
_def_infer("TF Erf", "erf")
_def_infer("TF Erfc", "erfc")
_def_infer("TF Tanh", "tanh")
_def_infer(
    "TF TanhGrad: 1 - y**2, what tanh's derivative emits since jax 0.12 (before: mul/sub)",
    "one_minus_square",
)
_def_infer("TF Sigmoid", "logistic")
_def_infer("TF Prod: a product reduction is infer, not deny", "reduce_prod")
_def_infer("TF AvgPool/AvgPoolGrad (sum window, then div)", "reduce_window_sum")
_def_infer(
    "TF Inv/Reciprocal: virtual key for integer_pow(y=-1) (also Pallas's reciprocal)",
    "reciprocal",
)
_def_infer(
    "TF Mul: virtual key for a dot_general without contracting dimensions (an outer product, "
    "einsum 'i,j->ij' as in RoPE's angles): a broadcast multiply, no tensor-core work",
    "outer_product",
)
# TF lists Softmax/LogSoftmax/Softplus/Elu/Selu/Softsign as infer, not deny (TF's own docstring
# calls Softmax a deny op; the code disagrees): fused kernels that are fine in half. JAX
# decomposes them into exp/expm1/reduce_sum (deny), so the painter must see the named jit as
# one op to match TF. jax.nn.softmax is not a named jit in jax 0.10.2, so per primitive it
# stays float32 (more precise than TF). relu, gelu, silu and leaky_relu need no unit: their
# primitives classify as TF's fused op would.
_def_infer("TF LogSoftmax (infer, not deny)", *_jit_units("log_softmax"))
_def_infer("TF Softplus", *_jit_units("softplus"))
_def_infer("TF Elu/Selu; celu is Elu with a scale", *_jit_units("elu", "selu", "celu"))
_def_infer("TF Softsign", *_jit_units("soft_sign"))
_def_infer("no TF op: log_sigmoid(x) = -softplus(-x), so like Softplus", *_jit_units("log_sigmoid"))

# --- deny: TF ops whose results overflow or lose precision in half -----------------------------
_def_deny("TF Exp", "exp")
_def_deny("no TF op: 2**x overflows like Exp", "exp2")
_def_deny("TF Expm1", "expm1")
_def_deny("TF Pow (float exponent: x**0.5, jnp.power)", "pow")
_def_deny(
    "no TF op (TF Cumprod is unlisted): a running product overflows like Exp",
    "cumprod",
)
_def_deny(
    "no TF op: a running log-sum-exp overflows like Exp (it holds exp and a sum)", "cumlogsumexp"
)

# --- depends on the dtype ----------------------------------------------------------------------
# TF denies Pow in both lists. x**3 overflows float16 for |x| > 40, but bfloat16 has float32's
# exponent range: a power overflows bfloat16 only where it overflows float32 too, the reason
# TF's own bf16 lists make Sum/Mean infer. Deny on Pow spreads through a whole tanh-GELU
# (x**3 -> mul, add, mul, tanh, ...), storing its float32 tanh for the backward pass beside
# the half activations: +2.25 GiB on GPT-2 small (H200). A deliberate difference from TF in
# bfloat16 (DIFFERENCES_FROM_TF).
_def_lists(
    "deny",
    "infer",
    "TF Pow: x**n for n not in {-1, 2}; deny in fp16 (x**3 overflows half for |x| > 40), "
    "infer in bf16 (float32's exponent range; TF: deny in both)",
    "integer_pow",
)
_def_lists(
    "deny",
    "infer",
    "no TF op: sum a_k x**k by Horner's rule (jax >= 0.12), treated like TF Pow: deny in fp16, "
    "infer in bf16",
    "polynomial",
)
_def_difference_from_tf(
    ("bfloat16",),
    "infer",
    "TF Pow is deny; infer here: bfloat16 has float32's exponent range (TF's reason to make "
    "Sum/Mean infer in bf16), and deny spread through the tanh-GELU kept its tanh float32 for "
    "the backward pass: +2.25 GiB on GPT-2 small, +1.88 GiB on ViT-B/16 (H200)",
    "integer_pow",
    "polynomial",
)
# TF denies Sum/Mean on CUDA fp16 (a half accumulator overflows at 65504 and loses precision),
# but the oneDNN bf16 list makes them infer: bfloat16 has float32's exponent range.
_def_lists("deny", "infer", "TF Sum/Mean (+ div): deny in fp16, infer in bf16", "reduce_sum")
_def_lists(
    "deny",
    "infer",
    "no TF op (TF Cumsum is unlisted): a running sum accumulates like Sum",
    "cumsum",
)
_def_lists(
    "deny",
    "infer",
    "no TF op (TF's scatters are unlisted): accumulates many updates like Sum "
    "(embedding/gather gradients)",
    "scatter-add",
    "scatter-sub",
)
_def_lists(
    "deny",
    "infer",
    "no TF op (TF collectives are unlisted): a cross-device sum, like Sum",
    "psum",
    "psum_invariant",
    "reduce_scatter",
)
# Unlisted on CUDA fp16 (layer norm's rsqrt stays float32 on GPUs in TF); the oneDNN lists add
# Rsqrt/Square/SquaredDifference to infer. `square` is also integer_pow(y=2)'s virtual key.
_def_lists(UNLISTED, "infer", "TF Rsqrt: unlisted in fp16, infer in bf16", "rsqrt")
_def_lists(UNLISTED, "infer", "TF Square: unlisted in fp16, infer in bf16", "square")

# --- clear: data movement and selection, exact in any precision ------------------------------
_def_clear("TF Reshape/ExpandDims/Squeeze/SpaceToDepth", "reshape")
_def_clear("TF Transpose", "transpose")
_def_clear("TF BroadcastTo/ExpandDims/Fill", "broadcast_in_dim", "broadcast_to")
_def_clear("TF Squeeze", "squeeze")
_def_clear("TF Slice/StridedSlice/Split", "slice", "dynamic_slice")
_def_clear("TF StridedSliceGrad/TensorListSetItem: overwrites a slice", "dynamic_update_slice")
_def_clear("TF Gather/GatherV2/GatherNd", "gather")
_def_clear("TF DynamicStitch/ScatterNd (bf16): overwrite only, no accumulation", "scatter")
_def_clear("TF Concat/ConcatV2/Pack", "concatenate", "stack")
_def_clear("TF Split/SplitV/Unpack", "split", "unstack")
_def_clear("TF Tile", "tile")
_def_clear("TF Pad/PadV2/MirrorPad", "pad")
_def_clear("TF Reverse/ReverseV2/ReverseSequence", "rev")
_def_clear("TF Select/SelectV2 (jnp.where)", "select_n")
_def_clear("TF ClipByValue", "clamp")
_def_clear("TF Maximum/Minimum/Relu/Relu6", "max", "min")
# Equinox's own primitives, in the loops of diffrax, optimistix and lineax.
_def_clear(
    "no TF op (Equinox): a lax.select that ignores an unbatched predicate, like SelectV2",
    "select_if_vmap",
)
_def_clear("no TF op (Equinox): an identity that refuses vmap, like Identity", "nonbatchable")
_def_clear("TF Max/Min reductions", "reduce_max", "reduce_min")
_def_clear("TF ArgMax/ArgMin", "argmax", "argmin")
_def_clear("TF MaxPool/MaxPool3D (and min pooling)", "reduce_window_max", "reduce_window_min")
_def_clear(
    "TF MaxPoolGrad (the VJP of max pooling)", "select_and_scatter_add", "select_and_scatter"
)
_def_clear("TF MaxPoolGradGrad (the JVP of max pooling)", "select_and_gather_add")
_def_clear("TF Abs", "abs")
_def_clear("TF Neg", "neg")
_def_clear("TF Sign", "sign")
_def_clear("TF Floor/Ceil/Round", "floor", "ceil", "round")
_def_clear(
    "TF Equal/NotEqual/Less/LessEqual/Greater/GreaterEqual", "eq", "ne", "lt", "le", "gt", "ge"
)
_def_clear("no TF op: total-order comparisons of sort comparators, like Equal/Less", "eq_to")
_def_clear("no TF op: total-order comparisons of sort comparators, like Less", "lt_to", "le_to")
_def_clear("TF IsFinite (IsInf/IsNan lower to eq/ne)", "is_finite")
_def_clear("TF TopK/TopKV2 (sort/argsort compare only)", "sort", "top_k", "approx_top_k")
_def_clear("no TF op: running max/min select values, like Max/Min", "cummax", "cummin")
_def_clear(
    "no TF op (TF's scatters are unlisted): scatter-max/min select values, like Maximum/Minimum",
    "scatter-max",
    "scatter-min",
)
_def_clear("TF Identity/Snapshot", "copy")
_def_clear("TF StopGradient/PreventGradient", "stop_gradient")
_def_clear("TF IdentityN: an identity that only orders computation", "optimization_barrier")
_def_clear("TF ZerosLike/OnesLike", "zeros_like")
#: Annotations of one operand that compute nothing: each output element is the operand's
#: (``origins`` hands a value's origin through them: a parameter made device-varying by
#: ``shard_map``'s ``pvary`` is the parameter still).
ANNOTATIONS = ("sharding_constraint", "layout_constraint", "reshard", "pvary", "pbroadcast")
_def_clear(
    "no TF op: an annotation that computes nothing, like EnsureShape/Identity",
    *ANNOTATIONS,
    "device_put",
)
_def_clear("no TF op: names a value for remat policies (checkpoint_name), like Identity", "name")
_def_clear("no TF op: lifts a value into the trace, like Identity", "stage")
_def_clear("no TF op: an identity on its second operand (orders effects), like Identity", "tie")
_def_clear(
    "no TF op: collective data movement, exact in any precision, like Gather/Concat",
    "all_gather",
    "all_gather_invariant",
    "all_to_all",
    "ragged_all_to_all",
    "ppermute",
)
_def_clear("no TF op: cross-device max/min, selection like Max/Min", "pmax", "pmin")

# --- float32 on purpose (on no list, carries floats) -------------------------------------------
_def_float32_only(
    "a user cast: never painted; the painter applies TF's existing-cast rule to it",
    "convert_element_type",
)
_def_float32_only(
    "deliberate precision emulation: its operand dtype is its meaning", "reduce_precision"
)
_def_float32_only("bit-level reinterpretation: the dtype is the semantics", "bitcast_convert_type")
_def_float32_only(
    "TF Sin/Cos/Tan/Asin/Acos/Atan/Atan2 are unlisted (PyTorch autocast: fp32)",
    "sin",
    "cos",
    "tan",
    "asin",
    "acos",
    "atan",
    "atan2",
)
_def_float32_only(
    "TF Sinh/Cosh/Asinh/Acosh/Atanh are unlisted (overflow-prone)",
    "sinh",
    "cosh",
    "asinh",
    "acosh",
    "atanh",
)
_def_float32_only("no TF op on any list: cube root stays fp32 like other roots", "cbrt")
_def_float32_only(
    "special functions: TF Lgamma/Digamma/Erfinv/Igamma/Zeta/Betainc are unlisted",
    "lgamma",
    "digamma",
    "igamma",
    "igammac",
    "igamma_grad_a",
    "polygamma",
    "zeta",
    "bessel_i0e",
    "bessel_i1e",
    "erf_inv",
    "regularized_incomplete_beta",
    "random_gamma",
)
_def_float32_only("TF Mod/FloorMod are unlisted", "rem")
_def_float32_only("defined by its dtype's ulp: converting changes the answer", "nextafter")
_def_float32_only(
    "generic reduction with a user body: its accumulation is unknown", "reduce", "reduce_window"
)
_def_float32_only("a multiplicative scatter accumulates and overflows in half", "scatter-mul")
_def_float32_only(
    "a source with an explicit dtype: nothing to convert",
    "iota",
    "rng_uniform",
    "empty",
    "empty2",
)
_def_float32_only("TF FFT is unlisted; no half-precision FFT on most backends", "fft")
_def_float32_only(
    "linear algebra: TF Cholesky/MatrixInverse are unlisted; no half kernels",
    "cholesky",
    "cholesky_update",
    "eig",
    "eigh",
    "svd",
    "qr",
    "lu",
    "triangular_solve",
    "householder_product",
    "schur",
    "hessenberg",
    "tridiagonal",
    "tridiagonal_solve",
    "ormqr",
    "symmetric_product",
    "geqrf",
    "geqp3",
)
_def_float32_only(
    "complex numbers: there is no half-precision complex dtype", "real", "imag", "conj", "complex"
)
_def_float32_only(
    "host callback or foreign kernel: it expects the traced dtype (TF SaveV2-like sink)",
    "debug_callback",
    "debug_print",
    "io_callback",
    "pure_callback",
    "ffi_call",
    "buffer_callback",
    "cudnn_fusion",
    "inspect_sharding",
    "check",
    "call_exported",
)
_def_float32_only("keeps values alive for DCE; nothing is computed", "dce_sink")
_def_float32_only(
    "reads or writes a mutable Ref, whose dtype is fixed",
    "get",
    "swap",
    "addupdate",
    "new_ref",
    "freeze",
)
_def_float32_only(
    "fp8 (block-scaled) operands are already low precision",
    "scaled_dot",
    "scaled_matmul_wrapper",
    "dot_product_attention_fp8_fwd",
    "dot_product_attention_fp8_bwd",
    "dot_product_attention_fp8_fwd_wrapper",
    "dot_product_attention_fp8_bwd_wrapper",
)

# --- structural (calls and control flow; older/newer names included) --------------------------
_def_structural(
    "call: the painter sees through its body (jit is pjit's name since jax 0.7)",
    "jit",
    "pjit",
    "closed_call",
    "core_call",
    "call",
    "xla_call",
)
_def_structural(
    "rematerialisation wrapper: painted through (remat2 is jax.checkpoint)",
    "remat2",
    "checkpoint",
    "remat_call",
    "remat_opt",
)
_def_structural(
    "custom derivative: painted through, the rule is kept",
    "custom_jvp_call",
    "custom_jvp_call_jaxpr",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "custom_lin",
    "linear_call",
)
_def_structural(
    "holds matvec/solve jaxprs: opaque, its bodies rewritten as programs of their own",
    "custom_linear_solve",
)
_def_structural("control flow: branch outputs must agree in dtype", "cond")
_def_structural(
    "loop: carries follow TF's recurrent colour match (v1 Merge/NextIteration)", "while", "scan"
)
_def_structural(
    "SPMD/device call: painted through with its boundary dtypes kept",
    "shard_map",
    "xla_pmap",
    "compute_on",
    "custom_partitioning",
    "xla_metadata_call",
)
_def_structural(
    "call wrapper with its own batching/lowering rule: painted through",
    "custom_vmap_call",
    "composite",
    "eval_jaxpr",
    "fused_call",
)
_def_structural(
    "stateful or kernel body over Refs: opaque, runs as written in its traced dtypes",
    "run_state",
    "pallas_call",
)

# --- never carry floats ---------------------------------------------------------------------
_def_non_float("bitwise or boolean", "and", "or", "not", "xor")
_def_non_float("integer shift", "shift_left", "shift_right_arithmetic", "shift_right_logical")
_def_non_float("integer bit counting", "population_count", "clz")
_def_non_float("integer multiply-high", "mulhi")
_def_non_float("boolean/integer reduction", "reduce_and", "reduce_or", "reduce_xor")
_def_non_float(
    "PRNG keys and random bits (uint)",
    "random_bits",
    "random_seed",
    "random_split",
    "random_fold_in",
    "random_wrap",
    "random_unwrap",
    "random_clone",
    "threefry2x32",
    "threefry4x32",
    "philox4x32",
    "rng_bit_generator",
)
_def_non_float("integer device/axis index", "axis_index", "platform_index")
_def_non_float("effect tokens", "create_token", "after_all")
_def_non_float("int32 pivots", "lu_pivots_to_permutation")

#: Why each key of the default lists is where it is (TF counterpart, or the reason for a JAX
#: primitive with none).
REASONS: Mapping[str, str] = types.MappingProxyType(_REASONS)
#: Primitives that carry floats and deliberately stay on no list, with the reason.
FLOAT32_ONLY: Mapping[str, str] = types.MappingProxyType(_FLOAT32_ONLY)
#: Higher-order/call primitives the painter sees through or handles structurally.
STRUCTURAL: Mapping[str, str] = types.MappingProxyType(_STRUCTURAL)
#: Primitives that never carry floats.
NON_FLOAT: Mapping[str, str] = types.MappingProxyType(_NON_FLOAT)
#: ``(key, dtype) -> (list, reason)`` where a default list departs on purpose from TF 2.21's
#: list for the key's TF counterpart (the TF op its reason names).
DIFFERENCES_FROM_TF: Mapping[tuple[str, str], tuple[str, str]] = types.MappingProxyType(
    _DIFFERENCES
)

#: ``integer_pow`` exponents with their own key (everything else is ``integer_pow``: TF Pow).
INTEGER_POW_KEYS: Mapping[int, str] = types.MappingProxyType({-1: "reciprocal", 2: "square"})
#: Keys that are not JAX primitives; the painter computes them.
VIRTUAL_KEYS: frozenset[str] = frozenset({"reciprocal", "outer_product"})
#: The named-jit keys this module puts on lists.
JIT_UNIT_KEYS: frozenset[str] = frozenset(k for k in _REASONS if k.startswith(JIT_UNIT_PREFIX))

# A few TF op names, for "did you mean" hints when someone passes a TF name.
_TF_NAME_HINTS: Mapping[str, str] = types.MappingProxyType(
    {
        "matmul": "dot_general",
        "batchmatmul": "dot_general",
        "batchmatmulv2": "dot_general",
        "einsum": "dot_general",
        "conv2d": "conv_general_dilated",
        "conv3d": "conv_general_dilated",
        "depthwiseconv2dnative": "conv_general_dilated",
        "addv2": "add",
        "addn": "add_any",
        "biasadd": "add",
        "realdiv": "div",
        "sigmoid": "logistic",
        "sum": "reduce_sum",
        "mean": "reduce_sum",
        "prod": "reduce_prod",
        "relu": "max",
        "maximum": "max",
        "minimum": "min",
        "selectv2": "select_n",
        "select": "select_n",
        "cast": "convert_element_type",
        "logsoftmax": "jit:log_softmax",
        "softplus": "jit:softplus",
        "avgpool": "reduce_window_sum",
        "maxpool": "reduce_window_max",
        "concatv2": "concatenate",
        "inv": "reciprocal",
    }
)


def dot_general_key(dimension_numbers: Any) -> str:
    """The op key of a ``dot_general`` equation with ``dimension_numbers``.

    Args:
      dimension_numbers: the equation's ``params["dimension_numbers"]``,
        ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``.

    Returns:
      ``"outer_product"`` when nothing is contracted (TF Mul), else ``"dot_general"``.

    Example:
      >>> dot_general_key((((1,), (0,)), ((), ()))), dot_general_key((((), ()), ((), ())))
      ('dot_general', 'outer_product')
    """
    (lhs_contract, _), _ = dimension_numbers
    return "dot_general" if len(lhs_contract) else "outer_product"


def integer_pow_key(y: int) -> str:
    """The op key of an ``integer_pow`` equation with exponent ``y``.

    Args:
      y: the equation's ``params["y"]``.

    Returns:
      ``"reciprocal"`` for ``y == -1`` (TF Reciprocal), ``"square"`` for ``y == 2`` (TF Square),
      otherwise ``"integer_pow"`` (TF Pow).

    Example:
      >>> integer_pow_key(-1), integer_pow_key(2), integer_pow_key(3)
      ('reciprocal', 'square', 'integer_pow')
    """
    return INTEGER_POW_KEYS.get(int(y), "integer_pow")


def jit_key(name: str) -> str:
    """The op key of a ``jit`` equation whose ``params["name"]`` is ``name``.

    Args:
      name: the jitted function's name, e.g. ``"log_softmax"``.

    Returns:
      ``"jit:" + name``.

    Example:
      >>> jit_key("log_softmax")
      'jit:log_softmax'
    """
    return JIT_UNIT_PREFIX + name


def _public_primitive_modules() -> list[types.ModuleType]:
    modules: list[types.ModuleType] = [jax.lax, _jax_compat.primitives]
    for name in ("jax.lax.linalg",):  # public submodules of jax.lax that define primitives
        try:
            modules.append(importlib.import_module(name))
        except ImportError:  # pragma: no cover - depends on the JAX version
            pass
    # Any other public submodule jax.lax exposes (names differ across JAX versions).
    for value in list(vars(jax.lax).values()):
        if isinstance(value, types.ModuleType) and value.__name__.startswith("jax.lax."):
            if value not in modules:
                modules.append(value)
    return modules


@functools.cache
def public_primitive_names() -> frozenset[str]:
    """Names of every primitive reachable from ``jax.lax`` and ``jax.extend.core.primitives``.

    Enumerated dynamically (``isinstance(value, jax.extend.core.Primitive)``), since primitive
    names differ across JAX versions.

    Returns:
      A frozenset of primitive names such as ``"dot_general"`` and ``"scatter-add"``.

    Example:
      >>> "dot_general" in public_primitive_names()
      True
    """
    names: set[str] = set()
    with warnings.catch_warnings():  # dir() lists deprecated aliases that warn on access
        warnings.simplefilter("ignore")
        for module in _public_primitive_modules():
            for attr in dir(module):
                try:
                    value = getattr(module, attr)
                except Exception:  # a lazy attribute may fail to import
                    continue
                if isinstance(value, _jax_compat.Primitive):
                    names.add(value.name)
    return frozenset(names)


@functools.cache
def known_op_keys() -> frozenset[str]:
    """Every op key an :class:`OpLists` accepts.

    That is: every primitive reachable from ``jax.lax`` (and its public submodules) and
    ``jax.extend.core.primitives`` in the installed JAX, every name this module classifies
    (including primitives of other JAX versions, such as ``pjit``, or ones only reachable
    privately, such as ``ragged_dot_general``), the virtual keys (``reciprocal``) and the named
    jit units (``jit:log_softmax``, ...). :class:`OpLists` also accepts any other ``jit:NAME``.

    Returns:
      A frozenset of op keys.

    Example:
      >>> {"dot_general", "reciprocal", "jit:softplus"} <= known_op_keys()
      True
    """
    return (
        public_primitive_names()
        | frozenset(_REASONS)
        | frozenset(_FLOAT32_ONLY)
        | frozenset(_STRUCTURAL)
        | frozenset(_NON_FLOAT)
        | VIRTUAL_KEYS
        | JIT_UNIT_KEYS
    )


_JIT_KEY_RE = re.compile(r"^jit:[^\s,]+$")


def _is_known(key: str) -> bool:
    return key in known_op_keys() or bool(_JIT_KEY_RE.match(key))


def _unknown_key_error(key: str, where: str) -> ValueError:
    known = known_op_keys()
    lowered = {k.lower(): k for k in known}
    suggestions = [lowered[m] for m in difflib.get_close_matches(key.lower(), lowered, n=3)]
    hint = _TF_NAME_HINTS.get(key.lower())
    if hint is not None and hint not in suggestions:
        suggestions.insert(0, hint)
    message = f"unknown op key {key!r} in {where}"
    if suggestions:
        message += f"; did you mean {' or '.join(repr(s) for s in suggestions)}?"
    message += " Keys are JAX primitive names: jmp_rewrite.known_op_keys() lists them all."
    return ValueError(message)


def _as_keys(value: Any, where: str) -> frozenset[str]:
    if isinstance(value, str | bytes):
        raise TypeError(f"{where} must be an iterable of op keys, not a single string: {value!r}")
    try:
        keys = frozenset(value)
    except TypeError:
        raise TypeError(f"{where} must be an iterable of op keys, got {value!r}") from None
    for key in keys:
        if not isinstance(key, str):
            raise TypeError(f"op keys are strings; {where} contains {key!r}")
    return keys


@dataclasses.dataclass(frozen=True, repr=False)
class OpLists:
    """Immutable allow/infer/deny/clear lists of op keys (JAX primitive names).

    The constructor accepts any iterables of keys and freezes them. It checks that every key
    is known (:func:`known_op_keys`, or any ``jit:NAME``) and that no key is on two lists, as
    TF's ``ValidateLists`` does. A key on no list is "unlisted". Instances are hashable and
    compare by value, so they can key caches.

    Attributes:
      allow: ops always converted to half precision.
      infer: ops converted when their neighbours are.
      deny: ops kept float32; deny spreads forward through infer and clear ops.
      clear: precision-agnostic ops that take their neighbours' colour.

    Raises:
      ValueError: if a key is unknown (the message suggests close matches) or on two lists
        (the message contains "conflicting entries" and names the op and both lists).
      TypeError: if a list is a bare string or contains a non-string.

    Example:
      >>> lists = OpLists(allow={"dot_general"}, infer=["add"])
      >>> lists
      OpLists(allow: 1, infer: 1, deny: 0, clear: 0)
      >>> lists.kind("add"), lists.kind("exp")
      ('infer', 'unlisted')
      >>> lists.move("add", "deny").kind("add")
      'deny'
    """

    allow: frozenset[str] = frozenset()
    infer: frozenset[str] = frozenset()
    deny: frozenset[str] = frozenset()
    clear: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for kind in KINDS:
            object.__setattr__(self, kind, _as_keys(getattr(self, kind), f"the {kind} list"))
        for kind in KINDS:
            for key in sorted(getattr(self, kind)):
                if not _is_known(key):
                    raise _unknown_key_error(key, f"the {kind} list")
        for i, first in enumerate(KINDS):
            for second in KINDS[i + 1 :]:
                both = getattr(self, first) & getattr(self, second)
                if both:
                    op = sorted(both)[0]
                    raise ValueError(
                        f"Op lists have conflicting entries: {op!r} is on both the {first} "
                        f"and the {second} list"
                        + (f" (also {sorted(both)[1:]})" if len(both) > 1 else "")
                    )

    def kind(self, key: str) -> str:
        """The list ``key`` is on.

        Args:
          key: an op key; unknown keys are simply unlisted.

        Returns:
          ``"allow"``, ``"infer"``, ``"deny"``, ``"clear"`` or ``"unlisted"``.

        Example:
          >>> default_lists("float16").kind("reduce_sum")
          'deny'
        """
        for kind in KINDS:
            if key in getattr(self, kind):
                return kind
        return UNLISTED

    def __contains__(self, key: object) -> bool:
        return any(key in getattr(self, kind) for kind in KINDS)

    def __repr__(self) -> str:
        counts = ", ".join(f"{kind}: {len(getattr(self, kind))}" for kind in KINDS)
        return f"OpLists({counts})"

    def add(
        self,
        *,
        allow: Iterable[str] = (),
        infer: Iterable[str] = (),
        deny: Iterable[str] = (),
        clear: Iterable[str] = (),
    ) -> OpLists:
        """New lists with keys added (TF's ``..._ADD``). Adding a key already there is a no-op.

        Args:
          allow: keys to add to the allow list.
          infer: keys to add to the infer list.
          deny: keys to add to the deny list.
          clear: keys to add to the clear list.

        Returns:
          A new :class:`OpLists`; ``self`` is unchanged.

        Raises:
          ValueError: for an unknown key, or one that would be on two lists (use
            :meth:`move` to change a key's list).

        Example:
          >>> lists = default_lists("float16").add(infer=["rsqrt"])
          >>> lists.kind("rsqrt"), default_lists("float16").kind("rsqrt")
          ('infer', 'unlisted')
        """
        extra = {"allow": allow, "infer": infer, "deny": deny, "clear": clear}
        return OpLists(**{k: getattr(self, k) | _as_keys(v, f"{k}=") for k, v in extra.items()})

    def remove(
        self,
        *,
        allow: Iterable[str] = (),
        infer: Iterable[str] = (),
        deny: Iterable[str] = (),
        clear: Iterable[str] = (),
    ) -> OpLists:
        """New lists with keys removed (TF's ``..._REMOVE``); removed keys become unlisted.

        Args:
          allow: keys to remove from the allow list.
          infer: keys to remove from the infer list.
          deny: keys to remove from the deny list.
          clear: keys to remove from the clear list.

        Returns:
          A new :class:`OpLists`; ``self`` is unchanged.

        Raises:
          ValueError: if a key is not on the list it is removed from (the message says where
            it is).

        Example:
          >>> default_lists("float16").remove(deny=["exp"]).kind("exp")
          'unlisted'
        """
        drop = {"allow": allow, "infer": infer, "deny": deny, "clear": clear}
        new = {}
        for kind, value in drop.items():
            keys = _as_keys(value, f"{kind}=")
            missing = sorted(keys - getattr(self, kind))
            if missing:
                raise ValueError(
                    f"cannot remove {missing[0]!r} from the {kind} list: it is not on it "
                    f"(it is {_where(self, missing[0])})"
                )
            new[kind] = getattr(self, kind) - keys
        return OpLists(**new)

    def move(self, op: str, to: str) -> OpLists:
        """New lists with ``op`` on list ``to`` (and on no other).

        Args:
          op: an op key.
          to: ``"allow"``, ``"infer"``, ``"deny"``, ``"clear"`` or ``"unlisted"``.

        Returns:
          A new :class:`OpLists`; ``self`` is unchanged.

        Raises:
          ValueError: for an unknown op key or target.

        Example:
          >>> default_lists("float16").move("reduce_sum", "infer").kind("reduce_sum")
          'infer'
        """
        if to not in (*KINDS, UNLISTED):
            raise ValueError(f"cannot move {op!r} to {to!r}; expected one of {(*KINDS, UNLISTED)}")
        if not isinstance(op, str):
            raise TypeError(f"op keys are strings, got {op!r}")
        if not _is_known(op):
            raise _unknown_key_error(op, "move()")
        new = {kind: getattr(self, kind) - {op} for kind in KINDS}
        if to != UNLISTED:
            new[to] = new[to] | {op}
        return OpLists(**new)


def _where(lists: OpLists | Mapping[str, Iterable[str]], key: str) -> str:
    if isinstance(lists, OpLists):
        lists = {kind: getattr(lists, kind) for kind in KINDS}
    found = [kind for kind in KINDS if key in lists[kind]]
    return f"on the {found[0]} list" if found else "unlisted"


def _canonical_dtype(dtype: Any) -> str:
    error = ValueError(
        f"no default op lists for dtype {dtype!r}; expected one of "
        "float16 (jnp.float16) or bfloat16 (jnp.bfloat16)"
    )
    if dtype is None or isinstance(dtype, bool):
        raise error
    try:
        name = jnp.dtype(dtype).name
    except (TypeError, ValueError):
        raise error from None
    if name not in DTYPES:
        raise error
    return name


@functools.cache
def _default_lists(name: str) -> OpLists:
    table = _FP16 if name == "float16" else _BF16
    return OpLists(**{kind: [k for k, v in table.items() if v == kind] for kind in KINDS})


def default_lists(dtype: Any) -> OpLists:
    """TF 2.21's default lists for ``dtype``, mapped to JAX primitive names.

    float16 gets TF's CUDA fp16 lists (``AutoMixedPrecisionListsFp16`` with cuda >= 9.1 and
    cudnn >= 8, so the version gates are all on); bfloat16 gets TF's oneDNN bf16 lists
    (``AutoMixedPrecisionListsMkl``). They differ in JAX terms only where TF's differ:
    ``reduce_sum`` (Sum/Mean), ``cumsum``, ``scatter-add``/``scatter-sub`` and ``psum`` are
    deny in float16 but infer in bfloat16, and ``rsqrt``/``square`` are unlisted in float16
    but infer in bfloat16.

    Args:
      dtype: ``jnp.float16``, ``np.float16``, ``"float16"``, ``jnp.bfloat16`` or
        ``"bfloat16"``.

    Returns:
      The default :class:`OpLists` (a cached, immutable object).

    Raises:
      ValueError: for any other dtype; the message lists the allowed ones.

    Example:
      >>> import jax.numpy as jnp
      >>> default_lists(jnp.float16).kind("reduce_sum"), default_lists("bfloat16").kind(
      ...     "reduce_sum")
      ('deny', 'infer')
    """
    return _default_lists(_canonical_dtype(dtype))


def canonical_level(level: str | None) -> str:
    """Normalises a level name: case-insensitive, surrounding spaces ignored, "" is DEFAULT.

    Args:
      level: one of :data:`LEVELS` in any case, ``""`` or ``None``.

    Returns:
      The upper-case level name.

    Raises:
      ValueError: for an unknown level; the message lists the allowed ones.

    Example:
      >>> canonical_level(" tensor_cores_only "), canonical_level("")
      ('TENSOR_CORES_ONLY', 'DEFAULT')
    """
    name = "" if level is None else str(level).strip().upper()
    name = name or "DEFAULT"
    if name not in LEVELS:
        raise ValueError(
            f"unknown level {level!r}; expected one of {', '.join(LEVELS)} "
            "(case-insensitive; an empty string means DEFAULT)"
        )
    return name


def apply_level(lists: OpLists, level: str | None, dtype: Any) -> OpLists:
    """The list effects of a TF ``TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LEVEL``.

    * ``DEFAULT``: unchanged.
    * ``TENSOR_CORES_ONLY``: empties the infer, deny and clear lists, so only allow ops are
      converted, each wrapped in casts. float16 only: for bfloat16 it is ignored, as in TF,
      where the check lives only in the fp16 list class.
    * ``TREAT_INFER_AS_DENY``: moves every infer op to the deny list.
    * ``UNSAFE_FORCE_ALL``: lists unchanged; the painter converts every op it can and skips
      deny propagation. An error for bfloat16, as TF rejects it in BF16 (oneDNN) mode.

    Args:
      lists: the lists to start from.
      level: one of :data:`LEVELS` (case-insensitive; ``""`` means DEFAULT).
      dtype: the target half-precision dtype (as for :func:`default_lists`).

    Returns:
      A new :class:`OpLists` (or ``lists`` itself when nothing changes).

    Raises:
      ValueError: for an unknown level or dtype, or UNSAFE_FORCE_ALL with bfloat16.

    Example:
      >>> lists = apply_level(default_lists("float16"), "treat_infer_as_deny", "float16")
      >>> lists.kind("add"), len(lists.infer)
      ('deny', 0)
    """
    level = canonical_level(level)
    name = _canonical_dtype(dtype)
    if level == "TENSOR_CORES_ONLY" and name == "float16":
        return OpLists(allow=lists.allow)
    if level == "TREAT_INFER_AS_DENY":
        return OpLists(allow=lists.allow, deny=lists.deny | lists.infer, clear=lists.clear)
    if level == "UNSAFE_FORCE_ALL" and name == "bfloat16":
        raise ValueError(
            "level UNSAFE_FORCE_ALL is not supported for bfloat16 "
            "(TF rejects it when oneDNN bf16 is used)"
        )
    return lists
