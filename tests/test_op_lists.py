"""Tests for jmp_rewrite._src.lists.op_lists: TF's AMP lists as data keyed by JAX primitive
names."""

from __future__ import annotations

import dataclasses
import doctest
import gc
import importlib
import json
import pathlib
import re
import types
import warnings

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_rewrite
from jmp_rewrite._src.lists import environment, op_lists
from jmp_rewrite._src.lists.environment import env_var_name, lists_from_environment
from jmp_rewrite._src.lists.op_lists import (
    DIFFERENCES_FROM_TF,
    FLOAT32_ONLY,
    KINDS,
    LEVELS,
    NON_FLOAT,
    REASONS,
    STRUCTURAL,
    VIRTUAL_KEYS,
    OpLists,
    apply_level,
    canonical_level,
    default_lists,
    dot_general_key,
    integer_pow_key,
    jit_key,
    known_op_keys,
)

FP16 = default_lists("float16")
BF16 = default_lists("bfloat16")

# ------------------------------------------------------------------------------------------
# Default lists
# ------------------------------------------------------------------------------------------

JIT_UNITS = ["log_softmax", "softplus", "elu", "selu", "celu", "soft_sign", "log_sigmoid"]


# TF 2.21's lists as TF ships them (auto_mixed_precision_lists.h, read from the tensorflow
# 2.21 wheel), the copy in tests/data; the configurations our default lists follow.
TF_LISTS_FILE = pathlib.Path(__file__).with_name("data") / "tf_amp_lists_tf2.21.json"
SHARED_REFERENCE = pathlib.Path(__file__).resolve().parents[2] / "shared" / "reference"
TF_LISTS = json.loads(TF_LISTS_FILE.read_text())
TF_CONFIG = {"float16": "cuda_fp16(cuda>=9.1,cudnn>=8.0)", "bfloat16": "onednn_bf16"}
DEFAULTS = {"float16": FP16, "bfloat16": BF16}

# The TF op names a reason gives (see the comment above the tables in op_lists.py):
# "TF A/B(V2)/C: ..." names the counterparts, "... like [TF ]A/B" the ops it behaves like.
_TF_NAMES = r"[A-Z]\w*(?:\(\w+\))?(?:/[A-Z]\w*(?:\(\w+\))?)*"
_COUNTERPART = re.compile(rf"^TF ({_TF_NAMES})")
_ANALOGUE = re.compile(rf"\blike (?:TF )?({_TF_NAMES})")
_MENTIONED = re.compile(rf"\bTF ({_TF_NAMES})")


def _names(group: str) -> list[str]:
    return [re.sub(r"\(\w+\)$", "", name) for name in group.split("/")]


def tf_kind(op: str, dtype: str) -> str:
    """The list TF 2.21 puts ``op`` on for ``dtype`` (our default lists' configuration)."""
    lists = TF_LISTS["effective"][TF_CONFIG[dtype]]
    found = [kind for kind in KINDS if op in lists[kind]]
    assert len(found) <= 1, (op, found)
    return found[0] if found else "unlisted"


def _all_tf_ops() -> set[str]:
    return {
        op for config in TF_LISTS["effective"].values() for ops in config.values() for op in ops
    }


def tf_reference(key: str) -> tuple[list[str], dict[str, str]]:
    """The TF ops a list entry's reason names, and the kind they give it per dtype."""
    reason = REASONS[key]
    match = _COUNTERPART.match(reason) or _ANALOGUE.search(reason)
    assert match, (
        f"the reason of {key!r} names no TF op: start it with 'TF <Op>' (its counterpart) or "
        f"say what it is 'like <Op>': {reason!r}"
    )
    ops = _names(match.group(1))
    unknown = sorted(set(ops) - _all_tf_ops())
    assert not unknown, f"{key!r}: {unknown} are on no TF list (a typo?): {reason!r}"
    expected = {}
    for dtype in TF_CONFIG:
        kinds = {tf_kind(op, dtype) for op in ops} - {"unlisted"}
        assert len(kinds) <= 1, f"{key!r}: {ops} are on different TF lists in {dtype}: {kinds}"
        expected[dtype] = kinds.pop() if kinds else "unlisted"
    return ops, expected


def test_tf_lists_copy_matches_the_shared_reference():
    shared = SHARED_REFERENCE / TF_LISTS_FILE.name
    if not shared.is_file():
        pytest.skip("no shared reference folder beside the checkout")
    assert json.loads(shared.read_text()) == TF_LISTS


