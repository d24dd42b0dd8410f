"""The curated mutants of ``tools/mutants.py``: realistic one-line bugs in ``jmp_rewrite/_src``.

Each :class:`Mutant` replaces one snippet (which must occur exactly once in its file) with a
buggy version and names the tests that should catch it (pytest node ids; a test function
without parameters runs all of them). Issue 17's numbered items are marked ``[17.n]``.
When the source changes, ``tests/test_mutant_list.py`` fails for a mutant whose snippet no
longer matches: update the snippet (or drop the mutant if the code it guarded is gone).

A mutant the suite cannot catch gets ``survives="why"``: an equivalent change, or one whose
effect no test on a CPU can observe. Keep that list short and explained.
"""

from __future__ import annotations

import dataclasses

_SRC = "jmp_rewrite/_src/"


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    bug: str
    survives: str = ""


T_DTYPES = "tests/test_dtype_decisions.py::"
T_OPS = "tests/test_op_lists.py::"
T_TF = "tests/test_tf_patterns.py"
T_REWRITE = "tests/test_rewrite.py::"
T_INV = "tests/test_invariants.py::"
T_LS = "tests/test_loss_scale.py"
T_LSO = "tests/test_loss_scale_optimizer.py::"
T_NUM = "tests/test_numerics.py::"
T_LOOPS = "tests/test_state_in_loops.py::"
T_LIBS = "tests/test_model_libraries.py::"


def _m(name, file, original, replacement, tests, bug, survives=""):
    tests = (tests,) if isinstance(tests, str) else tuple(tests)
    return Mutant(name, _SRC + file, original, replacement, tests, bug, survives)


