"""Round 10 of planted bugs: 12 realistic one-line bugs in the rules added on 2026-12-02.

Targets: ``dtype=None`` decided where the program is lowered (``lowering.PerPlatform.emit``,
``settings.lowering_dtypes`` and ``settings.cuda_choice``: bfloat16 for a TPU lowering,
float16 for CUDA, float32 elsewhere; 4 mutants); float8's TPU branch (``fp8.emit`` runs the
bfloat16 matmul on a TPU lowering, ``fp8.why_none``'s TPU reason; 2); the TPU branch of
``loss_scale.finite.any_non_finite`` (one reduction per leaf; 1); a big value a loop reads
handed in as float32 (``emit.emitter.Emitter._handed_in``) and pinned at a forward body's
output casts (``ScopeRec.big_outputs``, ``trace/graph.py``; 2); a ``select_n`` choosing as a
``cond`` does (``paint/additions.py`` ``_CHOICES``/``_all_half``, ``Graph._choice`` and
``Graph.choice_cases``; 3). Only files under ``jmp_rewrite/_src`` are mutated.

Independence record (written before any scoring, and before anything under ``tests/`` was
read). Read: ``git log --since=2026-12-02T03:00 --stat -- jmp_rewrite/`` and ``git show`` of
the library parts of commits 17bf46e, ea43986, dd9eb84, c213f3c; ``jmp_rewrite/_src/
lowering.py`` (whole), ``settings.py`` (``cuda_choice``, ``lowering_dtypes``,
``lowering_words``, the head of ``platform_dtype``), ``fp8.py`` (``why_none``, ``emit``),
``loss_scale/finite.py`` (``any_non_finite_fused``, ``any_non_finite``), ``emit/emitter.py``
(``run``'s output casts, ``big_outputs``, ``_handed_in``), ``paint/additions.py``
(``_CHOICES``, ``_all_half``, ``_moves_float32``), ``trace/graph.py`` (the lines the diffs
show), ``tools/mutants.py``'s docstring. Beyond the brief's allowance, by an over-long
``sed``/``grep``: ``tools/mutants_round9.py``'s module docstring and its first FOUR entries
(``r9_rankings_no_top_k``, ``r9_ranked_all_operands_derived``,
``r9_ranked_any_selection_in_body``, ``r9_ranked_max_of_two_off_by_one``; one names the test
``tests/test_recurrences.py::test_beam_search_scores_are_state[jit-fori_loop-float16]``), and
``tools/mutant_list.py``'s ``_m`` with its first three entries (``paint.cast_*``, naming
tests of ``test_dtype_decisions``); none of them touches a module mutated here. NOT read:
anything under ``tests/`` (only ``ls tests/``), the other entries of
``tools/mutant_list.py`` and ``tools/mutants_round6..9.py``, ``runs/``, ``docs/``. Each
mutant's ``tests`` is a guess from the file names in ``ls tests/``; after scoring, a caught
mutant's ``tests`` is narrowed to the test that caught it (see ``runs/mutants_round10.md``).

Added after scoring (``-j 1 --no-baseline --timeout 400``, the guessed files): 8 of 12 caught.
Caught mutants now name the test that caught them (rerun: each still caught). Of the four
survivors, ``r10_handed_in_clamped_constant`` is equivalent (``survives=``, probed); the
other three are real gaps, each shown by a probe program in ``runs/mutants_round10.md``.

Run: ``.venv/bin/python tools/mutants.py --list-module tools.mutants_round10 -j 1``.
"""

from __future__ import annotations

from tools.mutant_list import Mutant, _m  # _m: the list's own builder (a file under _src)

T_LOW = "tests/test_lowering_platforms.py"
T_DT = "tests/test_dtype_decisions.py"
T_FP8 = "tests/test_fp8.py"
T_FP8B = "tests/test_fp8_boundaries.py"
T_LS = "tests/test_loss_scale.py"
T_MASKS = "tests/test_mask_values.py"
T_LOOPS = "tests/test_loop_cotangents.py"
T_SEL = "tests/test_select_state.py"