@pytest.mark.parametrize("key", sorted(REASONS))
def test_default_lists_follow_tf_or_declare_the_difference(key):
    """Every key on a default list is, in both dtypes, on TF 2.21's list for the TF op its
    reason names, or on the list DIFFERENCES_FROM_TF declares (with a reason) instead."""
    ops, expected = tf_reference(key)
    for dtype, lists in DEFAULTS.items():
        ours = lists.kind(key)
        declared = DIFFERENCES_FROM_TF.get((key, dtype))
        if declared is None:
            assert ours == expected[dtype], (
                f"{key!r} is {ours} in {dtype}, but TF puts {'/'.join(ops)} on {expected[dtype]}"
                " (declare a deliberate difference with _def_difference_from_tf)"
            )
        else:
            assert ours == declared[0], f"{key!r} is {ours} in {dtype}, declared {declared[0]}"
            assert ours != expected[dtype], (
                f"{key!r} is declared to differ from TF in {dtype}, but TF puts "
                f"{'/'.join(ops)} on {ours} too: remove the declaration"
            )


def test_declared_differences_are_default_list_keys_with_reasons():
    assert DIFFERENCES_FROM_TF, "the Mha difference at least"
    for (key, dtype), (kind, reason) in DIFFERENCES_FROM_TF.items():
        assert key in REASONS and dtype in TF_CONFIG and kind in KINDS and reason.strip(), key


@pytest.mark.parametrize("key", sorted(FLOAT32_ONLY))
def test_float32_only_keys_name_tf_ops_that_tf_keeps_float32(key):
    """A float32-only key is on no default list; a TF op its reason names is one TF never
    converts (unlisted, or deny: SaveV2)."""
    assert all(lists.kind(key) == "unlisted" for lists in DEFAULTS.values())
    for group in _MENTIONED.findall(FLOAT32_ONLY[key]):
        for op in _names(group):
            for dtype in TF_CONFIG:
                assert tf_kind(op, dtype) in ("unlisted", "deny"), (key, op, dtype)


@pytest.mark.parametrize("name", JIT_UNITS)
def test_named_jit_units_are_infer_in_both_dtypes(name):
    # TF's LogSoftmax/Softplus/Elu/Selu/Softsign are infer; decomposed they'd contain deny ops.
    assert FP16.kind(jit_key(name)) == "infer"
    assert BF16.kind(jit_key(name)) == "infer"


@pytest.mark.parametrize("name", ["softmax", "relu", "gelu", "silu", "leaky_relu"])
def test_other_composites_are_not_units(name):
    assert jit_key(name) not in FP16
    assert jit_key(name) not in BF16


def test_integer_pow_keys():
    assert integer_pow_key(-1) == "reciprocal"
    assert integer_pow_key(2) == "square"
    for y in (-2, 0, 1, 3, 4):
        assert integer_pow_key(y) == "integer_pow"
    # x**-1 is TF Reciprocal (infer); x**3 is TF Pow (deny); x**2 is TF Square.
    assert FP16.kind(integer_pow_key(-1)) == "infer"
    assert FP16.kind(integer_pow_key(3)) == "deny"
    assert (FP16.kind(integer_pow_key(2)), BF16.kind(integer_pow_key(2))) == ("unlisted", "infer")


@pytest.mark.parametrize(
    "dtype", [jnp.float16, np.float16, "float16", np.dtype("float16"), jnp.dtype("float16")]
)
def test_default_lists_accepts_float16_spellings(dtype):
    assert default_lists(dtype) is FP16


@pytest.mark.parametrize("dtype", [jnp.bfloat16, "bfloat16", jnp.dtype("bfloat16")])
def test_default_lists_accepts_bfloat16_spellings(dtype):
    assert default_lists(dtype) is BF16


@pytest.mark.parametrize(
    "dtype", [jnp.float32, "float32", np.float64, jnp.int8, None, "nonsense", True, float, 3]
)
def test_default_lists_rejects_other_dtypes(dtype):
    with pytest.raises(ValueError, match="float16.*bfloat16"):
        default_lists(dtype)


def test_default_lists_are_valid_op_lists():
    for lists in (FP16, BF16):
        assert isinstance(lists, OpLists)
        every = set().union(*(getattr(lists, k) for k in KINDS))
        assert every <= known_op_keys()


# ------------------------------------------------------------------------------------------
# OpLists
# ------------------------------------------------------------------------------------------


def test_constructor_freezes_any_iterable():
    lists = OpLists(allow=["dot_general"], infer=(k for k in ["add", "mul"]), clear={"max"})
    for kind in KINDS:
        assert type(getattr(lists, kind)) is frozenset
    assert lists.infer == frozenset({"add", "mul"})
    assert lists.deny == frozenset()


