"""The environment variables that change the lists and the level: TF's names, and ours.

TF reads ``TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_{ALLOWLIST,INFERLIST,DENYLIST,CLEARLIST}_{ADD,
REMOVE}`` (comma-separated op names; the names before TF 2.4, ``..._{WHITELIST,GRAYLIST,
BLACKLIST}_{ADD,REMOVE}``, are applied after the new ones) and
``TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LEVEL``. jmp_rewrite reads the same names, and
``JMP_REWRITE_*`` aliases of them (``JMP_REWRITE_ALLOWLIST_ADD``, ``JMP_REWRITE_LEVEL``, ...):

* values are op keys (JAX primitive names such as ``exp`` or ``dot_general``) or TF op names
  (``Exp``, ``MatMul``, ``Sum``), mapped to the keys that stand for them in a jaxpr
  (:data:`TF_OPS`); a name that is neither is an error that names the variable;
* a list or level set under both names must agree, or it is an error naming both;
* a misspelt variable of either family (``JMP_REWRITE_ALOWLIST_ADD``,
  ``TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_DENYLIST_ADDD``) is ignored with a warning, once per
  name, that names the closest valid one, where TF would ignore it silently; TF's variables
  that jmp_rewrite has no use for (``..._LOG_PATH``, ``..._SIMULATE_GPU``) are ignored with a
  warning that says what to do instead.
"""

from __future__ import annotations

import difflib
import os
import types
import warnings
from collections.abc import Mapping
from typing import Any

from jax.typing import DTypeLike

from jmp_rewrite._src.lists import op_lists as ol

#: The two families of variable names.
JMP_PREFIX = "JMP_REWRITE_"
TF_PREFIX = "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_"
FAMILIES = {"jmp": JMP_PREFIX, "tf": TF_PREFIX}
#: Variable that selects a level, in our family (TF's: ``TF_..._LEVEL``).
ENV_LEVEL = JMP_PREFIX + "LEVEL"
_LEVEL = "LEVEL"
# TF's list names before 2.4, still read by TF after the new ones.
_TF_FORMER_LIST_NAMES = {"WHITELIST": "ALLOWLIST", "GRAYLIST": "INFERLIST", "BLACKLIST": "DENYLIST"}
# TF's other variables: valid for TF, of no use here.
_TF_UNUSED = {
    "LOG_PATH": "use jmp_rewrite.explain(...) (or python -m jmp_rewrite explain) instead",
    "IGNORE_PERFORMANCE": "pass rewrite(..., dtype=jnp.float16) to rewrite on any device",
    "SIMULATE_GPU": "pass rewrite(..., dtype=jnp.float16) to rewrite on any device",
    "EMULATE_FP16": "XLA decides how half precision runs on a CPU",
}
# Start of a name that is meant for us, misspelt further on or not.
_CANDIDATE_STARTS = ("JMP_REWRITE_", "TF_AUTO_MIXED_PRECISION_")

# TF op names -> the op keys standing for them in a jaxpr, where a TF name's lower case is
# not the key already (``Exp`` -> ``exp`` needs no entry) or would be the wrong one (TF's
# ``Max`` is a reduction; JAX's ``max`` is TF's ``Maximum``).
_TF_OPS: dict[str, tuple[str, ...]] = {}
for _keys, _names in (
    (("dot_general",), "MatMul BatchMatMul BatchMatMulV2 BatchMatMulV3 Einsum"),
    (
        ("conv_general_dilated",),
        "Conv2D Conv2DBackpropInput Conv2DBackpropFilter Conv3D Conv3DBackpropInputV2 "
        "Conv3DBackpropFilterV2 DepthwiseConv2dNative DepthwiseConv2dNativeBackpropInput "
        "DepthwiseConv2dNativeBackpropFilter",
    ),
    (("add",), "Add AddV2 BiasAdd BiasAddV1"),
    (("add_any",), "AddN"),
    (("div",), "RealDiv Div"),
    (("reciprocal",), "Inv Reciprocal"),
    (("logistic",), "Sigmoid"),
    (("pow", "integer_pow"), "Pow"),
    (("reduce_sum",), "Sum Mean"),
    (("reduce_prod",), "Prod"),
    (("reduce_max",), "Max"),
    (("reduce_min",), "Min"),
    (("argmax",), "ArgMax"),
    (("argmin",), "ArgMin"),
    (("max",), "Maximum Relu"),
    (("min",), "Minimum"),
    (("reduce_window_sum",), "AvgPool AvgPool3D"),
    (("reduce_window_max",), "MaxPool MaxPoolV2 MaxPool3D"),
    (("select_n",), "Select SelectV2"),
    (("clamp",), "ClipByValue"),
    (("convert_element_type",), "Cast"),
    (("concatenate",), "Concat ConcatV2"),
    (("pad",), "PadV2 MirrorPad"),
    (("gather",), "GatherV2 GatherNd"),
    (("rev",), "Reverse ReverseV2"),
    (("top_k",), "TopK TopKV2"),
    (("jit:log_softmax",), "LogSoftmax"),
    (("jit:softplus",), "Softplus"),
    (("jit:soft_sign",), "Softsign"),
    (("jit:elu",), "Elu"),
    (("jit:selu",), "Selu"),
):
    for _name in _names.split():
        _TF_OPS[_name] = _keys
