"""TF's environment variables and our JMP_REWRITE_* aliases (jmp_rewrite._src.lists.environment)."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import pytest

import jmp_rewrite as jr
from jmp_rewrite._src.lists import environment
from jmp_rewrite._src.lists.environment import (
    env_var_name,
    env_var_names,
    level_from_environment,
    lists_from_environment,
    tf_op_keys,
)

FP16 = jr.default_lists(jnp.float16)
TF = environment.TF_PREFIX


@pytest.fixture(autouse=True)
def fresh_env_warnings(monkeypatch):
    """Forget which misspelt variables were warned about (once per name and process)."""
    monkeypatch.setattr(environment, "_WARNED_ENV_NAMES", set())


def test_tf_names_are_read_and_ours_are_aliases():
    assert env_var_name("allow", "add", family="tf") == f"{TF}ALLOWLIST_ADD"
    assert env_var_names("tf")[0] == f"{TF}LEVEL"
    assert f"{TF}BLACKLIST_REMOVE" in env_var_names("tf")  # TF's names before 2.4
    lists, _ = lists_from_environment("float16", {f"{TF}ALLOWLIST_ADD": "sin"})
    assert lists.kind("sin") == "allow"
    alias, _ = lists_from_environment("float16", {"JMP_REWRITE_ALLOWLIST_ADD": "sin"})
    assert alias == lists
    both = {f"{TF}ALLOWLIST_ADD": "sin", "JMP_REWRITE_ALLOWLIST_ADD": " sin "}
    assert lists_from_environment("float16", both)[0] == lists  # the same: fine
    # exp is on the deny list: as in TF, adding it to allow alone is a conflict, not ignored.
    with pytest.raises(ValueError, match="'exp' is on both the allow and the deny list"):
        lists_from_environment("float16", {f"{TF}ALLOWLIST_ADD": "exp"})
    moved = {f"{TF}ALLOWLIST_ADD": "exp", f"{TF}DENYLIST_REMOVE": "exp"}
    assert lists_from_environment("float16", moved)[0].kind("exp") == "allow"


def test_tf_former_list_names_add_to_the_new_ones():
    env = {f"{TF}INFERLIST_ADD": "rsqrt", f"{TF}GRAYLIST_ADD": "square"}
    lists, _ = lists_from_environment("float16", env)
    assert lists.kind("rsqrt") == lists.kind("square") == "infer"


def test_tf_op_names_map_to_the_keys_of_a_jaxpr():
    assert tf_op_keys("MatMul") == ("dot_general",) and tf_op_keys("Rsqrt") == ("rsqrt",)
    assert tf_op_keys("Max") == ("reduce_max",)  # TF's Max reduces; JAX's max is Maximum
    assert tf_op_keys("Maximum") == ("max",) and tf_op_keys("Pow") == ("pow", "integer_pow")
    assert tf_op_keys("exp") is None  # lower case is a key, not a TF name
    lists, _ = lists_from_environment(
        "float16", {f"{TF}INFERLIST_ADD": "Rsqrt, Square", f"{TF}DENYLIST_REMOVE": "Exp"}
    )
    assert lists.kind("rsqrt") == lists.kind("square") == "infer"
    assert lists.kind("exp") == "unlisted"


def test_a_tf_op_without_a_primitive_is_explained():
    with pytest.raises(ValueError, match=f"{TF}DENYLIST_ADD: TF's Softmax has no single op"):
        lists_from_environment("float16", {f"{TF}DENYLIST_ADD": "Softmax"})


def test_an_unknown_op_names_the_variable_and_where_to_look():
    with pytest.raises(ValueError, match=r"'Expp' in .*ALLOWLIST_ADD.*known_op_keys\(\)"):
        lists_from_environment("float16", {f"{TF}ALLOWLIST_ADD": "Expp"})
    assert "exp" in jr.known_op_keys()  # the function the message points to exists


def test_tf_and_our_names_that_disagree_are_an_error_naming_both():
    env = {f"{TF}DENYLIST_ADD": "tanh", "JMP_REWRITE_DENYLIST_ADD": "log"}
    with pytest.raises(ValueError, match=f"{TF}DENYLIST_ADD='tanh' and JMP_REWRITE_DENYLIST_ADD"):
        lists_from_environment("float16", env)
    levels = {f"{TF}LEVEL": "TENSOR_CORES_ONLY", "JMP_REWRITE_LEVEL": "treat_infer_as_deny"}
    with pytest.raises(ValueError, match="disagree"):
        level_from_environment(levels)
    assert level_from_environment({f"{TF}LEVEL": "treat_infer_as_deny"}) == "TREAT_INFER_AS_DENY"


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        (f"{TF}ALOWLIST_ADD", f"{TF}ALLOWLIST_ADD"),
        (f"{TF}DENYLIST_ADDD", f"{TF}DENYLIST_ADD"),
        (f"{TF}LEVL", f"{TF}LEVEL"),
        ("TF_AUTO_MIXED_PRECISION_REWRITE_INFERLIST_ADD", f"{TF}INFERLIST_ADD"),
        ("JMP_REWRITE_ALOWLIST_ADD", "JMP_REWRITE_ALLOWLIST_ADD"),
    ],
)
def test_typos_in_both_families_name_the_closest_variable(typo, meant):
    with pytest.warns(UserWarning, match=f"{typo} is not read .*did you mean {meant}\\?"):
        lists, level = lists_from_environment("float16", {typo: "sin"})
    assert (lists, level) == (FP16, "DEFAULT")


def test_tf_variables_of_no_use_here_say_what_to_do_instead():
    with pytest.warns(UserWarning, match="LOG_PATH is TF's but means nothing here; use jmp"):
        lists_from_environment("float16", {f"{TF}LOG_PATH": "/tmp/amp"})


def test_rewrite_reads_tf_names_from_the_process_environment(monkeypatch):
    monkeypatch.setenv(f"{TF}INFERLIST_REMOVE", "Tanh")
    monkeypatch.setenv(f"{TF}DENYLIST_ADD", "Tanh")
    p = jr.paint(lambda w, x: jnp.tanh(x @ w), jnp.ones((4, 4)), jnp.ones((2, 4)), dtype="float16")
    assert p.colours("tanh") == ["deny"]
    monkeypatch.setenv("JMP_REWRITE_DENYLIST_ADD", "exp")
    with pytest.raises(ValueError, match="disagree"):
        jr.rewrite(lambda x: x @ x, dtype=jnp.float16)(jnp.ones((2, 2)))


def test_a_bad_level_argument_is_reported_as_the_argument():
    with pytest.raises(ValueError, match="level='fastest': unknown level") as exc:
        jr.rewrite(lambda x: x @ x, dtype=jnp.float16, level="fastest")(jnp.ones((2, 2)))
    assert "LEVEL:" not in str(exc.value)  # not blamed on an environment variable
    with pytest.raises(ValueError, match=f"{TF}LEVEL: unknown level 'FASTEST'"):
        lists_from_environment("float16", {f"{TF}LEVEL": "FASTEST"})


def test_the_level_argument_wins_over_the_environment():
    lists, level = lists_from_environment(
        "float16", {f"{TF}LEVEL": "TENSOR_CORES_ONLY"}, level="treat_infer_as_deny"
    )
    assert level == "TREAT_INFER_AS_DENY" and lists.kind("add") == "deny"


def test_valid_names_of_both_families_do_not_warn():
    env = dict.fromkeys((*env_var_names("jmp"), *env_var_names("tf")), "")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lists_from_environment("float16", env) == (FP16, "DEFAULT")