def test_constructor_rejects_bare_strings_and_non_strings():
    with pytest.raises(TypeError, match="single string"):
        OpLists(allow="dot_general")
    with pytest.raises(TypeError, match="strings"):
        OpLists(allow=[jax.lax.dot_general_p])
    with pytest.raises(TypeError, match="iterable"):
        OpLists(allow=3)


@pytest.mark.parametrize(
    ("first", "second"),
    [(a, b) for i, a in enumerate(KINDS) for b in KINDS[i + 1 :]],
)
def test_conflicting_entries_name_the_op_and_both_lists(first, second):
    with pytest.raises(ValueError, match="conflicting entries") as info:
        OpLists(**{first: ["exp"], second: ["exp"]})
    message = str(info.value)
    assert "'exp'" in message
    assert first in message and second in message


@pytest.mark.parametrize(
    ("bad", "suggestion"),
    [
        ("rsqr", "rsqrt"),
        ("dot_genral", "dot_general"),
        ("MatMul", "dot_general"),
        ("Sum", "reduce_sum"),
        ("scatter_add", "scatter-add"),
    ],
)
def test_unknown_keys_raise_with_suggestions(bad, suggestion):
    with pytest.raises(ValueError, match="unknown op key") as info:
        OpLists(deny=[bad])
    assert repr(bad) in str(info.value)
    assert repr(suggestion) in str(info.value)
    assert "deny" in str(info.value)


def test_any_named_jit_is_a_valid_key():
    lists = OpLists(infer=["jit:my_block"])
    assert lists.kind("jit:my_block") == "infer"
    with pytest.raises(ValueError, match="unknown op key"):
        OpLists(infer=["jit:"])


def test_add_returns_new_object_and_leaves_old_untouched():
    before = dataclasses.asdict(FP16)
    lists = FP16.add(infer=["rsqrt"], clear=["square"])
    assert lists is not FP16
    assert lists.kind("rsqrt") == "infer" and lists.kind("square") == "clear"
    assert FP16.kind("rsqrt") == "unlisted" and FP16.kind("square") == "unlisted"
    assert dataclasses.asdict(FP16) == before
    # Adding what is already there is a no-op (TF's lists are sets).
    assert FP16.add(allow=["dot_general"]) == FP16


def test_add_to_a_second_list_conflicts():
    with pytest.raises(ValueError, match="conflicting entries.*'max'.*infer.*clear"):
        FP16.add(infer=["max"])


def test_add_unknown_key_raises():
    with pytest.raises(ValueError, match="unknown op key 'nope'"):
        FP16.add(allow=["nope"])


def test_remove_returns_new_object_and_leaves_old_untouched():
    lists = FP16.remove(deny=["exp", "reduce_sum"], clear=["max"])
    assert lists is not FP16
    assert lists.kind("exp") == "unlisted"
    assert lists.kind("reduce_sum") == "unlisted"
    assert lists.kind("max") == "unlisted"
    assert FP16.kind("exp") == "deny" and FP16.kind("max") == "clear"


def test_remove_a_key_not_on_that_list_raises_and_says_where_it_is():
    with pytest.raises(ValueError, match="'add'.*deny.*on the infer list"):
        FP16.remove(deny=["add"])
    with pytest.raises(ValueError, match="'rsqrt'.*unlisted"):
        FP16.remove(infer=["rsqrt"])


@pytest.mark.parametrize("to", [*KINDS, "unlisted"])
def test_move(to):
    lists = FP16.move("reduce_sum", to)
    assert lists.kind("reduce_sum") == to
    assert FP16.kind("reduce_sum") == "deny"
    assert sum("reduce_sum" in getattr(lists, k) for k in KINDS) == (0 if to == "unlisted" else 1)


def test_move_errors():
    with pytest.raises(ValueError, match="'gray'"):
        FP16.move("exp", "gray")
    with pytest.raises(ValueError, match="unknown op key 'expp'.*'exp'"):
        FP16.move("expp", "allow")


def test_immutability():
    with pytest.raises(dataclasses.FrozenInstanceError):
        FP16.allow = frozenset()  # type: ignore[misc]
    with pytest.raises(AttributeError):
        FP16.allow.add("exp")  # type: ignore[attr-defined]
    assert FP16.kind("exp") == "deny"


def test_hashable_and_compared_by_value():
    a = OpLists(allow=["dot_general"], infer=["add"])
    b = OpLists(allow=("dot_general",), infer={"add"})
    assert a == b and hash(a) == hash(b)
    assert {a: 1}[b] == 1
    assert a != a.add(deny=["exp"])
    assert hash(FP16) != hash(BF16) or FP16 != BF16
    assert FP16 != BF16
    assert len({FP16, BF16, default_lists("float16")}) == 2


