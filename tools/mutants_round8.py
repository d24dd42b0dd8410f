"""Round 8 of planted bugs: 16 realistic one-line bugs in the rules added this round
(``git log -p 7f7ab3c..HEAD -- jmp_rewrite/``): float32 values handed into loops and
``shard_map`` (``emit.Emitter._handed_in``, ``graph_records.sums_over_trips``,
``higher_order.PER_TRIP``), gradients through moved fills (``tangents.Unsaturated.hand_on``,
``hands_on``, ``HANDS_ON``), ``value_and_grad`` with Flax NNX objects (``nnx_support``,
``loss_scale_state``), fused attention (grouped-query attention, the batch > 1 bias-gradient
guard, 64-mod-128 padding, head dim 256 on Hopper), ``--tolerance`` validation and
``Fp8NoneSelectedWarning``'s counts. Written by a helper who had read the library
(``jmp_rewrite/``), ``docs/``, ``README.md``, ``tools/mutants.py`` and the format of
``tools/mutants_round7.py`` (its header and a couple of entries), but NOT ``tests/`` nor the
entries of ``tools/mutant_list.py`` nor ``runs/`` (independence record: this file as first
committed, before any test was read; each mutant's ``tests`` guessed from the test files'
names in ``ls tests/`` only). First scored (``--no-baseline -j 2``, targeted files, not
``--broad``: the shared CPU was too slow): 9 of 16 caught, 7 survived; each caught mutant's
``tests`` was then narrowed to the test that caught it. Then (branch pins9) a test was added
for six of the survivors and each names it; ``r8_handed_in_big_not_saturating``, probed, was
no test gap but a bug of the code that the mutant fixed: the fix is applied, and the mutant
now puts the old code back. Re-scored with the baseline, ``-j 1``: 15 of 16 caught
(``runs/mutants_round8.md``).

Run: ``.venv/bin/python tools/mutants.py --list-module tools.mutants_round8 --broad -j 2``.
"""

from __future__ import annotations

from tools.mutant_list import Mutant, _m  # _m: the list's own builder (a file under _src)

