"""Round 6 of planted bugs (issue 29's measure): 20 realistic one-line bugs in
``jmp_rewrite/_src``, written by a helper who had read the library, the docs and the TF
reference but NOT ``tests/`` nor the entries of ``tools/mutant_list.py`` (independence record:
this file was committed before any test was read). ``tests`` are guessed from the test files'
names only (``ls tests/``), plus ``tests/test_goldens.py``.

Run: ``.venv/bin/python tools/mutants.py --list-module tools.mutants_round6 --broad -j 1``.
"""

from __future__ import annotations

from tools.mutant_list import Mutant

_SRC = "jmp_rewrite/_src/"
_G = "tests/test_goldens.py"


def _m(name, file, original, replacement, tests, bug, survives=""):
    tests = (tests,) if isinstance(tests, str) else tuple(tests)
    return Mutant(name, _SRC + file, original, replacement, (_G, *tests), bug, survives)


ENGINE = ("tests/test_rewrite.py", "tests/test_dtype_decisions.py", "tests/test_tf_patterns.py")
LOOPS = ("tests/test_state_in_loops.py", "tests/test_painting_flow.py")
NUMERICS = ("tests/test_numerics.py", "tests/test_round4_numerics.py", "tests/test_oracle.py")
LS = ("tests/test_loss_scale.py", "tests/test_loss_scale_optimizer.py")