def test_kind_contains_repr():
    assert FP16.kind("never_heard_of_it") == "unlisted"  # the painter asks about anything
    assert "dot_general" in FP16 and "sin" not in FP16
    assert repr(OpLists(allow=["dot_general"], clear=["max", "min"])) == (
        "OpLists(allow: 1, infer: 0, deny: 0, clear: 2)"
    )
    assert repr(FP16).startswith("OpLists(allow: ")


# ------------------------------------------------------------------------------------------
# Levels
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "level"),
    [
        ("", "DEFAULT"),
        (None, "DEFAULT"),
        ("default", "DEFAULT"),
        ("  Tensor_Cores_Only ", "TENSOR_CORES_ONLY"),
        ("treat_infer_as_deny", "TREAT_INFER_AS_DENY"),
        ("UNSAFE_FORCE_ALL", "UNSAFE_FORCE_ALL"),
    ],
)
def test_canonical_level(raw, level):
    assert canonical_level(raw) == level


def test_unknown_level_lists_allowed_levels():
    with pytest.raises(ValueError, match="unknown level 'FAST'") as info:
        canonical_level("FAST")
    for level in LEVELS:
        assert level in str(info.value)


def test_level_default_and_unsafe_force_all_leave_lists_alone():
    assert apply_level(FP16, "", "float16") == FP16
    assert apply_level(FP16, "UNSAFE_FORCE_ALL", "float16") == FP16
    assert apply_level(BF16, "default", "bfloat16") == BF16


def test_level_tensor_cores_only():
    lists = apply_level(FP16, "TENSOR_CORES_ONLY", jnp.float16)
    assert lists.allow == FP16.allow
    assert lists.infer == lists.deny == lists.clear == frozenset()
    # TF checks this level only in its fp16 list class: bf16 ignores it.
    assert apply_level(BF16, "TENSOR_CORES_ONLY", jnp.bfloat16) == BF16


@pytest.mark.parametrize("lists", [FP16, BF16], ids=["float16", "bfloat16"])
def test_level_treat_infer_as_deny(lists):
    dtype = "float16" if lists is FP16 else "bfloat16"
    merged = apply_level(lists, "TREAT_INFER_AS_DENY", dtype)
    assert merged.infer == frozenset()
    assert merged.deny == lists.deny | lists.infer
    assert merged.allow == lists.allow and merged.clear == lists.clear


def test_level_unsafe_force_all_is_an_error_in_bfloat16():
    with pytest.raises(ValueError, match="UNSAFE_FORCE_ALL.*bfloat16"):
        apply_level(BF16, "UNSAFE_FORCE_ALL", "bfloat16")


def test_apply_level_validates_dtype():
    with pytest.raises(ValueError, match="float16"):
        apply_level(FP16, "", jnp.float32)


# ------------------------------------------------------------------------------------------
# Environment overrides
# ------------------------------------------------------------------------------------------

ENV_VARS = [env_var_name(kind, action) for kind in KINDS for action in ("ADD", "REMOVE")]


def test_env_var_names():
    assert ENV_VARS == [
        "JMP_REWRITE_ALLOWLIST_ADD",
        "JMP_REWRITE_ALLOWLIST_REMOVE",
        "JMP_REWRITE_INFERLIST_ADD",
        "JMP_REWRITE_INFERLIST_REMOVE",
        "JMP_REWRITE_DENYLIST_ADD",
        "JMP_REWRITE_DENYLIST_REMOVE",
        "JMP_REWRITE_CLEARLIST_ADD",
        "JMP_REWRITE_CLEARLIST_REMOVE",
    ]
    with pytest.raises(ValueError):
        env_var_name("gray", "ADD")


def test_no_environment_gives_defaults():
    assert lists_from_environment("float16", {}) == (FP16, "DEFAULT")
    assert lists_from_environment("bfloat16", {"UNRELATED": "x"}) == (BF16, "DEFAULT")


# (kind, keys added: unlisted in fp16 by default, key removed: on that list by default)
ENV_CASES = [
    ("allow", "sin, cos", "conv_general_dilated"),
    ("infer", " rsqrt ,square,", "tanh"),
    ("deny", "sin", "exp"),
    ("clear", "rsqrt", "transpose"),
]


@pytest.mark.parametrize(("kind", "added", "removed"), ENV_CASES, ids=[c[0] for c in ENV_CASES])
def test_env_add_and_remove_each_list(kind, added, removed):
    env = {env_var_name(kind, "ADD"): added, env_var_name(kind, "REMOVE"): removed}
    lists, level = lists_from_environment("float16", env)
    assert level == "DEFAULT"
    for key in (k.strip() for k in added.split(",") if k.strip()):
        assert lists.kind(key) == kind
    assert lists.kind(removed) == "unlisted"
    # Everything else is as in the defaults.
    touched = {k.strip() for k in added.split(",")} | {removed}
    for other in KINDS:
        assert getattr(lists, other) - touched == getattr(FP16, other) - touched