MUTANTS: tuple[Mutant, ...] = (
    # -- dtype=None decided where the program is lowered ----------------------------------
    _m(
        "r10_per_platform_unchanged_not_shared",
        "lowering.py",
        "            if program.changed:",
        "            if program is not None:",
        # caught by the test it names
        "tests/test_lowering_platforms.py::test_a_program_no_platform_changes_is_emitted_as_it_is",
        "the check that a painting changes something dropped: a traced program no platform "
        "changes (no matmul, a CPU-only function) is emitted inside a lax.platform_dependent "
        "whose tpu and cuda branches are copies of the unchanged one, instead of as it is",
    ),
    _m(
        "r10_tpu_lowered_float16",
        "settings.py",
        'return (("tpu", np.dtype(jnp.bfloat16)), ("cuda", cuda))',
        'return (("tpu", np.dtype(jnp.float16)), ("cuda", cuda))',
        # caught by the test it names
        "tests/test_lowering_platforms.py::test_one_traced_function_lowers_to_each_platforms_dtype[tpu]",
        "wrong dtype for the TPU: rewrite(f) lowered for a TPU (lower(lowering_platforms="
        "('tpu',)) from a CPU host) runs its matmuls in float16 instead of bfloat16",
    ),
    _m(
        "r10_fp8_cuda_stays_float16",
        "settings.py",
        "        cuda = np.dtype(jnp.bfloat16)",
        "        cuda = np.dtype(jnp.float16)",
        # caught by the test it names
        "tests/test_lowering_platforms.py::test_each_dtype_is_painted_once_and_equal_dtypes_share_a_branch",
        "under fp8 a CUDA lowering keeps float16 instead of bfloat16: float8 starts from the "
        "bfloat16 rewrite's matmuls, so rewrite(f, fp8=True) lowered for cuda paints float16 "
        "(and its lowering_words say 'for cuda in float16')",
    ),
    _m(
        "r10_cuda_choice_first_gpu_only",
        "settings.py",
        "    for device in devices:",
        "    for device in devices[:1]:",
        "tests/test_lowering_platforms.py::test_every_local_cuda_gpu_decides_a_cuda_lowering",
        "only the first CUDA GPU checked: on a machine whose second GPU has compute "
        "capability < 7.0 (a V100 beside a P100), dtype=None still picks float16 for a CUDA "
        "lowering, where TF's rule (every GPU >= 7.0) runs unchanged with a reason",
    ),
    # -- float8's TPU branch ---------------------------------------------------------------
    _m(
        "r10_fp8_bfloat16_branch_wrong_key",
        "fp8.py",
        "return [lax.platform_dependent(a, b, tpu=tpu, default=float8)]",
        "return [lax.platform_dependent(a, b, cpu=tpu, default=float8)]",
        # caught by the test it names
        "tests/test_fp8.py::test_both_orders_quantize_the_same_gemms",
        "wrong platform key: the bfloat16 branch is taken on CPU (no exact float8 "
        "emulation there: the CPU's values are the bfloat16 rewrite's, not float8's) and a "
        "TPU lowering emits the float8 GEMM",
    ),
    _m(
        "r10_why_none_tpu_without_dots",
        "fp8.py",
        'if selection is not None and selection.dots and _default_platform() == "tpu":',
        'if selection is not None and _default_platform() == "tpu":',
        "tests/test_fp8_boundaries.py::test_on_a_tpu_a_program_that_selects_nothing_says_why_as_elsewhere",
        "the TPU reason given without a selected matmul: on a TPU a selection with no dot "
        "(each matmul left bfloat16 for its shape) says '0 matmul selected for float8, but on "
        "a TPU...' instead of the per-matmul reasons",
    ),
    # -- the non-finite check of a TPU lowering --------------------------------------------
    _m(
        "r10_any_non_finite_tpu_fused",
        "loss_scale/finite.py",
        'cpu=lambda: per_leaf(cpu_method), tpu=lambda: per_leaf("elementwise"), default=default',
        "cpu=lambda: per_leaf(cpu_method), tpu=default, default=default",
        "tests/test_memory_parity.py::test_finiteness_check_per_platform",
        "the TPU branch takes the default: with whole_leaves a TPU lowering concatenates the "
        "gradients into fused reductions (a concatenate in its HLO), gathering leaves sharded "
        "over the slice onto every chip",
    ),
    # -- big values handed into loops, pinned at a body's output casts --------------------
    _m(
        "r10_handed_in_clamped_constant",
        "emit/emitter.py",
        "if not (_clamped(rec, i) or jc.is_literal(a)) and is_f32(jnp.result_type(read(a))):",
        "if not jc.is_literal(a) and is_f32(jnp.result_type(read(a))):",
        (T_MASKS, T_LOOPS),
        "the clamped-constant condition dropped: a float32 constant beyond the half range "
        "(a -1e9 mask fill closed over by a scan body) is handed in as float32 and cast by "
        "its readers inside, where it is not clamped: -inf in float16, NaN after a softmax",
        survives="equivalent (argued and probed after scoring, runs/mutants_round10.md): the "
        "body's readers see the operand's frozen origin and clamp it as the outside cast did, "
        "and a frozen value has no cotangent; only where the casts sit differs (XLA hoists)",
    ),
    _m(
        "r10_big_outputs_backward_only",
        "trace/graph.py",
        "rec.big_outputs = tuple(not outer_backward and o.big for o in out_origins)",
        "rec.big_outputs = tuple(outer_backward and o.big for o in out_origins)",
        # caught by the test it names
        "tests/test_mask_values.py::test_gradients_across_boundaries[rewrite_of_grad-scan-float16]",
        "a 'not' dropped: a forward body's big outputs are never pinned at its output casts, "
        "so a scan handing on a float32 -1e9 mask bias casts it into float16 at the boundary "
        "and grad(rewrite(f)) through a half mul reading it is far off float32 again",
    ),
    # -- a select_n chooses as a cond does ---------------------------------------------------
    _m(
        "r10_all_half_any_case",
        "paint/additions.py",
        "return all(f in half for f in g.choice_cases.get(n.id, n.fanin))",
        "return any(f in half for f in g.choice_cases.get(n.id, n.fanin))",
        # caught by the test it names
        "tests/test_select_state.py::test_a_select_hands_the_state_it_did_not_update_on_exactly[vmap_cond-eager-f16]",
        "any for all: a select_n (or cond output) one of whose value cases is half counts as "
        "moving half values, so where(ok, update(s), s) with s computed in float32 (a loop "
        "carry handed on) comes back rounded through half",
    ),
    _m(
        "r10_choices_no_select_n",
        "paint/additions.py",
        '_CHOICES = ("<cond-output>", "select_n")',
        '_CHOICES = ("<cond-output>",)',
        # caught by the test it names
        "tests/test_select_state.py::test_a_select_hands_the_state_it_did_not_update_on_exactly[where-eager-f16]",
        "select_n missing from the choices: a vmapped cond of a batched predicate (both "
        "branches and a select_n) hands the untouched float32 state back rounded through "
        "bfloat16 beside a square update painted half",
    ),
    _m(
        "r10_choice_cases_frozen_counted",
        "trace/graph.py",
        "if is_float(a.aval.dtype) and not o.frozen",
        "if is_float(a.aval.dtype)",
        # caught by the test it names
        "tests/test_select_state.py::test_a_mask_fill_takes_the_selects_type[literal-f16]",
        "a select's constant cases counted as values: a masked score where(m, scores, fill) "
        "with a constant fill (a literal -1e9: no node, so an outside handoff; or "
        "jnp.full_like(scores, -1e9), Origin.frozen) never counts "
        "as half, so the masked scores beside a half matmul are kept float32",
    ),
)
