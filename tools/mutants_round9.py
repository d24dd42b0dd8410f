"""Round 9 of planted bugs: 20 realistic one-line bugs in the library's newest rules.

Targets: ``paint.recurrences.keep_ranked_increments_float32`` (commit ea531fc: a running
score a selection ranks, beam search's ``top_k`` over ``scores + log_softmax``, keeps its
increment float32 back to the matmuls; 6 mutants); the cuDNN guards of fused attention not
planted in round 8 (``emit/attention.py``: the bias in the queries' dtype, jax issue 32242;
masks at both sequence lengths, jax issue 28974; the key lengths of odd-length padding; the
fallback for rows a mask leaves without keys; ``attention/match.py``: Gemma 2's soft-capping
left with its reason; ``attention/select.py``: both matmuls painted half, the
``precision=HIGHEST`` logits matmul; the wording of the batch > 1 bias-gradient reason; 9
mutants); the lazy float32 stand-ins of ``emit/tangents.py`` (``forced``, ``hand_on``,
``Unsaturated.value``; 3 mutants); float8 inside ``shard_map`` (``fp8.CALL_KINDS``, pairing
the gradient GEMMs of ``rewrite(grad(f))`` through a ``shard_map``; origins through
``pvary``; 2 mutants). Only files under ``jmp_rewrite/_src`` are mutated.

Independence record (written before any scoring, and before anything under ``tests/`` was
read). Read: ``jmp_rewrite/`` (the targeted modules, their neighbours ``paint/additions.py``,
``trace/origins.py``, ``emit/emitter.py``'s cast and leaf paths), ``git log``/``git show`` of
the library commits ea531fc, faa5742, 2e50c55, 2c2e48c, 9b1753a (library parts),
``docs/guides/fused_attention.md``, ``docs/guides/float8.md`` (the shard_map paragraph),
``tools/mutants.py`` (docstring, options, runner), ``tools/mutant_list.py``'s module
docstring, ``Mutant`` and ``_m`` (no entry), round 8's module docstring. Beyond the brief's
"first two entries", the first FIVE entries of ``tools/mutants_round8.py`` were read by
mistake (its ``sed`` ran past the second): ``r8_handed_in_big_not_saturating``,
``r8_summing_kinds_no_shard_map``, ``r8_per_trip_no_xs``, ``r8_hands_on_no_select_n``,
``r8_hand_on_any_operand_unsaturated``; two of them carry "caught by" comments naming a test
id, ``tests/test_mask_values.py::test_the_gradient_through_a_moved_fill_is_the_fills[...]``,
the only test name known here besides the file names. NOT read: anything under ``tests/``
(only ``ls tests/``), the entries of ``tools/mutant_list.py``, ``tools/mutants_round6.py``,
``tools/mutants_round7.py`` and the rest of round 8's, nor ``runs/``. Each mutant's
``tests`` is a guess from the file names in ``ls tests/``; after scoring, a caught mutant's
``tests`` is narrowed to the test that caught it (see ``runs/mutants_round9.md``).

Added after scoring (``-j 1 --timeout 600``, baseline kept, targeted files): 13 of 20 caught.
The 7 survivors were rerun once against wider guessed files (test_tf_patterns,
test_invariants, test_gradient_underflow, test_behaviour_pins, test_generated_rules for the
tangents pair; test_goldens, test_rule_families, test_generated_rules for the recurrence
three): ``r9_hand_on_eager`` was caught there (14 of 20 with the wider files), the other six
survive; none is equivalent (each is shown by a probe program in the results file). Caught
mutants name the test that caught them; survivors keep their guessed files. The ``bug`` text
of ``r9_ranked_all_operands_derived`` was corrected after probing (argsort is not affected;
a sort with a float payload is).

Re-scored 2026-12-02 (branch pins10): a test was added for each of the six survivors (and
``r9_hand_on_eager`` now names the same forward-jaxpr test as ``r9_value_forces_stand_in``);
every mutant names the test that catches it: 20 of 20 caught (``runs/mutants_round9.md``).

Run: ``.venv/bin/python tools/mutants.py --list-module tools.mutants_round9 -j 1``.
"""

from __future__ import annotations

from tools.mutant_list import Mutant, _m  # _m: the list's own builder (a file under _src)