def test_env_add_then_remove_the_same_key_removes_it():
    env = {"JMP_REWRITE_DENYLIST_ADD": "sin", "JMP_REWRITE_DENYLIST_REMOVE": "sin"}
    lists, _ = lists_from_environment("float16", env)
    assert lists.kind("sin") == "unlisted"


def test_env_moves_a_key_between_lists_via_add_and_remove():
    # TF validates after every getter ran, so ADD to one list + REMOVE from another is a move.
    env = {"JMP_REWRITE_INFERLIST_ADD": "max", "JMP_REWRITE_CLEARLIST_REMOVE": "max"}
    lists, _ = lists_from_environment("float16", env)
    assert lists.kind("max") == "infer"


@pytest.mark.parametrize("var", ENV_VARS)
def test_env_unknown_name_names_the_variable_and_the_key(var):
    with pytest.raises(ValueError, match=f"unknown op key 'Rsqrtt' in {var}.*'rsqrt'"):
        lists_from_environment("float16", {var: "add, Rsqrtt"})


def test_env_conflict_names_op_and_both_lists():
    # TF: INFERLIST_ADD=Relu (also on clear) -> "Op lists have conflicting entries".
    with pytest.raises(ValueError, match="conflicting entries.*'max'.*infer.*clear"):
        lists_from_environment("float16", {"JMP_REWRITE_INFERLIST_ADD": "max"})


def test_env_remove_of_key_not_on_that_list_is_ignored_with_a_warning():
    # Sum is deny in fp16 but infer in bf16; TF ignores a REMOVE that finds nothing.
    env = {"JMP_REWRITE_DENYLIST_REMOVE": "reduce_sum"}
    with pytest.warns(UserWarning, match="DENYLIST_REMOVE.*'reduce_sum'.*on the infer list"):
        lists, _ = lists_from_environment("bfloat16", env)
    assert lists == BF16
    lists, _ = lists_from_environment("float16", env)
    assert lists.kind("reduce_sum") == "unlisted"


def test_env_reads_os_environ_by_default(monkeypatch):
    for var in [*ENV_VARS, "JMP_REWRITE_LEVEL"]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("JMP_REWRITE_INFERLIST_ADD", "rsqrt")
    monkeypatch.setenv("JMP_REWRITE_LEVEL", "treat_infer_as_deny")
    lists, level = lists_from_environment(jnp.float16)
    assert level == "TREAT_INFER_AS_DENY"
    assert lists.kind("rsqrt") == "deny"


def test_env_level_unknown_names_the_variable():
    with pytest.raises(ValueError, match="JMP_REWRITE_LEVEL: unknown level 'FASTEST'"):
        lists_from_environment("float16", {"JMP_REWRITE_LEVEL": "FASTEST"})


@pytest.fixture
def fresh_env_warnings(monkeypatch):
    """Forget which misspelled variables were warned about (once per name and process)."""
    monkeypatch.setattr(environment, "_WARNED_ENV_NAMES", set())


TYPOS = [
    ("JMP_REWRITE_ALOWLIST_ADD", "JMP_REWRITE_ALLOWLIST_ADD"),
    ("JMP_REWRITE_ALLOWLIST_ADDD", "JMP_REWRITE_ALLOWLIST_ADD"),
    ("JMP_REWRITE_DENYLIST_REMOV", "JMP_REWRITE_DENYLIST_REMOVE"),
    ("JMP_REWRITE_INFER_ADD", "JMP_REWRITE_INFERLIST_ADD"),
    ("JMP_REWRITE_LEVL", "JMP_REWRITE_LEVEL"),
    ("JMP_REWRITE_BLACKLIST_ADD", "JMP_REWRITE_DENYLIST_ADD"),  # TF's name before 2.4
    ("JMP_REWRITE_Clearlist_Remove", "JMP_REWRITE_CLEARLIST_REMOVE"),
]


@pytest.mark.usefixtures("fresh_env_warnings")
@pytest.mark.parametrize(("typo", "meant"), TYPOS, ids=[t for t, _ in TYPOS])
def test_env_misspelled_variable_is_ignored_with_a_warning_naming_the_closest(typo, meant):
    with pytest.warns(UserWarning) as record:
        lists, level = lists_from_environment("float16", {typo: "sin"})
    assert [str(w.message) for w in record] == [
        f"environment variable {typo} is not read by jmp_rewrite and is ignored; "
        f"did you mean {meant}?"
    ]
    assert record[0].filename == __file__  # points at the caller
    assert (lists, level) == (FP16, "DEFAULT")