MUTANTS: tuple[Mutant, ...] = (
    # -- float32 values handed into loops and shard_map ------------------------------------
    # Planted as dropping ``self._big(rec, i)``; probed, that was the fix (applied
    # 2026-12-02 with ScopeRec.big_outputs): the mutant is now the old code put back.
    _m(
        "r8_handed_in_big_not_saturating",
        "emit/emitter.py",
        "            if not (_clamped(rec, i) or jc.is_literal(a)) and is_f32(jnp.result_type(read(a))):",
        "            if not (_clamped(rec, i) or self._big(rec, i) or jc.is_literal(a)) and is_f32(jnp.result_type(read(a))):",
        "tests/test_mask_values.py::test_the_gradient_through_a_big_value_read_in_a_loop_is_the_unrolled_loops",
        "a big float32 value read by a loop is cast into half outside it again: the body's "
        "derivative reads the pinned half value (grad(rewrite(f)) of a scan reading a "
        "computed -1e9 mask bias: float16 gradients 100% off float32)",
    ),
    # caught by tests/test_loop_cotangents.py::test_a_shard_map_without_a_loop_takes_its_float32_weight_as_it_is
    _m(
        "r8_summing_kinds_no_shard_map",
        "trace/graph_records.py",
        'SUMMING_KINDS = ("scan", "while", "shard_map")',
        'SUMMING_KINDS = ("scan", "while")',
        "tests/test_loop_cotangents.py::test_a_shard_map_without_a_loop_takes_its_float32_weight_as_it_is",
        "a float32 weight read in half inside shard_map is cast to half outside again: its "
        "cotangent is summed over devices in half precision",
    ),
    # caught by tests/test_loop_cotangents.py::test_scanned_float32_slices_read_in_half_are_cast_once_before_the_loop
    _m(
        "r8_per_trip_no_xs",
        "trace/higher_order.py",
        'PER_TRIP = ("carry", "xs")',
        'PER_TRIP = ("carry",)',
        "tests/test_loop_cotangents.py::test_scanned_float32_slices_read_in_half_are_cast_once_before_the_loop",
        "a scan's float32 xs read in half are handed in as float32 and cast per trip inside "
        "(a stacked float32 cotangent, twice the memory; the slice is cast after slicing)",
    ),
    # -- gradients through moved fills -----------------------------------------------------
    # caught by tests/test_mask_values.py::test_the_gradient_through_a_moved_fill_is_the_fills[where_call-float16]
    _m(
        "r8_hands_on_no_select_n",
        "emit/tangents.py",
        '"concatenate", "pad", "select_n", "tile"}',
        '"concatenate", "pad", "tile"}',
        "tests/test_mask_values.py::test_the_gradient_through_a_moved_fill_is_the_fills[where_call-float16]",
        "a select_n choosing a saturated fill no longer stands for the select of its float32 "
        "value: a derivative reading it (a later max/exp tangent) sees the pinned half fill",
    ),
    # caught by tests/test_mask_values.py::test_the_gradient_through_a_moved_fill_is_the_fills[dynamic_slice-float16]
    _m(
        "r8_hand_on_any_operand_unsaturated",
        "emit/tangents.py",
        "        if not saturated or all(s is None for s in saturated) or not hands_on(eqn):",
        "        if not saturated or any(s is None for s in saturated) or not hands_on(eqn):",
        "tests/test_mask_values.py::test_the_gradient_through_a_moved_fill_is_the_fills[dynamic_slice-float16]",
        "any for all: a concatenate or pad of a saturated fill and a computed value (one "
        "operand unsaturated) hands on nothing, so its derivative reads the half fill",
    ),
    # caught by tests/test_mask_values.py::test_the_gradient_through_a_moved_fill_is_the_fills[pad_by_zeros-float16]
    _m(
        "r8_hand_on_other_operands_not_cast_back",
        "emit/tangents.py",
        "            return cast(v, atom.aval.dtype) if is_float(jnp.result_type(v)) else v",
        "            return v",
        "tests/test_mask_values.py::test_the_gradient_through_a_moved_fill_is_the_fills[pad_by_zeros-float16]",
        "the unsaturated operands of a concatenate/pad/select_n stay half while the "
        "saturated one is float32: the float32 equation is bound on mixed dtypes",
    ),
    # caught by tests/test_mask_values.py::test_a_call_of_a_move_and_arithmetic_on_a_fill_is_no_move
    _m(
        "r8_hands_on_call_any_move",
        "emit/tangents.py",
        "and all(map(hands_on, layout.inner().eqns))",
        "and any(map(hands_on, layout.inner().eqns))",
        "tests/test_mask_values.py::test_a_call_of_a_move_and_arithmetic_on_a_fill_is_no_move",
        "any for all: a call holding one move and arithmetic (not only moves) hands on its "
        "float32 value as if it were a move",
    ),
    # -- value_and_grad with NNX objects ---------------------------------------------------
    # caught by tests/test_nnx_state.py::test_batch_stats_move_as_with_nnx_value_and_grad[eager]
    _m(
        "r8_nnx_argnum_zero_counted_from_end",
        "nnx_support.py",
        "        return a + n_args if isinstance(a, int) and a < 0 else a",
        "        return a + n_args if isinstance(a, int) and a <= 0 else a",
        "tests/test_nnx_state.py::test_batch_stats_move_as_with_nnx_value_and_grad[eager]",
        "off by one: argnums=0 counted from the end, so the keywords' dict (one more "
        "positional argument) is differentiated instead of the first argument",
    ),
    # caught by tests/test_nnx_state.py::test_a_module_passed_only_by_keyword_keeps_its_updates
    _m(
        "r8_nnx_keywords_not_looked_in",
        "loss_scale/state.py",
        "        if nnx_support.holds_graph_nodes((args, kwargs)) or _any_diff_state(argnums):",
        "        if nnx_support.holds_graph_nodes(args) or _any_diff_state(argnums):",
        "tests/test_nnx_state.py::test_a_module_passed_only_by_keyword_keeps_its_updates",
        "an NNX module passed only as a keyword goes through jax.value_and_grad: what fun "
        "sets on it (BatchNorm statistics, Rngs counts) is not written back",
    ),
    # -- fused attention -------------------------------------------------------------------
    # caught by tests/test_fused_attention.py::test_a_bias_over_batch_and_heads_of_batch_above_one_is_left_with_the_reason
    _m(
        "r8_bias_guard_heads_not_learned",
        "attention/select.py",
        '            learned = any(lab in ("t", heads) for lab in b.dims if lab is not None)',
        '            learned = any(lab == "t" for lab in b.dims if lab is not None)',
        "tests/test_fused_attention.py::test_a_bias_over_batch_and_heads_of_batch_above_one_is_left_with_the_reason",
        "a bias over batch and heads (ALiBi-like, computed from float inputs) with batch > 1 "
        "is fused: cuDNN's bias gradient is for batch 1 only",
    ),
    # caught by tests/test_fused_attention.py::test_cudnn_lengths_64_mod_128_with_a_mask_are_padded_to_128[64-causal]
    _m(
        "r8_padding_without_mask",
        "emit/attention.py",
        "    if explicit and n % _TILE == _TILE // 2:",
        "    if n % _TILE == _TILE // 2:",
        "tests/test_fused_attention.py::test_cudnn_lengths_64_mod_128_with_a_mask_are_padded_to_128[64-causal]",
        "missing condition: a length 64 mod 128 with neither mask nor bias is padded to a "
        "multiple of 128 too (more work; a sequence-length mask where none was needed)",
    ),
    # caught by tests/test_fused_attention.py::test_grouped_query_rows_without_keys_get_the_mean_of_their_own_kv_heads_values
    _m(
        "r8_gqa_guard_tiled_heads",
        "emit/attention.py",
        "        mean = jnp.repeat(mean, core.group, axis=2)  # (B, 1, N, D)",
        "        mean = jnp.tile(mean, (1, 1, core.group, 1))  # (B, 1, N, D)",
        "tests/test_fused_attention.py::test_grouped_query_rows_without_keys_get_the_mean_of_their_own_kv_heads_values",
        "tile for repeat: a fully masked row of grouped-query attention (finite fill) gets "
        "the mean values of another key/value head (the heads of a group sit next to each "
        "other)",
    ),
    # caught by tests/test_fused_attention.py::test_head_dims_up_to_256_on_hopper_with_cudnn_9_5[hopper-9.5]
    _m(
        "r8_head_dim_256_not_on_hopper",
        "attention/match.py",
        "found[0] >= (9, 0) and found[1] >= (9, 5)",
        "found[0] > (9, 0) and found[1] >= (9, 5)",
        "tests/test_fused_attention.py::test_head_dims_up_to_256_on_hopper_with_cudnn_9_5[hopper-9.5]",
        "off by one: head dim 256 is fused above Hopper (compute capability 10.0) but not "
        "on Hopper itself",
    ),
    # caught by tests/test_fused_attention.py::test_grouped_query_attention_as_a_grouped_einsum_fuses_with_fewer_kv_heads[bf16]
    _m(
        "r8_gqa_keys_grouped",
        "attention/match.py",
        'rl = _operand_labels(rhs, rc[0], rb, "s" if s_side == 1 else "t", grouped=s_side == 0)',
        'rl = _operand_labels(rhs, rc[0], rb, "s" if s_side == 1 else "t", grouped=s_side == 1)',
        "tests/test_fused_attention.py::test_grouped_query_attention_as_a_grouped_einsum_fuses_with_fewer_kv_heads[bf16]",
        "the group dim is allowed on the keys (the logits dot's second operand) rather than "
        "the queries: keys with an extra free dim are taken for grouped-query attention and "
        "grouped queries (queries second) are refused",
    ),
    # -- cli, fp8 --------------------------------------------------------------------------
    # caught by tests/test_cli.py::test_compare_refuses_a_bad_tolerance[0]
    _m(
        "r8_tolerance_zero_accepted",
        "cli/main.py",
        "    if not (math.isfinite(value) and value > 0):",
        "    if not (math.isfinite(value) and value >= 0):",
        "tests/test_cli.py::test_compare_refuses_a_bad_tolerance[0]",
        "off by one: --tolerance 0 is accepted (compare then fails later, not as a usage "
        "error naming the value)",
    ),
    # caught by tests/test_fp8_boundaries.py::test_shape_reasons_are_counted_by_kind
    _m(
        "r8_fp8_shape_count_distinct",
        "fp8.py",
        '        parts.insert(0, f"{len(shapes)} x {shapes[0]}{first}")',
        '        parts.insert(0, f"{len(set(shapes))} x {shapes[0]}{first}")',
        "tests/test_fp8_boundaries.py::test_shape_reasons_are_counted_by_kind",
        "Fp8NoneSelectedWarning counts the distinct shape reasons, not the matmuls left "
        "bfloat16 for their shape (two matmuls of one odd shape read 1 x)",
    ),
)