#: TF op names accepted in the variables, with the op keys they stand for (besides the TF
#: names whose lower case is an op key: ``Exp``, ``Tanh``, ``Rsqrt``, ...).
TF_OPS: Mapping[str, tuple[str, ...]] = types.MappingProxyType(_TF_OPS)
# TF ops with no single JAX counterpart: why, for the error message.
_TF_NO_KEY = {
    "Softmax": "jax.nn.softmax is no primitive but reduce_max, sub, exp, reduce_sum, div",
    "SoftmaxCrossEntropyWithLogits": "optax's cross-entropy is jit:log_softmax, mul, reduce_sum",
    "FusedBatchNorm": "batch norm is reduce_sum, sub, mul, rsqrt, add",
    "FusedBatchNormV3": "batch norm is reduce_sum, sub, mul, rsqrt, add",
}


def env_var_name(kind: str, action: str, family: str = "jmp") -> str:
    """The environment variable for adding to / removing from one list.

    Args:
      kind: one of ``allow``, ``infer``, ``deny``, ``clear``.
      action: ``"ADD"`` or ``"REMOVE"``.
      family: ``"jmp"`` (``JMP_REWRITE_*``) or ``"tf"`` (TF's
        ``TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_*``).

    Returns:
      For example ``"JMP_REWRITE_INFERLIST_ADD"``.

    Raises:
      ValueError: for an unknown list, action or family; the message lists the allowed ones.

    Example:
      >>> env_var_name("deny", "remove")
      'JMP_REWRITE_DENYLIST_REMOVE'
      >>> env_var_name("allow", "add", family="tf")
      'TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_ALLOWLIST_ADD'
    """
    if kind not in ol.KINDS or action.upper() not in ("ADD", "REMOVE") or family not in FAMILIES:
        raise ValueError(
            f"no environment variable for list {kind!r}, action {action!r}, family {family!r}; "
            f"lists: {', '.join(ol.KINDS)}; actions: ADD, REMOVE; families: jmp, tf"
        )
    return f"{FAMILIES[family]}{kind.upper()}LIST_{action.upper()}"


def env_var_names(family: str = "jmp") -> tuple[str, ...]:
    """Every environment variable of one family that jmp_rewrite reads.

    Args:
      family: ``"jmp"`` or ``"tf"`` (which also has TF's names from before 2.4,
        ``..._WHITELIST_ADD`` and so on).

    Returns:
      The ``..._LEVEL`` variable, then the eight ``..._{list}LIST_{ADD,REMOVE}`` names (and,
      for ``"tf"``, the six former ones).

    Raises:
      ValueError: for an unknown family.

    Example:
      >>> len(env_var_names()), env_var_names()[0], len(env_var_names("tf"))
      (9, 'JMP_REWRITE_LEVEL', 15)
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected 'jmp' or 'tf'")
    prefix = FAMILIES[family]
    names = [prefix + _LEVEL]
    names += [env_var_name(kind, a, family) for kind in ol.KINDS for a in ("ADD", "REMOVE")]
    if family == "tf":
        names += [f"{prefix}{old}_{a}" for old in _TF_FORMER_LIST_NAMES for a in ("ADD", "REMOVE")]
    return tuple(names)


def is_ours(name: str) -> bool:
    """Whether an environment variable is, or looks meant to be, one of ours or TF's."""
    return name.upper().startswith(_CANDIDATE_STARTS)


# Misspelled names already warned about: once per name and process, since the environment is
# read on every call of a rewritten function.
_WARNED_ENV_NAMES: set[str] = set()