@pytest.mark.usefixtures("fresh_env_warnings")
def test_env_misspelling_warns_once_per_name():
    env = {"JMP_REWRITE_ALOWLIST_ADD": "sin", "JMP_REWRITE_INFERLIST_ADD": "rsqrt"}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for dtype in ("float16", "bfloat16", "float16"):
            lists, _ = lists_from_environment(dtype, env)
            assert lists.kind("rsqrt") == "infer" and lists.kind("sin") != "allow"
        lists_from_environment("float16", {**env, "JMP_REWRITE_ALOWLIST_ADD": "cos"})
        lists_from_environment("float16", {"JMP_REWRITE_DENYLIST_ADDD": "sin"})
    assert [str(w.message).split()[2] for w in record] == [
        "JMP_REWRITE_ALOWLIST_ADD",
        "JMP_REWRITE_DENYLIST_ADDD",
    ]


@pytest.mark.usefixtures("fresh_env_warnings")
def test_env_valid_and_unrelated_names_do_not_warn():
    env = dict.fromkeys(environment.env_var_names(), "")
    env |= dict.fromkeys(environment.env_var_names("tf"), "")
    env |= {"JMP_REWRITER": "x", "XLA_FLAGS": "", "TF_ENABLE_ONEDNN_OPTS": "1"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lists_from_environment("float16", env) == (FP16, "DEFAULT")


@pytest.mark.usefixtures("fresh_env_warnings")
def test_env_unrecognisable_name_lists_the_variables():
    with pytest.warns(UserWarning, match="JMP_REWRITE_CACHE_DIR") as record:
        lists_from_environment("float16", {"JMP_REWRITE_CACHE_DIR": "/tmp"})
    assert str(record[0].message).endswith(
        "ignored; the variables are " + ", ".join(["JMP_REWRITE_LEVEL", *ENV_VARS])
    )


@pytest.mark.usefixtures("fresh_env_warnings")
def test_rewrite_warns_about_a_misspelled_variable_in_the_environment(monkeypatch):
    """The typo sits in the shell; the rewritten function runs on the default lists."""
    monkeypatch.setenv("JMP_REWRITE_DENYLIST_ADDD", "dot_general")

    def layer(x, w):
        return jnp.tanh(x @ w)

    x = jnp.ones((4, 4), jnp.float32)
    fn = jmp_rewrite.rewrite(layer, dtype=jnp.float16)
    typo = r"JMP_REWRITE_DENYLIST_ADDD .*did you mean JMP_REWRITE_DENYLIST_ADD\?"
    with pytest.warns(UserWarning, match=typo):
        out = fn(x, x)
    assert out.dtype == jnp.float32
    painted = jmp_rewrite.paint(layer, x, x, dtype=jnp.float16)
    (dot,) = painted.find("dot_general")
    assert dot.list == "allow" and dot.colour == "allow"  # not moved to deny by the typo
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn(x, x)  # once per name


def test_env_tensor_cores_only_empties_lists_before_add():
    env = {
        "JMP_REWRITE_LEVEL": "tensor_cores_only",
        "JMP_REWRITE_ALLOWLIST_ADD": "sin",
        "JMP_REWRITE_ALLOWLIST_REMOVE": "ragged_dot_general",
        "JMP_REWRITE_INFERLIST_ADD": "rsqrt",
        "JMP_REWRITE_CLEARLIST_REMOVE": "max",
    }
    with pytest.warns(UserWarning, match="ignored.*TENSOR_CORES_ONLY") as record:
        lists, level = lists_from_environment("float16", env)
    assert level == "TENSOR_CORES_ONLY"
    assert len(record) == 2  # INFERLIST_ADD and CLEARLIST_REMOVE
    # As in TF: ALLOWLIST overrides apply; *_ADD/_REMOVE of the emptied lists are ignored.
    assert lists.allow == (FP16.allow | {"sin"}) - {"ragged_dot_general"}
    assert lists.infer == lists.deny == lists.clear == frozenset()


def test_env_tensor_cores_only_still_rejects_unknown_names():
    env = {"JMP_REWRITE_LEVEL": "TENSOR_CORES_ONLY", "JMP_REWRITE_INFERLIST_ADD": "bogus"}
    with pytest.raises(ValueError, match="JMP_REWRITE_INFERLIST_ADD"):
        lists_from_environment("float16", env)


def test_env_tensor_cores_only_is_ignored_for_bfloat16():
    env = {"JMP_REWRITE_LEVEL": "TENSOR_CORES_ONLY", "JMP_REWRITE_INFERLIST_ADD": "sin"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lists, level = lists_from_environment("bfloat16", env)
    assert level == "TENSOR_CORES_ONLY"
    assert lists == BF16.add(infer=["sin"])


def test_env_treat_infer_as_deny_merges_after_overrides():
    env = {
        "JMP_REWRITE_LEVEL": "TREAT_INFER_AS_DENY",
        "JMP_REWRITE_INFERLIST_ADD": "rsqrt",
        "JMP_REWRITE_INFERLIST_REMOVE": "log",
    }
    lists, level = lists_from_environment("float16", env)
    assert level == "TREAT_INFER_AS_DENY"
    assert lists.infer == frozenset()
    assert lists.deny == (FP16.deny | FP16.infer | {"rsqrt"}) - {"log"}
    assert lists.kind("log") == "unlisted"


def test_env_unsafe_force_all():
    lists, level = lists_from_environment("float16", {"JMP_REWRITE_LEVEL": "unsafe_force_all"})
    assert (lists, level) == (FP16, "UNSAFE_FORCE_ALL")
    with pytest.raises(ValueError, match="UNSAFE_FORCE_ALL.*bfloat16"):
        lists_from_environment("bfloat16", {"JMP_REWRITE_LEVEL": "UNSAFE_FORCE_ALL"})


# ------------------------------------------------------------------------------------------
# Coverage: every JAX primitive is classified deliberately
# ------------------------------------------------------------------------------------------


def _walk_public_primitives() -> dict[str, str]:
    """name -> where it was found, for primitives reachable from public JAX modules."""
    modules = [jax.lax, jex_core.primitives, importlib.import_module("jax.lax.linalg")]
    modules += [
        v
        for v in vars(jax.lax).values()
        if isinstance(v, types.ModuleType) and v.__name__.startswith("jax.lax.")
    ]
    found: dict[str, str] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in modules:
            for attr in dir(module):
                try:
                    value = getattr(module, attr)
                except Exception:
                    continue
                if isinstance(value, jex_core.Primitive):
                    found.setdefault(value.name, f"{module.__name__}.{attr}")
    return found


def _all_list_keys() -> set[str]:
    return set().union(*(getattr(lists, k) for lists in (FP16, BF16) for k in KINDS))


def test_every_public_primitive_is_classified():
    classified = _all_list_keys() | set(FLOAT32_ONLY) | set(STRUCTURAL) | set(NON_FLOAT)
    found = _walk_public_primitives()
    assert len(found) > 150  # the walk really found JAX's primitives
    missing = sorted(set(found) - classified)
    assert not missing, "\n".join(
        f"primitive {name!r} ({found[name]}) is not classified: put it on a default list "
        "(_def_allow/_def_infer/_def_deny/_def_clear/_def_lists, with a reason) or in "
        "FLOAT32_ONLY / STRUCTURAL / NON_FLOAT in jmp_rewrite/_src/lists/op_lists.py"
        for name in missing
    )


def test_known_op_keys_cover_everything():
    known = known_op_keys()
    assert set(_walk_public_primitives()) <= known
    assert _all_list_keys() <= known
    assert set(FLOAT32_ONLY) | set(STRUCTURAL) | set(NON_FLOAT) <= known
    assert {"reciprocal", "square", "integer_pow"} <= known
    assert {jit_key(n) for n in JIT_UNITS} <= known


def test_categories_and_lists_are_pairwise_disjoint():
    groups = {
        "lists": _all_list_keys(),
        "FLOAT32_ONLY": set(FLOAT32_ONLY),
        "STRUCTURAL": set(STRUCTURAL),
        "NON_FLOAT": set(NON_FLOAT),
    }
    names = list(groups)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not groups[a] & groups[b], f"{sorted(groups[a] & groups[b])} in {a} and {b}"


def test_every_entry_has_a_reason():
    assert set(REASONS) == _all_list_keys()
    for table in (REASONS, FLOAT32_ONLY, STRUCTURAL, NON_FLOAT):
        for key, reason in table.items():
            assert isinstance(reason, str) and reason.strip(), key
            assert "\n" not in reason, key


def test_tables_are_read_only():
    with pytest.raises(TypeError):
        FLOAT32_ONLY["sin"] = "no"  # type: ignore[index]
    with pytest.raises(TypeError):
        REASONS["exp"] = "no"  # type: ignore[index]


# Names from other JAX versions, kept so the same lists work there.
_OTHER_VERSION_NAMES = {
    "checkpoint",
    "core_call",
    "custom_vjp_call_jaxpr",
    "pjit",
    "remat_call",
    "xla_call",
    "xla_pmap",
    # jax 0.10 only
    "call",
    "closed_call",
    # jax >= 0.12 only
    "log2",
    "one_minus_square",
    "polynomial",
}


def test_classified_names_are_real_primitives():
    # Catches typos in the tables: every name must be a primitive somewhere in this JAX, found
    # through public modules (gc sees primitives that are only reachable privately).
    for name in (
        "jax.experimental.pallas",
        "jax.experimental.shard_map",
        "jax.experimental.checkify",
        "jax.experimental.compute_on",
        "jax.experimental.custom_partitioning",
        "jax.experimental.buffer_callback",
        "jax.experimental.fused",
        "jax.experimental.scheduling_groups",
        "equinox.internal",  # Equinox's primitives (diffrax's loops)
    ):
        importlib.import_module(name)
    jax.nn.dot_product_attention  # noqa: B018 - imports the cuDNN attention primitives
    gc.unfreeze()  # conftest.py freezes what is alive; get_objects skips what is frozen
    real = {o.name for o in gc.get_objects() if isinstance(o, jex_core.Primitive)}
    gc.freeze()  # and frozen again: the module's leak checks would scan it all
    classified = set(REASONS) | set(FLOAT32_ONLY) | set(STRUCTURAL) | set(NON_FLOAT)
    virtual = {k for k in classified if k.startswith("jit:")} | _OTHER_VERSION_NAMES
    assert sorted(classified - real - virtual - VIRTUAL_KEYS) == []


# ------------------------------------------------------------------------------------------
# The keys match what real programs trace to
# ------------------------------------------------------------------------------------------


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jex_core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def _keys_in(fn, *args) -> list[str]:
    keys = []
    for eqn in _eqns(jax.make_jaxpr(fn)(*args).jaxpr):
        name = eqn.primitive.name
        if name == "integer_pow":
            name = integer_pow_key(eqn.params["y"])
        if name == "dot_general":
            name = dot_general_key(eqn.params["dimension_numbers"])
        keys.append(name)
        if name == "jit":
            keys.append(jit_key(eqn.params["name"]))
    return keys


def test_named_jit_units_match_jax_nn():
    x = jnp.ones((2, 3))
    for name in JIT_UNITS:
        keys = _keys_in(getattr(jax.nn, name), x)
        assert jit_key(name) in keys, (name, keys)


def test_a_training_step_traces_only_classified_primitives():
    def loss(params, x, y):
        h = jax.nn.gelu(x @ params["w1"])
        h = jax.nn.softplus(h) + jax.nn.relu(h) ** 2 + jnp.reciprocal(h**2 + 1.0)
        h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
        logits = h @ params["w2"]
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * y, axis=-1))

    params = {"w1": jnp.ones((4, 8)), "w2": jnp.ones((8, 3))}
    keys = _keys_in(jax.grad(loss), params, jnp.ones((2, 4)), jnp.ones((2, 3)))
    classified = _all_list_keys() | set(FLOAT32_ONLY) | set(STRUCTURAL) | set(NON_FLOAT)
    # Named jits that are not units (jit:_var, jit:_where, ...) are simply seen through.
    assert {k for k in keys if not k.startswith("jit:")} - classified == set()
    assert {"dot_general", "reciprocal", "square", "jit:log_softmax", "jit:softplus"} <= set(keys)
    assert "integer_pow" in keys  # gelu's x**3 (TF Pow: deny)


@pytest.mark.parametrize(
    "spec", ["i,j->ij", "bi,bj->bij", "i,i->i"], ids=["outer", "batched_outer", "elementwise"]
)
def test_dot_general_without_contraction_is_an_infer_mul(spec):
    """Issue 14 item 3: RoPE's ``einsum("i,j->ij", pos, inv_freq)`` is TF's Mul (infer), not
    a matmul; ``i,j->`` (a contraction) stays a matmul."""
    a = jnp.ones((2, 3)) if spec.startswith("b") else jnp.ones(3)
    keys = _keys_in(lambda a, b: jnp.einsum(spec, a, b), a, a)
    assert "outer_product" in keys and "dot_general" not in keys, keys
    v = jnp.ones(3)
    assert "dot_general" in _keys_in(lambda a, b: jnp.einsum("i,i->", a, b), v, v)
    for lists in (FP16, BF16):
        assert lists.kind("outer_product") == "infer" == lists.kind("mul")
    assert REASONS["outer_product"].startswith("TF Mul")


def test_module_doctests():
    result = doctest.testmod(op_lists, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 10 and result.failed == 0