MUTANTS: tuple[Mutant, ...] = (
    # ---- paint.py: TF's passes -----------------------------------------------------------------
    _m(
        "paint.cast_any_reader_half",
        "paint.py",
        "            if all(c in p.allow for c in n.fanout):",
        "            if any(c in p.allow for c in n.fanout):",
        T_DTYPES + "test_a_cast_read_by_a_half_matmul_and_a_float32_op_stays_float32",
        "[17.2] a user's cast goes half when one reader is half",
    ),
    _m(
        "paint.cast_feeding_output_retargeted",
        "paint.py",
        "        if n.is_cast and n.process and n.fanout and not n.feeds_output:",
        "        if n.is_cast and n.process and n.fanout:",
        T_DTYPES + "test_a_cast_whose_value_is_an_output_stays_float32",
        "[17.3] a cast whose value is an output is retargeted to half",
    ),
    _m(
        "paint.cast_rule_disabled",
        "paint.py",
        "        if n.is_cast and n.process and n.fanout and not n.feeds_output:",
        "        if False:",
        T_DTYPES + "test_a_cast_read_only_by_half_ops_casts_straight_to_half",
        "TF's MakeCastsAllowIfAllOutputsAllow never runs (an extra cast)",
    ),
    _m(
        "paint.force_all_forces_casts",
        "paint.py",
        "(force_all and n.float32 and not n.is_cast)",
        "(force_all and n.float32)",
        T_DTYPES + "test_a_cast_whose_value_is_an_output_stays_float32",
        "[17.3] UNSAFE_FORCE_ALL also forces a cast that feeds an output",
    ),
    _m(
        "paint.allow_ignores_process",
        "paint.py",
        "        if n.process and (n.kind == ALLOW or (force_all",
        "        if (n.kind == ALLOW or (force_all",
        (
            T_DTYPES + "test_a_float32_region_holds_under_unsafe_force_all",
            T_REWRITE + "test_float32_region_is_never_converted_and_casts_back_on_entry",
        ),
        "UNSAFE_FORCE_ALL converts ops inside a float32 region",
    ),
    _m(
        "paint.deny_spreads_through_everything",
        "paint.py",
        "            lambda v, r: v.id == r or (v.id not in reached and v.id in upstream),",
        "            lambda v, r: v.id == r or v.id not in reached,",
        T_TF,
        "deny propagates forward through clear ops that lead to no deny/infer op",
    ),
    _m(
        "paint.between_allow_clear_only",
        "paint.py",
        "            lambda v, r: v.id == r or (v.kind in (CLEAR, INFER) and _eligible(v, p)),",
        "            lambda v, r: v.id == r or (v.kind == CLEAR and _eligible(v, p)),",
        T_TF,
        "pass 3 skips infer ops between two allow ops",
    ),
    _m(
        "paint.infer_follows_allow_despite_deny",
        "paint.py",
        "        if any(s in p.deny for s in n.fanin):",
        "        if False:",
        T_TF,
        "pass 4 paints an infer op with a deny input",
        survives="equivalent: pass 2 has already painted deny every infer op a deny op feeds "
        "(deny flows forward through infer ops unconditionally), and pass 4 skips deny "
        "nodes; the check is TF's code, kept for parity",
    ),
    _m(
        "paint.clear_propagation_downstream_only",
        "paint.py",
        "    for v in _dfs(roots, lambda n: [*n.fanin, *n.fanout], g.nodes, enter):",
        "    for v in _dfs(roots, lambda n: n.fanout, g.nodes, enter):",
        T_TF,
        "pass 5 no longer spreads allow upstream through clear ops (casts after a reshape)",
    ),
    _m(
        "paint.pass6_disabled",
        "paint.py",
        "        if n.id in p.allow and n.kind == ALLOW and not n.float32:",
        "        if False:",
        T_DTYPES + "test_matmuls_with_half_operands_keep_their_dtypes_and_float32_output",
        "[17.1] an allowlist op on half operands stays painted (TF RemoveAllowsetWithFp32)",
    ),
    _m(
        "paint.unit_deny_pieces_half",
        "paint.py",
        " and n.unit in p.allow and n.listed_kind != DENY:",
        " and n.unit in p.allow:",
        T_REWRITE + "test_named_unit_log_softmax_runs_whole_in_half_between_matmuls",
        "a half log_softmax unit computes its exp and sum in half too",
    ),
    _m(
        "paint.output_copies_not_kept",
        "paint.py",
        "    roots = [s for s, o, _ in g.outputs if s is not None and o.copy_of is not None]",
        "    roots = []",
        T_INV + "test_item1_passthrough_of_inner_call_is_bit_exact",
        "an input handed on to an output comes back rounded",
        survives="equivalent since keep_float32_reads_unrounded (issue 15): a clear op that only "
        "moves float32 values and is read by an output stays float32 anyway, so a copy of an "
        "input reaches its output exact without this pass too (no reshape, transpose, slice, "
        "jit, checkpoint or loop-carry passthrough found that differs, UNSAFE_FORCE_ALL "
        "included); the pass states TF's fetch-node rule on its own and stays as its guard",
    ),
    _m(
        "paint.state_updates_not_kept",
        "paint.py",
        "            if inp is not None and inp.shape == aval.shape and is_f32(inp.dtype):",
        "            if False:",
        (
            T_DTYPES + "test_a_running_average_between_two_matmuls_is_updated_in_float32",
            T_INV + "test_item2_state_update_between_two_matmuls_is_float32",
        ),
        "a running average between two matmuls is updated in half",
    ),
    _m(
        "paint.centring_not_a_statistic",
        "paint.py",
        '    {"square", "integer_pow", "mul", "sub", "div", "convert_element_type",',
        '    {"square", "integer_pow", "mul", "div", "convert_element_type",',
        T_DTYPES + "test_normalization_statistics_and_centring_stay_float32",
        "[17.7] the centring x - mean of a normalization statistic runs in half",
    ),
    _m(
        "paint.statistics_pass_disabled",
        "paint.py",
        "    keep_normalization_statistics_float32(g, p)\n",
        "    pass\n",
        T_DTYPES + "test_normalization_statistics_and_centring_stay_float32",
        "normalization statistics (mean, variance, rsqrt) follow the lists",
    ),
    _m(
        "paint.statistics_climb_through_matmuls",
        "paint.py",
        "        return n.eqn is not None and n.unit is None and not n.region and n.listed_kind != ALLOW",
        "        return n.eqn is not None and n.unit is None and not n.region",
        T_DTYPES + "test_normalization_statistics_and_centring_stay_float32",
        "an allowlist op between an rsqrt and a reduction is kept float32 with the statistic",
        survives="equivalent for statistics computed by reductions: the walks stop at "
        "reductions and at keys outside the statistic inputs, so an allow op is reached only "
        "when a matmul computes the statistic itself (einsum('bd,bd->b', c, c) as the "
        "variance); the mutant would then keep that matmul float32, arguably no worse, and "
        "no test pins that choice",
    ),
    _m(
        "paint.opaque_bodies_ignored_when_nothing_painted",
        "paint.py",
        "    if not p.allow and not g.opaque_allow:",
        "    if not p.allow:",
        T_DTYPES + "test_custom_linear_solve_bodies_are_rewritten",
        "a program whose only matmuls sit in a custom_linear_solve is not rewritten",
    ),
    # ---- graph.py: the painting graph ------------------------------------------------------
    _m(
        "graph.is_float32_outputs_only",
        "graph.py",
        "    dtypes = [a.aval.dtype for a in _float_atoms([*eqn.invars, *eqn.outvars])]",
        "    dtypes = [a.aval.dtype for a in _float_atoms(eqn.outvars)]",
        T_DTYPES + "test_matmuls_with_half_operands_keep_their_dtypes_and_float32_output",
        "[17.1] a bf16 matmul with a float32 output counts as float32 (its output goes half)",
    ),
    _m(
        "graph.is_float32_first_operand",
        "graph.py",
        "    dtypes = [a.aval.dtype for a in _float_atoms([*eqn.invars, *eqn.outvars])]",
        "    dtypes = [a.aval.dtype for a in _float_atoms([*eqn.invars[:1], *eqn.outvars])]",
        T_DTYPES + "test_matmuls_with_half_operands_keep_their_dtypes_and_float32_output",
        "[17.1] 'is it float32' reads the first operand only",
    ),
    _m(
        "graph.is_float32_any",
        "graph.py",
        "    return bool(dtypes) and all(is_f32(d) for d in dtypes)",
        "    return bool(dtypes) and any(is_f32(d) for d in dtypes)",
        T_DTYPES + "test_matmuls_with_half_operands_keep_their_dtypes_and_float32_output",
        "[17.1] one float32 value makes an equation float32",
    ),
    _m(
        "op_lists.cube_is_square",
        "op_lists.py",
        '{-1: "reciprocal", 2: "square"}',
        '{-1: "reciprocal", 2: "square", 3: "square"}',
        T_DTYPES + "test_cubes_stay_float32_in_float16",
        "x**3 takes Square's list instead of Pow's (deny)",
    ),
    _m(
        "origins.computed_values_clamped",
        "origins.py",
        "    const = all(o.const for o in ins)",
        "    const = any(o.const for o in ins)",
        T_DTYPES + "test_computed_values_overflow_honestly",
        "a value computed from an input and a constant is clamped instead of overflowing",
    ),
    _m(
        "graph.input_output_wants_half",
        "graph.py",
        "                rec.consumers[atom].append(None)",
        "                pass",
        T_INV + "test_item1_passthrough_of_inner_call_is_bit_exact",
        "a call passes an input it returns cast to half when its readers are half",
    ),
    _m(
        "origins.sub_not_a_state_update",
        "origins.py",
        'COMBINES = ("add", "sub", "add_any")',
        'COMBINES = ("add", "add_any")',
        T_DTYPES + "test_a_running_average_between_two_matmuls_is_updated_in_float32",
        "new = old - lr * g (a plain SGD step) is not seen as a state update",
    ),
    _m(
        "higher_order.namedtuple_bodies_hidden",
        "higher_order.py",
        "        for v in value if isinstance(value, tuple) else (value,):",
        "        for v in value if type(value) is tuple else (value,):",
        T_DTYPES + "test_custom_linear_solve_bodies_are_rewritten",
        "custom_linear_solve's bodies (a named tuple) are never rewritten",
    ),
    # ---- emit.py: re-emission ----------------------------------------------------------------
    _m(
        "emit.captured_constants_not_clamped",
        "emit.py",
        "convert_element_type(clamp(val, dtype) if const else val, dtype)",
        "convert_element_type(val, dtype)",
        T_DTYPES + "test_mask_constants_are_clamped_to_the_half_range",
        "[17.4] captured array constants overflow to -inf (a fully masked row is NaN)",
    ),
    _m(
        "emit.constant_casts_not_clamped",
        "emit.py",
        "                if _const(rec, 0):\n                    operand = clamp(operand, self.half)",
        "                if False:\n                    operand = clamp(operand, self.half)",
        T_DTYPES + "test_mask_constants_are_clamped_to_the_half_range",
        "[17.4] a retargeted cast of a constant overflows",
    ),
    _m(
        "emit.literals_not_clamped",
        "emit.py",
        "    return np.asarray(clamp(np.asarray(value), dtype), dtype=dtype)",
        "    return np.asarray(value, dtype=dtype)",
        T_DTYPES + "test_mask_constants_are_clamped_to_the_half_range",
        "[17.4] Python-number constants overflow to -inf",
    ),
    _m(
        "emit.clamp_array_infinities",
        "emit.py",
        "            big = jnp.isfinite(value) & ((value < lo) | (value > hi))",
        "            big = (value < lo) | (value > hi)",
        T_DTYPES + "test_infinite_constants_stay_infinite",
        "an infinite captured constant is clamped to the largest finite half",
    ),
    _m(
        "emit.clamp_literal_infinities",
        "emit.py",
        "    return np.where(np.isfinite(value), np.clip(value, lo, hi), value).astype(value.dtype)",
        "    return np.clip(value, lo, hi).astype(value.dtype)",
        T_DTYPES + "test_infinite_constants_stay_infinite",
        "an infinite literal is clamped to the largest finite half",
    ),
    _m(
        "emit.half_sum_accumulates_in_half",
        "emit.py",
        '    "reduce_sum",\n    "cumsum",\n    "reduce_window_sum",',
        '    "cumsum",\n    "reduce_window_sum",',
        (
            T_NUM + "test_bf16_reduce_sum_accumulates_in_float32",
            T_DTYPES + "test_gather_and_broadcast_gradients_accumulate_in_float32",
        ),
        "a bf16 reduce_sum painted half accumulates in half",
    ),
    _m(
        "emit.half_scatter_add_accumulates_in_half",
        "emit.py",
        '    "scatter-add",\n    "scatter-sub",\n    "psum",',
        '    "scatter-sub",\n    "psum",',
        (T_INV + "test_item3_scatter_add_accumulates_in_float32",),
        "a bf16 scatter-add painted half accumulates in half",
    ),
    _m(
        "emit.no_float32_tangents",
        "emit.py",
        'TRANSPOSE_ACCUMULATES = ("gather", "broadcast_in_dim", "add", "sub", "mul", "div", "max", "min")',
        "TRANSPOSE_ACCUMULATES = ()",
        T_DTYPES + "test_gather_and_broadcast_gradients_accumulate_in_float32",
        "[17.5] grad(rewrite(f)) accumulates gather/broadcast gradients in half",
    ),
    _m(
        "emit.no_float32_tangents_for_implicit_broadcast",
        "emit.py",
        'TRANSPOSE_ACCUMULATES = ("gather", "broadcast_in_dim", "add", "sub", "mul", "div", "max", "min")',
        'TRANSPOSE_ACCUMULATES = ("gather", "broadcast_in_dim")',
        T_DTYPES + "test_gather_and_broadcast_gradients_accumulate_in_float32",
        "[17.5] grad(rewrite(f)) sums a bias gradient (x @ w + b) in half",
    ),
    _m(
        "emit.no_float32_tangents_for_gather",
        "emit.py",
        "        return not _const(rec, 0)\n    size = eqn.outvars[0].aval.size",
        "        return False\n    size = eqn.outvars[0].aval.size",
        T_DTYPES + "test_gather_and_broadcast_gradients_accumulate_in_float32",
        "[17.5] grad(rewrite(f)) accumulates an embedding gradient in half",
    ),
    _m(
        "emit.half_matmul_keeps_float32_output",
        "emit.py",
        "                if key in params and params[key] is not None and is_f32(params[key]):",
        "                if False:",
        T_DTYPES + "test_matmuls_with_half_operands_keep_their_dtypes_and_float32_output",
        "a half matmul asked for float32 output keeps it (a float32 result, half inputs)",
    ),
    _m(
        "emit.call_operand_cast_for_one_reader",
        "emit.py",
        "        return wanted.pop() if len(wanted) == 1 else None",
        "        return min(wanted, key=str)",
        T_DTYPES + "test_a_call_operand_read_by_half_and_float32_ops_reaches_both_exactly",
        "a jit operand read by a half and a float32 op inside is passed in half",
    ),
    _m(
        "emit.half_sum_reads_half",
        "emit.py",
        "            return bind(eqn, [read(a, a.aval.dtype) for a in eqn.invars], eqn.params)",
        "            return bind(eqn, [read(a, self.half) for a in eqn.invars], eqn.params)",
        T_DTYPES + "test_gather_and_broadcast_gradients_accumulate_in_float32",
        "a half sum reads its operands in half",
    ),
    _m(
        "emit.outputs_not_cast_back",
        "emit.py",
        "        return [read(a, d) for a, d in zip(jaxpr.outvars, out_dtypes, strict=True)]",
        "        return [read(a) for a in jaxpr.outvars]",
        T_REWRITE + "test_matches_float32_and_keeps_signature",
        "rewritten outputs come back in half precision",
    ),
    _m(
        "emit.opaque_bodies_not_rewritten",
        "emit.py",
        "        params = {k: ho.map_held(v, self._rewrite_same_signature) for k, v in eqn.params.items()}",
        "        params = dict(eqn.params)",
        T_DTYPES + "test_custom_linear_solve_bodies_are_rewritten",
        "bodies of opaque equations are never rewritten",
    ),
    _m(
        "custom_rules.custom_jvp_rule_dropped",
        "custom_rules.py",
        "        fun = jax.custom_jvp(body)\n",
        "        return list(body(*invals))\n",
        T_REWRITE + "test_custom_jvp_rule_is_kept",
        "a custom_jvp function is differentiated through its body, not its rule",
    ),
    # ---- op_lists.py: TF's lists [17.6] ------------------------------------------------------
    _m(
        "op_lists.scatter_max_deny",
        "op_lists.py",
        "_def_clear(\n    \"no TF op (TF's scatters are unlisted): scatter-max/min select values",
        "_def_deny(\n    \"no TF op (TF's scatters are unlisted): scatter-max/min select values",
        T_OPS + "test_default_lists_follow_tf_or_declare_the_difference",
        "[17.6] scatter-max/scatter-min moved to deny",
    ),
    _m(
        "op_lists.psum_scatter_clear_in_float16",
        "op_lists.py",
        '    "psum_invariant",\n    "reduce_scatter",\n)',
        '    "psum_invariant",\n)\n_def_lists("clear", "infer", "like Sum", "reduce_scatter")',
        T_OPS + "test_default_lists_follow_tf_or_declare_the_difference",
        "[17.6] psum_scatter (reduce_scatter) moved to clear in float16",
    ),
    _m(
        "op_lists.rsqrt_infer_in_float16",
        "op_lists.py",
        '_def_lists(UNLISTED, "infer", "TF Rsqrt',
        '_def_lists("infer", "infer", "TF Rsqrt',
        T_OPS + "test_default_lists_follow_tf_or_declare_the_difference",
        "rsqrt infer in float16 (TF's CUDA lists leave Rsqrt unlisted)",
    ),
    _m(
        "op_lists.tanh_clear",
        "op_lists.py",
        '_def_infer("TF Tanh", "tanh")',
        '_def_clear("TF Tanh", "tanh")',
        T_OPS + "test_default_lists_follow_tf_or_declare_the_difference",
        "tanh on the clear list",
    ),
    _m(
        "op_lists.exp_infer",
        "op_lists.py",
        '_def_deny("TF Exp", "exp")',
        '_def_infer("TF Exp", "exp")',
        T_OPS + "test_default_lists_follow_tf_or_declare_the_difference",
        "exp on the infer list",
    ),
    _m(
        "op_lists.sum_deny_in_bfloat16",
        "op_lists.py",
        '_def_lists("deny", "infer", "TF Sum/Mean',
        '_def_lists("deny", "deny", "TF Sum/Mean',
        T_OPS + "test_default_lists_follow_tf_or_declare_the_difference",
        "reduce_sum deny in bfloat16 (TF's oneDNN lists make Sum infer)",
    ),
    _m(
        "op_lists.log_softmax_deny",
        "op_lists.py",
        '_def_infer("TF LogSoftmax (infer, not deny)"',
        '_def_deny("TF LogSoftmax (infer, not deny)"',
        T_OPS + "test_default_lists_follow_tf_or_declare_the_difference",
        "the log_softmax unit on the deny list",
    ),
    _m(
        "op_lists.treat_infer_as_deny_ignored",
        "op_lists.py",
        "        return OpLists(allow=lists.allow, deny=lists.deny | lists.infer, clear=lists.clear)",
        "        return lists",
        T_OPS + "test_level_treat_infer_as_deny",
        "TREAT_INFER_AS_DENY leaves the infer list alone",
    ),
    _m(
        "op_lists.tensor_cores_only_ignored",
        "op_lists.py",
        "        return OpLists(allow=lists.allow)\n",
        "        return lists\n",
        T_OPS + "test_level_tensor_cores_only",
        "TENSOR_CORES_ONLY keeps the infer/deny/clear lists",
    ),
    _m(
        "environment.env_remove_ignored",
        "environment.py",
        "        sets[kind] -= to_remove",
        "        pass",
        T_OPS + "test_env_add_and_remove_each_list",
        "JMP_REWRITE_*LIST_REMOVE is ignored",
    ),
    # ---- loss_scale.py: TF1's dynamic loss scale ---------------------------------------------
    _m(
        "loss_scale.max_exclusive",
        "loss_scale.py",
        "(grown <= jnp.float32(self.max_loss_scale))",
        "(grown < jnp.float32(self.max_loss_scale))",
        T_LS,
        "[17.8] the loss scale may not reach exactly max_loss_scale",
    ),
    _m(
        "loss_scale.no_floor",
        "loss_scale.py",
        "        scale_if_not = jnp.maximum(loss_scale / multiplier, jnp.float32(self.min_loss_scale))",
        "        scale_if_not = loss_scale / multiplier",
        T_LS,
        "back-off ignores min_loss_scale",
    ),
    _m(
        "loss_scale.period_off_by_one",
        "loss_scale.py",
        "        grow = next_good >= self.increment_period",
        "        grow = next_good > self.increment_period",
        T_LS,
        "growth after increment_period + 1 good steps",
    ),
    _m(
        "loss_scale.counter_kept_when_growth_refused",
        "loss_scale.py",
        "        good_if_finite = jnp.where(grow, jnp.zeros_like(next_good), next_good)",
        "        good_if_finite = jnp.where(grow & can_grow, jnp.zeros_like(next_good), next_good)",
        T_LS,
        "the good-step counter is not reset when growth is refused",
    ),
    _m(
        "loss_scale.counter_kept_on_overflow",
        "loss_scale.py",
        "        new_good = jnp.where(finite, good_if_finite, jnp.zeros_like(good_steps))",
        "        new_good = jnp.where(finite, good_if_finite, good_steps)",
        T_LS,
        "an overflow does not reset the good-step counter",
    ),
    _m(
        "loss_scale.grows_to_infinity",
        "loss_scale.py",
        "        can_grow = jnp.isfinite(grown)",
        "        can_grow = jnp.isfinite(loss_scale)",
        T_LS,
        "the scale may grow to infinity",
    ),
    _m(
        "loss_scale.max_below_min_accepted",
        "loss_scale.py",
        "            if maximum < minimum:",
        "            if maximum < 0:",
        T_LS,
        "max_loss_scale below min_loss_scale is accepted",
    ),
    _m(
        "loss_scale.fixed_never_skips",
        "loss_scale.py",
        "        apply = finite if self.skip_non_finite else jnp.ones_like(finite)",
        "        apply = jnp.ones_like(finite)",
        T_LS,
        "FixedLossScale(skip_non_finite=True) applies non-finite steps",
    ),
    # ---- loss_scale_optimizer.py ----------------------------------------------------------------
    _m(
        "optimizer.select_keeps_new_state_on_skip",
        "loss_scale_optimizer.py",
        "lambda n, o: jnp.where(apply, n, o)",
        "lambda n, o: n",
        T_LSO + "test_adam_count_and_moments_do_not_advance_on_skipped_steps",
        "use_select=True advances the inner state on skipped steps",
    ),
    _m(
        "optimizer.cond_always_applies",
        "loss_scale_optimizer.py",
        "        return jax.lax.cond(apply, applied, skipped, grads, inner_state, params32)",
        "        return jax.lax.cond(apply, applied, applied, grads, inner_state, params32)",
        (
            T_LSO + "test_adam_count_and_moments_do_not_advance_on_skipped_steps",
            T_LSO + "test_rewritten_train_step_traces_once_through_skips_and_scale_changes",
        ),
        "a traced step with non-finite gradients is applied",
    ),
    _m(
        "optimizer.eager_always_applies",
        "loss_scale_optimizer.py",
        "    return (applied if static_apply else skipped)(grads, inner_state, params32)",
        "    return applied(grads, inner_state, params32)",
        T_LSO + "test_step_sequence_sgd_momentum",
        "an eager step with non-finite gradients is applied",
    ),
    _m(
        "optimizer.skip_counter_frozen",
        "loss_scale_optimizer.py",
        "        skipped_steps=jnp.where(apply, skipped, optax.safe_increment(skipped)),",
        "        skipped_steps=skipped,",
        T_LSO + "test_step_sequence_sgd_momentum",
        "skipped steps are not counted",
    ),
    _m(
        "optimizer.not_unscaled",
        "loss_scale_optimizer.py",
        "    inv_scale = jnp.float32(1.0) / loss_scale",
        "    inv_scale = jnp.float32(1.0)",
        T_LSO + "test_unscales_with_the_scale_in_force_not_the_grown_one",
        "gradients reach the inner optimizer still scaled",
    ),
    _m(
        "optimizer.half_params_to_inner",
        "loss_scale_optimizer.py",
        "            return x.astype(jnp.float32)\n        return x\n\n    return jax.tree.map(cast, tree)",
        "            return x\n        return x\n\n    return jax.tree.map(cast, tree)",
        T_LSO + "test_dtypes_of_updates_and_state",
        "the inner optimizer sees half-precision parameters",
    ),
    _m(
        "optimizer.last_step_always_applied",
        "loss_scale_optimizer.py",
        "        last_step_applied=apply,",
        "        last_step_applied=jnp.array(True),",
        T_LSO + "test_step_sequence_sgd_momentum",
        "last_step_applied reports True after a skipped step",
    ),
    # ---- issue 14: state in loops ----------------------------------------------------------
    _m(
        "paint.loop_state_not_kept",
        "paint.py",
        "        if ls.recurrent and g.nodes[ls.carry].float32:",
        "        if False:",
        (
            T_LOOPS + "test_item1_loop_state_that_is_no_output",
            T_LOOPS + "test_item1_training_steps_in_a_loop",
        ),
        "[14.1] a loop carry updated as old + small is rounded to half every iteration",
    ),
    _m(
        "op_lists.outer_product_is_a_matmul",
        "op_lists.py",
        '    return "dot_general" if len(lhs_contract) else "outer_product"',
        '    return "dot_general"',
        T_LOOPS + "test_item3_rope_angles_are_not_rounded",
        "[14.3] an einsum contracting nothing (RoPE's angles) is painted allow",
    ),
    _m(
        "graph.log_softmax_residual_not_deny",
        "graph.py",
        "            if out[i] is None or piece is None:",
        "            if True:",
        T_LOOPS + "test_item4_log_softmax_gradient_is_float32",
        "[14.4] log-softmax's gradient runs in half (its exp residual is no deny vertex)",
    ),
    _m(
        "optimizer.skip_adds_plus_zero",
        "loss_scale_optimizer.py",
        "        return -zeros if jnp.issubdtype(u.dtype, jnp.inexact) else zeros",
        "        return zeros",
        T_LIBS + "test_skipped_step_leaves_parameters_and_optimizer_state_bit_identical",
        "[14.2] a skipped step adds +0.0: a parameter at -0.0 comes back as +0.0",
    ),
    _m(
        "origins.moves_carry_no_state",
        "origins.py",
        "    if (name in _MOVES or name in _SCATTER_COMBINES) and eqn.outvars:",
        "    if name in _SCATTER_COMBINES and eqn.outvars:",
        T_LOOPS + "test_item1_state_updated_through_data_movement",
        "a state updated through reshape/transpose/concatenate (ravel_pytree) is rounded in loops",
    ),
    _m(
        "origins.no_cycles_through_other_carries",
        "origins.py",
        "            if s in reach[t]:",
        "            if s == t:",
        T_LOOPS + "test_item1_state_updated_through_another_carry",
        "a two-step method's carries, each updating the other, are rounded every iteration",
    ),
    _m(
        "origins.placement_is_a_recurrence",
        "origins.py",
        "        return bool(self.cycle) and self.root is not None and self.root != self.carry",
        "        return self.root is not None and self.root != self.carry and self.state in "
        "self.origin.derived",
        T_LOOPS + "test_a_cache_written_by_placement_is_no_state_that_accumulates",
        "a KV cache written with dynamic_update_slice is kept float32 as if it accumulated",
    ),
    _m(
        "finite.empty_leaf_reshaped",
        "finite.py",
        "        if not is_inexact(g) or g.size == 0:  # an empty leaf holds nothing to check",
        "        if not is_inexact(g):",
        T_LSO + "test_an_empty_leaf_is_checked_as_holding_nothing",
        "a zero-size gradient leaf crashes the per-leaf finiteness check",
    ),
    _m(
        "paint.algorithm_presets_painted",
        "paint.py",
        "        return precision != lax.DotAlgorithmPreset.DEFAULT",
        "        return False",
        T_DTYPES + "test_a_matmul_that_names_its_precision_or_algorithm_runs_as_written",
        "a matmul with precision=DotAlgorithmPreset.F32_F32_F32 is painted allow",
    ),
    _m(
        "graph.scanned_state_is_no_state",
        "graph.py",
        '        x_in = [dataclasses.replace(o, const=False) for o in orig["xs"]]',
        '        x_in = [Origin(copy_of=o.copy_of) for o in orig["xs"]]',
        T_LOOPS + "test_state_scanned_in_and_stacked_out_is_updated_in_float32",
        "a per-layer running mean scanned in and stacked out is updated in half",
    ),
    # ---- branch vjp-fp16 (issue 21 items 3, 6, 7) -------------------------------------------
    _m(
        "custom_rules.rule_differentiates_everything",
        "custom_rules.py",
        "            live = tuple(i for i, p in enumerate(primals) if p.perturbed)",
        "            live = tuple(range(len(primals)))",
        "tests/test_custom_derivatives.py::test_odeint_matmul_runs_in_half_and_rule_is_kept",
        "grad(rewrite(odeint)) asks the custom_vjp rule about its closed-over tableau and fails",
    ),
    _m(
        "graph.softmax_denominator_not_deny",
        "graph.py",
        'CARRY_DENY = ("reduce_sum",)',
        "CARRY_DENY = ()",
        "tests/test_tf_patterns.py::test_whole_graph_log_softmax_gradient_is_float32_throughout",
        "in bfloat16 the log-softmax backward divides by the sum of exps in half, unlike TF",
    ),
    _m(
        "compare.no_gradient_underflow_note",
        "compare.py",
        "    notes += _gradient_underflow_notes(graph, painting, half.stats, dt)",
        "    notes += []",
        "tests/test_gradient_underflow.py::test_compare_names_gradient_underflow_in_float16_only",
        "compare counts float16 gradient underflow without naming it or the loss-scale optimizer",
    ),
    _m(
        "explain_view.no_gradient_underflow_lint",
        "explain_view.py",
        "    return _gradient_underflow(report) + _half_carries(report) + findings + chains",
        "    return _half_carries(report) + findings + chains",
        "tests/test_gradient_underflow.py::test_lint_names_a_float16_backward_pass_without_loss_scaling",
        "lint is silent about a float16 backward pass with no loss scaling",
    ),
)