def warn_unknown_env_vars(env: Mapping[str, str], stacklevel: int = 2) -> None:
    """Warns, once per name, about variables of either family that jmp_rewrite does not read.

    A misspelt variable (``JMP_REWRITE_ALOWLIST_ADD``,
    ``TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_DENYLIST_ADDD``) would otherwise be ignored
    silently. The warning names the closest valid variable of its family. TF's variables that
    jmp_rewrite has no use for get a warning that says what to do instead.

    Args:
      env: the environment to check (e.g. ``os.environ``).
      stacklevel: passed to :func:`warnings.warn`, counted from the caller of this function.
    """
    valid = {*env_var_names("jmp"), *env_var_names("tf")}
    for name in sorted(env):
        if not is_ours(name) or name in valid or name in _WARNED_ENV_NAMES:
            continue
        _WARNED_ENV_NAMES.add(name)
        upper = name.upper()
        if upper.startswith(TF_PREFIX) and upper[len(TF_PREFIX) :] in _TF_UNUSED:
            hint = _TF_UNUSED[upper[len(TF_PREFIX) :]]
            message = f"environment variable {name} is TF's but means nothing here; {hint}"
            warnings.warn(message, stacklevel=stacklevel + 1)
            continue
        family = "tf" if upper.startswith("TF") else "jmp"
        names = env_var_names(family)
        start = _CANDIDATE_STARTS[family == "tf"]
        # Compared without the common start, which would make every name look close.
        suffix = upper[len(start) :]
        if family == "jmp":
            for old, new in _TF_FORMER_LIST_NAMES.items():
                suffix = suffix.replace(old, new)
        close = difflib.get_close_matches(suffix, [n[len(start) :] for n in names], 1, 0.6)
        hint = f"did you mean {start}{close[0]}?" if close else "the variables are "
        hint += "" if close else ", ".join(names)
        warnings.warn(
            f"environment variable {name} is not read by jmp_rewrite and is ignored; {hint}",
            stacklevel=stacklevel + 1,
        )


def tf_op_keys(name: str) -> tuple[str, ...] | None:
    """The op keys a TF op name stands for in a jaxpr, or None for no TF op we know.

    Example:
      >>> tf_op_keys("MatMul"), tf_op_keys("Exp"), tf_op_keys("Max"), tf_op_keys("Nope")
      (('dot_general',), ('exp',), ('reduce_max',), None)
    """
    if name in TF_OPS:
        return TF_OPS[name]
    if name[:1].isupper() and name.lower() in ol.known_op_keys():
        return (name.lower(),)
    return None


def _parse(env: Mapping[str, str], var: str) -> frozenset[str]:
    keys: set[str] = set()
    for item in env.get(var, "").split(","):
        item = item.strip()
        if not item:
            continue
        if ol._is_known(item):
            keys.add(item)
        elif (mapped := tf_op_keys(item)) is not None:
            keys.update(mapped)
        elif item in _TF_NO_KEY:
            raise ValueError(
                f"{var}: TF's {item} has no single op in a jaxpr ({_TF_NO_KEY[item]}); "
                "list those op keys instead"
            )
        else:
            raise ol._unknown_key_error(item, var)
    return frozenset(keys)


def _both(env: Mapping[str, str], suffix: str, parse: Any) -> tuple[Any, str | None]:
    """The value of ``JMP_REWRITE_<suffix>`` / ``TF_..._<suffix>`` (with TF's former names
    added for lists), parsed, and the variable(s) it came from; an error when they differ."""
    ours, tfs = JMP_PREFIX + suffix, TF_PREFIX + suffix
    tf_vars = [v for v in (tfs, *_former(suffix)) if env.get(v, "").strip()]
    tf_value = None
    for v in tf_vars:
        value = parse(env, v)
        tf_value = value if tf_value is None else tf_value | value
    if not env.get(ours, "").strip():
        return tf_value, " and ".join(tf_vars) or None
    our_value = parse(env, ours)
    if tf_value is not None and tf_value != our_value:
        raise ValueError(
            f"{' and '.join(tf_vars)}={env[tf_vars[0]]!r} and {ours}={env[ours]!r} disagree; "
            f"{ours} is an alias of TF's {tfs}: set one of them (or both the same)"
        )
    return our_value, ours


def _former(suffix: str) -> list[str]:
    for old, new in _TF_FORMER_LIST_NAMES.items():
        if suffix.startswith(new):
            return [TF_PREFIX + old + suffix[len(new) :]]
    return []


def _parse_level(env: Mapping[str, str], var: str) -> str:
    try:
        return ol.canonical_level(env.get(var, ""))
    except ValueError as e:
        raise ValueError(f"{var}: {e}") from None