T_REC = "tests/test_recurrences.py"
T_ATT = "tests/test_fused_attention.py"
T_MASKS = "tests/test_mask_values.py"
T_UNDER = "tests/test_gradient_underflow.py"
T_FP8B = "tests/test_fp8_boundaries.py"
T_FP8 = "tests/test_fp8.py"

MUTANTS: tuple[Mutant, ...] = (
    # -- a running score a selection ranks (keep_ranked_increments_float32) ---------------
    # caught by the test it names
    _m(
        "r9_rankings_no_top_k",
        "paint/recurrences.py",
        '_RANKINGS = frozenset({"top_k", "approx_top_k", "sort", "reduce_max", "reduce_min"})',
        '_RANKINGS = frozenset({"approx_top_k", "sort", "reduce_max", "reduce_min"})',
        "tests/test_recurrences.py::test_beam_search_scores_are_state[jit-fori_loop-float16]",
        "top_k dropped from the rankings: beam search's top_k(scores[:, None] + log_softmax) "
        "is no longer a ranked running score, its log-probabilities are computed in half "
        "again (the near-tied beams flip: 0 of 4 beams kept on some seeds)",
    ),
    _m(
        "r9_ranked_all_operands_derived",
        "paint/recurrences.py",
        "_RANKINGS and any(ls.cycle & g.nodes[f].origin.derived for f in n.fanin):",
        "_RANKINGS and all(ls.cycle & g.nodes[f].origin.derived for f in n.fanin):",
        "tests/test_recurrences.py::test_a_sort_of_the_scores_with_a_float_payload_ranks_them",
        "all for any: a sort of several float operands (the candidates' scores with a float "
        "payload: lax.sort((-cand, payload), num_keys=1)) ranks the scores only when every "
        "operand derives from the carries, so such a beam search keeps its increments half "
        "(argsort is not affected: its iota is no float operand of the sort node)",
    ),
    _m(
        "r9_ranked_any_selection_in_body",
        "paint/recurrences.py",
        "        if n.key in _RANKINGS and any(ls.cycle & g.nodes[f].origin.derived"
        " for f in n.fanin):",
        "        if n.key in _RANKINGS:",
        "tests/test_recurrences.py::test_a_selection_that_ranks_something_else_keeps_no_increment_float32",
        "the condition that the ranking reads the carry's chain dropped: any argmax or max in "
        "the body (a sampling loop's argmax of the logits, a softmax's max) makes a float32 "
        "accumulator's increments float32 from the matmuls on, though nothing ranks it",
    ),
    _m(
        "r9_ranked_max_of_two_off_by_one",
        "paint/recurrences.py",
        '        if n.key in ("max", "min") and len([f for f in n.fanin if f in members]) >= 2:',
        '        if n.key in ("max", "min") and len([f for f in n.fanin if f in members]) > 2:',
        "tests/test_recurrences.py::test_a_viterbi_maximum_of_two_paths_ranks_the_scores",
        "off by one: a max/min has two operands, so maximum(s0 + a, s1 + b) (Viterbi's "
        "running maximum over two paths) never counts as ranking the scores",
    ),
    # caught by the test it names
    _m(
        "r9_ranked_increment_through_matmuls",
        "paint/recurrences.py",
        '        return v.float32 and v.listed_kind != ALLOW and v.key != "<carry>"',
        '        return v.float32 and v.key != "<carry>"',
        "tests/test_recurrences.py::test_beam_search_scores_are_state[jit-fori_loop-float16]",
        "the walk back from the increment no longer stops at the matmuls: the decoder's "
        "logits matmul (and the GRU's behind it) run float32, not half with the result cast up",
    ),
    # caught by the test it names
    _m(
        "r9_ranked_reason_name",
        "paint/recurrences.py",
        '_dfs(starts, _fanin, g.nodes, computes), "keep_ranked_scores_float32")',
        '_dfs(starts, _fanin, g.nodes, computes), "keep_ranked_increments_float32")',
        "tests/test_recurrences.py::test_a_beam_search_over_a_decoder_keeps_its_scores_float32[top_k]",
        "the function's name for the pass's: painted_by says keep_ranked_increments_float32, "
        "which explain's words and the documented reason do not know",
    ),
    # -- fused attention: what cuDNN is handed (emit/attention.py) ------------------------
    # caught by the test it names
    _m(
        "r9_cudnn_bias_float32",
        "emit/attention.py",
        "    bias = None if bias is None else clamp(bias, half).astype(half)",
        "    bias = None if bias is None else clamp(bias, half)",
        "tests/test_fused_attention.py::test_cudnn_gets_a_bias_of_the_queries_dtype",
        "the clamped bias is not cast: cuDNN gets a float32 bias with half queries (NaN "
        "gradients, jax issue 32242)",
    ),
    # caught by the test it names
    _m(
        "r9_cudnn_mask_lengths_only_with_bias",
        "emit/attention.py",
        "    mask = _full_lengths(mask, t, s)",
        "    mask = _full_lengths(mask, t, s) if bias is not None else mask",
        "tests/test_fused_attention.py::test_cudnn_gets_a_padding_mask_at_both_sequence_lengths",
        "a mask is broadcast to both sequence lengths only alongside a bias: a padding mask "
        "alone reaches cuDNN as (B, 1, 1, S), which it refuses (jax issue 28974)",
    ),
    _m(
        "r9_cudnn_lengths_of_padded_keys",
        "emit/attention.py",
        "        lengths = jnp.full((q.shape[0],), s, jnp.int32)",
        "        lengths = jnp.full((q.shape[0],), k.shape[1], jnp.int32)",
        "tests/test_fused_attention.py::test_cudnn_masks_the_key_added_to_an_odd_length_by_its_sequence_length",
        "the key lengths read after the padding: an odd-length sequence's added zero key is "
        "not masked, every query attends to it (weights and output change on CUDA)",
    ),
    # caught by the test it names
    _m(
        "r9_guard_rows_all_keys",
        "emit/attention.py",
        "    ok = jnp.swapaxes(jnp.any(keep, axis=-1), 1, 2)[..., None]  # (B|1, T|1, N|1, 1)",
        "    ok = jnp.swapaxes(jnp.all(keep, axis=-1), 1, 2)[..., None]  # (B|1, T|1, N|1, 1)",
        "tests/test_fused_attention.py::test_models_fuse_forward_and_backward_within_hand_written_error[nnx]",
        "all for any: a row with any masked key (every padded sequence's) gets the fallback "
        "for rows without keys, the mean of the values, instead of its attention",
    ),
    # caught by the test it names
    _m(
        "r9_guard_mean_over_heads",
        "emit/attention.py",
        "        mean = jnp.mean(v4.astype(jnp.float32), axis=1, keepdims=True)  # (B, 1, K, D)",
        "        mean = jnp.mean(v4.astype(jnp.float32), axis=2, keepdims=True)  # (B, 1, K, D)",
        "tests/test_fused_attention.py::test_grouped_query_attention_as_a_grouped_einsum_fuses_with_fewer_kv_heads[bf16]",
        "wrong axis: a row without keys (finite fill) gets the values' mean over the heads, "
        "not over the keys (or a shape error when the lengths differ)",
    ),
    _m(
        "r9_guard_causal_or",
        "emit/attention.py",
        "        keep = keep & jnp.tril(jnp.ones((out.shape[1], v4.shape[1]), bool))",
        "        keep = keep | jnp.tril(jnp.ones((out.shape[1], v4.shape[1]), bool))",
        "tests/test_fused_attention.py::test_causal_attention_with_a_minus_inf_fill_and_left_padding_gives_float32s_nan_rows",
        "| for &: with is_causal, a row whose only causal keys are padding (left padding) "
        "counts as having keys: with a -inf fill it gets the kernel's value, not float32's NaN",
    ),
    # -- fused attention: what is left as written (attention/) -----------------------------
    # caught by the test it names
    _m(
        "r9_softcap_condition_inverted",
        "attention/match.py",
        '    if at.name == "tanh" and _chain(view, at.operand(0), depth + 1) is not None:',
        '    if at.name == "tanh" and _chain(view, at.operand(0), depth + 1) is None:',
        "tests/test_fused_attention.py::test_unfusable_attention_is_left_as_written_with_the_reason[soft_capped]",
        "the soft-cap test inverted: Gemma 2's tanh(s / c) * c is still left as written, but "
        "with the generic reason (not the logits of a matmul through scales...), not 'cuDNN "
        "has no soft-cap'",
    ),
    # caught by the test it names
    _m(
        "r9_highest_logits_matmul_not_checked",
        "attention/select.py",
        "    for node in (pv_node, qk_node):",
        "    for node in (pv_node,):",
        "tests/test_fused_attention.py::test_unfusable_attention_is_left_as_written_with_the_reason[precision_highest]",
        "only the P.V matmul must be painted half: a logits matmul kept float32 by "
        "precision=HIGHEST is fused anyway, computed in half by the fused call",
    ),
    # caught by the test it names
    _m(
        "r9_bias_gradient_reason_issue",
        "attention/select.py",
        'cuDNN computes a "\n                "bias\'s gradient for batch 1 only (jax issue 30593)"',
        'cuDNN computes a "\n                "bias\'s gradient for batch 1 only (jax issue 32242)"',
        "tests/test_fused_attention.py::test_models_fuse_forward_and_backward_within_hand_written_error[t5]",
        "the reason cites the wrong issue (32242, the bias dtype's, copied from the emitter): "
        "the user reading lint() is sent to the wrong bug",
    ),
    # -- lazy float32 stand-ins (emit/tangents.py) -----------------------------------------
    # caught by the test it names
    _m(
        "r9_hand_on_others_not_cast_back",
        "emit/tangents.py",
        "            return cast(v, atom.aval.dtype) if is_float(jnp.result_type(v)) else v",
        "            return v",
        "tests/test_mask_values.py::test_the_gradient_through_a_moved_fill_is_the_fills[pad_by_zeros-float16]",
        "a move's other operands stay half for its float32 value: the concatenate/pad of a "
        "saturated fill and a computed half value binds mixed dtypes when a derivative reads it",
    ),
    # caught by the test it names (second run, wider files: runs/mutants_round9.md)
    _m(
        "r9_hand_on_eager",
        "emit/tangents.py",
        "                self._of[id(out)] = (out, functools.partial(value, k))",
        "                self._of[id(out)] = (out, value(k))",
        "tests/test_mask_values.py::test_a_forward_pass_through_a_moved_fill_binds_no_float32_copy_of_it",
        "the float32 stand-in is computed at once: every forward pass through a cast or move "
        "of a saturated value binds a float32 copy of it (a float32 select_n in the jaxpr), "
        "read by no derivative",
    ),
    _m(
        "r9_value_forces_stand_in",
        "emit/tangents.py",
        "            return self._of[id(raw)][1]",
        "            return forced(self._of[id(raw)][1])",
        "tests/test_mask_values.py::test_a_forward_pass_through_a_moved_fill_binds_no_float32_copy_of_it",
        "a stand-in is forced when a reader is emitted, not when a derivative reads it: a sum "
        "or a choice reading a pinned fill binds its float32 value in the forward pass",
    ),
    # -- float8 inside shard_map -----------------------------------------------------------
    # caught by the test it names
    _m(
        "r9_fp8_call_kinds_no_shard_map",
        "fp8.py",
        "CALL_KINDS = (ho.CALL, ho.CUSTOM_JVP, ho.CUSTOM_VJP, ho.SHARD_MAP)",
        "CALL_KINDS = (ho.CALL, ho.CUSTOM_JVP, ho.CUSTOM_VJP)",
        "tests/test_fp8_boundaries.py::test_the_gradient_gemms_of_a_forward_in_shard_map_run_in_float8",
        "a shard_map's body no longer names its parameters by the caller's arguments: in "
        "rewrite(grad(f)) over shard_map the transposed body's gradient GEMMs share no value "
        "with the forward's and stay bfloat16",
    ),
    # caught by the test it names
    _m(
        "r9_origins_not_through_pvary",
        "trace/origins.py",
        "    | set(ANNOTATIONS)\n",
        "",
        "tests/test_fp8_boundaries.py::test_float8_sees_through_shard_map[shard_map_of_rewrite]",
        "origins stop at pvary (and sharding constraints): a replicated weight read inside "
        "shard_map is no parameter operand, its matmul 'activation x activation', no float8",
    ),
)