MUTANTS: tuple[Mutant, ...] = (
    # ---- origins.py ------------------------------------------------------------------
    _m(
        "r6_cond_frozen_any",
        "origins.py",
        "frozen=all(o.frozen for o in origins),",
        "frozen=any(o.frozen for o in origins),",
        (*NUMERICS, "tests/test_behaviour_pins.py", "tests/test_rule_families.py"),
        "a cond output is frozen (clamped when cast to half) when ANY branch is a constant: "
        "cond(p, lambda: full(-1e9), lambda: exp(x)) @ w saturates exp(12) to 65504 instead "
        "of overflowing honestly",
    ),
    _m(
        "r6_square_is_linear",
        "origins.py",
        "derived = per[0] ^ per[1]",
        "derived = per[0] | per[1]",
        (*LOOPS, "tests/test_rule_families.py"),
        "old * old counted as linear in old: a carry updated as h + h*h*dt (or output "
        "x*x + y) is taken for state and kept float32 instead of TF's colours",
    ),
    # ---- paint_additions.py ----------------------------------------------------------
    _m(
        "r6_float32_read_all",
        "paint_additions.py",
        "or any(c not in p.allow for c in g.nodes[v].fanout)",
        "or all(c not in p.allow for c in g.nodes[v].fanout)",
        (*ENGINE, "tests/test_real_models.py"),
        "keep_float32_reads_unrounded only when EVERY reader is float32: a LayerNorm "
        "scale's broadcast shared by a float32 forward mul and a half backward mul is "
        "rounded to half for the float32 reader again",
    ),
    _m(
        "r6_step_tail_scaling",
        "paint_additions.py",
        "_products(v) > 1",
        "_products(v) >= 1",
        (*LOOPS, "tests/test_train_step.py"),
        "the state update's tail stops at a scaling by a literal: p - 0.01 * g computes "
        "0.01 * g in half (the learning-rate product rounded) instead of float32",
    ),
    # ---- paint.py ----------------------------------------------------------------------
    _m(
        "r6_infer_follow_all",
        "paint.py",
        "if any(s in p.allow for s in n.fanin):",
        "if all(s in p.allow for s in n.fanin):",
        (*ENGINE, "tests/test_op_lists.py"),
        "pass 4 paints an infer op only when all its inputs are allow: x @ w + b (b a "
        "float32 parameter) and the tanh after it stay float32",
    ),
    # ---- graph.py ----------------------------------------------------------------------
    _m(
        "r6_carry_drops_copy",
        "graph.py",
        "origins.append(Origin(copy_of=o.copy_of, derived=derived))",
        "origins.append(Origin(derived=derived))",
        (*LOOPS, "tests/test_model_libraries.py"),
        "a loop carry forgets it copies a program input: a weight handed on unchanged "
        "through fori_loop and returned comes back rounded to half",
    ),
    # ---- emit.py -----------------------------------------------------------------------
    _m(
        "r6_read_no_clamp",
        "emit.py",
        "clamp(val, dtype) if const else val",
        "val",
        (*NUMERICS, "tests/test_fused_attention.py", "tests/test_user_models_numerics.py"),
        "a constant (captured finfo(float32).min mask) cast to half is not clamped: -inf, "
        "and a fully masked softmax row becomes NaN",
    ),
    _m(
        "r6_target_any_float",
        "emit.py",
        "return self.half if self.is_half(node) and is_f32(dtype) else dtype",
        "return self.half if self.is_half(node) and is_float(dtype) else dtype",
        (*ENGINE, "tests/test_complex_values.py"),
        "a half node retargets every float operand, not only float32: a user's bfloat16 "
        "value read by a float16-painted op is cast bf16 -> f16 (and its outputs' dtypes)",
    ),
    # ---- clamping.py -------------------------------------------------------------------
    _m(
        "r6_clamp_one_sided",
        "clamping.py",
        "big = jnp.isfinite(value) & ((value < lo) | (value > hi))",
        "big = jnp.isfinite(value) & (value > hi)",
        (*NUMERICS, "tests/test_fused_attention.py"),
        "a captured jax.Array constant is only checked against the top of the range: a "
        "mask of finfo(float32).min is returned unclamped and becomes -inf in half",
    ),
    # ---- loss_scale.py -----------------------------------------------------------------
    _m(
        "r6_refused_growth_keeps_count",
        "loss_scale.py",
        "good_if_finite = jnp.where(grow, jnp.zeros_like(next_good), next_good)",
        "good_if_finite = jnp.where(grow & can_grow, jnp.zeros_like(next_good), next_good)",
        LS,
        "good_steps not reset when growth is refused (at max_loss_scale / float32 max): "
        "TF1 resets it; the counter runs on past increment_period",
    ),
    _m(
        "r6_max_scale_exclusive",
        "loss_scale.py",
        "grown <= jnp.float32(self.max_loss_scale)",
        "grown < jnp.float32(self.max_loss_scale)",
        LS,
        "growth to exactly max_loss_scale refused: DynamicLossScale(8, max_loss_scale=16, "
        "increment_period=1) never reaches 16",
    ),
    # ---- loss_scale_optimizer.py -------------------------------------------------------
    _m(
        "r6_skip_plus_zero",
        "loss_scale_optimizer.py",
        "return -zeros if jnp.issubdtype(u.dtype, jnp.inexact) else zeros",
        "return zeros",
        (*LS, "tests/test_loss_scale_misuse.py"),
        "a skipped step returns +0.0 updates: a parameter at -0.0 comes back +0.0, so a "
        "skipped step is not bit-exact",
    ),
    _m(
        "r6_scale_at_least_one_initial",
        "loss_scale_optimizer.py",
        "return rule.min_loss_scale >= 1.0",
        "return rule.initial_loss_scale >= 1.0",
        (*LS, "tests/test_loss_scale_multidevice.py"),
        "the finiteness check trusts the scaled values when the INITIAL scale is >= 1: "
        "with min_loss_scale < 1 the scale can drop below 1, and a gradient finite when "
        "scaled but infinite once unscaled (g / 0.5 > float32 max) is applied",
    ),
    # ---- fp8.py ------------------------------------------------------------------------
    _m(
        "r6_fp8_min_dim_exclusive",
        "fp8.py",
        "v < rules.min_dim or",
        "v <= rules.min_dim or",
        ("tests/test_fp8.py", "tests/test_fp8_boundaries.py", "tests/test_generated_rules.py"),
        "a GEMM with M, N or K exactly min_dim (256) is refused float8",
    ),
    _m(
        "r6_fp8_scale_no_floor",
        "fp8.py",
        "jnp.maximum(amax / fmax, tiny)",
        "amax / fmax",
        ("tests/test_fp8.py", "tests/test_fp8_boundaries.py"),
        "float8 scale without its floor: a tensor of subnormal amax gets scale 0 (flushed) "
        "and x / 0 gives NaN/inf instead of zeros",
    ),
    # ---- attention_match.py / attention.py ---------------------------------------------
    _m(
        "r6_attention_bias_unscaled",
        "attention_match.py",
        "biases = [dataclasses.replace(b, coef=b.coef * c) for b in biases]",
        "biases = list(biases)",
        "tests/test_fused_attention.py",
        "a bias added before the scale ((q @ k + bias) * c) is fused unscaled: the fused "
        "kernel adds bias instead of c * bias",
    ),
    _m(
        "r6_attention_empty_row_any",
        "attention.py",
        "not const_keep.any(axis=-1).all()",
        "not const_keep.any(axis=-1).any()",
        "tests/test_fused_attention.py",
        "a constant mask with SOME fully masked rows gets no guard: those rows take the "
        "fused kernel's value instead of float32's (only an all-empty mask is guarded)",
    ),
    # ---- explain.py --------------------------------------------------------------------
    _m(
        "r6_conv_taps_padding",
        "explain.py",
        "0 <= (at := o * stride + t * rhs_dilation - low) < length",
        "0 <= (at := o * stride + t * rhs_dilation - low) <= length",
        ("tests/test_explain.py", "tests/test_explain_oracles.py", "tests/test_explain_view.py"),
        "a convolution's FLOPs count the tap one past the input's end (high padding) as "
        "reading an element: SAME convs over-counted",
    ),
    # ---- eager.py (compare's statistics) ----------------------------------------------
    _m(
        "r6_underflow_counts_zeros",
        "eager.py",
        "r_fin & (r != 0) & (h == 0)",
        "r_fin & (h == 0)",
        (
            "tests/test_compare.py",
            "tests/test_compare_oracle.py",
            "tests/test_gradient_underflow.py",
        ),
        "compare counts exact zeros of float32 (ReLU gradients) as underflow: false "
        "'gradient underflow' notes and inflated underflow counts",
    ),
    # ---- compare.py --------------------------------------------------------------------
    _m(
        "r6_first_exceeding_last",
        "compare.py",
        "st.first_exceed < first[0]",
        "st.first_exceed > first[0]",
        ("tests/test_compare.py", "tests/test_compare_oracle.py"),
        "first_exceeding names the equation that exceeded LAST in execution order, not "
        "where the error started",
    ),
)