def level_from_environment(env: Mapping[str, str] | None = None) -> str:
    """The level set by ``TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LEVEL`` or
    ``JMP_REWRITE_LEVEL`` (``"DEFAULT"`` when neither is).

    Raises:
      ValueError: for an unknown level (naming the variable), or the two set differently.

    Example:
      >>> level_from_environment(
      ...     {"TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LEVEL": "tensor_cores_only"})
      'TENSOR_CORES_ONLY'
    """
    env = os.environ if env is None else env
    level, _ = _both(env, _LEVEL, _parse_level)
    return level or "DEFAULT"


def lists_from_environment(
    dtype: DTypeLike | None, env: Mapping[str, str] | None = None, *, level: str | None = None
) -> tuple[ol.OpLists, str]:
    """Default lists with TF's environment overrides applied, and the level.

    Reads ``TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_{ALLOWLIST,INFERLIST,DENYLIST,CLEARLIST}_{ADD,
    REMOVE}`` (and TF's former ``WHITELIST``/``GRAYLIST``/``BLACKLIST`` names), their
    ``JMP_REWRITE_*`` aliases (comma-separated op keys or TF op names, spaces ignored) and the
    ``..._LEVEL`` variables, in TF's order:

    1. start from :func:`jmp_rewrite.default_lists`;
    2. ``TENSOR_CORES_ONLY`` (float16) empties infer/deny/clear *before* the overrides, so
       ``*_ADD``/``*_REMOVE`` for those three lists are ignored at that level (TF does the same;
       a warning says so);
    3. for each list, ADD then REMOVE; a REMOVE of a key that is not on that list is ignored
       with a warning, as TF ignores it;
    4. ``TREAT_INFER_AS_DENY`` then merges the (overridden) infer list into deny, as TF merges
       after its list getters ran;
    5. the four lists must be disjoint.

    Misspelt variables of either family are ignored with a warning, once per name, that names
    the closest valid variable.

    Args:
      dtype: the target half-precision dtype (as for :func:`jmp_rewrite.default_lists`).
      env: the variables to read; ``os.environ`` when ``None``.
      level: a level that replaces the environment's (the ``level=`` argument of
        :func:`jmp_rewrite.rewrite`).

    Returns:
      ``(lists, level)`` with ``level`` one of :data:`jmp_rewrite.LEVELS`. The painter handles
      ``UNSAFE_FORCE_ALL`` itself; the lists are unchanged at that level.

    Raises:
      ValueError: for an op name that is neither an op key nor a TF op (naming the variable),
        an unknown level, UNSAFE_FORCE_ALL with bfloat16, a list or level set differently
        under TF's name and ours, or an op that ends on two lists ("conflicting entries",
        naming the op and both lists).

    Example:
      >>> lists, level = lists_from_environment(
      ...     "float16", {"TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_INFERLIST_ADD": "Rsqrt, square"})
      >>> lists.kind("rsqrt"), lists.kind("square"), level
      ('infer', 'infer', 'DEFAULT')
    """
    env = os.environ if env is None else env
    warn_unknown_env_vars(env, stacklevel=2)
    name = ol._canonical_dtype(dtype)
    level = ol.canonical_level(level) if level is not None else level_from_environment(env)
    lists = ol.default_lists(name)
    if level == "UNSAFE_FORCE_ALL":
        ol.apply_level(lists, level, name)  # raises for bfloat16
    tensor_cores_only = level == "TENSOR_CORES_ONLY" and name == "float16"
    if tensor_cores_only:
        lists = ol.apply_level(lists, level, name)

    sets = {kind: set(getattr(lists, kind)) for kind in ol.KINDS}
    for kind in ol.KINDS:
        to_add, add_var = _both(env, f"{kind.upper()}LIST_ADD", _parse)
        to_remove, remove_var = _both(env, f"{kind.upper()}LIST_REMOVE", _parse)
        to_add, to_remove = to_add or frozenset(), to_remove or frozenset()
        if tensor_cores_only and kind != "allow":
            for var, keys in ((add_var, to_add), (remove_var, to_remove)):
                if keys:
                    warnings.warn(
                        f"{var} is ignored: level TENSOR_CORES_ONLY empties the {kind} list "
                        "before overrides are applied (as in TensorFlow)",
                        stacklevel=2,
                    )
            continue
        sets[kind] |= to_add
        for key in sorted(to_remove - sets[kind]):
            warnings.warn(
                f"{remove_var}: {key!r} is not on the {kind} list for {name} "
                f"(it is {ol._where(sets, key)}); ignored",
                stacklevel=2,
            )
        sets[kind] -= to_remove

    try:
        lists = ol.OpLists(**sets)
    except ValueError as e:
        raise ValueError(f"{e} (after applying the *LIST_* environment variables)") from None
    if not tensor_cores_only:
        lists = ol.apply_level(lists, level, name)
    return lists, level
