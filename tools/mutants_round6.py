"""Round 6 of planted bugs (issue 29's measure): 20 realistic one-line bugs in
``jmp_rewrite/_src``, written by a helper who had read the library, the docs and the TF
reference but NOT ``tests/`` nor the entries of ``tools/mutant_list.py`` (independence record:
this file as committed in d3e6944, before any test was read, each mutant's ``tests`` guessed
from the test files' names). Scored in ``runs/mutants_round6.md`` (17 of 18 caught); each now
names the test that caught it (the survivor's was added afterwards), the two equivalents why.

Run: ``.venv/bin/python tools/mutants.py --list-module tools.mutants_round6 --broad -j 1``.
"""

from __future__ import annotations

from tools.mutant_list import Mutant, _m  # _m: the list's own builder (a file under _src)

MUTANTS: tuple[Mutant, ...] = (
    _m(
        "r6_cond_frozen_any",
        "trace/origins.py",
        "frozen=all(o.frozen for o in origins),",
        "frozen=any(o.frozen for o in origins),",
        "tests/test_round4_numerics.py::test_a_cond_output_constant_in_one_branch_only_still_overflows",
        "a cond output is frozen (clamped when cast to half) when ANY branch is a constant: cond(p, lambda: full(-1e9), lambda: exp(x)) @ w saturates exp(12) to 65504 instead of overflowing honestly",
    ),
    _m(
        "r6_square_is_linear",
        "trace/origins.py",
        "derived = per[0] ^ per[1]",
        "derived = per[0] | per[1]",
        "tests/test_goldens.py::test_painting_goldens[generated]",
        "old * old counted as linear in old: a carry updated as h + h*h*dt (or output x*x + y) is taken for state and kept float32 instead of TF's colours",
    ),
    _m(
        "r6_float32_read_all",
        "paint/additions.py",
        "or any(c not in p.allow for c in g.nodes[v].fanout)",
        "or all(c not in p.allow for c in g.nodes[v].fanout)",
        "tests/test_goldens.py::test_painting_goldens[tf_patterns]",
        "keep_float32_reads_unrounded only when EVERY reader is float32: a LayerNorm scale's broadcast shared by a float32 forward mul and a half backward mul is rounded to half for the float32 reader again",
    ),
    _m(
        "r6_step_tail_scaling",
        "paint/additions.py",
        "_products(v) > 1",
        "_products(v) >= 1",
        "tests/test_goldens.py::test_painting_goldens[generated]",
        "the state update's tail stops at a scaling by a literal: p - 0.01 * g computes 0.01 * g in half (the learning-rate product rounded) instead of float32",
    ),
    _m(
        "r6_infer_follow_all",
        "paint/passes.py",
        "if any(s in p.allow for s in n.fanin):",
        "if all(s in p.allow for s in n.fanin):",
        "tests/test_goldens.py::test_painting_goldens[tf_patterns]",
        "pass 4 paints an infer op only when all its inputs are allow: x @ w + b (b a float32 parameter) and the tanh after it stay float32",
    ),
    _m(
        "r6_carry_drops_copy",
        "trace/graph.py",
        "origins.append(Origin(copy_of=o.copy_of, derived=derived, big=o.big))",
        "origins.append(Origin(derived=derived, big=o.big))",
        (
            "tests/test_goldens.py",
            "tests/test_state_in_loops.py",
            "tests/test_painting_flow.py",
            "tests/test_model_libraries.py",
        ),
        "a loop carry forgets it copies a program input: a weight handed on unchanged through fori_loop and returned comes back rounded to half",
        survives="equivalent: JAX forwards a carry handed on unchanged into a constant before the rewrite sees it (probe: same painting, exact values)",
    ),
    _m(
        "r6_read_no_clamp",
        "emit/emitter.py",
        "clamp(val, dtype) if const else val",
        "val",
        "tests/test_round4_numerics.py::test_padded_rows_are_uniform_as_in_float32[finfo-eager-f16]",
        "a constant (captured finfo(float32).min mask) cast to half is not clamped: -inf, and a fully masked softmax row becomes NaN",
    ),
    _m(
        "r6_target_any_float",
        "emit/emitter.py",
        "return self.half if self.is_half(node) and is_f32(dtype) else dtype",
        "return self.half if self.is_half(node) and is_float(dtype) else dtype",
        (
            "tests/test_goldens.py",
            "tests/test_rewrite.py",
            "tests/test_dtype_decisions.py",
            "tests/test_tf_patterns.py",
            "tests/test_complex_values.py",
        ),
        "a half node retargets every float operand, not only float32: a user's bfloat16 value read by a float16-painted op is cast bf16 -> f16 (and its outputs' dtypes)",
        survives="equivalent: only float32 nodes are painted allow, and mixed-dtype ops are no float32 nodes (probe: identical painting and values)",
    ),
    _m(
        "r6_clamp_one_sided",
        "emit/clamping.py",
        "big = jnp.isfinite(value) & ((value < lo) | (value > hi))",
        "big = jnp.isfinite(value) & (value > hi)",
        "tests/test_round4_numerics.py::test_padded_rows_are_uniform_as_in_float32[finfo-eager-f16]",
        "a captured jax.Array constant is only checked against the top of the range: a mask of finfo(float32).min is returned unclamped and becomes -inf in half",
    ),
    _m(
        "r6_refused_growth_keeps_count",
        "loss_scale/scale.py",
        "good_if_finite = jnp.where(grow, jnp.zeros_like(next_good), next_good)",
        "good_if_finite = jnp.where(grow & can_grow, jnp.zeros_like(next_good), next_good)",
        "tests/test_goldens.py::test_painting_goldens[models]",
        "good_steps not reset when growth is refused (at max_loss_scale / float32 max): TF1 resets it; the counter runs on past increment_period",
    ),
    _m(
        "r6_max_scale_exclusive",
        "loss_scale/scale.py",
        "grown <= jnp.float32(self.max_loss_scale)",
        "grown < jnp.float32(self.max_loss_scale)",
        "tests/test_loss_scale.py::test_growth_may_reach_max_loss_scale_exactly[eager]",
        "growth to exactly max_loss_scale refused: DynamicLossScale(8, max_loss_scale=16, increment_period=1) never reaches 16",
    ),
    _m(
        "r6_skip_plus_zero",
        "loss_scale/optimizer.py",
        "return -zeros if jnp.issubdtype(u.dtype, jnp.inexact) else zeros",
        "return zeros",
        "tests/test_goldens.py::test_painting_goldens[models]",
        "a skipped step returns +0.0 updates: a parameter at -0.0 comes back +0.0, so a skipped step is not bit-exact",
    ),
    _m(
        "r6_scale_at_least_one_initial",
        "loss_scale/optimizer.py",
        "return rule.min_loss_scale >= 1.0",
        "return rule.initial_loss_scale >= 1.0",
        "tests/test_loss_scale_misuse.py::test_dynamic_scale_backed_off_below_one_skips_a_gradient_that_overflows_only_unscaled[False]",
        "the finiteness check trusts the scaled values when the INITIAL scale is >= 1: with min_loss_scale < 1 the scale can drop below 1, and a gradient finite when scaled but infinite once unscaled (g / 0.5 > float32 max) is applied",
    ),
    _m(
        "r6_fp8_min_dim_exclusive",
        "fp8.py",
        "v < rules.min_dim or",
        "v <= rules.min_dim or",
        "tests/test_goldens.py::test_painting_goldens[models]",
        "a GEMM with M, N or K exactly min_dim (256) is refused float8",
    ),
    _m(
        "r6_fp8_scale_no_floor",
        "fp8.py",
        "jnp.maximum(amax / fmax, tiny)",
        "amax / fmax",
        "tests/test_fp8.py::test_tiny_operands_do_not_turn_into_nan[1e-37-float8_e4m3fn]",
        "float8 scale without its floor: a tensor of subnormal amax gets scale 0 (flushed) and x / 0 gives NaN/inf instead of zeros",
    ),
    _m(
        "r6_attention_bias_unscaled",
        "attention/match.py",
        "biases = [dataclasses.replace(b, coef=b.coef * c) for b in biases]",
        "biases = list(biases)",
        "tests/test_fused_attention.py::test_each_mask_spelling_fuses_with_its_meaning[bias_then_scale]",
        "a bias added before the scale ((q @ k + bias) * c) is fused unscaled: the fused kernel adds bias instead of c * bias",
    ),
    _m(
        "r6_attention_empty_row_any",
        "attention/select.py",
        "not const_keep.any(axis=-1).all()",
        "not const_keep.any(axis=-1).any()",
        "tests/test_fused_attention.py::test_a_constant_mask_with_some_rows_without_keys_gives_them_float32s_value",
        "a constant mask with SOME fully masked rows gets no guard: those rows take the fused kernel's value instead of float32's (only an all-empty mask is guarded)",
    ),
    _m(
        "r6_conv_taps_padding",
        "explain/build.py",
        "0 <= (at := o * stride + t * rhs_dilation - low) < length",
        "0 <= (at := o * stride + t * rhs_dilation - low) <= length",
        "tests/test_goldens.py::test_painting_goldens[tf_patterns]",
        "a convolution's FLOPs count the tap one past the input's end (high padding) as reading an element: SAME convs over-counted",
    ),
    _m(
        "r6_underflow_counts_zeros",
        "compare/eager.py",
        "r_fin & (r != 0) & (h == 0)",
        "r_fin & (h == 0)",
        "tests/test_compare.py::test_benign_program_has_small_errors_and_no_suggestions[float16]",
        "compare counts exact zeros of float32 (ReLU gradients) as underflow: false 'gradient underflow' notes and inflated underflow counts",
    ),
    _m(
        "r6_first_exceeding_last",
        "compare/run.py",
        "st.first_exceed < first[0]",
        "st.first_exceed > first[0]",
        "tests/test_compare.py::test_mul_between_two_matmuls_then_the_matmul_that_reads_it",
        "first_exceeding names the equation that exceeded LAST in execution order, not where the error started",
    ),
)
